/// A transport URL, parsed once, here, for every scheme.
///
/// The grammar is `scheme://[host][:port][/path][?name=value&name2…]`, with extensions that the
/// schemes of this field need and RFC 3986 parsers reject:
/// - a Bluetooth address as host: `rfcomm://00:0a:3a:22:68:73` (host = MAC), and
///   `rfcomm://00:0a:3a:22:68:73:3` (port = channel 3);
/// - IPv6 literals in brackets: `tcp://[::1]:4000` (host = `::1`), with a zone as RFC 6874 writes
///   it, `%25` then the zone: `tcp://[fe80::1%25eth0]:4000` (host = `fe80::1%eth0`); a bare `%`
///   before the zone (`[fe80::1%eth0]`, as ping and ip write it) is read too;
/// - any number as port: `tty://adapter:19200/dev/ttyUSB0` (port = bit rate), `ble://FFF0:128` (PSM);
/// - a USB device as `VID:PID` in hexadecimal: `usb://1546:01a7` (``usbDeviceID``; not host and port);
/// - wrappers around any URL: `spy+tcp://127.0.0.1:4000?spy.format=raw`. Each `+` adds a layer; a
///   layer's options carry its scheme as a prefix (`spy.format`), so they never collide with the
///   wrapped URL's own options, which keep their meaning. ``inner`` is the wrapped URL.
///
/// Rejected before any plugin sees them: user info (`tcp://admin@host:22`), fragments, and control
/// characters (raw or percent-encoded, `%00` included) in the host, path and options.
///
/// What host, port and path mean is the scheme's business; ``SchemeDescriptor`` documents it.
///
/// ```swift
/// let url = try TransportURL("ble://FFF0:128/E3:2E:44:66:A2:4A")
/// url.host   // "FFF0"  (service UUID)
/// url.port   // 128     (L2CAP PSM)
/// url.path   // "/E3:2E:44:66:A2:4A"
///
/// let spied = try TransportURL("spy+tty:///dev/ttyUSB0?baud=115200&spy.format=raw")
/// spied.scheme                  // "spy"
/// spied.queryValue("format")    // "raw"
/// spied.inner?.description      // "tty:///dev/ttyUSB0?baud=115200"
/// ```
public struct TransportURL: Sendable, Hashable, CustomStringConvertible {
    /// Lower-cased scheme of this layer, such as `"tcp"`, or `"spy"` for `spy+tcp://…`.
    public var scheme: String
    /// Host without brackets, percent-decoded; `nil` when the authority is empty (`unix:///path`).
    public var host: String?
    /// The text after the host's last `:`, as written: a decimal port, a Bluetooth channel, or for
    /// `usb://VID:PID` the product id in hexadecimal. ``port`` is its decimal reading.
    public internal(set) var portText: String?
    /// Percent-decoded path including its leading `/`, or `""`.
    public var path: String {
        didSet { writtenPath = nil }
    }
    /// The path as the parsed text wrote it (percent-encoding kept), so that an encoded `/` (`%2F`)
    /// stays part of its segment; `nil` for a URL made from parts, or whose path was set since.
    fileprivate(set) var writtenPath: String?
    /// Query options of this layer in the order given, names as written (without a wrapper's
    /// prefix), values percent-decoded. A bare `?name` has the value `""`.
    public var query: [(name: String, value: String)]
    /// Empty, or the one URL this layer wraps (an array only to give the struct indirection).
    private var wrapped: [TransportURL]

    /// A URL from its parts; `inner` makes it a wrapper layer around another URL.
    ///
    /// ```swift
    /// let url = TransportURL(scheme: "tcp", host: "127.0.0.1", port: 4000, query: [("noDelay", "false")])
    /// ```
    public init(scheme: String, host: String? = nil, port: Int? = nil, path: String = "",
                query: [(name: String, value: String)] = [], inner: TransportURL? = nil) {
        self.scheme = scheme.lowercased()
        self.host = host
        self.portText = port.map(String.init)
        self.path = path
        self.query = query
        self.wrapped = inner.map { [$0] } ?? []
    }

