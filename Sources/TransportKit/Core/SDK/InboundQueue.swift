import NIOCore
import Synchronization

/// The inbound side of a backend: what the transport received and the application has not read
/// yet, bounded, with one reader. ``ChannelBackend``, `loop://` and callback-driven plugins (USB
/// transfers, GATT notifications) all deliver through it.
///
/// - **Bounded**: once ``Buffering/Watermarks/high`` bytes wait unread, ``append(_:)`` answers
///   ``Demand/pause`` (and ``shouldProduce()`` `false`): the producer stops taking data from its
///   source (NIO holds its `read()`, a USB plugin stops resubmitting transfers), so the kernel's or
///   the device's own flow control reaches the sender. When the reader has drained the backlog
///   below ``Buffering/Watermarks/low``, the queue calls `onResume` once, and the producer goes on. Data that
///   was already in flight is still accepted: nothing is dropped.
/// - **Ordered ends**: ``finish()`` and ``fail(_:)`` are seen by the reader only after every
///   element appended before them.
/// - **One reader**: ``next()`` parks at most one task; a second concurrent reader gets a
///   ``TransportError/Kind/misuse`` error. Cancelling the parked reader resumes it with
///   `CancellationError` and consumes nothing: the next ``next()`` gets the element.
/// - **Messages**: with `messages: true` every appended buffer is one message (a SEQPACKET record, a
///   GATT value, a WebSocket message, a USB packet), empty ones included, handed out whole; the
///   connection then offers ``Connection/readMessage(timeout:)``. Byte streams drop empty buffers.
///
/// ```swift
/// let queue = InboundQueue(watermarks: .init(low: 16 * 1024, high: 64 * 1024)) { device.resumeTransfers() }
/// // producer (a C library's callback thread):
/// if queue.append(ByteBuffer(bytes: packet)) == .pause { device.pauseTransfers() }
/// // consumer (the backend's read()):
/// let next = try await queue.next()   // nil after queue.finish()
/// ```
@_spi(Plugins)
public final class InboundQueue: Sendable {
    /// Where the producer is asked to pause and to resume, in bytes waiting unread (the type is
    /// ``Buffering``'s, which applications pick).
    public typealias Watermarks = Buffering.Watermarks

    /// What the producer should do after ``append(_:)``.
    public enum Demand: Sendable, Equatable {
        /// Keep producing.
        case more
        /// Stop taking data from the source until `onResume` is called.
        case pause
    }

    /// Where the producer pauses and resumes.
    public let watermarks: Watermarks
    /// `true` when every element is a message (see the type's documentation).
    public let carriesMessages: Bool
    private let onResume: @Sendable () -> Void
    private let executor: EventLoopTaskExecutor?
    private let state: Locked<State>

    private struct State {
        var buffered = CircularBuffer<ByteBuffer>()
        var bufferedBytes = 0
        /// The parked reader, with the number its `next()` call drew: a cancellation resumes only
        /// the reader it belongs to.
        var reader: (id: UInt64, continuation: UnsafeContinuation<ByteBuffer?, any Error>)?
        var nextReaderID: UInt64 = 0
        var end: Result<Void, TransportError>?
        /// The producer was told to pause and is owed an `onResume`.
        var paused = false
    }

    /// An empty queue.
    ///
    /// - Parameters:
    ///   - watermarks: where the producer pauses and resumes.
    ///   - messages: `true` when every appended buffer is a message.
    ///   - executor: the event loop the producer appends on, when it is one; a reader parked in a
    ///     task that prefers it is then resumed inside ``append(_:)`` (see
    ///     ``EventLoopTaskExecutor/resumeInline(_:)``).
    ///   - onResume: called (on the reader's thread, outside any lock) when a paused producer may
    ///     produce again.
    public init(watermarks: Watermarks = .standard, messages: Bool = false, resumingInlineOn executor: EventLoopTaskExecutor? = nil,
                onResume: @escaping @Sendable () -> Void = {}) {
        self.watermarks = watermarks
        self.carriesMessages = messages
        self.executor = executor
        self.onResume = onResume
        self.state = Locked(State())
    }

