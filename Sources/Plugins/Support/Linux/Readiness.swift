// Readiness.swift: waiting, without a thread per wait, until a descriptor SwiftNIO does not own is
// readable or writable (a netlink socket, a SEQPACKET socket BlueZ hands out, a listening L2CAP
// socket), through epoll(7).
//
// SwiftNIO 2.101 has no public way to register a foreign descriptor with its event loop, so the
// process has one epoll instance of TransportKit's own, watched by one thread started on first use
// and kept for the life of the process. A wait arms the descriptor with EPOLLONESHOT for what its
// waiters want (EPOLL_CTL_MOD, or EPOLL_CTL_ADD the first time: one system call), and the thread
// resumes the waiters an event matches, then re-arms for the waiters left. Level-triggered: a
// descriptor already ready is reported at once. A closed descriptor leaves the epoll set by
// itself (its last reference gone); a number reused for another file is added again (ENOENT).
// The dispatch source per wait this replaced cost two conditions, a source, its registration and
// a cancellation handshake for every wait; this costs one epoll_ctl and one lock.

import CLinux
import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore

extension FileDescriptor {
    /// What to wait for.
    public enum Readiness: Sendable {
        /// Bytes (or a hang-up, or an error) can be read without blocking.
        case readable
        /// Bytes can be written without blocking.
        case writable
    }

    /// Suspends until the descriptor is readable or writable (or has an error or a hang-up).
    /// Cancelling the task ends the wait with `CancellationError`. The descriptor must stay open
    /// while this waits; once it returns (or throws), it may be closed. Throws a `TransportError`
    /// naming epoll_ctl when the descriptor cannot be watched (EBADF: it is not open).
    ///
    /// ```swift
    /// while true {
    ///     switch Syscall.attempt({ recv(fd.rawValue, &buffer, buffer.count, 0) }) {
    ///     case .success(let count): return count
    ///     case .failure(.resourceTemporarilyUnavailable): try await fd.wait(until: .readable)
    ///     case .failure(let errno): throw TransportError.posix("recv", errno: errno, what: path)
    ///     }
    /// }
    /// ```
    public func wait(until readiness: Readiness) async throws {
        try await ReadinessPoller.shared().wait(rawValue, for: readiness)
    }
}

extension FileDescriptor {
    /// Waits for a non-blocking connect(2) that returned EINPROGRESS to finish: `nil` once the
    /// socket is connected, or the errno it failed with (SO_ERROR). A wake-up that finds the
    /// socket still connecting (readiness waits may wake spuriously; SO_ERROR is 0 then too) is
    /// told apart with getpeername(2) (ENOTCONN) and waited out. Cancelling the task ends the wait
    /// with `CancellationError`; the caller closes the socket.
    ///
    /// ```swift
    /// switch Syscall.attempt({ connect(fd.rawValue, address, length) }) {
    /// case .success: break
    /// case .failure(.nowInProgress): if let errno = try await fd.waitForConnect(describing: url) { throw refused(errno) }
    /// case .failure(let errno): throw refused(errno)
    /// }
    /// ```
    public func waitForConnect(describing what: String) async throws -> Errno? {
        while true {
            try await wait(until: .writable)
            var code: Int32 = 0
            var length = socklen_t(MemoryLayout<Int32>.size)
            _ = try Syscall.run("getsockopt(SO_ERROR)", on: what) { getsockopt(rawValue, SOL_SOCKET, SO_ERROR, &code, &length) }
            if code != 0 { return Errno(rawValue: code) }
            var peer = sockaddr_storage()
            var peerLength = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let named = withUnsafeMutablePointer(to: &peer) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getpeername(rawValue, $0, &peerLength) }
            }
            if named == 0 { return nil }
            guard Syscall.errno == .socketNotConnected else { return Syscall.errno }
        }
    }
}

/// The process's epoll instance and the thread that watches it. Waiters are kept by descriptor
/// number; an event resumes those it matches (an error or hang-up resumes all) outside the lock.
final class ReadinessPoller: Sendable {
    private struct Waiter {
        let id: UInt64
        let readiness: FileDescriptor.Readiness
        /// Resumed with `true` when the descriptor is ready (or woken), `false` at the deadline.
        let continuation: CheckedContinuation<Bool, any Error>
    }

    private struct State {
        var nextID: UInt64 = 0
        var waiters: [Int32: [Waiter]] = [:]
    }

    private let epoll: Int32
    private let state = Locked(State())

    private static let instance: Result<ReadinessPoller, TransportError> = Result { try ReadinessPoller() }
        .mapError { $0 as? TransportError ?? TransportError(.io, "cannot start the readiness poller: \($0)") }

    /// The poller, started on first use; throws what made it fail (no epoll instance or no thread).
    static func shared() throws -> ReadinessPoller { try instance.get() }

    private init() throws {
        let epoll = try Syscall.run("epoll_create1", on: "TransportKit's readiness poller") { epoll_create1(Int32(EPOLL_CLOEXEC)) }
        self.epoll = epoll
        let state = self.state
        do {
            // Lives as long as the process: never stopped, so never joined.
            _ = try WorkerThread(name: "tk readiness") { _ in
                Self.run(epoll: epoll, state: state)
            } interrupt: {}
        } catch {
            _ = close(epoll)
            throw error
        }
    }

