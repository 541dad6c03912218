import Logging
import NIOCore
import Synchronization

/// A connected, bidirectional byte stream (or message stream, where the transport has messages).
///
/// Get one from ``TransportRegistry/connect(to:buffering:)-(String,_)`` (or `Transport.connect(to:)` in the
/// `TransportKit` module). Read with ``read(maxBytes:timeout:)`` or iterate ``inbound``; write with
/// ``write(_:)-(Sequence<UInt8>)``; finish with ``close()``. Writes suspend while the peer is slow:
/// nothing in between buffers without bound.
///
/// ```swift
/// let connection = try await Transport.connect(to: "tcp://127.0.0.1:4000")
/// try await connection.write("hello\n")
/// for try await chunk in connection.inbound {
///     print(String(decoding: chunk, as: UTF8.self))
/// }
/// try await connection.close()
/// ```
///
/// Reading is for one task at a time; a second concurrent read throws
/// ``TransportError/Kind/misuse``. Writing from several tasks is allowed; each write's bytes stay
/// together, also where the transport's MTU splits them into several transfers.
///
/// A connection that wraps another (`spy+tcp://…`) is transparent: ``metadata``,
/// ``preferredExecutor`` and transport controls (`serialPort`) reach the wrapped transport.
public final class Connection: Sendable {
    /// The URL this connection was made for (for accepted connections: the peer's URL).
    public let url: TransportURL
    private let backend: any ConnectionBackend
    /// The connection `backend` wraps, when it is a ``WrappingBackend``.
    private let wrapped: Connection?
    private let state: Locked<State>
    private let counters: Counters
    /// Whose turn it is to write, on transports whose writes are chunked to an MTU (so the chunks
    /// of one write are not interleaved with another's). Unused elsewhere.
    private let writeTurn = AsyncCondition(false)

    private struct State {
        var metadata: ConnectionMetadata
        /// Bytes read from the backend but not yet handed out (a chunk larger than `maxBytes`, the
        /// rest of a message, bytes a framing helper read past a frame's end), with the kind of
        /// the message they came from.
        var leftover: TransportMessage?
        var reading = false
        var closed = false
        /// The backend's close() returned: nothing is left for abort() to release.
        var closeFinished = false
        var writeClosed = false
        var logger: Logger?
        /// How the stream ended, once a read saw it end (nil: not yet): for ``events()``.
        var ending: ConnectionEvent?
        /// Made at the first ``events()`` call on a connection that reports no events of its own.
        var events: ConnectionEventBroadcaster?
    }

    private final class Counters: Sendable {
        let read = Atomic<Int>(0)
        let written = Atomic<Int>(0)
    }

    /// Wraps a plugin's backend. Plugins call this; applications get connections from the registry.
    ///
    /// ```swift
    /// return Connection(url: request.url, backend: backend, metadata: ConnectionMetadata(name: "echo"))
    /// ```
    @_spi(Plugins)
    public init(url: TransportURL, backend: any ConnectionBackend, metadata: ConnectionMetadata = ConnectionMetadata()) {
        self.url = url
        self.backend = backend
        self.wrapped = (backend as? any WrappingBackend)?.wrapped
        self.state = Locked(State(metadata: metadata))
        self.counters = Counters()
    }

    deinit {
        // Dropped without close(): the backend releases its resources at once.
        if !state.withLock({ $0.closed }) { backend.connectionDropped() }
    }

    /// What the transport knows about the peer (for a wrapper: what the wrapped transport knows;
    /// for `reconnect+URL`: what the connection up now knows).
    public var metadata: ConnectionMetadata {
        wrapped?.metadata ?? (backend as? any ConnectionEventSource)?.currentMetadata ?? state.withLock { $0.metadata }
    }

    // MARK: Events

