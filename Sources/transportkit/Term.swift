// Term.swift: `transportkit term URL`, an interactive terminal on any URL, the way tio works. The
// local terminal is in raw mode (LocalTerminal.swift) and every key goes to the device, Ctrl-C
// included; Ctrl-T opens the menu. A device URL is wrapped in `reconnect+` unless told not to, and
// the connection's events become status lines.

import ArgumentParser
import Glibc
import Logging
import Synchronization
import TransportKit
@_spi(Plugins) import TransportKitCore

struct Term: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "An interactive terminal on a URL: every key goes to the device, Ctrl-C included; Ctrl-T opens the menu (Ctrl-T ? lists its keys, Ctrl-T q quits).",
        discussion: """
            Standard input must be a terminal; it is in raw mode while term runs and gets its \
            settings back when term ends, also after SIGTERM, SIGHUP or a crash. URLs to a device \
            (tty://, usb://, rfcomm://, ble://, rfc2217://) are connected again when the device \
            goes away, as by reconnect+URL; --no-reconnect ends term instead. Exit status: 0 after \
            Ctrl-T q or when the peer closed; 1 on an error; 129, 130 or 143 after SIGHUP, SIGINT \
            or SIGTERM. Maps (--map, names as tio's): ICRNL, IGNCR, INLCR, INLCRNL for what the \
            device sends; OCRNL, ONLCRNL, ODELBS, OLTU for what is typed.
            """
    )

    @Argument(help: "The URL to open, such as tty:///dev/ttyUSB0?baud=115200.")
    var url: String

    @Flag(name: .customLong("no-reconnect"), help: "End when the device goes away instead of waiting for it to come back.")
    var noReconnect = false

    @Option(name: .customLong("map"), help: ArgumentHelp("Character maps, separated by commas, such as INLCRNL,ODELBS.", valueName: "maps"))
    var map: String?

    @Flag(name: .customLong("local-echo"), help: "Show what is typed (Ctrl-T e toggles it).")
    var localEcho = false

    @Flag(help: "Show the device's bytes in hex (Ctrl-T h toggles it).")
    var hex = false

    @Flag(help: "Put the time at the start of each line the device sends (Ctrl-T t toggles it).")
    var timestamps = false

    @Option(name: .customLong("log"), help: ArgumentHelp("Append what the device sends, as shown, to this file (Ctrl-T f stops and starts it).", valueName: "file"))
    var logPath: String?

    func validate() throws {
        try Arguments.refuseRepeated(["--no-reconnect", "--map", "--local-echo", "--hex", "--timestamps", "--log"])
        do {
            _ = try TermMaps(parsing: map ?? "")
        } catch let error as TermError {
            throw ValidationError(error.description)
        }
        if logPath == "" { throw ValidationError("--log needs a file name") }
    }

    func run() async throws {
        // The library's log would land in the raw terminal; term says what matters itself.
        LoggingSystem.bootstrap { _ in SwiftLogNoOpLogHandler() }
        do {
            let plan = try Self.plan(url, reconnect: !noReconnect)
            if Self.spyTracesToTheTerminal(plan.url) {
                throw ValidationError("spy+ writes its trace to standard error, which is the terminal term draws on; "
                                      + "give the trace a file (spy.file=PATH) or send standard error elsewhere (2> trace.txt)")
            }
            _ = try LocalTerminal.settings()   // a terminal, before anything is connected
            ToolConnection.warnIfInsecure(plan.url)
            let log: TermLog? = if let logPath { try await TermLog.open(path: logPath) } else { nil }
            let options = TermSession.Options(url: plan.url, reconnecting: plan.reconnecting, maps: try TermMaps(parsing: map ?? ""),
                                              localEcho: localEcho, hex: hex, timestamps: timestamps, log: log)
            try await Signals.run {
                try await TermSession(options).run()
            }
        } catch let exit as ExitCode {
            throw exit
        } catch let error as ValidationError {
            throw error
        } catch {
            throw fail(error)
        }
    }

    /// Whether a spy layer of `url` writes its trace to standard error (no `spy.file`, no
    /// `spy.record`) and standard error is the terminal standard input is.
    static func spyTracesToTheTerminal(_ url: TransportURL) -> Bool {
        var toStandardError = false
        var layer: TransportURL? = url
        while let current = layer {
            if current.scheme == "spy", !["file", "spy.file", "record", "spy.record"].contains(where: { current.queryValue($0) != nil }) {
                toStandardError = true
            }
            layer = current.inner
        }
        guard toStandardError, isatty(2) == 1 else { return false }
        var error = stat(), input = stat()
        guard fstat(2, &error) == 0, fstat(0, &input) == 0 else { return true }
        return error.st_rdev == input.st_rdev
    }

    /// The URL term connects to: a tty gets its settings back at the end (`restore=true`), and a
    /// URL whose innermost scheme reaches a device is wrapped in `reconnect+` unless `reconnect`
    /// is false or the URL has a reconnect layer already.
    static func plan(_ text: String, reconnect: Bool) throws -> (url: TransportURL, reconnecting: Bool) {
        var url = try ToolConnection.restoring(text, writesWait: false)
        let explicit = url.hasLayer("reconnect")
        if explicit && !reconnect {
            throw ValidationError("--no-reconnect and a reconnect+ URL say opposite things; leave one of them out")
        }
        let innermost = url.innermost.scheme
        if reconnect, !explicit, Transport.schemes.contains(where: { !$0.wraps && $0.scheme == innermost && $0.reachesDevice }) {
            url = try TransportURL("reconnect+" + url.description)
        }
        return (url, url.hasLayer("reconnect"))
    }
}

