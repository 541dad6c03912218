// ReconnectBackend.swift: the state of a `reconnect+URL` connection. One underlying connection
// is up at a time (a generation); a read or write that finds it lost starts one reconnecting task,
// which closes the lost one, waits out the backoff (cut short by a hot-plug arrival of the inner
// scheme's plugin), connects the inner URL again (the plugin resolves its identity again), sets
// up what the application had set (a serial port's settings and lines), and installs it as the
// next generation. Readers wait for it and read on; writers fail at once, or wait up to
// `reconnect.writeWait`. Nothing written is sent twice.

import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore

/// Where a reconnecting connection stands.
enum ReconnectPhase: Sendable {
    /// `connection` is generation `generation`, up since `since`.
    case up(Connection, generation: Int, since: ContinuousClock.Instant)
    /// Generation `generation` was lost; the next one is being made.
    case down(generation: Int)
    /// The attempts ran out.
    case failed(TransportError, generation: Int)
    /// The application closed it.
    case closed(generation: Int)

    var generation: Int {
        switch self {
        case .up(_, let generation, _), .down(let generation), .failed(_, let generation), .closed(let generation): generation
        }
    }
}

/// What the application set on a serial port, to set again on each new connection.
struct RememberedControl: Sendable {
    var settings: SerialSettings?
    var dtr: Bool?
    var rts: Bool?
}

/// The work of a `reconnect+` connection, shared by its two backend types.
final class ReconnectCore: Sendable {
    let phase: AsyncCondition<ReconnectPhase>
    let events: ConnectionEventBroadcaster
    let request: ConnectRequest
    let settings: ReconnectSettings
    /// The inner URL, for messages.
    let describing: String
    let carriesMessages: Bool
    let supportsHalfClose: Bool

    private struct Work {
        var backoff: Backoff
        /// The reconnecting task of the outage in progress.
        var task: Task<Void, Never>?
        var control = RememberedControl()
        /// The next attempt's time, for messages.
        var nextAttempt: ContinuousClock.Instant?
    }

    private let work: Mutex<Work>

    init(first: Connection, request: ConnectRequest, settings: ReconnectSettings) {
        phase = AsyncCondition(.up(first, generation: 1, since: .now))
        events = ConnectionEventBroadcaster(.connected(generation: 1))
        self.request = request
        self.settings = settings
        describing = request.url.inner?.shown ?? request.url.shown
        carriesMessages = first.carriesMessages
        supportsHalfClose = first.supportsHalfClose
        work = Mutex(Work(backoff: settings.backoff))
    }

    var generation: Int { phase.withLock { $0.generation } }

    var current: Connection? {
        phase.withLock { phase in
            if case .up(let connection, _, _) = phase { connection } else { nil }
        }
    }

    // MARK: Reading and writing

    /// The connection up now (waiting while there is none), nil once closed; throws when the
    /// attempts ran out.
    private func upConnection() async throws -> (Connection, Int)? {
        try await phase.wait { phase -> (Connection, Int)?? in
            switch phase {
            case .up(let connection, let generation, _): return .some((connection, generation))
            case .down: return nil
            case .failed(let error, _): throw error
            case .closed: return .some(nil)
            }
        }
    }

    /// Runs `body` on the connection up now, and again on the next one each time it finds its
    /// connection's end (nil) or failure: reads carry on across losses. Nil once closed.
    func next<Value: Sendable>(_ body: (Connection) async throws -> Value?) async throws -> Value? {
        while true {
            guard case let (connection, generation)? = try await upConnection() else { return nil }
            do {
                if let value = try await body(connection) { return value }
                lost(generation, nil)
            } catch let error as CancellationError {
                throw error
            } catch {
                if Task.isCancelled { throw CancellationError() }
                lost(generation, TransportError.from(error, context: describing))
            }
        }
    }

    /// Runs `body` (a write) on the connection up now. While none is up it fails at once, or
    /// waits up to `reconnect.writeWait`. A failure loses the connection and is the write's
    /// `.disconnected`: what it carried is not sent again.
    func write(_ body: (Connection) async throws -> Void) async throws {
        let (connection, generation) = try await connectionForWrite()
        do {
            try await body(connection)
        } catch let error as CancellationError {
            throw error
        } catch {
            let failure = TransportError.from(error, context: describing)
            lost(generation, failure)
            throw TransportError(.disconnected, "\(describing) was lost during this write (\(failure.message)); its bytes are not sent again. Reconnecting",
                                 errno: failure.errno, syscall: failure.syscall)
        }
    }

