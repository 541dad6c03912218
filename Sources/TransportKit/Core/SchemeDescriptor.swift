/// What a scheme accepts: its grammar, the meaning of host, port and path, and its options.
///
/// The registry checks the descriptor when its plugin is registered, and validates every URL
/// against it before the plugin sees it, so a malformed URL fails before any I/O, with the grammar
/// in the message.
///
/// ```swift
/// let echo = SchemeDescriptor(
///     scheme: "echo",
///     summary: "Echoes what is written",
///     grammar: "echo://[?delay=SECONDS]",
///     host: .forbidden, port: .forbidden, path: .forbidden,
///     options: [URLOption.duration("delay", seconds: 0...60, default: 0, help: "Delay before each echo")]
/// )
/// ```
public struct SchemeDescriptor: Sendable, Codable, Equatable {
    /// Whether a URL part must, may or must not be present.
    public enum Presence: String, Sendable, Codable {
        /// `required`: the URL must have the part; `optional`: it may; `forbidden`: it must not.
        case required, optional, forbidden
    }

    /// How the part between `//` and the path reads.
    public enum AuthorityForm: String, Sendable, Codable {
        /// `HOST[:PORT]`, the port decimal (a Bluetooth address is a host too).
        case hostPort
        /// `VID:PID`, a USB device's vendor and product id as four hexadecimal digits each
        /// (``TransportURL/usbDeviceID``). Required.
        case usbDevice
    }

    /// The scheme's name, lower case, such as `tcp`.
    public var scheme: String
    /// What the scheme is, in one sentence, for `transportkit schemes`.
    public var summary: String
    /// The URL grammar in one line, such as `tcp://HOST:PORT[?OPTIONS]`.
    public var grammar: String
    /// Working examples of the grammar.
    public var examples: [String]
    /// How the part between `//` and the path reads.
    public var authority: AuthorityForm
    /// Whether a host is required, optional or forbidden.
    public var host: Presence
    /// Whether a port is required, optional or forbidden.
    public var port: Presence
    /// Accepted range of the port number (a TCP port, a bit rate, a PSM).
    public var portRange: ClosedRange<Int>?
    /// Whether a path is required, optional or forbidden (`/` alone counts as none).
    public var path: Presence
    /// Options the scheme accepts, besides the ones every scheme has (``OptionSpec/common``).
    public var options: [OptionSpec]
    /// `true` when the scheme can accept incoming connections (it has a listen handler).
    public internal(set) var canListen: Bool = false
    /// `true` for a wrapper layer, such as `spy`: its URLs wrap another (`spy+tcp://…`), carry no
    /// host, port or path of their own, and take their deadline from the wrapped URL.
    public internal(set) var wraps: Bool = false
    /// `true` when a URL of this scheme names something only one connection can use at a time
    /// (a serial port): a server that fronts it serves one client at a time, where a target that
    /// can be opened many times (tcp, unix) gets a connection per client.
    public var exclusive: Bool = false
    /// `true` when a URL of this scheme reaches a device that can go away and come back: a serial
    /// port, a USB or Bluetooth device, a serial port on another machine. `transportkit term`
    /// connects again (`reconnect+`) to such a URL by default, as tio does for a serial port.
    public var reachesDevice: Bool = false
    /// `true` for a scheme whose URL names a resource on a server (ws://, http://): query items
    /// it does not declare belong to the server and reach it unchanged
    /// (``ConnectRequest/serverQuery``), where another scheme refuses them as unknown. A declared
    /// name is always the scheme's own option and is never sent; `server.NAME=VALUE` sends
    /// `NAME=VALUE` to the server when NAME is also one of the scheme's options.
    public var serverQuery: Bool = false
    /// `true` for a scheme that runs its protocol over a TCP channel and takes layers beneath its
    /// own (`ConnectRequest.layersBeneath`, SPI): a `tls+` wrapper around it then runs TLS under the
    /// protocol (`tls+rfc2217://`: RFC 2217 over TLS), where around any other URL it runs TLS
    /// over that URL's bytes.
    public var layersBeneath: Bool = false
    /// The registry's key: the name, with a `+` for a wrapper (a wrapper and a plain scheme may
    /// share a name).
    var tableKey: String { wraps ? scheme + "+" : scheme }
    /// The ways the scheme's URLs are used and the options each uses (see ``SchemeMode``). Empty:
    /// one connect mode, and a listen mode when the scheme can listen, each using every option.
    public var modes: [SchemeMode] = []

