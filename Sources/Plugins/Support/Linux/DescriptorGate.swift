// DescriptorGate.swift: closing a descriptor only once no task is inside a readiness wait or a
// system call on it. Closed under such a use, the number could be reused by another file meanwhile
// (and epoll would watch the other file, or recv(2) read its bytes).

import SystemPackage
@_spi(Plugins) import TransportKitCore

/// Counts the tasks using a descriptor (a readiness wait, a system call), and closes it only once
/// the last has left: closing marks the gate closed, after which no use begins, wakes the uses
/// under way, waits for them to leave and then closes the descriptor.
///
/// ```swift
/// let gate = DescriptorGate(fd)
///
/// // A use: accept(2) until a connection comes, or the gate closes.
/// guard gate.enter() else { return nil }        // closed: do not touch the descriptor
/// defer { gate.leave() }
/// while !gate.isClosed {
///     if let accepted = try acceptOne(fd) { return accepted }
///     try await gate.wait(until: .readable)       // readable, or the gate closed
/// }
/// return nil
///
/// // Closing (the first call closes; later ones return false at once):
/// await gate.close(waking: { _ = shutdown(fd.rawValue, Int32(SHUT_RDWR)) })
/// ```
public final class DescriptorGate: Sendable {
    private struct State: Sendable {
        /// Uses inside a readiness wait or a system call on the descriptor.
        var users = 0
        var closed = false
    }

    private let fd: FileDescriptor
    private let state = AsyncCondition(State())

    /// A gate for `fd`, which it closes in ``close(waking:)`` (the caller owns it until then).
    public init(_ fd: FileDescriptor) {
        self.fd = fd
    }

    /// Counts a use of the descriptor; `false` once closing began (then leave the descriptor
    /// alone). Pair every `true` with ``leave()``.
    public func enter() -> Bool {
        state.update { state in
            guard !state.closed else { return false }
            state.users += 1
            return true
        }
    }

    /// Ends a use counted by ``enter()``.
    public func leave() {
        state.update { $0.users -= 1 }
    }

    /// Closing began (``close(waking:)`` was called).
    public var isClosed: Bool { state.withLock { $0.closed } }

    /// Suspends, inside a use, until the descriptor is ready or the gate closes, whichever comes
    /// first (then `true`; check ``isClosed`` after it), or `deadline` passes (then `false`).
    /// Cancelling the task ends the wait with `CancellationError`.
    ///
    /// ```swift
    /// guard try await gate.wait(until: .readable, deadline: .now + .seconds(2)) else { throw ReadDeadlinePassed() }
    /// ```
    @discardableResult
    public func wait(until readiness: FileDescriptor.Readiness, deadline: ContinuousClock.Instant? = nil) async throws -> Bool {
        let state = state
        // close(waking:) marks the gate closed before it wakes the waiters: a wait that begins
        // after the mark returns at once, one that began before it is woken.
        return try await ReadinessPoller.shared().wait(fd.rawValue, for: readiness, deadline: deadline) { state.withLock { $0.closed } }
    }

    /// Closes the descriptor, once: marks the gate closed (no use begins after this, and
    /// ``wait(until:deadline:)`` returns), runs `wake` to end the uses that do not watch the gate (shut a
    /// socket down, cancel a reader), waits until every use has left and closes the descriptor.
    /// Not cancellable. Returns `false`, at once, when the gate was closed already.
    @discardableResult
    public func close(waking wake: () async -> Void = {}) async -> Bool {
        let first = state.update { state -> Bool in
            defer { state.closed = true }
            return !state.closed
        }
        guard first else { return false }
        (try? ReadinessPoller.shared())?.wakeAll(fd.rawValue)
        await wake()
        let uses = state
        await uncancellable { _ = try? await uses.wait { $0.users == 0 ? () : nil } }
        fd.closeOwned()
        return true
    }
}
