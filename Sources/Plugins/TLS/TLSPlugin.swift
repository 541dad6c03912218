// tls:// and tls+URL: TLS through swift-nio-ssl, as a client and as a listener.
//
// Grammar:
//   tls://HOST:PORT[?ca=PATH&cert=PATH&key=PATH&serverName=NAME&alpn=P1,P2&minVersion=1.2|1.3&pin=sha256/B64
//                   &insecure=true&noDelay=BOOL&keepAlive=BOOL&keepAliveIdle=SECONDS&timeout=SECONDS]
//     The server's certificate is verified against the system's trust store plus ca=, and must
//     name HOST (or serverName=); an IP address is not sent as SNI and must be in the certificate.
//     pin= also requires one of the given public keys (with insecure=true, only that).
//   tls://ADDRESS:PORT?cert=PATH&key=PATH[&ca=PATH&alpn=…&minVersion=…&handshakeTimeout=SECONDS&backlog=N] (listening)
//     With ca=, every client must present a certificate that authority issued.
//   tls+URL[?tls.ca=…&tls.serverName=…] wraps any stream URL (tls+unix:///run/x.sock?tls.serverName=x).
//   tls+rfc2217://ADDRESS:PORT?tls.cert=PATH&tls.key=PATH&tls.ca=PATH (listening): TLS beneath a
//     protocol on TCP; client certificates from tls.ca are required.

import NIOCore
import NIOSSL
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
@_spi(Plugins) import TransportKitSockets

