import NIOCore
import SystemPackage
import Synchronization

/// A ``ConnectionBackend`` over a SwiftNIO `Channel`: what every socket-like plugin shares (tcp,
/// unix, tty, pty, and later Bluetooth sockets and TLS or WebSocket pipelines).
///
/// Backpressure both ways, nothing unbounded (the sizes are the connection's ``Buffering``):
/// - inbound: bytes go through an ``InboundQueue``; past its high watermark the backend holds NIO's
///   `read()`, so the kernel's socket buffer fills and the peer's TCP window closes.
/// - outbound: `write` hands bytes to NIO and waits at a ``WriterGate`` while the channel is not
///   writable (NIO's write-buffer watermarks, ``Buffering/outbound``). A writer off the event
///   loop reads that flag before the loop has seen its latest writes, so when the loop is starved
///   it could run far ahead (33 MB was seen on a loaded machine); the bytes handed over and not yet
///   written are therefore also counted, and past ``Buffering/inFlight``'s high mark (4 MiB in
///   ``Buffering/standard``) the writer waits until its low mark is left.
///
/// Built in one step: ``install(on:describing:supportsHalfClose:messages:messageKinds:buffering:hangUp:shutsDownOnClose:)`` adds the
/// backend's handler at the end of the pipeline, on the channel's event loop, before a byte can
/// arrive. Handlers a plugin adds first (TLS, a WebSocket codec) sit in front of it; the backend
/// reads and writes `ByteBuffer`s, and with `messages: true` each inbound `ByteBuffer` is a message.
/// With `messageKinds: true` the handlers in front pass ``TransportMessage`` values both ways
/// instead (a WebSocket codec: text and binary kept apart).
///
/// ```swift
/// let backend = try await ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
///     .connect(host: host, port: port) { channel in
///         channel.eventLoop.makeCompletedFuture {
///             try ChannelBackend.install(on: channel, describing: "tcp://\(host):\(port)", supportsHalfClose: true)
///         }
///     }
/// return Connection(url: request.url, backend: backend)
/// ```
///
/// Ownership: the backend owns the channel and closes it in ``close()``, or at once in
/// ``connectionDropped()`` when the application let its connection go without closing.
///
/// A device or link that can vanish (a serial adapter unplugged, a Bluetooth link dropped) passes
/// a ``HangUp``: every end this side did not ask for (end of stream, or a `.disconnected` error
/// from a read or a write) is then reported as that error, after every byte received before it.
@_spi(Plugins)
public final class ChannelBackend: ConnectionBackend {
    /// The channel this backend reads and writes.
    public let channel: any Channel
    /// `true` for sockets: `closeWrite()` shuts down the sending direction.
    public let supportsHalfClose: Bool
    /// `true` when each `ByteBuffer` that reaches the handler is one message.
    public let carriesMessages: Bool
    /// `true` when the handlers in front pass ``TransportMessage`` values (kind and payload).
    public let carriesMessageKinds: Bool
    /// The kinds of the messages in `inbound`, in the same order: the handler appends a kind just
    /// before its payload, and the one reader takes one with each payload.
    private let inboundKinds = KindQueue()

    /// A class, so the handler can hold it without holding the backend.
    private final class KindQueue: Sendable {
        let kinds = Locked(CircularBuffer<TransportMessage.Kind>())
    }
    /// Names the peer in error messages, such as `"tcp://127.0.0.1:4000"`.
    public let describing: String
    private let inbound: InboundQueue
    private let writers: WriterGate
    private let executor: EventLoopTaskExecutor
    private let writeState = Locked(WriteState())
    /// Bytes handed to the channel and not yet written to the kernel (or failed).
    private let inFlight = Atomic(0)
    /// The hard cap on bytes handed to the channel and not yet written: a writer waits above it
    /// until they drop to ``inFlightResume``. Reached only when the event loop falls behind;
    /// otherwise NIO's writability gates first.
    public let inFlightCap: Int
    /// Where a writer held at ``inFlightCap`` goes on.
    public let inFlightResume: Int
    /// The error an end this side did not ask for becomes; `nil`: an end of stream is `nil` from
    /// `read`, a disconnect the channel's own error.
    private let hangUp: HangUp?
    /// The socket is shut down before it is closed (``connectionDroppedShuttingDown()``).
    private let shutsDownOnClose: Bool

    private struct WriteState {
        var failure: TransportError?
        var failureReported = false
    }

