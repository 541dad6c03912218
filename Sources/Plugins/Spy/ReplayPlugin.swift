// ReplayPlugin.swift: replay:///FILE plays the device's side of a recording that spy.record=FILE
// wrote (Recording.swift): what the device sent is read by the application, in order, with the
// recorded timing or as fast as possible; what the application writes is checked against what it
// wrote in the recording (strict, by default) or taken as it comes. A recording of a serial line
// also answers serial control calls, with the settings and modem lines the recording shows.

import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// The `replay://` scheme: a recorded device, played back.
///
/// ```swift
/// // Record once against the real device …
/// let live = try await Transport.connect(to: "spy+tty:///dev/ttyUSB0?baud=38400&spy.record=/home/me/elm327.rec")
/// // … then the app's tests run against the recording, with no hardware.
/// let fake = try await Transport.connect(to: "replay:///home/me/elm327.rec?timing=fast")
/// try await fake.write("ATZ\r")
/// print(try await fake.readFrame(.delimiter(">")) ?? [])
/// ```
public struct ReplayPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    /// How the device's bytes are paced.
    public enum Timing: String, CaseIterable, Sendable {
        /// As recorded: each waits as long after the event before it as it did then.
        case recorded
        /// As fast as the application reads and writes.
        case fast
    }

    static let timing = URLOption.choice("timing", default: Timing.recorded, help: "recorded: the device's bytes come with the recorded pauses; fast: at once")
    static let strict = URLOption.bool("strict", default: true,
                                       help: "A write that differs from the recording (or goes past its writes) fails with the position and both bytes; false takes any writes")
    /// The largest recording read (a recording is read whole at connect).
    static let maximumSize = 64 << 20

    /// The `replay` scheme.
    public var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(
            scheme: "replay",
            summary: "Plays the device's side of a recording made with spy.record=FILE: no hardware needed",
            grammar: "replay:///PATH[?timing=recorded|fast&strict=true|false]",
            examples: ["replay:///home/me/elm327.rec", "replay:///home/me/gps.rec?timing=fast&strict=false"],
            host: .forbidden, port: .forbidden, path: .required,
            options: [Self.timing, Self.strict]
        ), connect: { request in
            let path = request.url.path
            let text = try await Self.read(path)
            let events = try RecordedEvent.parse(text, describing: "the recording \(TransportError.printable(path))")
            let core = ReplayCore(events: events, describing: request.url.shown, timing: request[Self.timing], strict: request[Self.strict])
            let backend: any ConnectionBackend = core.isSerial ? ReplaySerialBackend(core: core) : ReplayBackend(core: core)
            return Connection(url: request.url, backend: backend, metadata: ConnectionMetadata(name: "replay of \(path)", remoteAddress: core.recordedURL))
        })]
    }

    /// The file's text, read off the cooperative pool; at most ``maximumSize`` bytes.
    static func read(_ path: String) async throws -> String {
        let bytes = try await Blocking.run { () throws -> [UInt8] in
            let fd: SystemPackage.FileDescriptor
            do {
                fd = try SystemPackage.FileDescriptor.open(FilePath(path), .readOnly, options: [.closeOnExec])
            } catch let errno as Errno {
                let kind = TransportError.Kind(errno: errno)
                let what = errno == .noSuchFileOrDirectory
                    ? "no recording at \(TransportError.printable(path)); make one with spy+URL?spy.record=\(TransportError.printable(path))"
                    : "the recording \(TransportError.printable(path)) cannot be opened (\(errno.symbolicDescription))"
                throw TransportError(kind, what, errno: errno, syscall: "open")
            }
            defer { try? fd.close() }
            var bytes: [UInt8] = []
            var chunk = [UInt8](repeating: 0, count: 65536)
            while true {
                let count = try chunk.withUnsafeMutableBytes { try fd.read(into: $0) }
                if count == 0 { break }
                bytes += chunk[..<count]
                guard bytes.count <= maximumSize else {
                    throw TransportError(.unsupported, "the recording \(TransportError.printable(path)) is larger than \(maximumSize >> 20) MiB")
                }
            }
            return bytes
        }
        return String(decoding: bytes, as: UTF8.self)
    }
}