    /// The bytes an element counts against the watermarks: an empty message still counts one, so a
    /// flood of them cannot grow the queue without bound.
    private func weight(_ element: ByteBuffer) -> Int {
        carriesMessages ? max(1, element.readableBytes) : element.readableBytes
    }

    // MARK: Producer

    /// Hands `element` to the parked reader, or queues it. Elements appended after ``finish()`` or
    /// ``fail(_:)`` are dropped (the stream has ended).
    ///
    /// ```swift
    /// if queue.append(chunk) == .pause { stopReading() }
    /// ```
    @discardableResult
    public func append(_ element: ByteBuffer) -> Demand {
        append(element, deferringWake: false)
    }

    /// ``append(_:)`` for a producer that brings several elements in one go (the completions one
    /// `libusb_handle_events` call reports): with `deferringWake`, a parked reader is not resumed
    /// here; the producer calls ``wakeReader()`` after the last of them, so the reader's thread is
    /// woken once per batch rather than once per element.
    ///
    /// ```swift
    /// for completion in batch { _ = queue.append(completion.bytes, deferringWake: true) }
    /// queue.wakeReader()
    /// ```
    @discardableResult
    public func append(_ element: ByteBuffer, deferringWake: Bool) -> Demand {
        if !carriesMessages && element.readableBytes == 0 { return .more }
        let weight = self.weight(element)
        let (reader, demand): (UnsafeContinuation<ByteBuffer?, any Error>?, Demand) = state.withLock { state in
            guard state.end == nil else { return (nil, .pause) }
            if !deferringWake, let reader = state.reader {
                state.reader = nil
                return (reader.continuation, .more)
            }
            state.buffered.append(element)
            state.bufferedBytes += weight
            guard state.bufferedBytes >= watermarks.high else { return (nil, .more) }
            state.paused = true
            return (nil, .pause)
        }
        if let reader { hand(element, to: reader) }
        return demand
    }

    /// Resumes the parked reader with `element`, inline on the producer's event loop when there is one.
    private func hand(_ element: ByteBuffer, to reader: UnsafeContinuation<ByteBuffer?, any Error>) {
        if let executor {
            executor.resumeInline { reader.resume(returning: element) }
        } else {
            reader.resume(returning: element)
        }
    }

    /// Resumes a parked reader with the first element that ``append(_:deferringWake:)`` left
    /// waiting; does nothing when no reader is parked or nothing waits.
    public func wakeReader() {
        let (reader, element, resume): (UnsafeContinuation<ByteBuffer?, any Error>?, ByteBuffer?, Bool) = state.withLock { state in
            guard let reader = state.reader, let (element, resume) = popFirst(&state) else { return (nil, nil, false) }
            state.reader = nil
            return (reader.continuation, element, resume)
        }
        guard let reader, let element else { return }
        hand(element, to: reader)
        if resume { onResume() }
    }

    /// Asks before producing (SwiftNIO's `read()`): `false` while the high watermark is reached,
    /// and `onResume` follows once the reader has made room.
    public func shouldProduce() -> Bool {
        state.withLock { state in
            guard state.bufferedBytes >= watermarks.high else { return true }
            state.paused = true
            return false
        }
    }

    /// Ends the stream after the elements already appended: the reader then gets `nil`.
    public func finish() {
        end(.success(()))
    }

    /// Ends the stream after the elements already appended: the reader then gets `error`. Only the
    /// first end counts.
    public func fail(_ error: TransportError) {
        end(.failure(error))
    }

    private func end(_ result: Result<Void, TransportError>) {
        let (reader, element) = state.withLock { state -> (UnsafeContinuation<ByteBuffer?, any Error>?, ByteBuffer?) in
            if state.end == nil { state.end = result }
            guard let reader = state.reader else { return (nil, nil) }
            state.reader = nil
            // A reader parked beside buffered elements: they were appended with a deferred wake.
            // The first goes to the reader now; the rest, and then the end, to its next calls.
            return (reader.continuation, popFirst(&state)?.element)
        }
        // Resumed here, not inline: see resumeInline.
        if let element {
            reader?.resume(returning: element)
        } else {
            reader?.resume(with: result.map { nil }.mapError { $0 })
        }
    }