    private init(channel: any Channel, describing: String, supportsHalfClose: Bool, messages: Bool, messageKinds: Bool,
                 buffering: Buffering, hangUp: HangUp?, shutsDownOnClose: Bool) {
        self.channel = channel
        self.hangUp = hangUp
        self.shutsDownOnClose = shutsDownOnClose
        self.inFlightCap = buffering.inFlight.high
        self.inFlightResume = buffering.inFlight.low
        self.describing = describing
        self.supportsHalfClose = supportsHalfClose
        self.carriesMessages = messages || messageKinds
        self.carriesMessageKinds = messageKinds
        let executor = EventLoopTaskExecutor(channel.eventLoop)
        self.executor = executor
        self.inbound = InboundQueue(watermarks: buffering.inbound, messages: messages || messageKinds, resumingInlineOn: executor) { [channel] in
            channel.read()
        }
        self.writers = WriterGate()
    }

    /// Creates the backend for `channel` and adds its handler at the end of the pipeline. Call it
    /// on the channel's event loop, in a bootstrap's channel initializer, after the plugin's own
    /// handlers.
    ///
    /// - Parameters:
    ///   - channel: the connected channel; the backend owns it from now on.
    ///   - describing: names the peer in error messages, such as `"tcp://127.0.0.1:4000"`.
    ///   - supportsHalfClose: `true` when `close(mode: .output)` sends an end of stream (sockets).
    ///   - messages: `true` when each `ByteBuffer` that reaches the handler is one message.
    ///   - messageKinds: `true` when the handlers in front pass ``TransportMessage`` values both
    ///     ways (implies `messages`).
    ///   - buffering: how much the backend holds each way (``ConnectRequest/buffering``).
    ///   - hangUp: for a device or link that can vanish, the error every end this side did not ask
    ///     for becomes (end of stream included); `nil` keeps ends of stream and the channel's errors.
    ///   - shutsDownOnClose: `true` for a socket another process holds a descriptor of too (one
    ///     bluetoothd handed over): closing shuts it down first, which a close alone would not.
    public static func install(on channel: any Channel, describing: String, supportsHalfClose: Bool, messages: Bool = false,
                               messageKinds: Bool = false, buffering: Buffering = .standard, hangUp: HangUp? = nil,
                               shutsDownOnClose: Bool = false) throws -> ChannelBackend {
        let backend = ChannelBackend(channel: channel, describing: describing, supportsHalfClose: supportsHalfClose,
                                     messages: messages, messageKinds: messageKinds, buffering: buffering,
                                     hangUp: hangUp, shutsDownOnClose: shutsDownOnClose)
        if let options = channel.syncOptions {
            try options.setOption(.writeBufferWaterMark, value: .init(low: buffering.outbound.low, high: buffering.outbound.high))
            try options.setOption(.maxMessagesPerRead, value: UInt(buffering.readsPerWakeup))
            try options.setOption(.recvAllocator, value: AdaptiveRecvByteBufferAllocator(minimum: 64, initial: min(2048, buffering.readSize),
                                                                                          maximum: buffering.readSize))
        }
        if messageKinds {
            let kinds = backend.inboundKinds
            let inbound = backend.inbound
            try channel.pipeline.syncOperations.addHandler(Handler<TransportMessage>(backend: backend) { message in
                // The kind first: a parked reader is resumed inside append and takes it at once.
                kinds.kinds.withLock { $0.append(message.kind) }
                inbound.append(message.payload)
            })
        } else {
            let inbound = backend.inbound
            try channel.pipeline.syncOperations.addHandler(Handler<ByteBuffer>(backend: backend) { inbound.append($0) })
        }
        return backend
    }

    /// An executor on the channel's event loop; see ``EventLoopTaskExecutor``. A reader parked in a
    /// task that prefers it is resumed inside the read that brought its bytes.
    public var preferredExecutor: (any TaskExecutor)? { executor }

    /// The next chunk from the inbound queue; with a ``HangUp``, never `nil`.
    public func read() async throws -> ByteBuffer? {
        if carriesMessageKinds { return try await readMessage()?.payload }
        guard let hangUp else { return try await inbound.next() }
        return try await Self.untilHangUp(hangUp) { try await inbound.next() }
    }

    /// The next message with its kind (``TransportMessage/Kind/binary`` without `messageKinds`).
    public func readMessage() async throws -> TransportMessage? {
        guard let hangUp else { return message(try await inbound.next()) }
        return message(try await Self.untilHangUp(hangUp) { try await inbound.next() })
    }

