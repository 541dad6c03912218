// TCP stream sockets: socket(7), tcp(7). Connect resolves names with getaddrinfo(3) and races IPv6
// and IPv4 (SwiftNIO's Happy Eyeballs); options map to setsockopt(2).

import Glibc
import NIOCore
import NIOPosix
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// TCP connections, for `tcp://` and for plugins layered on TCP.
@_spi(Plugins)
public enum TCPSocket {
    /// Connects to `host:port` with the tcp:// options of `request` (``SocketsPlugin/noDelay`` and the
    /// keep-alive options, their defaults when the request's scheme does not declare them), within
    /// the request's deadline. `handlers` runs on the event loop before the byte handler is added:
    /// handlers it adds sit in front of it, as TLS or a WebSocket codec would. With `messages`, each
    /// `ByteBuffer` they pass on is one message (`Connection.readMessage(timeout:)`).
    ///
    /// ```swift
    /// // In a plugin's connect handler: a length-prefixed message protocol over TCP.
    /// try await TCPSocket.connect(request, host: request.host, port: request.port, messages: true) { channel in
    ///     try channel.pipeline.syncOperations.addHandler(ByteToMessageHandler(LengthPrefixDecoder()))
    ///     try channel.pipeline.syncOperations.addHandler(MessageToByteHandler(LengthPrefixEncoder()))
    /// }
    /// ```
    public static func connect(_ request: ConnectRequest, host: String, port: Int, messages: Bool = false,
                               handlers: @escaping @Sendable (any Channel) throws -> Void = { _ in }) async throws -> Connection {
        let layer = ProtocolLayer(name: "handlers", messages: messages) { channel in
            try handlers(channel)
            return nil
        }
        return try await connect(request, host: host, port: port, layers: [layer])
    }

    /// Connects to `host:port` with the tcp:// options of `request`, within the request's
    /// deadline, and returns a connection whose reads and writes are system calls on the calling
    /// task's thread (`StreamSocketBackend`): tcp://'s own path, with no SwiftNIO channel and so
    /// no `Connection/preferredExecutor`. Names resolve through getaddrinfo(3), IPv6 and IPv4
    /// raced as RFC 8305 says (HappyEyeballs.swift).
    ///
    /// ```swift
    /// // In a plugin's connect handler: a plain byte stream to the URL's host.
    /// try await TCPSocket.connectStream(request, host: request.host, port: request.port)
    /// ```
    public static func connectStream(_ request: ConnectRequest, host: String, port: Int, name: String? = nil) async throws -> Connection {
        let target = name ?? self.target(host: host, port: port)
        let settings = Settings(request.options)
        let addresses = try await HappyEyeballs.addresses(host: host, port: port)
        let (fd, _) = try await HappyEyeballs.connect(to: addresses, configure: { try settings.apply(to: $0, describing: target) }) { failures in
            connectFailure(failures, target: target, port: port) ?? TransportError(.io, "connecting to \(target) failed: no address to try")
        }
        let backend = StreamSocketBackend(adopting: fd, describing: target, largestRead: request.buffering.readSize)
        return Connection(url: request.url, backend: backend, metadata: StreamSocketBackend.metadata(of: fd, name: target))
    }

    /// Connects to `host:port` and runs `layers` over the TCP channel (the first nearest the
    /// wire), each ready step (a TLS handshake, a WebSocket upgrade) inside the connect and within
    /// the request's deadline: a failed handshake is this call's error. The layers' metadata joins
    /// the connection's `ConnectionMetadata.extra`.
    ///
    /// ```swift
    /// // In a plugin's connect handler: TLS over TCP.
    /// try await TCPSocket.connect(request, host: request.host, port: request.port, layers: [tlsLayer])
    /// ```
    public static func connect(_ request: ConnectRequest, host: String, port: Int, layers: [ProtocolLayer],
                               name: String? = nil) async throws -> Connection {
        let target = target(host: host, port: port)
        let settings = Settings(request.options)
        let steps = ReadySteps()
        let backend = try await ClientSocket.connect(
            describing: name ?? target, messages: layers.last?.messages ?? false,
            messageKinds: layers.last?.messageKinds ?? false, supportsHalfClose: layers.allSatisfy(\.supportsHalfClose),
            buffering: request.buffering,
            configure: { channel in
                try settings.apply(to: channel)
                steps.set(try ProtocolLayer.install(layers, on: channel), for: channel)
            },
            mapError: { mapConnectError($0, host: host, port: port, target: name ?? target) },
            ready: { backend in steps.told(try await ProtocolLayer.awaitReady(steps.take(for: backend.channel), on: backend.channel)) }
        ) { bootstrap, initializer in
            try await bootstrap.connect(host: host, port: port, channelInitializer: initializer)
        }
        var metadata = metadata(of: backend.channel, name: name ?? target)
        metadata.extra.merge(await ProtocolLayer.metadata(of: layers, on: backend.channel)) { _, new in new }
        metadata.extra.merge(steps.facts) { _, new in new }
        return Connection(url: request.url, backend: backend, metadata: metadata)
    }

