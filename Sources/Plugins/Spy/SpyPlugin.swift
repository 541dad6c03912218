// spy+URL — wraps any URL and traces what passes: every read, write, half-close and close, and
// every serial control call (line settings, modem lines, break, flush, drain) with a timestamp,
// like pyserial's spy://. The wrapped URL keeps its own options; spy's carry the "spy." prefix.
//
// Grammar:  spy+URL[?spy.format=hex|raw&spy.direction=both|rx|tx&spy.file=PATH&spy.label=TEXT]
//   spy+tcp://127.0.0.1:4000
//   spy+tty:///dev/ttyUSB0?baud=115200&spy.file=/home/me/trace.txt
//   spy+spy+… is allowed but pointless.
// Output (standard error unless spy.file is given):
//   hex  one line per event, seconds since open, a label, the detail; data as a hex + ASCII dump,
//        16 bytes a line (with spy.label=TEXT, every line starts with TEXT):
//            0.000000 OPEN  tcp://127.0.0.1:4000 at 2026-11-26 07:12:03 UTC
//            0.000412 TX    0000  68 65 6c 6c 6f 0a                                 |hello.|
//            0.001733 RX    0000  68 65 6c 6c 6f 0a                                 |hello.|
//            0.002010 CTRL  DTR on
//            0.002015 CTRL  DTR on → ok
//            0.003100 EOF
//   raw  the data bytes only, as they pass (both directions, or one with spy.direction), to
//        capture a stream into a file.
// spy.file (UserPath.openForAppending): never follows a symbolic link at its last component,
// never truncates (a trace is appended to; several connections can share one file, each record
// whole), creates a new file owner-only (0600), and refuses what is not a regular file of this
// user or a character device (/dev/null). The records are written by a thread of their own, so
// a slow disk never holds the connection; a trace that cannot be written is reported once on
// standard error and the connection goes on.
// The wrapped connection stays reachable: metadata, preferredExecutor and connection.serialPort
// work through spy, and `transportkit connect spy+…` keeps standard output byte-exact.

import Glibc
import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// The `spy+URL` wrapper.
///
/// ```swift
/// let port = try await Transport.connect(to: "spy+tty:///dev/ttyUSB0?baud=115200&spy.file=/home/me/trace.txt")
/// try await port.serialPort?.setDTR(true)    // traced: "CTRL  DTR on"
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
    static let file = URLOption.string("file", help: "Append the trace to this file instead of standard error (created owner-only; a symbolic link is refused)")
    static let label = URLOption.string("label", help: "hex format: begin every line with this text, to tell connections apart in a shared trace")
    static let record = URLOption.string("record", help: "Write a recording of the session to this new file, for replay://FILE (without spy.file, no trace is written)")

    /// The `spy` wrapper scheme.
    public var schemes: [Scheme] {
        [Scheme.wrapper(SchemeDescriptor(
            scheme: "spy",
            summary: "Wraps any URL and traces reads, writes, closes and serial control calls (hex dump or raw)",
            grammar: "spy+URL[?spy.format=hex|raw&spy.direction=both|rx|tx&spy.file=PATH&spy.label=TEXT&spy.record=PATH]",
            examples: ["spy+tcp://127.0.0.1:4000", "spy+tty:///dev/ttyUSB0?baud=115200&spy.file=/home/me/trace.txt",
                       "spy+loop://?spy.format=raw&spy.direction=rx"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [Self.format, Self.direction, Self.file, Self.label, Self.record]
        ), check: { request in
            // What a server checks before it listens: the options fit, and the trace file can be written.
            let settings = try Settings(request)
            if let file = settings.file { try await TraceSink.open(file).close() }
            if let record = settings.record { try Recorder.checkNew(record) }
        }, connect: { request in
            let settings = try Settings(request)
            // The trace and the recording first: a path that cannot be written fails before any I/O.
            if let record = settings.record { try Recorder.checkNew(record) }
            let sink: TraceSink? = if let file = settings.file { try await TraceSink.open(file) } else if settings.record == nil { try TraceSink.standardError() } else { nil }
            let recording: TraceSink?
            let inner: Connection
            do {
                recording = if let record = settings.record { try await TraceSink.openRecording(record) } else { nil }
                do {
                    inner = try await request.connectInner()
                } catch {
                    await recording?.close()
                    // Nothing was recorded: the empty file this connect made goes.
                    if let record = settings.record { Recorder.removeIfEmpty(record) }
                    throw error
                }
            } catch {
                await sink?.close()
                throw error
            }
            let tracer = sink.map { Tracer(sink: $0, format: settings.format, direction: settings.direction, label: settings.label) }
            tracer?.event("OPEN", "\(inner.url) at \(Tracer.wallClock())")
            let recorder = recording.map { Recorder(sink: $0, url: inner.url) }
            return Connection(url: request.url, backend: SpyBackend(wrapping: inner, tracer: tracer, recorder: recorder))
        })]
    }

    /// A spy layer's options, read and checked together.
    struct Settings {
        var format: Format
        var direction: Direction
        var file: String?
        var label: String?
        var record: String?

        init(_ request: ConnectRequest) throws {
            format = request[SpyPlugin.format]
            direction = request[SpyPlugin.direction]
            file = request[SpyPlugin.file]
            label = request[SpyPlugin.label]
            record = request[SpyPlugin.record]
            if record?.isEmpty == true {
                throw TransportError(.invalidURL, "\(request.url.shown): spy.record= needs a path for the new recording, such as spy.record=\(UserPath.example)")
            }
            if file?.isEmpty == true {
                throw TransportError(.invalidURL, "\(request.url.shown): spy.file= needs a path, such as spy.file=\(UserPath.example)")
            }
            if label != nil, format == .raw {
                throw TransportError(.invalidURL, "\(request.url.shown): spy.label= begins the lines of the hex format; "
                                     + "spy.format=raw writes the bytes alone, with no lines to label. Drop one of them")
            }
        }
    }
}