    /// A descriptor. `options` are the ``URLOption`` constants the plugin reads values with;
    /// `modes` say which of them each way of using the scheme reads (empty: all of them).
    @_spi(Plugins)
    public init(scheme: String, summary: String, grammar: String, examples: [String] = [], authority: AuthorityForm = .hostPort,
                host: Presence, port: Presence, portRange: ClosedRange<Int>? = nil, path: Presence,
                options: [any OptionDeclaration] = [], modes: [SchemeMode] = [], exclusive: Bool = false,
                reachesDevice: Bool = false) {
        self.exclusive = exclusive
        self.reachesDevice = reachesDevice
        self.modes = modes
        self.scheme = scheme.lowercased()
        self.summary = summary
        self.grammar = grammar
        self.examples = examples
        self.authority = authority
        self.host = host
        self.port = port
        self.portRange = portRange
        self.path = path
        self.options = options.map(\.spec)
    }

    /// The scheme's own options followed by the common ones (wrappers have no common option).
    public var allOptions: [OptionSpec] { wraps ? options : options + OptionSpec.common }

    /// ``modes``, or when none are declared the implicit ones: connect with every option, and
    /// listen with every option when the scheme can listen.
    public var effectiveModes: [SchemeMode] {
        guard modes.isEmpty else { return modes }
        var implicit = [SchemeMode("\(scheme):// connection", form: grammar, options: options)]
        if canListen { implicit.append(SchemeMode("\(scheme):// listener", role: .listen, form: grammar, options: options)) }
        return implicit
    }

    /// The mode that serves `url` in `role`: the first whose selectors fit; `nil` when none does
    /// (the plugin's handler then refuses the URL with its own words).
    public func mode(for url: TransportURL, role: SchemeMode.Role) -> SchemeMode? {
        effectiveModes.first { $0.serves(url, as: role) }
    }

    /// The options `mode` takes: its own, and the common ones for a connect mode.
    ///
    /// ```swift
    /// let names = descriptor.options(of: descriptor.effectiveModes[0]).map(\.name)
    /// ```
    public func options(of mode: SchemeMode) -> [OptionSpec] {
        let own = options.filter { spec in mode.options.contains { URLParser.sameName($0, spec.name) } }
        return own + (mode.role == .connect && !wraps ? OptionSpec.common : [])
    }

    /// A multi-line help text: grammar, options with type and default, examples.
    public var helpText: String {
        var lines = ["\(grammar)  \(summary)"]
        for option in allOptions {
            let former = option.formerNames.isEmpty ? "" : "; formerly " + option.formerNames.map { (wraps ? scheme + "." : "") + $0 }.joined(separator: ", ")
            lines.append("  \(wraps ? scheme + "." : "")\(option.name) (\(option.kind.label)\(option.defaultValue.map { ", default \($0)" } ?? "")\(former)): \(option.help)")
        }
        if !modes.isEmpty {
            for mode in modes {
                let names = options(of: mode).map { (wraps ? scheme + "." : "") + $0.name }
                lines.append("  \(mode.role == .listen ? "listening" : "connecting"), \(mode.form): \(names.isEmpty ? "no options" : names.joined(separator: ", "))")
            }
        }
        if !examples.isEmpty { lines.append("  e.g. " + examples.joined(separator: ", ")) }
        return lines.joined(separator: "\n")
    }

