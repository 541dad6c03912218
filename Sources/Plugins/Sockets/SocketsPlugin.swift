// tcp:// and unix:// — stream sockets (connect and listen): tcp:// on sockets of its own
// (TCPSocket.connectStream, listenStream: StreamSocketBackend), unix:// through SwiftNIO.
//
// Grammar:
//   tcp://HOST:PORT[?noDelay=BOOL&keepAlive=BOOL&keepAliveIdle=SECONDS&timeout=SECONDS]
//     HOST is a name (resolved through getaddrinfo, IPv4 and IPv6 raced), an IPv4 address or an IPv6
//     address in brackets.
//   tcp://ADDRESS:PORT[?backlog=N&noDelay=BOOL&keepAlive=BOOL&keepAliveIdle=SECONDS] (listening)
//     ADDRESS is the address to bind and PORT 0 picks a free port; the socket options apply to
//     every accepted connection.
//   unix:///PATH[?timeout=SECONDS]
//   unix:///PATH[?backlog=N&mode=OCTAL] (listening)
//     PATH is the socket file, created with exactly `mode` (default 0600: only this user may
//     connect). A listener replaces a stale socket file (nobody accepting on it) and removes its
//     file when closed, if it is still its own; it refuses with "busy" when another process is
//     listening.
//
// Plugins layered on TCP (TLS, WebSocket) connect through TCPSocket.connect(_:host:port:messages:handlers:),
// which puts their channel handlers in front of the byte handler.

import NIOCore
import NIOPosix
import Synchronization
@_spi(Plugins) import TransportKitCore

/// The `tcp://` and `unix://` schemes.
///
/// ```swift
/// let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
/// let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)?noDelay=true")
/// ```
public struct SocketsPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    /// `TCP_NODELAY`; a plugin over TCP may list it in its own descriptor.
    @_spi(Plugins) public static let noDelay = URLOption.bool("noDelay", default: true, help: "Set TCP_NODELAY: send small writes at once instead of coalescing them")
    /// `SO_KEEPALIVE`.
    @_spi(Plugins) public static let keepAlive = URLOption.bool("keepAlive", default: false, help: "Set SO_KEEPALIVE so a dead peer is noticed on an idle connection")
    /// `TCP_KEEPIDLE` in seconds (the kernel's range).
    @_spi(Plugins) public static let keepAliveIdle = URLOption.duration("keepAliveIdle", seconds: 1...32767,
                                                                        help: "Seconds of idleness before the first keep-alive probe (TCP_KEEPIDLE; implies keepAlive)")
    /// The listen backlog.
    @_spi(Plugins) public static let backlog = URLOption.integer("backlog", in: 1...65535, default: 128, help: "Pending connections the kernel queues before accept")
    /// A unix listener's socket file mode.
    @_spi(Plugins) public static let mode = URLOption.string("mode", default: "0600",
                                                             help: "The socket file's permission bits, in octal: 0600 lets only this user connect, 0660 its group too")

    static let tcpOptions: [any OptionDeclaration] = [noDelay, keepAlive, keepAliveIdle]

    /// The `tcp` and `unix` schemes, both able to listen.
    public var schemes: [Scheme] {
        [
            Scheme(SchemeDescriptor(
                scheme: "tcp",
                summary: "TCP stream socket (IPv4, IPv6, DNS names)",
                grammar: "tcp://HOST:PORT[?OPTIONS]",
                examples: ["tcp://192.168.0.10:35000", "tcp://[::1]:4000?noDelay=false", "tcp://localhost:4000?keepAlive=true",
                           "tcp://127.0.0.1:2000?backlog=16 (listening)"],
                host: .required, port: .required, portRange: 0...65535, path: .forbidden,
                options: Self.tcpOptions + [Self.backlog],
                modes: [SchemeMode("tcp:// connection", form: "tcp://HOST:PORT", options: Self.tcpOptions),
                        SchemeMode("tcp:// listener", role: .listen, form: "tcp://ADDRESS:PORT", options: Self.tcpOptions + [Self.backlog])]
            ), connect: { request in
                try await TCPSocket.connectStream(request, host: request.host, port: request.port)
            }, listen: TCPSocket.listenStream),
            Scheme(SchemeDescriptor(
                scheme: "unix",
                summary: "Unix domain stream socket",
                grammar: "unix:///PATH[?OPTIONS]",
                examples: ["unix:///run/app.sock", "unix:///tmp/device.sock?timeout=2", "unix:///tmp/device.sock?mode=0660 (listening)"],
                host: .forbidden, port: .forbidden, path: .required,
                options: [Self.backlog, Self.mode],
                modes: [SchemeMode("unix:// connection", form: "unix:///PATH", options: []),
                        SchemeMode("unix:// listener", role: .listen, form: "unix:///PATH", options: [Self.backlog, Self.mode])]
            ), check: UnixSocket.check, connect: UnixSocket.connect, listen: UnixSocket.listen),
        ]
    }
}

