// WorkerThread.swift: threads for work that must block, kept off Swift's cooperative pool (on a
// 2-core machine that pool has two threads; one blocked call would stall every task) and off pools
// other code shares (NIOThreadPool.singleton, dispatch's worker threads).
//   - WorkerThread: one long-lived thread for a C library that runs its own event handling
//     (libusb_handle_events, an sd-bus loop), stopped by a call that interrupts it, and joined.
//   - JobThread: one long-lived thread that runs jobs in the order they came (a spy+ trace's writes).
//   - Blocking.run: a short blocking call (open(2), reading a file, a sysfs walk) on TransportKit's
//     own small pool.
//   - Blocking.runOnThread: a call that waits as long as a device or a peer wants (tcdrain,
//     TIOCSBRK, a tty's last close(2), an SDP search) on a thread started for it.

import Glibc
import NIOPosix
import Synchronization
@_spi(Plugins) import TransportKitCore

/// A named thread that runs a C library's event loop until it is stopped.
///
/// `body` runs on the thread; it should loop until `isStopping()` turns true, blocking inside the
/// library in between. ``stop()`` sets that flag, calls `interrupt` (which must make the blocked
/// call return, as `libusb_interrupt_event_handler` does), and waits, without blocking a task's
/// thread, until the thread has ended.
///
/// ```swift
/// let events = try WorkerThread(name: "libusb events") { isStopping in
///     while !isStopping() { _ = libusb_handle_events(context) }
/// } interrupt: {
///     libusb_interrupt_event_handler(context)
/// }
/// // … transfers complete on that thread …
/// await events.stop()
/// ```
public final class WorkerThread: Sendable {
    /// The thread's name, as ps, top and gdb show it (its first 15 bytes).
    public let name: String
    private let interrupt: @Sendable () -> Void
    /// Set by `stop()`; read by the thread's loop.
    private let stopping = AsyncCondition(false)
    /// Set by the thread when `body` returned.
    private let ended = AsyncCondition(false)
    private let thread: pthread_t

    /// Starts the thread; throws when the system refuses a new thread.
    public init(name: String, _ body: @escaping @Sendable (_ isStopping: @Sendable () -> Bool) -> Void,
                interrupt: @escaping @Sendable () -> Void) throws {
        self.name = name
        self.interrupt = interrupt
        let stopping = self.stopping
        let ended = self.ended
        let job = Job {
            Self.nameCurrentThread(name)
            body { stopping.withLock { $0 } }
            ended.update { $0 = true }
        }
        var thread = pthread_t()
        let box = Unmanaged.passRetained(job)
        let result = pthread_create(&thread, nil, { context in
            guard let context else { return nil }
            let job = Unmanaged<Job>.fromOpaque(context).takeRetainedValue()
            job.run()
            return nil
        }, box.toOpaque())
        guard result == 0 else {
            box.release()
            throw TransportError(.io, "cannot start the \(name) thread: pthread_create failed", errno: .init(rawValue: result), syscall: "pthread_create")
        }
        self.thread = thread
    }

    /// Names the calling thread for ps, top and gdb: the kernel keeps the first 15 bytes
    /// (proc(5), /proc/thread-self/comm; pthread_setname_np is not visible to Swift).
    static func nameCurrentThread(_ name: String) {
        let fd = open("/proc/thread-self/comm", O_WRONLY | O_CLOEXEC)
        guard fd >= 0 else { return }
        let bytes = Array(name.utf8.prefix(15))
        _ = bytes.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
        _ = close(fd)
    }

    /// `true` until the thread's body has returned.
    public var isRunning: Bool { !ended.withLock { $0 } }

    /// Asks the thread to stop, interrupts it, and returns once it has ended and was joined.
    /// Another call waits until the thread's body has returned (the first call joins it).
    public func stop() async {
        let first = stopping.update { stopping in
            defer { stopping = true }
            return !stopping
        }
        if first { interrupt() }
        // Not cancellable: the thread must be joined, or it would leak.
        let ended = self.ended
        await uncancellable { _ = try? await ended.wait { $0 ? () : nil } }
        guard first else { return }
        // The body has returned; the thread only has its return left, so this join is immediate.
        _ = pthread_join(thread, nil)
    }

    deinit {
        // Never stopped: the thread keeps running what it was given; let it end on its own.
        if !stopping.withLock({ $0 }) { pthread_detach(thread) }
    }

    private final class Job: Sendable {
        let run: @Sendable () -> Void
        init(_ run: @escaping @Sendable () -> Void) { self.run = run }
    }
}