    /// A URL from parts as a device listing writes its identity URLs: `portText` as it stands after
    /// the host's `:` (a USB product id in hexadecimal), and the path as `segments`, each
    /// percent-encoded whole (``percentEncoded(_:keeping:)``), so that a `/` inside one stays
    /// inside it (`%2F`, as ``pathSegments`` reads it back). ``description`` is the URL's text.
    ///
    /// ```swift
    /// TransportURL(scheme: "usb", host: "1d50", portText: "6089", segments: ["AB/12 ü"]).description
    /// // "usb://1d50:6089/AB%2F12%20%C3%BC"
    /// TransportURL(scheme: "usb", host: "05e3", portText: "0608", segments: [], query: [("location", "1-1")]).description
    /// // "usb://05e3:0608?location=1-1"
    /// ```
    public init(scheme: String, host: String? = nil, portText: String? = nil, segments: [String],
                query: [(name: String, value: String)] = []) {
        self.init(scheme: scheme, host: host, path: segments.isEmpty ? "" : "/" + segments.joined(separator: "/"), query: query)
        self.portText = portText
        if !segments.isEmpty {
            writtenPath = "/" + segments.map { TransportURL.percentEncoded($0) }.joined(separator: "/")
        }
    }

    /// `text` percent-encoded for a URL: unreserved ASCII (letters, digits, `-._~`) and the
    /// characters of `keeping` stay as they are; every other UTF-8 byte becomes `%XX`, two
    /// upper-case hex digits. What ``description`` writes each part of a URL with.
    ///
    /// ```swift
    /// TransportURL.percentEncoded("AB/12 ü")                      // "AB%2F12%20%C3%BC"
    /// TransportURL.percentEncoded("/tmp/a b", keeping: "/")       // "/tmp/a%20b"
    /// ```
    public static func percentEncoded(_ text: String, keeping extra: String = "") -> String {
        let kept = Set(extra.utf8)
        var out = ""
        for byte in text.utf8 {
            switch byte {
            case UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "A")...UInt8(ascii: "Z"), UInt8(ascii: "a")...UInt8(ascii: "z"),
                 UInt8(ascii: "-"), UInt8(ascii: "."), UInt8(ascii: "_"), UInt8(ascii: "~"):
                out.unicodeScalars.append(Unicode.Scalar(byte))
            case _ where kept.contains(byte):
                out.unicodeScalars.append(Unicode.Scalar(byte))
            default:
                out += "%" + Hex.digits(byte, width: 2, uppercase: true)
            }
        }
        return out
    }

    /// Parses `string`, throwing ``TransportError/Kind/invalidURL`` with the reason.
    ///
    /// ```swift
    /// let url = try TransportURL("tcp://[::1]:4000?noDelay=false")
    /// ```
    public init(_ string: String) throws {
        self = try URLParser.parse(string)
    }

    /// The port as a decimal number; `nil` when absent or not decimal (a hexadecimal USB product id).
    public var port: Int? {
        get {
            guard let portText, !portText.isEmpty, portText.utf8.count <= 9,
                  portText.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else { return nil }
            return Int(portText)
        }
        set { portText = newValue.map(String.init) }
    }

    /// The path as written (percent-encoding kept; `/` when empty) and a query of `items`, as an
    /// HTTP request target: what ws:// and http:// send to the server.
    ///
    /// ```swift
    /// try TransportURL("ws://h/a%2Fb").requestTarget(query: [("token", "x y")])   // "/a%2Fb?token=x%20y"
    /// ```
    @_spi(Plugins)
    public func requestTarget(query items: [(name: String, value: String)]) -> String {
        // Sub-delimiters stay as they are in a request's path, as servers route on them.
        let target = URLParser.encodePath(written: writtenPath, decoded: path, keeping: "!$&'()*+,;=")
        return (target.isEmpty ? "/" : target) + URLParser.encodeQuery(items)
    }

    /// The path's segments, percent-decoded each, split where the URL text has a `/` (not at a
    /// `%2F`, which stays inside its segment): `usb://1d50:6089/AB%2F12` has `["", "AB/12"]`, and
    /// `usb://1d50:6089/AB/12` has `["", "AB", "12"]`. Empty for an empty path.
    ///
    /// ```swift
    /// try TransportURL("usb://0403:6001/A%2FB").pathSegments   // ["", "A/B"]
    /// ```
    public var pathSegments: [String] {
        guard !path.isEmpty else { return [] }
        guard let writtenPath else { return path.split(separator: "/", omittingEmptySubsequences: false).map(String.init) }
        return writtenPath.split(separator: "/", omittingEmptySubsequences: false).map { segment in
            // The whole path decoded when it was parsed, so each of its segments decodes too.
            (try? URLParser.decode(segment, in: writtenPath, what: "the path")) ?? String(segment)
        }
    }

    /// The URL this layer wraps: `tcp://127.0.0.1:4000` for `spy+tcp://127.0.0.1:4000`.
    public var inner: TransportURL? {
        get { wrapped.first }
        set { wrapped = newValue.map { [$0] } ?? [] }
    }

    /// The URL at the bottom of the wrapper layers (this URL when it wraps nothing).
    public var innermost: TransportURL {
        var url = self
        while let next = url.inner { url = next }
        return url
    }

    /// The value of query option `name` (compared case-insensitively), if present.
    public func queryValue(_ name: String) -> String? {
        query.first { URLParser.sameName($0.name, name) }?.value
    }

    /// `true` when the host is a Bluetooth device address such as `00:0A:3A:22:68:73`.
    public var hostIsBluetoothAddress: Bool {
        host.map(URLParser.isMACAddress) ?? false
    }

    /// The authority read as a USB device's vendor and product id, four hexadecimal digits each
    /// (`usb://1546:01a7`); `nil` when it is not of that form.
    public var usbDeviceID: (vendor: UInt16, product: UInt16)? {
        guard let host, let portText,
              let vendor = Hex.value(host, width: 4, as: UInt16.self), let product = Hex.value(portText, width: 4, as: UInt16.self) else { return nil }
        return (vendor, product)
    }

    /// The URL written out again, wrapper layers and their prefixed options included; it parses back to an equal URL.
    public var description: String {
        var layers = [self]
        while let next = layers[layers.count - 1].inner { layers.append(next) }
        let bottom = layers[layers.count - 1]
        var text = layers.map(\.scheme).joined(separator: "+") + "://"
        if let host = bottom.host {
            if URLParser.isMACAddress(host) {
                text += host
            } else if host.contains(":") && URLParser.isIPv6Literal(host) {
                // RFC 6874: the zone's '%' is written "%25", the zone itself percent-encoded.
                if let percent = host.firstIndex(of: "%") {
                    text += "[" + host[..<percent] + "%25" + TransportURL.percentEncoded(String(host[host.index(after: percent)...])) + "]"
                } else {
                    text += "[" + host + "]"
                }
            } else {
                // A ':' that came percent-encoded (tcp://x%3Ay:1) goes back percent-encoded.
                text += TransportURL.percentEncoded(host)
            }
        }
        if let portText = bottom.portText { text += ":" + portText }
        text += URLParser.encodePath(written: bottom.writtenPath, decoded: bottom.path)
        var items = bottom.query
        for layer in layers.dropLast() {
            items += layer.query.map { (name: layer.scheme + "." + $0.name, value: $0.value) }
        }
        return text + URLParser.encodeQuery(items)
    }

    /// The URL as a message shows it: control characters escaped, and past 160 characters cut in
    /// the middle with its full length given (``description`` is the whole URL).
    ///
    /// ```swift
    /// throw TransportError(.notFound, "nothing answers at \(request.url.shown)")
    /// ```
    public var shown: String { URLParser.printable(description) }

    /// Two URLs are equal when they are written the same way (``description``).
    public static func == (lhs: TransportURL, rhs: TransportURL) -> Bool {
        lhs.description == rhs.description
    }

    /// Hashes the ``description``.
    public func hash(into hasher: inout Hasher) {
        hasher.combine(description)
    }
}

