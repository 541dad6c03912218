// ModemLineWatch.swift: changes of a tty's modem input lines (CTS, DSR, RI, CD) through TIOCMIWAIT
// (ioctl_tty(2)): the calling thread sleeps until one of the lines in the mask changes, or the port
// hangs up (EIO: a USB adapter unplugged). Drivers without it (ptys; some USB serial drivers) answer
// EINVAL or ENOTTY. The call blocks, so each watch runs on a thread of its own (WorkerThread), on a
// duplicate of the port's descriptor.
//
// Ending a watch early takes a signal: SIGURG, with a handler that does nothing, installed without
// SA_RESTART so the kernel's wait returns EINTR. It is installed once, only over SIGURG's default
// disposition (ignore); an application's own handler is used as it is if it lets calls be
// interrupted (no SA_RESTART), and a watch is refused otherwise. The watch thread unblocks SIGURG
// for itself (threads made from a dispatch worker inherit a mask that blocks it). The signal goes
// to the watch's thread only, again every 5 ms until the thread has left the call (one sent just
// before it entered would be lost).

import Glibc
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// The watches of one port: stopped before the port's descriptor closes, so no duplicate keeps
/// the port (and its flock) open after the connection closed.
final class ModemLineWatches: Sendable {
    private struct State {
        var closed = false
        var running: [Int: WorkerThread] = [:]
        var next = 0
    }
    private let state = Locked(State())

    /// Starts watching `device`: the lines now, then each change. Throws `.unsupported` on a port
    /// without modem lines, or when SIGURG cannot interrupt the wait in this process.
    func start(_ device: TTYDevice) throws -> AsyncThrowingStream<ModemLines, any Error> {
        let path = device.path
        guard WakeSignal.usable() else {
            throw TransportError(.unsupported, "this process ignores SIGURG, or handles it with SA_RESTART: a modem-line watch could not be "
                                 + "stopped; read modemLines() now and then instead")
        }
        let (own, initial) = try device.withDescriptor { fd in
            let initial = try TTYLines(fd: fd, path: path).get(askedBy: .method("modemLineChanges()")).intersection(.inputs)
            let own = try Syscall.run("fcntl(F_DUPFD_CLOEXEC)", on: path) { fcntl(fd.rawValue, F_DUPFD_CLOEXEC, 0) }
            return (own, initial)
        }
        let (stream, continuation) = AsyncThrowingStream<ModemLines, any Error>.makeStream(bufferingPolicy: .bufferingNewest(64))
        continuation.yield(initial)
        let inCall = InCall()
        let key = state.withLock { state in
            defer { state.next += 1 }
            return state.next
        }
        // Set before the thread starts: a watch that ends at once is still joined at once.
        continuation.onTermination = { [weak self] _ in
            guard let thread = self?.state.withLock({ $0.running.removeValue(forKey: key) }) else { return }
            startCleanup { await thread.stop() }
        }
        let thread: WorkerThread
        do {
            thread = try WorkerThread(name: "tk modem lines") { isStopping in
                var wake = sigset_t()
                sigemptyset(&wake)
                sigaddset(&wake, SIGURG)
                pthread_sigmask(SIG_UNBLOCK, &wake, nil)
                inCall.thread.withLock { $0 = pthread_self() }
                defer {
                    // Under the lock: a wake-up is never sent to a thread that has gone.
                    inCall.thread.withLock { $0 = nil }
                    _ = close(own)
                }
                let mask = ModemLines.inputs.rawValue
                var last = initial
                while !isStopping() {
                    var bits: Int32 = 0
                    guard ioctl(own, UInt(TIOCMGET), &bits) == 0 else {
                        continuation.finish(throwing: Self.failure("ioctl(TIOCMGET)", errno, path))
                        return
                    }
                    let now = ModemLines(rawValue: bits).intersection(.inputs)
                    if now != last {
                        continuation.yield(now)
                        last = now
                    }
                    if ioctl(own, UInt(TIOCMIWAIT), mask) != 0 {
                        let code = errno
                        if code == EINTR { continue }
                        continuation.finish(throwing: Self.failure("ioctl(TIOCMIWAIT)", code, path))
                        return
                    }
                }
                continuation.finish()
            } interrupt: {
                Task.detached {
                    while inCall.thread.withLock({ thread in thread.map { pthread_kill($0, SIGURG) } }) != nil {
                        try? await Task.sleep(for: .milliseconds(5))
                    }
                }
            }
        } catch {
            _ = close(own)
            continuation.finish(throwing: error)
            throw error
        }
        let closed = state.withLock { state in
            if !state.closed { state.running[key] = thread }
            return state.closed
        }
        if closed { startCleanup { await thread.stop() } }
        return stream
    }

    /// Stops every watch and waits until their threads have ended (the port is closing).
    func stopAll() async {
        for thread in closeAndTake() { await thread.stop() }
    }

    /// Stops every watch without waiting (the connection was dropped).
    func stopSoon() {
        let threads = closeAndTake()
        if !threads.isEmpty { startCleanup { for thread in threads { await thread.stop() } } }
    }

    /// No watch starts from now on; the running ones, to stop.
    private func closeAndTake() -> [WorkerThread] {
        state.withLock { state in
            state.closed = true
            defer { state.running = [:] }
            return Array(state.running.values)
        }
    }

    private static func failure(_ call: String, _ code: Int32, _ path: String) -> TransportError {
        let errno = Errno(rawValue: code)
        switch errno {
        // EIO from a hung-up tty; ENODEV from cdc_acm once its device is gone.
        case .ioError, Errno(rawValue: ENODEV), Errno(rawValue: ENXIO), Errno(rawValue: ESHUTDOWN):
            return TransportError(.disconnected, "\(path) went away while its modem lines were watched (adapter unplugged)", errno: errno, syscall: call)
        case .invalidArgument, .inappropriateIOCTLForDevice:
            return TransportError(.unsupported, "the driver of \(path) cannot wait for modem line changes (\(call)); read modemLines() now and then instead",
                                  errno: errno, syscall: call)
        default:
            return TransportError(.io, "watching the modem lines of \(path) failed", errno: errno, syscall: call)
        }
    }
}

/// The watch thread while it may be inside TIOCMIWAIT: set by the thread, cleared before it returns.
private final class InCall: Sendable {
    let thread = Locked<pthread_t?>(nil)
}

/// SIGURG as the signal that ends a blocking wait (see the file's comment).
enum WakeSignal {
    /// `true` when SIGURG interrupts a blocking call in this process: the handler installed here,
    /// or the application's own without SA_RESTART.
    static func usable() -> Bool {
        _ = installed
        var current = sigaction()
        guard sigaction(SIGURG, nil, &current) == 0, let handler = current.__sigaction_handler.sa_handler else { return false }
        // SIG_IGN is the handler 1: an ignored signal interrupts nothing.
        guard unsafeBitCast(handler, to: Int.self) != 1 else { return false }
        return current.sa_flags & Int32(SA_RESTART) == 0
    }

    private static let installed: Bool = {
        var current = sigaction()
        guard sigaction(SIGURG, nil, &current) == 0, current.__sigaction_handler.sa_handler == nil else { return false }
        var action = sigaction()
        action.__sigaction_handler.sa_handler = { _ in }
        sigemptyset(&action.sa_mask)
        action.sa_flags = 0
        return sigaction(SIGURG, &action, nil) == 0
    }()
}
