/// Searches inside a connect: waiting for a device to be plugged in (`?wait=true`), scanning for a
/// Bluetooth peripheral. A search that gives up a little before the connect's deadline can say what
/// it did not find, where the registry's own limit could only say that connecting took too long.
extension ConnectRequest {
    /// When a search that began at `started` should give up: shortly before ``deadline`` (a fifth
    /// of the time left before it, at most one second); nil when the connect has no deadline.
    ///
    /// ```swift
    /// let started = ContinuousClock.now
    /// let found = try await ConnectRequest.first(of: [{ try await waitForArrival() }],
    ///                                            until: request.searchLimit(from: started))
    /// guard let found else { throw TransportError(.timedOut, "… not plugged in within …") }
    /// ```
    public func searchLimit(from started: ContinuousClock.Instant) -> ContinuousClock.Instant? {
        Self.searchLimit(before: deadline, from: started)
    }

    /// ``searchLimit(from:)`` for a deadline handed down without its request.
    ///
    /// ```swift
    /// let limit = ConnectRequest.searchLimit(before: deadline, from: .now) ?? .now + .seconds(10)
    /// ```
    public static func searchLimit(before deadline: ContinuousClock.Instant?, from started: ContinuousClock.Instant) -> ContinuousClock.Instant? {
        guard let deadline else { return nil }
        return deadline - min(.seconds(1), max(.zero, deadline - started) / 5)
    }

    /// The result of whichever of `searches` finishes first (nil included), or nil once `limit`
    /// passes (nil: no limit); the others are cancelled. The first error thrown is rethrown.
    ///
    /// ```swift
    /// let reply = try await ConnectRequest.first(of: [{ try await probe(portA) }, { try await probe(portB) }], until: limit)
    /// ```
    public static func first<Result: Sendable>(of searches: [@Sendable () async throws -> Result?],
                                               until limit: ContinuousClock.Instant?) async throws -> Result? {
        try await withThrowingTaskGroup(of: Result?.self) { group in
            for search in searches { group.addTask { try await search() } }
            if let limit {
                group.addTask {
                    try await Task.sleep(until: limit, clock: .continuous)
                    return nil
                }
            }
            let first = try await group.next() ?? nil
            group.cancelAll()
            return first
        }
    }
}
