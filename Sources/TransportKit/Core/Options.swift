/// One URL option, declared once: its name, type, range, default and help, and how its value
/// reads back in a plugin. Declare options as static constants, list them in the
/// ``SchemeDescriptor``, and read a request's value with the same constant.
///
/// ```swift
/// enum EchoOptions {
///     static let delay = URLOption.duration("delay", seconds: 0...60, default: 0, help: "Delay before each echo")
///     static let repeats = URLOption.integer("repeats", in: 1...10, default: 1, help: "Echoes per write")
///     static let prefix = URLOption.string("prefix", help: "Put in front of each echo")
/// }
/// // In the descriptor: options: [EchoOptions.delay, EchoOptions.repeats, EchoOptions.prefix]
/// // In connect:
/// let repeats: Int = request[EchoOptions.repeats]        // the URL's value, or 1
/// let prefix: String? = request[EchoOptions.prefix]      // nil when absent
/// ```
///
/// The registry checks every declaration when the plugin is registered (names, ranges, defaults
/// inside their range) and every value before the plugin runs, so a lookup cannot fail, and no
/// input can overflow a number: each numeric option has a range, checked before conversion.
@_spi(Plugins)
public struct URLOption<Value: Sendable>: OptionDeclaration {
    /// The option's name, kind, range, default and help, as declared.
    public let spec: OptionSpec
    private let read: @Sendable (OptionValue?) -> Value

    private init(_ spec: OptionSpec, read: @escaping @Sendable (OptionValue?) -> Value) {
        self.spec = spec
        self.read = read
    }

    /// The value in `values` (validated, defaults filled in).
    func value(in values: OptionValues) -> Value {
        read(values.raw[spec.key])
    }

    /// The same option, also accepted under `names`, the names it had before a rename, so URLs
    /// written for an earlier release keep working. A URL that gives both a former name and the
    /// current one is refused; `transportkit schemes` shows the former names.
    ///
    /// ```swift
    /// static let receiveMTU = URLOption.integer("receiveMTU", in: 23...65535, help: "The receive MTU to offer").formerly("mtu")
    /// ```
    public func formerly(_ names: String...) -> URLOption<Value> {
        var spec = spec
        spec.formerNames += names
        return URLOption(spec, read: read)
    }
}

/// An option declaration seen without its value type, as a ``SchemeDescriptor`` lists it.
@_spi(Plugins)
public protocol OptionDeclaration: Sendable {
    /// What the option accepts, as the registry validates it and `transportkit schemes` prints it.
    var spec: OptionSpec { get }
}

@_spi(Plugins)
extension OptionSpec: OptionDeclaration {
    /// The spec itself, so a bare spec can be listed among a descriptor's options.
    public var spec: OptionSpec { self }
}

extension URLOption where Value == Bool {
    /// A boolean with a default: `?name`, `name=true/false/1/0/yes/no/on/off`.
    public static func bool(_ name: String, default defaultValue: Bool, help: String) -> URLOption<Bool> {
        URLOption(OptionSpec(name, .bool, default: String(defaultValue), help: help)) { value in
            if case .bool(let value)? = value { value } else { defaultValue }
        }
    }
}

extension URLOption where Value == Bool? {
    /// A boolean that may be absent (`nil`: leave things as they are).
    public static func bool(_ name: String, help: String) -> URLOption<Bool?> {
        URLOption(OptionSpec(name, .bool, help: help)) { value in
            if case .bool(let value)? = value { value } else { nil }
        }
    }
}

extension URLOption where Value == Int {
    /// An integer in `range` with a default.
    public static func integer(_ name: String, in range: ClosedRange<Int>, default defaultValue: Int, help: String) -> URLOption<Int> {
        URLOption(OptionSpec(name, .integer(min: range.lowerBound, max: range.upperBound), default: String(defaultValue), help: help)) { value in
            if case .integer(let value)? = value { value } else { defaultValue }
        }
    }
}

extension URLOption where Value == Int? {
    /// An integer in `range` that may be absent.
    public static func integer(_ name: String, in range: ClosedRange<Int>, help: String) -> URLOption<Int?> {
        URLOption(OptionSpec(name, .integer(min: range.lowerBound, max: range.upperBound), help: help)) { value in
            if case .integer(let value)? = value { value } else { nil }
        }
    }
}