enum URLParser {
    static func fail(_ string: String, _ reason: String) -> TransportError {
        TransportError(.invalidURL, "invalid URL '\(printable(string))': \(reason)")
    }

    /// The URL as it may appear in a message: control characters shown as `\u{…}`.
    /// `string` as it may appear in a message: control characters escaped, and anything longer
    /// than `limit` characters cut in the middle with the full length given, so a 100 KB URL does
    /// not fill a terminal.
    static func printable(_ string: String, limit: Int = 160) -> String {
        var text = string
        if text.count > limit {
            text = "\(text.prefix(limit * 2 / 3))…\(text.suffix(limit / 3)) (\(string.utf8.count) bytes)"
        }
        guard text.unicodeScalars.contains(where: isControl) else { return text }
        return String(text.unicodeScalars.map { isControl($0) ? "\\u{\(String($0.value, radix: 16))}" : String($0) }.joined())
    }

    static func isControl(_ scalar: Unicode.Scalar) -> Bool {
        scalar.value < 0x20 || scalar.value == 0x7F
    }

    /// Case-insensitive comparison of option names (ASCII; names are declared in ASCII).
    static func sameName(_ a: String, _ b: String) -> Bool {
        a.utf8.count == b.utf8.count && a.lowercased() == b.lowercased()
    }

