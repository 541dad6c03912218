import NIOCore
import Synchronization

/// What a plugin implements to carry bytes. ``Connection`` wraps it with everything else
/// (counters, leftovers, timeouts, the inbound sequence, closing exactly once).
///
/// Contract:
/// - `read()` returns the next chunk of inbound bytes, `nil` at the end of the stream, and throws a
///   ``TransportError`` when the stream ended abnormally. It is called by one task at a time, must
///   return bytes that already arrived before reporting an end or error, and must honour task
///   cancellation (throw `CancellationError` without consuming bytes).
/// - `write(_:)` suspends while the transport's bounded buffer is full; returning means the bytes
///   were accepted into that buffer.
/// - `closeWrite()` sends an end-of-stream to the peer after every accepted byte (TCP FIN);
///   transports without half-close throw ``TransportError/Kind/unsupported``.
/// - `close()` delivers bytes already accepted where the transport allows, then releases every
///   resource. It is called once.
public protocol ConnectionBackend: AnyObject, Sendable {
    func read() async throws -> ByteBuffer?
    func write(_ buffer: ByteBuffer) async throws
    func closeWrite() async throws
    func close() async throws
    /// `true` when ``closeWrite()`` is supported.
    var supportsHalfClose: Bool { get }
    /// An executor that runs tasks where this backend does its I/O, if it has one; see
    /// ``Connection/preferredExecutor``.
    var preferredExecutor: (any TaskExecutor)? { get }
}

extension ConnectionBackend {
    public var preferredExecutor: (any TaskExecutor)? { nil }
}

/// What a transport knows about the other end, like CornucopiaStreams' `CC_meta`.
/// Every field is optional; `extra` holds transport-specific facts (a pty's peer path, …).
public struct ConnectionMetadata: Sendable, Equatable, Codable {
    public var name: String?
    public var manufacturer: String?
    public var model: String?
    public var serialNumber: String?
    public var firmwareVersion: String?
    /// The largest write the transport carries in one unit (BLE ATT payload, L2CAP MTU).
    public var mtu: Int?
    public var localAddress: String?
    public var remoteAddress: String?
    public var extra: [String: String]

    public init(name: String? = nil, manufacturer: String? = nil, model: String? = nil, serialNumber: String? = nil,
                firmwareVersion: String? = nil, mtu: Int? = nil, localAddress: String? = nil,
                remoteAddress: String? = nil, extra: [String: String] = [:]) {
        self.name = name
        self.manufacturer = manufacturer
        self.model = model
        self.serialNumber = serialNumber
        self.firmwareVersion = firmwareVersion
        self.mtu = mtu
        self.localAddress = localAddress
        self.remoteAddress = remoteAddress
        self.extra = extra
    }
}

/// A connected, bidirectional byte stream.
///
/// Get one from ``TransportRegistry/connect(to:)-(String)`` (or `Transport.connect(to:)` in the
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
/// Reading is for one task at a time; a second concurrent read throws. Writing from several tasks
/// is allowed; each write's bytes stay together.
public final class Connection: Sendable {
    /// The URL this connection was made for (for accepted connections: the peer's URL).
    public let url: TransportURL
    private let backend: any ConnectionBackend
    private let state: Mutex<State>
    private let counters: Counters

    private struct State {
        var metadata: ConnectionMetadata
        /// Bytes read from the backend but not yet handed out (a chunk larger than `maxBytes`).
        var leftover: ByteBuffer?
        var reading = false
        var closed = false
        var writeClosed = false
    }

    private final class Counters: Sendable {
        let read = Atomic<Int>(0)
        let written = Atomic<Int>(0)
    }

    /// Wraps a plugin's backend. Plugins call this; applications get connections from the registry.
    public init(url: TransportURL, backend: any ConnectionBackend, metadata: ConnectionMetadata = ConnectionMetadata()) {
        self.url = url
        self.backend = backend
        self.state = Mutex(State(metadata: metadata))
        self.counters = Counters()
    }

