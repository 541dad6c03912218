import ArgumentParser
import Foundation
import Logging
import TransportKit

@main
struct TransportKitCLI: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "transportkit",
        abstract: "Connect to devices and peers by URL: tcp://, unix://, tty://, pty://, loop://, spy+URL, …",
        discussion: "Run 'transportkit schemes' for every URL form and its options. spy+URL traces a connection on standard error.",
        subcommands: [Schemes.self, List.self, Watch.self, Connect.self, Bridge.self]
    )
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
        guard let level = levelName.flatMap(Logger.Level.init(rawValue:)) else { return }
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
    FileHandle.standardError.write(Data("transportkit: \(message)\n".utf8))
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
    var options: [Option]

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
        // A wrapper's options are written with its prefix (spy.format).
        let prefix = descriptor.wraps ? descriptor.scheme + "." : ""
        options = descriptor.allOptions.map { Option(name: prefix + $0.name, type: $0.kind.label, default: $0.defaultValue, help: $0.help) }
    }
}

struct Connect: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Relay standard input to a connection and the connection to standard output.",
        discussion: """
            Bytes pass untouched. At the end of standard input the connection is half-closed where \
            the transport allows, and inbound bytes are still copied until the peer closes or \
            --linger seconds pass. Exits 0 then; on failure prints the error and exits 1.
            """
    )

    @Argument(help: "The URL to connect to, such as tcp://127.0.0.1:4000.")
    var url: String

    @Option(help: "Seconds to keep copying inbound bytes after standard input ends.")
    var linger: Double = 0.5

    @OptionGroup var logging: LoggingOptions

    func run() async throws {
        logging.bootstrap()
        do {
            let connection = try await Transport.connect(to: url)
            try await Relay.pump(
                from: StandardInput(), to: connection,
                inbound: { try await StandardOutput.copy(from: connection) },
                linger: .milliseconds(Int64(max(0, linger) * 1000))
            )
        } catch {
            throw fail(error)
        }
    }
}

struct Bridge: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Relay both ways between two URLs until either side closes.",
        discussion: """
            Give two endpoints in all: URLs to connect to as arguments, URLs to listen on with \
            --listen (a listening side accepts one connection before relaying starts). Example, \
            sharing a device over the network: transportkit bridge --listen tcp://0.0.0.0:2000 loop://
            Status lines ("listening on …", "accepted …") go to standard error; with --json as one \
            JSON object per line.
            """
    )

    @Option(help: "A URL to listen on; accepts one connection. May be given twice.")
    var listen: [String] = []

    @Argument(help: "URLs to connect to.")
    var urls: [String] = []

    @Option(help: "Seconds to keep relaying the other direction after one side ends.")
    var linger: Double = 0.5

    @Flag(help: "Print status lines as JSON objects.")
    var json = false

    @OptionGroup var logging: LoggingOptions

    func validate() throws {
        guard listen.count + urls.count == 2 else {
            throw ValidationError("a bridge has two endpoints: give two URLs, or one URL and --listen URL, or --listen twice")
        }
    }

    func run() async throws {
        logging.bootstrap()
        do {
            let accepted = try await withThrowingTaskGroup(of: Connection.self) { group in
                for url in listen {
                    group.addTask { try await acceptOne(on: url) }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            var connections = accepted
            for url in urls { connections.append(try await Transport.connect(to: url)) }
            try await Relay.bridge(connections[0], connections[1], linger: .milliseconds(Int64(max(0, linger) * 1000)))
        } catch {
            throw fail(error)
        }
    }

    private func acceptOne(on url: String) async throws -> Connection {
        let listener = try await Transport.listen(on: url)
        status(["event": "listening", "url": listener.url.description])
        defer { Task { try? await listener.close() } }
        guard let connection = try await listener.accept() else {
            throw TransportError(.disconnected, "the listener on \(listener.url) closed before a connection arrived")
        }
        status(["event": "accepted", "url": connection.url.description, "listener": listener.url.description])
        return connection
    }

    private func status(_ fields: [String: String]) {
        let line: String
        if json, let data = try? JSONSerialization.data(withJSONObject: fields, options: [.sortedKeys]) {
            line = String(decoding: data, as: UTF8.self)
        } else {
            line = fields["event", default: ""] + " " + fields["url", default: ""]
        }
        FileHandle.standardError.write(Data((line + "\n").utf8))
    }
}
