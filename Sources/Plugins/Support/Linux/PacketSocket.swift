// PacketSocket.swift: a connected SOCK_SEQPACKET socket (socket(7), recv(2), send(2)) as a
// ConnectionBackend, for descriptors SwiftNIO's stream channels must not carry: an LE L2CAP
// channel (a write larger than the send MTU fails with EMSGSIZE, and NIO would gather several
// writes into one writev), and the AF_UNIX sockets BlueZ hands out for GATT AcquireWrite and
// AcquireNotify (one datagram, one attribute value). Every record read is one message; every
// write(_:) is sent as one record, and writeRecords(_:accepted:) cuts a longer write into records
// of the send MTU.
//
// Readiness comes from FileDescriptor.wait(until:) (no thread parked). A write of several records
// (a 4 KiB write cut to an L2CAP send MTU) that finds the socket full sends the rest from a
// thread of the connection's own, blocked in poll(2) between records, so that the kernel wakes
// the sender directly as credits come back and the writing task is resumed once per write, not
// once per record (RecordSender, below). Closing shuts the socket down first, so a read or write
// waiting for readiness wakes and leaves, and closes the descriptor only once nothing waits on it
// (DescriptorGate).

import Glibc
import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// A connected SOCK_SEQPACKET socket as a connection: records in, records out.
///
/// ```swift
/// let backend = PacketSocketBackend(adopting: fd, describing: "ble://FFF0:128/00:AA:01:01:00:01",
///                                   receiveSize: 672, maximumWriteSize: 672) { errno in
///     TransportError(.disconnected, "00:AA:01:01:00:01 disconnected", errno: errno, syscall: "recv")
/// }
/// return Connection(url: request.url, backend: backend, metadata: metadata)
/// ```
@_spi(Plugins)
public final class PacketSocketBackend: ConnectionBackend {
    /// `false`: a SEQPACKET channel has no end-of-stream of its own, so ``closeWrite()`` throws.
    public let supportsHalfClose = false
    /// `true`: each read is one record, each write is sent as one.
    public let carriesMessages = true
    /// The largest record the peer accepts (the send MTU), as given at adoption; nil for no limit.
    public let maximumWriteSize: Int?
    private let fd: SystemPackage.FileDescriptor
    private let describing: String
    private let receiveSize: Int
    private let inbound: InboundQueue
    /// `true` while the reader may take records from the socket (false once the queue asked it to pause).
    private let producing = AsyncCondition(true)
    /// Reads and writes inside a readiness wait or a system call on `fd`; closes it once they left.
    private let gate: DescriptorGate
    private let reader = AsyncCondition<Task<Void, Never>?>(nil)
    private let hangUp: HangUp
    /// The socket is AF_UNIX (read once, at adoption).
    private let isUnixSocket: Bool
    /// Made at the first write of several records that finds the socket full; ended at close.
    private let sender = Locked<RecordSender?>(nil)

    /// Takes ownership of a connected SOCK_SEQPACKET socket and starts reading it.
    ///
    /// - Parameters:
    ///   - fd: the connected socket; the backend owns it and closes it.
    ///   - describing: the URL or name the errors use.
    ///   - receiveSize: the largest record expected (the receive MTU); a longer one is cut (MSG_TRUNC).
    ///   - maximumWriteSize: the largest record the peer accepts (the send MTU); a longer write comes
    ///     to ``writeRecords(_:accepted:)``, which cuts it into records of this size.
    ///   - watermarks: where reading pauses while the application does not read.
    ///   - hangUp: the error that ends the connection when the peer goes away (with the errno and
    ///     the call, `recv` or `send`, if any).
    public init(adopting fd: SystemPackage.FileDescriptor, describing: String, receiveSize: Int, maximumWriteSize: Int?,
                watermarks: InboundQueue.Watermarks = .standard, hangUp: @escaping HangUp) {
        self.fd = fd
        gate = DescriptorGate(fd)
        self.describing = describing
        self.receiveSize = max(receiveSize, 1)
        self.maximumWriteSize = maximumWriteSize
        self.hangUp = hangUp
        var domain: Int32 = 0
        var size = socklen_t(MemoryLayout<Int32>.size)
        isUnixSocket = getsockopt(fd.rawValue, SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0 && domain == AF_UNIX
        let producing = self.producing
        inbound = InboundQueue(watermarks: watermarks, messages: true) { producing.update { $0 = true } }
        let task = Task { [self] in await self.readLoop() }
        reader.update { $0 = task }
    }

    /// What the kernel reports when the link or the peer is gone (l2cap_chan_del's reasons).
    static let hangUps: [Errno] = [.connectionReset, .socketNotConnected, .hostIsDown, .timedOut, .connectionAbort, .brokenPipe]

    /// The next record; `nil` once the backend is closed. Throws the `hangUp` error when the peer
    /// goes away (after the records already received), or a `TransportError` naming recv(2) for another failure.
    public func read() async throws -> ByteBuffer? { try await inbound.next() }

    /// The next record as a binary message, waiting at most until `deadline` (then
    /// `ReadDeadlinePassed`, with nothing consumed); the reader parks in the queue, no task is made.
    public func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        try await inbound.next(deadline: deadline).map { TransportMessage(.binary, $0) }
    }

