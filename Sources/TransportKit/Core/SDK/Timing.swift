/// The SDK's two waiting primitives: a race with a deadline and a wait that cancellation cannot
/// cut short. Handshakes, pings and closing handshakes use them; write no private copy.

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
public func withDeadline<T: Sendable>(
    _ deadline: ContinuousClock.Instant?,
    _ error: @autoclosure @escaping @Sendable () -> TransportError,
    _ operation: @escaping @Sendable () async throws -> T
) async throws -> T {
    guard let deadline else { return try await operation() }
    return try await withThrowingTaskGroup(of: T?.self) { group in
        group.addTask { try await operation() }
        group.addTask {
            try await Task.sleep(until: deadline, clock: .continuous)
            return nil
        }
        defer { group.cancelAll() }
        // The first to finish decides; nil is the timer's.
        guard let first = try await group.next(), let value = first else { throw error() }
        return value
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
public func withTimeout<T: Sendable>(
    _ limit: Duration?,
    _ error: @autoclosure @escaping @Sendable () -> TransportError,
    _ operation: @escaping @Sendable () async throws -> T
) async throws -> T {
    try await withDeadline(limit.map { ContinuousClock.now + $0 }, error(), operation)
}

/// Runs `operation` to its end even if the calling task is cancelled meanwhile: for what must not
/// be cut short (a close that flushes, a closing handshake bounded by its own timeout). Awaiting a
/// detached task's value does not pass the caller's cancellation on.
///
/// ```swift
/// await uncancellable { try? await channel.close().get() }
/// ```
public func uncancellable<T: Sendable>(_ operation: @escaping @Sendable () async -> T) async -> T {
    await Task.detached(operation: operation).value
}
