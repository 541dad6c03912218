// ws:// and wss://: WebSocket clients and listeners, each message a message; http:// and https://:
// a streamed request, the writes its body and the reads the response's.
//
// Grammar:
//   ws://HOST[:PORT][/PATH][?OPTIONS&SERVER-QUERY]      (port 80; wss:// 443, over TLS)
//     Query items that are not options below go to the server unchanged; server.NAME=V sends
//     NAME=V when NAME is also an option here.
//   ws://ADDRESS:PORT[/PATH]?[OPTIONS] (listening: a connection per client that upgrades on PATH;
//     wss:// needs cert= and key=)
//   http://HOST[:PORT][/PATH][?method=POST&contentType=T&length=N&idleTimeout=S&…&SERVER-QUERY]
//     (port 80; https:// 443 over TLS)

import FoundationEssentials
import NIOCore
import NIOHTTP1
import NIOWebSocket
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
@_spi(Plugins) import TransportKitSockets
@_spi(Plugins) import TransportKitTLS
import TransportKitWebSocket

/// The `ws`, `wss`, `http` and `https` schemes.
///
/// ```swift
/// let connection = try await Transport.connect(to: "wss://example.com/feed?token=abc&subprotocols=json.v1")
/// try await connection.writeMessage(.text("{\"subscribe\":\"ticks\"}"))
/// while let message = try await connection.nextMessage() { print(message.text ?? "\(message.payload.readableBytes) bytes") }
/// ```
public struct WebPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    /// Subprotocols: offered by a client, preferred first; spoken by a listener.
    @_spi(Plugins) public static let subprotocols = URLOption.string("subprotocols", help: "WebSocket subprotocols, comma-separated: offered in this order (a listener: the ones it speaks)")
    /// The Origin header a client sends.
    @_spi(Plugins) public static let origin = URLOption.string("origin", help: "The Origin header to send, such as https://example.com")
    /// The Authorization header a client sends.
    @_spi(Plugins) public static let authorization = URLOption.string("authorization", help: "The Authorization header to send, such as 'Bearer TOKEN' (it appears in logs of the URL: prefer a file-free secret store where you can)")
    /// The Cookie header a client sends.
    @_spi(Plugins) public static let cookie = URLOption.string("cookie", help: "The Cookie header to send, such as session=abc")
    /// Origins a listener lets in.
    @_spi(Plugins) public static let origins = URLOption.string("origins", help: "Origins allowed to connect, comma-separated (a browser page on any other site is refused with 403); default: any")
    /// The largest message taken from the peer.
    @_spi(Plugins) public static let maxMessageSize = URLOption.integer("maxMessageSize", in: 125...(1 << 30), default: 1 << 20,
                                                                        help: "The largest message taken from the peer, in bytes; a larger one closes the connection with 1009")
    /// How often a keepalive ping goes out.
    @_spi(Plugins) public static let pingInterval = URLOption.timeLimit("pingInterval", seconds: 0...86400, default: 20,
                                                                        help: "Seconds between keepalive pings; 0: none")
    /// How long a ping may go unanswered.
    @_spi(Plugins) public static let pingTimeout = URLOption.timeLimit("pingTimeout", seconds: 0...86400, default: 20,
                                                                       help: "Seconds a keepalive ping may go unanswered before the peer counts as gone; 0: wait forever")
    /// How long a close waits for the peer's close frame.
    @_spi(Plugins) public static let closeTimeout = URLOption.duration("closeTimeout", seconds: 0.01...300, default: 10,
                                                                       help: "Seconds a close waits for the peer's close frame")
    /// permessage-deflate offered (client) or accepted (listener).
    @_spi(Plugins) public static let compression = URLOption.bool("compression", default: true,
                                                                  help: "Compress messages with permessage-deflate (RFC 7692) when the other side agrees; a listener accepts a client's offer")
    /// How long an accepted client may take to upgrade.
    @_spi(Plugins) public static let handshakeTimeout = URLOption.duration("handshakeTimeout", seconds: 0.1...300, default: 10,
                                                                           help: "Seconds an accepted client has to finish its upgrade (and TLS handshake) before it is dropped")

    static let session: [any OptionDeclaration] = [maxMessageSize, pingInterval, pingTimeout, closeTimeout, compression]
    static let tcp: [any OptionDeclaration] = [SocketsPlugin.noDelay, SocketsPlugin.keepAlive, SocketsPlugin.keepAliveIdle]
    static let clientOptions: [any OptionDeclaration] = [subprotocols, origin, authorization, cookie] + session + tcp
    static let serverOptions: [any OptionDeclaration] = [subprotocols, origins, handshakeTimeout, SocketsPlugin.backlog] + session + tcp

    /// The request's method.
    @_spi(Plugins) public static let method = URLOption.string("method", default: "POST", help: "The request's method: POST (default), PUT or another token")
    /// The body's media type.
    @_spi(Plugins) public static let contentType = URLOption.string("contentType", default: "application/octet-stream", help: "The Content-Type of the body")
    /// The body's length, when known.
    @_spi(Plugins) public static let length = URLOption.integer("length", in: 0...(1 << 53), help: "The body's length in bytes, sent as Content-Length (write exactly that many); without it the body is chunked")
    /// The longest pause either way.
    @_spi(Plugins) public static let idleTimeout = URLOption.timeLimit("idleTimeout", seconds: 0...86400, default: 120,
                                                                       help: "Seconds the request may go without a byte either way before it fails; 0: no limit")
    /// A limit on the whole request, only when asked for.
    @_spi(Plugins) public static let requestTimeout = URLOption.timeLimit("requestTimeout", seconds: 0...31_536_000, default: 0,
                                                                          help: "Seconds the whole request may take, body and answer; 0 (default): no limit, for a stream that runs as long as its source")

    static let requestOptions: [any OptionDeclaration] = [method, contentType, length, idleTimeout, requestTimeout, authorization, cookie] + tcp

    /// `ws` and `wss` (connect and listen), `http` and `https` (connect).
    public var schemes: [Scheme] {
        [webSocket(secure: false), webSocket(secure: true), request(secure: false), request(secure: true)]
    }

    private func request(secure: Bool) -> Scheme {
        let name = secure ? "https" : "http"
        let options = Self.requestOptions + (secure ? TLSPlugin.clientLayerOptions : [])
        var descriptor = SchemeDescriptor(
            scheme: name,
            summary: "A streamed HTTP request: writes are the body, reads the response's" + (secure ? " (over TLS)" : ""),
            grammar: "\(name)://HOST[:PORT][/PATH][?OPTIONS&SERVER-QUERY]",
            examples: ["\(name)://example.com/ingest", "\(name)://127.0.0.1:8080/upload?method=PUT&contentType=text/plain"],
            host: .required, port: .optional, portRange: 0...65535, path: .optional,
            options: options,
            modes: [SchemeMode("\(name):// request", form: "\(name)://HOST[:PORT][/PATH]", options: options)]
        )
        descriptor.serverQuery = true
        return Scheme(descriptor, connect: { try await Self.connectRequest($0, secure: secure) })
    }

    @Sendable static func connectRequest(_ request: ConnectRequest, secure: Bool) async throws -> Connection {
        let host = request.host
        let port = request.url.port ?? (secure ? 443 : 80)
        let bracketed = host.contains(":") ? "[\(host)]" : host
        let authority = port == (secure ? 443 : 80) ? bracketed : "\(bracketed):\(port)"
        let methodName = request[method]
        guard !methodName.isEmpty, methodName.utf8.allSatisfy({ (0x41...0x5A).contains($0) || $0 == 0x2D }) else {
            throw TransportError(.invalidURL, "\(request.url.shown): method=\(TransportError.printable(methodName)) is not an HTTP method; write it in capitals, such as POST or PUT")
        }
        let target = request.url.requestTarget(query: request.serverQuery)
        let describing = "\(methodName) \(secure ? "https" : "http")://\(authority)\(request.url.path.isEmpty ? "/" : request.url.path)"
        let headers = [("Content-Type", try checkedHeader(request[contentType], request))] + (try credentialHeaders(request))
        let plan = HTTPRequestPlan(method: HTTPMethod(rawValue: methodName), target: target, host: authority, headers: headers,
                                   length: request[length], idleTimeout: request[idleTimeout],
                                   requestTimeout: request[requestTimeout], describing: describing)
        let facts = ResponseFacts()
        var layers: [ProtocolLayer] = []
        if secure { layers.append(try TLSPlugin.clientLayer(for: request, host: host, alpn: ["http/1.1"])) }
        layers.append(ProtocolLayer(name: "http", mapError: { TransportError.from($0, context: "sending the request head to \(describing)") }) { channel in
            let sent = channel.eventLoop.makePromise(of: Void.self)
            try channel.pipeline.syncOperations.addHandlers([
                HTTPRequestEncoder(), ByteToMessageHandler(HTTPResponseDecoder(leftOverBytesStrategy: .dropBytes)),
                HTTPUploadHandler(plan: plan, facts: facts, sent: sent),
            ])
            return sent.futureResult
        })
        let connection = try await TCPSocket.connect(request, host: host, port: port, layers: layers, name: describing)
        facts.attach(connection)
        return connection
    }

    private func webSocket(secure: Bool) -> Scheme {
        let name = secure ? "wss" : "ws"
        let client = Self.clientOptions + (secure ? TLSPlugin.clientLayerOptions : [])
        let server = Self.serverOptions + (secure ? TLSPlugin.serverLayerOptions : [])
        var all: [any OptionDeclaration] = []
        for option in client + server where !all.contains(where: { $0.spec.name == option.spec.name }) { all.append(option) }
        var descriptor = SchemeDescriptor(
            scheme: name,
            summary: secure ? "WebSocket over TLS: messages, text or binary (RFC 6455)" : "WebSocket: messages, text or binary (RFC 6455)",
            grammar: "\(name)://HOST[:PORT][/PATH][?OPTIONS&SERVER-QUERY]",
            examples: secure
                ? ["wss://example.com/feed?token=abc", "wss://0.0.0.0:8443/tty?cert=cert.pem&key=key.pem (listening)"]
                : ["ws://127.0.0.1:8765/", "ws://0.0.0.0:8080/tty?origins=http://localhost:8000 (listening)"],
            host: .required, port: .optional, portRange: 0...65535, path: .optional,
            options: all,
            modes: [SchemeMode("\(name):// connection", form: "\(name)://HOST[:PORT][/PATH]", options: client),
                    SchemeMode("\(name):// listener", role: .listen, form: "\(name)://ADDRESS:PORT[/PATH]", options: server)]
        )
        descriptor.serverQuery = true
        return Scheme(descriptor, connect: { try await Self.connect($0, secure: secure) }, listen: { try await Self.listen($0, secure: secure) })
    }

    /// Authorization and Cookie from the URL, checked.
    static func credentialHeaders(_ request: ConnectRequest) throws -> [(String, String)] {
        var headers: [(String, String)] = []
        if let authorization = request[authorization] { headers.append(("Authorization", try checkedHeader(authorization, request))) }
        if let cookie = request[cookie] { headers.append(("Cookie", try checkedHeader(cookie, request))) }
        return headers
    }

    /// `value`, unless it holds a line break or NUL: those would end the header and start
    /// another that the URL's author did not write (header injection).
    static func checkedHeader(_ value: String, _ request: ConnectRequest) throws -> String {
        guard !value.utf8.contains(where: { $0 == 0x0D || $0 == 0x0A || $0 == 0 }) else {
            throw TransportError(.invalidURL, "\(request.url.shown): a header value holds a line break or NUL, which would end the header early")
        }
        return value
    }

    static func configuration(_ request: ConnectRequest, role: WebSocketConfiguration.Role, describing: String) -> WebSocketConfiguration {
        WebSocketConfiguration(role: role, maxMessageSize: request[maxMessageSize], pingInterval: request[pingInterval],
                               pingTimeout: request[pingTimeout], closeTimeout: request[closeTimeout], describing: describing)
    }

    static func list(_ text: String?) -> [String] {
        (text ?? "").split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty }
    }

    @Sendable static func connect(_ request: ConnectRequest, secure: Bool) async throws -> Connection {
        let host = request.host
        let port = request.url.port ?? (secure ? 443 : 80)
        let bracketed = host.contains(":") ? "[\(host)]" : host
        let authority = port == (secure ? 443 : 80) ? bracketed : "\(bracketed):\(port)"
        let target = request.url.requestTarget(query: request.serverQuery)
        let describing = "\(secure ? "wss" : "ws")://\(authority)\(request.url.path.isEmpty ? "/" : request.url.path)"
        var headers: [(String, String)] = []
        if let origin = request[origin] { headers.append(("Origin", try checkedHeader(origin, request))) }
        headers += try credentialHeaders(request)
        let upgrade = WebSocketClientHandshake.Request(target: target, host: authority, subprotocols: list(request[subprotocols]), headers: headers,
                                                         compression: request[compression])
        let configuration = configuration(request, role: .client, describing: describing)
        var layers: [ProtocolLayer] = []
        if secure { layers.append(try TLSPlugin.clientLayer(for: request, host: host, alpn: ["http/1.1"])) }
        layers.append(ProtocolLayer(name: "ws", messageKinds: true, supportsHalfClose: false, metadata: metadata,
                                    mapError: { mapError($0, describing) }) { channel in
            let webSocket = WebSocketHandler(configuration)
            return try WebSocketClientHandshake.install(on: channel, request: upgrade, webSocket: webSocket).progress.promise.futureResult
        })
        return try await TCPSocket.connect(request, host: host, port: port, layers: layers, name: describing)
    }

    @Sendable static func listen(_ request: ConnectRequest, secure: Bool) async throws -> Listener {
        if let item = request.serverQuery.first {
            throw TransportError(.invalidURL, "\(request.url.shown): '\(TransportError.printable(item.name))' is not an option of a \(secure ? "wss" : "ws"):// listener, and a listener has no server to pass it to")
        }
        guard request.url.port != nil else {
            throw TransportError(.invalidURL, "\(request.url.shown): a listener needs a port (0 picks a free one)")
        }
        let policy = WebSocketServerHandshake.Policy(path: request.url.path, subprotocols: list(request[subprotocols]), origins: list(request[origins]),
                                                     compression: request[compression])
        var layers: [ProtocolLayer] = []
        var authenticated = false
        if secure {
            let tls = try TLSPlugin.serverLayer(for: request)
            layers.append(tls.layer)
            authenticated = tls.authenticated
        }
        let configuration = configuration(request, role: .server, describing: "a \(secure ? "wss" : "ws") client")
        layers.append(ProtocolLayer(name: "ws", messageKinds: true, supportsHalfClose: false, metadata: metadata) { channel in
            let webSocket = WebSocketHandler(configuration)
            return try WebSocketServerHandshake.install(on: channel, policy: policy, webSocket: webSocket).progress.promise.futureResult
        })
        // Browsers let any page open a WebSocket to any address: without origins=, a page on any
        // site, in a browser on a machine that reaches the port, is a client like any other.
        let caution = policy.origins.isEmpty
            ? "any web page open in a browser that can reach it can connect (a WebSocket is not bound by the same-origin rule); origins= names the pages that may"
            : nil
        return try await TCPSocket.listen(request, layers: layers, handshakeTimeout: request[handshakeTimeout],
                                          peerScheme: secure ? "wss" : "ws", authenticated: authenticated, caution: caution)
    }

    @Sendable static func metadata(_ channel: any Channel) -> [String: String] {
        (try? channel.pipeline.syncOperations.handler(type: WebSocketHandler.self))?.facts ?? [:]
    }

    static func mapError(_ error: any Error, _ describing: String) -> TransportError {
        TransportError.from(error, context: "the WebSocket upgrade to \(describing)")
    }
}