/// A recording in play: the device's bytes go to the application, its writes are checked.
final class ReplayCore: Sendable {
    let inbound = InboundQueue()
    let describing: String
    let strict: Bool
    let timing: ReplayPlugin.Timing
    /// The URL the recording was made with (its `open` line).
    let recordedURL: String?
    let isSerial: Bool
    private let events: [RecordedEvent]
    /// Every byte the application wrote in the recording, in order, and the line each write is on.
    private let expected: [UInt8]
    private let writeLines: [(end: Int, line: Int)]
    /// How many bytes the application has written so far.
    private let written = AsyncCondition(0)
    /// The serial line as the recording shows it at the point played.
    let line: Locked<(settings: SerialSettings, lines: ModemLines?)>
    private let driver: Locked<Task<Void, Never>?> = Locked(nil)

    init(events: [RecordedEvent], describing: String, timing: ReplayPlugin.Timing, strict: Bool) {
        self.events = events
        self.describing = describing
        self.timing = timing
        self.strict = strict
        var expected: [UInt8] = []
        var writeLines: [(Int, Int)] = []
        var url: String?
        var controls = false
        let serialCalls = ["settings", "modem lines", "DTR", "RTS", "break", "flush", "drain", "line errors"]
        for event in events {
            switch event.kind {
            case .toDevice(let bytes):
                expected += bytes
                writeLines.append((expected.count, event.line))
            case .open(let text): url = text
            case .control(let operation, _): controls = controls || serialCalls.contains { operation.hasPrefix($0) }
            default: break
            }
        }
        self.expected = expected
        self.writeLines = writeLines
        recordedURL = url
        let scheme = url.flatMap { try? TransportURL($0) }?.innermost.scheme
        isSerial = controls || ["tty", "pty", "rfc2217"].contains(scheme ?? "")
        // The recorded URL's line options, before any recorded control call says more.
        line = Locked((url.flatMap { try? TransportURL($0) }.map(Self.settings(of:)) ?? SerialSettings(), nil))
        // The line as the recording first shows it, before any of it is played: an app that asks
        // for the settings before the recording did gets the recorded ones, not the defaults.
        let calls = events.compactMap { event -> (String, String)? in
            if case .control(let operation, let outcome) = event.kind { (operation, outcome) } else { nil }
        }
        if let settings = calls.first(where: { $0.0.hasPrefix("settings") }) { noteControl(settings.0, settings.1) }
        if let lines = calls.first(where: { $0.0 == "modem lines?" }) { noteControl(lines.0, lines.1) }
        let task = Task { [self] in await play() }
        driver.withLock { $0 = task }
    }

    /// The line settings a URL's options give (`baud`, `dataBits`, `parity`, `stopBits`,
    /// `flowControl`; the rest as `tty://`'s defaults).
    static func settings(of url: TransportURL) -> SerialSettings {
        let inner = url.innermost
        var settings = SerialSettings()
        if let rate = inner.queryValue("baud").flatMap({ Int($0) }) { settings.baudRate = rate } else if let port = inner.port, inner.scheme == "tty" { settings.baudRate = port }
        if let bits = inner.queryValue("dataBits").flatMap({ Int($0) }) { settings.dataBits = bits }
        if let parity = inner.queryValue("parity").flatMap({ SerialSettings.Parity(rawValue: $0.lowercased()) }) { settings.parity = parity }
        if let stop = inner.queryValue("stopBits").flatMap({ Int($0) }) { settings.stopBits = stop }
        if let flow = inner.queryValue("flowControl").flatMap({ SerialSettings.FlowControl(rawValue: $0.lowercased()) }) { settings.flowControl = flow }
        return settings
    }

    /// The line of the recording that holds written byte `position`.
    private func line(ofByte position: Int) -> Int {
        writeLines.first { $0.end > position }?.line ?? writeLines.last?.line ?? 0
    }

