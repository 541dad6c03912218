import NIOCore
import Synchronization

/// A ``ConnectionBackend`` over a SwiftNIO `Channel`: what socket-like plugins (tcp, unix, tty, …)
/// share.
///
/// Backpressure both ways, nothing unbounded:
/// - inbound: bytes the application has not read yet are kept up to `inboundLimit`; past it the
///   handler holds NIO's `read()` so the kernel's socket buffer fills and the peer's TCP window closes.
/// - outbound: `write` hands bytes to NIO and suspends while the channel is not writable (NIO's
///   write-buffer watermarks, 32 KiB/64 KiB by default).
///
/// Use: create one, add ``handler`` to the channel's pipeline in the bootstrap's initializer, then
/// ``attach(_:)`` the connected channel.
///
/// ```swift
/// let backend = ChannelBackend(describing: "tcp://\(host):\(port)", supportsHalfClose: true)
/// let channel = try await ClientBootstrap(group: group)
///     .channelInitializer { channel in
///         channel.eventLoop.makeCompletedFuture { try channel.pipeline.syncOperations.addHandler(backend.handler) }
///     }
///     .connect(host: host, port: port).get()
/// backend.attach(channel)
/// ```
///
/// Ownership: the backend owns the channel. It closes it in ``close()`` or, if the application
/// drops the connection without closing, when the backend is released.
public final class ChannelBackend: ConnectionBackend {
    public let supportsHalfClose: Bool
    /// The handler that feeds this backend; add it last in the channel's pipeline.
    public let handler: ChannelBackendHandler
    private let shared: Shared
    private let channelBox: Mutex<(any Channel)?>

    /// - Parameters:
    ///   - describing: names the peer in error messages, such as `"tcp://127.0.0.1:4000"`.
    ///   - inboundLimit: bytes kept for the application before reading from the kernel pauses.
    public init(describing: String, supportsHalfClose: Bool, inboundLimit: Int = 256 * 1024) {
        let shared = Shared(describing: describing, inboundLimit: inboundLimit)
        self.shared = shared
        self.supportsHalfClose = supportsHalfClose
        self.handler = ChannelBackendHandler(shared: shared)
        self.channelBox = Mutex(nil)
    }

    /// Binds the backend to its connected channel (the one whose pipeline holds ``handler``).
    public func attach(_ channel: any Channel) {
        channelBox.withLock { $0 = channel }
    }

    deinit {
        // The application dropped the connection without close(): release the descriptor.
        channelBox.withLock { $0 }?.close(promise: nil)
    }

    private var channel: any Channel {
        get throws {
            guard let channel = channelBox.withLock({ $0 }) else {
                throw TransportError(.io, "internal: ChannelBackend for \(shared.describing) used before attach(_:)")
            }
            return channel
        }
    }

    /// An executor on the channel's event loop; see ``EventLoopTaskExecutor``. A reader parked in a
    /// task that prefers it is resumed inside the read that brought its bytes.
    public var preferredExecutor: (any TaskExecutor)? {
        shared.executor
    }

    public func read() async throws -> ByteBuffer? {
        let channel = try self.channel
        switch shared.take() {
        case .chunk(let buffer, let resumeReading):
            if resumeReading { channel.read() }
            return buffer
        case .finished(let result):
            return try result.get()
        case .empty:
            break
        }
        let shared = self.shared
        return try await withTaskCancellationHandler {
            // Unsafe rather than checked (the checked one allocates per read): every path that
            // resumes the reader first takes it out of `State` under the lock, so it resumes once.
            try await withUnsafeThrowingContinuation { (continuation: UnsafeContinuation<ByteBuffer?, any Error>) in
                if shared.park(continuation) {
                    channel.read()
                }
            }
        } onCancel: {
            shared.cancelParkedReader()
        }
    }

