// Example 3 of Docs/Plugins.md: a wrapper around any URL. PluginExampleTests checks that the
// document quotes this file verbatim between the markers, and runs the plugin.
// BEGIN EXAMPLE
import NIOCore
@_spi(Plugins) import TransportKitCore

/// crlf+URL writes every "\n" as "\r\n", as modems and ELM327 adapters expect; reads pass
/// untouched. It wraps any URL (crlf+tcp://…, crlf+tty:///dev/ttyUSB0?baud=38400), whose options
/// stay its own. The wrapped connection stays reachable through it: metadata, serialPort and
/// preferredExecutor are the wrapped transport's.
struct CRLFPlugin: TransportPlugin {
    var schemes: [Scheme] {
        [Scheme.wrapper(SchemeDescriptor(
            scheme: "crlf",
            summary: "Writes \\n as \\r\\n (modems, ELM327)",
            grammar: "crlf+URL",
            examples: ["crlf+tcp://192.168.0.10:35000"],
            host: .forbidden, port: .forbidden, path: .forbidden
        )) { request in
            let inner = try await request.connectInner()
            return Connection(url: request.url, backend: CRLFBackend(wrapping: inner))
        }]
    }
}

final class CRLFBackend: WrappingBackend {
    let wrapped: Connection

    init(wrapping connection: Connection) {
        wrapped = connection
    }

    func read() async throws -> ByteBuffer? {
        try await wrapped.readBuffer()
    }

    func write(_ buffer: ByteBuffer) async throws {
        var converted = ByteBuffer()
        converted.reserveCapacity(buffer.readableBytes + 16)
        for byte in buffer.readableBytesView {
            if byte == UInt8(ascii: "\n") { converted.writeInteger(UInt8(ascii: "\r")) }
            converted.writeInteger(byte)
        }
        try await wrapped.write(converted)
    }

    func closeWrite() async throws {
        try await wrapped.closeWrite()
    }

    func close() async throws {
        try await wrapped.close()
    }
}
// END EXAMPLE
