import NIOCore

/// A protocol that runs as SwiftNIO channel handlers in front of a connection's byte handler: TLS,
/// a WebSocket codec, a telnet negotiation. The same layer runs over a TCP channel directly
/// (`TCPSocket.connect(_:host:port:layers:)`, `TCPSocket.listen(_:layers:)`) and over any other
/// ``Connection`` (`ConnectionLayering.layer(_:over:request:)`), so `tls+tty://…` and
/// `tls://HOST:PORT` share one implementation.
///
/// ```swift
/// let reverse = ProtocolLayer(name: "reverse") { channel in
///     try channel.pipeline.syncOperations.addHandler(ReverseHandler())
///     return nil   // no handshake: ready at once
/// }
/// let connection = try await TCPSocket.connect(request, host: request.host, port: request.port, layers: [reverse])
/// ```
@_spi(Plugins)
public struct ProtocolLayer: Sendable {
    /// Names the layer in messages: `"tls"`, `"ws"`.
    public var name: String
    /// `true` when the handlers pass whole messages on (each inbound `ByteBuffer` one message, each
    /// outbound one too). The outermost layer decides for the connection.
    public var messages: Bool
    /// `true` when the handlers pass ``TransportMessage`` values (kind and payload) both ways
    /// rather than `ByteBuffer`s: WebSocket's text and binary messages. Implies ``messages``.
    public var messageKinds: Bool
    /// `false` when the protocol has no half-close (WebSocket: its close frame ends both ways, and
    /// a peer may drop what it had not sent yet); the connection's `closeWrite()` is then
    /// unsupported. Any layer without it makes the whole connection so.
    public var supportsHalfClose: Bool
    /// Adds the handlers to the channel, on its event loop, in front of the byte handler; returns
    /// the future of the layer's ready step (its handshake), or `nil` when it is ready at once.
    public var install: @Sendable (any Channel) throws -> EventLoopFuture<Void>?
    /// What the layer knows once ready, as ``ConnectionMetadata/extra`` entries (the TLS version,
    /// the WebSocket subprotocol). Runs on the channel's event loop.
    public var metadata: @Sendable (any Channel) -> [String: String]
    /// Turns a failure of the ready step into an error that says what to do.
    public var mapError: @Sendable (any Error) -> TransportError

    /// A layer named `name`; see the properties.
    public init(name: String, messages: Bool = false, messageKinds: Bool = false, supportsHalfClose: Bool = true,
                metadata: @escaping @Sendable (any Channel) -> [String: String] = { _ in [:] },
                mapError: @escaping @Sendable (any Error) -> TransportError = { TransportError.from($0, context: "the handshake") },
                install: @escaping @Sendable (any Channel) throws -> EventLoopFuture<Void>?) {
        self.name = name
        self.messages = messages || messageKinds
        self.messageKinds = messageKinds
        self.supportsHalfClose = supportsHalfClose
        self.install = install
        self.metadata = metadata
        self.mapError = mapError
    }

    /// A layer's ready step: its handshake's future, which yields the layer's ``metadata`` as it
    /// stood the moment the step completed.
    public typealias ReadyStep = (layer: ProtocolLayer, ready: EventLoopFuture<[String: String]>)

    /// Installs `layers` in order (the first is nearest the wire) and returns their ready steps.
    /// Each step reads its layer's metadata as it completes, on the event loop, before anything
    /// that came after the handshake runs: a peer that sends its first message and closes at once
    /// does not take the handshake's facts (a subprotocol, an extension) with it.
    public static func install(_ layers: [ProtocolLayer], on channel: any Channel) throws -> [ReadyStep] {
        try layers.compactMap { layer in
            try layer.install(channel).map { future in (layer, future.map { layer.metadata(channel) }) }
        }
    }

    /// Waits for each ready step in order (the wire's first), maps the first failure with its
    /// layer's ``mapError``, and returns what the steps told (``metadata`` entries). Cancelling the
    /// waiting task closes `channel`, which ends the steps.
    @discardableResult
    public static func awaitReady(_ steps: [ReadyStep], on channel: any Channel) async throws -> [String: String] {
        try await withTaskCancellationHandler {
            var facts: [String: String] = [:]
            for (layer, future) in steps {
                do {
                    facts.merge(try await future.get()) { _, new in new }
                } catch {
                    if Task.isCancelled { throw CancellationError() }
                    throw layer.mapError(error)
                }
            }
            return facts
        } onCancel: {
            channel.close(promise: nil)
        }
    }

    /// The metadata entries of every layer, read on the channel's event loop.
    public static func metadata(of layers: [ProtocolLayer], on channel: any Channel) async -> [String: String] {
        (try? await channel.eventLoop.submit {
            layers.reduce(into: [String: String]()) { extra, layer in extra.merge(layer.metadata(channel)) { _, new in new } }
        }.get()) ?? [:]
    }
}