    private func connectionForWrite() async throws -> (Connection, Int) {
        let now = try phase.withLock { phase -> (Connection, Int)?? in
            switch phase {
            case .up(let connection, let generation, _): return .some((connection, generation))
            case .down: return nil
            case .failed(let error, _): throw error
            case .closed: return .some(nil)
            }
        }
        if let now {
            guard let now else { throw TransportError.misuse("write on a connection to \(describing) after close()") }
            return now
        }
        let wait = settings.writeWait
        guard wait > .zero else {
            throw TransportError(.disconnected, "\(describing) is not connected\(nextAttemptText()); writes are not queued "
                                 + "(reconnect.writeWait=SECONDS makes them wait for the next connection)")
        }
        let late = TransportError(.disconnected, "\(describing) was still not connected after \(wait.secondsText) (reconnect.writeWait)")
        let waited = try await withTimeout(wait, late) {
            try await self.upConnection()
        }
        guard let waited else { throw TransportError.misuse("write on a connection to \(describing) after close()") }
        return waited
    }

    private func nextAttemptText() -> String {
        guard let next = work.withLock({ $0.nextAttempt }) else { return " (reconnecting)" }
        let left = max(next - .now, .zero)
        return " (reconnecting: the next attempt in \(left.secondsText))"
    }

    // MARK: Losing and reconnecting

    /// Generation `generation` was lost (`error` nil: its stream ended): the first to notice
    /// starts the one reconnecting task; later reports of the same loss do nothing.
    func lost(_ generation: Int, _ error: TransportError?) {
        let lost = phase.update { phase -> (Connection, Duration)? in
            guard case .up(let connection, let current, let since) = phase, current == generation else { return nil }
            phase = .down(generation: generation)
            return (connection, .now - since)
        }
        guard case let (connection, upFor)? = lost else { return }
        // The lost link is released now (a device's descriptor and lock): nothing on it can be delivered.
        connection.abort()
        work.withLock { work in
            if upFor >= settings.stableAfter { work.backoff.reset() }
            work.task = Task { await self.reconnect(after: generation, error: error) }
        }
    }

    private func nextDelay() -> Duration {
        work.withLock { work in
            let delay = work.backoff.next()
            work.nextAttempt = .now + delay
            return delay
        }
    }

    /// One outage: attempts after each delay until one connects, the limits are reached, or the
    /// connection is closed.
    private func reconnect(after generation: Int, error: TransportError?) async {
        let started = ContinuousClock.now
        var delay = nextDelay()
        events.emit(.disconnected(error, nextAttempt: delay))
        let arrivals = ArrivalWatch(request.innerDeviceEvents())
        defer { arrivals.stop() }
        var attempt = 0
        while !Task.isCancelled {
            await arrivals.wait(upTo: delay)
            if Task.isCancelled { return }
            attempt += 1
            events.emit(.connecting(attempt: attempt))
            do {
                let fresh = try await request.connectInnerAgain()
                await restoreControl(on: fresh)
                let installed = phase.update { phase -> Bool in
                    guard case .down = phase else { return false }
                    phase = .up(fresh, generation: generation + 1, since: .now)
                    return true
                }
                guard installed else {
                    try? await fresh.close()
                    return
                }
                work.withLock { $0.nextAttempt = nil }
                events.emit(.connected(generation: generation + 1))
                return
            } catch {
                if Task.isCancelled { return }
                let failure = TransportError.from(error, context: describing)
                let outage = ContinuousClock.now - started
                if (settings.attempts > 0 && attempt >= settings.attempts) || settings.giveUpAfter.map({ outage >= $0 }) == true {
                    let final = TransportError(failure.kind, "\(describing): gave up after \(attempt) attempt\(attempt == 1 ? "" : "s") in "
                                               + "\(outage.secondsText): \(failure.message)", errno: failure.errno, syscall: failure.syscall)
                    let gaveUp = phase.update { phase -> Bool in
                        guard case .down = phase else { return false }
                        phase = .failed(final, generation: generation)
                        return true
                    }
                    if gaveUp { events.emit(.failed(final)) }
                    return
                }
                delay = nextDelay()
                events.emit(.waiting(for: ConnectionEvent.missing(failure), error: failure, nextAttempt: delay))
            }
        }
    }

