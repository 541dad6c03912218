// spy+URL — wraps any URL and traces what passes: every read, write, half-close and close, and
// every serial control call (line settings, modem lines, break, flush, drain) with a timestamp,
// like pyserial's spy://. The wrapped URL keeps its own options; spy's carry the "spy." prefix.
//
// Grammar:  spy+URL[?spy.format=hex|raw&spy.direction=both|rx|tx&spy.file=PATH]
//   spy+tcp://127.0.0.1:4000
//   spy+tty:///dev/ttyUSB0?baud=115200&spy.file=/tmp/trace.txt
//   spy+spy+… is allowed but pointless.
// Output (standard error unless spy.file is given; the file is created or truncated):
//   hex  one line per event, seconds since open, a label, the detail; data as a hex + ASCII dump,
//        16 bytes a line:
//            0.000412 TX    0000  68 65 6c 6c 6f 0a                                 |hello.|
//            0.001733 RX    0000  68 65 6c 6c 6f 0a                                 |hello.|
//            0.002010 CTRL  DTR on
//            0.002015 CTRL  DTR on → ok
//            0.003100 EOF
//   raw  the data bytes only, as they pass (both directions, or one with spy.direction), to
//        capture a stream into a file.
// The wrapped connection stays reachable: metadata, preferredExecutor and connection.serialPort
// work through spy, and `transportkit connect spy+…` keeps standard output byte-exact.

import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// The `spy+URL` wrapper.
///
/// ```swift
/// let port = try await Transport.connect(to: "spy+tty:///dev/ttyUSB0?baud=115200&spy.file=/tmp/trace.txt")
/// try port.serialPort?.setDTR(true)          // traced: "CTRL  DTR on"
/// try await port.write("AT\r")               // traced: "TX    0000  41 54 0d …"
/// ```
public struct SpyPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    /// How the trace is written.
    public enum Format: String, CaseIterable, Sendable {
        /// Timestamped lines; data as a hex + ASCII dump.
        case hex
        /// Data bytes only, as they pass.
        case raw
    }

    /// Which data is traced.
    public enum Direction: String, CaseIterable, Sendable {
        /// What is sent and what is received.
        case both
        /// What is received only.
        case rx
        /// What is sent only.
        case tx
    }

    static let format = URLOption.choice("format", default: Format.hex, help: "hex: timestamped hex + ASCII dump of every event; raw: the data bytes only")
    static let direction = URLOption.choice("direction", default: Direction.both, help: "Trace data in both directions, or only received (rx) or sent (tx)")
    static let file = URLOption.string("file", help: "Write the trace to this file (created or truncated) instead of standard error")

    /// The `spy` wrapper scheme.
    public var schemes: [Scheme] {
        [Scheme.wrapper(SchemeDescriptor(
            scheme: "spy",
            summary: "Wraps any URL and traces reads, writes, closes and serial control calls (hex dump or raw)",
            grammar: "spy+URL[?spy.format=hex|raw&spy.direction=both|rx|tx&spy.file=PATH]",
            examples: ["spy+tcp://127.0.0.1:4000", "spy+tty:///dev/ttyUSB0?baud=115200&spy.file=/tmp/trace.txt",
                       "spy+loop://?spy.format=raw&spy.direction=rx"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [Self.format, Self.direction, Self.file]
        )) { request in
            // The trace file first: a path that cannot be written fails before any I/O.
            let sink = try TraceSink(file: request[Self.file])
            let inner: Connection
            do {
                inner = try await request.connectInner()
            } catch {
                sink.close()
                throw error
            }
            let tracer = Tracer(sink: sink, format: request[Self.format], direction: request[Self.direction])
            tracer.event("OPEN", "\(inner.url)")
            return Connection(url: request.url, backend: SpyBackend(wrapping: inner, tracer: tracer))
        }]
    }
}

/// Passes everything to the wrapped connection and tells the tracer.
final class SpyBackend: WrappingBackend {
    let wrapped: Connection
    private let tracer: Tracer

    init(wrapping wrapped: Connection, tracer: Tracer) {
        self.wrapped = wrapped
        self.tracer = tracer
    }

    func read() async throws -> ByteBuffer? {
        do {
            let chunk = try await carriesMessages ? wrapped.readMessageBuffer() : wrapped.readBuffer()
            if let chunk {
                tracer.data(.rx, chunk)
            } else {
                tracer.event("EOF", "")
            }
            return chunk
        } catch is CancellationError {
            throw CancellationError()
        } catch {
            tracer.event("ERROR", "reading: \(error)")
            throw error
        }
    }

    func write(_ buffer: ByteBuffer) async throws {
        tracer.data(.tx, buffer)
        do {
            if carriesMessages {
                try await wrapped.writeMessage(buffer)
            } else {
                try await wrapped.write(buffer)
            }
        } catch is CancellationError {
            throw CancellationError()
        } catch {
            tracer.event("ERROR", "writing: \(error)")
            throw error
        }
    }

    func closeWrite() async throws {
        tracer.event("SHUT", "no more writes (half-close)")
        try await wrapped.closeWrite()
    }