    /// What is wrong with this declaration, if anything: the scheme name, option names (valid and
    /// unique, common ones included), ranges, and defaults the options would themselves refuse.
    /// The registry refuses to register a plugin whose descriptor has problems.
    public func declarationProblems() -> [String] {
        var problems: [String] = []
        if !URLParser.isSchemeName(scheme) {
            problems.append("'\(scheme)' is not a valid scheme name: a letter, then letters, digits, '-' and '.' ('+' joins wrapper layers)")
        } else if wraps && scheme.contains(".") {
            problems.append("the wrapper '\(scheme)' has a '.' in its name: its options (\(scheme).NAME) would be ambiguous")
        }
        if let portRange, portRange.lowerBound < 0 {
            problems.append("the port range \(portRange.lowerBound)…\(portRange.upperBound) starts below 0")
        }
        var seen = Set<String>()
        for option in allOptions {
            problems += option.declarationProblems()
            for name in [option.name] + option.formerNames where !seen.insert(name.lowercased()).inserted {
                problems.append("the option '\(name)' is declared twice (names, former names included, are case-insensitive; 'timeout' is common to every scheme)")
            }
        }
        for mode in modes {
            for name in mode.options where !options.contains(where: { URLParser.sameName($0.name, name) }) {
                problems.append("the mode '\(mode.name)' uses the option '\(name)', which the scheme does not declare")
            }
            if let selector = mode.selectedBy {
                let spec = options.first { URLParser.sameName($0.name, selector) }
                if spec?.formerNames.isEmpty == false {
                    // A mode is picked by the URL's item of that exact name (SchemeMode.serves).
                    problems.append("the mode '\(mode.name)' is selected by '\(selector)', which has former names: a selector keeps one name")
                }
                if spec?.kind != .bool {
                    problems.append("the mode '\(mode.name)' is selected by '\(selector)', which is not a boolean option of the scheme")
                } else if spec?.defaultValue == "true" {
                    // The URL would pick another mode while the plugin reads true.
                    problems.append("the mode '\(mode.name)' is selected by '\(selector)', whose default is true: a selector must default to false")
                }
                let before = modes.prefix { $0 != mode }
                if before.contains(where: { $0.role == mode.role && $0.port == nil && $0.host == nil && $0.selectedBy == nil }) {
                    problems.append("the mode '\(mode.name)' comes after a \(mode.role.rawValue) mode without selectors, which takes every URL first: "
                                    + "declare it before that one")
                }
                if !mode.options.contains(where: { URLParser.sameName($0, selector) }) {
                    problems.append("the mode '\(mode.name)' is selected by '\(selector)' but does not list it among its options")
                }
            }
            if modes.contains(where: { $0 != mode && $0.name == mode.name && $0.role == mode.role }) {
                problems.append("the mode '\(mode.name)' is declared twice")
            }
        }
        if !modes.isEmpty {
            for option in options where !modes.contains(where: { $0.options.contains { URLParser.sameName($0, option.name) } }) {
                problems.append("the option '\(option.name)' is used by none of the modes: declare it in the modes that read it, or drop it")
            }
        }
        return problems.map { "\(scheme)://: \($0)" }
    }

