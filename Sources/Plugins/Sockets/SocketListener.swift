// listen(2)/accept(2) through SwiftNIO's ServerBootstrap, shared by tcp:// and unix://.
// Accepting is driven by demand: the server channel does not auto-read, and each accept() that
// finds no connection waiting asks for one read of at most one connection, so connections wait in
// the kernel's backlog, never in an unbounded queue here.
//
// A connection is handed out only when its channel reaches the server pipeline: NIO runs the child
// initializer first and then closes the child if the server channel closed meanwhile, so handing
// it out from the initializer would let `listener.close()` right after `accept()` kill it.

import Logging
import NIOCore
import NIOPosix
@_spi(Plugins) import TransportKitCore

final class SocketListener: ListenerBackend {
    private let server: any Channel
    /// Shared with the server's pipeline, which stages and delivers accepted connections.
    private let accepted: AsyncCondition<Accepted>
    private let onClose: @Sendable () -> Void

    struct Accepted: Sendable {
        /// The server channel, once bound.
        var server: (any Channel)?
        /// accept() calls under way, counted before their read of the server socket: the
        /// connection that read brings in sees them, even when the calling task has not parked
        /// yet (a waiter count would miss it, and a silent client's handshake would then leave
        /// the next client unread until its timeout).
        var accepting = 0
        /// Connections whose child initializer ran, by channel, until NIO passes them on, with
        /// their layers' ready steps.
        var staged: [ObjectIdentifier: (connection: Connection, steps: [ProtocolLayer.ReadyStep])] = [:]
        /// Accepted channels whose layers' handshakes are under way; closed with the listener.
        var handshaking: [ObjectIdentifier: any Channel] = [:]
        /// Bounded without a limit of its own: the server socket is read only for a waiting
        /// accept() (with nothing ready) or a free handshake slot (`handshakeLimit`).
        var ready: [Connection] = []
        var closed = false
        var closeCalled = false
    }

    private init(server: any Channel, accepted: AsyncCondition<Accepted>, onClose: @escaping @Sendable () -> Void) {
        self.server = server
        self.accepted = accepted
        self.onClose = onClose
    }

    var boundPort: Int? { server.localAddress?.port }
    var localAddress: SocketAddress? { server.localAddress }

    /// At most this many accepted connections run their handshakes at once; more wait in the
    /// kernel's backlog.
    static let handshakeLimit = 64

    static func bind(
        backlog: Int,
        buffering: Buffering,
        layers: [ProtocolLayer] = [],
        handshakeTimeout: Duration = .seconds(10),
        logger: Logger? = nil,
        configure: @escaping @Sendable (any Channel) throws -> Void,
        describePeer: @escaping @Sendable (any Channel) -> String,
        bind: (ServerBootstrap) async throws -> any Channel,
        onClose: @escaping @Sendable () -> Void = {}
    ) async throws -> SocketListener {
        let accepted = AsyncCondition(Accepted())
        let bootstrap = ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .serverChannelOption(.backlog, value: Int32(backlog))
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .serverChannelOption(.autoRead, value: false)
            .serverChannelOption(.maxMessagesPerRead, value: 1)
            .childChannelOption(.allowRemoteHalfClosure, value: true)
            .childChannelInitializer { child in
                child.eventLoop.makeCompletedFuture {
                    do {
                        try configure(child)
                        let peer = describePeer(child)
                        let steps = try ProtocolLayer.install(layers, on: child)
                        let backend = try ChannelBackend.install(on: child, describing: peer, supportsHalfClose: layers.allSatisfy(\.supportsHalfClose),
                                                                 messages: layers.last?.messages ?? false,
                                                                 messageKinds: layers.last?.messageKinds ?? false, buffering: buffering)
                        let url = (try? TransportURL(peer)) ?? TransportURL(scheme: "unix")
                        let connection = Connection(url: url, backend: backend,
                                                    metadata: ConnectionMetadata(name: peer, localAddress: child.localAddress?.description,
                                                                                 remoteAddress: child.remoteAddress?.description))
                        stage(connection, steps: steps, for: child, in: accepted)
                    } catch {
                        // NIO closes this child; the read that accepted it is spent, so a waiting
                        // accept() asks for the next connection.
                        readMore(accepted)
                        throw error
                    }
                }
            }
        let server = try await bind(bootstrap)
        // Appended after bind so it sits behind NIO's AcceptHandler; nothing is accepted before
        // the first accept() because the server channel does not auto-read.
        do {
            try await server.pipeline.addHandler(AcceptedChannelHandler { child in
                take(child, from: accepted, layers: layers, handshakeTimeout: handshakeTimeout, logger: logger)
            }).get()
        } catch {
            try? await server.close()
            throw error
        }
        accepted.withLock { $0.server = server }
        server.closeFuture.whenComplete { _ in accepted.update { $0.closed = true; $0.server = nil } }
        return SocketListener(server: server, accepted: accepted, onClose: onClose)
    }

    private static func stage(_ connection: Connection, steps: [ProtocolLayer.ReadyStep], for child: any Channel,
                              in accepted: AsyncCondition<Accepted>) {
        let key = ObjectIdentifier(child)
        accepted.withLock { $0.staged[key] = (connection, steps) }
        // A child that NIO closes before passing it on must not stay staged.
        child.closeFuture.whenComplete { _ in
            _ = accepted.withLock { $0.staged.removeValue(forKey: key) }
        }
    }