    public func write(_ buffer: ByteBuffer) async throws {
        let channel = try self.channel
        if let failure = shared.takeUnreportedWriteFailure() { throw failure }
        let promise = channel.eventLoop.makePromise(of: Void.self)
        channel.writeAndFlush(buffer, promise: promise)
        // Bookkeeping after handing the bytes over, so that on the event loop it is not between the
        // read that woke this task and the write syscall. A write that already failed runs the
        // callback at once, so nothing is missed.
        let shared = self.shared
        promise.futureResult.whenFailure { error in
            shared.recordWriteFailure(TransportError.from(error, context: "writing to \(shared.describing)"))
        }
        shared.setLastWrite(promise.futureResult)
        if !channel.isWritable {
            try await waitUntilWritable(channel)
        }
    }

    private func waitUntilWritable(_ channel: any Channel) async throws {
        let shared = self.shared
        let id = shared.nextWaiterID()
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                channel.eventLoop.execute {
                    if !channel.isActive {
                        continuation.resume(throwing: shared.disconnectedError())
                    } else if channel.isWritable {
                        continuation.resume()
                    } else {
                        shared.parkWriter(id: id, continuation)
                    }
                }
            }
        } onCancel: {
            shared.cancelWriter(id: id)
        }
    }

    /// Drops bytes received but not read yet (a serial port's input flush) and resumes reading
    /// from the kernel if it was paused for them.
    public func discardBufferedInbound() {
        if shared.discardBuffered(), let channel = channelBox.withLock({ $0 }) {
            channel.read()
        }
    }

    /// Waits until every byte written so far has been handed to the kernel (or failed).
    public func flushPendingWrites() async {
        await shared.lastWrite?.flushed()
    }

    public func closeWrite() async throws {
        let channel = try self.channel
        await shared.lastWrite?.flushed()
        if let failure = shared.takeUnreportedWriteFailure() { throw failure }
        do {
            try await channel.close(mode: .output).get()
        } catch {
            throw TransportError.from(error, context: "half-closing \(shared.describing)")
        }
    }

    public func close() async throws {
        let channel = try self.channel
        await shared.lastWrite?.flushed()
        do {
            try await channel.close().get()
        } catch ChannelError.alreadyClosed {
            // The peer closed first; nothing left to release.
        } catch {
            throw TransportError.from(error, context: "closing \(shared.describing)")
        }
        if let failure = shared.takeUnreportedWriteFailure() {
            throw TransportError(failure.kind, "bytes written to \(shared.describing) were not delivered: \(failure.message)",
                                 errno: failure.errno, syscall: failure.syscall)
        }
    }

    /// State shared by the event loop (handler) and the application's tasks.
    final class Shared: Sendable {
        let describing: String
        let inboundLimit: Int
        private let state: Mutex<State>

        struct State {
            var buffered = CircularBuffer<ByteBuffer>()
            var bufferedBytes = 0
            var reader: UnsafeContinuation<ByteBuffer?, any Error>?
            var end: Result<ByteBuffer?, TransportError>?
            /// NIO asked to read while the buffer was full; call `channel.read()` once drained.
            var heldRead = false
            var writers: [Int: CheckedContinuation<Void, any Error>] = [:]
            var cancelledWriters: Set<Int> = []
            var nextWaiterID = 0
            var writeFailure: TransportError?
            var writeFailureReported = false
            var lastWrite: EventLoopFuture<Void>?
            /// The channel's event loop as a task executor, set when the handler joins the pipeline.
            var executor: EventLoopTaskExecutor?

            /// Why the channel ended, when an error ended it.
            var endFailure: TransportError? {
                if case .failure(let error)? = end { error } else { nil }
            }
        }

        init(describing: String, inboundLimit: Int) {
            self.describing = describing
            self.inboundLimit = inboundLimit
            self.state = Mutex(State())
        }

        enum Take {
            case chunk(ByteBuffer, resumeReading: Bool)
            case finished(Result<ByteBuffer?, TransportError>)
            case empty
        }

        func take() -> Take {
            state.withLock { state in
                if let buffer = state.buffered.popFirst() {
                    state.bufferedBytes -= buffer.readableBytes
                    let resume = state.heldRead && state.bufferedBytes < inboundLimit / 2
                    if resume { state.heldRead = false }
                    return .chunk(buffer, resumeReading: resume)
                }
                if let end = state.end { return .finished(end) }
                return .empty
            }
        }

        /// Empties the inbound buffer; returns `true` when a held read should be resumed.
        func discardBuffered() -> Bool {
            state.withLock { state in
                state.buffered.removeAll()
                state.bufferedBytes = 0
                defer { state.heldRead = false }
                return state.heldRead
            }
        }

        /// Parks the reader, or resumes it at once if bytes or the end arrived meanwhile.
        /// Returns `true` when the caller should ask NIO to read (a read was held).
        func park(_ continuation: UnsafeContinuation<ByteBuffer?, any Error>) -> Bool {
            let (ready, resumeReading): (Result<ByteBuffer?, any Error>?, Bool) = state.withLock { state in
                if let buffer = state.buffered.popFirst() {
                    state.bufferedBytes -= buffer.readableBytes
                    return (.success(buffer), false)
                }
                if let end = state.end { return (end.mapError { $0 }, false) }
                // Checked under the lock: cancelParkedReader() either runs after this and finds the
                // reader, or ran before and set the flag seen here.
                if Task.isCancelled { return (.failure(CancellationError()), false) }
                state.reader = continuation
                let resume = state.heldRead
                state.heldRead = false
                return (nil, resume)
            }
            if let ready { continuation.resume(with: ready) }
            return resumeReading
        }

        func cancelParkedReader() {
            state.withLock { state in
                defer { state.reader = nil }
                return state.reader
            }?.resume(throwing: CancellationError())
        }

        // Event-loop side.

        func deliver(_ buffer: ByteBuffer) {
            let (reader, executor): (UnsafeContinuation<ByteBuffer?, any Error>?, EventLoopTaskExecutor?) = state.withLock { state in
                if let reader = state.reader {
                    state.reader = nil
                    return (reader, state.executor)
                }
                state.buffered.append(buffer)
                state.bufferedBytes += buffer.readableBytes
                return (nil, nil)
            }
            guard let reader else { return }
            if let executor {
                executor.resumeInline { reader.resume(returning: buffer) }
            } else {
                reader.resume(returning: buffer)
            }
        }

        func setExecutor(_ executor: EventLoopTaskExecutor) {
            state.withLock { $0.executor = executor }
        }

        var executor: EventLoopTaskExecutor? { state.withLock { $0.executor } }

        /// Returns `true` when NIO's read should go ahead.
        func shouldRead() -> Bool {
            state.withLock { state in
                if state.bufferedBytes >= inboundLimit {
                    state.heldRead = true
                    return false
                }
                return true
            }
        }

        func finish(_ end: Result<ByteBuffer?, TransportError>) {
            let (reader, writers): (UnsafeContinuation<ByteBuffer?, any Error>?, [CheckedContinuation<Void, any Error>]) =
                state.withLock { state in
                    if state.end == nil { state.end = end }
                    let reader = state.buffered.isEmpty ? state.reader : nil
                    if reader != nil { state.reader = nil }
                    let writers = Array(state.writers.values)
                    state.writers = [:]
                    return (reader, writers)
                }
            reader?.resume(with: end.mapError { $0 })
            for writer in writers { writer.resume(throwing: disconnectedError()) }
        }

        func disconnectedError() -> TransportError {
            state.withLock { $0.endFailure } ?? TransportError(.disconnected, "the connection to \(describing) is closed")
        }

        func resumeWriters() {
            let writers = state.withLock { state in
                defer { state.writers = [:] }
                return Array(state.writers.values)
            }
            for writer in writers { writer.resume() }
        }

        func nextWaiterID() -> Int {
            state.withLock { state in
                state.nextWaiterID += 1
                return state.nextWaiterID
            }
        }

        func parkWriter(id: Int, _ continuation: CheckedContinuation<Void, any Error>) {
            let cancelled = state.withLock { state in
                if state.cancelledWriters.remove(id) != nil { return true }
                state.writers[id] = continuation
                return false
            }
            if cancelled { continuation.resume(throwing: CancellationError()) }
        }

        func cancelWriter(id: Int) {
            state.withLock { state -> CheckedContinuation<Void, any Error>? in
                if let writer = state.writers.removeValue(forKey: id) { return writer }
                state.cancelledWriters.insert(id)
                return nil
            }?.resume(throwing: CancellationError())
        }

        /// Keeps the first write failure. A write that found the channel already closed knows no
        /// errno; if a read error closed it (a reset, an unplugged device), that error is the cause.
        func recordWriteFailure(_ error: TransportError) {
            state.withLock { state in
                guard state.writeFailure == nil else { return }
                if error.errno == nil, let cause = state.endFailure, cause.errno != nil {
                    state.writeFailure = cause
                } else {
                    state.writeFailure = error
                }
            }
        }

        func takeUnreportedWriteFailure() -> TransportError? {
            state.withLock { state in
                guard let failure = state.writeFailure, !state.writeFailureReported else { return nil }
                state.writeFailureReported = true
                return failure
            }
        }

        func setLastWrite(_ future: EventLoopFuture<Void>) {
            state.withLock { $0.lastWrite = future }
        }

        var lastWrite: EventLoopFuture<Void>? { state.withLock { $0.lastWrite } }
    }
}

