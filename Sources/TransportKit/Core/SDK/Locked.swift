// Locked.swift: the one lock type for state shared between threads, in the library and its tests.

import NIOConcurrencyHelpers

/// State behind a lock: every read and change goes through ``withLock(_:)``.
///
/// TransportKit uses this type, not `Synchronization.Mutex`, wherever state is shared:
/// ThreadSanitizer does not see `Mutex` on Linux (it locks with a futex of its own, so every
/// access under it is reported as a race), and sees this one (a pthread mutex underneath, through
/// SwiftNIO's `NIOLockedValueBox`). With one lock type the whole suite can run under
/// `--sanitize=thread` and a report means a real race. Never wait inside the closure: no `await`
/// can be there, and nothing that blocks belongs there either.
///
/// ```swift
/// final class Counter: Sendable {
///     private let count = Locked(0)
///     func increment() -> Int { count.withLock { $0 += 1; return $0 } }
/// }
/// ```
// @unchecked Sendable, as `Mutex` is Sendable for any value: the state is only reached through
// withLock, under the pthread mutex. (Mutex also makes the closure's state and result `sending`;
// NIOLockedValueBox's closure cannot take that, so a result that is not Sendable can leave the lock
// here: return copies of Sendable values, as every caller does.)
@_spi(Plugins)
public struct Locked<State>: @unchecked Sendable {
    @usableFromInline
    let box: NIOLockedValueBox<State>

    /// `state` behind a lock of its own.
    @inlinable
    public init(_ state: State) {
        box = NIOLockedValueBox(state)
    }

    /// Runs `body` with the state, holding the lock; returns what `body` returns.
    ///
    /// ```swift
    /// let wasEmpty = queue.withLock { queue in defer { queue.append(item) }; return queue.isEmpty }
    /// ```
    @inlinable
    public func withLock<Result>(_ body: (inout State) throws -> Result) rethrows -> Result {
        try box.withLockedValue(body)
    }
}
