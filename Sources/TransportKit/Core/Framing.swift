import NIOCore
import Synchronization

/// How a byte stream is cut into messages.
///
/// ```swift
/// for try await line in connection.frames(.delimiter("\n")) { … }
/// let header = try await connection.readFrame(.fixedLength(4))
/// let packet = try await connection.readFrame(.lengthPrefixed(.uint16(.big)), timeout: .seconds(2))
/// let burst = try await connection.readFrame(.interByteTimeout(.milliseconds(20)))
/// ```
public enum Framing: Sendable, Equatable {
    /// Up to (not including) a delimiter such as `\n`, `\r` or `>`. At the end of the stream the
    /// bytes after the last delimiter form a last frame.
    case delimiter([UInt8])
    /// Exactly this many bytes.
    case fixedLength(Int)
    /// A length field followed by that many bytes (the field is not part of the frame).
    case lengthPrefixed(LengthPrefix)
    /// Whatever arrives until the line stays silent for this long (after the first byte).
    case interByteTimeout(Duration)

    /// A text delimiter, such as `.delimiter("\r\n")`.
    public static func delimiter(_ text: String) -> Framing { .delimiter(Array(text.utf8)) }
}

/// The length field of ``Framing/lengthPrefixed(_:)``.
public enum LengthPrefix: Sendable, Equatable {
    /// The order of the field's bytes: most significant first (`big`, network order) or last.
    public enum ByteOrder: Sendable {
        /// Most significant byte first (network order).
        case big
        /// Least significant byte first.
        case little
    }
    /// One byte: frames of up to 255 bytes.
    case uint8
    /// Two bytes: frames of up to 65,535 bytes.
    case uint16(ByteOrder)
    /// Four bytes: frames of up to 4 GiB.
    case uint32(ByteOrder)

    var width: Int {
        switch self {
        case .uint8: 1
        case .uint16: 2
        case .uint32: 4
        }
    }

    var maximum: Int {
        switch self {
        case .uint8: Int(UInt8.max)
        case .uint16: Int(UInt16.max)
        case .uint32: Int(UInt32.max)
        }
    }

    func decode(_ bytes: [UInt8]) -> Int {
        let ordered: [UInt8]
        switch self {
        case .uint8, .uint16(.big), .uint32(.big): ordered = bytes
        case .uint16(.little), .uint32(.little): ordered = bytes.reversed()
        }
        return ordered.reduce(0) { $0 << 8 | Int($1) }
    }

    func encode(_ length: Int) -> [UInt8] {
        let big = (0..<width).reversed().map { UInt8(truncatingIfNeeded: length >> ($0 * 8)) }
        switch self {
        case .uint8, .uint16(.big), .uint32(.big): return big
        case .uint16(.little), .uint32(.little): return big.reversed()
        }
    }
}

extension Connection {
    /// Reads one frame. Returns `nil` when the stream ended before a frame began.
    ///
    /// - Parameters:
    ///   - framing: how the stream is cut into frames.
    ///   - maxLength: the longest frame accepted; a longer one throws `.io` and its bytes stay unread.
    ///   - timeout: a deadline for the whole frame. When it passes the partial frame stays unread
    ///     (the next read gets it) and `.timedOut` is thrown.
    /// - Throws: `.disconnected` when the stream ends inside a fixed-length or length-prefixed frame.
    public func readFrame(_ framing: Framing, maxLength: Int = 1 << 20, timeout: Duration? = nil) async throws -> [UInt8]? {
        // NIODeadline rather than ContinuousClock.Instant: the stdlib type is resilient, so every hop of
        // an optional Instant through the async calls below costs a metadata lookup and witness calls.
        let deadline: NIODeadline? = if let timeout { .now() + TimeAmount(timeout) } else { nil }
        switch framing {
        case .delimiter(let delimiter):
            precondition(!delimiter.isEmpty, "the delimiter must not be empty")
            return try await readUntil(delimiter, maxLength: maxLength, deadline: deadline)
        case .fixedLength(let length):
            precondition(length >= 0, "the length must not be negative")
            return try await readExactly(length, deadline: deadline)
        case .lengthPrefixed(let prefix):
            guard let field = try await readExactly(prefix.width, deadline: deadline, lengthField: true) else { return nil }
            let length = prefix.decode(field)
            guard length <= maxLength else {
                unread(ByteBuffer(bytes: field))
                throw TransportError(.io, "a length-prefixed frame from \(url.shown) announces \(length) bytes, more than maxLength \(maxLength)")
            }
            guard let payload = try await readExactly(length, deadline: deadline) else {
                throw TransportError(.disconnected, "\(url.shown) ended after a length field, before its \(length)-byte frame")
            }
            return payload
        case .interByteTimeout(let gap):
            return try await readUntilSilent(gap: gap, maxLength: maxLength, deadline: deadline)
        }
    }

