// TermScreen.swift: what `transportkit term` shows. The device's bytes after the input maps, as
// they are or in hex, with a time at the start of each line when asked; the tool's own lines
// ("[12:00:01.250] Disconnected: …") always on a line of their own; the log file. One writer at a
// time, in the order the calls came, so that a status line never lands inside a piece of the
// device's output.

import Dispatch
import Glibc
import Synchronization
import SystemPackage
import TransportKit
@_spi(Plugins) import TransportKitLinux
@_spi(Plugins) import TransportKitCore

/// Character maps, named as tio's `--map` names them: `I…` for what the device sends (shown on
/// the screen), `O…` for what is typed (sent to the device).
struct TermMaps: Sendable, Equatable {
    enum Flag: String, CaseIterable, Sendable {
        /// CR from the device shown as a new line (unless IGNCR).
        case ICRNL
        /// CR from the device dropped.
        case IGNCR
        /// LF from the device shown as CR.
        case INLCR
        /// LF from the device shown as CR LF (a device that ends lines with LF alone).
        case INLCRNL
        /// CR typed (Enter) sent as LF.
        case OCRNL
        /// LF typed or pasted sent as CR LF.
        case ONLCRNL
        /// DEL typed (Backspace on most terminals) sent as BS.
        case ODELBS
        /// Lower case letters typed sent as upper case.
        case OLTU
    }

    var flags: Set<Flag> = []

    init() {}

    /// Parses `--map ICRNL,ONLCRNL`: names separated by commas, in any case.
    init(parsing text: String) throws {
        for name in text.split(separator: ",").map({ $0.trimmingSpaces().uppercased() }) where !name.isEmpty {
            guard let flag = Flag(rawValue: name) else {
                throw TermError("--map has no map named \(name); the maps are \(Flag.allCases.map(\.rawValue).joined(separator: ", "))")
            }
            flags.insert(flag)
        }
    }

    var summary: String { flags.isEmpty ? "none" : Flag.allCases.filter(flags.contains).map(\.rawValue).joined(separator: ",") }

    /// The device's bytes as the screen gets them.
    func fromDevice(_ bytes: [UInt8]) -> [UInt8] {
        guard !flags.isEmpty else { return bytes }
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count + 8)
        for byte in bytes {
            switch byte {
            case 0x0D where flags.contains(.IGNCR): continue
            case 0x0D where flags.contains(.ICRNL): out.append(0x0A)
            case 0x0A where flags.contains(.INLCRNL): out += [0x0D, 0x0A]
            case 0x0A where flags.contains(.INLCR): out.append(0x0D)
            default: out.append(byte)
            }
        }
        return out
    }

    /// Typed bytes as the device gets them.
    func toDevice(_ bytes: [UInt8]) -> [UInt8] {
        guard !flags.isEmpty else { return bytes }
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count + 8)
        for byte in bytes {
            switch byte {
            case 0x0D where flags.contains(.OCRNL): out.append(0x0A)
            case 0x0A where flags.contains(.ONLCRNL): out += [0x0D, 0x0A]
            case 0x7F where flags.contains(.ODELBS): out.append(0x08)
            case UInt8(ascii: "a")...UInt8(ascii: "z") where flags.contains(.OLTU): out.append(byte - 0x20)
            default: out.append(byte)
            }
        }
        return out
    }
}

/// A message for the person at the terminal, from `term` itself.
struct TermError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}

extension Substring {
    func trimmingSpaces() -> Substring {
        var text = self
        while text.first == " " { text = text.dropFirst() }
        while text.last == " " { text = text.dropLast() }
        return text
    }
}

