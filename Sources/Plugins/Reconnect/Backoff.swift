// Backoff.swift: the delays between attempts, after gRPC's connection-backoff spec
// (doc/connection-backoff.md in grpc/grpc): the first after `initial`, each next one `multiplier`
// times longer up to `maximum`, each moved by a random part of up to ±`jitter` of itself so that
// many clients that lost the same server do not come back in step.

/// The delays of one outage: ``next()`` for each attempt, ``reset()`` once a connection stayed up.
struct Backoff: Sendable {
    let initial: Double
    let multiplier: Double
    let maximum: Double
    let jitter: Double
    /// The delay before jitter of the last ``next()``; nil before the first.
    private var current: Double?

    init(initial: Duration, multiplier: Double, maximum: Duration, jitter: Double) {
        self.initial = initial.seconds
        self.multiplier = multiplier
        self.maximum = max(maximum.seconds, initial.seconds)
        self.jitter = jitter
    }

    /// The delay before the next attempt.
    mutating func next() -> Duration {
        let base = current.map { min($0 * multiplier, maximum) } ?? initial
        current = base
        let spread = base * jitter
        let delay = spread > 0 ? base + Double.random(in: -spread...spread) : base
        return .milliseconds(Int((max(delay, 0) * 1000).rounded()))
    }

    /// Back to the first delay.
    mutating func reset() { current = nil }
}

extension Duration {
    /// The duration in seconds, as a Double.
    var seconds: Double {
        let (seconds, attoseconds) = components
        return Double(seconds) + Double(attoseconds) / 1e18
    }
}
