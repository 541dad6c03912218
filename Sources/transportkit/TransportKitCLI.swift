import ArgumentParser
import Foundation
import Logging
import TransportKit

@main
struct TransportKitCLI: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "transportkit",
        abstract: "Connect to devices and peers by URL: tcp://, unix://, tls://, ws://, wss://, http://, https://, tty://, pty://, rfc2217://, usb://, rfcomm://, ble://, loop://, replay://; spy+URL, tls+URL and reconnect+URL wrap any of them; ea:// is refused.",
        discussion: "Run 'transportkit schemes' for every URL form and its options. spy+URL traces a connection on standard error.",
        subcommands: [Schemes.self, List.self, Watch.self, Connect.self, Term.self, Bridge.self, Gatt.self]
    )

    static func main() async {
        // Before anything opens a descriptor: a closed standard stream gets /dev/null in its place.
        _ = StandardStreams.closedAtStart
        await main(nil)
    }
}

/// `--log-level LEVEL`: TransportKit's log (connects, closes, failures, with URL and scheme) on
/// standard error. Quiet without it.
struct LoggingOptions: ParsableArguments {
    @Option(name: .customLong("log-level"),
            help: ArgumentHelp("Log what connections do on standard error: trace, debug, info, notice, warning, error or critical.",
                               valueName: "level"))
    var levelName: String?

    func validate() throws {
        if let levelName, Logger.Level(rawValue: levelName) == nil {
            throw ValidationError("--log-level takes one of: \(Logger.Level.allCases.map(\.rawValue).joined(separator: ", "))")
        }
    }

    /// Installs the standard-error log handler; must run before the registry is first used.
    func bootstrap() {
        // Without --log-level, only errors: the tool says itself what the library warns about
        // (insecure=true), once, in its own words.
        let level = levelName.flatMap(Logger.Level.init(rawValue:)) ?? .error
        LoggingSystem.bootstrap { label in
            var handler = StreamLogHandler.standardError(label: label)
            handler.logLevel = level
            return handler
        }
    }
}

/// Prints `error` the way every subcommand reports failures, and exits non-zero.
func fail(_ error: any Error) -> ExitCode {
    let message = (error as? TransportError)?.description ?? "\(error)"
    StandardError.write("transportkit: \(message)\n")
    return ExitCode.failure
}

struct Schemes: AsyncParsableCommand {
    static let configuration = CommandConfiguration(abstract: "List every registered scheme with its grammar and options.")

    @Flag(help: "Print a JSON array of scheme objects.")
    var json = false

    func run() async throws {
        let schemes = Transport.schemes
        if json {
            let encoder = JSONEncoder()
            encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
            let data = try encoder.encode(schemes.map(SchemeJSON.init))
            print(String(decoding: data, as: UTF8.self))
        } else {
            print(schemes.map(\.helpText).joined(separator: "\n\n"))
        }
    }
}

/// The stable JSON shape of a scheme for scripts.
struct SchemeJSON: Encodable {
    struct Option: Encodable {
        var name: String
        var type: String
        var `default`: String?
        var help: String
        /// Names the option had before a rename, still accepted.
        var formerly: [String]?
    }
    var scheme: String
    var summary: String
    var grammar: String
    var examples: [String]
    var host: String
    var port: String
    var portRange: [Int]?
    var path: String
    var canListen: Bool
    var wraps: Bool
    /// One connection at a time (a serial port or a USB interface: tty://, usb://): `bridge --listen` serves one client at a time.
    var exclusive: Bool
    /// A device that can go away and come back (a serial port, USB, Bluetooth): `term` reconnects to it by default.
    var device: Bool
    var options: [Option]
    /// The ways the scheme's URLs are used, each with the options it takes (Docs/Schemes.md, "Modes").
    var modes: [Mode]