    /// What the transport knows about the peer.
    public var metadata: ConnectionMetadata {
        state.withLock { $0.metadata }
    }

    /// Lets a plugin update metadata that changes while connected (a negotiated MTU).
    public func updateMetadata(_ update: (inout ConnectionMetadata) -> Void) {
        state.withLock { update(&$0.metadata) }
    }

    /// Bytes handed to the application so far.
    public var bytesRead: Int { counters.read.load(ordering: .relaxed) }
    /// Bytes accepted from the application so far.
    public var bytesWritten: Int { counters.written.load(ordering: .relaxed) }
    /// `true` when ``closeWrite()`` is available on this transport.
    public var supportsHalfClose: Bool { backend.supportsHalfClose }

    /// The plugin's backend as its concrete type, or `nil`. Plugins use this to offer controls
    /// that only their transport has (a serial port's modem lines, for example).
    public func backend<Backend: ConnectionBackend>(as type: Backend.Type) -> Backend? {
        backend as? Backend
    }

    /// Drops bytes this connection holds that the application has not read (from ``unread(_:)``
    /// or a chunk larger than `maxBytes`). A serial port's input flush calls this.
    public func discardUnreadInput() {
        state.withLock { $0.leftover = nil }
    }

    /// An executor on the thread that does this connection's I/O, when the transport has one
    /// (tcp://, unix://, tty:// do; loop:// does not). A request/response loop that runs with this
    /// executor preferred is resumed where the reply was read, inside that read, and runs until it
    /// next suspends before the I/O thread goes on: no thread hop and no queueing per read.
    ///
    /// ```swift
    /// let connection = try await Transport.connect(to: "tcp://127.0.0.1:35000")
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
    /// then, the next read gets it. Throws `CancellationError` when the task is cancelled.
    public func read(maxBytes: Int = 65536, timeout: Duration? = nil) async throws -> [UInt8]? {
        guard let buffer = try await readBuffer(maxBytes: maxBytes, timeout: timeout) else { return nil }
        return Array(buffer.readableBytesView)
    }

    /// Like ``read(maxBytes:timeout:)`` without copying out of the transport's buffer.
    public func readBuffer(maxBytes: Int = 65536, timeout: Duration? = nil) async throws -> ByteBuffer? {
        precondition(maxBytes > 0, "maxBytes must be positive")
        // One lock: check the state, mark this task as the reader and take bytes put back earlier.
        let leftover = try state.withLock { state -> ByteBuffer? in
            if state.closed { throw TransportError(.io, "read on a closed connection to \(url)") }
            if state.reading {
                throw TransportError(.io, "two tasks read \(url) at once; read from one task, or share the bytes with an AsyncChannel")
            }
            state.reading = true
            defer { state.leftover = nil }
            return state.leftover
        }
        defer { state.withLock { $0.reading = false } }

        var chunk: ByteBuffer
        if let leftover {
            chunk = leftover
        } else if let timeout {
            guard let next = try await readWithTimeout(timeout) else { return nil }
            chunk = next
        } else {
            guard let next = try await backend.read() else { return nil }
            chunk = next
        }
        if chunk.readableBytes > maxBytes, let head = chunk.readSlice(length: maxBytes) {
            state.withLock { $0.leftover = chunk }
            chunk = head
        }
        counters.read.add(chunk.readableBytes, ordering: .relaxed)
        return chunk
    }

    /// Puts bytes back in front of the stream; the next read returns them first. Used by framing
    /// helpers that read past a frame's end.
    public func unread(_ bytes: ByteBuffer) {
        guard bytes.readableBytes > 0 else { return }
        counters.read.subtract(bytes.readableBytes, ordering: .relaxed)
        state.withLock { state in
            if var leftover = state.leftover {
                var combined = bytes
                combined.writeBuffer(&leftover)
                state.leftover = combined
            } else {
                state.leftover = bytes
            }
        }
    }

