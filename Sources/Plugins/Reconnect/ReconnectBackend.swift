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
        /// Closed or dropped: no outage starts any more.
        var closed = false
        /// The metadata of the connection up now, or of the last one.
        var metadata: ConnectionMetadata
    }

    private let work: Locked<Work>

    init(first: Connection, request: ConnectRequest, settings: ReconnectSettings) {
        phase = AsyncCondition(.up(first, generation: 1, since: .now))
        events = ConnectionEventBroadcaster(.connected(generation: 1))
        self.request = request
        self.settings = settings
        describing = request.url.inner?.shown ?? request.url.shown
        carriesMessages = first.carriesMessages
        supportsHalfClose = first.supportsHalfClose
        work = Locked(Work(backoff: settings.backoff, metadata: first.metadata))
    }

    var generation: Int { phase.withLock { $0.generation } }

    var current: Connection? {
        phase.withLock { phase in
            if case .up(let connection, _, _) = phase { connection } else { nil }
        }
    }

    /// The metadata of the connection up now, or of the last one while none is.
    var metadata: ConnectionMetadata {
        current?.metadata ?? work.withLock { $0.metadata }
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
            } catch let error as TransportError where error.isRefusedCall {
                // A read the connection does not offer (usb://…?controlOnly=true has no data to
                // read): the next connection would refuse it too, so it is not a loss.
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
        } catch let error as TransportError where error.kind == .misuse || error.kind == .unsupported {
            throw error   // the call, not the link: the connection stays
        } catch {
            if Task.isCancelled { throw CancellationError() }
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
        let metadata = connection.metadata
        // The lost link is released now (a device's descriptor and lock): nothing on it can be delivered.
        connection.abort()
        // Under the lock close() takes too: an outage that starts as the connection is closed
        // starts no task (close() would not see it to cancel it).
        work.withLock { work in
            work.metadata = metadata
            guard !work.closed else { return }
            if upFor >= settings.stableAfter { work.backoff.reset() }
            work.task = Task { await self.reconnect(after: generation, error: error) }
        }
    }

    /// Whether the outage of generation `generation` is still being worked on (not closed,
    /// failed or over).
    private func stillDown(_ generation: Int) -> Bool {
        phase.withLock { phase in
            if case .down(let current) = phase { current == generation } else { false }
        }
    }

    /// One outage: attempts after each delay until one connects, the limits are reached, or the
    /// connection is closed. (gRPC's spec tries once at once after a loss and counts each delay
    /// from the start of an attempt; here the first attempt waits `initialDelay` too, and each
    /// delay counts from the end of the attempt before it.)
    private func reconnect(after generation: Int, error: TransportError?) async {
        let started = ContinuousClock.now
        let deadline = settings.giveUpAfter.map { started + $0 }
        // Watching before the loss is announced: a device plugged in again by someone reacting
        // to the event is seen.
        let arrivals = ArrivalWatch(await request.innerDeviceEvents())
        defer { arrivals.stop() }
        var delay = nextDelay(until: deadline)
        events.emit(.disconnected(error, nextAttempt: delay))
        var attempt = 0
        while !Task.isCancelled, stillDown(generation) {
            await arrivals.wait(upTo: delay)
            if Task.isCancelled || !stillDown(generation) { return }
            // At `giveUpAfter` (the delay was cut to it) one last attempt is made.
            attempt += 1
            events.emit(.connecting(attempt: attempt))
            do {
                let fresh = try await request.connectInnerAgain()
                await restoreControl(on: fresh)
                work.withLock { $0.nextAttempt = nil }
                // Installed and announced under one lock: a loss of the new connection, found at
                // once, reports its .disconnected after this .connected.
                let installed = phase.update { phase -> Bool in
                    guard case .down = phase else { return false }
                    phase = .up(fresh, generation: generation + 1, since: .now)
                    events.emit(.connected(generation: generation + 1))
                    return true
                }
                if !installed { try? await fresh.close() }
                return
            } catch {
                if Task.isCancelled { return }
                let failure = TransportError.from(error, context: describing)
                let outOfTime = deadline.map { ContinuousClock.now >= $0 } ?? false
                if (settings.attempts > 0 && attempt >= settings.attempts) || outOfTime {
                    giveUp(generation, failure, attempts: attempt, since: started)
                    return
                }
                delay = nextDelay(until: deadline)
                events.emit(.waiting(for: ConnectionEvent.missing(failure), error: failure, nextAttempt: delay))
            }
        }
    }

    /// The delay before the next attempt, cut to the time left before `deadline`.
    private func nextDelay(until deadline: ContinuousClock.Instant?) -> Duration {
        work.withLock { work in
            var delay = work.backoff.next()
            if let deadline { delay = max(min(delay, deadline - .now), .zero) }
            work.nextAttempt = .now + delay
            return delay
        }
    }

    /// The outage of `generation` has failed for good: readers and writers get `last`'s kind.
    private func giveUp(_ generation: Int, _ last: TransportError, attempts: Int, since started: ContinuousClock.Instant) {
        let outage = ContinuousClock.now - started
        let final = TransportError(last.kind, "\(describing): gave up after \(attempts) attempt\(attempts == 1 ? "" : "s") in "
                                   + "\(outage.secondsText): \(last.message)", errno: last.errno, syscall: last.syscall)
        phase.update { phase in
            guard case .down(let current) = phase, current == generation else { return }
            phase = .failed(final, generation: generation)
            events.emit(.failed(final))
        }
    }

    /// Sets what the application set on the last connection's serial port on `fresh`'s (the
    /// URL's own options were applied by its connect). A setting the new port refuses is left as
    /// the port has it, and logged (the registry's logger, warning).
    private func restoreControl(on fresh: Connection) async {
        let control = work.withLock { $0.control }
        guard let port = fresh.serialPort else { return }
        do {
            if let settings = control.settings { try await port.apply(settings) }
            if let dtr = control.dtr { try await port.setLines(.dtr, dtr) }
            if let rts = control.rts { try await port.setLines(.rts, rts) }
        } catch {
            request.logger.warning("reconnect: the new port did not take what the application had set", metadata: ["error": "\(error)"])
        }
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
            work.closed = true
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
        _ = try? await withTimeout(delay) {
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
    var currentMetadata: ConnectionMetadata? { core.metadata }
    var supportsHalfClose: Bool { core.supportsHalfClose }
    var carriesMessages: Bool { core.carriesMessages }
    /// None here: the connection up now chunks each write to its own limit, so a write never
    /// straddles two connections.
    var maximumWriteSize: Int? { nil }
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