    struct Mode: Encodable {
        var name: String
        var role: String
        var form: String
        /// The boolean option that, turned on, selects this mode (`usb://`'s `controlOnly`).
        var selectedBy: String?
        var options: [String]
    }

    init(_ descriptor: SchemeDescriptor) {
        scheme = descriptor.scheme
        summary = descriptor.summary
        grammar = descriptor.grammar
        examples = descriptor.examples
        host = descriptor.host.rawValue
        port = descriptor.port.rawValue
        portRange = descriptor.portRange.map { [$0.lowerBound, $0.upperBound] }
        path = descriptor.path.rawValue
        canListen = descriptor.canListen
        wraps = descriptor.wraps
        exclusive = descriptor.exclusive
        device = descriptor.reachesDevice
        // A wrapper's options are written with its prefix (spy.format).
        let prefix = descriptor.wraps ? descriptor.scheme + "." : ""
        options = descriptor.allOptions.map { option in
            Option(name: prefix + option.name, type: option.kind.label, default: option.defaultValue, help: option.help,
                   formerly: option.formerNames.isEmpty ? nil : option.formerNames.map { prefix + $0 })
        }
        modes = descriptor.effectiveModes.map { mode in
            Mode(name: mode.name, role: mode.role.rawValue, form: mode.form, selectedBy: mode.selectedBy.map { prefix + $0 },
                 options: descriptor.options(of: mode).map { prefix + $0.name })
        }
    }
}

struct Connect: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Relay standard input to a connection and the connection to standard output.",
        discussion: """
            Bytes pass untouched. At the end of standard input the connection is half-closed where \
            the transport allows, and inbound bytes are still copied until the peer closes or \
            --linger seconds pass. When the peer closes first, the rest of standard input gets \
            --linger seconds. Exit status: 0 when the relay ended normally (also when standard \
            output was closed, as by `| head`); 1 on an error, such as a device that went away; \
            129, 130 or 143 after SIGHUP, SIGINT or SIGTERM, with everything closed and a tty's \
            settings restored. pty:// without link= prints the peer node it made on standard error.
            """
    )

    @Argument(help: "The URL to connect to, such as tcp://127.0.0.1:4000.")
    var url: String

    @Option(parsing: .unconditional, help: Linger.help)
    var linger: Double = 0.5

    @Flag(help: "Send each line of standard input as one text message, and print each message read on a line of its own (ws://, wss://). Without it, each chunk of standard input is one binary message.")
    var text = false

    @OptionGroup var logging: LoggingOptions

    func validate() throws {
        try Arguments.refuseRepeated(["--linger", "--log-level", "--text"])
        try Linger.check(linger)
    }

    func run() async throws {
        logging.bootstrap()
        let url = url
        let linger = Linger.duration(linger)
        let text = text
        do {
            if let closed = StandardStreams.closedForRelay() { throw closed }
            try await Signals.run {
                let connection = try await ToolConnection.open(url)
                if connection.url.innermost.scheme == "pty", connection.metadata.extra["link"] == nil,
                   let peer = connection.metadata.extra["peer"] {
                    StandardError.write("pty: \(peer)\n")
                }
                if text, !connection.carriesMessages {
                    try? await connection.close()
                    throw ValidationError("--text sends text messages, and \(connection.url.scheme):// carries a byte stream; leave --text out")
                }
                try await Relay.pump(connection, linger: linger, textLines: text)
            }
        } catch StandardStreamError.outputClosed {
            // Whoever read standard output went away (`| head`): a normal end, as for cat(1)
            // under a shell that ignores SIGPIPE.
        } catch let exit as ExitCode {
            throw exit
        } catch {
            throw fail(error)
        }
    }
}

/// `--linger SECONDS`, shared by connect and bridge.
enum Linger {
    static let limit: Double = 86_400
    static let help = ArgumentHelp("Seconds (0 to 86400) to keep relaying one direction after the other ended.", valueName: "seconds")

