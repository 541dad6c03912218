import ArgumentParser
import Foundation
import Glibc
import Synchronization
import TransportKit
@_spi(Plugins) import TransportKitCore

struct Bridge: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Relay both ways between two URLs; with --listen, serve clients until stopped.",
        discussion: """
            Give two endpoints in all: URLs to connect to as arguments, URLs to listen on with \
            --listen. With one --listen and one URL the bridge is a server: it keeps accepting \
            clients until SIGINT or SIGTERM. A target that can be opened many times (tcp, unix, \
            loop) gets a connection of its own per client, up to --max-clients at once; more are \
            told the bridge is full and closed. An exclusive target (a serial port or a USB interface: tty://, usb://) serves one \
            client at a time: --busy refuse (the default) tells a second client "busy" and closes \
            it, --busy replace closes the old client and serves the new one (ser2net's \
            kickolduser: any client can take over). The target is opened per client and closed \
            after it, unless --keep-open keeps it open between clients (bytes it sends while no \
            client is connected are dropped). --once serves one client and exits. Two URLs, or \
            --listen twice, relay one pair of connections and exit. An option a mode does not use \
            is refused. The target is checked before anything listens.
            The bridge does not authenticate clients: listening on an address other machines can \
            reach lets anyone there use the target, and the tool says so. Share a serial port on \
            this machine only, and reach it from elsewhere through ssh -L:
              transportkit bridge --listen tcp://127.0.0.1:2000 tty:///dev/ttyUSB0?baud=115200
            --announce publishes an rfc2217:// server on the local network by mDNS (DNS-SD type \
            _telnetcpcd._tcp, through avahi-daemon) with the device's USB attributes, until the bridge \
            stops; `transportkit list --network` elsewhere finds it.
            Status lines (listening, announced, accepted, closed, refused, replaced, failed, warning) go to \
            standard error; with --json as one JSON object per line. Exit status: 0, or 1 on an \
            error before serving (a bad URL, an address in use), 64 on a usage error, or \
            129/130/143 after SIGHUP/SIGINT/SIGTERM with the listener's socket file removed.
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

    @Flag(help: "Serve one client of the listener, then exit.")
    var once = false

    @Option(help: "An exclusive target (tty://) with a client connected: refuse the new client (default), or replace the old one.")
    var busy: BusyPolicy?

    @Flag(help: "Keep an exclusive target (tty://) open between clients.")
    var keepOpen = false

    @Option(parsing: .unconditional,
            help: ArgumentHelp("A target opened per client (tcp://, unix://): at most this many clients at once, 1 to \(ClientLimit.most); more are told the bridge is full (default \(ClientLimit.standard), fewer if the descriptor limit cannot hold them).",
                               valueName: "n"))
    var maxClients: Int?

    @Flag(help: "Announce an rfc2217:// listener on the local network by mDNS (DNS-SD type _telnetcpcd._tcp, through avahi-daemon), with the device's USB attributes.")
    var announce = false

    @Option(help: ArgumentHelp("The name to announce (default: the device and this host's name, as \"ttyUSB0 on bench\").", valueName: "name"))
    var announceName: String?

    @Flag(help: "Print status lines as JSON objects.")
    var json = false

    @OptionGroup var logging: LoggingOptions

    /// One --listen and one target URL, without --once: a server.
    var serves: Bool { listen.count == 1 && urls.count == 1 && !once }

    func validate() throws {
        try Arguments.refuseRepeated(["--linger", "--busy", "--max-clients", "--log-level", "--once", "--keep-open", "--json", "--announce", "--announce-name"])
        guard listen.count + urls.count == 2 else {
            throw ValidationError("a bridge has two endpoints: give two URLs, or one URL and --listen URL, or --listen twice")
        }
        try Linger.check(linger)
        if once, !(listen.count == 1 && urls.count == 1) {
            throw ValidationError("--once serves one client of a listener: give it with one --listen URL and one target URL")
        }
        if !serves {
            let unused = [(busy != nil, "--busy"), (keepOpen, "--keep-open"), (maxClients != nil, "--max-clients")].filter(\.0).map(\.1)
            if !unused.isEmpty {
                let mode = once ? "--once serves a single client" : "a bridge of two URLs, or of two listeners, relays one pair of connections"
                throw ValidationError("\(unused.joined(separator: " and ")) \(unused.count == 1 ? "applies" : "apply") to a bridge that serves clients (--listen URL TARGET, without --once); \(mode)")
            }
        }
        if let maxClients, !(1...ClientLimit.most).contains(maxClients) {
            throw ValidationError("--max-clients takes a number from 1 to \(ClientLimit.most); got \(maxClients)")
        }
        if announceName != nil, !announce { throw ValidationError("--announce-name names what --announce publishes: give --announce too") }
        if let announceName, announceName.isEmpty || announceName.utf8.count > 63 {
            throw ValidationError("--announce-name takes 1 to 63 bytes (a DNS-SD instance name); \"\(announceName)\" has \(announceName.utf8.count)")
        }
        if announce {
            guard serves, let url = try? TransportURL(listen[0]), url.innermost.scheme == "rfc2217" else {
                throw ValidationError("--announce publishes a serial port served by an rfc2217:// listener: give --listen rfc2217://HOST:PORT and the port's URL, without --once")
            }
            let host = url.innermost.host ?? ""
            if host == "localhost" || host.hasPrefix("127.") || host == "::1" || host == "[::1]" {
                throw ValidationError("--announce tells the network about \(url.shown), which listens on \(host), where only this machine can connect: "
                                      + "listen on 0.0.0.0 or one of this machine's network addresses")
            }
        }
    }

    func run() async throws {
        logging.bootstrap()
        let status = StatusPrinter(json: json)
        let linger = Linger.duration(linger)
        let listen = listen
        let urls = urls
        do {
            let settings: BridgeServer.Settings?
            if serves {
                // Which flags the target takes is known once its scheme is: refused as usage errors.
                let target = try Transport.registry.resolve(urls[0])
                let exclusive = Transport.registry.descriptor(for: target.url.innermost.scheme)?.exclusive == true
                if exclusive, maxClients != nil {
                    throw ValidationError("--max-clients: \(target.url.innermost.scheme):// is exclusive (one client at a time); --busy says what happens to the others")
                }
                if !exclusive, busy != nil || keepOpen {
                    throw ValidationError("\(busy != nil ? "--busy" : "--keep-open") applies to an exclusive target (a serial port, tty://), which serves one client at a time; "
                                          + "\(target.url.innermost.scheme):// gets a connection of its own for every client")
                }
                settings = BridgeServer.Settings(target: urls[0], exclusive: exclusive, linger: linger, busy: busy ?? .refuse, keepOpen: keepOpen,
                                                 limit: exclusive ? 1 : try ClientLimit.choose(maxClients, target: target.url.innermost.scheme),
                                                 status: status, announce: announce ? Announce(name: announceName) : nil)
            } else {
                settings = nil
            }
            // Everything about the URLs to connect to that can be known is checked before anything listens.
            if let settings { try SpyTraces.checkShared(settings) }
            for url in urls {
                try await Transport.registry.check(url)
                ToolConnection.warnIfInsecure(try TransportURL(url))
            }
            for url in listen { _ = try Transport.registry.resolve(url, role: .listen) }
            // An RFC 2217 client sets a serial line: the target must carry one.
            let serial: Set<String> = ["tty", "pty", "rfc2217"]
            if listen.contains(where: { (try? TransportURL($0))?.innermost.scheme == "rfc2217" }),
               let target = urls.first, let scheme = try? TransportURL(target).innermost.scheme, !serial.contains(scheme) {
                throw ValidationError("an rfc2217:// listener serves a serial port: its clients set the line (bit rate, DTR, break); "
                                      + "\(scheme):// has none. Bridge it to tty://, pty:// or rfc2217://, or listen on tcp:// for the bytes alone")
            }
            try await Signals.run {
                if let settings {
                    try await BridgeServer(settings).serve(on: listen[0])
                } else {
                    try await relayOnce(listen: listen, urls: urls, linger: linger, status: status)
                }
            }
        } catch let exit as ExitCode {
            throw exit
        } catch let usage as ValidationError {
            // Found only once the target's scheme is known: a usage error all the same, with this
            // command's usage (thrown from here, the parser would show the tool's).
            StandardError.write(Self.fullMessage(for: usage) + "\n")
            throw ExitCode.validationFailure
        } catch {
            throw fail(error)
        }
    }

    /// Accepts one connection on each listener, connects each URL, relays the pair once. A client
    /// the target fails for is told so in one line.
    private func relayOnce(listen: [String], urls: [String], linger: Duration, status: StatusPrinter) async throws {
        var connections: [Connection] = []
        do {
            connections = try await withThrowingTaskGroup(of: Connection.self) { group in
                for url in listen {
                    group.addTask { try await BridgeServer.acceptOne(on: url, status: status) }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            for url in urls {
                do {
                    connections.append(try await ToolConnection.open(url))
                } catch {
                    for client in connections { await BridgeServer.tell(client, about: error) }
                    throw error
                }
            }
        } catch {
            for connection in connections { try? await connection.close() }
            throw error
        }
        // An RFC 2217 client on either side is served with the other side's serial port.
        let sessions = [BridgeServer.serveSession(of: connections[0], with: connections[1]),
                        BridgeServer.serveSession(of: connections[1], with: connections[0])].compactMap { $0 }
        var beforeClosing: (@Sendable () async -> Void)?
        if !sessions.isEmpty {
            beforeClosing = {
                for session in sessions { session.cancel() }
                for session in sessions { await session.value }
            }
        }
        try await Relay.bridge(connections[0], connections[1], linger: linger, beforeClosing: beforeClosing)
    }
}

/// How many clients a server with a target opened per client serves at once.
enum ClientLimit {
    /// The default: enough that thousands of silent clients cannot lock out a real one.
    static let standard = 4096
    static let most = 100_000
    /// Descriptors kept for everything but the clients (the listener, the event loops, logs).
    static let reserve = 64
    /// What one client holds: its socket and its target's connection (tcp, unix: one socket),
    /// with one to spare. A pty:// target is a new pseudo-terminal per client: its master, the two
    /// duplicates the event loop reads and writes through, and the peer kept open. A loop://
    /// target is memory only: the client's socket alone.
    static func descriptorsPerClient(target scheme: String) -> Int {
        switch scheme {
        case "pty": 6
        case "loop": 1
        default: 3
        }
    }

    /// The limit for `asked` (the default when `nil`), after raising the soft descriptor limit to
    /// the hard one: a default is lowered to what the descriptors allow; a number asked for that
    /// they cannot hold is an error that says so.
    static func choose(_ asked: Int?, target scheme: String) throws -> Int {
        let descriptorsPerClient = descriptorsPerClient(target: scheme)
        var limit = rlimit()
        guard getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return asked ?? standard }
        if limit.rlim_cur < limit.rlim_max {
            var raised = limit
            raised.rlim_cur = limit.rlim_max
            if setrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &raised) == 0 { limit = raised }
        }
        let affordable = max(1, (Int(clamping: limit.rlim_cur) - reserve) / descriptorsPerClient)
        guard let asked else { return min(standard, affordable) }
        guard asked <= affordable else {
            throw TransportError(.unsupported, "--max-clients \(asked) needs about \(asked * descriptorsPerClient + reserve) file descriptors, and this "
                                 + "process may open \(limit.rlim_cur) (ulimit -n): ask for \(affordable) at most, or raise the limit (ulimit -Hn, LimitNOFILE=)")
        }
        return asked
    }
}

/// The arguments as given, for checks the parser does not make.
enum Arguments {
    /// Refuses an option given twice: the parser would keep the last one silently.
    static func refuseRepeated(_ names: [String]) throws {
        let given = CommandLine.arguments.dropFirst().prefix { $0 != "--" }
        for name in names {
            let values = given.filter { $0 == name || $0.hasPrefix(name + "=") }
            if values.count > 1 {
                throw ValidationError("\(name) is given \(values.count) times; give it once")
            }
        }
    }
}

/// spy+ traces in a bridge's target: every client's records go to the one trace, each line with
/// the client's number (`spy.label=#N`, unless the URL labels them itself).
enum SpyTraces {
    /// The target URL for client `id`; `nil`: the target kept open across clients (`--keep-open`),
    /// whose lines begin with `kept`, as no client's number would be true of them all.
    static func labelled(_ target: String, client id: Int?) throws -> TransportURL {
        var url = try ToolConnection.restoring(target)
        url.updateLayers { layer in
            if layer.scheme == "spy", layer.queryValue("label") == nil, layer.queryValue("format")?.lowercased() != "raw" {
                layer.query.append(("label", id.map { "#\($0)" } ?? "kept"))
            }
        }
        return url
    }

    /// A raw trace (bytes without lines) of a target several clients use at once would mix their
    /// bytes beyond telling apart: refused before listening.
    static func checkShared(_ settings: BridgeServer.Settings) throws {
        // A recording is one session, and a server's target is opened for client after client.
        var recorded: TransportURL? = try TransportURL(settings.target)
        while let current = recorded {
            if current.scheme == "spy", current.queryValue("record") != nil, !settings.keepOpen {
                throw ValidationError("spy.record in the target of a bridge that serves client after client would need a recording per session; "
                                      + "use --once, or --keep-open (one session of the target for all its clients)")
            }
            recorded = current.inner
        }
        guard !settings.exclusive, settings.limit > 1 else { return }
        var layer: TransportURL? = try TransportURL(settings.target)
        while let current = layer {
            if current.scheme == "spy", current.queryValue("format")?.lowercased() == "raw" {
                throw ValidationError("spy.format=raw in the target of a bridge that serves several clients at once would mix their bytes in one trace; "
                                      + "use spy.format=hex (every line carries the client's number) or --max-clients 1")
            }
            layer = current.inner
        }
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
        /// The target serves one client at a time (its scheme's descriptor says `exclusive`).
        var exclusive: Bool
        var linger: Duration
        var busy: Bridge.BusyPolicy
        var keepOpen: Bool
        /// Clients served at once (1 for an exclusive target).
        var limit: Int
        var status: StatusPrinter
        /// `--announce`: publish the listener by mDNS, under this name or a default one.
        var announce: Announce?
    }

    let settings: Settings
    init(_ settings: Settings) { self.settings = settings }

    /// Serves `client`'s RFC 2217 requests (if it is an `rfc2217://` listener's client) with
    /// `target`'s serial port, until the client leaves or the task is cancelled.
    static func serveSession(of client: Connection, with target: Connection) -> Task<Void, Never>? {
        guard let session = client.rfc2217Session, let port = target.serialPort else { return nil }
        return Task { await session.serve(port) }
    }

    /// Opens a listener, reports it, accepts one connection and closes the listener.
    static func acceptOne(on url: String, status: StatusPrinter) async throws -> Connection {
        let listener = try await Transport.listen(on: url)
        // Warnings first: whoever waits for "listening" has then seen them.
        warnIfOpenToStrangers(listener, target: nil, status: status)
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
            throw TransportError(.disconnected, "the listener on \(listener.url.shown) closed before a connection arrived")
        }
        status(["event": "accepted", "url": connection.url.description, "listener": listener.url.description])
        return connection
    }

    /// Says once, when the listener admits strangers (other machines, devices in radio range,
    /// no authentication), who can now use the target.
    static func warnIfOpenToStrangers(_ listener: Listener, target: String?, status: StatusPrinter) {
        guard let exposure = listener.exposure else { return }
        if let caution = exposure.caution {
            status(["event": "warning", "message": "\(listener.url.shown): \(caution); see Docs/Security.md"])
        }
        guard exposure.admitsStrangers else { return }
        let what = target.map { "use \($0)" } ?? "connect"
        status(["event": "warning",
                "message": "\(listener.url.shown) does not authenticate clients: \(exposure.who) can \(what), and what it relays is not "
                    + "encrypted. To share on this machine only, listen on 127.0.0.1 (and reach it from elsewhere with ssh -L); see Docs/Security.md"])
    }

    /// Tells a client in one line that the target failed it, without naming the target (a
    /// stranger learns nothing of the device behind the bridge), then closes it.
    static func tell(_ client: Connection, about error: any Error) async {
        let kind = (error as? TransportError)?.kind.phrase ?? "an error"
        try? await client.write("transportkit: error: the bridge cannot open its target now (\(kind)); try again later\r\n")
        try? await client.close()
    }

    /// Serves clients until the task is cancelled (a signal) or the listener fails. The listener
    /// is closed (its socket file removed) before this returns or throws.
    func serve(on url: String) async throws {
        let listener = try await Transport.registry.listen(on: url, buffering: .compact)
        Self.warnIfOpenToStrangers(listener, target: settings.target, status: settings.status)
        let announcement: NetworkAnnouncement?
        do {
            announcement = try await settings.announce?.publish(listener, target: settings.target, status: settings.status)
        } catch {
            try? await listener.close()
            throw error
        }
        settings.status(["event": "listening", "url": listener.url.description, "target": settings.target,
                         "clients": settings.exclusive ? "1 at a time" : "up to \(settings.limit)"])
        do {
            if settings.exclusive {
                try await serveExclusive(listener)
            } else {
                try await serveShared(listener)
            }
        } catch {
            if let announcement { await uncancellable { await announcement.withdraw() } }
            try? await listener.close()
            throw error
        }
        if let announcement { await uncancellable { await announcement.withdraw() } }
        try await listener.close()
    }

    /// A connection to the target per client, at most `limit` at once; a client beyond is told
    /// the bridge is full and closed at once, so it neither waits in the backlog nor holds a place.
    private func serveShared(_ listener: Listener) async throws {
        let active = ClientCount()
        try await withThrowingDiscardingTaskGroup { group in
            var number = 0
            while let client = try await listener.accept() {
                number += 1
                let id = number
                accepted(client, id: id)
                let admitted = active.admit(limit: settings.limit)
                guard admitted else {
                    settings.status(["event": "refused", "client": String(id), "reason": "the bridge serves its limit of \(settings.limit) clients"])
                    group.addTask {
                        try? await client.write("transportkit: busy: the bridge serves as many clients as it may; try again later\r\n")
                        try? await client.close()
                    }
                    continue
                }
                group.addTask {
                    await session(client, id: id) {
                        let target = try await Transport.registry.connect(to: SpyTraces.labelled(settings.target, client: id), buffering: .compact)
                        ToolConnection.follow(target) { settings.status(["event": "target", "client": String(id), "state": "\($0)"]) }
                        return target
                    }
                    if let left = active.leave() { Memory.giveBack(active, left: left) }
                }
            }
        }
    }

    /// One client at a time; see `Bridge`'s discussion for the policy.
    private func serveExclusive(_ listener: Listener) async throws {
        let device = SharedDevice(settings.target, keepOpen: settings.keepOpen, status: settings.status)
        if settings.keepOpen { _ = try await device.open(client: 0) }
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
                        // The device is not named: a stranger learns only that it is in use.
                        Task {
                            try? await client.write("transportkit: busy: the device serves another client; try again later\r\n")
                            try? await client.close()
                        }
                        continue
                    }
                    settings.status(["event": "replaced", "client": String(running.id), "by": String(id)])
                    running.task?.cancel()
                    await running.task?.value
                }
                // Marked busy before the task starts, so a session that ends at once clears it.
                current.state.withLock { $0 = (id, nil) }
                let task = Task {
                    await session(client, id: id, keepTarget: settings.keepOpen) { try await device.open(client: id) }
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
            let connection: Connection
            do {
                connection = try await open()
            } catch {
                if !(error is CancellationError) { await Self.tell(client, about: error) }
                throw error
            }
            target = connection
            // An RFC 2217 client's settings, lines and purges go to the target's port.
            let serving = Self.serveSession(of: client, with: connection)
            defer { serving?.cancel() }
            if keepTarget {
                // Drop what the target sent while nobody listened: what is buffered now, for at
                // most 20 ms (a device that never stops talking must not keep the client waiting).
                let until = ContinuousClock.now + .milliseconds(20)
                while ContinuousClock.now < until,
                      let stale = try? await connection.readBuffer(timeout: .milliseconds(1)), stale.readableBytes > 0 {}
                // The client's session ends before the next client comes, releasing what it left set (a BREAK).
                do {
                    try await Relay.closing([client]) {
                        try await Relay.run(
                            { while let chunk = try await client.readBuffer() { try await connection.write(chunk) } },
                            {
                                while let chunk = try await connection.readBuffer() { try await client.write(chunk) }
                                throw TransportError(.disconnected, "\(settings.target) ended")
                            },
                            linger: settings.linger)
                    }
                } catch {
                    serving?.cancel()
                    await serving?.value
                    throw error
                }
                serving?.cancel()
                await serving?.value
            } else {
                // The client's session ends with it, releasing what it left set (a BREAK) before the port closes.
                var beforeClosing: (@Sendable () async -> Void)?
                if let serving {
                    beforeClosing = {
                        serving.cancel()
                        await serving.value
                    }
                }
                try await Relay.bridge(client, connection, linger: settings.linger, beforeClosing: beforeClosing)
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

/// The clients a server serves now, and when the memory of those that left is worth giving back.
final class ClientCount: Sendable {
    private struct State {
        var count = 0
        /// The most clients at once since memory was last given back.
        var peak = 0
        /// A give-back is scheduled and has not finished.
        var givingBack = false
        /// Another give-back was due while one ran: it starts when that one ends.
        var pending = false
    }

    /// Guards the numbers; the accept loop admits, each session's end leaves.
    private let state = Locked(State())

    /// The clients served now.
    var current: Int { state.withLock { $0.count } }

    /// Takes one more client unless `limit` are served.
    func admit(limit: Int) -> Bool {
        state.withLock { state in
            guard state.count < limit else { return false }
            state.count += 1
            state.peak = max(state.peak, state.count)
            return true
        }
    }

    /// A session ended. Returns the clients left when the memory of those gone should be given
    /// back: none is left, or a quarter of the most there were (when that was at least 64). The
    /// peak then starts again from here. While a give-back runs, a due one waits for its end.
    func leave() -> Int? {
        state.withLock { state in
            state.count -= 1
            guard state.count == 0 || (state.peak >= 64 && state.count <= state.peak / 4) else { return nil }
            state.peak = state.count
            guard !state.givingBack else {
                state.pending = true
                return nil
            }
            state.givingBack = true
            return state.count
        }
    }

    /// A give-back ended. Returns the clients left when another one became due meanwhile (it
    /// starts now, its delays counted afresh), else nil.
    func gaveBack() -> Int? {
        state.withLock { state in
            guard state.pending else {
                state.givingBack = false
                return nil
            }
            state.pending = false
            return state.count
        }
    }
}

/// The C library's free memory, given back to the system.
enum Memory {
    /// When the bridge trims after clients left, counted from the session that asked: the memory
    /// of a finished session is not all free at once. What a cancelled `Task.sleep` holds (a
    /// relay's linger, a timed wait's timer) stays until its deadline would have come; measured
    /// after 6,000 clients left, a trim 1 s after the last gave back 88 of 181 MB, one after 3 s
    /// 165 MB, and later ones a few MB more each (BENCHMARKS.md).
    static let trimDelays: [Duration] = [.seconds(1), .seconds(3), .seconds(11)]

    /// malloc_trim(3) at each of `trimDelays` while no more than `left` clients are served:
    /// glibc keeps what a load of clients freed in its arenas (about 90 MB after 6,000 clients)
    /// until asked. A trim takes a few milliseconds; the bridge asks only when most clients have
    /// gone. A give-back that became due meanwhile follows this one.
    static func giveBack(_ clients: ClientCount, left: Int) {
        Task.detached {
            var slept = Duration.zero
            for delay in trimDelays {
                try? await Task.sleep(for: delay - slept)
                slept = delay
                guard clients.current <= left else { break }
                _ = trim?(0)
            }
            if let next = clients.gaveBack() { giveBack(clients, left: next) }
        }
    }

    /// malloc_trim, found at run time: it is declared in <malloc.h>, which Swift's Glibc module
    /// does not include. Absent (another C library): nothing is given back.
    private static let trim: (@convention(c) (Int) -> Int32)? = {
        guard let symbol = dlsym(UnsafeMutableRawPointer(bitPattern: 0), "malloc_trim") else { return nil }
        return unsafeBitCast(symbol, to: (@convention(c) (Int) -> Int32).self)
    }()
}

/// The one session an exclusive target serves: its client's number and task.
final class CurrentSession: Sendable {
    /// Guards which session runs; set by the accept loop, cleared by the session as it ends.
    let state = Locked<(id: Int, task: Task<Void, Never>?)?>(nil)
}

/// The exclusive target: opened per client, or once and kept open with `keepOpen`.
final class SharedDevice: Sendable {
    private let url: String
    private let keepOpen: Bool
    /// The connection while kept open. The mutex guards the reference; the connection itself is
    /// used by one session at a time (the server runs one session for an exclusive target).
    private let connection = Locked<Connection?>(nil)

    private let status: StatusPrinter

    init(_ url: String, keepOpen: Bool, status: StatusPrinter) {
        self.url = url
        self.keepOpen = keepOpen
        self.status = status
    }

    /// The kept connection (reopened if it ended), or a new one per call without `keepOpen`;
    /// a spy+ trace in it labels its lines with `client`'s number (`kept` when kept open). A
    /// `reconnect+` target's events are status lines.
    func open(client: Int) async throws -> Connection {
        let target = try SpyTraces.labelled(url, client: keepOpen ? nil : client)
        let status = status
        let report: @Sendable (ConnectionEvent) -> Void = { status(["event": "target", "state": "\($0)"]) }
        guard keepOpen else {
            let fresh = try await Transport.registry.connect(to: target)
            ToolConnection.follow(fresh, report: report)
            return fresh
        }
        if let kept = connection.withLock({ $0 }), !kept.isClosed { return kept }
        let fresh = try await Transport.registry.connect(to: target)
        ToolConnection.follow(fresh, report: report)
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

/// `bridge --announce`: the listener published by mDNS while it serves.
struct Announce: Sendable {
    /// `--announce-name`, or nil for "<device> on <host>".
    var name: String?

    /// Publishes `listener` (an rfc2217:// one) through avahi-daemon, with the target's USB
    /// attributes when the target is a serial port this machine lists; says under which name.
    func publish(_ listener: Listener, target: String, status: StatusPrinter) async throws -> NetworkAnnouncement {
        guard let port = listener.url.innermost.port else {
            throw TransportError(.misuse, "\(listener.url.shown) has no port to announce")
        }
        let device = await Self.device(for: target)
        let chosen = name ?? Self.defaultName(device: device, target: target)
        let announcement = try await RFC2217Plugin().announce(port: port, name: chosen, device: device, tls: listener.url.scheme == "tls")
        var line = ["event": "announced", "name": announcement.name, "type": announcement.service.type, "port": String(port)]
        if announcement.name != chosen { line["asked"] = chosen }
        status(line)
        return announcement
    }

    /// The serial port `target` names, as this machine lists it (by its URL, its node or a link to it).
    static func device(for target: String) async -> DeviceRecord? {
        guard let url = try? TransportURL(target), url.innermost.scheme == "tty" else { return nil }
        let path = url.innermost.path
        let real = path.isEmpty ? nil : realpath(path, nil).map { pointer in
            defer { free(pointer) }
            return String(cString: pointer)
        }
        // Only the serial plugin's listing: the tty is among its devices, and asking every plugin
        // (bluetoothd, libusb) would cost the bridge's start for nothing.
        let listed = (try? await SerialPlugin().devices(includeAll: true)) ?? []
        return listed.first { record in
            record.url == target || (record.devnode != nil && (record.devnode == real || record.devnode == path || record.links.contains(path)))
        }
    }

    /// "<product or node> on <host>", as pyserial's port publisher names its ports; at most 63 bytes.
    static func defaultName(device: DeviceRecord?, target: String) -> String {
        let node: String? = device?.devnode.flatMap { $0.split(separator: "/").last.map(String.init) }
        let path: String? = (try? TransportURL(target))?.innermost.path.split(separator: "/").last.map(String.init)
        let what: String = device?.product ?? node ?? path ?? "serial port"
        var host = [UInt8](repeating: 0, count: 256)
        let hostName = host.withUnsafeMutableBufferPointer { buffer -> String in
            guard let base = buffer.baseAddress, gethostname(base, buffer.count - 1) == 0 else { return "this host" }
            let bytes = UnsafeBufferPointer(start: base, count: strlen(base))
            return String(decoding: bytes, as: UTF8.self)
        }
        var name = "\(what) on \(hostName)"
        while name.utf8.count > 63 { name.removeLast() }
        return name
    }
}
