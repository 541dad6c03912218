// The example of Docs/Plugins.md. PluginExampleTests checks that the document quotes this file
// verbatim between the markers, and runs the plugin.
// BEGIN EXAMPLE
import NIOCore
import TransportKit

/// echo://[?uppercase=BOOL] answers every write with the same bytes.
struct EchoPlugin: TransportPlugin {
    let schemes = [
        SchemeDescriptor(
            scheme: "echo",
            summary: "Answers every write with the same bytes",
            grammar: "echo://[?uppercase=BOOL]",
            examples: ["echo://", "echo://?uppercase=true"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [OptionSpec("uppercase", .bool, default: "false", help: "Answer in upper case")]
        ),
    ]

    func connect(_ request: ConnectRequest) async throws -> Connection {
        // The registry already validated the URL: options are typed and defaults filled in.
        let uppercase = request.options.bool("uppercase") ?? false
        // Reuse the in-memory loop for buffering and backpressure.
        let loop = try await Transport.connect(to: "loop://?buffer=65536")
        return Connection(url: request.url, backend: EchoBackend(loop: loop, uppercase: uppercase),
                          metadata: ConnectionMetadata(name: "echo"))
    }
}

/// Carries the bytes: what was written comes back, transformed.
final class EchoBackend: ConnectionBackend {
    let loop: Connection
    let uppercase: Bool
    let supportsHalfClose = true

    init(loop: Connection, uppercase: Bool) {
        self.loop = loop
        self.uppercase = uppercase
    }

    func read() async throws -> ByteBuffer? { try await loop.readBuffer() }

    func write(_ buffer: ByteBuffer) async throws {
        let bytes = Array(buffer.readableBytesView)
        try await loop.write(uppercase ? Array(String(decoding: bytes, as: UTF8.self).uppercased().utf8) : bytes)
    }

    func closeWrite() async throws { try await loop.closeWrite() }
    func close() async throws { try await loop.close() }
}
// END EXAMPLE
