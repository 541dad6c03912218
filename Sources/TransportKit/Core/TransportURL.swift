/// A transport URL, parsed once, here, for every scheme.
///
/// The grammar is `scheme://[user@]host[:port][/path][?name=value&name2…]`, with three extensions
/// that the schemes of this field need and RFC 3986 parsers reject:
/// - a Bluetooth address as host: `rfcomm://00:0a:3a:22:68:73` (host = MAC), and
///   `rfcomm://00:0a:3a:22:68:73:3` (port = channel 3);
/// - IPv6 literals in brackets: `tcp://[::1]:4000` (host = `::1`);
/// - any number as port: `tty://adapter:19200/dev/ttyUSB0` (port = bit rate), `ble://FFF0:128` (PSM).
///
/// What host, port and path mean is the scheme's business; ``SchemeDescriptor`` documents it.
///
/// ```swift
/// let url = try TransportURL("ble://FFF0:128/E3:2E:44:66:A2:4A")
/// url.host   // "FFF0"  (service UUID)
/// url.port   // 128     (L2CAP PSM)
/// url.path   // "/E3:2E:44:66:A2:4A"
/// ```
public struct TransportURL: Sendable, Hashable, CustomStringConvertible {
    /// Lower-cased scheme, such as `"tcp"`.
    public var scheme: String
    /// The user part before `@`, if any (percent-decoded).
    public var user: String?
    /// Host without brackets, percent-decoded; `nil` when the authority is empty (`unix:///path`).
    public var host: String?
    /// The number after the host's last `:`.
    public var port: Int?
    /// Percent-decoded path including its leading `/`, or `""`.
    public var path: String
    /// Query options in the order given, names as written, values percent-decoded. A bare
    /// `?name` has the value `""`.
    public var query: [(name: String, value: String)]

    public init(scheme: String, user: String? = nil, host: String? = nil, port: Int? = nil, path: String = "",
                query: [(name: String, value: String)] = []) {
        self.scheme = scheme.lowercased()
        self.user = user
        self.host = host
        self.port = port
        self.path = path
        self.query = query
    }

    /// Parses `string`, throwing ``TransportError/Kind/invalidURL`` with the reason.
    public init(_ string: String) throws {
        self = try URLParser.parse(string)
    }

    /// The value of query option `name` (compared case-insensitively), if present.
    public func queryValue(_ name: String) -> String? {
        query.first { $0.name.lowercased() == name.lowercased() }?.value
    }

    /// `true` when the host is a Bluetooth device address such as `00:0A:3A:22:68:73`.
    public var hostIsBluetoothAddress: Bool {
        host.map(URLParser.isMACAddress) ?? false
    }

    public var description: String {
        var text = scheme + "://"
        if let user { text += URLParser.percentEncode(user, allowing: URLParser.unreserved) + "@" }
        if let host {
            if host.contains(":") && !URLParser.isMACAddress(host) {
                text += "[" + host + "]"
            } else {
                text += URLParser.percentEncode(host, allowing: URLParser.unreserved + ":")
            }
        }
        if let port { text += ":\(port)" }
        text += URLParser.percentEncode(path, allowing: URLParser.unreserved + "/:@")
        if !query.isEmpty {
            text += "?" + query.map { item in
                let name = URLParser.percentEncode(item.name, allowing: URLParser.unreserved)
                return item.value.isEmpty ? name : name + "=" + URLParser.percentEncode(item.value, allowing: URLParser.unreserved + ":/")
            }.joined(separator: "&")
        }
        return text
    }

    public static func == (lhs: TransportURL, rhs: TransportURL) -> Bool {
        lhs.description == rhs.description
    }

    public func hash(into hasher: inout Hasher) {
        hasher.combine(description)
    }
}

enum URLParser {
    static let unreserved = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~"

    static func fail(_ string: String, _ reason: String) -> TransportError {
        TransportError(.invalidURL, "invalid URL '\(string)': \(reason)")
    }