    /// Reads one line (up to `\n`, a `\r` before it removed) as UTF-8 text; `nil` at the end.
    public func readLine(maxLength: Int = 1 << 16, timeout: Duration? = nil) async throws -> String? {
        guard var line = try await readFrame(.delimiter([UInt8(ascii: "\n")]), maxLength: maxLength, timeout: timeout) else {
            return nil
        }
        if line.last == UInt8(ascii: "\r") { line.removeLast() }
        return String(decoding: line, as: UTF8.self)
    }

    /// Writes `payload` behind its length field.
    public func writeFrame(_ payload: [UInt8], prefix: LengthPrefix) async throws {
        guard payload.count <= prefix.maximum else {
            throw TransportError(.io, "a \(payload.count)-byte frame does not fit a \(prefix.width)-byte length field")
        }
        try await write(prefix.encode(payload.count) + payload)
    }

    /// The frames of the inbound stream as an `AsyncSequence`; it ends with the stream.
    public func frames(_ framing: Framing, maxLength: Int = 1 << 20) -> Frames {
        Frames(connection: self, framing: framing, maxLength: maxLength)
    }

    /// Inbound lines as text; see ``readLine(maxLength:timeout:)``.
    public var lines: AsyncThrowingMapSequence<Frames, String> {
        frames(.delimiter([UInt8(ascii: "\n")]), maxLength: 1 << 16).map { line in
            String(decoding: line.last == UInt8(ascii: "\r") ? line.dropLast() : line[...], as: UTF8.self)
        }
    }

    /// An `AsyncSequence` of frames; see ``Connection/frames(_:maxLength:)``.
    public struct Frames: AsyncSequence, Sendable {
        /// One frame.
        public typealias Element = [UInt8]
        let connection: Connection
        let framing: Framing
        let maxLength: Int

        /// Reads the next frame on each call.
        public struct AsyncIterator: AsyncIteratorProtocol {
            let frames: Frames
            /// The next frame; `nil` at the end of the stream.
            public mutating func next() async throws -> [UInt8]? {
                try await frames.connection.readFrame(frames.framing, maxLength: frames.maxLength)
            }
        }