    /// ``readMessage()`` until `deadline`, parked in the calling task (``InboundQueue/next(deadline:)``).
    public func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        guard let hangUp else { return message(try await inbound.next(deadline: deadline)) }
        return message(try await Self.untilHangUp(hangUp) { try await inbound.next(deadline: deadline) })
    }

    /// What `read` gives, with its end of stream and a disconnect both told as `hangUp`.
    private static func untilHangUp<Value>(_ hangUp: HangUp, _ read: () async throws -> Value?) async throws -> Value {
        let value: Value?
        do {
            value = try await read()
        } catch let error as TransportError where error.kind == .disconnected {
            throw hangUp(error.errno, error.syscall)
        }
        guard let value else { throw hangUp(nil, nil) }
        return value
    }

    private func message(_ payload: ByteBuffer?) -> TransportMessage? {
        guard let payload else { return nil }
        guard carriesMessageKinds else { return TransportMessage(.binary, payload) }
        return TransportMessage(inboundKinds.kinds.withLock { $0.popFirst() } ?? .binary, payload)
    }

    /// Hands `buffer` to the channel; waits while the channel is not writable, or while more than
    /// ``inFlightCap`` bytes handed over are not yet written. With `messageKinds`, a binary message.
    public func write(_ buffer: ByteBuffer) async throws {
        if carriesMessageKinds {
            try await send(TransportMessage(.binary, buffer), size: buffer.readableBytes)
        } else {
            try await send(buffer, size: buffer.readableBytes)
        }
    }

    /// Sends `message` with its kind where the handlers in front take kinds; else its payload.
    public func writeMessage(_ message: TransportMessage) async throws {
        if carriesMessageKinds {
            try await send(message, size: message.payload.readableBytes)
        } else {
            try await send(message.payload, size: message.payload.readableBytes)
        }
    }

    /// ``write(_:)`` all or nothing by `deadline`: waits for room (the channel writable, the bytes
    /// in flight under ``inFlightCap``) before it hands anything over, and not after. When the
    /// deadline passes first, nothing of `buffer` was sent (``WriteDeadlinePassed``).
    public func write(_ buffer: ByteBuffer, deadline: ContinuousClock.Instant) async throws {
        let noRoom = !channel.isWritable || inFlight.load(ordering: .relaxed) > inFlightCap
        if noRoom {
            do {
                let room: Void? = try await withDeadline(deadline) { [self] in
                    try await writers.wait { [self] in channel.isWritable && inFlight.load(ordering: .relaxed) <= inFlightCap }
                }
                if room == nil { throw WriteDeadlinePassed(nothingSent: true) }
            } catch let error as TransportError where error.kind == .disconnected && hangUp != nil {
                throw hangUp.map { $0(error.errno, error.syscall) } ?? error
            }
        }
        if carriesMessageKinds {
            try await send(TransportMessage(.binary, buffer), size: buffer.readableBytes, waitForRoom: false)
        } else {
            try await send(buffer, size: buffer.readableBytes, waitForRoom: false)
        }
    }

    private func send<Data: Sendable>(_ data: Data, size: Int, waitForRoom: Bool = true) async throws {
        guard let hangUp else { return try await handOverAndWait(data, size: size, waitForRoom: waitForRoom) }
        do {
            try await handOverAndWait(data, size: size, waitForRoom: waitForRoom)
        } catch let error as TransportError where error.kind == .disconnected {
            throw hangUp(error.errno, error.syscall)
        }
    }

    /// Hands `data` over, then (with `waitForRoom`) waits while the channel has no room for more.
    private func handOverAndWait<Data: Sendable>(_ data: Data, size: Int, waitForRoom: Bool) async throws {
        if let failure = takeUnreportedWriteFailure() { throw failure }
        // Counted before the hand-over: on the event loop the write may complete inside it.
        let inFlightNow = inFlight.add(size, ordering: .relaxed).newValue
        let eventLoop = channel.eventLoop
        if eventLoop.inEventLoop {
            handOver(data, size: size)
        } else {
            // One hop to the loop for the write and its bookkeeping together: a future's
            // `whenComplete` called off the loop would queue a second job of its own.
            eventLoop.execute { [self] in handOver(data, size: size) }
        }
        if waitForRoom && (!channel.isWritable || inFlightNow > inFlightCap) {
            // Checked again under the gate's lock. The handler signals when NIO makes the channel
            // writable; the completion that brings the bytes in flight down to the resume mark too.
            try await writers.wait { [self] in
                channel.isWritable && inFlight.load(ordering: .relaxed) <= (inFlightNow > inFlightCap ? inFlightResume : inFlightCap)
            }
        }
    }

    /// Writes `data` on the loop and, once the channel has written or failed it, takes it out of
    /// the bytes in flight. Registered after handing the bytes over, so that on the loop the
    /// bookkeeping is not between the read that woke the writer and the write syscall; a write
    /// that already completed runs the callback at once, so nothing is missed.
    private func handOver<Data: Sendable>(_ data: Data, size: Int) {
        let promise = channel.eventLoop.makePromise(of: Void.self)
        channel.writeAndFlush(data, promise: promise)
        promise.futureResult.whenComplete { [self] result in
            let before = inFlight.subtract(size, ordering: .relaxed).oldValue
            if case .failure(let error) = result {
                recordWriteFailure(TransportError.from(error, context: "writing to \(describing)"))
            }
            let after = before - size
            // Wake writers held at the cap, and flushPendingWrites waiting for the last byte.
            if (before > inFlightResume && after <= inFlightResume) || after == 0 { writers.signal() }
        }
    }

    /// Bytes handed to the channel that it has not yet written to the kernel. What a socket's
    /// kernel queue holds is sent after a close too: TCP's, and RFCOMM's, whose close queues its
    /// DISC behind the data (`__rfcomm_dlc_close`). A tty's driver queue is not: a tty backend
    /// adds TIOCOUTQ itself.
    public var unsentByteCount: Int? { max(inFlight.load(ordering: .relaxed), 0) }

    /// Bytes received and queued for the reader (an empty message counts as one).
    public var unreadByteCount: Int? { inbound.bufferedBytes }

    /// Drops bytes received but not read yet (a serial port's input flush) and resumes reading
    /// from the kernel if it was paused for them.
    public func discardBufferedInbound() {
        inbound.discardBuffered()
        inboundKinds.kinds.withLock { $0.removeAll() }
    }

    /// Waits until every byte written so far has been handed to the kernel (or failed): until no
    /// byte is in flight, whichever writer wrote it, in whatever order their bookkeeping ran.
    public func flushPendingWrites() async {
        // Ends early when the channel ended (its pending writes then fail). Not cancellable, as
        // close() must not cut its own flush short.
        await uncancellable { [self] in
            try? await writers.wait { [self] in inFlight.load(ordering: .relaxed) == 0 }
        }
    }

    /// Waits for the bytes in flight, then shuts down the sending direction.
    public func closeWrite() async throws {
        await flushPendingWrites()
        if let failure = takeUnreportedWriteFailure() { throw failure }
        do {
            try await channel.close(mode: .output).get()
        } catch ChannelError.alreadyClosed, ChannelError.ioOnClosedChannel, ChannelError.outputClosed {
            // The sending direction is already over: the peer closed both ways (a unix socket
            // whose peer closed hangs up, and NIO then closes the whole channel). Every byte in
            // flight was accounted for above, so nothing written is lost.
        } catch {
            throw TransportError.from(error, context: "half-closing \(describing)")
        }
    }

    /// Waits for the bytes in flight, closes the channel, and reports a write that failed after
    /// it was accepted. With `shutsDownOnClose`, shuts the socket down first (after the bytes in
    /// flight; shutdown(2) of an RFCOMM socket ends the link after what is queued).
    public func close() async throws {
        if shutsDownOnClose {
            do {
                try await closeWrite()
            } catch {
                // A write that failed is reported here, and the channel still closed.
                try? await channel.close().get()
                throw error
            }
        }
        await flushPendingWrites()
        do {
            try await channel.close().get()
        } catch ChannelError.alreadyClosed {
            // The peer closed first; nothing left to release.
        } catch {
            throw TransportError.from(error, context: "closing \(describing)")
        }
        if let failure = takeUnreportedWriteFailure() {
            throw TransportError(failure.kind, "bytes written to \(describing) were not delivered: \(failure.message)",
                                 errno: failure.errno, syscall: failure.syscall)
        }
    }

    /// Closes the channel at once (shut down first with `shutsDownOnClose`).
    public func connectionDropped() {
        if shutsDownOnClose { return connectionDroppedShuttingDown() }
        channel.close(promise: nil)
    }

    /// Closes the channel at once, shutting the socket down first: for a socket another process
    /// holds a descriptor of too (one bluetoothd handed over), which a close alone would leave up.
    public func connectionDroppedShuttingDown() {
        channel.close(mode: .output, promise: nil)
        channel.close(promise: nil)
    }

    /// Why writing can no longer succeed: the error that ended the channel, or a plain "closed".
    private static func disconnectedError(_ inbound: InboundQueue, _ describing: String) -> TransportError {
        inbound.failure ?? TransportError(.disconnected, "the connection to \(describing) is closed")
    }

    /// Keeps the first write failure. A write that found the channel already closed knows no
    /// errno; if a read error closed it (a reset, an unplugged device, a protocol's own verdict
    /// such as an HTTP server that hung up before answering), that error is the cause.
    private func recordWriteFailure(_ error: TransportError) {
        let cause = inbound.failure
        writeState.withLock { state in
            guard state.failure == nil else { return }
            if error.errno == nil, let cause, cause.errno != nil || error.kind == .disconnected {
                state.failure = cause
            } else {
                state.failure = error
            }
        }
    }

    private func takeUnreportedWriteFailure() -> TransportError? {
        writeState.withLock { state in
            guard let failure = state.failure, !state.failureReported else { return nil }
            state.failureReported = true
            return failure
        }
    }

    /// The NIO side: feeds the inbound queue, holds `read()` while it is full, signals the writer
    /// gate when the channel becomes writable and fails it when the channel ends. It holds the queue and the gate, not the backend, so the backend does
    /// not keep itself.
    private final class Handler<Inbound: Sendable>: ChannelDuplexHandler, Sendable {
        typealias InboundIn = Inbound
        typealias OutboundIn = Inbound
        typealias OutboundOut = Inbound

        let inbound: InboundQueue
        let writers: WriterGate
        let describing: String
        let deliver: @Sendable (Inbound) -> Void

        init(backend: ChannelBackend, deliver: @escaping @Sendable (Inbound) -> Void) {
            inbound = backend.inbound
            writers = backend.writers
            describing = backend.describing
            self.deliver = deliver
        }

        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            deliver(Self.unwrapInboundIn(data))
        }

        func read(context: ChannelHandlerContext) {
            if inbound.shouldProduce() { context.read() }
        }

        func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
            if let event = event as? ChannelEvent, event == .inputClosed {
                inbound.finish()
            }
            context.fireUserInboundEventTriggered(event)
        }

        func channelInactive(context: ChannelHandlerContext) {
            inbound.finish()
            writers.fail(ChannelBackend.disconnectedError(inbound, describing))
            context.fireChannelInactive()
        }

        func channelWritabilityChanged(context: ChannelHandlerContext) {
            if context.channel.isWritable { writers.signal() }
            context.fireChannelWritabilityChanged()
        }

        func errorCaught(context: ChannelHandlerContext, error: any Error) {
            let failure = TransportError.from(error, context: "reading from \(describing)")
            inbound.fail(failure)
            writers.fail(failure)
            context.close(promise: nil)
        }

    }
}