    /// Bytes of the records received and queued for the reader (an empty record counts as one).
    public var unreadByteCount: Int? { inbound.bufferedBytes }

    /// For an AF_UNIX socket, the bytes sent that its peer has not received yet (SIOCOUTQ, unix(7)),
    /// and 0 once it is closed (AF_UNIX keeps what was sent in the receiver's queue, so closing
    /// drops nothing); `nil` for other families, whose SIOCOUTQ means something else (Bluetooth's
    /// reports the free space) or nothing.
    public var unsentByteCount: Int? {
        guard isUnixSocket else { return nil }
        guard gate.enter() else { return 0 }
        defer { gate.leave() }
        var queued: Int32 = 0
        guard ioctl(fd.rawValue, UInt(TIOCOUTQ), &queued) == 0 else { return nil }
        return Int(queued)
    }

    /// Sends `buffer` as one record, waiting while the socket's send buffer is full. Throws `.misuse`
    /// once closed, the `hangUp` error when the peer is gone, and a `TransportError` with EMSGSIZE
    /// for a record larger than the peer accepts.
    public func write(_ buffer: ByteBuffer) async throws {
        guard gate.enter() else { throw TransportError(.misuse, "\(describing) is closed") }
        defer { gate.leave() }
        while true {
            switch Self.send(fd, buffer, buffer.readableBytes) {
            case .success: return
            case .failure(.resourceTemporarilyUnavailable), .failure(.noBufferSpace):
                try await fd.wait(until: .writable)
                if gate.isClosed { throw TransportError(.misuse, "\(describing) was closed during a write") }
            case .failure(let errno):
                throw sendFailure(errno, length: buffer.readableBytes)
            }
        }
    }

    /// Sends `buffer` as records of at most ``maximumWriteSize`` bytes, in order (the connection
    /// calls this for a write larger than one record). Records go out from the calling task while
    /// the socket takes them at once; once it is full, the rest are sent from a thread of this
    /// connection's own that waits in poll(2) between records, and the task is resumed when the
    /// last was taken. Cancelling the task stops the thread's sending before the next record
    /// (records taken stay sent, and were reported to `accepted`). Errors as ``write(_:)``; when the
    /// system refuses the thread, the rest is sent from the task, waiting for room per record.
    /// A timed write (`Connection.write(_:timeout:)`) does not come here: it goes record by record
    /// through ``write(_:)``, each bounded by the deadline.
    public func writeRecords(_ buffer: ByteBuffer, accepted: @escaping @Sendable (Int) -> Void) async throws {
        guard gate.enter() else { throw TransportError(.misuse, "\(describing) is closed") }
        defer { gate.leave() }
        let limit = max(1, maximumWriteSize ?? buffer.readableBytes)
        var rest = buffer
        switch Self.sendWhileTaken(fd, &rest, limit: limit, accepted: accepted) {
        case .sent, .stopped:
            return
        case .full:
            try await sendFromThread(rest, limit: limit, accepted: accepted)
        case .failed(let errno, let length):
            throw sendFailure(errno, length: length)
        }
    }

    /// One record of `length` bytes from the start of `records`, without waiting.
    private static func send(_ fd: SystemPackage.FileDescriptor, _ records: ByteBuffer, _ length: Int) -> Result<Int, Errno> {
        Syscall.attempt { records.withUnsafeReadableBytes { Glibc.send(fd.rawValue, $0.baseAddress, length, Int32(MSG_NOSIGNAL | MSG_DONTWAIT)) } }
    }