    /// Takes the application's `bytes`; in strict mode each must be the recording's next one.
    func write(_ bytes: ByteBuffer) throws {
        do {
            try check(Array(bytes.readableBytesView))
        } catch let error as TransportError {
            // The recording cannot go on from here: a reader waiting for its next bytes learns why.
            inbound.fail(error)
            throw error
        }
    }

    private func check(_ view: [UInt8]) throws {
        try written.update { position in
            if strict {
                for (index, byte) in view.enumerated() {
                    let at = position + index
                    guard at < expected.count else {
                        throw TransportError(.protocolError, "\(describing): the application wrote byte \(at) (\(Self.shown(byte))), past the recording's "
                                             + "last write (line \(writeLines.last?.line ?? 0)); strict=false takes any writes")
                    }
                    guard expected[at] == byte else {
                        throw TransportError(.protocolError, "\(describing): the application wrote \(Self.shown(byte)) at byte \(at) where the recording "
                                             + "(line \(line(ofByte: at))) has \(Self.shown(expected[at])); strict=false takes any writes")
                    }
                }
            }
            position += view.count
        }
    }

    static func shown(_ byte: UInt8) -> String {
        let hex = "0x" + Hex.digits(byte)
        return (0x20..<0x7F).contains(byte) ? "\(hex) '\(Character(Unicode.Scalar(byte)))'" : hex
    }

    /// Plays the recording: each event when its time comes (`timing=recorded`), counted from the
    /// last wait for the application's writes, so sleeps' lateness does not add up; the device's
    /// bytes after the application's writes recorded before them.
    private func play() async {
        var recorded = 0.0
        var real = ContinuousClock.now
        var writtenBefore = 0
        for event in events {
            if Task.isCancelled { return }
            if case .toDevice(let bytes) = event.kind {
                writtenBefore += bytes.count
                let target = writtenBefore
                do { try await written.wait { $0 >= target ? () : nil } } catch { return }
                recorded = event.time
                real = .now
                continue
            }
            if timing == .recorded {
                real += .nanoseconds(Int64(((event.time - recorded) * 1e9).rounded()))
                recorded = event.time
                do { try await Task.sleep(until: real, clock: .continuous) } catch { return }
            }
            switch event.kind {
            case .fromDevice(let bytes): inbound.append(ByteBuffer(bytes: bytes))
            case .control(let operation, let outcome): noteControl(operation, outcome)
            case .endOfStream: inbound.finish()
            case .open, .end, .toDevice, .lost: break
            }
        }
    }

    /// What a recorded control call says about the line: settings set or read, modem lines read.
    private func noteControl(_ operation: String, _ outcome: String) {
        if operation.hasPrefix("settings "), outcome == "ok", let settings = SerialSettings(summary: String(operation.dropFirst(9))) {
            line.withLock { $0.settings = settings }
        } else if operation == "settings?", let settings = SerialSettings(summary: outcome) {
            line.withLock { $0.settings = settings }
        } else if operation == "modem lines?", !outcome.hasPrefix("failed") {
            line.withLock { $0.lines = ModemLines(names: outcome) }
        }
    }

    func close() async {
        let task = driver.withLock { $0 }
        task?.cancel()
        await task?.value
        inbound.finish()
    }

    func drop() {
        driver.withLock { $0 }?.cancel()
        inbound.finish()
    }
}

extension SerialSettings {
    /// Settings from their summary (`"38400 8N1"`, `"9600 7E2 rtscts"`), or nil.
    init?(summary: String) {
        let parts = summary.split(separator: " ")
        guard parts.count >= 2, let rate = Int(parts[0]) else { return nil }
        let frame = Array(parts[1])
        guard frame.count == 3, let bits = Int(String(frame[0])), let stop = Int(String(frame[2])) else { return nil }
        let parity: Parity? = switch frame[1] {
        case "N": Parity.none
        case "E": .even
        case "O": .odd
        case "M": .mark
        case "S": .space
        default: nil
        }
        let flow = parts.count > 2 ? FlowControl(rawValue: String(parts[2])) : FlowControl.none
        guard let parity, let flow else { return nil }
        self.init(baudRate: rate, dataBits: bits, parity: parity, stopBits: stop, flowControl: flow)
    }
}