/// One run of `term`: the connection, the keys, the screen.
final class TermSession: Sendable {
    struct Options: Sendable {
        var url: TransportURL
        var reconnecting: Bool
        var maps: TermMaps
        var localEcho: Bool
        var hex: Bool
        var timestamps: Bool
        var log: TermLog?
    }

    static let menuKey: UInt8 = 0x14   // Ctrl-T
    static let breakLength: Duration = .milliseconds(250)
    static let pulseLength: Duration = .milliseconds(100)
    /// How long the first connect waits between attempts while the device is not there.
    static let firstRetry: Duration = .seconds(1)

    let options: Options
    let screen: TermScreen
    /// The connection once it is made.
    private let current = Locked<Connection?>(nil)
    private let localEcho: Atomic<Bool>
    private let sent = Atomic<Int>(0)
    private let received = Atomic<Int>(0)
    /// "not sent" was said in this outage (cleared when connected again).
    private let notSentSaid = Atomic<Bool>(false)
    /// DTR and RTS as term set them (by `ModemLines` raw value): a port whose answer does not
    /// include an output line it was not told (rfc2217://) still toggles it both ways.
    private let linesSet = Locked<[Int32: Bool]>([:])
    /// The file `Ctrl-T f` logs to: from --log, or typed at its prompt.
    private let logPath: Locked<String?>

    init(_ options: Options) {
        self.options = options
        screen = TermScreen(maps: options.maps, hex: options.hex, timestamps: options.timestamps, log: options.log)
        localEcho = Atomic(options.localEcho)
        logPath = Locked(options.log?.path)
    }

    private var connection: Connection? { current.withLock { $0 } }

    /// Connects, runs until Ctrl-T q, the end of the connection, an error or cancellation (a
    /// signal), and closes. The terminal is raw only inside.
    func run() async throws {
        var first: Connection?
        var firstError: TransportError?
        do {
            first = try await Transport.registry.connect(to: options.url)
        } catch let error as TransportError where options.reconnecting && Self.worthWaiting(error) {
            firstError = error   // the device is not there yet: wait for it, as tio does
        }
        do {
            try LocalTerminal.enterRawMode()
        } catch {
            if let first { _ = await Relay.close([first]) }
            throw error
        }
        defer { LocalTerminal.restore() }
        let (made, missing) = (first, firstError)
        let ending: (any Error)?
        do {
            try await withThrowingTaskGroup(of: Void.self) { group in
                let (typed, sender) = AsyncStream<[UInt8]>.makeStream(bufferingPolicy: .bufferingOldest(256))
                group.addTask { try await self.keys(sending: sender) }
                group.addTask { await self.send(typed) }
                group.addTask { try await self.device(first: made, firstError: missing) }
                // Whichever ends first ends the session: a quit, the device's end, an error.
                try await group.next()
                group.cancelAll()
            }
            ending = nil
        } catch {
            ending = error
        }
        if let connection { _ = await Relay.close([connection]) }
        // A connect cut short by Ctrl-T q or a signal while the device was awaited: what it made
        // (a tty whose settings it changed) is closed, and put back, before the tool exits.
        await Transport.registry.waitForAbandonedConnects()
        await screen.log?.flush()
        await screen.finish()
        if let ending { throw ending }
    }

