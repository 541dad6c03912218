import ArgumentParser
import Foundation
import Synchronization
import TransportKit

struct Bridge: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Relay both ways between two URLs; with --listen, serve clients until stopped.",
        discussion: """
            Give two endpoints in all: URLs to connect to as arguments, URLs to listen on with \
            --listen. With one --listen and one URL the bridge is a server: it keeps accepting \
            clients until SIGINT or SIGTERM. A target that can be opened many times (tcp, unix, \
            loop) gets a connection of its own per client, up to --max-clients at once. An \
            exclusive target (a serial port) serves one client at a time: --busy refuse (the \
            default) tells a second client "busy" and closes it, --busy replace closes the old \
            client and serves the new one (ser2net's kickolduser). The target is opened per client \
            and closed after it, unless --keep-open keeps it open between clients (bytes it sends \
            while no client is connected are dropped). --once serves one client and exits. Two \
            URLs, or --listen twice, relay one pair of connections and exit. \
            Example, sharing a serial port: transportkit bridge --listen tcp://0.0.0.0:2000 tty:///dev/ttyUSB0?baud=115200
            Status lines (listening, accepted, closed, refused, replaced, failed) go to standard \
            error; with --json as one JSON object per line. Exit status: 0, or 1 on an error before \
            serving (a bad URL, an address in use), or 130/143 after SIGINT/SIGTERM with the \
            listener's socket file removed.
            """
    )

    enum BusyPolicy: String, ExpressibleByArgument, CaseIterable {
        case refuse, replace
    }

    @Option(help: "A URL to listen on. May be given twice (then one connection on each is relayed).")
    var listen: [String] = []

    @Argument(help: "URLs to connect to.")
    var urls: [String] = []

    @Option(parsing: .unconditional, help: Linger.help)
    var linger: Double = 0.5

    @Flag(help: "Serve one client, then exit.")
    var once = false

    @Option(help: "For an exclusive target with a client connected: refuse the new client, or replace the old one.")
    var busy: BusyPolicy = .refuse

    @Flag(help: "Keep an exclusive target open between clients.")
    var keepOpen = false

    @Option(help: "At most this many clients at once (more wait in the listen backlog).")
    var maxClients = 64

    @Flag(help: "Print status lines as JSON objects.")
    var json = false

    @OptionGroup var logging: LoggingOptions

    func validate() throws {
        guard listen.count + urls.count == 2 else {
            throw ValidationError("a bridge has two endpoints: give two URLs, or one URL and --listen URL, or --listen twice")
        }
        try Linger.check(linger)
        guard (1...10_000).contains(maxClients) else {
            throw ValidationError("--max-clients takes a number from 1 to 10000; got \(maxClients)")
        }
    }

    func run() async throws {
        logging.bootstrap()
        let status = StatusPrinter(json: json)
        let linger = Linger.duration(linger)
        let listen = listen
        let urls = urls
        let server = listen.count == 1 && !once
        let settings = BridgeServer.Settings(target: urls.first ?? "", linger: linger, busy: busy, keepOpen: keepOpen,
                                             maxClients: maxClients, status: status)
        do {
            try await Signals.run {
                if server {
                    try await BridgeServer(settings).serve(on: listen[0])
                } else {
                    try await relayOnce(listen: listen, urls: urls, linger: linger, status: status)
                }
            }
        } catch let exit as ExitCode {
            throw exit
        } catch {
            throw fail(error)
        }
    }

    /// Accepts one connection on each listener, connects each URL, relays the pair once.
    private func relayOnce(listen: [String], urls: [String], linger: Duration, status: StatusPrinter) async throws {
        var connections: [Connection] = []
        do {
            connections = try await withThrowingTaskGroup(of: Connection.self) { group in
                for url in listen {
                    group.addTask { try await BridgeServer.acceptOne(on: url, status: status) }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            for url in urls { connections.append(try await ToolConnection.open(url)) }
        } catch {
            for connection in connections { try? await connection.close() }
            throw error
        }
        try await Relay.bridge(connections[0], connections[1], linger: linger)
    }
}

/// Writes the bridge's status lines to standard error.
struct StatusPrinter: Sendable {
    let json: Bool

    func callAsFunction(_ fields: [String: String]) {
        let line: String
        if json, let data = try? JSONSerialization.data(withJSONObject: fields, options: [.sortedKeys]) {
            line = String(decoding: data, as: UTF8.self)
        } else {
            var text = fields["event", default: ""]
            if let client = fields["client"] { text += " #\(client)" }
            if let url = fields["url"] { text += " " + url }
            for key in fields.keys.sorted() where !["event", "client", "url"].contains(key) {
                text += " \(key)=\(fields[key, default: ""])"
            }
            line = text
        }
        StandardError.write(line + "\n")
    }
}

/// The listening side of `bridge`: accepts clients until cancelled, and relays each to the target.
struct BridgeServer: Sendable {
    struct Settings: Sendable {
        var target: String
        var linger: Duration
        var busy: Bridge.BusyPolicy
        var keepOpen: Bool
        var maxClients: Int
        var status: StatusPrinter
    }

    let settings: Settings
    init(_ settings: Settings) { self.settings = settings }

    /// Opens a listener, reports it, accepts one connection and closes the listener.
    static func acceptOne(on url: String, status: StatusPrinter) async throws -> Connection {
        let listener = try await Transport.listen(on: url)
        status(["event": "listening", "url": listener.url.description])
        let accepted: Connection?
        do {
            accepted = try await listener.accept()
        } catch {
            try? await listener.close()
            throw error
        }
        try? await listener.close()
        guard let connection = accepted else {
            throw TransportError(.disconnected, "the listener on \(listener.url) closed before a connection arrived")
        }
        status(["event": "accepted", "url": connection.url.description, "listener": listener.url.description])
        return connection
    }

    /// Serves clients until the task is cancelled (a signal) or the listener fails. The listener
    /// is closed (its socket file removed) before this returns or throws.
    func serve(on url: String) async throws {
        // The target URL is checked (scheme, grammar, options) before anything listens.
        let target = try Transport.registry.resolve(settings.target).url
        let descriptor = Transport.registry.descriptor(for: target.innermost.scheme)
        let listener = try await Transport.listen(on: url)
        settings.status(["event": "listening", "url": listener.url.description, "target": settings.target])
        do {
            if descriptor?.exclusive == true {
                try await serveExclusive(listener)
            } else {
                try await serveShared(listener)
            }
        } catch {
            try? await listener.close()
            throw error
        }
        try await listener.close()
    }

    /// A connection to the target per client, at most `maxClients` at once.
    private func serveShared(_ listener: Listener) async throws {
        let slots = Slots(settings.maxClients)
        try await withThrowingDiscardingTaskGroup { group in
            var number = 0
            while true {
                try await slots.acquire()
                guard let client = try await listener.accept() else { break }
                number += 1
                let id = number
                accepted(client, id: id)
                group.addTask {
                    defer { slots.release() }
                    await session(client, id: id) { try await ToolConnection.open(settings.target) }
                }
            }
        }
    }

    /// One client at a time; see `Bridge`'s discussion for the policy.
    private func serveExclusive(_ listener: Listener) async throws {
        let device = SharedDevice(settings.target, keepOpen: settings.keepOpen)
        if settings.keepOpen { _ = try await device.open() }
        let current = CurrentSession()
        do {
            var number = 0
            while let client = try await listener.accept() {
                number += 1
                let id = number
                accepted(client, id: id)
                if let running = current.state.withLock({ $0 }) {
                    if settings.busy == .refuse {
                        settings.status(["event": "refused", "client": String(id), "reason": "client #\(running.id) is connected"])
                        try? await client.write("transportkit: busy: \(settings.target) serves another client; try again later\r\n")
                        try? await client.close()
                        continue
                    }
                    settings.status(["event": "replaced", "client": String(running.id), "by": String(id)])
                    running.task?.cancel()
                    await running.task?.value
                }
                // Marked busy before the task starts, so a session that ends at once clears it.
                current.state.withLock { $0 = (id, nil) }
                let task = Task {
                    await session(client, id: id, keepTarget: settings.keepOpen) { try await device.open() }
                    current.state.withLock { if $0?.id == id { $0 = nil } }
                }
                current.state.withLock { if $0?.id == id { $0?.task = task } }
            }
        } catch {
            if let running = current.state.withLock({ $0 }) {
                running.task?.cancel()
                await running.task?.value
            }
            await device.close()
            throw error
        }
        if let running = current.state.withLock({ $0 }) { await running.task?.value }
        await device.close()
    }

    private func accepted(_ client: Connection, id: Int) {
        settings.status(["event": "accepted", "client": String(id), "url": client.url.description])
    }

    /// Relays one client to the target until either ends; reports how it ended. Never throws: one
    /// client's failure is its own. With `keepTarget` the target is neither half-closed nor closed.
    private func session(_ client: Connection, id: Int, keepTarget: Bool = false,
                         target open: @Sendable () async throws -> Connection) async {
        var target: Connection?
        do {
            let connection = try await open()
            target = connection
            if keepTarget {
                // Drop what the target sent while nobody listened: what is buffered now, for at
                // most 20 ms (a device that never stops talking must not keep the client waiting).
                let until = ContinuousClock.now + .milliseconds(20)
                while ContinuousClock.now < until,
                      let stale = try? await connection.readBuffer(timeout: .milliseconds(1)), stale.readableBytes > 0 {}
                try await Relay.closing([client]) {
                    try await Relay.run(
                        { while let chunk = try await client.readBuffer() { try await connection.write(chunk) } },
                        {
                            while let chunk = try await connection.readBuffer() { try await client.write(chunk) }
                            throw TransportError(.disconnected, "\(settings.target) ended")
                        },
                        linger: settings.linger)
                }
            } else {
                try await Relay.bridge(client, connection, linger: settings.linger)
            }
            settings.status(["event": "closed", "client": String(id), "received": String(client.bytesRead), "sent": String(client.bytesWritten)])
        } catch {
            try? await client.close()
            if !keepTarget { try? await target?.close() }
            if error is CancellationError {
                settings.status(["event": "closed", "client": String(id), "reason": "stopped"])
            } else {
                let message = (error as? TransportError)?.description ?? "\(error)"
                settings.status(["event": "failed", "client": String(id), "error": message])
                // Which side failed is not known here: a kept-open target is closed and opened
                // again for the next client rather than kept in an unknown state.
                if keepTarget { try? await target?.close() }
            }
        }
    }
}

/// The one session an exclusive target serves: its client's number and task.
final class CurrentSession: Sendable {
    /// Guards which session runs; set by the accept loop, cleared by the session as it ends.
    let state = Mutex<(id: Int, task: Task<Void, Never>?)?>(nil)
}

/// The exclusive target: opened per client, or once and kept open with `keepOpen`.
final class SharedDevice: Sendable {
    private let url: String
    private let keepOpen: Bool
    /// The connection while kept open. The mutex guards the reference; the connection itself is
    /// used by one session at a time (the server runs one session for an exclusive target).
    private let connection = Mutex<Connection?>(nil)

    init(_ url: String, keepOpen: Bool) {
        self.url = url
        self.keepOpen = keepOpen
    }

    /// The kept connection (reopened if it ended), or a new one per call without `keepOpen`.
    func open() async throws -> Connection {
        guard keepOpen else { return try await ToolConnection.open(url) }
        if let kept = connection.withLock({ $0 }), !kept.isClosed { return kept }
        let fresh = try await ToolConnection.open(url)
        connection.withLock { $0 = fresh }
        return fresh
    }

    func close() async {
        let kept = connection.withLock { connection in
            defer { connection = nil }
            return connection
        }
        try? await kept?.close()
    }
}

/// A counting semaphore for tasks: at most `limit` holders; `acquire` waits, cancellably.
final class Slots: Sendable {
    private struct State {
        var free: Int
        var waiters: [CheckedContinuation<Void, Never>] = []
    }
    /// Guards the count and the parked acquirer.
    private let state: Mutex<State>

    init(_ limit: Int) { state = Mutex(State(free: limit)) }

    func acquire() async throws {
        while true {
            try Task.checkCancellation()
            let taken = state.withLock { state in
                guard state.free > 0 else { return false }
                state.free -= 1
                return true
            }
            if taken { return }
            // Woken by a release or by cancellation; then look again.
            await withTaskCancellationHandler {
                await withCheckedContinuation { continuation in
                    let parked = state.withLock { state in
                        guard state.free == 0, !Task.isCancelled else { return false }
                        state.waiters.append(continuation)
                        return true
                    }
                    if !parked { continuation.resume() }
                }
            } onCancel: {
                let waiters = state.withLock { state in
                    defer { state.waiters = [] }
                    return state.waiters
                }
                for waiter in waiters { waiter.resume() }
            }
        }
    }

    func release() {
        let waiter = state.withLock { state -> CheckedContinuation<Void, Never>? in
            state.free += 1
            return state.waiters.isEmpty ? nil : state.waiters.removeFirst()
        }
        waiter?.resume()
    }
}