    /// Where ``sendWhileTaken(_:_:limit:accepted:stop:)`` stopped.
    fileprivate enum SendStop {
        /// Every record went.
        case sent
        /// The socket has no room (EAGAIN or ENOBUFS): wait for writability, then go on.
        case full
        /// `stop` said so before the next record.
        case stopped
        /// send(2) failed with this errno on a record of this length.
        case failed(Errno, length: Int)
    }

    /// Sends records of at most `limit` bytes from `rest` while the socket takes them without
    /// waiting and `stop` says go on, telling `accepted` each one's size; `rest` is left at the
    /// first record not sent. The writing task and the sender thread share it.
    fileprivate static func sendWhileTaken(_ fd: SystemPackage.FileDescriptor, _ rest: inout ByteBuffer, limit: Int,
                                           accepted: (Int) -> Void, stop: () -> Bool = { false }) -> SendStop {
        while rest.readableBytes > 0 {
            if stop() { return .stopped }
            let length = min(limit, rest.readableBytes)
            switch send(fd, rest, length) {
            case .success:
                rest.moveReaderIndex(forwardBy: length)
                accepted(length)
            case .failure(.resourceTemporarilyUnavailable), .failure(.noBufferSpace):
                return .full
            case .failure(let errno):
                return .failed(errno, length: length)
            }
        }
        return .sent
    }

    /// What a failed send(2) of a `length`-byte record throws.
    private func sendFailure(_ errno: Errno, length: Int) -> TransportError {
        if gate.isClosed { return TransportError(.misuse, "\(describing) was closed during a write") }
        switch errno {
        case .messageTooLong:
            return TransportError.posix("send", errno: .messageTooLong, what: describing,
                                        hint: "a write of \(length) bytes is larger than the peer accepts (\(maximumWriteSize.map(String.init) ?? "?") bytes)")
        case let errno where Self.hangUps.contains(errno):
            return hangUp(errno, "send")
        default:
            return TransportError.posix("send", errno: errno, what: describing)
        }
    }

    /// Sends `records` from the connection's sender thread; returns once all were taken.
    private func sendFromThread(_ records: ByteBuffer, limit: Int, accepted: @escaping @Sendable (Int) -> Void) async throws {
        let made = Result { () throws -> RecordSender in
            try sender.withLock { sender in
                if let sender { return sender }
                let made = try RecordSender()
                sender = made
                return made
            }
        }
        guard case .success(let sender) = made else {
            // No thread (or no pipe) to be had: record by record from this task.
            return try await writeRecordByRecord(records, accepted: accepted)
        }
        let job = RecordSender.Job(fd: fd, records: records, limit: limit, accepted: accepted)
        let outcome = await withTaskCancellationHandler {
            await sender.run(job)
        } onCancel: {
            sender.cancel(job)
        }
        switch outcome {
        case .sent: return
        case .cancelled: throw CancellationError()
        case .notRun: throw TransportError(.misuse, "\(describing) was closed during a write")
        case .failed(let errno, let length): throw sendFailure(errno, length: length)
        }
    }

    /// Always throws `.unsupported`: close the connection instead.
    public func closeWrite() async throws {
        throw TransportError(.unsupported, "\(describing) cannot half-close (a SEQPACKET channel has no end-of-stream of its own); close the connection instead")
    }

    /// Shuts the socket down, waits for the reader and any write in progress to leave, and
    /// closes the descriptor; reads then end with `nil`. Records already sent are the kernel's to
    /// deliver; nothing waits for them.
    public func close() async throws {
        await shutDown()
    }

    /// Ends reading as if the peer had hung up (after the records already received), for an owner
    /// that learns of the end another way (bluetoothd reporting the link down) before the socket does.
    public func endReading() {
        guard gate.enter() else { return }
        defer { gate.leave() }
        _ = Glibc.shutdown(fd.rawValue, Int32(SHUT_RD))
    }

    /// Shuts down and closes as ``close()`` does, in a task of its own, without waiting.
    public func connectionDropped() {
        startCleanup { await self.shutDown() }
    }