    /// `true` for a name a scheme may be registered under: a letter, then letters, digits, `-`, `.`.
    /// `+` is not allowed: it separates wrapper layers.
    static func isSchemeName<S: StringProtocol>(_ name: S) -> Bool {
        guard let first = name.unicodeScalars.first, first.isASCIILetter else { return false }
        return name.unicodeScalars.allSatisfy { $0.isASCIILetter || ("0"..."9").contains($0) || $0 == "-" || $0 == "." }
    }

    static func parse(_ string: String) throws -> TransportURL {
        guard let colon = string.firstIndex(of: ":"), string[colon...].hasPrefix("://") else {
            throw fail(string, "expected scheme://…, for example tcp://127.0.0.1:4000 or loop://")
        }
        let layers = string[..<colon].split(separator: "+", omittingEmptySubsequences: false)
        for scheme in layers where !isSchemeName(scheme) {
            throw fail(string, "the scheme '\(scheme)' must start with a letter and contain only letters, digits, '-' and '.' (a '+' separates a wrapper from the URL it wraps, as in spy+tcp://…)")
        }
        for (index, wrapper) in layers.dropLast().enumerated() {
            if wrapper.contains(".") {
                throw fail(string, "the wrapper '\(wrapper)' has a '.' in its name, which would make its options (\(wrapper).NAME) ambiguous")
            }
            if layers.dropLast().prefix(index).contains(where: { sameName(String($0), String(wrapper)) }) {
                throw fail(string, "the wrapper '\(wrapper)' is given twice; one layer is enough (its options could not be told apart)")
            }
        }
        if string.unicodeScalars.contains(where: isControl) {
            throw fail(string, "it contains a control character; percent-encoding does not make one acceptable either")
        }
        var rest = string[string.index(colon, offsetBy: 3)...]
        if let hash = rest.firstIndex(of: "#") {
            throw fail(string, "fragments ('#\(rest[rest.index(after: hash)...])') have no meaning here; percent-encode '#' as %23")
        }
        var queryText: Substring?
        if let mark = rest.firstIndex(of: "?") {
            queryText = rest[rest.index(after: mark)...]
            rest = rest[..<mark]
        }
        let slash = rest.firstIndex(of: "/") ?? rest.endIndex
        let authority = rest[..<slash]
        let path = try decode(rest[slash...], in: string, what: "the path")

        if authority.contains("@") {
            throw fail(string, "user information ('name@') has no meaning in a transport URL; put credentials in options, or percent-encode '@' as %40 where it belongs to the host")
        }
        let (host, portText) = try parseHostPort(authority, in: string)
        var query = try parseQuery(queryText, in: string)

        // Wrapper layers, outermost first, take the options named "LAYER.NAME"; the rest belong to
        // the wrapped URL at the bottom.
        var layerOptions = Array(repeating: [(name: String, value: String)](), count: layers.count)
        if layers.count > 1 {
            var own: [(name: String, value: String)] = []
            for item in query {
                if let dot = item.name.firstIndex(of: "."),
                   let layer = layers.dropLast().firstIndex(where: { sameName(String($0), String(item.name[..<dot])) }) {
                    layerOptions[layer].append((String(item.name[item.name.index(after: dot)...]), item.value))
                } else {
                    own.append(item)
                }
            }
            query = own
        }
        var url = TransportURL(scheme: String(layers[layers.count - 1]), host: host, path: path, query: query)
        url.writtenPath = path.isEmpty ? nil : String(rest[slash...])
        url.portText = portText
        for index in layers.indices.dropLast().reversed() {
            url = TransportURL(scheme: String(layers[index]), query: layerOptions[index], inner: url)
        }
        return url
    }

