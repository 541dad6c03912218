// tcp:// and unix:// — stream sockets through SwiftNIO (connect and listen).
//
// Grammar:
//   tcp://HOST:PORT[?noDelay=BOOL&keepAlive=BOOL&keepAliveIdle=SECONDS&backlog=N&timeout=SECONDS]
//     HOST is a name (resolved through getaddrinfo, IPv4 and IPv6 raced), an IPv4 address or an IPv6
//     address in brackets. As a listener, HOST is the address to bind and PORT 0 picks a free port.
//   unix:///PATH[?backlog=N&timeout=SECONDS]
//     PATH is the socket file. A listener replaces a stale socket file (nobody accepting on it) and
//     removes its file when closed; it refuses with "busy" when another process is listening.

import NIOCore
import NIOPosix
import Synchronization
import TransportKitCore

/// The `tcp://` and `unix://` schemes.
///
/// ```swift
/// let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
/// let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port!)?noDelay=true")
/// ```
public struct SocketsPlugin: TransportPlugin {
    public init() {}

    public let schemes = [
        SchemeDescriptor(
            scheme: "tcp",
            summary: "TCP stream socket (IPv4, IPv6, DNS names)",
            grammar: "tcp://HOST:PORT[?OPTIONS]",
            examples: ["tcp://192.168.0.10:35000", "tcp://[::1]:4000?noDelay=false", "tcp://localhost:4000?keepAlive=true"],
            host: .required, port: .required, portRange: 0...65535, path: .forbidden,
            options: [
                OptionSpec("noDelay", .bool, default: "true", help: "Set TCP_NODELAY: send small writes at once instead of coalescing them"),
                OptionSpec("keepAlive", .bool, default: "false", help: "Set SO_KEEPALIVE so a dead peer is noticed on an idle connection"),
                OptionSpec("keepAliveIdle", .duration, help: "Seconds of idleness before the first keep-alive probe (TCP_KEEPIDLE; implies keepAlive)"),
                OptionSpec("backlog", .integer(min: 1, max: 65535), default: "128", help: "Listen mode: pending connections the kernel queues"),
            ],
            canListen: true
        ),
        SchemeDescriptor(
            scheme: "unix",
            summary: "Unix domain stream socket",
            grammar: "unix:///PATH[?OPTIONS]",
            examples: ["unix:///run/app.sock", "unix:///tmp/device.sock?timeout=2"],
            host: .forbidden, port: .forbidden, path: .required,
            options: [
                OptionSpec("backlog", .integer(min: 1, max: 65535), default: "128", help: "Listen mode: pending connections the kernel queues"),
            ],
            canListen: true
        ),
    ]

    public func connect(_ request: ConnectRequest) async throws -> Connection {
        switch request.url.scheme {
        case "unix": try await UnixSocket.connect(request)
        default: try await TCPSocket.connect(request)
        }
    }

    public func listen(_ request: ConnectRequest) async throws -> Listener {
        switch request.url.scheme {
        case "unix": try await UnixSocket.listen(request)
        default: try await TCPSocket.listen(request)
        }
    }
}

extension ConnectRequest {
    /// NIO's connect timeout: the `timeout` option, or a day when it is 0 (the kernel's own
    /// SYN retry limit ends a hopeless attempt first).
    var nioConnectTimeout: TimeAmount {
        timeout.map { .nanoseconds(Int64($0.components.seconds) * 1_000_000_000 + $0.components.attoseconds / 1_000_000_000) }
            ?? .hours(24)
    }
}

/// The client side shared by tcp:// and unix://: a bootstrap with a ``ChannelBackend`` in the
/// pipeline, half-close allowed, the request's connect timeout, and cancellation that closes the
/// sockets of an abandoned attempt.
enum ClientSocket {
    static func connect(
        _ request: ConnectRequest,
        describing target: String,
        configure: @escaping @Sendable (any Channel) throws -> Void = { _ in },
        mapError: (any Error) -> TransportError,
        _ connect: (ClientBootstrap) async throws -> any Channel
    ) async throws -> (channel: any Channel, backend: ChannelBackend) {
        let backend = ChannelBackend(describing: target, supportsHalfClose: true)
        let pending = PendingChannels()
        let bootstrap = ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .connectTimeout(request.nioConnectTimeout)
            .channelOption(.allowRemoteHalfClosure, value: true)
            .channelInitializer { channel in
                pending.add(channel)
                return channel.eventLoop.makeCompletedFuture {
                    try configure(channel)
                    try channel.pipeline.syncOperations.addHandler(backend.handler)
                }
            }
        let channel: any Channel
        do {
            channel = try await pending.connect { try await connect(bootstrap) }
        } catch {
            if error is CancellationError || Task.isCancelled { throw CancellationError() }
            throw mapError(error)
        }
        backend.attach(channel)
        return (channel, backend)
    }
}

/// Channels a bootstrap created for one connect attempt (Happy Eyeballs may make several), so a
/// cancelled connect can close them at once instead of leaving a half-open socket to the kernel's
/// SYN retries (about two minutes). NIO's connect futures ignore task cancellation.
final class PendingChannels: Sendable {
    private let state = Mutex<(channels: [any Channel], cancelled: Bool)>(([], false))

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
    func connect(_ connect: () async throws -> any Channel) async throws -> any Channel {
        try await withTaskCancellationHandler {
            let channel = try await connect()
            try Task.checkCancellation()
            return channel
        } onCancel: {
            cancel()
        }
    }
}
