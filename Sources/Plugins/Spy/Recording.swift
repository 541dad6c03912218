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
                let digits = Array("0123456789abcdef")
                text += "\\x" + String(digits[Int(byte >> 4)]) + String(digits[Int(byte & 0x0F)])
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
        func hexValue(_ digit: UInt8) -> UInt8? {
            switch digit {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): digit - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): digit - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): digit - UInt8(ascii: "A") + 10
            default: nil
            }
        }
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
                guard index + 3 < end, let high = hexValue(scalars[index + 2]), let low = hexValue(scalars[index + 3]) else { return nil }
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
        for (offset, raw) in text.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
            let line = raw.hasSuffix("\r") ? raw.dropLast() : raw
            let number = offset + 1
            if line.isEmpty || line.hasPrefix("#") { continue }
            func bad(_ why: String) -> TransportError {
                TransportError(.invalidURL, "\(describing), line \(number): \(why): \(TransportError.printable(String(line.prefix(80))))")
            }
            guard let space = line.firstIndex(of: " "), let time = Double(line[..<space]), time.isFinite, time >= 0 else {
                throw bad("a line begins with its time in seconds")
            }
            guard time >= lastTime else { throw bad("the times go back") }
            lastTime = time
            let rest = line[line.index(after: space)...]
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
        return events
    }
}

/// Writes a session's recording (`spy.record=FILE`) through a sink of its own: a header, the open
/// line, then one line per event.
final class Recorder: Sendable {
    private let sink: TraceSink
    private let start = ContinuousClock.now

    init(sink: TraceSink, url: TransportURL) {
        self.sink = sink
        sink.write(Array("\(RecordedEvent.header)\n".utf8))
        record(.open(url.description))
    }

    /// A recording is one session: a file that has something in it already is refused (replay
    /// would find its times going back).
    static func checkNew(_ path: String) throws {
        var status = stat()
        guard lstat(path, &status) == 0 else { return }   // absent: it is made
        if (status.st_mode & S_IFMT) == S_IFREG, status.st_size > 0 {
            throw TransportError(.busy, "spy.record=\(TransportError.printable(path)) already holds a recording: a recording is one session; remove it or name a new file")
        }
    }

    func record(_ kind: RecordedEvent.Kind) {
        let (seconds, attoseconds) = (ContinuousClock.now - start).components
        let time = Double(seconds) + Double(attoseconds) / 1e18
        sink.write(Array((RecordedEvent(time: time, kind: kind).text + "\n").utf8))
    }

    func close() async { await sink.close() }
    func closeLater() { sink.closeLater() }
}