        /// An iterator over the frames; use one per connection.
        public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(frames: self) }
    }

    // MARK: Building blocks

    private func remaining(until deadline: NIODeadline?) throws -> Duration? {
        guard let deadline else { return nil }
        let left = deadline - .now()
        guard left > .zero else {
            throw TransportError(.timedOut, "no complete frame from \(url.shown) before the deadline")
        }
        return Duration(left)
    }

    /// Reads a chunk before `deadline`; on failure the bytes gathered so far go back unread.
    private func nextChunk(_ gathered: inout ByteBuffer, deadline: NIODeadline?) async throws -> ByteBuffer? {
        do {
            return try await readBuffer(timeout: try remaining(until: deadline))
        } catch {
            unread(gathered)
            gathered.clear()
            if let error = error as? TransportError, error.kind == .timedOut {
                throw TransportError(.timedOut, "no complete frame from \(url.shown) within the timeout; the partial frame stays unread")
            }
            throw error
        }
    }

    private func readUntil(_ delimiter: [UInt8], maxLength: Int, deadline: NIODeadline?) async throws -> [UInt8]? {
        var gathered = ByteBuffer()
        var searchFrom = 0
        while true {
            let view = gathered.readableBytesView
            if let end = view.firstRange(of: delimiter, from: searchFrom) {
                // A delimiter found in a chunk that brought many bytes at once can still end a
                // frame that is too long.
                guard end.lowerBound - view.startIndex <= maxLength else { throw tooLong(gathered, maxLength) }
                let frame = Array(view[view.startIndex..<end.lowerBound])
                gathered.moveReaderIndex(forwardBy: end.upperBound - view.startIndex)
                unread(gathered)
                return frame
            }
            if gathered.readableBytes > maxLength + delimiter.count { throw tooLong(gathered, maxLength) }
            searchFrom = max(0, gathered.readableBytes - delimiter.count + 1)
            guard var chunk = try await nextChunk(&gathered, deadline: deadline) else {
                // The stream ended: the bytes after the last delimiter are the last frame.
                guard gathered.readableBytes <= maxLength else { throw tooLong(gathered, maxLength) }
                return gathered.readableBytes > 0 ? Array(gathered.readableBytesView) : nil
            }
            gathered.writeBuffer(&chunk)
        }
    }

    /// Puts `gathered` back and returns the error for a delimited frame longer than `maxLength`.
    private func tooLong(_ gathered: ByteBuffer, _ maxLength: Int) -> TransportError {
        unread(gathered)
        return TransportError(.io, "no delimiter within \(maxLength) bytes from \(url.shown); the bytes stay unread")
    }

    private func readExactly(_ length: Int, deadline: NIODeadline?, lengthField: Bool = false) async throws -> [UInt8]? {
        var gathered = ByteBuffer()
        while gathered.readableBytes < length {
            guard var chunk = try await nextChunk(&gathered, deadline: deadline) else {
                if gathered.readableBytes == 0 { return nil }
                let what = lengthField ? "a length field" : "a \(length)-byte frame"
                throw TransportError(.disconnected, "\(url.shown) ended after \(gathered.readableBytes) bytes of \(what)")
            }
            // The whole frame in one chunk (the usual case): no copy into `gathered`.
            if gathered.readableBytes == 0, let frame = chunk.readBytes(length: length) {
                unread(chunk)
                return frame
            }
            gathered.writeBuffer(&chunk)
        }
        let frame = Array(gathered.readableBytesView.prefix(length))
        gathered.moveReaderIndex(forwardBy: length)
        unread(gathered)
        return frame
    }

    private func readUntilSilent(gap: Duration, maxLength: Int, deadline: NIODeadline?) async throws -> [UInt8]? {
        var gathered = ByteBuffer()
        guard var first = try await nextChunk(&gathered, deadline: deadline) else { return nil }
        gathered.writeBuffer(&first)
        while gathered.readableBytes < maxLength {
            do {
                guard var chunk = try await readBuffer(timeout: gap) else { break }
                gathered.writeBuffer(&chunk)
            } catch let error as TransportError where error.kind == .timedOut {
                break
            }
        }
        let frame = Array(gathered.readableBytesView.prefix(maxLength))
        gathered.moveReaderIndex(forwardBy: frame.count)
        unread(gathered)
        return frame
    }
}

extension ByteBufferView {
    /// The first occurrence of `needle` at or after offset `from` (relative to the view's start).
    func firstRange(of needle: [UInt8], from: Int) -> Range<Int>? {
        guard count >= needle.count else { return nil }
        var index = startIndex + from
        let last = endIndex - needle.count
        while index <= last {
            if self[index] == needle[0] && self[index..<(index + needle.count)].elementsEqual(needle) {
                return index..<(index + needle.count)
            }
            index += 1
        }
        return nil
    }
}

