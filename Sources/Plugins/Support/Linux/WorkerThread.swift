// WorkerThread.swift: threads for work that must block, kept off Swift's cooperative pool (on a
// 2-core machine that pool has two threads; one blocked call would stall every task).
//   - WorkerThread: one long-lived thread for a C library that runs its own event handling
//     (libusb_handle_events, an sd-bus loop), stopped by a call that interrupts it, and joined.
//   - Blocking.run: one blocking call (tcdrain) on SwiftNIO's thread pool.

import Glibc
import NIOPosix
import TransportKitCore

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
    private static func nameCurrentThread(_ name: String) {
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

/// Runs one blocking call on SwiftNIO's thread pool, so it never occupies the cooperative pool.
///
/// ```swift
/// try await Blocking.run { try Syscall.run("tcdrain", on: path) { tcdrain(fd.rawValue) } }
/// ```
public enum Blocking {
    /// Runs `body` on a pool thread and returns what it returns (or throws what it throws).
    @discardableResult
    public static func run<Value: Sendable>(_ body: @escaping @Sendable () throws -> Value) async throws -> Value {
        try await NIOThreadPool.singleton.runIfActive(body)
    }
}