/// The screen (standard output) and the log file.
actor TermScreen {
    var maps: TermMaps
    var hex: Bool
    var timestamps: Bool
    /// The device's output is at the start of a line (for the time stamp).
    private var atLineStart = true
    /// Hex bytes on the current line.
    private var hexColumn = 0
    /// The last byte written to the screen was a line feed (status lines start on a line of their own).
    private var atColumnZero = true
    private(set) var log: TermLog?
    private let colored: Bool
    private let writable = DescriptorWait(fd: 1, events: Int16(POLLOUT))
    /// One caller at a time formats and writes: a write that waits for room on the screen
    /// suspends, and the next caller waits its turn (``takeTurn()``), so pieces never interleave.
    private var busy = false
    private var waiting: [CheckedContinuation<Void, Never>] = []

    init(maps: TermMaps, hex: Bool, timestamps: Bool, log: TermLog?) {
        self.maps = maps
        self.hex = hex
        self.timestamps = timestamps
        self.log = log
        colored = isatty(1) == 1 && getenv("NO_COLOR") == nil
    }

    /// Shows bytes from the device (and logs them as shown).
    func device(_ bytes: [UInt8]) async throws {
        await takeTurn()
        defer { passTurn() }
        let shown = format(maps.fromDevice(bytes))
        log?.write(shown)
        try await write(shown)
    }

    /// Shows typed bytes (local echo) as they are, Enter as a new line: no time, no hex.
    func echo(_ bytes: [UInt8]) async throws {
        await takeTurn()
        defer { passTurn() }
        var typed: [UInt8] = []
        for byte in bytes { if byte == 0x0D { typed += [0x0D, 0x0A] } else { typed.append(byte) } }
        if let last = typed.last {
            atLineStart = last == 0x0A
            if atLineStart { hexColumn = 0 }
        }
        try await write(typed)
    }

    /// A line of the tool's own, on a line of its own: `[12:00:01.250] text`. Lines in `text`
    /// each get a line of their own.
    func status(_ text: String) async {
        await takeTurn()
        defer { passTurn() }
        // CR first in any case: after a bare LF from the device (no output processing in raw
        // mode) the cursor is on a new line but not at its start.
        var out: [UInt8] = atColumnZero ? [0x0D] : [0x0D, 0x0A]
        let lines = text.split(separator: "\n", omittingEmptySubsequences: false)
        for (index, line) in lines.enumerated() {
            let prefix = index == 0 ? "[\(Self.clock())] " : "    "
            out += Array((colored ? "\u{1B}[33m" : "").utf8) + Array((prefix + line).utf8) + Array((colored ? "\u{1B}[0m" : "").utf8) + [0x0D, 0x0A]
        }
        hexColumn = 0
        atLineStart = true
        try? await write(out)
    }

    /// Writes `bytes` as they are (a prompt and what is typed into it).
    func raw(_ bytes: [UInt8]) async {
        await takeTurn()
        defer { passTurn() }
        try? await write(bytes)
    }

    func setHex(_ on: Bool) async {
        await takeTurn()
        defer { passTurn() }
        if hex && !on && hexColumn > 0 {
            hexColumn = 0
            atLineStart = true
            try? await write([0x0D, 0x0A])
        }
        hex = on
    }

    func setTimestamps(_ on: Bool) { timestamps = on }

    func setLog(_ log: TermLog?) { self.log = log }

    /// Ends the output at the start of a line of its own, for the shell's prompt.
    func finish() async {
        await takeTurn()
        defer { passTurn() }
        try? await write(atColumnZero ? [0x0D] : [0x0D, 0x0A])
    }

    /// The time of day, as `12:00:01.250`.
    static func clock() -> String {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        var parts = tm()
        var seconds = now.tv_sec
        localtime_r(&seconds, &parts)
        func two(_ n: Int32) -> String { n < 10 ? "0\(n)" : "\(n)" }
        let millis = Int(now.tv_nsec / 1_000_000)
        let ms = millis < 10 ? "00\(millis)" : millis < 100 ? "0\(millis)" : "\(millis)"
        return "\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)).\(ms)"
    }

    private func format(_ bytes: [UInt8]) -> [UInt8] {
        guard hex || timestamps else {
            if let last = bytes.last { atLineStart = last == 0x0A }
            return bytes
        }
        var out: [UInt8] = []
        out.reserveCapacity(bytes.count * (hex ? 3 : 1) + 32)
        for byte in bytes {
            if atLineStart {
                if timestamps { out += Array("[\(Self.clock())] ".utf8) }
                atLineStart = false
            }
            if hex {
                out += Array((Hex.digits(byte) + " ").utf8)
                hexColumn += 1
                if byte == 0x0A || hexColumn == 16 {
                    out += [0x0D, 0x0A]
                    hexColumn = 0
                    atLineStart = true
                }
            } else {
                out.append(byte)
                if byte == 0x0A { atLineStart = true }
            }
        }
        return out
    }

    /// Waits for this caller's turn: the state the output is formatted from is read and changed
    /// only by the caller whose turn it is, and turns go in the order they were asked for.
    private func takeTurn() async {
        if busy {
            await withCheckedContinuation { waiting.append($0) }   // passTurn hands it over: busy stays true
        } else {
            busy = true
        }
    }

    private func passTurn() {
        if waiting.isEmpty { busy = false } else { waiting.removeFirst().resume() }
    }

    /// Writes during the caller's turn.
    private func write(_ bytes: [UInt8]) async throws {
        guard !bytes.isEmpty else { return }
        if let last = bytes.last { atColumnZero = last == 0x0A }
        try await StandardOutput.writeAll(bytes, waiting: writable)
    }
}

