/// What a scheme accepts: its grammar, the meaning of host, port and path, and its options.
///
/// The registry validates every URL against its scheme's descriptor before the plugin sees it,
/// so a malformed URL fails before any I/O, with the grammar in the message.
///
/// ```swift
/// let echo = SchemeDescriptor(
///     scheme: "echo",
///     summary: "Echoes what is written",
///     grammar: "echo://[?delay=SECONDS]",
///     host: .forbidden, port: .forbidden, path: .forbidden,
///     options: [OptionSpec("delay", .duration, default: "0", help: "Delay before each echo")]
/// )
/// ```
public struct SchemeDescriptor: Sendable, Codable, Equatable {
    /// Whether a URL part must, may or must not be present.
    public enum Presence: String, Sendable, Codable {
        case required, optional, forbidden
    }

    public var scheme: String
    public var summary: String
    /// The URL grammar in one line, such as `tcp://HOST:PORT[?OPTIONS]`.
    public var grammar: String
    /// Working examples of the grammar.
    public var examples: [String]
    public var host: Presence
    public var port: Presence
    /// Accepted range of the port number (a TCP port, a bit rate, a PSM).
    public var portRange: ClosedRange<Int>?
    public var path: Presence
    /// Options the scheme accepts, besides the ones every scheme has (``OptionSpec/common``).
    public var options: [OptionSpec]
    /// `true` when the scheme can accept incoming connections (``TransportPlugin/listen(_:)``).
    public var canListen: Bool

    public init(scheme: String, summary: String, grammar: String, examples: [String] = [],
                host: Presence, port: Presence, portRange: ClosedRange<Int>? = nil, path: Presence,
                options: [OptionSpec] = [], canListen: Bool = false) {
        self.scheme = scheme.lowercased()
        self.summary = summary
        self.grammar = grammar
        self.examples = examples
        self.host = host
        self.port = port
        self.portRange = portRange
        self.path = path
        self.options = options
        self.canListen = canListen
    }

    /// The scheme's own options followed by the common ones.
    public var allOptions: [OptionSpec] { options + OptionSpec.common }

    /// A multi-line help text: grammar, options with type and default, examples.
    public var helpText: String {
        var lines = ["\(grammar)  \(summary)"]
        for option in allOptions {
            lines.append("  \(option.name) (\(option.kind.label)\(option.defaultValue.map { ", default \($0)" } ?? "")): \(option.help)")
        }
        if !examples.isEmpty { lines.append("  e.g. " + examples.joined(separator: ", ")) }
        return lines.joined(separator: "\n")
    }

    /// Checks `url` against this descriptor and returns its typed option values.
    public func validate(_ url: TransportURL) throws -> OptionValues {
        func reject(_ reason: String) -> TransportError {
            TransportError(.invalidURL, "invalid \(scheme) URL '\(url)': \(reason). Grammar: \(grammar)")
        }
        try check(url.host != nil, host, "a host", reject)
        try check(url.port != nil, port, "a port", reject)
        try check(!url.path.isEmpty && url.path != "/", path, "a path", reject)
        if let portValue = url.port, let portRange, !portRange.contains(portValue) {
            throw reject("the port \(portValue) is outside \(portRange.lowerBound)…\(portRange.upperBound)")
        }
        var values: [String: OptionValue] = [:]
        for item in url.query {
            guard let spec = allOptions.first(where: { $0.name.lowercased() == item.name.lowercased() }) else {
                let names = allOptions.map(\.name).joined(separator: ", ")
                throw reject("unknown option '\(item.name)' (\(scheme) accepts: \(names))")
            }
            do {
                values[spec.name] = try spec.kind.parse(item.value)
            } catch let problem as OptionKind.Problem {
                throw reject("option '\(spec.name)=\(item.value)': \(problem.reason)")
            }
        }
        for spec in allOptions where values[spec.name] == nil {
            if let defaultValue = spec.defaultValue {
                values[spec.name] = try? spec.kind.parse(defaultValue)
            }
        }
        return OptionValues(values)
    }

