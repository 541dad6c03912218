// Recording.swift: the recording format that `spy.record=FILE` writes and `replay://FILE` plays:
// one line per event, readable and editable.
//
//   # transportkit recording 1
//   0.000000 open tty:///dev/ttyUSB0?baud=38400
//   0.012345 > "ATZ\r"                      bytes the application wrote (to the device)
//   0.045000 < "\r\nELM327 v1.5\r\n>"       bytes the application read (from the device)
//   0.050000 ctrl settings 38400 8N1 -> ok  a control call and its outcome
//   0.060000 ctrl modem lines? -> CTS DSR
//   0.900000 eof                            the device ended the stream
//   1.234567 end                            the application closed the connection
//
// The time is seconds since the connection opened. Bytes are a double-quoted string: printable
// ASCII as itself, `\\`, `\"`, `\r`, `\n`, `\t`, and `\xHH` for every other byte. Lines starting
// with `#` and blank lines are ignored.

import Glibc
import Synchronization
@_spi(Plugins) import TransportKitCore

/// One event of a recording.
struct RecordedEvent: Sendable, Equatable {
    enum Kind: Sendable, Equatable {
        case open(String)
        /// Written by the application, for the device.
        case toDevice([UInt8])
        /// Read by the application, from the device.
        case fromDevice([UInt8])
        /// A control call (`"settings 38400 8N1"`) and its outcome (`"ok"`, `"CTS DSR"`, `"failed: …"`).
        case control(String, outcome: String)
        case endOfStream
        case end
        /// Records the recorder could not write (the disk was too slow or full): the file is
        /// incomplete, and replay refuses it.
        case lost(Int)
    }

    /// Seconds since the connection opened.
    var time: Double
    var kind: Kind
    /// Its line in the file (from 1), for messages.
    var line: Int = 0

    /// The event as a line of the format, without its newline.
    var text: String {
        let stamp = Self.stamp(time)
        switch kind {
        case .open(let url): return "\(stamp) open \(url)"
        case .toDevice(let bytes): return "\(stamp) > \(Self.quoted(bytes))"
        case .fromDevice(let bytes): return "\(stamp) < \(Self.quoted(bytes))"
        case .control(let operation, let outcome): return "\(stamp) ctrl \(operation) -> \(outcome)"
        case .endOfStream: return "\(stamp) eof"
        case .end: return "\(stamp) end"
        case .lost(let count): return "\(stamp) lost \(count)"
        }
    }

    static let header = "# transportkit recording 1"

    static func stamp(_ time: Double) -> String {
        let micros = Int((time * 1_000_000).rounded())
        let fraction = String(micros % 1_000_000)
        return "\(micros / 1_000_000)." + String(repeating: "0", count: 6 - fraction.count) + fraction
    }

    /// `bytes` as the format's quoted string.
    static func quoted(_ bytes: [UInt8]) -> String {
        var text = "\""
        for byte in bytes {
            switch byte {
            case UInt8(ascii: "\\"): text += "\\\\"
            case UInt8(ascii: "\""): text += "\\\""
            case 0x0D: text += "\\r"
            case 0x0A: text += "\\n"
            case 0x09: text += "\\t"
            case 0x20..<0x7F: text.unicodeScalars.append(Unicode.Scalar(byte))
            default:
                text += "\\x" + Hex.digits(byte)
            }
        }
        return text + "\""
    }

    /// The bytes of a quoted string, or nil when it is not one.
    static func unquoted(_ text: Substring) -> [UInt8]? {
        let scalars = Array(text.utf8)
        guard scalars.count >= 2, scalars.first == UInt8(ascii: "\""), scalars.last == UInt8(ascii: "\"") else { return nil }
        var bytes: [UInt8] = []
        var index = 1
        let end = scalars.count - 1
        while index < end {
            let byte = scalars[index]
            guard byte == UInt8(ascii: "\\") else {
                guard byte != UInt8(ascii: "\"") else { return nil }
                bytes.append(byte)
                index += 1
                continue
            }
            guard index + 1 < end else { return nil }
            switch scalars[index + 1] {
            case UInt8(ascii: "\\"): bytes.append(UInt8(ascii: "\\"))
            case UInt8(ascii: "\""): bytes.append(UInt8(ascii: "\""))
            case UInt8(ascii: "r"): bytes.append(0x0D)
            case UInt8(ascii: "n"): bytes.append(0x0A)
            case UInt8(ascii: "t"): bytes.append(0x09)
            case UInt8(ascii: "x"):
                guard index + 3 < end, let high = Hex.digitValue(scalars[index + 2]), let low = Hex.digitValue(scalars[index + 3]) else { return nil }
                bytes.append(high << 4 | low)
                index += 2
            default:
                return nil
            }
            index += 2
        }
        return bytes
    }