extension URLOption where Value == Duration {
    /// A number of seconds in `seconds` (fractions allowed) with a default.
    public static func duration(_ name: String, seconds range: ClosedRange<Double>, default defaultValue: Double, help: String) -> URLOption<Duration> {
        URLOption(OptionSpec(name, .duration(min: range.lowerBound, max: range.upperBound), default: defaultValue.exactText, help: help)) { value in
            .seconds(value?.number ?? defaultValue)
        }
    }
}

extension URLOption where Value == Duration? {
    /// A number of seconds in `seconds` that may be absent.
    public static func duration(_ name: String, seconds range: ClosedRange<Double>, help: String) -> URLOption<Duration?> {
        URLOption(OptionSpec(name, .duration(min: range.lowerBound, max: range.upperBound), help: help)) { value in
            value?.number.map { .seconds($0) }
        }
    }

    /// A time limit in `seconds` with a default, where `0` means "no limit" and reads as `nil`.
    public static func timeLimit(_ name: String, seconds range: ClosedRange<Double>, default defaultValue: Double, help: String) -> URLOption<Duration?> {
        URLOption(OptionSpec(name, .duration(min: range.lowerBound, max: range.upperBound), default: defaultValue.exactText, help: help)) { value in
            let seconds = value?.number ?? defaultValue
            return seconds > 0 ? .seconds(seconds) : nil
        }
    }
}

extension URLOption where Value == Double {
    /// A number in `range` (decimal, exponent allowed) with a default.
    public static func number(_ name: String, in range: ClosedRange<Double>, default defaultValue: Double, help: String) -> URLOption<Double> {
        URLOption(OptionSpec(name, .number(min: range.lowerBound, max: range.upperBound), default: defaultValue.exactText, help: help)) { value in
            value?.number ?? defaultValue
        }
    }
}

extension URLOption where Value == Double? {
    /// A number in `range` that may be absent.
    public static func number(_ name: String, in range: ClosedRange<Double>, help: String) -> URLOption<Double?> {
        URLOption(OptionSpec(name, .number(min: range.lowerBound, max: range.upperBound), help: help)) { value in
            value?.number
        }
    }
}

extension URLOption where Value == String {
    /// Text with a default.
    public static func string(_ name: String, default defaultValue: String, help: String) -> URLOption<String> {
        URLOption(OptionSpec(name, .string, default: defaultValue, help: help)) { value in
            if case .string(let value)? = value { value } else { defaultValue }
        }
    }
}

extension URLOption where Value == String? {
    /// Text that may be absent.
    public static func string(_ name: String, help: String) -> URLOption<String?> {
        URLOption(OptionSpec(name, .string, help: help)) { value in
            if case .string(let value)? = value { value } else { nil }
        }
    }
}

extension URLOption where Value: CaseIterable & RawRepresentable, Value.RawValue == String {
    /// One of the cases of `Value`, by raw value (case-insensitive), with a default.
    ///
    /// ```swift
    /// enum Parity: String, CaseIterable, Sendable { case none, even, odd }
    /// static let parity = URLOption.choice("parity", default: Parity.none, help: "Parity bit")
    /// ```
    public static func choice(_ name: String, default defaultValue: Value, help: String) -> URLOption<Value> {
        URLOption(OptionSpec(name, .choice(Value.allCases.map(\.rawValue)), default: defaultValue.rawValue, help: help)) { value in
            if case .string(let text)? = value, let choice = Value(rawValue: text) { choice } else { defaultValue }
        }
    }
}

/// What one option accepts, without its value type: the declaration as the registry validates it,
/// `transportkit schemes` prints it and JSON carries it. Plugins make these through ``URLOption``.
public struct OptionSpec: Sendable, Codable, Equatable {
    /// The option's name as written in URLs (matched case-insensitively).
    public var name: String
    /// The value's type and range.
    public var kind: OptionKind
    /// The default, written as it would appear in a URL; `nil` when the option is simply absent.
    public var defaultValue: String?
    /// One sentence for `transportkit schemes`.
    public var help: String
    /// Names the option had before a rename, still accepted in URLs (``URLOption/formerly(_:)``).
    public var formerNames: [String]