/// The log file: appended to, written on a queue of its own so that a slow disk never holds the
/// screen. At most 4 MiB wait for the disk; beyond that bytes are dropped and counted
/// (``trouble``: `Ctrl-T s` and `Ctrl-T f` say it).
final class TermLog: Sendable {
    let path: String
    private let fd: Int32
    private let queue = DispatchQueue(label: "transportkit-term-log")
    /// Bytes handed to the queue and not yet written; bytes dropped; the first write error.
    private let state = Locked<(pending: Int, lost: Int, failure: Errno?)>((0, 0, nil))
    static let pendingLimit = 4 << 20

    /// Opens `path` for appending as `spy.file=` traces are (UserPath: never through another
    /// user's link, a new file owner-only, the open never waiting), and takes only a regular file.
    static func open(path: String) async throws -> TermLog {
        let fd = try await UserPath.openForAppending(path, purpose: "the log file (--log)").rawValue
        var status = stat()
        guard fstat(fd, &status) == 0, (status.st_mode & S_IFMT) == S_IFREG else {
            _ = Glibc.close(fd)
            throw TransportError(.unsupported, "the log file \(TransportError.printable(path)) is not a regular file; name a file")
        }
        _ = fcntl(fd, F_SETFL, O_WRONLY | O_APPEND)   // writes wait for the disk (on the log's queue)
        return TermLog(path: path, fd: fd)
    }

    private init(path: String, fd: Int32) {
        self.path = path
        self.fd = fd
    }

    deinit { _ = Glibc.close(fd) }

    /// What went wrong, if anything: `nil`, or "12 bytes lost (the disk was slower than the device)".
    var trouble: String? {
        state.withLock { state in
            if let failure = state.failure { return "writing \(path) failed with \(failure.symbolicDescription) (\(failure.description)); later bytes are not logged" }
            return state.lost > 0 ? "\(state.lost) bytes were not logged: the disk was slower than the device" : nil
        }
    }

    func write(_ bytes: [UInt8]) {
        let take = state.withLock { state -> Bool in
            guard state.failure == nil else { return false }
            guard state.pending + bytes.count <= Self.pendingLimit else {
                state.lost += bytes.count
                return false
            }
            state.pending += bytes.count
            return true
        }
        guard take else { return }
        queue.async { [self] in
            let failure = writeFully(fd, bytes[...])
            state.withLock { state in
                state.pending -= bytes.count
                if let failure, state.failure == nil { state.failure = failure }
            }
        }
    }

    /// Waits until what was handed over is on its way to the disk.
    func flush() async {
        await withCheckedContinuation { continuation in queue.async { continuation.resume() } }
    }
}