    // MARK: Consumer

    /// The next element, `nil` once the stream has finished, or the error it failed with.
    ///
    /// ```swift
    /// while let chunk = try await queue.next() { consume(chunk) }
    /// ```
    ///
    /// - Throws: the stream's error; `CancellationError` when the task is cancelled while waiting
    ///   (nothing is consumed); ``TransportError/Kind/misuse`` when another task is already waiting.
    public func next() async throws -> ByteBuffer? {
        switch try take() {
        case .ready(let element): return element
        case .wait(let id): return try await parked(id, deadline: nil)
        }
    }

    /// ``next()``, waiting at most until `deadline`: throws ``ReadDeadlinePassed`` when it passes
    /// with nothing taken (nothing is consumed; what arrives later goes to the next call). The
    /// reader parks in the calling task, with a timer task beside it, not in a task group.
    ///
    /// ```swift
    /// let chunk = try await queue.next(deadline: .now + .seconds(2))
    /// ```
    public func next(deadline: ContinuousClock.Instant) async throws -> ByteBuffer? {
        let id: UInt64
        switch try take() {
        case .ready(let element): return element
        case .wait(let number): id = number
        }
        // The timer may fire before the reader is parked; park() then sees the deadline passed
        // (the timer never fires before it), so no wake-up is lost either way.
        let timer = Task { [self] in
            try await Task.sleep(until: deadline, clock: .continuous)
            resumeParked(id, throwing: ReadDeadlinePassed())
        }
        defer { timer.cancel() }
        return try await parked(id, deadline: deadline)
    }

    /// Parks the calling task as the reader drawn under `id` until an element, the end, its
    /// deadline (``next(deadline:)``'s timer, or park's own check) or its cancellation.
    private func parked(_ id: UInt64, deadline: ContinuousClock.Instant?) async throws -> ByteBuffer? {
        try await withTaskCancellationHandler {
            // Unsafe rather than checked (the checked one allocates per read): every path that
            // resumes the reader first takes it out of `State` under the lock, so it resumes once.
            try await withUnsafeThrowingContinuation { (continuation: UnsafeContinuation<ByteBuffer?, any Error>) in
                park(continuation, id: id, deadline: deadline)
            }
        } onCancel: {
            // Only this call's own reader: another task may be the one parked.
            resumeParked(id, throwing: CancellationError())
        }
    }

    /// Resumes the reader parked under `id` with `error`, if it is still parked; any other reader
    /// (a later call's) is left alone.
    private func resumeParked(_ id: UInt64, throwing error: any Error) {
        state.withLock { state -> UnsafeContinuation<ByteBuffer?, any Error>? in
            guard let reader = state.reader, reader.id == id else { return nil }
            state.reader = nil
            return reader.continuation
        }?.resume(throwing: error)
    }

    private enum Taken {
        /// An element, or `nil` for the end.
        case ready(ByteBuffer?)
        /// Nothing yet: park, under this number.
        case wait(UInt64)
    }

    /// Takes the first element, and says whether the producer may go on now: a paused producer is
    /// resumed once the backlog is below the low watermark. Every consumer path pops through here.
    private func popFirst(_ state: inout State) -> (element: ByteBuffer, resume: Bool)? {
        guard let element = state.buffered.popFirst() else { return nil }
        state.bufferedBytes -= weight(element)
        let resume = state.paused && state.bufferedBytes < watermarks.low
        if resume { state.paused = false }
        return (element, resume)
    }

    /// An element or the end, if one is there now; else the number to park under.
    private func take() throws -> Taken {
        let (ready, resume, id): (Result<ByteBuffer?, TransportError>?, Bool, UInt64) = state.withLock { state in
            if let (element, resume) = popFirst(&state) { return (.success(element), resume, 0) }
            if let end = state.end { return (end.map { nil }, false, 0) }
            state.nextReaderID &+= 1
            return (nil, false, state.nextReaderID)
        }
        if resume { onResume() }
        guard let ready else { return .wait(id) }
        return .ready(try ready.get())
    }