/// Passes everything to the wrapped connection and tells the tracer.
final class SpyBackend: WrappingBackend {
    let wrapped: Connection
    /// The trace, unless only a recording was asked for.
    private let tracer: Tracer?
    private let recorder: Recorder?
    /// Each poll's last traced line, by operation.
    private let lastPolls = Locked<[String: String]>([:])

    init(wrapping wrapped: Connection, tracer: Tracer?, recorder: Recorder? = nil) {
        self.wrapped = wrapped
        self.tracer = tracer
        self.recorder = recorder
    }

    func read() async throws -> ByteBuffer? {
        try await readMessage()?.payload
    }

    /// Reads (a message with its kind where the wrapped connection carries them) and traces it.
    func readMessage() async throws -> TransportMessage? {
        do {
            let message = try await carriesMessages ? wrapped.nextMessage() : wrapped.readBuffer().map { TransportMessage(.binary, $0) }
            if let message {
                tracer?.data(.rx, message.payload)
                recorder?.record(.fromDevice(Array(message.payload.readableBytesView)))
            } else {
                tracer?.event("EOF", "")
                recorder?.record(.endOfStream)
            }
            return message
        } catch is CancellationError {
            throw CancellationError()
        } catch {
            tracer?.event("ERROR", "reading: \(error)")
            recorder?.record(.endOfStream)   // a replay ends its stream there too
            throw error
        }
    }

    func write(_ buffer: ByteBuffer) async throws {
        try await writeMessage(TransportMessage(.binary, buffer))
    }

    /// Traces, then writes (a message with its kind where the wrapped connection carries them).
    func writeMessage(_ message: TransportMessage) async throws {
        tracer?.data(.tx, message.payload)
        recorder?.record(.toDevice(Array(message.payload.readableBytesView)))
        do {
            if carriesMessages {
                try await wrapped.writeMessage(message)
            } else {
                try await wrapped.write(message.payload)
            }
        } catch is CancellationError {
            throw CancellationError()
        } catch {
            tracer?.event("ERROR", "writing: \(error)")
            throw error
        }
    }

    func closeWrite() async throws {
        tracer?.event("SHUT", "no more writes (half-close)")
        try await wrapped.closeWrite()
    }

    func close() async throws {
        tracer?.event("CLOSE", "")
        recorder?.record(.end)
        do {
            try await wrapped.close()
        } catch {
            await tracer?.close()
            await recorder?.close()
            throw error
        }
        await tracer?.close()
        await recorder?.close()
    }

    func connectionDropped() {
        tracer?.event("DROP", "released without close()")
        tracer?.closeLater()
        recorder?.record(.end)
        recorder?.closeLater()
    }

    func willPerform(_ operation: ControlOperation) {
        if !operation.isPoll { tracer?.event("CTRL", operation.description) }
    }

    func didPerform(_ operation: ControlOperation, outcome: Result<String?, any Error>) {
        let result = switch outcome {
        case .success(let text): text ?? "ok"
        case .failure(let error): "failed: \(error)"
        }
        let line = "\(operation) → \(result)"
        // A poll on a timer is traced when its answer changes, not four times a second.
        if operation.isPoll, lastPolls.withLock({ polls in defer { polls[operation.description] = line }; return polls[operation.description] == line }) {
            return
        }
        tracer?.event("CTRL", line)
        recorder?.record(.control(operation.description, outcome: result))
    }
}

