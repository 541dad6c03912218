// listen(2)/accept(2) through SwiftNIO's ServerBootstrap, shared by tcp:// and unix://.
// Accepting is driven by demand: the server channel does not auto-read, and each accept() that
// finds no connection waiting asks for one read of at most one connection, so connections wait in
// the kernel's backlog, never in an unbounded queue here.
//
// A connection is handed out only when its channel reaches the server pipeline: NIO runs the child
// initializer first and then closes the child if the server channel closed meanwhile, so handing
// it out from the initializer would let `listener.close()` right after `accept()` kill it.

import NIOCore
import NIOPosix
import Synchronization
import TransportKitCore

final class SocketListener: ListenerBackend {
    private let state = Mutex(State())
    private let serverBox = Mutex<(any Channel)?>(nil)
    private let onClose: @Sendable () -> Void

    private struct State {
        /// Connections whose child initializer ran, by channel, until NIO passes them on.
        var staged: [ObjectIdentifier: Connection] = [:]
        var ready: [Connection] = []
        var waiter: CheckedContinuation<Connection?, any Error>?
        var closed = false
        var closeCalled = false
    }

    private init(onClose: @escaping @Sendable () -> Void) {
        self.onClose = onClose
    }

    var boundPort: Int? { serverBox.withLock { $0?.localAddress?.port } }

    static func bind(
        backlog: Int,
        configure: @escaping @Sendable (any Channel) throws -> Void,
        describePeer: @escaping @Sendable (any Channel) -> String,
        bind: (ServerBootstrap) async throws -> any Channel,
        onClose: @escaping @Sendable () -> Void = {}
    ) async throws -> SocketListener {
        let listener = SocketListener(onClose: onClose)
        let bootstrap = ServerBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .serverChannelOption(.backlog, value: Int32(backlog))
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .serverChannelOption(.autoRead, value: false)
            .serverChannelOption(.maxMessagesPerRead, value: 1)
            .childChannelOption(.allowRemoteHalfClosure, value: true)
            .childChannelInitializer { [weak listener] child in
                child.eventLoop.makeCompletedFuture {
                    try configure(child)
                    let peer = describePeer(child)
                    let backend = ChannelBackend(describing: peer, supportsHalfClose: true)
                    try child.pipeline.syncOperations.addHandler(backend.handler)
                    backend.attach(child)
                    let url = (try? TransportURL(peer)) ?? TransportURL(scheme: "unix")
                    let connection = Connection(url: url, backend: backend,
                                                metadata: ConnectionMetadata(name: peer, localAddress: child.localAddress?.description,
                                                                             remoteAddress: child.remoteAddress?.description))
                    guard let listener else { throw ChannelError.ioOnClosedChannel }
                    listener.stage(connection, for: child)
                }
            }
        let server = try await bind(bootstrap)
        // Appended after bind so it sits behind NIO's AcceptHandler; nothing is accepted before
        // the first accept() because the server channel does not auto-read.
        try await server.pipeline.addHandler(AcceptedChannelHandler { [weak listener] child in
            if let listener {
                listener.deliver(child)
            } else {
                child.close(promise: nil)
            }
        }).get()
        listener.serverBox.withLock { $0 = server }
        server.closeFuture.whenComplete { [weak listener] _ in listener?.serverClosed() }
        return listener
    }

    private func stage(_ connection: Connection, for child: any Channel) {
        let key = ObjectIdentifier(child)
        state.withLock { $0.staged[key] = connection }
        // A child that NIO closes before passing it on must not stay staged.
        child.closeFuture.whenComplete { [weak self] _ in
            _ = self?.state.withLock { $0.staged.removeValue(forKey: key) }
        }
    }

    private func deliver(_ child: any Channel) {
        let (connection, waiter) = state.withLock { state -> (Connection?, CheckedContinuation<Connection?, any Error>?) in
            guard let connection = state.staged.removeValue(forKey: ObjectIdentifier(child)) else { return (nil, nil) }
            if let waiter = state.waiter {
                state.waiter = nil
                return (connection, waiter)
            }
            state.ready.append(connection)
            return (connection, nil)
        }
        guard let connection else {
            child.close(promise: nil)
            return
        }
        if let waiter {
            waiter.resume(returning: connection)
        } else if isClosed {
            Task { try? await connection.close() }
        }
    }

    private var isClosed: Bool { state.withLock { $0.closed } }

    private func serverClosed() {
        let waiter = state.withLock { state in
            state.closed = true
            defer { state.waiter = nil }
            return state.waiter
        }
        waiter?.resume(returning: nil)
    }

    func accept() async throws -> Connection? {
        let server = serverBox.withLock { $0 }
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Connection?, any Error>) in
                let ready = state.withLock { state -> Result<Connection?, any Error>? in
                    if !state.ready.isEmpty { return .success(state.ready.removeFirst()) }
                    if state.closed { return .success(nil) }
                    if Task.isCancelled { return .failure(CancellationError()) }
                    state.waiter = continuation
                    return nil
                }
                if let ready {
                    continuation.resume(with: ready)
                } else {
                    server?.read()
                }
            }
        } onCancel: {
            state.withLock { state in
                defer { state.waiter = nil }
                return state.waiter
            }?.resume(throwing: CancellationError())
        }
    }

    func close() async throws {
        let (first, pending) = state.withLock { state -> (Bool, [Connection]) in
            defer { state.closed = true; state.closeCalled = true; state.ready = [] }
            return (!state.closeCalled, state.ready)
        }
        for connection in pending { try? await connection.close() }
        if let server = serverBox.withLock({ $0 }) {
            try? await server.close().get()
        }
        if first { onClose() }
        serverClosed()
    }

    deinit {
        serverBox.withLock { $0 }?.close(promise: nil)
    }
}

/// Sits in the server channel's pipeline and receives each accepted child channel once NIO has
/// finished setting it up. It passes the event on: NIO registers the child with its event loop
/// only when the event reaches the end of the server pipeline.
private final class AcceptedChannelHandler: ChannelInboundHandler, Sendable {
    typealias InboundIn = any Channel
    typealias InboundOut = any Channel
    private let accepted: @Sendable (any Channel) -> Void

    init(_ accepted: @escaping @Sendable (any Channel) -> Void) { self.accepted = accepted }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let child = Self.unwrapInboundIn(data)
        context.fireChannelRead(data)
        accepted(child)
    }
}