    /// Errors the first connect waits out when reconnecting: the device is missing, busy, not
    /// allowed yet, or not answering.
    static func worthWaiting(_ error: TransportError) -> Bool {
        [.notFound, .busy, .permissionDenied, .refused, .timedOut, .disconnected, .io].contains(error.kind)
    }

    // MARK: The device's side

    private func device(first: Connection?, firstError: TransportError?) async throws {
        var connection = first
        if connection == nil, let firstError {
            connection = try await waitForFirst(firstError)
        }
        guard let connection else { return }
        current.withLock { $0 = connection }
        notSentSaid.store(false, ordering: .relaxed)   // keys typed while it was awaited were said
        await screen.status("Connected to \(connection.url.shown) (Ctrl-T ? for the keys, Ctrl-T q to quit)")
        try await withThrowingTaskGroup(of: Void.self) { group in
            if options.reconnecting {
                group.addTask { await self.follow(connection.events()) }
            }
            group.addTask {
                do {
                    while let bytes = try await connection.read() {
                        self.received.add(bytes.count, ordering: .relaxed)
                        try await self.screen.device(bytes)
                    }
                    await self.screen.status("Disconnected: the peer closed the connection")
                } catch let error as TransportError where !self.options.reconnecting {
                    await self.screen.status("Disconnected: \(error.message)")
                    throw error
                }
            }
            try await group.next()
            group.cancelAll()
        }
    }

    /// Connects again and again (each `firstRetry`) until the device is there.
    private func waitForFirst(_ error: TransportError) async throws -> Connection {
        var last = error
        await screen.status(Self.sentence(ConnectionEvent.waiting(for: ConnectionEvent.missing(error), error: error, nextAttempt: Self.firstRetry)))
        while true {
            try await Task.sleep(for: Self.firstRetry)
            do {
                return try await Transport.registry.connect(to: options.url)
            } catch let error as TransportError where Self.worthWaiting(error) {
                if error.message != last.message {
                    await screen.status(Self.sentence(ConnectionEvent.waiting(for: ConnectionEvent.missing(error), error: error, nextAttempt: Self.firstRetry)))
                }
                last = error
            }
        }
    }

    /// A status line for each of a reconnecting connection's events after its first connect.
    private func follow(_ events: AsyncStream<ConnectionEvent>) async {
        for await event in events {
            switch event {
            case .connected(generation: 1), .connecting, .closed: continue
            case .connected:
                notSentSaid.store(false, ordering: .relaxed)
                await screen.status(Self.sentence(event))
            default:
                await screen.status(Self.sentence(event))
            }
        }
    }

    /// An event as a status line: "Disconnected: … (next attempt in 1 s)".
    static func sentence(_ event: ConnectionEvent) -> String {
        let text = event.description
        return text.prefix(1).uppercased() + text.dropFirst()
    }

    // MARK: The keys

    private enum KeyState {
        case normal
        /// Ctrl-T was pressed: the next key is a command.
        case menu
        /// The log file's name is being typed (its UTF-8 bytes so far).
        case prompt([UInt8])
    }