    /// The ready steps channel initializers made, by channel (Happy Eyeballs may initialize
    /// several), handed to the task that awaits the winner's.
    final class ReadySteps: Sendable {
        private let steps = Locked<[ObjectIdentifier: [ProtocolLayer.ReadyStep]]>([:])
        private let learned = Locked<[String: String]>([:])
        /// What the winning channel's steps told, once ready.
        var facts: [String: String] { learned.withLock { $0 } }
        func told(_ facts: [String: String]) { learned.withLock { $0 = facts } }
        func set(_ value: [ProtocolLayer.ReadyStep], for channel: any Channel) {
            steps.withLock { $0[ObjectIdentifier(channel)] = value }
        }
        func take(for channel: any Channel) -> [ProtocolLayer.ReadyStep] {
            steps.withLock { steps in
                defer { steps = [:] }
                return steps[ObjectIdentifier(channel)] ?? []
            }
        }
    }

    /// The socket options of a tcp:// URL, read once (a listener applies them to every connection
    /// it accepts, long after its URL was read).
    struct Settings: Sendable {
        var noDelay: Bool
        var keepAlive: Bool
        var keepAliveIdle: Duration?

        init(_ options: OptionValues) {
            noDelay = options[SocketsPlugin.noDelay]
            keepAlive = options[SocketsPlugin.keepAlive]
            keepAliveIdle = options[SocketsPlugin.keepAliveIdle]
        }

        /// setsockopt(2) on a socket of our own: TCP_NODELAY, SO_KEEPALIVE, TCP_KEEPIDLE.
        func apply(to fd: SystemPackage.FileDescriptor, describing: String) throws {
            var value: Int32 = noDelay ? 1 : 0
            let size = socklen_t(MemoryLayout<Int32>.size)
            _ = try Syscall.run("setsockopt(TCP_NODELAY)", on: describing) { setsockopt(fd.rawValue, Int32(IPPROTO_TCP), TCP_NODELAY, &value, size) }
            if keepAlive || keepAliveIdle != nil {
                value = 1
                _ = try Syscall.run("setsockopt(SO_KEEPALIVE)", on: describing) { setsockopt(fd.rawValue, SOL_SOCKET, SO_KEEPALIVE, &value, size) }
            }
            if let keepAliveIdle {
                // The option's range (1…32767 s, the kernel's) keeps the conversion exact.
                value = Int32(keepAliveIdle.components.seconds)
                _ = try Syscall.run("setsockopt(TCP_KEEPIDLE)", on: describing) { setsockopt(fd.rawValue, Int32(IPPROTO_TCP), TCP_KEEPIDLE, &value, size) }
            }
        }

        /// setsockopt(2): TCP_NODELAY, SO_KEEPALIVE, TCP_KEEPIDLE. On the channel's event loop.
        func apply(to channel: any Channel) throws {
            guard let sync = channel.syncOptions else {
                throw TransportError(.unsupported, "cannot set the socket options of \(channel): it offers no synchronous options")
            }
            // .tcpOption, not .socketOption: the latter would set option 1 at SOL_SOCKET (SO_DEBUG).
            try sync.setOption(.tcpOption(.tcp_nodelay), value: noDelay ? 1 : 0)
            if keepAlive || keepAliveIdle != nil {
                try sync.setOption(.socketOption(.so_keepalive), value: 1)
            }
            if let keepAliveIdle {
                // The option's range (1…32767 s, the kernel's) keeps the conversion exact.
                let option = ChannelOptions.Types.SocketOption(level: .tcp, name: NIOBSDSocket.Option(rawValue: TCP_KEEPIDLE))
                try sync.setOption(option, value: SocketOptionValue(keepAliveIdle.components.seconds))
            }
        }
    }

