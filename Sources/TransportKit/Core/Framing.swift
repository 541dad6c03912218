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

    /// Writes `payload` as one frame that ``readFrame(_:maxLength:timeout:)`` with the same
    /// `framing` reads back whole, in one write:
    /// - `.delimiter(d)`: the payload, then `d`. A payload that contains `d` is refused (the
    ///   reader would cut it there).
    /// - `.fixedLength(n)`: the payload, which must be exactly `n` bytes.
    /// - `.lengthPrefixed(p)`: the length field, then the payload; refused when the payload does
    ///   not fit the field (more than 255 bytes for `.uint8`, 65,535 for `.uint16`).
    /// - `.interByteTimeout`: the payload as it is; the reader cuts it where the line goes
    ///   silent, so leave the gap before the next frame.
    ///
    /// - Throws: `.misuse` for a payload the framing cannot carry (nothing is written), and what
    ///   `write(_:)` throws.
    ///
    /// ```swift
    /// try await connection.writeFrame(Array("hello".utf8), .lengthPrefixed(.uint16(.big)))   // 00 05 h e l l o
    /// try await modem.writeFrame(Array("ATZ".utf8), .delimiter("\r"))
    /// ```
    public func writeFrame(_ payload: [UInt8], _ framing: Framing) async throws {
        switch framing {
        case .delimiter(let delimiter):
            precondition(!delimiter.isEmpty, "the delimiter must not be empty")
            // Searched in the payload with its delimiter: a delimiter that overlaps itself ("\r\n\r\n"
            // after a payload ending in "\r\n") would otherwise end the frame early.
            if let at = Self.firstIndex(of: delimiter, in: payload + delimiter), at < payload.count {
                throw TransportError.misuse("a frame for \(url.shown) contains its delimiter at byte \(at); the reader would cut it there "
                                            + "(escape it, or use .lengthPrefixed framing)")
            }
            try await write(payload + delimiter)
        case .fixedLength(let length):
            guard payload.count == length else {
                throw TransportError.misuse("a \(payload.count)-byte frame for \(url.shown) is not the framing's \(length) bytes")
            }
            try await write(payload)
        case .lengthPrefixed(let prefix):
            guard payload.count <= prefix.maximum else {
                throw TransportError.misuse("a \(payload.count)-byte frame does not fit a \(prefix.width)-byte length field (at most \(prefix.maximum) bytes)")
            }
            try await write(prefix.encode(payload.count) + payload)
        case .interByteTimeout:
            try await write(payload)
        }
    }

    /// Writes `payload` behind its length field: ``writeFrame(_:_:)`` with `.lengthPrefixed(prefix)`.
    @available(*, deprecated, message: "write writeFrame(payload, .lengthPrefixed(prefix)), as readFrame spells it")
    public func writeFrame(_ payload: [UInt8], prefix: LengthPrefix) async throws {
        try await writeFrame(payload, .lengthPrefixed(prefix))
    }

    /// Where `pattern` first starts in `bytes`, if it does.
    private static func firstIndex(of pattern: [UInt8], in bytes: [UInt8]) -> Int? {
        guard bytes.count >= pattern.count else { return nil }
        return (0...(bytes.count - pattern.count)).first { start in
            bytes[start] == pattern[0] && bytes[start..<(start + pattern.count)].elementsEqual(pattern)
        }
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
/// ```swift
/// let elm = CommandSession(try await Transport.connect(to: "tcp://192.168.0.10:35000"), terminator: ">")
/// _ = try await elm.send("ATZ", timeout: .seconds(10))   // reset: slower than other commands
/// let voltage = try await elm.send("ATRV")                // "12.6V", without the echo "ATRV"
/// ```
///
/// **The echo.** Devices such as ELM327 adapters echo each command before its answer (`ATE1`,
/// the adapter's default). By default (``EchoHandling/strip``) the session removes a first line
/// that is exactly the command as sent, with its line ending, so ``send(_:timeout:)`` returns just
/// the answer. A response without that line (a device that does not echo, or an ELM327 after
/// `ATE0`) is returned as is. With `echo: .keep` the response is returned as the device sent it,
/// echo included.
///
/// **Timeouts and late answers.** Each command waits ``timeout`` for its prompt, or the `timeout`
/// given to ``send(_:timeout:)``. A command that times out, or whose task is cancelled, leaves its
/// answer on the way: the device still owes it. The session counts these owed answers, and three rules keep a command from
/// reading an earlier command's answer:
///
/// 1. Before a command is sent, every complete response that has already arrived is dropped: a
///    response received before the command was sent is not its answer (a late answer, or a power-up
///    banner). An owed answer among them is paid.
/// 2. Then the session waits up to ``lateAnswerWait`` (1 s by default) for each answer still
///    owed, and drops it. An owed answer that has not come by then is taken as lost, and the
///    command is sent. (An ELM327 stops what it is doing when a byte arrives; waiting for its
///    prompt first spares the next command a `STOPPED`.)
/// 3. With ``EchoHandling/strip``, a response that starts with the echo of a command that timed
///    out, not the one being sent, is that command's late answer however late it comes: it is
///    dropped and the session reads on for the right one.
///
/// With a device that echoes, an answer is never taken for another command's, however late it
/// is. Two cases remain, both bounded to one answer:
///
/// - A device that does not echo and answers a timed-out command after ``lateAnswerWait``: the
///   late answer is read as the next command's. The answer it displaced, once arrived, is dropped
///   by rule 1 before the command after that, so the session is back in step. Give such a device a
///   longer ``lateAnswerWait``, or leave its echo on.
/// - The same command sent again after it timed out: the echo cannot tell its late answer from the
///   new one. The session returns the first (the same question's answer, older), and drops the
///   other before a later command (rule 1, or rule 3 for another command).
///
/// `lateAnswerWait: nil` turns rules 1 and 2 off: every response is then read in turn, a late one
/// as the next command's.
public struct CommandSession: Sendable {
    /// What the session does with a device's echo of each command; see ``CommandSession/echo``.
    public enum EchoHandling: Sendable, Equatable {
        /// Remove a first line that is exactly the command as sent (and the line ending after
        /// it), and drop a response that starts with the echo of a command that timed out (its
        /// late answer). A response without the echo is returned as is. The default.
        case strip
        /// Return each response as the device sent it, echo included. Late answers are then
        /// recognised by time only (``CommandSession/lateAnswerWait``).
        case keep
    }

    /// The device's connection.
    public let connection: Connection
    /// The prompt that ends every response, such as `>`.
    public var terminator: [UInt8]
    /// What ends every command, such as `\r`.
    public var lineEnding: String
    /// How long a response may take, unless ``send(_:timeout:)`` is given a timeout of its own.
    public var timeout: Duration
    /// Drop every byte that is already buffered before each command, a partial response too.
    public var discardStaleInput: Bool
    /// After a timed-out command: how long the next command first waits for that late answer's
    /// prompt, dropping everything up to it. `nil` turns resynchronisation off (a late answer is
    /// then read as the next command's response, and responses that arrived unasked are not
    /// dropped). Default 1 second. See ``CommandSession`` for the rules.
    public var lateAnswerWait: Duration?
    /// What to do with the device's echo of each command: ``EchoHandling/strip`` (the default)
    /// removes it and recognises late answers by it, ``EchoHandling/keep`` returns it.
    public var echo: EchoHandling
    /// Answers still owed by the device, shared by copies of this session.
    private let pending: PendingAnswers

    /// A session on `connection` whose responses end with `terminator`.
    ///
    /// ```swift
    /// let elm = CommandSession(connection, terminator: ">")                 // echo removed
    /// let raw = CommandSession(connection, terminator: ">", echo: .keep)    // "ATRV\n12.6V"
    /// ```
    public init(_ connection: Connection, terminator: String = ">", lineEnding: String = "\r",
                timeout: Duration = .seconds(5), discardStaleInput: Bool = false,
                lateAnswerWait: Duration? = .seconds(1), echo: EchoHandling = .strip) {
        self.connection = connection
        self.terminator = Array(terminator.utf8)
        self.lineEnding = lineEnding
        self.timeout = timeout
        self.discardStaleInput = discardStaleInput
        self.lateAnswerWait = lateAnswerWait
        self.echo = echo
        pending = PendingAnswers()
    }

    /// A session that removes the echo when `stripsEcho` is set, and returns it otherwise.
    @available(*, deprecated, message: "use echo: .strip (now the default) or echo: .keep")
    public init(_ connection: Connection, terminator: String = ">", lineEnding: String = "\r",
                timeout: Duration = .seconds(5), discardStaleInput: Bool = false,
                lateAnswerWait: Duration? = .seconds(1), stripsEcho: Bool) {
        self.init(connection, terminator: terminator, lineEnding: lineEnding, timeout: timeout,
                  discardStaleInput: discardStaleInput, lateAnswerWait: lateAnswerWait, echo: stripsEcho ? .strip : .keep)
    }

    /// `true` when ``echo`` is ``EchoHandling/strip``.
    @available(*, deprecated, message: "use echo: .strip (now the default) or echo: .keep")
    public var stripsEcho: Bool {
        get { echo == .strip }
        set { echo = newValue ? .strip : .keep }
    }

    /// Sends `command` plus ``lineEnding`` and returns the response text before the prompt,
    /// without the command's echo (see ``echo``): runs of CR/LF become single newlines, and blank
    /// space around the text is trimmed.
    ///
    /// ```swift
    /// let voltage = try await elm.send("ATRV")                            // the session's timeout
    /// let pids = try await elm.send("0100", timeout: .seconds(10))        // this command's own
    /// ```
    ///
    /// - Parameters:
    ///   - command: the command without its line ending, such as `"ATRV"`.
    ///   - timeout: how long this command's response may take; `nil` (the default) takes the
    ///     session's ``timeout``. The wait for an earlier command's late answer
    ///     (``lateAnswerWait``) comes before this one and is not part of it.
    /// - Throws: `.timedOut` when the prompt does not come in time (the session then expects the
    ///   answer late, see ``CommandSession``); `.disconnected` when the device closes first.
    public func send(_ command: String, timeout: Duration? = nil) async throws -> String {
        let response = try await request(Array((command + lineEnding).utf8), timeout: timeout)
        let text = String(decoding: response, as: UTF8.self)
            .split(omittingEmptySubsequences: true) { $0 == "\r" || $0 == "\n" || $0 == "\r\n" }
            .joined(separator: "\n")
        return text.trimmingBlanks()
    }

    /// Writes `bytes` and returns what arrives before the terminator (not included), without the
    /// echo of `bytes` (their trailing CR/LF removed) when ``echo`` is ``EchoHandling/strip``.
    ///
    /// ```swift
    /// let reply = try await elm.request(Array("ATRV\r".utf8), timeout: .seconds(2))   // "12.6V\r\r"
    /// ```
    ///
    /// - Parameters:
    ///   - bytes: the command as the device takes it, line ending included.
    ///   - timeout: how long the response may take; `nil` takes the session's ``timeout``.
    /// - Throws: `.timedOut` when the prompt does not come in time; the session then expects that
    ///   answer late (see ``lateAnswerWait``).
    public func request(_ bytes: [UInt8], timeout: Duration? = nil) async throws -> [UInt8] {
        let timeout = timeout ?? self.timeout
        try await resynchronise()
        if discardStaleInput {
            while let stale = try? await connection.readBuffer(timeout: .milliseconds(1)), stale.readableBytes > 0 {}
        }
        try await connection.write(bytes)
        let sent = Array(Self.commandEcho(of: bytes))
        let matchesEcho = echo == .strip && !sent.isEmpty
        let clock = ContinuousClock()
        let deadline = clock.now.advanced(by: timeout)
        do {
            while true {
                let remaining = clock.now.duration(to: deadline)
                guard remaining > .zero else { throw TransportError(.timedOut, "skipping late answers took the whole timeout") }
                guard let response = try await connection.readFrame(.delimiter(terminator), timeout: remaining) else {
                    throw TransportError(.disconnected, "\(connection.url.shown) closed before answering")
                }
                guard matchesEcho else { return response }
                // The echo is the whole first line: "01" does not echo "010C".
                let start = response.drop { $0 == 0x0D || $0 == 0x0A }
                let firstLine = start.prefix { $0 != 0x0D && $0 != 0x0A }
                if firstLine.elementsEqual(sent) {
                    return Array(start.dropFirst(sent.count).drop { $0 == 0x0D || $0 == 0x0A })
                }
                // The echo of a command that timed out: its late answer, dropped (rule 3).
                // Anything else is returned as is: a device that does not echo (ELM327 after ATE0).
                guard pending.isLateAnswer(firstLine: Array(firstLine), sending: sent) else { return response }
            }
        } catch let error as TransportError where error.kind == .timedOut {
            pending.owe(sent)
            throw TransportError(.timedOut, "\(connection.url.shown) did not answer with '\(String(decoding: terminator, as: UTF8.self))' within \(timeout.secondsText); is the device on and at the right bit rate?")
        } catch let error as CancellationError {
            // The command went out: its answer is still coming.
            pending.owe(sent)
            throw error
        }
    }

    /// Rules 1 and 2 (see ``CommandSession``): drops the responses that have already arrived, then
    /// waits up to ``lateAnswerWait`` for each answer still owed and drops it. Bytes of a response
    /// not yet complete stay unread, for the late-answer check of the next read.
    private func resynchronise() async throws {
        guard let wait = lateAnswerWait else { return }
        // A bound for a device that talks without end (an ELM327 in monitor mode).
        for _ in 0..<256 {
            let owed = pending.awaited > 0
            let look: Duration = owed ? wait : .milliseconds(1)
            let response: [UInt8]?
            do {
                response = try await connection.readFrame(.delimiter(terminator), timeout: look)
            } catch let error as TransportError where error.kind == .timedOut {
                // Nothing more has arrived; an owed answer that has not come is taken as lost.
                if owed { pending.giveUp() }
                return
            }
            // The stream ended: the write or the read of the command reports it.
            guard let response else { return }
            let start = response.drop { $0 == 0x0D || $0 == 0x0A }
            pending.dropped(firstLine: Array(start.prefix { $0 != 0x0D && $0 != 0x0A }))
        }
    }

    /// The command as a device echoes it: the bytes sent without the trailing line ending.
    private static func commandEcho(of bytes: [UInt8]) -> ArraySlice<UInt8> {
        var end = bytes.endIndex
        while end > bytes.startIndex, bytes[end - 1] == 0x0D || bytes[end - 1] == 0x0A { end -= 1 }
        return bytes[..<end]
    }
}

/// What a ``CommandSession`` remembers between commands: how many owed answers the next command
/// waits for, and the echoes of the commands that timed out (to recognise their late answers).
private final class PendingAnswers: Sendable {
    private struct State {
        /// Owed answers the next command waits for (rule 2), up to `lateAnswerWait` each.
        var awaited = 0
        /// The echoes of timed-out commands whose answers have not been seen, oldest first, at
        /// most 16. Kept after the wait for them gives up, so a later answer is still known (rule 3).
        var late: [[UInt8]] = []
    }
    /// Guards the state; a session is used by one task at a time, copies share it.
    private let state = Locked(State())

    var awaited: Int { state.withLock { $0.awaited } }

    /// The command that echoes `echo` was sent and its answer did not come in time. An empty
    /// command has no echo to recognise its answer by.
    func owe(_ echo: [UInt8]) {
        state.withLock { state in
            state.awaited += 1
            guard !echo.isEmpty else { return }
            state.late.append(echo)
            if state.late.count > 16 { state.late.removeFirst() }
        }
    }

    /// The answers awaited did not come within `lateAnswerWait`: taken as lost, and not waited for
    /// again. Their echoes are kept.
    func giveUp() { state.withLock { $0.awaited = 0 } }

    /// A response dropped before a command was sent, whose first line is `firstLine`: it pays for
    /// an awaited answer (answers come in turn), and forgets the echo it starts with. An echo is
    /// forgotten only when seen, so a late answer is still known after a response without echo.
    func dropped(firstLine: [UInt8]) {
        state.withLock { state in
            if let index = state.late.firstIndex(of: firstLine) { state.late.remove(at: index) }
            state.awaited = max(0, state.awaited - 1)
        }
    }

    /// Whether a response whose first line is `firstLine`, read for the command that echoes
    /// `sending`, is the late answer of another command that timed out; if so it is paid for.
    /// The command's own echo is never late: a repeated command's late answer is taken as its own.
    func isLateAnswer(firstLine: [UInt8], sending: [UInt8]) -> Bool {
        guard firstLine != sending else { return false }
        return state.withLock { state in
            guard let index = state.late.firstIndex(of: firstLine) else { return false }
            state.late.remove(at: index)
            state.awaited = max(0, state.awaited - 1)
            return true
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