/// The NIO side of ``ChannelBackend``. Add ``ChannelBackend/handler`` last in the pipeline.
public final class ChannelBackendHandler: ChannelDuplexHandler, Sendable {
    public typealias InboundIn = ByteBuffer
    public typealias OutboundIn = ByteBuffer
    public typealias OutboundOut = ByteBuffer

    let shared: ChannelBackend.Shared

    init(shared: ChannelBackend.Shared) { self.shared = shared }

    public func handlerAdded(context: ChannelHandlerContext) {
        shared.setExecutor(EventLoopTaskExecutor(context.eventLoop))
    }

    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        shared.deliver(Self.unwrapInboundIn(data))
    }

    public func read(context: ChannelHandlerContext) {
        if shared.shouldRead() { context.read() }
    }

    public func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let event = event as? ChannelEvent, event == .inputClosed {
            shared.finish(.success(nil))
        }
        context.fireUserInboundEventTriggered(event)
    }

    public func channelInactive(context: ChannelHandlerContext) {
        shared.finish(.success(nil))
        context.fireChannelInactive()
    }

    public func errorCaught(context: ChannelHandlerContext, error: any Error) {
        shared.finish(.failure(TransportError.from(error, context: "reading from \(shared.describing)")))
        context.close(promise: nil)
    }

    public func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable { shared.resumeWriters() }
        context.fireChannelWritabilityChanged()
    }
}

