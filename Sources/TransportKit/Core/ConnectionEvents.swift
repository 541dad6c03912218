import Synchronization

/// What happened to a connection: connecting, connected, disconnected, waiting, failed, closed.
/// ``Connection/events()`` reports them; a `reconnect+URL` connection reports every one, a plain
/// connection the ones that apply (`connected`, `disconnected` when its stream ends, `closed`).
///
/// ```swift
/// let port = try await Transport.connect(to: "reconnect+tty://usb/0403:6001?serial=A50285BI")
/// Task {
///     for await event in port.events() { print(event) }   // "disconnected: … (next attempt in 1 s)", …
/// }
/// ```
public enum ConnectionEvent: Sendable, Equatable, CustomStringConvertible {
    /// Attempt `attempt` (1, 2, …) to connect again after a loss has begun.
    case connecting(attempt: Int)
    /// Connected; `generation` counts the underlying connections, 1 for the first. Bytes read
    /// after a new generation come from a new stream (``Connection/generation``).
    case connected(generation: Int)
    /// The underlying connection ended: with `error`, or at a clean end of stream (nil); when it
    /// will be tried again (nil: it will not).
    case disconnected(TransportError?, nextAttempt: Duration?)
    /// An attempt failed: `what` it waits for in words (``missing(_:)``: the device to be plugged
    /// in, permission, …), `error` the attempt's error, `nextAttempt` when the next one is (it may
    /// come sooner: a device's arrival starts it at once).
    case waiting(for: String, error: TransportError, nextAttempt: Duration?)
    /// Gone for good: the attempts ran out; `error` is the last attempt's.
    case failed(TransportError)
    /// The application closed the connection; no event follows.
    case closed

    /// A line as a terminal prints it: `"disconnected: … (next attempt in 1.6 s)"`.
    public var description: String {
        func next(_ delay: Duration?) -> String {
            delay.map { " (next attempt in \($0.secondsText))" } ?? ""
        }
        switch self {
        case .connecting(let attempt): return "connecting (attempt \(attempt))"
        case .connected(let generation): return generation == 1 ? "connected" : "connected again (connection \(generation))"
        case .disconnected(let error, let delay): return "disconnected: \(error.map(\.message) ?? "the stream ended")\(next(delay))"
        case .waiting(let what, let error, let delay): return "waiting for \(what): \(error.message)\(next(delay))"
        case .failed(let error): return "gave up: \(error.message)"
        case .closed: return "closed"
        }
    }

    /// What an attempt that failed with `error` waits for, in words: the device to be plugged in
    /// (`.notFound`), permission, the device to be free (`.busy`), the peer to accept
    /// (`.refused`), an answer (`.timedOut`), the adapter to be powered (a Bluetooth adapter that
    /// is off: code `org.bluez.Error.NotReady`), or else the next attempt.
    ///
    /// ```swift
    /// ConnectionEvent.missing(TransportError(.notFound, "no device at /dev/ttyUSB0"))   // "the device to be plugged in"
    /// ```
    public static func missing(_ error: TransportError) -> String {
        if error.code == "org.bluez.Error.NotReady" { return "the adapter to be powered" }
        return switch error.kind {
        case .notFound: "the device to be plugged in"
        case .permissionDenied: "permission"
        case .busy: "the device to be free"
        case .refused: "the peer to accept connections"
        case .timedOut: "an answer"
        default: "the next attempt"
        }
    }
}

/// Hands ``ConnectionEvent``s to every subscriber: each gets the latest event first, then every
/// later one, until `.closed` ends them all. A plugin whose connections report their own events
/// (a wrapper that reconnects) keeps one and conforms its backend to ``ConnectionEventSource``.
///
/// ```swift
/// let events = ConnectionEventBroadcaster(.connected(generation: 1))
/// events.emit(.disconnected(TransportError(.disconnected, "the peer left"), nextAttempt: .seconds(1)))
/// ```
@_spi(Plugins)
public final class ConnectionEventBroadcaster: Sendable {
    private struct State {
        var latest: ConnectionEvent?
        var subscribers: [Int: AsyncStream<ConnectionEvent>.Continuation] = [:]
        var nextID = 0
        var ended = false
    }

    private let state: Locked<State>

    /// A broadcaster whose first subscribers get `latest` first.
    public init(_ latest: ConnectionEvent? = nil) {
        state = Locked(State(latest: latest, ended: latest == .closed))
    }

    /// Reports `event` to every subscriber (a slow one keeps the newest 64); `.closed` ends them.
    /// Events reach every subscriber in the order they were emitted (yielded under the lock).
    public func emit(_ event: ConnectionEvent) {
        let ending = state.withLock { state -> [AsyncStream<ConnectionEvent>.Continuation] in
            guard !state.ended else { return [] }
            state.latest = event
            for subscriber in state.subscribers.values { subscriber.yield(event) }
            guard event == .closed else { return [] }
            state.ended = true
            defer { state.subscribers.removeAll() }
            return Array(state.subscribers.values)
        }
        for subscriber in ending { subscriber.finish() }
    }

    /// The latest event, then each later one; it ends after `.closed`.
    public func subscribe() -> AsyncStream<ConnectionEvent> {
        let (stream, continuation) = AsyncStream<ConnectionEvent>.makeStream(bufferingPolicy: .bufferingNewest(64))
        let id = state.withLock { state -> Int? in
            if let latest = state.latest { continuation.yield(latest) }
            guard !state.ended else { return nil }
            let id = state.nextID
            state.nextID += 1
            state.subscribers[id] = continuation
            return id
        }
        guard let id else {
            continuation.finish()
            return stream
        }
        continuation.onTermination = { [weak self] _ in
            _ = self?.state.withLock { $0.subscribers.removeValue(forKey: id) }
        }
        return stream
    }

    /// The latest event reported.
    public var latest: ConnectionEvent? { state.withLock { $0.latest } }
}

/// A backend whose connection reports its own events and generations (a wrapper that replaces
/// its underlying connection): ``Connection/events()``, ``Connection/generation`` and
/// ``Connection/metadata`` ask it instead of the connection's own bookkeeping.
///
/// ```swift
/// final class RetryingBackend: ConnectionBackend, ConnectionEventSource {
///     let events = ConnectionEventBroadcaster(.connected(generation: 1))
///     var generation: Int { 1 }
///     var currentMetadata: ConnectionMetadata? { inner.metadata }
///     // … read, write, close …
/// }
/// ```
@_spi(Plugins)
public protocol ConnectionEventSource: ConnectionBackend {
    /// Where the connection's events are reported.
    var events: ConnectionEventBroadcaster { get }
    /// How many underlying connections there have been, 1 for the first.
    var generation: Int { get }
    /// The metadata of the underlying connection up now (or of the last one while none is):
    /// the connection's ``Connection/metadata``.
    var currentMetadata: ConnectionMetadata? { get }
}