    /// Checks `url` against this descriptor for `role` and returns its typed option values. An
    /// option the URL's mode does not use is refused with the mode's name.
    ///
    /// ```swift
    /// let values = try descriptor.validate(TransportURL("echo://?delay=0.5"))
    /// ```
    @_spi(Plugins)
    public func validate(_ url: TransportURL, role: SchemeMode.Role = .connect) throws -> OptionValues {
        func reject(_ reason: String) -> TransportError {
            TransportError(.invalidURL, "invalid \(scheme) URL '\(URLParser.printable(url.description))': \(reason). Grammar: \(grammar)")
        }
        if wraps {
            guard url.inner != nil else {
                throw reject("\(scheme) wraps another URL; write it in front of one, as \(scheme)+tcp://127.0.0.1:4000")
            }
        } else if let inner = url.inner {
            throw reject("\(scheme):// does not wrap other URLs (\(inner.scheme)://…); only wrapper schemes go in front of a '+'")
        }
        switch authority {
        case .hostPort:
            try check(url.host != nil, host, "a host", reject)
            try check(url.portText != nil, port, "a port", reject)
            if let portText = url.portText {
                let digits = !portText.isEmpty && portText.utf8.allSatisfy { $0 >= 0x30 && $0 <= 0x39 }
                guard let portValue = url.port else {
                    if digits, let portRange {
                        // Too many digits to be read as a number at all: out of range, not malformed.
                        throw reject("the port \(URLParser.printable(portText, limit: 40)) is outside \(portRange.lowerBound)…\(portRange.upperBound)")
                    }
                    throw reject("the port '\(URLParser.printable(portText, limit: 40))' must be a decimal number")
                }
                if let portRange, !portRange.contains(portValue) {
                    throw reject("the port \(portValue) is outside \(portRange.lowerBound)…\(portRange.upperBound)")
                }
            }
        case .usbDevice:
            guard url.usbDeviceID != nil else {
                throw reject("expected VID:PID, the vendor and product id as four hexadecimal digits each, such as \(scheme)://0403:6001 (`lsusb` or `transportkit list` shows them)")
            }
        }
        try check(!url.path.isEmpty && url.path != "/", path, "a path", reject)
        var values: [String: OptionValue] = [:]
        let mode = mode(for: url, role: role)
        let prefix = wraps ? scheme + "." : ""
        for item in url.query {
            guard let spec = allOptions.first(where: { $0.isNamed(item.name) }) else {
                if serverQuery { continue }
                let names = allOptions.map { prefix + $0.name }.joined(separator: ", ")
                let guess = Self.likelyMeant(item.name, among: allOptions.map(\.name)).map { "; did you mean '\(prefix)\($0)'?" } ?? ""
                throw reject("unknown option '\(prefix)\(URLParser.printable(item.name, limit: 40))'\(guess) (\(scheme) accepts: \(names.isEmpty ? "none" : names))")
            }
            if let mode, !options(of: mode).contains(where: { $0.key == spec.key }) {
                let users = effectiveModes.filter { options(of: $0).contains { $0.key == spec.key } }.map(\.phrase)
                throw reject("option '\(prefix)\(URLParser.printable(item.name, limit: 40))' is not used by this mode, \(mode.phrase), so it is refused rather than ignored"
                             + (users.isEmpty ? "" : "; it applies to: \(users.joined(separator: "; "))"))
            }
            if values[spec.key] != nil {
                // Only a former name and the current one can meet here: a name given twice is refused when the URL is read.
                throw reject("option '\(prefix)\(spec.name)' is given twice, under its name and its former name "
                             + "\(spec.formerNames.map { "'" + prefix + $0 + "'" }.joined(separator: " or ")); keep only '\(prefix)\(spec.name)'")
            }
            do {
                values[spec.key] = try spec.kind.parse(item.value)
            } catch let problem as OptionKind.Problem {
                throw reject("option '\(prefix)\(URLParser.printable(item.name, limit: 40))=\(URLParser.printable(item.value, limit: 40))': \(problem.reason)")
            }
        }
        for spec in allOptions where values[spec.key] == nil {
            // Declarations were checked at registration, so a default always parses.
            if let defaultValue = spec.defaultValue, let value = try? spec.kind.parse(defaultValue) {
                values[spec.key] = value
            }
        }
        return OptionValues(values)
    }

    /// The query items of `url` that go to the server (``serverQuery``): the undeclared ones, in
    /// order, with `server.NAME` written as `NAME`. Empty for other schemes.
    public func serverQueryItems(of url: TransportURL) -> [(name: String, value: String)] {
        guard serverQuery else { return [] }
        return url.query.compactMap { item in
            if allOptions.contains(where: { $0.isNamed(item.name) }) { return nil }
            if item.name.lowercased().hasPrefix("server."), item.name.utf8.count > 7 {
                return (String(item.name.dropFirst(7)), item.value)
            }
            return item
        }
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

extension SchemeDescriptor {
    /// The option a misspelt `name` most likely meant: one whose name starts the other's, letter
    /// case aside (`baudRate` for `baud`, `dtrOn` for `dtr`), or one at most two edits away
    /// (`parit` for `parity`); `nil` when none or more than one fits equally.
    static func likelyMeant(_ name: String, among names: [String]) -> String? {
        let typed = Array(name.lowercased())
        guard typed.count >= 3 else { return nil }
        var best: (name: String, distance: Int)?
        var tie = false
        for candidate in names {
            let known = Array(candidate.lowercased())
            let distance: Int
            if known.count >= 3 && (typed.starts(with: known) || known.starts(with: typed)) {
                distance = 0
            } else {
                distance = editDistance(typed, known)
            }
            guard distance <= 2 else { continue }
            if let current = best, current.distance < distance { continue }
            tie = best?.distance == distance
            best = (candidate, distance)
        }
        return tie ? nil : best?.name
    }

    /// Levenshtein distance: insertions, deletions and substitutions.
    private static func editDistance(_ a: [Character], _ b: [Character]) -> Int {
        var previous = Array(0...b.count)
        for (i, left) in a.enumerated() {
            var current = [i + 1]
            for (j, right) in b.enumerated() {
                current.append(Swift.min(previous[j + 1] + 1, current[j] + 1, previous[j] + (left == right ? 0 : 1)))
            }
            previous = current
        }
        return previous[b.count]
    }
}