/// A thread of its own that runs jobs one at a time, in the order they were queued: for blocking
/// work that must stay in order and must not hold a shared thread (a spy+ trace's writes, which a
/// slow disk or a full pipe can hold up). The caller bounds what it queues: ``submit(_:)`` takes
/// every job until ``finish()`` or ``finishLater()``.
///
/// ```swift
/// let writer = try JobThread(name: "tk trace")
/// writer.submit { _ = Glibc.write(fd, bytes, count) }
/// await writer.finish()   // runs what was queued, then ends the thread and joins it
/// ```
public final class JobThread: Sendable {
    private let shared: Shared
    private let worker: WorkerThread

    /// Starts the thread; throws when the system refuses a new thread or a pipe.
    public init(name: String) throws {
        let shared = try Shared()
        do {
            worker = try WorkerThread(name: name) { _ in
                shared.run()
            } interrupt: {
                shared.wake()
            }
        } catch {
            shared.end()
            throw error
        }
        self.shared = shared
    }

    /// Queues `job`; `false` (and `job` is not run) once ``finish()`` or ``finishLater()`` was called.
    @discardableResult
    public func submit(_ job: @escaping @Sendable () -> Void) -> Bool {
        shared.submit(job)
    }

    /// Takes no more jobs, lets the thread run those queued, and returns once it has ended and
    /// was joined. Not cancellable.
    public func finish() async {
        shared.close()
        await worker.stop()
    }

    /// Takes no more jobs; the thread runs those queued and then ends on its own.
    public func finishLater() {
        shared.close()
    }

    deinit {
        // The thread runs what is queued and ends; the WorkerThread, never stopped, lets it go.
        shared.close()
    }

    /// The queue and the wake pipe, shared with the thread.
    private final class Shared: Sendable {
        private struct Queue {
            var jobs: [@Sendable () -> Void] = []
            /// Takes jobs; false once closed.
            var open = true
            /// The thread has ended: nothing wakes it any more.
            var ended = false
        }
        private let queue = Locked(Queue())
        /// Its read end blocks: the thread waits in read(2) on it while the queue is empty.
        private let pipe: WakePipe

        init() throws {
            pipe = try WakePipe(what: "a job thread's wake pipe", blockingRead: true)
        }

        /// Under the queue's lock, while not ended.
        private func poke() {
            pipe.poke()
        }

        func submit(_ job: @escaping @Sendable () -> Void) -> Bool {
            queue.withLock { queue in
                guard queue.open else { return false }
                queue.jobs.append(job)
                // Empty before: the thread may be waiting, and no wake-up is pending for this job.
                if queue.jobs.count == 1 { poke() }
                return true
            }
        }

        func close() {
            queue.withLock { queue in
                guard queue.open else { return }
                queue.open = false
                poke()   // open implies not ended
            }
        }

        func wake() {
            queue.withLock { queue in
                if !queue.ended { poke() }
            }
        }

        /// The thread's loop: runs jobs until the queue is closed and empty.
        func run() {
            var drain = [UInt8](repeating: 0, count: 64)
            while true {
                let (jobs, open) = queue.withLock { queue in
                    defer { queue.jobs = [] }
                    return (queue.jobs, queue.open)
                }
                for job in jobs { job() }
                guard jobs.isEmpty else { continue }
                if !open { break }
                _ = Glibc.read(pipe.readEnd, &drain, drain.count)
            }
            end()
        }

        /// Marks the thread ended (the pipe is closed with this object).
        func end() {
            queue.withLock { queue in
                queue.open = false
                queue.ended = true
            }
        }
    }
}

/// A pipe that wakes a thread waiting in read(2) or poll(2) on its read end. Its write end does
/// not block: a full pipe already holds a wake-up, and a poke after the thread stopped waiting
/// is harmless. Both ends are closed when the pipe is released.
///
/// ```swift
/// let wake = try WakePipe(what: "a sender's wake pipe", blockingRead: false)
/// var fds = [pollfd(fd: socket, events: Int16(POLLOUT), revents: 0), pollfd(fd: wake.readEnd, events: Int16(POLLIN), revents: 0)]
/// wake.poke()         // from any thread: the poll(2) above returns
/// wake.drain()        // on the woken thread
/// ```
@_spi(Plugins)
public final class WakePipe: Sendable {
    /// Where the thread waits.
    public let readEnd: Int32
    /// Where ``poke()`` writes.
    private let writeEnd: Int32

    /// Makes the pipe (close-on-exec); `blockingRead: false` makes the read end non-blocking too,
    /// for a thread that waits in poll(2) and empties it with ``drain()``. Throws naming `what`.
    public init(what: String, blockingRead: Bool) throws {
        var ends: [Int32] = [-1, -1]
        guard pipe(&ends) == 0 else {
            throw TransportError.posix("pipe", errno: Syscall.errno, what: what)
        }
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        _ = fcntl(ends[1], F_SETFL, O_NONBLOCK)
        if !blockingRead { _ = fcntl(ends[0], F_SETFL, O_NONBLOCK) }
        readEnd = ends[0]
        writeEnd = ends[1]
    }