/// Formats trace lines and writes them to the sink, one whole line at a time.
final class Tracer: Sendable {
    enum Flow { case rx, tx }

    private let sink: TraceSink
    private let format: SpyPlugin.Format
    private let direction: SpyPlugin.Direction
    /// Put in front of every line ("#3 "), or empty.
    private let prefix: String
    private let start = ContinuousClock.now

    init(sink: TraceSink, format: SpyPlugin.Format, direction: SpyPlugin.Direction, label: String? = nil) {
        self.sink = sink
        self.format = format
        self.direction = direction
        self.prefix = label.map { $0 + " " } ?? ""
    }

    /// "2026-11-26 07:12:03 UTC": when the trace of a connection began, so that traces appended
    /// to one file can be placed in time.
    static func wallClock() -> String {
        var now = time(nil)
        var parts = tm()
        guard gmtime_r(&now, &parts) != nil else { return "?" }
        func two(_ value: Int32) -> String { value < 10 ? "0\(value)" : "\(value)" }
        return "\(parts.tm_year + 1900)-\(two(parts.tm_mon + 1))-\(two(parts.tm_mday)) \(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)) UTC"
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

    /// Writes what is queued, then closes the sink.
    func close() async {
        await sink.close()
    }

    /// Closes the sink once what is queued is written, without waiting.
    func closeLater() {
        sink.closeLater()
    }

    /// "   0.001733 RX    detail\n": seconds since open, right-aligned, six decimals.
    private func line(_ label: String, _ detail: String) -> String {
        let elapsed = ContinuousClock.now - start
        let micros = elapsed.components.seconds * 1_000_000 + elapsed.components.attoseconds / 1_000_000_000_000
        let fraction = String(micros % 1_000_000)
        let stamp = "\(micros / 1_000_000)." + String(repeating: "0", count: 6 - fraction.count) + fraction
        let padded = String(repeating: " ", count: max(0, 11 - stamp.count)) + stamp
        let labelText = label + String(repeating: " ", count: max(1, 6 - label.count))
        return detail.isEmpty ? "\(prefix)\(padded) \(label)\n" : "\(prefix)\(padded) \(labelText)\(detail)\n"
    }

    /// "0010  68 65 6c 6c 6f 0a …  |hello.|": offset, 16 hex columns (a gap after 8), printable ASCII.
    static func hexRow(_ row: ArraySlice<UInt8>, offset: Int) -> String {
        var columns = ""
        for (index, byte) in row.enumerated() {
            columns += Hex.digits(byte) + (index == 7 ? "  " : " ")
        }
        columns += String(repeating: " ", count: max(0, 50 - columns.count))
        let ascii = String(decoding: row.map { $0 >= 0x20 && $0 < 0x7F ? $0 : UInt8(ascii: ".") }, as: UTF8.self)
        return Hex.digits(offset, width: 4) + "  " + columns + "|" + ascii + "|"
    }
}

/// Where a trace goes: standard error, or a file this sink owns. Records are written in order by
/// one writer thread that every trace of the process shares (a `JobThread`, started with the
/// first: neither the cooperative pool nor dispatch's worker threads, which other code shares, and
/// not a thread per connection, which a bridge serving thousands of spied clients could not
/// start), so a slow disk or a full pipe never holds a connection or anyone else's work; it holds
/// only the other traces' writes, which is where a trace's cost belongs. The queue is bounded: at most ``pendingLimit`` bytes wait, each record
/// counted with ``recordOverhead`` more (so a flood of tiny records is bounded too); records
/// beyond are dropped and counted. The first failure to write (a full disk, /dev/full) is
/// reported once on standard error.
final class TraceSink: Sendable {
    /// Records wait for the writer up to this many bytes; more are dropped (and reported).
    static let pendingLimit = 4 << 20
    /// What a waiting record costs beyond its bytes (its job and array), counted against the limit.
    static let recordOverhead = 64

    private struct State {
        /// The descriptor, or nil once closed.
        var output: SystemPackage.FileDescriptor?
        var pending = 0
        var dropped = 0
        var failed = false
        var closing = false
    }

    private let ownsDescriptor: Bool
    private let describing: String
    /// What is written at close when records were dropped (a recording's `lost N` line).
    private let droppedNote: @Sendable (Int) -> String
    /// Writes the records, in order, then closes the descriptor: the process's trace writer.
    private let writer: JobThread
    /// Set by the writer once the descriptor is closed; ``close()`` waits for it.
    private let closed = AsyncCondition(false)

