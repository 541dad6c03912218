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
    @_spi(Plugins)
    public func searchLimit(from started: ContinuousClock.Instant) -> ContinuousClock.Instant? {
        Self.searchLimit(before: deadline, from: started)
    }

    /// ``searchLimit(from:)`` for a deadline handed down without its request.
    ///
    /// ```swift
    /// let limit = ConnectRequest.searchLimit(before: deadline, from: .now) ?? .now + .seconds(10)
    /// ```
    @_spi(Plugins)
    public static func searchLimit(before deadline: ContinuousClock.Instant?, from started: ContinuousClock.Instant) -> ContinuousClock.Instant? {
        guard let deadline else { return nil }
        return deadline - min(.seconds(1), max(.zero, deadline - started) / 5)
    }

    /// How a search that gave up says how long it had: "the 3 s timeout" (the connect's own
    /// ``timeout``, which the user gave or the default), or `elapsed` written out ("2.4 s") when
    /// the connect has none. The search itself stops a little earlier (``searchLimit(from:)``), but
    /// the timeout is the figure the user knows.
    ///
    /// ```swift
    /// throw TransportError(.timedOut, "nothing was plugged in within \(ConnectRequest.searchTime(timeout: request.timeout, orElse: .now - started))")
    /// ```
    @_spi(Plugins)
    public static func searchTime(timeout: Duration?, orElse elapsed: Duration) -> String {
        timeout.map { "the \($0.secondsText) timeout" } ?? elapsed.secondsText
    }

    /// The result of whichever of `searches` finishes first (nil included), or nil once `limit`
    /// passes (nil: no limit); the others are cancelled. The first error thrown is rethrown.
    ///
    /// ```swift
    /// let reply = try await ConnectRequest.first(of: [{ try await probe(portA) }, { try await probe(portB) }], until: limit)
    /// ```
    @_spi(Plugins)
    public static func first<Result: Sendable>(of searches: [@Sendable () async throws -> Result?],
                                               until limit: ContinuousClock.Instant?) async throws -> Result? {
        // withDeadline's nil: the limit passed first.
        let found: Result?? = try await withDeadline(limit) {
            try await withThrowingTaskGroup(of: Result?.self) { group in
                for search in searches { group.addTask { try await search() } }
                let first = try await group.next() ?? nil
                group.cancelAll()
                return first
            }
        }
        return found ?? nil
    }
}
