// rfc2217:// — a serial port on another machine, through RFC 2217 (Telnet COM-PORT-OPTION), as
// ser2net, pyserial's PortManager and console servers serve them.
//
// Grammar:
//   rfc2217://HOST:PORT[?baud=…&dataBits=…&parity=…&stopBits=…&flowControl=…&dtr=…&rts=…
//                       &answerTimeout=SECONDS&ignoreSetControl=BOOL]
//   tls+rfc2217://HOST:PORT[?…&tls.ca=…]     RFC 2217 over TLS (the tls+ wrapper runs TLS beneath)
// The line settings are applied at connect, each confirmed by the server; `connection.serialPort`
// controls the remote port at run time as a local one's. See Docs/Schemes.md.

import NIOCore
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitSockets

/// The `rfc2217` scheme: a serial port served on the network (RFC 2217).
///
/// ```swift
/// let board = try await Transport.connect(to: "rfc2217://rack-pi:4001?baud=115200")
/// try await board.serialPort?.setDTR(false)    // reset it, as on a local port
/// try await board.serialPort?.setDTR(true)
/// ```
public struct RFC2217Plugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    static let answerTimeout = URLOption.duration("answerTimeout", seconds: 0.1...60, default: 3,
                                                  help: "How long each setting waits for the server's answer (3 s, as pyserial)")
    static let ignoreSetControl = URLOption.bool("ignoreSetControl", default: false,
                                                 help: "Do not wait for answers to DTR, RTS, BREAK and flow control (pyserial's ign_set_control), for servers that never send them")

    static var options: [any OptionDeclaration] {
        SerialLineOptions.settings + [SerialLineOptions.dtr, SerialLineOptions.rts, answerTimeout, ignoreSetControl,
                                      SocketsPlugin.noDelay, SocketsPlugin.keepAlive, SocketsPlugin.keepAliveIdle]
    }

    /// `rfc2217`.
    public var schemes: [Scheme] {
        var descriptor = SchemeDescriptor(
            scheme: "rfc2217",
            summary: "Serial port on another machine (RFC 2217: ser2net, pyserial, console servers); line settings and modem lines as on a local port",
            grammar: "rfc2217://HOST:PORT[?OPTIONS]",
            examples: ["rfc2217://rack-pi:4001?baud=115200", "rfc2217://127.0.0.1:3333?ignoreSetControl=true",
                       "tls+rfc2217://rack-pi:4443?baud=9600&tls.ca=/etc/lab/ca.pem"],
            host: .required, port: .required, portRange: 0...65535, path: .forbidden,
            options: Self.options + [SocketsPlugin.backlog],
            modes: [SchemeMode("rfc2217:// connection", form: "rfc2217://HOST:PORT", options: Self.options),
                    SchemeMode("rfc2217:// listener", role: .listen, form: "rfc2217://ADDRESS:PORT", options: Self.listenOptions)])
        descriptor.layersBeneath = true
        descriptor.reachesDevice = true
        return [Scheme(descriptor, connect: Self.connect, listen: Self.listen)]
    }

    static var listenOptions: [any OptionDeclaration] {
        [SocketsPlugin.noDelay, SocketsPlugin.keepAlive, SocketsPlugin.keepAliveIdle, SocketsPlugin.backlog]
    }

    /// An RFC 2217 server: each accepted connection carries a client's bytes, and its
    /// `rfc2217Session` the client's COM-PORT requests for whoever serves them with a port.
    @Sendable static func listen(_ request: ConnectRequest) async throws -> Listener {
        let layer = ProtocolLayer(name: "rfc2217") { channel in
            let handler = RFC2217ServerHandler()
            try channel.pipeline.syncOperations.addHandler(handler)
            RFC2217Session.register(RFC2217Session(handler: handler, eventLoop: channel.eventLoop, signature: "TransportKit"), for: channel)
            return nil
        }
        return try await TCPSocket.listen(request, layers: request.layersBeneath + [layer], peerScheme: "rfc2217")
    }

    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let host = request.host
        let describing = "rfc2217://\(host.contains(":") ? "[\(host)]" : host):\(request.port)"
        let options = RFC2217ClientOptions(
            settings: try request.serialSettings(),
            dtr: request[SerialLineOptions.dtr], rts: request[SerialLineOptions.rts],
            answerTimeout: .milliseconds(request[answerTimeout].wholeMilliseconds),
            answerTimeoutText: request[answerTimeout].secondsText,
            ignoreSetControl: request[ignoreSetControl], describing: describing)
        let handlers = RFC2217Handlers()
        let layer = ProtocolLayer(name: "rfc2217", metadata: { channel in
            (try? channel.pipeline.syncOperations.handler(type: RFC2217ClientHandler.self).facts) ?? [:]
        }, mapError: { TransportError.from($0, context: "\(describing): RFC 2217 negotiation") }) { channel in
            let handler = RFC2217ClientHandler(options: options)
            try channel.pipeline.syncOperations.addHandler(handler)
            handlers.add(handler, on: channel)
            return handler.readyFuture(on: channel.eventLoop)
        }
        let tcp = try await TCPSocket.connect(request, host: host, port: request.port, layers: request.layersBeneath + [layer], name: describing)
        guard let channel = tcp.backend(as: ChannelBackend.self)?.channel, let handler = handlers.take(for: channel) else {
            try? await tcp.close()
            throw TransportError.misuse("\(describing): the TCP connection has no RFC 2217 handler")
        }
        return Connection(url: request.url, backend: RFC2217Backend(wrapping: tcp, channel: channel, handler: handler, describing: describing))
    }
}