    /// What happens to this connection, as it happens: the latest event first (`.connected` for
    /// one that is up), then each later one, until `.closed`. A `reconnect+URL` connection reports
    /// its losses, attempts and new connections; a plain one `.connected(generation: 1)`, a
    /// `.disconnected` when a read finds its stream ended, and `.closed`. Each call is a new
    /// subscriber; a subscriber that does not keep up gets the newest 64 events.
    ///
    /// ```swift
    /// for await event in connection.events() {
    ///     if case .connected(let generation) = event, generation > 1 { print("back, a new stream") }
    /// }
    /// ```
    public func events() -> AsyncStream<ConnectionEvent> {
        if let source = firstBackend((any ConnectionEventSource).self) { return source.events.subscribe() }
        let broadcaster = state.withLock { state in
            if let events = state.events { return events }
            let events = ConnectionEventBroadcaster(state.closed ? .closed : state.ending ?? .connected(generation: 1))
            state.events = events
            return events
        }
        return broadcaster.subscribe()
    }

    /// How many underlying connections this one has had: 1, and for `reconnect+URL` one more each
    /// time it connected again. A reader that sees it grow knows the bytes that follow come from a
    /// new stream (what the device sent in between is lost, and a protocol may need to start over).
    ///
    /// ```swift
    /// let before = connection.generation
    /// let reply = try await connection.read()
    /// if connection.generation != before { /* the reply may be from the device's new session */ }
    /// ```
    public var generation: Int {
        firstBackend((any ConnectionEventSource).self)?.generation ?? 1
    }

    /// A read found the stream's end (`error` nil) or failure: reported once, to ``events()``.
    private func streamEnded(_ error: TransportError?) {
        let event = ConnectionEvent.disconnected(error, nextAttempt: nil)
        let events = state.withLock { state -> ConnectionEventBroadcaster? in
            guard state.ending == nil, !state.closed else { return nil }
            state.ending = event
            return state.events
        }
        events?.emit(event)
    }

    /// Bytes handed to the application so far.
    public var bytesRead: Int { counters.read.load(ordering: .relaxed) }
    /// Bytes accepted from the application so far.
    public var bytesWritten: Int { counters.written.load(ordering: .relaxed) }
    /// `true` when ``closeWrite()`` is available on this transport.
    public var supportsHalfClose: Bool { backend.supportsHalfClose }
    /// `true` when the transport carries messages: ``readMessage(timeout:)`` returns one whole
    /// message and ``writeMessage(_:)-([UInt8])`` sends one.
    public var carriesMessages: Bool { backend.carriesMessages }
    /// The most bytes the transport takes in one write (its MTU), or `nil` for no limit; longer
    /// writes are sent in chunks of this size, longer messages refused.
    public var maximumWriteSize: Int? { backend.maximumWriteSize }

    /// An executor on the thread that does this connection's I/O, when the transport has one
    /// (unix://, tty://, tls:// do; loop:// and tcp://, whose reads and writes are system calls on
    /// the calling task's thread, do not). A request/response loop that runs with this executor
    /// preferred is resumed where the reply was read, inside that read, and runs until it next
    /// suspends before the I/O thread goes on: no thread hop and no queueing per read. With `nil`
    /// the preference changes nothing, so code may always ask for it.
    ///
    /// ```swift
    /// let connection = try await Transport.connect(to: "unix:///run/obd.sock")
    /// try await withTaskExecutorPreference(connection.preferredExecutor) {
    ///     try await connection.write(Array("ATZ\r".utf8))
    ///     _ = try await connection.readFrame(.delimiter(Array(">".utf8)))
    /// }
    /// ```
    ///
    /// Never block a thread inside such a task: other connections share that I/O thread.
    public var preferredExecutor: (any TaskExecutor)? { backend.preferredExecutor }

    // MARK: Reading

