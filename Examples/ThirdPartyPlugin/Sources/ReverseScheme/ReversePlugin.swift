// reverse:// — answers every write with its bytes reversed. A third-party plugin built on the
// TransportKitCore product alone: its answers go through the SDK's InboundQueue (bounded, one
// reader, end after the bytes) and its writers wait at a WriterGate while the answers pile up.
//
// Grammar:  reverse://[?limit=BYTES]
//   limit  answers kept for the reader before writers wait (default 4096)

import NIOCore
@_spi(Plugins) import TransportKitCore

/// The `reverse://` scheme.
///
/// ```swift
/// let registry = try TransportRegistry(plugins: [ReversePlugin()])
/// try await registry.withConnection(to: "reverse://") { connection in
///     try await connection.write("stressed")
///     print(String(decoding: try await connection.read() ?? [], as: UTF8.self))   // "desserts"
/// }
/// ```
public struct ReversePlugin: TransportPlugin {
    public init() {}

    /// How many answer bytes may wait for the reader.
    static let limit = URLOption.integer("limit", in: 1...(1 << 20), default: 4096,
                                         help: "Answer bytes kept for the reader before writers wait")

    public var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(
            scheme: "reverse",
            summary: "Answers every write with its bytes reversed",
            grammar: "reverse://[?limit=BYTES]",
            examples: ["reverse://", "reverse://?limit=64"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [Self.limit]
        )) { request in
            Connection(url: request.url, backend: ReverseBackend(limit: request[Self.limit]),
                       metadata: ConnectionMetadata(name: "reverse"))
        }]
    }
}

final class ReverseBackend: ConnectionBackend {
    let supportsHalfClose = true
    private let answers: InboundQueue
    private let writers: WriterGate

    init(limit: Int) {
        let writers = WriterGate()
        self.writers = writers
        // Writers are let go as soon as the reader made room.
        self.answers = InboundQueue(watermarks: .init(low: limit, high: limit)) { writers.signal() }
    }

    func read() async throws -> ByteBuffer? {
        try await answers.next()
    }

    func write(_ buffer: ByteBuffer) async throws {
        let limit = answers.watermarks.high
        try await writers.wait { [answers] in answers.bufferedBytes < limit }
        answers.append(ByteBuffer(bytes: buffer.readableBytesView.reversed()))
    }

    func closeWrite() async throws {
        answers.finish()
    }

    func close() async throws {
        answers.finish()
        writers.fail(TransportError(.disconnected, "the reverse:// connection is closed"))
    }
}