    /// Sets what the application set on the last connection's serial port on `fresh`'s (the
    /// URL's own options were applied by its connect). A setting the new port refuses is left:
    /// the next control call says why.
    private func restoreControl(on fresh: Connection) async {
        let control = work.withLock { $0.control }
        guard let port = fresh.serialPort else { return }
        if let settings = control.settings { try? await port.apply(settings) }
        if let dtr = control.dtr { try? await port.setLines(.dtr, dtr) }
        if let rts = control.rts { try? await port.setLines(.rts, rts) }
    }

    func remember(_ change: (inout RememberedControl) -> Void) {
        work.withLock { change(&$0.control) }
    }

    // MARK: Closing

    /// Ends the connection: the reconnecting task stops, the connection up now is closed.
    func close() async throws {
        let (connection, task) = shutDown()
        task?.cancel()
        await task?.value
        defer { events.emit(.closed) }
        try await connection?.close()
    }

    /// The application let the connection go without closing it.
    func drop() {
        let (connection, task) = shutDown()
        task?.cancel()
        connection?.abort()
        events.emit(.closed)
    }

    private func shutDown() -> (Connection?, Task<Void, Never>?) {
        let connection = phase.update { phase -> Connection? in
            let up: Connection? = if case .up(let connection, _, _) = phase { connection } else { nil }
            phase = .closed(generation: phase.generation)
            return up
        }
        let task = work.withLock { work in
            defer { work.task = nil }
            return work.task
        }
        return (connection, task)
    }
}

/// Hot-plug arrivals of the inner scheme's plugin during one outage: an arrival cuts the wait
/// before the next attempt short.
final class ArrivalWatch: Sendable {
    private let arrived: AsyncCondition<Bool>
    private let task: Task<Void, Never>?

    init(_ events: AsyncThrowingStream<DeviceEvent, any Error>?) {
        let arrived = AsyncCondition(false)
        self.arrived = arrived
        task = events.map { events in
            Task {
                do {
                    for try await event in events where event.action == .added {
                        arrived.update { $0 = true }
                    }
                } catch {}
            }
        }
    }

    /// Returns after `delay`, or at an arrival, or when the task is cancelled.
    func wait(upTo delay: Duration) async {
        let arrived = arrived
        _ = try? await withTimeout(delay, TransportError(.timedOut, "no arrival")) {
            try await arrived.wait { state -> Void? in
                guard state else { return nil }
                state = false
                return ()
            }
        }
    }

    func stop() { task?.cancel() }
}

/// A backend over a ``ReconnectCore``: the connection's bytes go to the connection up now.
protocol ReconnectingBackend: ConnectionEventSource {
    var core: ReconnectCore { get }
}

extension ReconnectingBackend {
    var events: ConnectionEventBroadcaster { core.events }
    var generation: Int { core.generation }
    var current: Connection? { core.current }
    var supportsHalfClose: Bool { core.supportsHalfClose }
    var carriesMessages: Bool { core.carriesMessages }
    var maximumWriteSize: Int? { core.current?.maximumWriteSize }
    var unsentByteCount: Int? { core.current?.unsentByteCount }

    func read() async throws -> ByteBuffer? {
        try await core.next { try await $0.readBuffer() }
    }

    func readMessage() async throws -> TransportMessage? {
        guard core.carriesMessages else { return try await read().map { TransportMessage(.binary, $0) } }
        return try await core.next { try await $0.nextMessage() }
    }

    func write(_ buffer: ByteBuffer) async throws {
        try await core.write { try await $0.write(buffer) }
    }

    func writeMessage(_ message: TransportMessage) async throws {
        try await core.write { try await $0.writeMessage(message) }
    }

    func closeWrite() async throws {
        try await core.write { try await $0.closeWrite() }
    }

    func close() async throws { try await core.close() }
    func connectionDropped() { core.drop() }
}

/// `reconnect+` around a URL without a serial line.
final class ReconnectBackend: ReconnectingBackend {
    let core: ReconnectCore
    init(core: ReconnectCore) { self.core = core }
}

/// `reconnect+` around a serial line (`tty://`, `rfc2217://`): `connection.serialPort` controls
/// the port up now, and what it sets is set again on each new connection.
final class ReconnectSerialBackend: ReconnectingBackend, SerialControlling {
    let core: ReconnectCore
    init(core: ReconnectCore) { self.core = core }

    func serialControl(through connection: Connection) -> any SerialControl {
        ReconnectSerialPort(core: core, connection: connection)
    }
}
