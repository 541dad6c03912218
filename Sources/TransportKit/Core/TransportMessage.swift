import NIOCore

/// One message with its kind, on a transport whose messages have kinds (WebSocket's text and
/// binary messages). Transports whose messages have no kind (SEQPACKET records, GATT values,
/// `loop://?messages=true`) read every message as `.binary` and send a `.text` one as its bytes.
///
/// ```swift
/// let connection = try await Transport.connect(to: "ws://127.0.0.1:8765/echo")
/// try await connection.writeMessage(.text("{\"cmd\":\"status\"}"))
/// if let reply = try await connection.nextMessage(), reply.kind == .text {
///     print(reply.text ?? "")
/// }
/// ```
public struct TransportMessage: Sendable, Equatable {
    /// What a message's payload is.
    public enum Kind: String, Sendable, Equatable {
        /// Any bytes.
        case binary
        /// UTF-8 text (a WebSocket text message; checked on the way in).
        case text
    }

    /// What the payload is.
    public var kind: Kind
    /// The message's bytes.
    public var payload: ByteBuffer

    /// A message of `kind` carrying `payload`.
    public init(_ kind: Kind, _ payload: ByteBuffer) {
        self.kind = kind
        self.payload = payload
    }

    /// A text message with the UTF-8 bytes of `text`.
    public static func text(_ text: String) -> TransportMessage {
        TransportMessage(.text, ByteBuffer(string: text))
    }

    /// A binary message with `bytes`.
    public static func binary(_ bytes: some Sequence<UInt8>) -> TransportMessage {
        var buffer = ByteBufferAllocator().buffer(capacity: bytes.underestimatedCount)
        buffer.writeBytes(bytes)
        return TransportMessage(.binary, buffer)
    }

    /// The payload's bytes.
    public var bytes: [UInt8] { Array(payload.readableBytesView) }

    /// The payload as text, for a text message; `nil` for a binary one.
    public var text: String? {
        kind == .text ? String(decoding: payload.readableBytesView, as: UTF8.self) : nil
    }
}