    /// The events of a recording's text, or an error naming the first line that is not one.
    static func parse(_ text: String, describing: String) throws -> [RecordedEvent] {
        var events: [RecordedEvent] = []
        var lastTime = 0.0
        // Lines by their LF byte (a CRLF file too: Swift takes "\r\n" as one Character).
        for (offset, bytes) in Array(text.utf8).split(separator: 0x0A, omittingEmptySubsequences: false).enumerated() {
            let line = Substring(String(decoding: bytes.last == 0x0D ? bytes.dropLast() : bytes[...], as: UTF8.self))
            let number = offset + 1
            if line.isEmpty || line.hasPrefix("#") { continue }
            func bad(_ why: String) -> TransportError {
                TransportError(.invalidURL, "\(describing), line \(number): \(why): \(TransportError.printable(String(line.prefix(80))))")
            }
            guard let space = line.firstIndex(of: " "), let time = Double(line[..<space]), time.isFinite, time >= 0 else {
                throw bad("a line begins with its time in seconds")
            }
            let rest = line[line.index(after: space)...]
            if rest.hasPrefix("lost ") {
                throw bad("the recorder lost \(rest.dropFirst(5)) records while it wrote this file (a disk too slow or full); record the session again")
            }
            guard time >= lastTime else { throw bad("the times go back") }
            lastTime = time
            let kind: Kind
            if rest.hasPrefix("> ") || rest.hasPrefix("< ") {
                guard let bytes = unquoted(rest.dropFirst(2)) else { throw bad("bytes are a quoted string with \\r, \\n, \\t, \\\\, \\\" and \\xHH escapes") }
                kind = rest.hasPrefix(">") ? .toDevice(bytes) : .fromDevice(bytes)
            } else if rest.hasPrefix("ctrl ") {
                let call = Array(rest.dropFirst(5))
                let arrow = Array(" -> ")
                guard let at = (0..<max(0, call.count - arrow.count + 1)).first(where: { Array(call[$0..<$0 + arrow.count]) == arrow }) else {
                    throw bad("a control line is 'ctrl OPERATION -> OUTCOME'")
                }
                kind = .control(String(call[..<at]), outcome: String(call[(at + arrow.count)...]))
            } else if rest.hasPrefix("open ") {
                kind = .open(String(rest.dropFirst(5)))
            } else if rest == "eof" {
                kind = .endOfStream
            } else if rest == "end" {
                kind = .end
            } else {
                throw bad("an event is >, <, ctrl, open, eof or end")
            }
            events.append(RecordedEvent(time: time, kind: kind, line: number))
        }
        guard !events.isEmpty else {
            throw TransportError(.invalidURL, "\(describing) holds no event: a recording has lines such as 0.012 > \"ATZ\\r\" (made with spy.record=)")
        }
        return events
    }
}

/// Writes a session's recording (`spy.record=FILE`) through a sink of its own: a header, the open
/// line, then one line per event, in the order the events happened (one lock around the clock and
/// the write, so a reader and a writer in two tasks cannot cross), nothing after `end`. A payload
/// is written in lines of at most ``chunk`` bytes, so no record is too large for the sink.
final class Recorder: Sendable {
    /// The most bytes one `<` or `>` line carries (its quoted text at most four times that).
    static let chunk = 16 * 1024

    private let sink: TraceSink
    private let start = ContinuousClock.now
    /// Set once `end` is written.
    private let ended = Locked(false)

    init(sink: TraceSink, url: TransportURL) {
        self.sink = sink
        sink.write(Array("\(RecordedEvent.header)\n".utf8))
        record(.open(url.shown))
    }

    /// A recording is one session: a file that has something in it already is refused (replay
    /// would find its times going back). (Checked before the file is opened: two sessions started
    /// at the same moment on one new path are not told apart.)
    static func checkNew(_ path: String) throws {
        var status = stat()
        guard lstat(path, &status) == 0 else { return }   // absent: it is made
        if (status.st_mode & S_IFMT) == S_IFREG, status.st_size > 0 {
            throw TransportError(.busy, "spy.record=\(TransportError.printable(path)) is not empty: a recording is one session in a file of its own; "
                                 + "remove it or name a new file")
        }
    }

    /// Removes `path` if it is an empty regular file (a recording whose connect failed).
    static func removeIfEmpty(_ path: String) {
        var status = stat()
        if lstat(path, &status) == 0, (status.st_mode & S_IFMT) == S_IFREG, status.st_size == 0 { unlink(path) }
    }

    /// The lost-records line the sink writes at close when it had to drop some.
    static func lostNote(_ count: Int) -> String { "0.000000 lost \(count)\n" }

    func record(_ kind: RecordedEvent.Kind) {
        ended.withLock { ended in
            guard !ended else { return }
            if kind == .end { ended = true }
            let (seconds, attoseconds) = (ContinuousClock.now - start).components
            let time = Double(seconds) + Double(attoseconds) / 1e18
            var text = ""
            switch kind {
            case .toDevice(let bytes) where bytes.count > Self.chunk, .fromDevice(let bytes) where bytes.count > Self.chunk:
                let toDevice = if case .toDevice = kind { true } else { false }
                for start in stride(from: 0, to: bytes.count, by: Self.chunk) {
                    let piece = Array(bytes[start..<min(start + Self.chunk, bytes.count)])
                    text += RecordedEvent(time: time, kind: toDevice ? .toDevice(piece) : .fromDevice(piece)).text + "\n"
                }
            case .control(let operation, let outcome):
                // One line each: a message with a newline in it is kept on its line.
                let flat = { (text: String) in text.replacingNewlines() }
                text = RecordedEvent(time: time, kind: .control(flat(operation), outcome: flat(outcome))).text + "\n"
            default:
                text = RecordedEvent(time: time, kind: kind).text + "\n"
            }
            sink.write(Array(text.utf8))
        }
    }

    func close() async { await sink.close() }
    func closeLater() { sink.closeLater() }
}

extension String {
    /// The text with CR and LF as spaces.
    func replacingNewlines() -> String {
        String(unicodeScalars.map { $0 == "\n" || $0 == "\r" ? " " : Character($0) })
    }
}