    /// The one writer thread for every trace, started at the first sink and kept for the process.
    private static let sharedWriter = Locked<JobThread?>(nil)

    private static func writerThread() throws -> JobThread {
        try sharedWriter.withLock { writer in
            if let writer { return writer }
            let started = try JobThread(name: "tk spy trace")
            writer = started
            return started
        }
    }
    /// Guards the descriptor and the counts; the writer thread does the writing.
    private let state: Locked<State>

    /// Throws when the system refuses the writer thread (the descriptor stays the caller's).
    private init(_ output: SystemPackage.FileDescriptor, owned: Bool, describing: String,
                 droppedNote: @escaping @Sendable (Int) -> String = { "spy: \($0) records were dropped: the trace could not be written as fast as the connection ran\n" }) throws {
        ownsDescriptor = owned
        self.describing = describing
        self.droppedNote = droppedNote
        state = Locked(State(output: output))
        writer = try Self.writerThread()
    }

    /// The trace on standard error (not owned: never closed).
    static func standardError() throws -> TraceSink {
        try TraceSink(.standardError, owned: false, describing: "standard error")
    }

    /// A trace appended to `path`; see `UserPath.openForAppending`.
    static func open(_ path: String) async throws -> TraceSink {
        let fd = try await UserPath.openForAppending(path, purpose: "the trace file (spy.file=)")
        do {
            return try TraceSink(fd, owned: true, describing: TransportError.printable(path))
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// A recording written to `path` (spy.record=): records it had to drop are marked at close
    /// with a `lost N` line, which replay refuses.
    static func openRecording(_ path: String) async throws -> TraceSink {
        let fd = try await UserPath.openForAppending(path, purpose: "the recording (spy.record=)")
        do {
            return try TraceSink(fd, owned: true, describing: TransportError.printable(path), droppedNote: Recorder.lostNote)
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// Queues `bytes` (one whole record) for writing.
    func write(_ bytes: [UInt8]) {
        guard !bytes.isEmpty else { return }
        let cost = bytes.count + Self.recordOverhead
        let taken = state.withLock { state -> Bool in
            guard state.output != nil, !state.closing else { return false }
            guard state.pending + cost <= Self.pendingLimit else {
                state.dropped += 1
                return false
            }
            state.pending += cost
            return true
        }
        guard taken else { return }
        let queued = writer.submit { [self] in
            let output = state.withLock { $0.output }
            // A trace that cannot be written (a full disk, a closed pipe, a device that cannot
            // take it now) must not break the connection it watches: the record is dropped.
            var failure: Errno?
            if let output { failure = Self.writeAll(bytes, to: output) }
            let report = state.withLock { state -> Bool in
                state.pending -= cost
                guard failure != nil, !state.failed else { return false }
                state.failed = true
                return true
            }
            if report, let failure, ownsDescriptor {
                let line = "spy: writing the trace to \(describing) failed: \(failure.symbolicDescription); records are lost until it can be written again\n"
                _ = Self.writeAll(Array(line.utf8), to: .standardError)
            }
        }
        // Refused only by a close that came meanwhile: the record goes with the rest.
        if !queued { state.withLock { $0.pending -= cost } }
    }

    /// write(2) until done (EINTR retried); a descriptor that is not ready now (a device,
    /// non-blocking: EAGAIN) counts as a failure.
    private static func writeAll(_ bytes: [UInt8], to output: SystemPackage.FileDescriptor) -> Errno? {
        do {
            _ = try output.writeAll(bytes)
            return nil
        } catch {
            return error as? Errno ?? .ioError
        }
    }

    /// Writes what is queued, then closes the file (standard error stays open), and returns once
    /// that is done. A second call waits for the first one's end as well. Not cancellable.
    func close() async {
        state.withLock { current in
            guard !current.closing else { return }
            current.closing = true
            // Queued under the lock that marks the sink closing: no record queued after this
            // one is written. The shared writer is never finished, so it takes the job.
            writer.submit { [self] in
                let (output, dropped) = state.withLock { state in
                    defer { state.output = nil }
                    return (state.output, state.dropped)
                }
                if dropped > 0, let output {
                    _ = Self.writeAll(Array(droppedNote(dropped).utf8), to: output)
                }
                if ownsDescriptor { output?.closeOwned() }
                closed.update { $0 = true }
            }
        }
        let done = closed
        await uncancellable { try? await done.wait { $0 ? () : nil } }
    }

    /// ``close()`` without waiting for it (a dropped connection); counted by
    /// `waitForAbandonedConnects()` until the trace is written and closed.
    func closeLater() {
        startCleanup { [self] in await close() }
    }
}