extension ModemLines {
    /// Lines from their names (`"DTR RTS CTS"`, `"none"`).
    init(names: String) {
        let known: [String: ModemLines] = ["DTR": .dtr, "RTS": .rts, "CTS": .cts, "DSR": .dsr, "RI": .ri, "CD": .cd]
        self = names.split(separator: " ").reduce(into: ModemLines()) { lines, name in lines.formUnion(known[String(name)] ?? []) }
    }
}

/// The backend of a replay: reads from the played recording, writes checked against it.
protocol ReplayingBackend: ConnectionBackend {
    var core: ReplayCore { get }
}

extension ReplayingBackend {
    var supportsHalfClose: Bool { false }
    func read() async throws -> ByteBuffer? { try await core.inbound.next() }
    func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        try await core.inbound.next(deadline: deadline).map { TransportMessage(.binary, $0) }
    }
    func write(_ buffer: ByteBuffer) async throws { try core.write(buffer) }
    func closeWrite() async throws { throw TransportError(.unsupported, "replay:// has no half-close; call close() when done") }
    func close() async throws { await core.close() }
    func connectionDropped() { core.drop() }
}

final class ReplayBackend: ReplayingBackend {
    let core: ReplayCore
    init(core: ReplayCore) { self.core = core }
}

/// A replay of a serial line: `connection.serialPort` answers from the recording.
final class ReplaySerialBackend: ReplayingBackend, SerialControlling {
    let core: ReplayCore
    init(core: ReplayCore) { self.core = core }
    func serialControl(through connection: Connection) -> any SerialControl { ReplaySerialPort(core: core, connection: connection) }
}

/// Serial control of a replay: settings and modem lines as the recording shows them at the point
/// played (or as the application set them since); the calls that act on a line are taken.
struct ReplaySerialPort: SerialControl {
    let core: ReplayCore
    let connection: Connection
    var port: String { core.recordedURL ?? core.describing }

    func settings() async throws -> SerialSettings {
        connection.performControl(ControlOperation("settings?"), describe: { $0.summary }) { core.line.withLock { $0.settings } }
    }

    func apply(_ settings: SerialSettings) async throws {
        let settings = try settings.validated()
        connection.performControl(ControlOperation("settings", settings.summary)) { core.line.withLock { $0.settings = settings } }
    }

    func modemLines() async throws -> ModemLines {
        try connection.performControl(ControlOperation("modem lines?"), describe: { $0.description }) {
            guard let lines = core.line.withLock({ $0.lines }) else {
                throw TransportError(.unsupported, "\(core.describing): the recording has no modem lines (its device was asked for none)")
            }
            return lines
        }
    }

    func setLines(_ lines: ModemLines, _ on: Bool) async throws {
        connection.performControl(ControlOperation(lines.description, on ? "on" : "off")) {
            core.line.withLock { state in
                if on { state.lines = (state.lines ?? []).union(lines) } else { state.lines = state.lines?.subtracting(lines) }
            }
        }
    }

    func setBreak(_ on: Bool) async throws { connection.performControl(ControlOperation("break", on ? "on" : "off")) {} }
    func flush(_ queue: FlushQueue) async throws { connection.performControl(ControlOperation("flush", queue.rawValue)) {} }
    func drain() async throws { connection.performControl(ControlOperation("drain")) {} }

    /// The lines now; a replay reports no changes, so the sequence then ends.
    func modemLineChanges() async throws -> AsyncThrowingStream<ModemLines, any Error> {
        let now = try await modemLines()
        return AsyncThrowingStream { continuation in
            continuation.yield(now.intersection(ModemLines.inputs))
            continuation.finish()
        }
    }
}
