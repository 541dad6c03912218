import Synchronization

/// State behind a lock that tasks can wait on until it satisfies a condition: an asynchronous
/// condition variable, and the one place waiting tasks are parked in TransportKit (besides the
/// hot path of ``InboundQueue``).
///
/// A waiter gives a check that runs under the lock, at once and again after every ``update(_:)``;
/// the first time it returns a value (or throws), the waiter resumes with it. A check may change the
/// state as it succeeds (take an element, claim a turn), so waking and consuming are one step.
/// Waiters are checked in the order they came. Cancelling a waiting task resumes it with
/// `CancellationError` and leaves the state untouched.
///
/// ```swift
/// let ready = AsyncCondition<[Int]>([])
/// Task { ready.update { $0.append(42) } }
/// let first = try await ready.wait { queue in queue.isEmpty ? nil : queue.removeFirst() }   // 42
/// ```
@_spi(Plugins)
public final class AsyncCondition<State: Sendable>: Sendable {
    // withLock and update are @inlinable, so that a plugin's calls are specialized for its State
    // and result types: unspecialized, every call looked up generic and tuple metadata at run time
    // (a fifth of a usb:// transfer loop's CPU time in the lab's profile).
    @usableFromInline
    struct Waiter: Sendable {
        let id: Int
        /// Runs the check; returns how to resume the waiter when it is done waiting.
        @usableFromInline
        let poll: @Sendable (inout State) -> (@Sendable () -> Void)?
        let cancel: @Sendable () -> Void
    }

    @usableFromInline
    struct Storage: Sendable {
        @usableFromInline
        var state: State
        @usableFromInline
        var waiters: [Waiter] = []
        var nextID = 0

        init(state: State) { self.state = state }
    }

    @usableFromInline
    let storage: Locked<Storage>

    /// A condition around `state`.
    public init(_ state: State) {
        storage = Locked(Storage(state: state))
    }

    /// Reads or changes the state without waking anybody (for changes no waiter waits for).
    ///
    /// ```swift
    /// let count = condition.withLock { $0.count }
    /// ```
    @inlinable
    public func withLock<Result>(_ body: (inout State) throws -> Result) rethrows -> Result {
        try storage.withLock { try body(&$0.state) }
    }

    /// Changes the state, then lets every waiter check it again; the ones whose check now succeeds
    /// are resumed (outside the lock) before this returns.
    ///
    /// ```swift
    /// gateState.update { $0.open = true }
    /// ```
    @discardableResult @inlinable
    public func update<Result>(_ body: (inout State) throws -> Result) rethrows -> Result {
        let (result, wakes) = try storage.withLock { storage -> (Result, [@Sendable () -> Void]) in
            let result = try body(&storage.state)
            return (result, Self.pollWaiters(&storage))
        }
        for wake in wakes { wake() }
        return result
    }

    /// Checks every waiter, in order, until a pass wakes nobody: a check that succeeds may change
    /// the state (take an element) in a way an earlier waiter was waiting for.
    @usableFromInline
    static func pollWaiters(_ storage: inout Storage) -> [@Sendable () -> Void] {
        // Nobody waits: the common case on a data path, with no allocation.
        if storage.waiters.isEmpty { return [] }
        var wakes: [@Sendable () -> Void] = []
        var changed = true
        while changed && !storage.waiters.isEmpty {
            changed = false
            var index = 0
            while index < storage.waiters.count {
                if let wake = storage.waiters[index].poll(&storage.state) {
                    storage.waiters.remove(at: index)
                    wakes.append(wake)
                    changed = true
                } else {
                    index += 1
                }
            }
        }
        return wakes
    }

    /// Suspends until `check`, run under the lock now and after every ``update(_:)``, returns a
    /// value or throws; returns that value or rethrows that error.
    ///
    /// ```swift
    /// try await condition.wait { state in state.open ? () : nil }
    /// ```
    ///
    /// - Throws: what `check` throws, or `CancellationError` when the task is cancelled first.
    public func wait<Value: Sendable>(until check: @escaping @Sendable (inout State) throws -> Value?) async throws -> Value {
        // Fast path: no allocation, no continuation when the condition already holds.
        let (ready, wakes) = try storage.withLock { storage -> (Value?, [@Sendable () -> Void]) in
            guard let value = try check(&storage.state) else { return (nil, []) }
            return (value, Self.pollWaiters(&storage))
        }
        for wake in wakes { wake() }
        if let ready { return ready }
        let id = storage.withLock { storage in
            storage.nextID &+= 1
            return storage.nextID
        }
        return try await withTaskCancellationHandler {
            try await withUnsafeThrowingContinuation { (continuation: UnsafeContinuation<Value, any Error>) in
                // Every path that resumes takes the waiter out of `waiters` under the lock first, so
                // the continuation is resumed exactly once.
                let (ready, wakes): (Result<Value, any Error>?, [@Sendable () -> Void]) = storage.withLock { storage in
                    do {
                        if let value = try check(&storage.state) { return (.success(value), Self.pollWaiters(&storage)) }
                    } catch {
                        return (.failure(error), [])
                    }
                    // Checked under the lock: the cancellation handler either runs after this and
                    // finds the waiter, or ran before and set the flag seen here.
                    if Task.isCancelled { return (.failure(CancellationError()), []) }
                    storage.waiters.append(Waiter(
                        id: id,
                        poll: { state in
                            do {
                                guard let value = try check(&state) else { return nil }
                                return { continuation.resume(returning: value) }
                            } catch {
                                return { continuation.resume(throwing: error) }
                            }
                        },
                        cancel: { continuation.resume(throwing: CancellationError()) }
                    ))
                    return (nil, [])
                }
                for wake in wakes { wake() }
                if let ready { continuation.resume(with: ready) }
            }
        } onCancel: {
            let cancelled = storage.withLock { storage -> Waiter? in
                guard let index = storage.waiters.firstIndex(where: { $0.id == id }) else { return nil }
                return storage.waiters.remove(at: index)
            }
            cancelled?.cancel()
        }
    }

    /// How many tasks are waiting now (for tests and diagnostics).
    public var waiterCount: Int { storage.withLock { $0.waiters.count } }
}