    /// Unstages `child`'s connection (from then on NIO closing the child cannot lose it) and
    /// returns the step that makes it ready for accept(), or closes it if the listener closed.
    private static func take(_ child: any Channel, from accepted: AsyncCondition<Accepted>, layers: [ProtocolLayer],
                             handshakeTimeout: Duration, logger: Logger?) -> @Sendable () -> Void {
        guard let (connection, steps) = accepted.withLock({ $0.staged.removeValue(forKey: ObjectIdentifier(child)) }) else {
            return {
                child.close(promise: nil)
                // The read that accepted it is spent: a waiting accept() asks for the next one.
                readMore(accepted)
            }
        }
        if !steps.isEmpty {
            return { handshake(connection, steps: steps, child: child, in: accepted, layers: layers, timeout: handshakeTimeout, logger: logger) }
        }
        return {
            let refused = accepted.update { state -> Bool in
                if state.closed { return true }
                state.ready.append(connection)
                return false
            }
            if refused { startCleanup { try? await connection.close() } }
        }
    }

    /// Runs an accepted connection's handshakes off the accept path: a slow or silent client
    /// holds neither accept() nor the clients behind it. It is handed out once ready; one that
    /// fails or takes longer than `timeout` is closed, and a waiting accept() asks for the next.
    private static func handshake(_ connection: Connection, steps: [ProtocolLayer.ReadyStep], child: any Channel,
                                  in accepted: AsyncCondition<Accepted>, layers: [ProtocolLayer], timeout: Duration, logger: Logger?) {
        let key = ObjectIdentifier(child)
        let (refused, more) = accepted.update { state -> (Bool, Bool) in
            if state.closed { return (true, false) }
            state.handshaking[key] = child
            return (false, state.handshaking.count < handshakeLimit)
        }
        if refused {
            connection.abort()
            return
        }
        // Another client may be waiting behind this one.
        if more { readMore(accepted) }
        Task {
            do {
                let told = try await withTimeout(timeout, TransportError(.timedOut, "the client did not finish the handshake within \(timeout.secondsText)")) {
                    try await ProtocolLayer.awaitReady(steps, on: child)
                }
                var extra = await ProtocolLayer.metadata(of: layers, on: child)
                extra.merge(told) { _, new in new }
                connection.updateMetadata { $0.extra.merge(extra) { _, new in new } }
                let refused = accepted.update { state -> Bool in
                    state.handshaking[key] = nil
                    if state.closed { return true }
                    state.ready.append(connection)
                    return false
                }
                if refused { try? await connection.close() }
            } catch {
                logger?.debug("a client's handshake failed", metadata: ["peer": "\(connection.url)", "error": "\(error)"])
                accepted.update { $0.handshaking[key] = nil }
                connection.abort()
                readMore(accepted)
            }
        }
    }

    /// Reads the next connection from the server socket when an accept() is under way.
    private static func readMore(_ accepted: AsyncCondition<Accepted>) {
        accepted.withLock { $0.accepting > 0 ? $0.server : nil }?.read()
    }

    func accept() async throws -> Connection? {
        // Demand-driven: one read of at most one connection per accept that finds none waiting.
        let mustRead = accepted.withLock { state -> Bool in
            state.accepting += 1
            return state.ready.isEmpty && !state.closed
        }
        defer { accepted.withLock { $0.accepting -= 1 } }
        if mustRead { server.read() }
        return try await accepted.wait { state -> Connection?? in
            if !state.ready.isEmpty { return .some(state.ready.removeFirst()) }
            return state.closed ? .some(nil) : nil
        }
    }

    func close() async throws {
        let (first, pending, handshaking) = accepted.update { state -> (Bool, [Connection], [any Channel]) in
            defer { state.closed = true; state.closeCalled = true; state.ready = []; state.handshaking = [:] }
            return (!state.closeCalled, state.ready, Array(state.handshaking.values))
        }
        for connection in pending { try? await connection.close() }
        for channel in handshaking { channel.close(promise: nil) }
        try? await server.close().get()
        if first { onClose() }
    }

    deinit {
        server.close(promise: nil)
    }
}

/// Sits in the server channel's pipeline and receives each accepted child channel once NIO has
/// finished setting it up, and passes the event on: NIO registers the child with its event loop
/// only when the event reaches the end of the server pipeline.
private final class AcceptedChannelHandler: ChannelInboundHandler, Sendable {
    typealias InboundIn = any Channel
    typealias InboundOut = any Channel
    /// Unstages the child's connection and returns what hands it to accept().
    private let take: @Sendable (any Channel) -> @Sendable () -> Void

    init(_ take: @escaping @Sendable (any Channel) -> @Sendable () -> Void) { self.take = take }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        // Taken before the child is passed on: passing it on schedules its registration on its
        // event loop, after which a peer that already hung up (a unix client that sent and closed
        // at once) can close the child on another thread and unstage it. Handed to accept() only
        // after: by then the registration is queued ahead of anything accept()'s caller does
        // with the connection (a write, a close).
        let child = Self.unwrapInboundIn(data)
        let handOver = take(child)
        context.fireChannelRead(data)
        handOver()
    }
}