    /// Parks the reader, unless an element or the end is there, the task was cancelled, or
    /// `deadline` has passed: the timer of ``next(deadline:)`` may have fired before the reader
    /// was parked, and found nobody to wake.
    private func park(_ continuation: UnsafeContinuation<ByteBuffer?, any Error>, id: UInt64, deadline: ContinuousClock.Instant? = nil) {
        let (ready, resume): (Result<ByteBuffer?, any Error>?, Bool) = state.withLock { state in
            if let (element, resume) = popFirst(&state) { return (.success(element), resume) }
            if let end = state.end { return (end.map { nil }.mapError { $0 }, false) }
            if state.reader != nil {
                return (.failure(TransportError.misuse("two tasks read one connection at once; read from one task, and hand the bytes to others")), false)
            }
            if let deadline, ContinuousClock.now >= deadline { return (.failure(ReadDeadlinePassed()), false) }
            // Checked under the lock: the cancellation handler either runs after this and finds the
            // reader, or ran before and set the flag seen here.
            if Task.isCancelled { return (.failure(CancellationError()), false) }
            state.reader = (id, continuation)
            // Nothing buffered: a paused producer must go on, or the reader would wait forever.
            let resume = state.paused
            state.paused = false
            return (nil, resume)
        }
        if let ready { continuation.resume(with: ready) }
        if resume { onResume() }
    }

    /// Drops every element not read yet (a serial port's input flush); a paused producer resumes.
    public func discardBuffered() {
        let resume = state.withLock { state in
            state.buffered.removeAll()
            state.bufferedBytes = 0
            defer { state.paused = false }
            return state.paused
        }
        if resume { onResume() }
    }

    /// The bytes waiting unread.
    public var bufferedBytes: Int { state.withLock { $0.bufferedBytes } }

    /// The error the stream failed with, once ``fail(_:)`` was called.
    public var failure: TransportError? {
        state.withLock { state in
            if case .failure(let error)? = state.end { error } else { nil }
        }
    }

    /// `true` once ``finish()`` or ``fail(_:)`` was called (elements may still wait unread).
    public var hasEnded: Bool { state.withLock { $0.end != nil } }
}

/// Lets writers wait while a transport cannot take more (a full socket buffer, a full ring, every
/// USB transfer in flight), without a queue of its own and without losing a wake-up.
///
/// The owner keeps the truth (a channel's writability, free transfer slots); a writer waits until
/// a check of it passes. The check runs under the gate's lock when the writer arrives and again
/// after every ``signal()``, so a change that happens between the check and the wait is not lost,
/// as long as the owner changes its state first and signals after. ``fail(_:)`` ends every wait
/// with the error: the connection is gone.
///
/// ```swift
/// // Writer:
/// try await gate.wait { channel.isWritable }
/// // Owner, when the transport drained:
/// gate.signal()
/// // Owner, when the connection ended:
/// gate.fail(TransportError(.disconnected, "…"))
/// ```
@_spi(Plugins)
public final class WriterGate: Sendable {
    private let failure = AsyncCondition<TransportError?>(nil)

    /// An open gate with no failure.
    public init() {}

    /// Returns once `isOpen` holds; throws the gate's failure, or `CancellationError` when the
    /// task is cancelled while waiting. `isOpen` must not call back into this gate.
    public func wait(until isOpen: @escaping @Sendable () -> Bool) async throws {
        try await failure.wait { failure in
            if let failure { throw failure }
            return isOpen() ? () : nil
        }
    }

    /// Wakes the waiting writers to check again (after the transport drained).
    public func signal() {
        failure.update { _ in }
    }

    /// Fails every waiting and later writer with `error`; only the first failure counts.
    public func fail(_ error: TransportError) {
        failure.update { failure in
            if failure == nil { failure = error }
        }
    }

    /// The failure passed to ``fail(_:)``, if any.
    public var failed: TransportError? { failure.withLock { $0 } }
}