/// Sends commands to a prompt-driven device and reads each response up to its prompt, such as the
/// `>` of ELM327 OBD-II adapters or a modem's `OK`.
///
/// A command that times out leaves its answer on the way. The session remembers that: before the
/// next command it waits up to ``lateAnswerWait`` for that late answer's prompt and drops it, so
/// the next response is the next command's, not the previous one's. With ``stripsEcho`` the echo
/// of the command (ELM327 adapters echo by default, `ATE1`) is removed from each response, and a
/// response that starts with an earlier command's echo is known to be stale and is skipped, even
/// when it comes later than ``lateAnswerWait``.
///
/// ```swift
/// var elm = CommandSession(connection, terminator: ">", lineEnding: "\r")
/// elm.stripsEcho = true
/// _ = try await elm.send("ATZ")                 // reset
/// let voltage = try await elm.send("ATRV")      // "12.6V"
/// ```
public struct CommandSession: Sendable {
    /// The device's connection.
    public let connection: Connection
    /// The prompt that ends every response, such as `>`.
    public var terminator: [UInt8]
    /// What ends every command, such as `\r`.
    public var lineEnding: String
    /// How long a response may take.
    public var timeout: Duration
    /// Drop every byte that is already buffered (anything unasked) before each command.
    public var discardStaleInput: Bool
    /// After a timed-out command: how long the next command first waits for the late answer's
    /// prompt, dropping everything up to it. `nil` turns this off (the late answer is then read as
    /// the next command's response). Default 1 second.
    public var lateAnswerWait: Duration?
    /// Remove the echo of the command (its whole first line) from the start of each response, and
    /// skip a response that starts with the echo of an earlier command (its late answer). For
    /// devices that echo, such as ELM327 adapters after reset; a response without an echo is
    /// returned as is.
    public var stripsEcho: Bool
    /// Late answers still owed by the device, shared by copies of this session.
    private let pending: PendingAnswers

    /// A session on `connection` whose responses end with `terminator`.
    public init(_ connection: Connection, terminator: String = ">", lineEnding: String = "\r",
                timeout: Duration = .seconds(5), discardStaleInput: Bool = false,
                lateAnswerWait: Duration? = .seconds(1), stripsEcho: Bool = false) {
        self.connection = connection
        self.terminator = Array(terminator.utf8)
        self.lineEnding = lineEnding
        self.timeout = timeout
        self.discardStaleInput = discardStaleInput
        self.lateAnswerWait = lateAnswerWait
        self.stripsEcho = stripsEcho
        pending = PendingAnswers()
    }

    /// Sends `command` plus the line ending and returns the response text before the prompt:
    /// runs of CR/LF become single newlines and surrounding blank space is trimmed. A device that
    /// echoes commands returns the echo as the first line unless ``stripsEcho`` is set.
    public func send(_ command: String) async throws -> String {
        let response = try await request(Array((command + lineEnding).utf8))
        let text = String(decoding: response, as: UTF8.self)
            .split(omittingEmptySubsequences: true) { $0 == "\r" || $0 == "\n" || $0 == "\r\n" }
            .joined(separator: "\n")
        return text.trimmingBlanks()
    }