extension TransportError {
    /// Maps a SwiftNIO error to a ``TransportError``, keeping errno and the system call name.
    /// `context` says what was being done, such as "connecting to tcp://host:port".
    /// `syscall` names the call when the caller knows it better than the error does.
    ///
    /// ```swift
    /// throw TransportError.from(error, context: "connecting to \(target)", syscall: "connect")
    /// ```
    @_spi(Plugins)
    public static func from(_ error: any Error, context: String, syscall knownSyscall: String? = nil) -> TransportError {
        if let error = error as? TransportError { return error }
        if let error = error as? IOError {
            // IOError's description is "<syscall>(<args>): <strerror> (errno: N)" for system calls,
            // and a phrase such as "connection reset (error set): …" otherwise.
            let text = error.description
            let prefix = text.firstIndex(of: "(").map { String(text[..<$0]) }
            let syscall = knownSyscall ?? prefix.flatMap { $0.allSatisfy { $0.isLetter || $0.isNumber || $0 == "_" } ? $0 : nil }
            let errno = Errno(rawValue: error.errnoCode)
            let kind = TransportError.Kind(errno: errno)
            return TransportError(kind, "\(context) failed: \(errno.symbolicDescription)\(hint(for: kind))",
                                  errno: errno, syscall: syscall)
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
