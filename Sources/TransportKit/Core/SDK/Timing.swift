/// The SDK's two waiting primitives: a race with a deadline (throwing an error, or giving nil, when
/// the deadline comes first) and a wait that cancellation cannot cut short. Handshakes, pings,
/// closing handshakes, searches and drains use them; write no private copy.

/// Runs `operation` and returns its result, or throws `error` when `deadline` passes first. The
/// operation is then cancelled and awaited, so this returns on time only if it honours
/// cancellation (for instance by closing, in a cancellation handler, the channel whose future it
/// waits on). A `nil` deadline: no limit.
///
/// ```swift
/// let reply = try await withDeadline(.now + .seconds(5),
///                                    TransportError(.timedOut, "the server did not answer the ping within 5 s")) {
///     try await pong.wait()
/// }
/// ```
@_spi(Plugins)
public func withDeadline<T: Sendable>(
    _ deadline: ContinuousClock.Instant?,
    _ error: @autoclosure @escaping @Sendable () -> TransportError,
    _ operation: @escaping @Sendable () async throws -> T
) async throws -> T {
    guard let value = try await withDeadline(deadline, operation) else { throw error() }
    return value
}

/// Like ``withDeadline(_:_:_:)``, but `nil` when `deadline` passes first instead of an error: for
/// a caller that goes on either way (a poll that an event may wake early, a drain given up after a
/// while) or that words its own error. What the operation throws, and cancellation, is rethrown.
///
/// By default the first to finish decides, as there: a result that comes after the deadline passed
/// is dropped. With `resultWins`, what the operation gives once cancelled at the deadline still wins
/// over the timer (its result, or an error other than `CancellationError`): for a read whose bytes
/// must not be lost because a timer fired at the same moment. `nil` then means the operation ended
/// by the cancellation alone; a cancelled caller gets `CancellationError`.
///
/// ```swift
/// // Woken by a uevent, or after 250 ms to look again.
/// _ = try await withDeadline(.now + .milliseconds(250)) { try await monitor.next() }
///
/// // A chunk that arrived as the timer fired is returned, not dropped.
/// guard let chunk = try await withDeadline(.now + .seconds(1), resultWins: true, { try await backend.read() }) else {
///     throw TransportError(.timedOut, "no data within 1 s")
/// }
/// ```
@_spi(Plugins)
public func withDeadline<T: Sendable>(
    _ deadline: ContinuousClock.Instant?,
    resultWins: Bool = false,
    _ operation: @escaping @Sendable () async throws -> T
) async throws -> T? {
    guard let deadline else { return try await operation() }
    return try await withThrowingTaskGroup(of: T?.self) { group in
        group.addTask { try await operation() }
        group.addTask {
            try await Task.sleep(until: deadline, clock: .continuous)
            return nil
        }
        defer { group.cancelAll() }
        // The first to finish decides; nil is the timer's.
        guard resultWins else { return try await group.next() ?? nil }
        // Both are awaited: the operation's result or its own error wins, whichever finished first.
        var timedOut = false
        while let finished = await group.nextResult() {
            group.cancelAll()
            switch finished {
            case .success(let value?): return value
            case .success(nil): timedOut = true
            case .failure(let error) where !(error is CancellationError): throw error
            case .failure: break
            }
        }
        guard timedOut, !Task.isCancelled else { throw CancellationError() }
        return nil
    }
}

/// Like ``withDeadline(_:_:_:)`` with a duration from now. An `EventLoopFuture`'s `get()` ignores
/// cancellation: wait on it through something that closes its channel when cancelled
/// (`ProtocolLayer.awaitReady(_:on:)` does), or the timeout waits for the future.
///
/// ```swift
/// try await withTimeout(.seconds(10), TransportError(.timedOut, "the client's handshake took longer than 10 s")) {
///     try await ProtocolLayer.awaitReady(steps, on: channel)   // closes the channel when cancelled
/// }
/// ```
@_spi(Plugins)
public func withTimeout<T: Sendable>(
    _ limit: Duration?,
    _ error: @autoclosure @escaping @Sendable () -> TransportError,
    _ operation: @escaping @Sendable () async throws -> T
) async throws -> T {
    try await withDeadline(limit.map { ContinuousClock.now + $0 }, error(), operation)
}

/// Like ``withDeadline(_:resultWins:_:)`` with a duration from now: the result, or `nil` after `limit`.
///
/// ```swift
/// // Give the last writes up to 2 s to reach the device, then close all the same.
/// _ = try? await withTimeout(.seconds(2)) { try await drained.wait { $0 ? () : nil } }
/// ```
@_spi(Plugins)
public func withTimeout<T: Sendable>(
    _ limit: Duration?,
    _ operation: @escaping @Sendable () async throws -> T
) async throws -> T? {
    try await withDeadline(limit.map { ContinuousClock.now + $0 }, operation)
}

/// Runs `operation` to its end even if the calling task is cancelled meanwhile: for what must not
/// be cut short (a close that flushes, a closing handshake bounded by its own timeout). Awaiting a
/// detached task's value does not pass the caller's cancellation on.
///
/// ```swift
/// await uncancellable { try? await channel.close().get() }
/// ```
@_spi(Plugins)
public func uncancellable<T: Sendable>(_ operation: @escaping @Sendable () async -> T) async -> T {
    await Task.detached(operation: operation).value
}

/// Starts cleanup that nobody waits for (what `connectionDropped()` or a `deinit` cannot do at
/// once: a close that awaits, a thread to stop, a service to withdraw) in a task of its own, and
/// counts it until it has finished, so that `TransportRegistry.waitForAbandonedConnects()` also
/// waits for it: a program that exits right after dropping a connection loses none of it.
/// Never a bare `Task { … }` for this.
///
/// ```swift
/// func connectionDropped() {
///     startCleanup { [engine] in await engine.close(drain: false) }
/// }
/// ```
@_spi(Plugins)
public func startCleanup(_ cleanup: @escaping @Sendable () async -> Void) {
    // Counted before the task starts, so a wait that begins right after this call sees it.
    Deadline.abandoned.update { $0 += 1 }
    Task.detached {
        await cleanup()
        Deadline.abandoned.update { $0 -= 1 }
    }
}
