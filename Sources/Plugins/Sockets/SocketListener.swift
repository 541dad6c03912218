// listen(2)/accept(2) through SwiftNIO's ServerBootstrap, shared by tcp:// and unix://.
// Accepting is driven by demand: the server channel does not auto-read, and each accept() that
// finds no connection waiting asks for one read of at most one connection, so connections wait in
// the kernel's backlog, never in an unbounded queue here.

import NIOCore
import NIOPosix
import Synchronization
import TransportKitCore

final class SocketListener: ListenerBackend {
    private let state = Mutex(State())
    private let serverBox = Mutex<(any Channel)?>(nil)
    private let onClose: @Sendable () -> Void

    private struct State {
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
                    if let listener {
                        listener.deliver(connection)
                    } else {
                        child.close(promise: nil)
                    }
                }
            }
        let server = try await bind(bootstrap)
        listener.serverBox.withLock { $0 = server }
        server.closeFuture.whenComplete { [weak listener] _ in listener?.serverClosed() }
        return listener
    }

    private func deliver(_ connection: Connection) {
        let waiter = state.withLock { state -> CheckedContinuation<Connection?, any Error>? in
            if let waiter = state.waiter {
                state.waiter = nil
                return waiter
            }
            state.ready.append(connection)
            return nil
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