    static func metadata(of channel: any Channel, name: String) -> ConnectionMetadata {
        ConnectionMetadata(name: name, localAddress: channel.localAddress?.description,
                           remoteAddress: channel.remoteAddress?.description)
    }

    static func mapConnectError(_ error: any Error, host: String, port: Int, target: String) -> TransportError {
        if let error = error as? NIOConnectionError {
            if error.connectionErrors.isEmpty, error.dnsAError != nil || error.dnsAAAAError != nil {
                return TransportError(.notFound, "cannot resolve the host '\(TransportError.printable(host))': check the name, or use an IP address")
            }
            let failures = error.connectionErrors.map { TransportError.from($0.error, context: "connecting to \($0.target)", syscall: "connect") }
            if let failure = connectFailure(failures, target: target, port: port) { return failure }
        }
        return TransportError.from(error, context: "connecting to \(target)", syscall: "connect")
    }

    /// What a connect whose every attempt failed says: a refusal in any of them means nobody
    /// listens there; otherwise the first attempt's error. `nil` when there was no attempt.
    static func connectFailure(_ failures: [TransportError], target: String, port: Int) -> TransportError? {
        if let refused = failures.first(where: { $0.kind == .refused }) {
            return TransportError(.refused, "\(target) refused the connection: is the server running and listening on port \(port)?",
                                  errno: refused.errno, syscall: "connect")
        }
        return failures.first
    }

    /// `tcp://HOST:PORT` as errors and metadata name a connection or listener: an IPv6 host in
    /// brackets, a name as it may be printed.
    static func target(host: String, port: Int) -> String {
        "tcp://\(host.contains(":") ? "[\(host)]" : TransportError.printable(host)):\(port)"
    }

    @Sendable static func listen(_ request: ConnectRequest) async throws -> Listener {
        try await listen(request, layers: [])
    }

    /// Listens on the request's `HOST:PORT` with the tcp:// listener options (backlog, socket
    /// options: their defaults when the scheme does not declare them) and runs `layers` over every
    /// accepted connection. A connection is handed out once its layers are ready; a client that
    /// fails its handshake, or does not finish it within `handshakeTimeout`, is closed and never
    /// seen by `accept()`, and does not hold up the clients behind it. Accepted connections' URLs
    /// use `peerScheme`; `authenticated` says that the layers make every client prove who it is
    /// (TLS with required client certificates), for `ListenerExposure`.
    ///
    /// ```swift
    /// // In a plugin's listen handler:
    /// try await TCPSocket.listen(request, layers: [tlsServerLayer], peerScheme: "tls")
    /// ```
    public static func listen(_ request: ConnectRequest, layers: [ProtocolLayer], handshakeTimeout: Duration = .seconds(10),
                              peerScheme: String = "tcp", authenticated: Bool = false, caution: String? = nil) async throws -> Listener {
        let host = request.host
        let port = request.port
        let settings = Settings(request.options)
        let listener = try await SocketListener.bind(
            backlog: request[SocketsPlugin.backlog],
            buffering: request.buffering,
            layers: layers, handshakeTimeout: handshakeTimeout, logger: request.logger,
            configure: { channel in try settings.apply(to: channel) },
            describePeer: { channel in "\(peerScheme)://\(channel.remoteAddress.map(hostPort) ?? "?")" },
            bind: { bootstrap in
                do {
                    return try await bootstrap.bind(host: host, port: port).get()
                } catch let error where error is SocketAddressError || error is SocketAddressError.UnknownHost {
                    // NIO resolves the host with getaddrinfo(3) and reports a name it cannot
                    // resolve (or a literal it cannot parse) this way.
                    throw unknownListenHost(host)
                } catch {
                    throw bindFailure(TransportError.from(error, context: "listening on \(host):\(port)", syscall: "bind"), host: host, port: port)
                }
            }
        )
        var url = request.url
        url.port = listener.boundPort ?? port
        var exposure = exposure(of: listener.localAddress, host: host, port: url.port ?? port)
        exposure.authenticated = authenticated
        exposure.caution = caution
        return Listener(url: url, backend: listener, exposure: exposure)
    }