    /// Options in order; duplicate names (case-insensitive) are refused. Linear in their number.
    static func parseQuery(_ queryText: Substring?, in string: String) throws -> [(name: String, value: String)] {
        guard let queryText, !queryText.isEmpty else { return [] }
        var query: [(name: String, value: String)] = []
        var seen = Set<String>()
        for item in queryText.split(separator: "&", omittingEmptySubsequences: true) {
            let parts = item.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
            let name = try decode(parts[0], in: string, what: "an option name")
            guard !name.isEmpty else { throw fail(string, "an option has no name ('\(item)')") }
            let value = parts.count > 1 ? try decode(parts[1], in: string, what: "the value of '\(name)'") : ""
            guard seen.insert(name.lowercased()).inserted else {
                throw fail(string, "option '\(name)' is given twice")
            }
            query.append((name, value))
        }
        return query
    }

    /// The host and the raw text after its last colon (see ``TransportURL/portText``).
    static func parseHostPort(_ authority: Substring, in string: String) throws -> (String?, String?) {
        if authority.isEmpty { return (nil, nil) }
        let hostPart: Substring
        var portPart: Substring?
        if authority.hasPrefix("[") {
            guard let close = authority.firstIndex(of: "]") else {
                throw fail(string, "'[' opens an IPv6 address that no ']' closes")
            }
            hostPart = authority[authority.index(after: authority.startIndex)..<close]
            let after = authority[authority.index(after: close)...]
            if !after.isEmpty {
                guard after.hasPrefix(":") else { throw fail(string, "expected ':PORT' after ']'") }
                portPart = after.dropFirst()
            }
            guard isIPv6Literal(hostPart) else {
                throw fail(string, "'\(hostPart)' is not an IPv6 address")
            }
            return (try zoned(hostPart, in: string), portPart.map(String.init))
        }
        let colons = authority.utf8.count { $0 == UInt8(ascii: ":") }
        if colons <= 1 {
            if let colon = authority.firstIndex(of: ":") {
                hostPart = authority[..<colon]
                portPart = authority[authority.index(after: colon)...]
            } else {
                hostPart = authority
            }
        } else {
            // Only a Bluetooth address may carry bare colons: six hex pairs, then an optional ":PORT".
            let groups = authority.split(separator: ":", omittingEmptySubsequences: false)
            guard groups.count == 6 || groups.count == 7,
                  isMACAddress(groups.prefix(6).joined(separator: ":")) else {
                throw fail(string, "'\(printable(String(authority), limit: 60))' has \(colons) colons: an authority is HOST:PORT, VID:PID (usb://0403:6001; "
                           + "a serial number goes after a '/'), or a Bluetooth address (AA:BB:CC:DD:EE:FF[:CHANNEL]); IPv6 addresses go in brackets, as [::1]:4000")
            }
            hostPart = Substring(groups.prefix(6).joined(separator: ":"))
            portPart = groups.count == 7 ? groups[6] : nil
        }
        let host = try decode(hostPart, in: string, what: "the host")
        return (host.isEmpty ? nil : host, portPart.map(String.init))
    }

    /// An IPv6 address as RFC 4291 writes it (section 2.2): eight groups of one to four hex digits,
    /// or fewer with one `::` standing for the rest, the last two groups possibly an IPv4 address;
    /// then an optional zone after '%' (fe80::1%eth0). Six pairs of digits (a Bluetooth address)
    /// are not one.
    static func isIPv6Literal<S: StringProtocol>(_ text: S) -> Bool {
        let address = String(text.prefix { $0 != "%" })
        guard address.contains(":"), address.allSatisfy({ ($0.isASCII && $0.isHexDigit) || $0 == ":" || $0 == "." }) else { return false }
        let characters = Array(address)
        var halves: [String] = []
        var start = 0
        var index = 0
        while index < characters.count {
            if characters[index] == ":", index + 1 < characters.count, characters[index + 1] == ":" {
                halves.append(String(characters[start..<index]))
                index += 2
                start = index
            } else {
                index += 1
            }
        }
        halves.append(String(characters[start...]))
        guard halves.count <= 2 else { return false }
        var groups = 0
        for (index, half) in halves.enumerated() where !half.isEmpty {
            let parts = half.split(separator: ":", omittingEmptySubsequences: false)
            for (position, part) in parts.enumerated() {
                let last = index == halves.count - 1 && position == parts.count - 1
                if last, part.contains(".") {
                    let octets = part.split(separator: ".", omittingEmptySubsequences: false)
                    guard octets.count == 4, octets.allSatisfy({ (octet: Substring) in !octet.isEmpty && octet.count <= 3 && octet.allSatisfy(\.isNumber) && (Int(octet) ?? 256) <= 255 })
                    else { return false }
                    groups += 2
                } else {
                    guard (1...4).contains(part.count), part.allSatisfy({ $0.isASCII && $0.isHexDigit }) else { return false }
                    groups += 1
                }
            }
        }
        return halves.count == 2 ? groups <= 7 : groups == 8
    }