    private enum TimedRead: Sendable {
        case chunk(ByteBuffer?)
        case timerFired
    }

    /// Races a backend read against a timer. If both finish, the bytes win: a read that completed
    /// is never dropped for a timeout.
    private func readWithTimeout(_ timeout: Duration) async throws -> ByteBuffer? {
        let backend = self.backend
        return try await withThrowingTaskGroup(of: TimedRead.self) { group in
            group.addTask { .chunk(try await backend.read()) }
            group.addTask {
                try await Task.sleep(for: timeout)
                return .timerFired
            }
            var chunk: ByteBuffer??
            var failure: (any Error)?
            var timerFired = false
            while let result = await group.nextResult() {
                switch result {
                case .success(.chunk(let received)):
                    chunk = .some(received)
                    group.cancelAll()
                case .success(.timerFired):
                    timerFired = true
                    group.cancelAll()
                case .failure(let error):
                    if !(error is CancellationError), failure == nil { failure = error }
                }
            }
            if let chunk { return chunk }
            if let failure { throw failure }
            if timerFired && !Task.isCancelled {
                throw TransportError(.timedOut, "no data from \(url) within \(timeout.secondsText)")
            }
            throw CancellationError()
        }
    }

    /// The inbound bytes as an `AsyncSequence` of chunks; it ends when the peer closes and throws
    /// when the connection fails. Iterate it from one task.
    public var inbound: InboundBytes { InboundBytes(connection: self) }

    /// The inbound side of a ``Connection`` as an `AsyncSequence` of byte chunks.
    public struct InboundBytes: AsyncSequence, Sendable {
        public typealias Element = [UInt8]
        let connection: Connection

        public struct AsyncIterator: AsyncIteratorProtocol {
            let connection: Connection
            public mutating func next() async throws -> [UInt8]? {
                try await connection.read()
            }
        }

        public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(connection: connection) }
    }

    // MARK: Writing

    /// Writes `bytes`, suspending while the transport's buffer is full.
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

    /// Writes a `ByteBuffer` without copying it.
    public func write(_ buffer: ByteBuffer) async throws {
        try state.withLock { state in
            if state.closed { throw TransportError(.io, "write on a closed connection to \(url)") }
            if state.writeClosed { throw TransportError(.io, "write after closeWrite() on \(url)") }
        }
        guard buffer.readableBytes > 0 else { return }
        try await backend.write(buffer)
        counters.written.add(buffer.readableBytes, ordering: .relaxed)
    }

    // MARK: Closing

    /// Half-close: tells the peer no more bytes will come (after the ones already written) while
    /// reading goes on. Throws `.unsupported` on transports without half-close.
    public func closeWrite() async throws {
        guard backend.supportsHalfClose else {
            throw TransportError(.unsupported, "\(url.scheme):// has no half-close; call close() when done")
        }
        let first = state.withLock { state in
            defer { state.writeClosed = true }
            return !state.writeClosed && !state.closed
        }
        if first { try await backend.closeWrite() }
    }

    /// Closes the connection, delivering bytes already written where the transport allows.
    /// Calling it again does nothing.
    public func close() async throws {
        let first = state.withLock { state in
            defer { state.closed = true }
            return !state.closed
        }
        if first { try await backend.close() }
    }

    /// `true` once ``close()`` was called.
    public var isClosed: Bool { state.withLock { $0.closed } }
}

extension Duration {
    /// "1.5 s", for messages.
    var secondsText: String {
        let (seconds, attoseconds) = components
        let value = Double(seconds) + Double(attoseconds) / 1e18
        return "\(value.formatted3) s"
    }
}

extension Double {
    var formatted3: String {
        let rounded = (self * 1000).rounded() / 1000
        return rounded == rounded.rounded() ? String(Int(rounded)) : String(rounded)
    }
}