    /// Reads the next bytes that arrive, at most `maxBytes` of them.
    ///
    /// Returns `nil` at the end of the stream (the peer closed or half-closed). Throws
    /// ``TransportError`` with kind `.timedOut` when `timeout` passes with no byte; no byte is lost
    /// then, the next read gets it. Throws `CancellationError` when the task is cancelled. On a
    /// transport with messages, bytes are read across message boundaries.
    ///
    /// ```swift
    /// let reply = try await connection.read(timeout: .seconds(2))
    /// ```
    public func read(maxBytes: Int = 65536, timeout: Duration? = nil) async throws -> [UInt8]? {
        guard let buffer = try await readBuffer(maxBytes: maxBytes, timeout: timeout) else { return nil }
        return Array(buffer.readableBytesView)
    }

    /// Like ``read(maxBytes:timeout:)`` without copying out of the transport's buffer.
    public func readBuffer(maxBytes: Int = 65536, timeout: Duration? = nil) async throws -> ByteBuffer? {
        precondition(maxBytes > 0, "maxBytes must be positive")
        return try await readChunk(maxBytes: maxBytes, timeout: timeout)
    }

    /// Reads one whole message on a transport that carries messages (see ``carriesMessages``);
    /// `nil` at the end. If a byte read took only part of a message, this returns the rest of it.
    ///
    /// ```swift
    /// let connection = try await Transport.connect(to: "loop://?messages=true")
    /// try await connection.writeMessage(Array("one".utf8))
    /// let message = try await connection.readMessage()   // "one", whole
    /// ```
    ///
    /// - Throws: ``TransportError/Kind/unsupported`` on a byte stream, which has no message
    ///   boundaries (use ``readFrame(_:maxLength:timeout:)``); as ``read(maxBytes:timeout:)`` otherwise.
    public func readMessage(timeout: Duration? = nil) async throws -> [UInt8]? {
        guard let buffer = try await readMessageBuffer(timeout: timeout) else { return nil }
        return Array(buffer.readableBytesView)
    }

    /// Like ``readMessage(timeout:)`` without copying out of the transport's buffer.
    public func readMessageBuffer(timeout: Duration? = nil) async throws -> ByteBuffer? {
        guard carriesMessages else {
            throw TransportError(.unsupported, "\(url.scheme):// carries a byte stream without message boundaries; read bytes, or cut them with readFrame(_:)")
        }
        return try await readChunk(maxBytes: nil, timeout: timeout)
    }

    /// Reads one whole message with its kind (``TransportMessage/Kind/text`` or
    /// ``TransportMessage/Kind/binary``) on a transport that carries messages; `nil` at the end.
    /// Transports whose messages have no kind read `.binary`. If a byte read took only part of a
    /// message, this returns the rest of it, with that message's kind.
    ///
    /// ```swift
    /// let connection = try await Transport.connect(to: "ws://127.0.0.1:8765/")
    /// while let message = try await connection.nextMessage() {
    ///     if let text = message.text { print(text) } else { print("\(message.payload.readableBytes) bytes") }
    /// }
    /// ```
    ///
    /// - Throws: as ``readMessage(timeout:)``.
    public func nextMessage(timeout: Duration? = nil) async throws -> TransportMessage? {
        guard carriesMessages else {
            throw TransportError(.unsupported, "\(url.scheme):// carries a byte stream without message boundaries; read bytes, or cut them with readFrame(_:)")
        }
        return try await readUnit(maxBytes: nil, timeout: timeout)
    }

    /// The leftover, or the backend's next chunk; cut to `maxBytes` (nil: whole) with the rest kept.
    private func readChunk(maxBytes: Int?, timeout: Duration?) async throws -> ByteBuffer? {
        try await readUnit(maxBytes: maxBytes, timeout: timeout)?.payload
    }