/// The `tls` scheme and the `tls+` wrapper.
///
/// ```swift
/// let connection = try await Transport.connect(to: "tls://example.com:443?alpn=http/1.1")
/// print(connection.metadata.extra["tls.version"] ?? "")   // "TLS 1.3"
/// let listener = try await Transport.listen(on: "tls://127.0.0.1:0?cert=/etc/x/cert.pem&key=/etc/x/key.pem")
/// ```
public struct TLSPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    /// Extra trust anchors (a PEM file); the system's store still counts. On a listener: the
    /// authority whose client certificates are required.
    @_spi(Plugins) public static let ca = URLOption.string("ca", help: "PEM file of extra trust anchors (a listener: the CA whose client certificates are required)")
    /// This end's certificate chain.
    @_spi(Plugins) public static let cert = URLOption.string("cert", help: "PEM file of this end's certificate chain (a client certificate, or the listener's)")
    /// This end's private key.
    @_spi(Plugins) public static let key = URLOption.string("key", help: "PEM file of the private key of cert=")
    /// The name sent as SNI and checked in the server's certificate.
    @_spi(Plugins) public static let serverName = URLOption.string("serverName", help: "The name sent as SNI and required in the server's certificate (default: the host)")
    /// ALPN protocols offered or accepted.
    @_spi(Plugins) public static let alpn = URLOption.string("alpn", help: "Application protocols to offer (ALPN), comma-separated, such as h2,http/1.1")
    /// The lowest TLS version accepted.
    @_spi(Plugins) public static let minVersion = URLOption.choice("minVersion", default: MinimumVersion.tls12, help: "The lowest TLS version accepted: 1.2 or 1.3")

    /// The values of ``minVersion``.
    public enum MinimumVersion: String, Sendable, CaseIterable {
        /// TLS 1.2 and 1.3.
        case tls12 = "1.2"
        /// TLS 1.3 only.
        case tls13 = "1.3"
    }
    /// Accepted public keys of the server.
    @_spi(Plugins) public static let pin = URLOption.string("pin", help: "The server's public key must be one of these: sha256/BASE64 digests of its SubjectPublicKeyInfo, "
                                                            + "comma-separated (connection.metadata.extra[\"tls.pin\"] shows a server's)")
    /// No verification at all.
    @_spi(Plugins) public static let insecure = URLOption.bool("insecure", default: false,
                                                               help: "Skip every check of the server's certificate: anyone on the path can read and change the data")
    /// How long an accepted client may take over its handshake.
    @_spi(Plugins) public static let handshakeTimeout = URLOption.duration("handshakeTimeout", seconds: 0.1...300, default: 10,
                                                                           help: "Seconds an accepted client has to finish its handshake before it is dropped")

    static let clientOptions: [any OptionDeclaration] = [ca, cert, key, serverName, alpn, minVersion, insecure, pin]
    static let serverOptions: [any OptionDeclaration] = [ca, cert, key, alpn, minVersion, handshakeTimeout]
    /// A `tls+` listener's: client certificates are required (`ca`), as ser2net's gensio TLS does.
    static let wrappedServerOptions: [any OptionDeclaration] = [ca, cert, key, minVersion]

    /// `tls` (connect and listen) and the `tls+` wrapper.
    public var schemes: [Scheme] {
        let tcp: [any OptionDeclaration] = [SocketsPlugin.noDelay, SocketsPlugin.keepAlive, SocketsPlugin.keepAliveIdle]
        var all = Self.clientOptions + [Self.handshakeTimeout]
        all += tcp + [SocketsPlugin.backlog]
        return [
            Scheme(SchemeDescriptor(
                scheme: "tls",
                summary: "TLS over TCP, the server's certificate verified (swift-nio-ssl)",
                grammar: "tls://HOST:PORT[?OPTIONS]",
                examples: ["tls://example.com:443", "tls://127.0.0.1:8443?ca=/etc/lab/ca.pem&serverName=lab.local",
                           "tls://0.0.0.0:8443?cert=cert.pem&key=key.pem (listening)"],
                host: .required, port: .required, portRange: 0...65535, path: .forbidden,
                options: all,
                modes: [SchemeMode("tls:// connection", form: "tls://HOST:PORT", options: Self.clientOptions + tcp),
                        SchemeMode("tls:// listener", role: .listen, form: "tls://ADDRESS:PORT", options: Self.serverOptions + tcp + [SocketsPlugin.backlog])]
            ), connect: Self.connect, listen: Self.listen),
            Scheme.wrapper(SchemeDescriptor(
                scheme: "tls",
                summary: "TLS over any stream URL (tls+unix://, tls+tty://, tls+rfcomm://)",
                grammar: "tls+URL[?tls.OPTION=VALUE…]",
                examples: ["tls+unix:///run/device.sock?tls.serverName=device.local&tls.ca=/etc/lab/ca.pem",
                           "tls+rfc2217://0.0.0.0:4443?tls.cert=cert.pem&tls.key=key.pem&tls.ca=clients.pem (listening)"],
                host: .forbidden, port: .forbidden, path: .forbidden,
                options: Self.clientOptions,
                modes: [SchemeMode("tls+ over another URL", form: "tls+URL", options: Self.clientOptions),
                        SchemeMode("tls+ listener around a protocol on TCP", role: .listen, form: "tls+rfc2217://ADDRESS:PORT",
                                   options: Self.wrappedServerOptions)]
            ), connect: Self.connectWrapped, listen: Self.listenWrapped),
        ]
    }

    /// What the client options cannot mean together, refused before any I/O.
    static func check(_ settings: TLSSettings, _ request: ConnectRequest) throws {
        if let name = settings.serverName, isIPAddress(name) {
            throw TransportError(.invalidURL, "\(request.url.shown): serverName=\(name) is an IP address, which TLS does not send as a name (SNI); "
                                 + "connect to the address itself, and its certificate must carry it")
        }
        for pin in settings.pins where !(pin.hasPrefix("sha256/") && pin.utf8.count == 51 && pin.hasSuffix("=")) {
            throw TransportError(.invalidURL, "\(request.url.shown): pin=\(pin) is not a SHA-256 key pin; write sha256/ and 44 base64 characters, "
                                 + "as connection.metadata.extra[\"tls.pin\"] shows it")
        }
        if settings.insecure, settings.ca != nil {
            throw TransportError(.invalidURL, "\(request.url.shown): ca= and insecure=true contradict each other: insecure checks no certificate, "
                                 + "so ca= would be ignored; drop insecure=true to check the server against ca=")
        }
    }

    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let settings = TLSSettings(request, listening: false)
        try check(settings, request)
        let host = request.host
        let name = settings.serverName ?? (isIPAddress(host) ? nil : host)
        warnIfInsecure(settings, request)
        let target = "tls://\(host.contains(":") ? "[\(host)]" : host):\(request.port)"
        let layer = TLSLayer.client(try settings.clientContext(), settings: settings, serverName: name, describing: target)
        return try await TCPSocket.connect(request, host: host, port: request.port, layers: [layer], name: target)
    }

    @Sendable static func connectWrapped(_ request: ConnectRequest) async throws -> Connection {
        var settings = TLSSettings(request, listening: false)
        try check(settings, request)
        // Over a URL with a host name (tls+tcp://name:port), that name is the one checked.
        if settings.serverName == nil, let host = request.url.inner?.host, !isIPAddress(host) {
            settings.serverName = host
        }
        guard settings.serverName != nil || settings.insecure else {
            throw TransportError(.invalidURL, "\(request.url.shown): tls+ over \(request.url.inner?.scheme ?? "?"):// has no host name to check the certificate against; "
                                 + "give the name the server's certificate carries as tls.serverName=NAME")
        }
        warnIfInsecure(settings, request)
        let context = try settings.clientContext()
        let layer = TLSLayer.client(context, settings: settings, serverName: settings.serverName, describing: request.url.shown)
        // A protocol over TCP (tls+rfc2217://) runs over TLS: TLS goes beneath it, on its channel.
        if request.innerTakesLayersBeneath {
            return try await request.connectInner(beneath: [layer])
        }
        let inner = try await request.connectInner()
        return try await ConnectionLayering.layer([layer], over: inner, request: request)
    }

    @Sendable static func listen(_ request: ConnectRequest) async throws -> Listener {
        let settings = TLSSettings(request, listening: true)
        let context = try settings.serverContext()
        let described = "tls://\(request.host):\(request.port)"
        return try await TCPSocket.listen(request, layers: [TLSLayer.server(context, describing: described)],
                                          handshakeTimeout: request[Self.handshakeTimeout], peerScheme: "tls", authenticated: settings.ca != nil)
    }

    /// `tls+rfc2217://ADDRESS:PORT?tls.cert=…&tls.key=…&tls.ca=…`: the wrapped scheme listens with
    /// TLS beneath its protocol, and every client must present a certificate from `tls.ca`. Only
    /// around a scheme that takes layers beneath (a protocol on TCP); TLS over TCP itself is `tls://`.
    @Sendable static func listenWrapped(_ request: ConnectRequest) async throws -> Listener {
        guard request.innerTakesLayersBeneath else {
            throw TransportError(.unsupported, "\(request.url.shown): a tls+ listener wraps a protocol that runs on TCP (tls+rfc2217://ADDRESS:PORT); "
                                 + "for TLS over TCP itself, listen on tls://ADDRESS:PORT?cert=…&key=…")
        }
        let settings = TLSSettings(request, listening: true)
        guard settings.cert != nil, settings.key != nil else {
            throw TransportError(.invalidURL, "\(request.url.shown): a tls+ listener needs tls.cert=PATH and tls.key=PATH: its certificate chain and private key, as PEM files")
        }
        guard settings.ca != nil else {
            throw TransportError(.invalidURL, "\(request.url.shown): a tls+ listener requires client certificates: give tls.ca=PEM, the authority whose "
                                 + "certificates clients must present, beside tls.cert= and tls.key=, this server's")
        }
        let layer = TLSLayer.server(try settings.serverContext(), describing: request.url.shown)
        let inner = try await request.listenInner(beneath: [layer])
        // Reported as tls+ over the bound URL; the certificate paths are not repeated.
        let url = (try? TransportURL("tls+" + inner.url.description)) ?? request.url
        let exposure = inner.exposure.map { ListenerExposure(reach: $0.reach, authenticated: true, who: $0.who, caution: $0.caution) }
        return Listener(url: url, backend: WrappedListener(inner), exposure: exposure)
    }

    /// The listener of a wrapped URL, handed out under the wrapper's URL.
    final class WrappedListener: ListenerBackend {
        let inner: Listener
        init(_ inner: Listener) { self.inner = inner }
        func accept() async throws -> Connection? { try await inner.accept() }
        func close() async throws { try await inner.close() }
    }

    /// The TLS client layer for a plugin that runs its protocol over TLS (wss://, https://): the
    /// client options (`ca`, `cert`, `key`, `serverName`, `alpn`, `minVersion`, `insecure`, `pin`)
    /// read from `request`, the server's name from `serverName=` or `host` (an IP address is not
    /// sent as a name), `alpn` used when the URL gives none.
    ///
    /// ```swift
    /// let tls = try TLSPlugin.clientLayer(for: request, host: request.host, alpn: ["http/1.1"])
    /// return try await TCPSocket.connect(request, host: request.host, port: request.port, layers: [tls, webSocket])
    /// ```
    @_spi(Plugins)
    public static func clientLayer(for request: ConnectRequest, host: String, alpn: [String] = []) throws -> ProtocolLayer {
        var settings = TLSSettings(request, listening: false)
        if settings.alpn.isEmpty { settings.alpn = alpn }
        try check(settings, request)
        warnIfInsecure(settings, request)
        let name = settings.serverName ?? (isIPAddress(host) ? nil : host)
        return TLSLayer.client(try settings.clientContext(), settings: settings, serverName: name, describing: request.url.shown)
    }

    /// The TLS server layer for a listener of another plugin (wss://): `cert=`, `key=`, and with
    /// `ca=` client certificates required. The second value is `true` when clients must present one.
    @_spi(Plugins)
    public static func serverLayer(for request: ConnectRequest) throws -> (layer: ProtocolLayer, authenticated: Bool) {
        let settings = TLSSettings(request, listening: true)
        return (TLSLayer.server(try settings.serverContext(), describing: request.url.shown), settings.ca != nil)
    }

    /// The options a client reads for ``clientLayer(for:host:alpn:)``.
    @_spi(Plugins) public static var clientLayerOptions: [any OptionDeclaration] { [ca, cert, key, serverName, minVersion, insecure, pin] }
    /// The options a listener reads for ``serverLayer(for:)``.
    @_spi(Plugins) public static var serverLayerOptions: [any OptionDeclaration] { [ca, cert, key, minVersion] }

    static func warnIfInsecure(_ settings: TLSSettings, _ request: ConnectRequest) {
        if settings.insecure && settings.pins.isEmpty {
            request.logger.warning("insecure=true: the server's certificate is not checked; anyone on the path can read and change this connection")
        }
    }

    static func isIPAddress(_ host: String) -> Bool {
        host.contains(":") || (host.split(separator: ".").count == 4 && host.split(separator: ".").allSatisfy { UInt8($0) != nil })
    }
}