    static func isMACAddress(_ text: String) -> Bool {
        let groups = text.split(separator: ":", omittingEmptySubsequences: false)
        return groups.count == 6 && groups.allSatisfy { $0.count == 2 && $0.allSatisfy({ $0.isASCII && $0.isHexDigit }) }
    }

    /// An IPv6 literal's text with its zone decoded: RFC 6874's `fe80::1%25eth0`, and the bare
    /// `fe80::1%eth0` that ping(8) and ip(8) print, are both `fe80::1%eth0`. After `%25` the zone
    /// is percent-decoded; after a bare `%` it is taken as written.
    static func zoned(_ literal: Substring, in string: String) throws -> String {
        guard let percent = literal.firstIndex(of: "%") else { return String(literal) }
        let address = literal[..<percent]
        let rest = literal[literal.index(after: percent)...]
        let zone: String
        // "%25" and more is RFC 6874's spelling; "%25" alone is the bare zone "25" (an interface
        // index), which the RFC spelling writes "%2525".
        if rest.hasPrefix("25"), rest.count > 2 {
            zone = try decode(rest.dropFirst(2), in: string, what: "the IPv6 zone")
        } else {
            zone = String(rest)
        }
        guard !zone.isEmpty else {
            throw fail(string, "'\(literal)' has no zone after '%' (write it as RFC 6874 does: [fe80::1%25eth0])")
        }
        guard !zone.contains("%") else {
            throw fail(string, "the zone of '\(literal)' contains a '%'; no interface name does")
        }
        return address + "%" + zone
    }

    /// Percent-decodes `text`; refuses malformed escapes, invalid UTF-8 and control characters.
    static func decode(_ text: Substring, in string: String, what: String) throws -> String {
        guard text.contains("%") else { return String(text) }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(text.utf8.count)
        var utf8 = text.utf8[...]
        while let byte = utf8.first {
            utf8 = utf8.dropFirst()
            if byte == UInt8(ascii: "%") {
                guard utf8.count >= 2, let high = Hex.digitValue(utf8[utf8.startIndex]),
                      let low = Hex.digitValue(utf8[utf8.index(after: utf8.startIndex)]) else {
                    throw fail(string, "'%' must be followed by two hex digits")
                }
                let value = high << 4 | low
                if value < 0x20 || value == 0x7F {
                    throw fail(string, "\(what) contains a control character (%\(Hex.digits(value, width: 2, uppercase: true))); such bytes are never valid here")
                }
                bytes.append(value)
                utf8 = utf8.dropFirst(2)
            } else {
                bytes.append(byte)
            }
        }
        guard let decoded = String(validating: bytes, as: UTF8.self) else {
            throw fail(string, "percent-encoded bytes are not valid UTF-8")
        }
        return decoded
    }

    /// A path for a URL's text: as written where it was parsed (re-encoding the decoded path would
    /// turn a "%2F" into a "/"), else the decoded path encoded; `keeping` more characters as they are.
    static func encodePath(written: String?, decoded: String, keeping extra: String = "") -> String {
        let kept = "/:@" + extra
        return written.map { TransportURL.percentEncoded($0, keeping: kept + "%") } ?? TransportURL.percentEncoded(decoded, keeping: kept)
    }

    /// `?name=value&…` with names and values encoded (a bare name for an empty value); `""` for none.
    static func encodeQuery(_ items: [(name: String, value: String)]) -> String {
        guard !items.isEmpty else { return "" }
        return "?" + items.map { name, value in
            let name = TransportURL.percentEncoded(name)
            return value.isEmpty ? name : name + "=" + TransportURL.percentEncoded(value, keeping: ":/")
        }.joined(separator: "&")
    }
}

extension Unicode.Scalar {
    var isASCIILetter: Bool { ("a"..."z").contains(self) || ("A"..."Z").contains(self) }
}