    /// Writes `bytes` and returns what arrives before the terminator (not included).
    /// Throws `.timedOut` when the prompt does not come within ``timeout``; the session then
    /// expects that answer late (see ``lateAnswerWait``).
    public func request(_ bytes: [UInt8]) async throws -> [UInt8] {
        try await dropLateAnswers()
        if discardStaleInput {
            while let stale = try? await connection.readBuffer(timeout: .milliseconds(1)), stale.readableBytes > 0 {}
        }
        try await connection.write(bytes)
        let echo = Self.echo(of: bytes)
        let earlier = pending.sent(Array(echo))
        let clock = ContinuousClock()
        let deadline = clock.now.advanced(by: timeout)
        do {
            while true {
                let remaining = clock.now.duration(to: deadline)
                guard remaining > .zero else { throw TransportError(.timedOut, "skipping stale answers took the whole timeout") }
                guard let response = try await connection.readFrame(.delimiter(terminator), timeout: remaining) else {
                    throw TransportError(.disconnected, "\(connection.url.shown) closed before answering")
                }
                guard stripsEcho, !echo.isEmpty else { return response }
                // The echo is the whole first line: "01" does not echo "010C".
                let start = response.drop { $0 == 0x0D || $0 == 0x0A }
                let firstLine = start.prefix { $0 != 0x0D && $0 != 0x0A }
                if firstLine.elementsEqual(echo) {
                    return Array(start.dropFirst(echo.count).drop { $0 == 0x0D || $0 == 0x0A })
                }
                // The echo of an earlier command: that command's late answer. Skip it.
                // Anything else is returned as is: a device that does not echo (ELM327 after ATE0).
                guard earlier.contains(where: { firstLine.elementsEqual($0) }) else { return response }
                pending.settle(1)
            }
        } catch let error as TransportError where error.kind == .timedOut {
            pending.add()
            throw TransportError(.timedOut, "\(connection.url.shown) did not answer with '\(String(decoding: terminator, as: UTF8.self))' within \(timeout.secondsText); is the device on and at the right bit rate?")
        }
    }

    /// Reads and drops late answers owed by the device, waiting up to ``lateAnswerWait`` for each.
    /// An answer that does not come by then is taken as never coming.
    private func dropLateAnswers() async throws {
        guard let wait = lateAnswerWait else { return }
        while pending.count > 0 {
            do {
                guard try await connection.readFrame(.delimiter(terminator), timeout: wait) != nil else {
                    throw TransportError(.disconnected, "\(connection.url.shown) closed before answering")
                }
                pending.settle(1)
            } catch let error as TransportError where error.kind == .timedOut {
                pending.settle(pending.count)
            }
        }
    }

    /// The command as a device echoes it: the bytes sent without the trailing line ending.
    private static func echo(of bytes: [UInt8]) -> ArraySlice<UInt8> {
        var end = bytes.endIndex
        while end > bytes.startIndex, bytes[end - 1] == 0x0D || bytes[end - 1] == 0x0A { end -= 1 }
        return bytes[..<end]
    }
}

/// What a ``CommandSession`` remembers between commands: the answers it still expects late, and
/// the echoes of the last commands sent (to recognise a late answer by its echo).
private final class PendingAnswers: Sendable {
    private struct State {
        var late = 0
        var echoes: [[UInt8]] = []
    }
    /// Guards the state; a session is used by one task at a time, copies share it.
    private let state = Mutex(State())

    var count: Int { state.withLock { $0.late } }
    func add() { state.withLock { $0.late += 1 } }
    func settle(_ answers: Int) { state.withLock { $0.late = max(0, $0.late - answers) } }

    /// Records `echo` as sent and returns the echoes of up to 16 earlier commands that differ
    /// from it (a repeated command's late answer cannot be told from its own).
    func sent(_ echo: [UInt8]) -> [[UInt8]] {
        state.withLock { state in
            let earlier = state.echoes.filter { $0 != echo }
            state.echoes.append(echo)
            if state.echoes.count > 16 { state.echoes.removeFirst() }
            return earlier
        }
    }
}

extension String {
    func trimmingBlanks() -> String {
        let blanks: Set<Character> = [" ", "\t", "\n", "\r"]
        guard let first = firstIndex(where: { !blanks.contains($0) }),
              let last = lastIndex(where: { !blanks.contains($0) }) else { return "" }
        return String(self[first...last])
    }
}