    private func check(_ present: Bool, _ presence: Presence, _ what: String,
                       _ reject: (String) -> TransportError) throws {
        switch (presence, present) {
        case (.required, false): throw reject("\(what) is required")
        case (.forbidden, true): throw reject("\(what) is not allowed here")
        default: break
        }
    }
}

/// One option a scheme accepts in its URL query.
public struct OptionSpec: Sendable, Codable, Equatable {
    public var name: String
    public var kind: OptionKind
    /// The default, written as it would appear in a URL; `nil` when the option is simply absent.
    public var defaultValue: String?
    public var help: String

    public init(_ name: String, _ kind: OptionKind, default defaultValue: String? = nil, help: String) {
        self.name = name
        self.kind = kind
        self.defaultValue = defaultValue
        self.help = help
    }

    /// Options every scheme accepts.
    public static let common: [OptionSpec] = [
        OptionSpec("timeout", .duration, default: "10",
                   help: "Seconds to wait for the connection to be established (0 waits forever)"),
    ]
}

/// The type of an option value, with its constraints.
public enum OptionKind: Sendable, Codable, Equatable {
    case bool
    case integer(min: Int, max: Int)
    case number(min: Double, max: Double)
    /// Seconds, fractions allowed, such as `2.5`.
    case duration
    case string
    case choice([String])

    struct Problem: Error { var reason: String }

    /// A short label for help texts.
    public var label: String {
        switch self {
        case .bool: "bool"
        case .integer(let min, let max): "integer \(min)…\(max)"
        case .number(let min, let max): "number \(min)…\(max)"
        case .duration: "seconds"
        case .string: "text"
        case .choice(let values): values.joined(separator: "|")
        }
    }

    func parse(_ text: String) throws -> OptionValue {
        switch self {
        case .bool:
            switch text.lowercased() {
            case "", "1", "true", "yes", "on": return .bool(true)
            case "0", "false", "no", "off": return .bool(false)
            default: throw Problem(reason: "expected true or false")
            }
        case .integer(let min, let max):
            guard let value = Int(text) else { throw Problem(reason: "expected an integer") }
            guard (min...max).contains(value) else { throw Problem(reason: "must be between \(min) and \(max)") }
            return .integer(value)
        case .number(let min, let max):
            guard let value = Double(text), value.isFinite else { throw Problem(reason: "expected a number") }
            guard (min...max).contains(value) else { throw Problem(reason: "must be between \(min) and \(max)") }
            return .number(value)
        case .duration:
            guard let value = Double(text), value.isFinite, value >= 0 else {
                throw Problem(reason: "expected a number of seconds, such as 2 or 0.5")
            }
            return .number(value)
        case .string:
            return .string(text)
        case .choice(let values):
            guard let match = values.first(where: { $0.lowercased() == text.lowercased() }) else {
                throw Problem(reason: "expected one of \(values.joined(separator: ", "))")
            }
            return .string(match)
        }
    }
}

/// A parsed option value.
public enum OptionValue: Sendable, Equatable {
    case bool(Bool)
    case integer(Int)
    case number(Double)
    case string(String)
}

/// The typed options of one URL: what the URL gave, completed with the declared defaults.
public struct OptionValues: Sendable, Equatable {
    public private(set) var values: [String: OptionValue]

    public init(_ values: [String: OptionValue] = [:]) { self.values = values }

    public func bool(_ name: String) -> Bool? {
        if case .bool(let value)? = values[name] { return value }
        return nil
    }

    public func int(_ name: String) -> Int? {
        if case .integer(let value)? = values[name] { return value }
        return nil
    }

    public func double(_ name: String) -> Double? {
        switch values[name] {
        case .number(let value)?: value
        case .integer(let value)?: Double(value)
        default: nil
        }
    }

    public func string(_ name: String) -> String? {
        if case .string(let value)? = values[name] { return value }
        return nil
    }

    /// A `.duration` option as a `Duration`; `0` means "no limit" and gives `nil`.
    public func duration(_ name: String) -> Duration? {
        guard let seconds = double(name), seconds > 0 else { return nil }
        return .nanoseconds(Int64((seconds * 1e9).rounded()))
    }
}