extension EventLoopFuture where Value == Void {
    /// Waits for the write to finish either way; its failure is recorded elsewhere.
    func flushed() async {
        _ = try? await self.get()
    }
}

extension TransportError {
    /// Maps a SwiftNIO error to a ``TransportError``, keeping errno and the system call name.
    /// `context` says what was being done, such as "connecting to tcp://host:port".
    /// `syscall` names the call when the caller knows it better than the error does.
    public static func from(_ error: any Error, context: String, syscall knownSyscall: String? = nil) -> TransportError {
        if let error = error as? TransportError { return error }
        if let error = error as? IOError {
            // IOError's description is "<syscall>(<args>): <strerror> (errno: N)" for system calls,
            // and a phrase such as "connection reset (error set): …" otherwise.
            let text = error.description
            let prefix = text.firstIndex(of: "(").map { String(text[..<$0]) }
            let syscall = knownSyscall ?? prefix.flatMap { $0.allSatisfy { $0.isLetter || $0.isNumber || $0 == "_" } ? $0 : nil }
            let kind = TransportError.Kind(errno: error.errnoCode)
            return TransportError(kind, "\(context) failed: \(ErrnoName.describe(error.errnoCode))\(hint(for: kind))",
                                  errno: error.errnoCode, syscall: syscall)
        }
        if let error = error as? ChannelError {
            switch error {
            case .connectTimeout(let timeout):
                return TransportError(.timedOut, "\(context) did not finish within \(Duration.nanoseconds(timeout.nanoseconds).secondsText); check that the peer is reachable, or raise ?timeout=")
            case .ioOnClosedChannel, .alreadyClosed, .outputClosed, .inputClosed, .eof:
                return TransportError(.disconnected, "\(context) failed: the connection is closed")
            default:
                break
            }
        }
        return TransportError(.io, "\(context) failed: \(error)")
    }

