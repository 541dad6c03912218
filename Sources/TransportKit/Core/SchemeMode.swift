import Synchronization

/// One way a scheme's URLs are used, and the options that way uses: connecting or listening, and,
/// for a scheme with several forms, which form. `ble://SERVICE:PSM/MAC` opens an L2CAP channel and
/// `ble://SERVICE/MAC` GATT serial; an option one form has no use for (`receiveMTU=` on a GATT URL) is
/// refused before any I/O with a message that names the form, never taken and ignored.
///
/// A URL's mode is the first of the descriptor's ``SchemeDescriptor/modes`` whose role and
/// selectors (``port``, ``host``, ``selectedBy``) fit it. Connect modes also take the common options
/// (``OptionSpec/common``); listen modes do not (a listener has no connect deadline).
///
/// ```swift
/// SchemeDescriptor(scheme: "ble", …, options: [adapter, rx, tx, receiveMTU, security],
///                  modes: [SchemeMode("GATT serial connection", form: "ble://SERVICE[/MAC]", port: .forbidden,
///                                     options: [adapter, rx, tx]),
///                          SchemeMode("L2CAP connection", form: "ble://SERVICE:PSM[/MAC]", port: .required,
///                                     options: [adapter, receiveMTU, security])])
/// ```
///
/// A descriptor without modes has one connect mode, and one listen mode when the scheme can
/// listen, each using every option the scheme declares.
public struct SchemeMode: Sendable, Codable, Equatable {
    /// Whether the URL is connected to or listened on.
    public enum Role: String, Sendable, Codable {
        /// `connect(to:)`.
        case connect
        /// `listen(on:)`.
        case listen
    }

    /// What a person calls this mode, used in messages: "GATT serial connection", "listener".
    public var name: String
    /// Connect or listen.
    public var role: Role
    /// The URL form, such as `ble://SERVICE:PSM[/MAC]`.
    public var form: String
    /// The mode serves URLs with a port (`.required`), without one (`.forbidden`), or either (`nil`).
    public var port: SchemeDescriptor.Presence?
    /// The mode serves URLs whose host is this word (case-insensitive), such as `usb` for
    /// `tty://usb/VID:PID`; `nil`: any host.
    public var host: String?
    /// The mode serves URLs that turn this boolean option on (`?controlOnly` or `controlOnly=true`
    /// selects `usb://`'s control-only mode); `nil`: the option plays no part in choosing.
    public var selectedBy: String?
    /// The names of the scheme's options this mode uses.
    public var options: [String]

    /// A mode; `options` are the ``URLOption`` constants of the descriptor that it uses, and
    /// `selectedBy` a boolean one of them that, turned on in a URL, selects this mode.
    ///
    /// ```swift
    /// SchemeMode("usb:// control-only connection", form: "usb://VID:PID?controlOnly=true", selectedBy: controlOnly,
    ///            options: [controlOnly, serial, interface])
    /// ```
    @_spi(Plugins)
    public init(_ name: String, role: Role = .connect, form: String, port: SchemeDescriptor.Presence? = nil, host: String? = nil,
                selectedBy: (any OptionDeclaration)? = nil, options: [any OptionDeclaration]) {
        self.name = name
        self.role = role
        self.form = form
        self.port = port
        self.host = host
        self.selectedBy = selectedBy?.spec.name
        self.options = options.map(\.spec.name)
    }

    /// Whether this mode serves `url` in `role`.
    func serves(_ url: TransportURL, as role: Role) -> Bool {
        guard role == self.role else { return false }
        switch port {
        case .required? where url.portText == nil: return false
        case .forbidden? where url.portText != nil: return false
        default: break
        }
        if let host, url.host.map({ URLParser.sameName($0, host) }) != true { return false }
        if let selectedBy {
            // A value that is not a boolean selects nothing here; validation names the problem.
            guard let text = url.queryValue(selectedBy), case .bool(true)? = try? OptionKind.bool.parse(text) else { return false }
        }
        return true
    }

    /// The mode as messages name it: "ble:// GATT serial connection (ble://SERVICE[/MAC])".
    public var phrase: String { "\(name) (\(form))" }
}

/// Which options a request's plugin read: each read through ``ConnectRequest``'s subscript (or
/// ``OptionValues``') is recorded, so the registry can refuse a connect whose plugin never used an
/// option the URL gave (a plugin bug that would otherwise ignore it silently).
final class OptionUse: Sendable {
    private let read = Locked<Set<String>>([])

    func record(_ key: String) {
        _ = read.withLock { $0.insert(key) }
    }

    var keys: Set<String> { read.withLock { $0 } }
}