    /// Reads the keys until Ctrl-T q or the end of standard input (the terminal hung up).
    private func keys(sending sender: AsyncStream<[UInt8]>.Continuation) async throws {
        defer { sender.finish() }
        let input = StandardInput()
        // Ctrl-T q returns from here: the read-ahead thread must not take the keys typed after it.
        defer { input.cancel() }
        var state = KeyState.normal
        var pending: [UInt8] = []
        func flush() async {
            guard !pending.isEmpty else { return }
            let bytes = options.maps.toDevice(pending)
            pending = []
            if localEcho.load(ordering: .relaxed) { try? await screen.echo(bytes) }
            if case .dropped = sender.yield(bytes) {
                await screen.status("The device is not taking what is typed: \(bytes.count) bytes were dropped")
            }
        }
        while let chunk = try await input.next() {
            for byte in chunk.readableBytesView {
                switch state {
                case .normal:
                    if byte == Self.menuKey { state = .menu } else { pending.append(byte) }
                case .menu:
                    state = .normal
                    if byte == Self.menuKey {
                        pending.append(byte)   // Ctrl-T Ctrl-T sends Ctrl-T
                        continue
                    }
                    await flush()
                    switch await command(byte) {
                    case .quit: return
                    case .promptForLog: state = .prompt([])
                    case .done: break
                    }
                case .prompt(var name):
                    switch byte {
                    case 0x0D, 0x0A:
                        state = .normal
                        await screen.raw([0x0D, 0x0A])
                        await startLog(String(decoding: name, as: UTF8.self))
                    case 0x1B, 0x03:
                        state = .normal
                        await screen.raw([0x0D, 0x0A])
                        await screen.status("Not logging")
                    case 0x7F, 0x08:
                        // One character back: its UTF-8 continuation bytes, then its first byte.
                        while let last = name.last, last & 0xC0 == 0x80 { name.removeLast() }
                        if !name.isEmpty {
                            name.removeLast()
                            await screen.raw([0x08, 0x20, 0x08])
                        }
                        state = .prompt(name)
                    case 0x20...0x7E, 0x80...:
                        name.append(byte)
                        await screen.raw([byte])
                        state = .prompt(name)
                    default:
                        state = .prompt(name)
                    }
                }
            }
            await flush()
        }
    }

    /// Sends what was typed, in order; keys typed while the device is away are dropped, and that
    /// is said once per outage.
    private func send(_ typed: AsyncStream<[UInt8]>) async {
        for await bytes in typed {
            guard let connection else {
                await notSent(bytes.count, "not connected yet")
                continue
            }
            do {
                try await connection.write(bytes)
                sent.add(bytes.count, ordering: .relaxed)
            } catch let error as TransportError where error.kind == .disconnected {
                await notSent(bytes.count, "disconnected")
            } catch is CancellationError {
                return
            } catch {
                await screen.status("Not sent: \(error)")
            }
        }
    }

    private func notSent(_ count: Int, _ why: String) async {
        guard !notSentSaid.exchange(true, ordering: .relaxed) else { return }
        await screen.status("Not sent (\(why)): \(count) bytes; keys typed until the device is back are dropped")
    }

    private enum Outcome {
        case done
        case quit
        case promptForLog
    }

    static let help = """
        Keys after Ctrl-T:
          ?  this list                    q  quit
          b  send a break (250 ms)        F  flush the port's queues
          d  toggle DTR                   D  pulse DTR (100 ms)
          r  toggle RTS                   R  pulse RTS (100 ms)
          L  modem lines                  c  configuration and line settings
          e  local echo on/off            h  hex display on/off
          t  timestamps on/off            f  log to a file on/off
          s  statistics                   l  clear the screen
          Ctrl-T  send Ctrl-T itself
        """

    private func command(_ key: UInt8) async -> Outcome {
        switch key {
        case UInt8(ascii: "q"):
            return .quit
        case UInt8(ascii: "?"):
            await screen.status(Self.help)
        case UInt8(ascii: "e"):
            let on = !localEcho.load(ordering: .relaxed)
            localEcho.store(on, ordering: .relaxed)
            await screen.status("Local echo \(on ? "on" : "off")")
        case UInt8(ascii: "h"):
            let on = await !screen.hex
            await screen.setHex(on)
            await screen.status("Hex display \(on ? "on" : "off")")
        case UInt8(ascii: "t"):
            let on = await !screen.timestamps
            await screen.setTimestamps(on)
            await screen.status("Timestamps \(on ? "on" : "off")")
        case UInt8(ascii: "f"):
            if let log = await screen.log {
                await screen.setLog(nil)
                await log.flush()
                await screen.status("Logging to \(log.path) stopped" + (log.trouble.map { "; \($0)" } ?? ""))
            } else if let path = logPath.withLock({ $0 }) {
                await startLog(path)
            } else {
                await screen.status("Log to which file? Type its name and Enter (Esc: no log)")
                await screen.raw(Array("file: ".utf8))
                return .promptForLog
            }
        case UInt8(ascii: "s"):
            await statistics()
        case UInt8(ascii: "c"):
            await configuration()
        case UInt8(ascii: "l"):
            await screen.raw(Array("\u{1B}[H\u{1B}[2J".utf8))
        case UInt8(ascii: "b"):
            await serial("Break") { port in
                try await port.sendBreak(duration: Self.breakLength)
                return "Break sent (250 ms)"
            }
        case UInt8(ascii: "F"):
            await serial("Flush") { port in
                try await port.flush(.both)
                return "Flushed what waited to be sent and what was received"
            }
        case UInt8(ascii: "L"):
            await serial("Modem lines") { port in "Modem lines: \(try await port.modemLines())" }
        case UInt8(ascii: "d"), UInt8(ascii: "r"):
            let line: ModemLines = key == UInt8(ascii: "d") ? .dtr : .rts
            await serial(line.description) { port in
                let on = !(try await self.state(of: line, on: port))
                try await port.setLines(line, on)
                self.linesSet.withLock { $0[line.rawValue] = on }
                return "\(line) \(on ? "on" : "off")"
            }
        case UInt8(ascii: "D"), UInt8(ascii: "R"):
            let line: ModemLines = key == UInt8(ascii: "D") ? .dtr : .rts
            await serial(line.description) { port in
                let on = try await self.state(of: line, on: port)
                try await port.setLines(line, !on)
                try await Task.sleep(for: Self.pulseLength)
                try await port.setLines(line, on)
                self.linesSet.withLock { $0[line.rawValue] = on }
                return "\(line) pulsed (\(on ? "off" : "on") for 100 ms)"
            }
        default:
            let name = key < 0x20 ? "Ctrl-\(Character(Unicode.Scalar(key + 0x40)))" : key < 0x7F ? String(Character(Unicode.Scalar(key))) : "byte \(key)"
            await screen.status("Ctrl-T \(name) does nothing; Ctrl-T ? lists the keys")
        }
        return .done
    }