    func close() async throws {
        tracer.event("CLOSE", "")
        defer { tracer.close() }
        try await wrapped.close()
    }

    func connectionDropped() {
        tracer.event("DROP", "released without close()")
        tracer.close()
    }

    func willPerform(_ operation: ControlOperation) {
        tracer.event("CTRL", operation.description)
    }

    func didPerform(_ operation: ControlOperation, outcome: Result<String?, any Error>) {
        switch outcome {
        case .success(let text): tracer.event("CTRL", "\(operation) → \(text ?? "ok")")
        case .failure(let error): tracer.event("CTRL", "\(operation) → failed: \(error)")
        }
    }
}

/// Formats trace lines and writes them to the sink, one whole line at a time.
final class Tracer: Sendable {
    enum Flow { case rx, tx }

    private let sink: TraceSink
    private let format: SpyPlugin.Format
    private let direction: SpyPlugin.Direction
    private let start = ContinuousClock.now

    init(sink: TraceSink, format: SpyPlugin.Format, direction: SpyPlugin.Direction) {
        self.sink = sink
        self.format = format
        self.direction = direction
    }

    /// A non-data event: hex format only.
    func event(_ label: String, _ detail: String) {
        guard format == .hex else { return }
        sink.write(Array(line(label, detail).utf8))
    }

    func data(_ flow: Flow, _ buffer: ByteBuffer) {
        switch (direction, flow) {
        case (.rx, .tx), (.tx, .rx): return
        default: break
        }
        let bytes = Array(buffer.readableBytesView)
        switch format {
        case .raw:
            sink.write(bytes)
        case .hex:
            let label = flow == .rx ? "RX" : "TX"
            guard !bytes.isEmpty else { return sink.write(Array(line(label, "<empty message>").utf8)) }
            var text = ""
            for offset in stride(from: 0, to: bytes.count, by: 16) {
                text += line(label, Self.hexRow(bytes[offset..<min(offset + 16, bytes.count)], offset: offset))
            }
            sink.write(Array(text.utf8))
        }
    }

    func close() {
        sink.close()
    }

    /// "   0.001733 RX    detail\n": seconds since open, right-aligned, six decimals.
    private func line(_ label: String, _ detail: String) -> String {
        let elapsed = ContinuousClock.now - start
        let micros = elapsed.components.seconds * 1_000_000 + elapsed.components.attoseconds / 1_000_000_000_000
        let fraction = String(micros % 1_000_000)
        let stamp = "\(micros / 1_000_000)." + String(repeating: "0", count: 6 - fraction.count) + fraction
        let padded = String(repeating: " ", count: max(0, 11 - stamp.count)) + stamp
        let labelText = label + String(repeating: " ", count: max(1, 6 - label.count))
        return detail.isEmpty ? "\(padded) \(label)\n" : "\(padded) \(labelText)\(detail)\n"
    }

    /// "0010  68 65 6c 6c 6f 0a …  |hello.|": offset, 16 hex columns (a gap after 8), printable ASCII.
    static func hexRow(_ row: ArraySlice<UInt8>, offset: Int) -> String {
        func hex(_ value: Int, width: Int) -> String {
            let text = String(value, radix: 16)
            return String(repeating: "0", count: max(0, width - text.count)) + text
        }
        var columns = ""
        for (index, byte) in row.enumerated() {
            columns += hex(Int(byte), width: 2) + (index == 7 ? "  " : " ")
        }
        columns += String(repeating: " ", count: max(0, 50 - columns.count))
        let ascii = String(decoding: row.map { $0 >= 0x20 && $0 < 0x7F ? $0 : UInt8(ascii: ".") }, as: UTF8.self)
        return hex(offset, width: 4) + "  " + columns + "|" + ascii + "|"
    }
}

/// Where a trace goes: standard error, or a file this sink owns. Writes are whole and in order.
final class TraceSink: Sendable {
    /// The descriptor, or nil once closed; the lock also keeps writes of different lines apart.
    private let output: Mutex<SystemPackage.FileDescriptor?>
    private let ownsDescriptor: Bool

    init(file: String?) throws {
        guard let file else {
            output = Mutex(SystemPackage.FileDescriptor.standardError)
            ownsDescriptor = false
            return
        }
        do {
            output = Mutex(try SystemPackage.FileDescriptor.open(file, .writeOnly, options: [.create, .truncate, .closeOnExec],
                                                   permissions: [.ownerReadWrite, .groupRead, .otherRead]))
        } catch let errno as Errno {
            throw TransportError.posix("open", errno: errno, what: file, hint: "spy.file= must name a file this process can create or overwrite")
        }
        ownsDescriptor = true
    }

    func write(_ bytes: [UInt8]) {
        output.withLock { output in
            // A trace that cannot be written (a closed pipe, a full disk) must not break the
            // connection it watches: the bytes are dropped.
            _ = try? output?.writeAll(bytes)
        }
    }

    func close() {
        let owned = output.withLock { output in
            defer { output = nil }
            return ownsDescriptor ? output : nil
        }
        try? owned?.close()
    }
}