/// The client side shared by tcp:// and unix://: a bootstrap whose pipeline ends in a
/// ``ChannelBackend``, half-close allowed, and cancellation that closes the sockets of an
/// abandoned attempt. The registry's deadline is the connect's one timer: NIO's own connect
/// timeout is set out of its way.
enum ClientSocket {
    static func connect(
        describing target: String,
        messages: Bool = false,
        messageKinds: Bool = false,
        supportsHalfClose: Bool = true,
        buffering: Buffering,
        configure: @escaping @Sendable (any Channel) throws -> Void = { _ in },
        mapError: (any Error) -> TransportError,
        ready: @escaping @Sendable (ChannelBackend) async throws -> Void = { _ in },
        _ connect: (ClientBootstrap, _ initializer: @escaping @Sendable (any Channel) -> EventLoopFuture<ChannelBackend>) async throws -> ChannelBackend
    ) async throws -> ChannelBackend {
        let pending = PendingChannels()
        let bootstrap = ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .connectTimeout(.hours(24))
            .channelOption(.allowRemoteHalfClosure, value: true)
        do {
            return try await pending.connect {
                let backend = try await connect(bootstrap) { channel in
                    pending.add(channel)
                    return channel.eventLoop.makeCompletedFuture {
                        try configure(channel)
                        return try ChannelBackend.install(on: channel, describing: target, supportsHalfClose: supportsHalfClose, messages: messages,
                                                          messageKinds: messageKinds, buffering: buffering)
                    }
                }
                // The ready step (a handshake) inside the connect: cancelling closes the channel,
                // which ends it; its failure is this connect's error.
                do {
                    try await ready(backend)
                } catch {
                    backend.connectionDropped()
                    throw error
                }
                return backend
            }
        } catch {
            if error is CancellationError || Task.isCancelled { throw CancellationError() }
            throw mapError(error)
        }
    }
}

/// Channels a bootstrap created for one connect attempt (Happy Eyeballs may make several), so a
/// cancelled connect can close them at once instead of leaving a half-open socket to the kernel's
/// SYN retries (about two minutes). NIO's connect futures ignore task cancellation.
final class PendingChannels: Sendable {
    private let state = Locked<(channels: [any Channel], cancelled: Bool)>(([], false))

    /// Records a channel from the bootstrap's initializer; closes it if already cancelled.
    func add(_ channel: any Channel) {
        let cancelled = state.withLock { state in
            state.channels.append(channel)
            return state.cancelled
        }
        if cancelled { channel.close(promise: nil) }
    }

    func cancel() {
        let channels = state.withLock { state in
            state.cancelled = true
            return state.channels
        }
        for channel in channels { channel.close(promise: nil) }
    }

    /// Runs `connect`, closing every channel it created if the task is cancelled meanwhile.
    func connect<Output: Sendable>(_ connect: () async throws -> Output) async throws -> Output {
        try await withTaskCancellationHandler {
            let output = try await connect()
            try Task.checkCancellation()
            return output
        } onCancel: {
            cancel()
        }
    }
}