    /// ``readChunk(maxBytes:timeout:)`` with the kind of the message the bytes came from.
    private func readUnit(maxBytes: Int?, timeout: Duration?) async throws -> TransportMessage? {
        // One lock: check the state, mark this task as the reader and take bytes put back earlier.
        let leftover = try state.withLock { state -> TransportMessage? in
            if state.closed { throw TransportError.misuse("read on a connection to \(url.shown) after close()") }
            if state.reading {
                throw TransportError.misuse("two tasks read \(url.shown) at once; read from one task, and hand the bytes to others")
            }
            state.reading = true
            defer { state.leftover = nil }
            return state.leftover
        }
        defer { state.withLock { $0.reading = false } }

        var chunk: TransportMessage
        if let leftover {
            chunk = leftover
        } else {
            let next: TransportMessage?
            do {
                next = if let timeout { try await readWithTimeout(timeout) } else { try await readBackend() }
            } catch let error as TransportError where error.kind != .timedOut && error.kind != .misuse && !error.isRefusedCall {
                // A read the connection does not offer (usb://…?controlOnly=true) leaves it up.
                streamEnded(error)
                throw error
            }
            guard let next else {
                streamEnded(nil)
                return nil
            }
            chunk = next
        }
        if let maxBytes, chunk.payload.readableBytes > maxBytes, let head = chunk.payload.readSlice(length: maxBytes) {
            let rest = chunk
            state.withLock { $0.leftover = rest }
            chunk.payload = head
        }
        counters.read.add(chunk.payload.readableBytes, ordering: .relaxed)
        return chunk
    }

    /// The backend's next chunk; a message with its kind where the transport carries messages
    /// (the default `readMessage()` is `read()`'s chunk, as binary).
    private func readBackend() async throws -> TransportMessage? {
        try await backend.readMessage()
    }

    /// Puts bytes back in front of the stream; the next read returns them first. Framing helpers
    /// use it for bytes they read past a frame's end.
    func unread(_ bytes: ByteBuffer) {
        guard bytes.readableBytes > 0 else { return }
        counters.read.subtract(bytes.readableBytes, ordering: .relaxed)
        state.withLock { state in
            if var leftover = state.leftover {
                var combined = bytes
                combined.writeBuffer(&leftover.payload)
                leftover.payload = combined
                state.leftover = leftover
            } else {
                state.leftover = TransportMessage(.binary, bytes)
            }
        }
    }

    /// The backend's next chunk, or a ``TransportError/Kind/timedOut`` error when `timeout`
    /// passes first. If both happen, the bytes win: a read that completed is never dropped.
    private func readWithTimeout(_ timeout: Duration) async throws -> TransportMessage? {
        do {
            return try await backend.readMessage(deadline: .now + timeout)
        } catch is ReadDeadlinePassed {
            throw TransportError(.timedOut, "no data from \(url.shown) within \(timeout.secondsText)")
        }
    }

    /// The inbound bytes as an `AsyncSequence` of chunks; it ends when the peer closes and throws
    /// when the connection fails. Iterate it from one task.
    public var inbound: InboundBytes { InboundBytes(connection: self) }

    /// The inbound side of a ``Connection`` as an `AsyncSequence` of byte chunks.
    public struct InboundBytes: AsyncSequence, Sendable {
        /// A chunk of bytes as it arrived.
        public typealias Element = [UInt8]
        let connection: Connection

        /// Reads the next chunk on each call.
        public struct AsyncIterator: AsyncIteratorProtocol {
            let connection: Connection
            /// The next chunk; `nil` at the end of the stream.
            public mutating func next() async throws -> [UInt8]? {
                try await connection.read()
            }
        }