    deinit {
        _ = Glibc.close(readEnd)
        _ = Glibc.close(writeEnd)
    }

    /// Wakes the waiting thread (or the next to wait).
    public func poke() {
        var one: UInt8 = 1
        _ = Glibc.write(writeEnd, &one, 1)
    }

    /// Empties the pipe of wake-ups (a non-blocking read end only).
    public func drain() {
        var bytes = [UInt8](repeating: 0, count: 64)
        while Glibc.read(readEnd, &bytes, bytes.count) > 0 {}
    }
}

/// Where TransportKit runs system calls that block, so that none occupies a thread of Swift's
/// cooperative pool, nor a thread of a pool other code shares (SwiftNIO's
/// `NIOThreadPool.singleton`, which has as many threads as cores: two stuck tcdrain calls would
/// stall every other user of it).
///
/// - ``run(_:)``: a short call (opening a file a user named, reading a `replay://` recording, a
///   walk of sysfs, opening a D-Bus connection) on TransportKit's own pool of ``poolThreads``
///   threads, started at the first call and kept for the life of the process. Nothing on this
///   pool waits for a device or a peer, so its threads come free quickly. When all are busy a
///   call waits its turn in the pool's queue; that queue (NIOThreadPool's) has no bound of its
///   own and needs none: each entry belongs to a task suspended in `run` until it is done, so the
///   queue never holds more entries than tasks waiting here. A caller cancelled while its call
///   still waits in the queue gets `CancellationError` and the call does not run; one already
///   running is waited for.
/// - ``runOnThread(_:_:)``: a call that waits as long as a device or a peer wants — tcdrain and
///   TIOCSBRK (flow control can hold a port's output forever), a tty's last close(2) (up to its
///   closing_wait, 30 s by default), an SDP search — on a thread started for it, which ends with
///   the call. No pool, so no queue: however many of these are stuck, no other call waits behind
///   them. There are as many such threads as such calls in progress (each holds a caller);
///   starting one costs tens of microseconds, nothing next to the calls they run.
///
/// ```swift
/// let text = try await Blocking.run { try readRecording(path) }
/// try await Blocking.runOnThread("tk tcdrain") { try Syscall.run("tcdrain", on: path) { tcdrain(fd.rawValue) } }
/// ```
public enum Blocking {
    /// The threads of ``run(_:)``'s pool.
    public static let poolThreads = 4

    /// TransportKit's own pool, started on first use; never shut down (a process-lifetime pool).
    private static let pool: NIOThreadPool = {
        let pool = NIOThreadPool(numberOfThreads: poolThreads)
        pool.start()
        return pool
    }()

    /// Runs `body`, a short blocking call, on TransportKit's pool and returns what it returns (or
    /// throws what it throws).
    @discardableResult
    public static func run<Value: Sendable>(_ body: @escaping @Sendable () throws -> Value) async throws -> Value {
        try await pool.runIfActive(body)
    }

    /// Runs `body`, a call that may block for long, on a thread started for it (named `name`, as
    /// ps and gdb show it: 15 bytes), and returns what it returns (or throws what it throws).
    /// Cancelling the caller does not end the call: a caller that can end it early does that
    /// itself (an SDP search shuts its socket down; an abort flushes a port's output). Throws
    /// `.io` when the system refuses a new thread.
    @discardableResult
    public static func runOnThread<Value: Sendable>(_ name: String, _ body: @escaping @Sendable () throws -> Value) async throws -> Value {
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Value, any Error>) in
            do {
                try startThread(name) { continuation.resume(with: Result(catching: body)) }
            } catch {
                continuation.resume(throwing: error)
            }
        }
    }

    /// Starts a detached thread that runs `body`, then ends.
    private static func startThread(_ name: String, _ body: @escaping @Sendable () -> Void) throws {
        let box = Unmanaged.passRetained(ThreadBody {
            WorkerThread.nameCurrentThread(name)
            body()
        })
        var thread = pthread_t()
        let result = pthread_create(&thread, nil, { context in
            guard let context else { return nil }
            Unmanaged<ThreadBody>.fromOpaque(context).takeRetainedValue().run()
            return nil
        }, box.toOpaque())
        guard result == 0 else {
            box.release()
            throw TransportError(.io, "cannot start a thread for \(name): pthread_create failed", errno: .init(rawValue: result), syscall: "pthread_create")
        }
        pthread_detach(thread)
    }

    private final class ThreadBody: Sendable {
        let run: @Sendable () -> Void
        init(_ run: @escaping @Sendable () -> Void) { self.run = run }
    }
}