    /// Whether `line` (DTR or RTS) is on: as term last set it, or else as the port reports it.
    /// (An rfc2217:// client knows an output line only once it set it; the server's is not asked.)
    private func state(of line: ModemLines, on port: any SerialControl) async throws -> Bool {
        if let set = linesSet.withLock({ $0[line.rawValue] }) { return set }
        return try await port.modemLines().contains(line)
    }

    /// Runs `body` on the serial port, and says what it did or why not.
    private func serial(_ what: String, _ body: (any SerialControl) async throws -> String) async {
        guard let connection else {
            await screen.status("\(what): not connected yet")
            return
        }
        guard let port = connection.serialPort else {
            await screen.status("\(what): \(connection.url.innermost.scheme):// has no serial line to control")
            return
        }
        do {
            await screen.status(try await body(port))
        } catch let error as TransportError {
            await screen.status("\(what): \(error.message)")
        } catch {
            await screen.status("\(what): \(error)")
        }
    }

    private func startLog(_ path: String) async {
        guard !path.isEmpty else {
            await screen.status("Not logging: no file name was given")
            return
        }
        do {
            let log = try await TermLog.open(path: path)
            logPath.withLock { $0 = path }
            await screen.setLog(log)
            await screen.status("Logging to \(path)")
        } catch let error as TransportError {
            await screen.status("Not logging: \(error.message)")
        } catch {
            await screen.status("Not logging: \(error)")
        }
    }

    private func statistics() async {
        var lines = ["Sent \(sent.load(ordering: .relaxed)) bytes, received \(received.load(ordering: .relaxed)) bytes"]
        if let connection {
            lines.append("Connection \(connection.generation)\(options.reconnecting ? " (reconnecting)" : "")")
            if let port = connection.serialPort, let errors = try? await port.lineErrors() {
                lines.append("Line errors since the port was set up: \(errors)")
            }
        } else {
            lines.append("Not connected yet")
        }
        if let log = await screen.log {
            lines.append("Logging to \(log.path)" + (log.trouble.map { ": \($0)" } ?? ""))
        }
        await screen.status(lines.joined(separator: "\n"))
    }

    private func configuration() async {
        var lines = ["URL: \(options.url.shown)\(options.reconnecting ? " (connects again when lost)" : "")"]
        if let port = connection?.serialPort {
            if let settings = try? await port.settings() {
                lines.append("Line: \(settings.summary)")
            } else {
                lines.append("Line: its settings cannot be read now")
            }
        }
        let log = await screen.log
        lines.append("Maps: \(options.maps.summary); local echo \(localEcho.load(ordering: .relaxed) ? "on" : "off"); "
                     + "hex \(await screen.hex ? "on" : "off"); timestamps \(await screen.timestamps ? "on" : "off"); "
                     + "log \(log.map(\.path) ?? "off")")
        await screen.status(lines.joined(separator: "\n"))
    }
}