        /// An iterator over the chunks; use one per connection.
        public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(connection: connection) }
    }

    // MARK: Writing

    /// Writes `bytes`, suspending while the transport's buffer is full.
    ///
    /// ```swift
    /// try await connection.write([0x02, 0x10, 0x03])
    /// ```
    public func write(_ bytes: [UInt8]) async throws {
        try await write(ByteBuffer(bytes: bytes))
    }

    /// Writes `bytes`, suspending while the transport's buffer is full.
    public func write(_ bytes: some Sequence<UInt8>) async throws {
        var buffer = ByteBufferAllocator().buffer(capacity: bytes.underestimatedCount)
        buffer.writeBytes(bytes)
        try await write(buffer)
    }

    /// Writes the UTF-8 bytes of `text`.
    public func write(_ text: String) async throws {
        try await write(ByteBuffer(string: text))
    }

    /// Writes a `ByteBuffer` without copying it. On a transport with an MTU
    /// (``ConnectionBackend/maximumWriteSize``) the bytes go out in chunks of at most that size,
    /// and no other write comes between them.
    public func write(_ buffer: ByteBuffer) async throws {
        try checkWritable()
        guard buffer.readableBytes > 0 else { return }
        if let limit = backend.maximumWriteSize {
            try await inTurn {
                if buffer.readableBytes <= limit {
                    try await backend.write(buffer)
                    counters.written.add(buffer.readableBytes, ordering: .relaxed)
                } else {
                    // Several records: the backend may send them all per wake-up.
                    let counters = counters
                    try await backend.writeRecords(buffer) { counters.written.add($0, ordering: .relaxed) }
                }
            }
        } else {
            try await backend.write(buffer)
            counters.written.add(buffer.readableBytes, ordering: .relaxed)
        }
    }

    /// The next piece of `rest` that fits the transport's MTU (read before each piece: it may
    /// change while connected); nil once `rest` is empty.
    private func nextChunk(of rest: inout ByteBuffer) -> ByteBuffer? {
        guard rest.readableBytes > 0 else { return nil }
        return rest.readSlice(length: min(max(1, backend.maximumWriteSize ?? rest.readableBytes), rest.readableBytes))
    }

    /// Writes `bytes` if the transport takes them within `timeout`, as pyserial's `write_timeout`:
    /// throws ``TransportError/Kind/timedOut`` when it does not (the peer stopped reading, flow
    /// control holds a serial port). On tcp, unix, tty, pty, rfcomm, tls and ws connections the
    /// write then sent nothing: it waits for room before it hands anything over. Elsewhere (and
    /// through wrappers such as spy+) part of it may have gone, and the error says so.
    ///
    /// ```swift
    /// do {
    ///     try await port.write(command, timeout: .seconds(1))
    /// } catch let error as TransportError where error.kind == .timedOut {
    ///     print("the device is not reading: \(error.message)")
    /// }
    /// ```
    public func write(_ bytes: [UInt8], timeout: Duration) async throws {
        try await write(ByteBuffer(bytes: bytes), timeout: timeout)
    }

    /// Writes the UTF-8 bytes of `text` within `timeout`; see ``write(_:timeout:)-([UInt8],_)``.
    public func write(_ text: String, timeout: Duration) async throws {
        try await write(ByteBuffer(string: text), timeout: timeout)
    }

    /// Writes a `ByteBuffer` within `timeout`; see ``write(_:timeout:)-([UInt8],_)``. On a transport
    /// with an MTU the deadline covers every chunk; chunks sent before it passed stay sent.
    public func write(_ buffer: ByteBuffer, timeout: Duration) async throws {
        try checkWritable()
        guard buffer.readableBytes > 0 else { return }
        let deadline = ContinuousClock.now + timeout
        var sent = 0
        do {
            if backend.maximumWriteSize != nil {
                try await inTurn(until: deadline) {
                    var rest = buffer
                    while let chunk = nextChunk(of: &rest) {
                        try await backend.write(chunk, deadline: deadline)
                        sent += chunk.readableBytes
                        counters.written.add(chunk.readableBytes, ordering: .relaxed)
                    }
                }
            } else {
                try await backend.write(buffer, deadline: deadline)
                counters.written.add(buffer.readableBytes, ordering: .relaxed)
            }
        } catch let passed as WriteDeadlinePassed {
            let what = passed.nothingSent
                ? (sent == 0 ? "nothing of it was sent" : "\(sent) of its \(buffer.readableBytes) bytes were sent")
                : "part of it may have been sent"
            throw TransportError(.timedOut, "writing \(buffer.readableBytes) bytes to \(url.shown) took longer than \(timeout.secondsText): "
                                 + "\(what); the peer is not reading, or flow control holds the line")
        }
    }

    /// Sends `message` as one message on a transport that carries messages (empty messages too).
    ///
    /// ```swift
    /// try await connection.writeMessage(Array("{\"cmd\":\"status\"}".utf8))
    /// ```
    ///
    /// - Throws: ``TransportError/Kind/unsupported`` on a byte stream; ``TransportError/Kind/misuse``
    ///   when the message is larger than the transport's MTU (``ConnectionMetadata/mtu``).
    public func writeMessage(_ message: [UInt8]) async throws {
        try await writeMessage(ByteBuffer(bytes: message))
    }

    /// Sends a `ByteBuffer` as one message; see ``writeMessage(_:)-([UInt8])``.
    public func writeMessage(_ message: ByteBuffer) async throws {
        try await writeMessage(TransportMessage(.binary, message))
    }

    /// Sends one message with its kind: a WebSocket text or binary message. Transports whose
    /// messages have no kind send the payload.
    ///
    /// ```swift
    /// try await connection.writeMessage(.text("hello"))
    /// try await connection.writeMessage(.binary([0x01, 0x02]))
    /// ```
    ///
    /// - Throws: as ``writeMessage(_:)-([UInt8])``.
    public func writeMessage(_ typed: TransportMessage) async throws {
        let message = typed.payload
        guard carriesMessages else {
            throw TransportError(.unsupported, "\(url.scheme):// carries a byte stream without message boundaries; write bytes, or frame them with writeFrame(_:_:)")
        }
        try checkWritable()
        try await inTurn {
            if let limit = backend.maximumWriteSize, message.readableBytes > limit {
                throw TransportError.misuse("a \(message.readableBytes)-byte message does not fit the \(limit)-byte MTU of \(url.shown); keep messages within metadata.maximumWriteSize")
            }
            try await backend.writeMessage(typed)
            counters.written.add(message.readableBytes, ordering: .relaxed)
        }
    }

    private func checkWritable() throws {
        try state.withLock { state in
            if state.closed { throw TransportError.misuse("write on a connection to \(url.shown) after close()") }
            if state.writeClosed { throw TransportError.misuse("write on a connection to \(url.shown) after closeWrite()") }
        }
    }

    /// Runs `body` while no other chunked write runs.
    /// With `deadline`, the wait for the turn ends there too (``WriteDeadlinePassed``, nothing
    /// sent): another writer held up by a peer that stopped reading must not hold this one for ever.
    private func inTurn(until deadline: ContinuousClock.Instant? = nil, _ body: () async throws -> Void) async throws {
        let take: @Sendable () async throws -> Void = { [writeTurn] in
            try await writeTurn.wait { (taken: inout Bool) -> Void? in
                if taken { return nil }
                taken = true
                return ()
            }
        }
        if let deadline {
            // resultWins: a turn taken as the timer fired is this writer's, and is given back below.
            guard try await withDeadline(deadline, resultWins: true, take) != nil else { throw WriteDeadlinePassed(nothingSent: true) }
        } else {
            try await take()
        }
        defer { writeTurn.update { $0 = false } }
        try await body()
    }

    // MARK: Closing

    /// Half-close: tells the peer no more bytes will come (after the ones already written) while
    /// reading goes on. Throws `.unsupported` on transports without half-close.
    ///
    /// ```swift
    /// try await connection.write(request)
    /// try await connection.closeWrite()
    /// let answer = try await connection.readFrame(.delimiter("\n"))
    /// ```
    public func closeWrite() async throws {
        guard backend.supportsHalfClose else {
            throw TransportError(.unsupported, "\(url.scheme):// has no half-close; call close() when done")
        }
        let first = state.withLock { state in
            defer { state.writeClosed = true }
            return !state.writeClosed && !state.closed
        }
        guard first else { return }
        if backend.maximumWriteSize != nil {
            // After the chunked write in progress, not between its chunks.
            try await inTurn { try await backend.closeWrite() }
        } else {
            try await backend.closeWrite()
        }
    }

    /// Closes the connection, delivering bytes already written where the transport allows.
    /// Calling it again does nothing.
    public func close() async throws {
        let (first, logger) = state.withLock { state in
            defer { state.closed = true }
            return (!state.closed, state.logger)
        }
        guard first else { return }
        defer {
            let events = state.withLock { state in
                state.closeFinished = true
                return state.events
            }
            events?.emit(.closed)
        }
        do {
            try await backend.close()
            logger?.debug("closed", metadata: ["read": "\(bytesRead)", "written": "\(bytesWritten)"])
        } catch {
            logger?.debug("close failed", metadata: ["error": "\(error)"])
            throw error
        }
    }

    /// Closes the connection at once, without waiting for bytes already written to be sent:
    /// they are dropped (a socket's queued data, a serial port's pending writes). For a peer that
    /// stopped reading, where ``close()`` would wait for it, or for a program that must exit now.
    /// Wrapped connections are aborted too. A ``close()`` that is waiting stops waiting; after
    /// ``close()`` has finished this does nothing.
    ///
    /// ```swift
    /// let closing = Task { try await connection.close() }
    /// try await Task.sleep(for: .seconds(2))
    /// connection.abort()   // the peer did not read the rest; stop waiting for it
    /// ```
    public func abort() {
        let (first, finished) = state.withLock { state in
            defer { state.closed = true }
            return (!state.closed, state.closeFinished)
        }
        guard !finished else { return }
        // A close() in progress has marked the connection closed: release what it is waiting on.
        backend.connectionDropped()
        wrapped?.abort()
        if first { state.withLock { $0.events }?.emit(.closed) }
        if first { state.withLock { $0.logger }?.debug("aborted") }
    }

    /// `true` once ``close()`` was called.
    public var isClosed: Bool { state.withLock { $0.closed } }

    /// Bytes written that the transport has not passed on yet, and that ``abort()`` would drop:
    /// 0 when none, `nil` when the transport cannot tell. A ``close()`` that takes long while this
    /// is 0 is releasing the transport (a Bluetooth disconnect), not waiting for the peer.
    ///
    /// ```swift
    /// let closing = Task { try await connection.close() }
    /// try await Task.sleep(for: .seconds(2))
    /// if connection.unsentByteCount != 0 { connection.abort() }   // the peer stopped reading
    /// ```
    public var unsentByteCount: Int? { backend.unsentByteCount }

    /// Bytes received and not read yet that a read can have without waiting: what the connection
    /// holds (the rest of a chunk a read cut short, bytes a frame read put back) plus what the
    /// transport holds for it; `nil` when the transport cannot tell. On tcp://, whose only queue is
    /// the socket's receive buffer, that is what the kernel holds (FIONREAD); elsewhere bytes still
    /// in the kernel or a device's driver are not counted (a serial port's `bytesWaiting()` adds them).
    ///
    /// ```swift
    /// if connection.unreadByteCount ?? 0 >= 4 {
    ///     let header = try await connection.readFrame(.fixedLength(4))   // there already
    /// }
    /// ```
    public var unreadByteCount: Int? {
        guard let held = backend.unreadByteCount else { return nil }
        return held + state.withLock { $0.leftover?.payload.readableBytes ?? 0 }
    }

    func setLogger(_ logger: Logger) {
        state.withLock { $0.logger = logger }
    }

    // MARK: For plugins

    /// Lets a plugin update metadata that changes while connected (a negotiated MTU).
    ///
    /// ```swift
    /// connection.updateMetadata { $0.maximumWriteSize = negotiated - 3 }
    /// ```
    @_spi(Plugins)
    public func updateMetadata(_ update: (inout ConnectionMetadata) -> Void) {
        state.withLock { update(&$0.metadata) }
    }

    /// The backend as its concrete type, looking through wrapping layers, or `nil`. Plugins use
    /// this to offer controls only their transport has (`connection.serialPort`).
    ///
    /// ```swift
    /// extension Connection {
    ///     public var sensor: SensorControl? { backend(as: SensorBackend.self).map { SensorControl($0, self) } }
    /// }
    /// ```
    @_spi(Plugins)
    public func backend<Backend: ConnectionBackend>(as type: Backend.Type) -> Backend? {
        (backend as? Backend) ?? wrapped?.backend(as: type)
    }

    /// The first backend that is a `T` (a protocol plugins' backends adopt, such as
    /// ``SerialControlling``), looking through wrapping layers, or `nil`.
    ///
    /// ```swift
    /// let control = connection.firstBackend((any SerialControlling).self)
    /// ```
    @_spi(Plugins)
    public func firstBackend<T>(_ type: T.Type) -> T? {
        (backend as? T) ?? wrapped?.firstBackend(type)
    }

    /// Drops bytes this connection holds that the application has not read (a chunk larger than
    /// `maxBytes`, the rest of a message). A serial port's input flush calls this.
    @_spi(Plugins)
    public func discardUnreadInput() {
        state.withLock { $0.leftover = nil }
        wrapped?.discardUnreadInput()
    }

    /// Runs a transport control call, announcing it to every wrapping layer first and its outcome
    /// after (what `spy+tty://` traces). `describe` turns the result into text for them.
    ///
    /// ```swift
    /// try connection.performControl(ControlOperation("DTR", on ? "on" : "off")) { try lines.set(.dtr, on) }
    /// ```
    @_spi(Plugins)
    public func performControl<Result>(_ operation: ControlOperation, describe: (Result) -> String? = { _ in nil },
                                       _ body: () throws -> Result) rethrows -> Result {
        let announced = announce(operation)
        do {
            return announced.succeeded(try body(), describe)
        } catch {
            throw announced.failed(error)
        }
    }

    /// ``performControl(_:describe:_:)`` for a call that suspends (a break, a drain).
    @_spi(Plugins)
    public func performControl<Result>(_ operation: ControlOperation, describe: (Result) -> String? = { _ in nil },
                                       _ body: () async throws -> Result) async rethrows -> Result {
        let announced = announce(operation)
        do {
            return announced.succeeded(try await body(), describe)
        } catch {
            throw announced.failed(error)
        }
    }

    /// A control call announced to the wrapping layers, to be reported to them when it ends.
    private struct Announced {
        let layers: [any WrappingBackend]
        let operation: ControlOperation

        func succeeded<Result>(_ result: Result, _ describe: (Result) -> String?) -> Result {
            let text = layers.isEmpty ? nil : describe(result)
            for layer in layers { layer.didPerform(operation, outcome: .success(text)) }
            return result
        }

        func failed(_ error: any Error) -> any Error {
            for layer in layers { layer.didPerform(operation, outcome: .failure(error)) }
            return error
        }
    }

    private func announce(_ operation: ControlOperation) -> Announced {
        var operation = operation
        if ControlOperation.polling { operation.isPoll = true }
        let layers = wrappingLayers
        for layer in layers { layer.willPerform(operation) }
        return Announced(layers: layers, operation: operation)
    }

    /// The wrapping backends from this connection down, outermost first.
    private var wrappingLayers: [any WrappingBackend] {
        var layers: [any WrappingBackend] = []
        var current: Connection? = self
        while let connection = current, let layer = connection.backend as? any WrappingBackend {
            layers.append(layer)
            current = connection.wrapped
        }
        return layers
    }
}