    static func parse(_ string: String) throws -> TransportURL {
        guard let colon = string.firstIndex(of: ":"), string[colon...].hasPrefix("://") else {
            throw fail(string, "expected scheme://…, for example tcp://127.0.0.1:4000 or loop://")
        }
        let scheme = String(string[..<colon])
        guard let first = scheme.first, first.isASCII, first.isLetter,
              scheme.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || "+-.".contains($0)) })
        else {
            throw fail(string, "the scheme '\(scheme)' must start with a letter and contain only letters, digits, '+', '-' and '.'")
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
        var authority = rest[..<slash]
        let path = try decode(rest[slash...], in: string)

        var user: String?
        if let at = authority.lastIndex(of: "@") {
            user = try decode(authority[..<at], in: string)
            authority = authority[authority.index(after: at)...]
        }
        let (host, port) = try parseHostPort(authority, in: string)

        var query: [(name: String, value: String)] = []
        if let queryText, !queryText.isEmpty {
            for item in queryText.split(separator: "&", omittingEmptySubsequences: true) {
                let parts = item.split(separator: "=", maxSplits: 1, omittingEmptySubsequences: false)
                let name = try decode(parts[0], in: string)
                guard !name.isEmpty else { throw fail(string, "an option has no name ('\(item)')") }
                let value = parts.count > 1 ? try decode(parts[1], in: string) : ""
                if query.contains(where: { $0.name.lowercased() == name.lowercased() }) {
                    throw fail(string, "option '\(name)' is given twice")
                }
                query.append((name, value))
            }
        }
        return TransportURL(scheme: scheme, user: user, host: host, port: port, path: path, query: query)
    }

    static func parseHostPort(_ authority: Substring, in string: String) throws -> (String?, Int?) {
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
            let address = hostPart.prefix { $0 != "%" }
            guard !address.isEmpty, address.allSatisfy({ $0.isHexDigit || $0 == ":" || $0 == "." }) else {
                throw fail(string, "'\(hostPart)' is not an IPv6 address")
            }
            // A zone such as fe80::1%eth0 is taken verbatim, not percent-decoded.
            return (String(hostPart), try parsePort(portPart, in: string))
        } else {
            let colons = authority.filter { $0 == ":" }.count
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
                    throw fail(string, "'\(authority)' is neither HOST:PORT nor a Bluetooth address (AA:BB:CC:DD:EE:FF[:CHANNEL]); write IPv6 addresses in brackets, as [::1]:4000")
                }
                hostPart = Substring(groups.prefix(6).joined(separator: ":"))
                portPart = groups.count == 7 ? groups[6] : nil
            }
        }
        let host = try decode(hostPart, in: string)
        return (host.isEmpty ? nil : host, try parsePort(portPart, in: string))
    }

    static func parsePort(_ portPart: Substring?, in string: String) throws -> Int? {
        guard let portPart else { return nil }
        guard !portPart.isEmpty, portPart.count <= 9, portPart.allSatisfy({ $0.isASCII && $0.isNumber }),
              let value = Int(portPart) else {
            throw fail(string, "the port '\(portPart)' must be a decimal number")
        }
        return value
    }

    static func isMACAddress(_ text: String) -> Bool {
        let groups = text.split(separator: ":", omittingEmptySubsequences: false)
        return groups.count == 6 && groups.allSatisfy { $0.count == 2 && $0.allSatisfy(\.isHexDigit) }
    }

    static func decode(_ text: Substring, in string: String) throws -> String {
        guard text.contains("%") else { return String(text) }
        var bytes: [UInt8] = []
        var utf8 = text.utf8[...]
        while let byte = utf8.first {
            utf8 = utf8.dropFirst()
            if byte == UInt8(ascii: "%") {
                guard utf8.count >= 2,
                      let value = UInt8(String(decoding: utf8.prefix(2), as: UTF8.self), radix: 16) else {
                    throw fail(string, "'%' must be followed by two hex digits")
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

    static func percentEncode(_ text: String, allowing allowed: String) -> String {
        let allowedBytes = Set(allowed.utf8)
        var out = ""
        for byte in text.utf8 {
            if allowedBytes.contains(byte) {
                out.unicodeScalars.append(Unicode.Scalar(byte))
            } else {
                let hex = String(byte, radix: 16, uppercase: true)
                out += "%" + (hex.count == 1 ? "0" + hex : hex)
            }
        }
        return out
    }
}