    static func hint(for kind: Kind) -> String {
        switch kind {
        case .disconnected: "; the peer closed the connection or the link dropped, reconnect to go on"
        case .permissionDenied: "; check the permissions of the path or device"
        default: ""
        }
    }
}

/// Runs Swift tasks on one NIO event loop: the loop that does a channel's I/O.
///
/// A task that prefers this executor (`withTaskExecutorPreference`) is resumed on the thread that
/// read its bytes, instead of being handed to the cooperative pool: one thread wake-up less per
/// read. Worth it for chatty request/response loops; for bulk transfers the default is as fast.
/// Never block inside such a task: it holds up every channel on that loop.
///
/// ```swift
/// let executor = EventLoopTaskExecutor(channel.eventLoop)
/// try await withTaskExecutorPreference(executor) { /* runs on channel.eventLoop */ }
/// ```
///
/// ``ChannelBackend`` goes one step further with the executor it hands out as
/// ``ChannelBackend/preferredExecutor``: when bytes arrive for a reader parked in such a task, the
/// task runs at once, inside the read, until it next suspends, as a SwiftNIO handler would; it is
/// not queued behind the rest of the loop's work. See ``resumeInline(_:)``.
public final class EventLoopTaskExecutor: TaskExecutor {
    public let eventLoop: any EventLoop
    /// Open only on the loop's thread, while ``resumeInline(_:)`` runs its closure; then it holds
    /// the job that closure made ready instead of queueing it.
    private let handoff = Mutex(Handoff())

    private struct Handoff {
        var open = false
        var job: UnownedJob?
    }

    public init(_ eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
    }

    public func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        // Only the loop's thread can find the handoff open: resumeInline opens it there and closes
        // it before returning, and no other thread passes the inEventLoop test.
        if eventLoop.inEventLoop, handoff.withLock({ handoff in
            guard handoff.open, handoff.job == nil else { return false }
            handoff.job = job
            return true
        }) {
            return
        }
        let executor = self.asUnownedTaskExecutor()
        eventLoop.execute {
            job.runSynchronously(on: executor)
        }
    }

    /// Runs `resume`, which resumes a continuation of a task that may prefer this executor, and then
    /// runs that task right here until it next suspends, instead of queueing it on the event loop.
    ///
    /// Called by ``ChannelBackend``'s handler on the loop's thread when it hands bytes to a parked
    /// reader, so a request/response loop writes its reply before the event loop goes on, as a
    /// SwiftNIO handler would. Anywhere else (another thread, or inside a running task, where a
    /// nested job would break the runtime's bookkeeping) it only runs `resume` and the task is
    /// queued as usual. Continuations resumed elsewhere (a cancellation handler, the end of the
    /// stream, a writer waiting for room) never come through here and are always queued: the
    /// runtime calls cancellation handlers while it holds the task's status-record lock and walks
    /// those records, and the task would remove its own record from under it.
    ///
    /// ```swift
    /// // In a handler's channelRead, on the loop, with the reader taken out of shared state:
    /// executor.resumeInline { reader.resume(returning: buffer) }
    /// ```
    public func resumeInline(_ resume: () -> Void) {
        guard eventLoop.inEventLoop, withUnsafeCurrentTask(body: { $0 == nil }) else {
            resume()
            return
        }
        handoff.withLock { $0.open = true }
        resume()
        let job = handoff.withLock { handoff in
            handoff.open = false
            defer { handoff.job = nil }
            return handoff.job
        }
        job?.runSynchronously(on: self.asUnownedTaskExecutor())
    }
}