    private func readLoop() async {
        var buffer = [UInt8](repeating: 0, count: receiveSize)
        while true {
            do {
                try await producing.wait { $0 ? () : nil }
            } catch {
                return   // cancelled: closing
            }
            guard gate.enter() else { return }
            let result = Syscall.attempt { buffer.withUnsafeMutableBytes { recv(fd.rawValue, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) } }
            switch result {
            case .success(0):
                gate.leave()
                inbound.fail(hangUp(nil, nil))
                return
            case .success(let count):
                gate.leave()
                if inbound.append(ByteBuffer(bytes: buffer.prefix(count))) == .pause {
                    producing.update { $0 = false }
                    // The reader may have drained the queue (and called onResume) before the line
                    // above: ask again, or the reader would wait for records never read.
                    if inbound.shouldProduce() { producing.update { $0 = true } }
                }
            case .failure(.resourceTemporarilyUnavailable):
                do {
                    try await fd.wait(until: .readable)
                    gate.leave()
                } catch {
                    gate.leave()
                    return
                }
            case .failure(let errno):
                gate.leave()
                if gate.isClosed { return }
                inbound.fail(Self.hangUps.contains(errno) ? hangUp(errno, "recv") : TransportError.posix("recv", errno: errno, what: describing))
                return
            }
        }
    }

    private func shutDown() async {
        // The descriptor is closed once no read or write is inside a wait or a call on it.
        let closed = await gate.close {
            // Wakes every readiness wait on the socket (it becomes readable and writable with an error).
            _ = Glibc.shutdown(fd.rawValue, Int32(SHUT_RDWR))
            let task = reader.withLock { $0 }
            task?.cancel()
            await task?.value
        }
        if closed {
            inbound.finish()
            // No write is inside any more (the gate is closed): the thread is idle.
            let sender = sender.withLock { sender in
                defer { sender = nil }
                return sender
            }
            await sender?.finish()
        }
    }
}

/// A thread that sends records on one socket, blocked in poll(2) while the socket is full, and
/// a wake pipe through which a cancelled write stops it between records. Jobs (one write's
/// records each) run one after another in the order they came: ``Connection`` serializes the
/// writes of several records, so there is one at a time. (A second job queued behind a first
/// would not see its cancel until the first is done.)
private final class RecordSender: Sendable {
    /// One write's records and where its sending stands.
    final class Job: Sendable {
        let fd: SystemPackage.FileDescriptor
        let records: ByteBuffer
        let limit: Int
        let accepted: @Sendable (Int) -> Void
        /// Set by the writing task's cancellation; read by the thread between records.
        let cancelled = Atomic<Bool>(false)

        init(fd: SystemPackage.FileDescriptor, records: ByteBuffer, limit: Int, accepted: @escaping @Sendable (Int) -> Void) {
            self.fd = fd
            self.records = records
            self.limit = limit
            self.accepted = accepted
        }
    }

    enum Outcome: Sendable {
        case sent
        case cancelled
        /// The thread takes no more jobs (the connection is closing).
        case notRun
        /// send(2) failed with this errno on a record of this length.
        case failed(Errno, length: Int)
    }

    private let thread: JobThread
    /// Polled beside the socket: a cancel pokes it.
    private let wake: WakePipe

    init() throws {
        wake = try WakePipe(what: "a record sender's wake pipe", blockingRead: false)
        thread = try JobThread(name: "tk record send")
    }

    /// Runs `job` on the thread and returns how it ended.
    func run(_ job: Job) async -> Outcome {
        await withCheckedContinuation { continuation in
            let queued = thread.submit { [self] in continuation.resume(returning: send(job)) }
            if !queued { continuation.resume(returning: .notRun) }
        }
    }

    /// Stops `job` before its next record (a wake-up for a job already over is ignored by the next).
    func cancel(_ job: Job) {
        job.cancelled.store(true, ordering: .sequentiallyConsistent)
        wake.poke()
    }

    /// Ends the thread (idle by then) and joins it.
    func finish() async {
        await thread.finish()
    }

    /// On the thread: every record of `job`, waiting in poll(2) while the socket is full, and
    /// checking for a cancel before each record.
    private func send(_ job: Job) -> Outcome {
        var rest = job.records
        var waits = [pollfd(fd: job.fd.rawValue, events: Int16(POLLOUT), revents: 0),
                     pollfd(fd: wake.readEnd, events: Int16(POLLIN), revents: 0)]
        while true {
            switch PacketSocketBackend.sendWhileTaken(job.fd, &rest, limit: job.limit, accepted: job.accepted,
                                                      stop: { job.cancelled.load(ordering: .sequentiallyConsistent) }) {
            case .sent: return .sent
            case .stopped: return .cancelled
            case .failed(let errno, let length): return .failed(errno, length: length)
            case .full:
                // Woken by room (or the socket shut down: the next send fails), or by a cancel.
                _ = Syscall.attempt { poll(&waits, 2, -1) }
                if waits[1].revents != 0 { wake.drain() }
            }
        }
    }
}
