import NIOCore
import Synchronization

/// The ready step of a connection whose protocol has a handshake (TLS, the WebSocket upgrade, a
/// telnet negotiation): a handler that completes a future when the protocol says it is ready, and
/// fails it with the first error, or when the channel closes before that.
///
/// Plugins add it right behind the protocol's handler and wait for ``future`` inside `connect`
/// (`TCPSocket`'s `ready:` step does, in TransportKitSockets), so the handshake counts against the connect's one
/// deadline and its failure is the connect's error, never a surprise on the first read.
///
/// ```swift
/// let ready = ChannelReady(on: channel) { event in
///     guard case TLSUserEvent.handshakeCompleted(let alpn) = event else { return nil }
///     return ["tls.alpn": alpn ?? ""]   // ready, with what the handshake told
/// }
/// try channel.pipeline.syncOperations.addHandler(ready)
/// try await ready.future.get()
/// ```
@_spi(Plugins)
public final class ChannelReady: ChannelInboundHandler, RemovableChannelHandler, Sendable {
    /// Anything: the step passes reads on untouched.
    public typealias InboundIn = NIOAny
    /// What came in, unchanged.
    public typealias InboundOut = NIOAny

    private let promise: EventLoopPromise<Void>
    private let isReady: @Sendable (Any) -> [String: String]?
    private let learned = Locked<[String: String]>([:])

    /// What the event that made the step ready told (a negotiated protocol), for metadata.
    public var facts: [String: String] { learned.withLock { $0 } }

    /// Completed when the protocol is ready; failed with the first error the pipeline reports, or
    /// ``TransportError/Kind/disconnected`` when the channel closes first.
    public var future: EventLoopFuture<Void> { promise.futureResult }

    /// A ready step for `channel` that completes when `isReady` returns facts (possibly none) for
    /// a user inbound event; `nil` means not yet.
    public init(on channel: any Channel, readyWhen isReady: @escaping @Sendable (Any) -> [String: String]?) {
        self.promise = channel.eventLoop.makePromise()
        self.isReady = isReady
    }

    /// Passes the read on to the next handler.
    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        context.fireChannelRead(data)
    }

    /// Completes ``future`` when `readyWhen` returns facts for `event`, then passes the event on.
    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let facts = isReady(event) {
            learned.withLock { $0 = facts }
            promise.succeed()
        }
        context.fireUserInboundEventTriggered(event)
    }

    /// Fails ``future`` with `error` (if it is not complete yet) and passes the error on.
    public func errorCaught(context: ChannelHandlerContext, error: any Error) {
        promise.fail(error)
        context.fireErrorCaught(error)
    }

    /// Fails ``future`` with ``TransportError/Kind/disconnected`` if the channel closed before it was ready.
    public func channelInactive(context: ChannelHandlerContext) {
        promise.fail(TransportError(.disconnected, "the peer closed the connection during the handshake"))
        context.fireChannelInactive()
    }

    /// Fails ``future`` with ``TransportError/Kind/disconnected`` if the step is removed before it was ready.
    public func handlerRemoved(context: ChannelHandlerContext) {
        promise.fail(TransportError(.disconnected, "the handshake's ready step was removed before it finished"))
    }
}