    static func check(_ seconds: Double) throws {
        guard seconds.isFinite, (0...limit).contains(seconds) else {
            throw ValidationError("--linger takes a number of seconds from 0 to \(Int(limit)), such as 0.5; got \(seconds)")
        }
    }

    static func duration(_ seconds: Double) -> Duration {
        .milliseconds(Int64((seconds * 1000).rounded()))
    }
}

/// How the tool opens its connections.
enum ToolConnection {
    /// Connects to `url`. A tty gets its previous settings back when the tool closes it, also after
    /// a signal, unless the URL says `restore=false`.
    ///
    /// A signal does not cut the connect short (the connect's own timeout still applies, and the
    /// signal handler's time limit): a connect abandoned half-way would leave what it made, a pty's
    /// link or a tty's changed settings, to be cleaned up after the tool has exited. The
    /// connection is closed once it is made, and the tool then exits.
    static func open(_ url: String, report: @escaping @Sendable (ConnectionEvent) -> Void = reportOnStandardError) async throws -> Connection {
        let url = try restoring(url)
        warnIfInsecure(url)
        let connection = try await Transport.registry.connect(to: url)
        follow(connection, report: report)
        return connection
    }

    /// For a `reconnect+` connection: `report` gets each of its events but the first
    /// ("connected", which is the connect itself), in a task that ends with the connection's
    /// `.closed`. Other connections are left alone.
    static func follow(_ connection: Connection, report: @escaping @Sendable (ConnectionEvent) -> Void) {
        guard connection.url.hasLayer("reconnect") else { return }
        let events = connection.events()
        Task {
            for await event in events where event != .connected(generation: 1) { report(event) }
        }
    }

    /// `transportkit: disconnected: … (next attempt in 1 s)`.
    @Sendable static func reportOnStandardError(_ event: ConnectionEvent) {
        StandardError.write("transportkit: \(event)\n")
    }

    /// Says on standard error, on every use, that a TLS layer checks no certificate.
    static func warnIfInsecure(_ url: TransportURL) {
        var layer: TransportURL? = url
        while let current = layer {
            if current.scheme == "tls", let value = current.queryValue("insecure"), ["true", "1", "yes", "on", ""].contains(value.lowercased()),
               current.queryValue("pin") == nil {
                StandardError.write("transportkit: warning: \(current.inner == nil ? "insecure" : "tls.insecure")=true: the server's certificate is not checked; "
                                    + "anyone on the network path can read and change this connection\n")
            }
            layer = current.inner
        }
    }

    /// `url` with `restore=true` on a tty:// layer that does not say: the tool puts a port's line
    /// settings back when it closes it, also when a signal cuts a connect short and the
    /// registry closes what the connect made late (Signals waits for that). A `reconnect+` layer
    /// that does not say gets `reconnect.writeWait=86400`: what the tool relays waits for the
    /// connection to come back instead of ending the relay (unless `writesWait` is false: `term`
    /// drops keys typed while the device is away).
    static func restoring(_ text: String, writesWait: Bool = true) throws -> TransportURL {
        var url = try TransportURL(text)
        url.updateLayers { layer in
            if layer.scheme == "tty", layer.queryValue("restore") == nil { layer.query.append(("restore", "true")) }
            if writesWait, layer.scheme == "reconnect", layer.queryValue("writeWait") == nil { layer.query.append(("writeWait", "86400")) }
        }
        return url
    }
}

extension TransportURL {
    /// Whether this URL or one it wraps has the scheme `scheme`.
    func hasLayer(_ scheme: String) -> Bool {
        self.scheme == scheme || inner?.hasLayer(scheme) == true
    }

    /// Runs `body` on this layer and on every layer it wraps, outermost first, keeping the changes.
    mutating func updateLayers(_ body: (inout TransportURL) -> Void) {
        body(&self)
        if var inner {
            inner.updateLayers(body)
            self.inner = inner
        }
    }
}