    /// Listens on the request's `HOST:PORT` with the tcp:// listener options and hands out
    /// connections whose reads and writes are system calls on the calling task's thread
    /// (`StreamSocketBackend`, as ``connectStream(_:host:port:name:)`` makes): tcp://'s own
    /// listener. A name resolves through getaddrinfo(3); the first address is bound.
    ///
    /// ```swift
    /// // In a plugin's listen handler: plain TCP connections.
    /// try await TCPSocket.listenStream(request)
    /// ```
    @Sendable public static func listenStream(_ request: ConnectRequest) async throws -> Listener {
        let host = request.host
        let port = request.port
        let settings = Settings(request.options)
        let address: SocketAddress
        do {
            guard let first = try await HappyEyeballs.addresses(host: host, port: port).first else { throw unknownListenHost(host) }
            address = first
        } catch let error as TransportError where error.syscall == "getaddrinfo" {
            throw unknownListenHost(host)
        }
        let describing = target(host: host, port: port)
        let listener = try StreamListener.bind(address, backlog: request[SocketsPlugin.backlog], largestRead: request.buffering.readSize,
                                               configure: { try settings.apply(to: $0, describing: describing) }) { errno, call in
            bindFailure(StreamSocketBackend.failure(errno, call, context: "listening on \(host):\(port)"), host: host, port: port)
        }
        var url = request.url
        url.port = listener.localAddress?.port ?? port
        return Listener(url: url, backend: listener, exposure: exposure(of: listener.localAddress, host: host, port: url.port ?? port))
    }

    /// The error for a listening address that is not one: a name that does not resolve, or a
    /// literal that does not parse.
    static func unknownListenHost(_ host: String) -> TransportError {
        TransportError(.notFound, "cannot listen on '\(TransportError.printable(host))': it is not an address of this machine or a name that resolves to one. Use an IP address such as 0.0.0.0 (every interface) or 127.0.0.1 (this machine only)",
                       syscall: "getaddrinfo")
    }

    /// What a failed bind (or socket, listen) says: a port in use names its holder, an address not
    /// this machine's and a privileged port say what to choose instead.
    static func bindFailure(_ mapped: TransportError, host: String, port: Int) -> TransportError {
        switch mapped.errno {
        case .addressInUse?:
            TransportError(.busy, "port \(port) on \(host) is in use\(portHolder(port).map { " by \($0)" } ?? ""); stop that program or choose another port (port 0 picks a free one)",
                           errno: mapped.errno, syscall: "bind")
        case .addressNotAvailable?:
            TransportError(.notFound, "\(host) is not an address of this machine; use one of its addresses, 0.0.0.0 for all of them",
                           errno: mapped.errno, syscall: "bind")
        case .permissionDenied?:
            TransportError(.permissionDenied, "ports below 1024 need root or CAP_NET_BIND_SERVICE; choose port 1024 or above",
                           errno: mapped.errno, syscall: "bind")
        default:
            mapped
        }
    }

    /// A loopback address reaches this machine only; any other, the network. No tcp:// listener
    /// asks a peer who it is.
    static func exposure(of address: SocketAddress?, host: String, port: Int) -> ListenerExposure {
        let ip = address?.ipAddress ?? host
        let loopback = ip.hasPrefix("127.") || ip == "::1" || ip.hasPrefix("::ffff:127.")
        return loopback
            ? ListenerExposure(reach: .thisMachine, authenticated: false, who: "every program of this machine (loopback, port \(port))")
            : ListenerExposure(reach: .network, authenticated: false, who: "any machine that can reach \(host) port \(port)")
    }

    /// Who listens on a tcp port: the socket inode from /proc/net/tcp and tcp6 (proc(5); state 0A
    /// is LISTEN), then the process holding it.
    static func portHolder(_ port: Int) -> String? {
        for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
            guard let text = DeviceNode.readText(table, limit: 64 << 20) else { continue }
            for line in text.split(separator: "\n").dropFirst() {
                let fields = line.split(separator: " ", omittingEmptySubsequences: true)
                guard fields.count > 9, fields[3] == "0A",
                      let local = fields[1].split(separator: ":").last, Int(local, radix: 16) == port else { continue }
                let inode = fields[9]
                if let holder = DeviceNode.describeHolders(matching: { $0 == "socket:[\(inode)]" }) { return holder }
            }
        }
        return nil
    }

    static func hostPort(_ address: SocketAddress) -> String {
        let ip = address.ipAddress ?? "?"
        let host = ip.contains(":") ? "[\(ip)]" : ip
        return "\(host):\(address.port ?? 0)"
    }
}