    /// A declaration; prefer the typed constructors of ``URLOption``, which keep the default typed.
    public init(_ name: String, _ kind: OptionKind, default defaultValue: String? = nil, help: String, formerNames: [String] = []) {
        self.name = name
        self.kind = kind
        self.defaultValue = defaultValue
        self.help = help
        self.formerNames = formerNames
    }

    private enum CodingKeys: String, CodingKey {
        case name, kind, defaultValue, help, formerNames
    }

    /// Reads a spec; `formerNames` may be absent (JSON written before it existed).
    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        self.init(try container.decode(String.self, forKey: .name), try container.decode(OptionKind.self, forKey: .kind),
                  default: try container.decodeIfPresent(String.self, forKey: .defaultValue),
                  help: try container.decode(String.self, forKey: .help),
                  formerNames: try container.decodeIfPresent([String].self, forKey: .formerNames) ?? [])
    }

    /// The name as values are stored: options are matched case-insensitively.
    var key: String { name.lowercased() }

    /// Whether a URL's query item `name` sets this option: its name or a former one, in any case.
    func isNamed(_ name: String) -> Bool {
        URLParser.sameName(self.name, name) || formerNames.contains { URLParser.sameName($0, name) }
    }

    /// Options every scheme accepts (wrappers excepted: their deadline is the wrapped URL's).
    /// `timeout`: seconds the whole connect may take, 0…31536000, default 10; `0` waits forever.
    @_spi(Plugins) public static let timeout = URLOption.timeLimit("timeout", seconds: 0...86_400 * 365, default: 10,
                                                                   help: "Seconds to wait for the connection to be established (0 waits forever)")
    /// The options every scheme but a wrapper accepts.
    public static let common: [OptionSpec] = [timeout.spec]

    /// Problems with this declaration: a malformed name, an empty or inverted range, a default the
    /// option would itself refuse.
    func declarationProblems() -> [String] {
        var problems: [String] = []
        for candidate in [name] + formerNames where !Self.isValidName(candidate) {
            problems.append("the option name '\(candidate)' must start with a letter and contain only letters and digits")
        }
        switch kind {
        case .integer(let min, let max) where min > max:
            problems.append("option '\(name)' has the empty range \(min)…\(max)")
        case .number(let min, let max), .duration(let min, let max):
            if !(min.isFinite && max.isFinite && min <= max) {
                problems.append("option '\(name)' needs a finite range with min <= max (got \(min)…\(max))")
            } else if case .duration = kind, min < 0 || max > OptionKind.longestDuration {
                problems.append("option '\(name)' allows \(min.formatted3)…\(max.formatted3) seconds; durations must lie within 0…\(OptionKind.longestDuration.formatted3)")
            }
        case .choice(let values) where values.isEmpty:
            problems.append("option '\(name)' offers no choice")
        default:
            break
        }
        if let defaultValue {
            do {
                _ = try kind.parse(defaultValue)
            } catch let problem as OptionKind.Problem {
                problems.append("option '\(name)' has the default '\(defaultValue)', which it refuses: \(problem.reason)")
            } catch {
                problems.append("option '\(name)' has an unreadable default '\(defaultValue)'")
            }
        }
        return problems
    }

    /// A letter, then letters and digits: no '.', which marks a wrapper's options (`spy.format`).
    static func isValidName(_ name: String) -> Bool {
        guard let first = name.unicodeScalars.first, first.isASCIILetter else { return false }
        return name.unicodeScalars.allSatisfy { $0.isASCIILetter || ("0"..."9").contains($0) }
    }
}

/// The type of an option value, with its constraints.
public enum OptionKind: Sendable, Codable, Equatable {
    /// `true/false/1/0/yes/no/on/off`; a bare `?name` is true.
    case bool
    /// Decimal digits within `min…max`.
    case integer(min: Int, max: Int)
    /// A decimal number within `min…max`.
    case number(min: Double, max: Double)
    /// Seconds, fractions allowed, such as `2.5`, within `min…max`.
    case duration(min: Double, max: Double)
    /// Any text.
    case string
    /// One of these words (case-insensitive).
    case choice([String])

    /// The longest duration an option may allow: a hundred years, far inside what `Duration` holds.
    static let longestDuration: Double = 100 * 365 * 86_400

    struct Problem: Error { var reason: String }