    /// Suspends until `fd` is ready for `readiness` (then `true`), or `deadline` passes (then
    /// `false`; a timer task beside the waiter, no task group), or `unless()` (checked under the
    /// poller's lock, after ``wakeAll(_:)``'s caller changed what it reads) is true at the start.
    @discardableResult
    func wait(_ fd: Int32, for readiness: FileDescriptor.Readiness, deadline: ContinuousClock.Instant? = nil,
              unless: @Sendable () -> Bool = { false }) async throws -> Bool {
        let id = state.withLock { state -> UInt64 in
            state.nextID &+= 1
            return state.nextID
        }
        // The timer may fire before the waiter is registered; registering then sees the deadline
        // passed (the timer never fires before it), so no wake-up is lost either way.
        let timer = deadline.map { deadline in
            Task { [self] in
                try await Task.sleep(until: deadline, clock: .continuous)
                remove(id, of: fd)?.continuation.resume(returning: false)
            }
        }
        defer { timer?.cancel() }
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Bool, any Error>) in
                let outcome = state.withLock { state -> Result<Bool?, any Error> in
                    // Cancelled before this ran: the handler below found no waiter to resume.
                    if Task.isCancelled { return .failure(CancellationError()) }
                    if unless() { return .success(true) }
                    if let deadline, ContinuousClock.now >= deadline { return .success(false) }
                    state.waiters[fd, default: []].append(Waiter(id: id, readiness: readiness, continuation: continuation))
                    switch arm(fd, for: state.waiters[fd] ?? []) {
                    case .success: return .success(nil)
                    case .failure(.notPermitted):
                        // epoll(7) refuses regular files and directories, which poll(2) calls always ready.
                        state.waiters[fd]?.removeAll { $0.id == id }
                        return .success(true)
                    case .failure(let errno):
                        state.waiters[fd]?.removeAll { $0.id == id }
                        if state.waiters[fd]?.isEmpty == true { state.waiters[fd] = nil }
                        return .failure(TransportError.posix("epoll_ctl", errno: errno, what: "descriptor \(fd)"))
                    }
                }
                switch outcome {
                case .success(let ready?): continuation.resume(returning: ready)
                case .success(nil): break
                case .failure(let error): continuation.resume(throwing: error)
                }
            }
        } onCancel: {
            remove(id, of: fd)?.continuation.resume(throwing: CancellationError())
        }
    }

    /// Takes the waiter `id` of `fd` out, if it is still waiting (for its cancellation or its
    /// deadline). What is left stays armed for itself; a wider mask only costs a spurious event.
    private func remove(_ id: UInt64, of fd: Int32) -> Waiter? {
        state.withLock { state in
            guard let index = state.waiters[fd]?.firstIndex(where: { $0.id == id }) else { return nil }
            let waiter = state.waiters[fd]?.remove(at: index)
            if state.waiters[fd]?.isEmpty == true { state.waiters[fd] = nil }
            return waiter
        }
    }

    /// Resumes every waiter on `fd` at once (they check why they woke): for a closing owner, after
    /// it changed what their `unless` reads.
    func wakeAll(_ fd: Int32) {
        let woken = state.withLock { $0.waiters.removeValue(forKey: fd) ?? [] }
        for waiter in woken { waiter.continuation.resume(returning: true) }
    }

    /// Arms `fd` for its waiters' union, once (EPOLLONESHOT); adds it when the epoll set lacks it.
    /// Under the lock.
    private func arm(_ fd: Int32, for waiters: [Waiter]) -> Result<Void, Errno> {
        var event = epoll_event()
        event.events = Self.events(for: waiters)
        event.data.u64 = UInt64(UInt32(bitPattern: fd))
        if epoll_ctl(epoll, EPOLL_CTL_MOD, fd, &event) == 0 { return .success(()) }
        guard Syscall.errno == .noSuchFileOrDirectory else { return .failure(Syscall.errno) }
        return Syscall.attempt { epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event) }.map { _ in () }
    }

    /// The epoll events `waiters` wait for, armed once (EPOLLONESHOT).
    private static func events(for waiters: [Waiter]) -> UInt32 {
        waiters.reduce(EPOLLONESHOT.rawValue) { events, waiter in
            events | (waiter.readiness == .readable ? EPOLLIN.rawValue | EPOLLRDHUP.rawValue : EPOLLOUT.rawValue)
        }
    }

    /// The thread's loop: wait, then resume what each event matches and re-arm for the rest.
    private static func run(epoll: Int32, state: Locked<State>) {
        var events = [epoll_event](repeating: epoll_event(), count: 64)
        let both = EPOLLERR.rawValue | EPOLLHUP.rawValue
        while true {
            let count = events.withUnsafeMutableBufferPointer { epoll_wait(epoll, $0.baseAddress, Int32($0.count), -1) }
            guard count > 0 else { continue }   // EINTR
            for event in events.prefix(Int(count)) {
                let fd = Int32(bitPattern: UInt32(truncatingIfNeeded: event.data.u64))
                let readable = event.events & (EPOLLIN.rawValue | EPOLLRDHUP.rawValue | both) != 0
                let writable = event.events & (EPOLLOUT.rawValue | both) != 0
                let ready = state.withLock { state -> [Waiter] in
                    guard let waiting = state.waiters[fd] else { return [] }
                    let (ready, left) = waiting.reduce(into: ([Waiter](), [Waiter]())) { split, waiter in
                        if waiter.readiness == .readable ? readable : writable { split.0.append(waiter) } else { split.1.append(waiter) }
                    }
                    if left.isEmpty {
                        state.waiters[fd] = nil
                    } else {
                        state.waiters[fd] = left
                        var rearm = epoll_event()
                        rearm.events = Self.events(for: left)
                        rearm.data = event.data
                        if epoll_ctl(epoll, EPOLL_CTL_MOD, fd, &rearm) != 0 {
                            // Gone from the set (closed under a waiter, which its owner must not do): wake them to find out.
                            state.waiters[fd] = nil
                            return waiting
                        }
                    }
                    return ready
                }
                for waiter in ready { waiter.continuation.resume(returning: true) }
            }
        }
    }
}