    /// A short label for help texts.
    public var label: String {
        switch self {
        case .bool: "bool"
        case .integer(let min, let max): "integer \(min)…\(max)"
        case .number(let min, let max): "number \(min.formatted3)…\(max.formatted3)"
        case .duration(let min, let max): "seconds \(min.formatted3)…\(max.formatted3)"
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
            // Digits only (an optional leading '-'): no '+', no spaces. Int() refuses overflow.
            let digits = text.utf8.first == UInt8(ascii: "-") ? text.utf8.dropFirst() : text.utf8[...]
            guard !digits.isEmpty, digits.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }), let value = Int(text) else {
                throw Problem(reason: "expected an integer between \(min) and \(max)")
            }
            guard (min...max).contains(value) else { throw Problem(reason: "\(URLParser.printable(text, limit: 40)) is outside \(min)…\(max)") }
            return .integer(value)
        case .number(let min, let max), .duration(let min, let max):
            let unit = if case .duration = self { " seconds" } else { "" }
            // Decimal notation, exponent allowed; no hexadecimal ('0x10'), no 'inf' or 'nan'.
            guard !text.isEmpty, text.utf8.allSatisfy({ ($0 >= 0x30 && $0 <= 0x39) || $0 == 0x2E || $0 == 0x2D || $0 == 0x2B || $0 | 0x20 == 0x65 }),
                  let value = Double(text), value.isFinite else {
                throw Problem(reason: "expected a number of\(unit.isEmpty ? "" : unit) between \(min.formatted3) and \(max.formatted3), such as 2 or 0.5")
            }
            guard value >= min && value <= max else {
                throw Problem(reason: "\(URLParser.printable(text, limit: 40)) is outside \(min.formatted3)…\(max.formatted3)\(unit)")
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
    /// A boolean option's value.
    case bool(Bool)
    /// An integer option's value.
    case integer(Int)
    /// A number's or a duration's value (seconds).
    case number(Double)
    /// A text's or a choice's value.
    case string(String)

    var number: Double? {
        switch self {
        case .number(let value): value
        case .integer(let value): Double(value)
        default: nil
        }
    }
}

/// The typed options of one URL: what the URL gave, completed with the declared defaults. Read a
/// value with the ``URLOption`` that declared it.
///
/// ```swift
/// let noDelay: Bool = request.options[SocketsPlugin.noDelay]
/// ```
@_spi(Plugins)
public struct OptionValues: Sendable, Equatable {
    /// Values by lower-cased option name.
    let raw: [String: OptionValue]
    /// Records which options were read (shared by the copies of one request's values).
    let use: OptionUse

    init(_ raw: [String: OptionValue] = [:], use: OptionUse = OptionUse()) {
        self.raw = raw
        self.use = use
    }

    /// The value of `option`: the URL's, else its default (or `nil` for an option without one).
    public subscript<Value>(_ option: URLOption<Value>) -> Value {
        use.record(option.spec.key)
        return option.value(in: self)
    }

    /// Two sets of values are equal when they hold the same values (what was read is not compared).
    public static func == (lhs: OptionValues, rhs: OptionValues) -> Bool {
        lhs.raw == rhs.raw
    }
}

extension Duration {
    /// "1.5 s", for messages.
    @_spi(Plugins) public var secondsText: String {
        let (seconds, attoseconds) = components
        let value = Double(seconds) + Double(attoseconds) / 1e18
        return "\(value.formatted3) s"
    }

    /// Whole milliseconds (rounded down), for the C and D-Bus APIs that count in them.
    @_spi(Plugins) public var wholeMilliseconds: Int64 {
        components.seconds * 1000 + components.attoseconds / 1_000_000_000_000_000
    }
}

extension Double {
    /// The value written so that it parses back to itself, without a trailing ".0": "10", "0.0005".
    var exactText: String {
        guard self == rounded(), abs(self) < 1e15 else { return String(self) }
        return String(Int64(self))
    }

    /// Up to three decimals, without a trailing ".0": "2", "0.25", "31536000".
    var formatted3: String {
        let rounded = (self * 1000).rounded() / 1000
        guard rounded == rounded.rounded(), abs(rounded) < 1e15 else { return String(rounded) }
        return String(Int64(rounded))
    }
}
