// TLS (RFC 8446, RFC 5246) through swift-nio-ssl (BoringSSL): the client and server layers, their
// configuration from URL options, and errors that say what to do. The layer runs over a TCP channel
// (tls://HOST:PORT) or over any connection (tls+URL) through ConnectionLayering.

import Crypto
import FoundationEssentials
import Glibc
import NIOCore
import NIOSSL
import NIOTLS
import Synchronization
@_spi(Plugins) import TransportKitCore

/// TLS settings read from a URL's options, once.
struct TLSSettings: Sendable {
    var ca: String?
    var cert: String?
    var key: String?
    var serverName: String?
    var alpn: [String]
    var minVersion: TLSVersion
    var insecure: Bool
    /// Accepted SHA-256 digests of the server's public key (SubjectPublicKeyInfo), base64.
    var pins: [String]

    init(_ request: ConnectRequest, listening: Bool) {
        ca = request[TLSPlugin.ca]
        cert = request[TLSPlugin.cert]
        key = request[TLSPlugin.key]
        alpn = request[TLSPlugin.alpn].map { $0.split(separator: ",").map { String($0.filter { $0 != " " }) } } ?? []
        minVersion = request[TLSPlugin.minVersion] == .tls13 ? .tlsv13 : .tlsv12
        if listening {
            serverName = nil
            insecure = false
            pins = []
        } else {
            serverName = request[TLSPlugin.serverName]
            insecure = request[TLSPlugin.insecure]
            pins = request[TLSPlugin.pin].map { $0.split(separator: ",").map { String($0.filter { $0 != " " }) } } ?? []
        }
    }

    /// The client's configuration: the system's trust store plus `ca`, a client certificate if
    /// given, full verification unless `insecure`.
    func clientContext() throws -> NIOSSLContext {
        // Building a context loads the system trust store: one per set of options and files.
        let key = ContextCache.Key(settings: self)
        if let cached = ContextCache.shared.context(for: key) { return cached }
        let context = try makeClientContext()
        ContextCache.shared.store(context, for: key)
        return context
    }

    private func makeClientContext() throws -> NIOSSLContext {
        var configuration = TLSConfiguration.makeClientConfiguration()
        configuration.shutdownTimeout = Self.closeBound
        configuration.minimumTLSVersion = minVersion
        configuration.applicationProtocols = alpn
        configuration.certificateVerification = insecure ? .none : .fullVerification
        if let ca { configuration.additionalTrustRoots = [.certificates(try Self.certificates(ca, what: "ca="))] }
        try identity(into: &configuration)
        return try Self.context(configuration)
    }

    /// The server's configuration: its certificate and key; with `ca`, client certificates
    /// required and verified against it (and nothing else).
    func serverContext() throws -> NIOSSLContext {
        guard let cert, let key else {
            throw TransportError(.invalidURL, "a tls:// listener needs cert=PATH and key=PATH: its certificate chain and private key, as PEM files")
        }
        var configuration = TLSConfiguration.makeServerConfiguration(
            certificateChain: try Self.certificates(cert, what: "cert=").map { .certificate($0) },
            privateKey: .privateKey(try Self.privateKey(key)))
        configuration.shutdownTimeout = Self.closeBound
        configuration.minimumTLSVersion = minVersion
        configuration.applicationProtocols = alpn
        if let ca {
            configuration.certificateVerification = .noHostnameVerification
            configuration.trustRoots = .certificates(try Self.certificates(ca, what: "ca="))
        }
        return try Self.context(configuration)
    }

    /// How long a close waits for the peer's close_notify after sending its own: not at all, as
    /// RFC 8446 §6.1 allows (Go and curl do the same). With openssl s_server and gnutls-serv as
    /// peers, swift-nio-ssl's wait for theirs always ran to its limit (1 s, then 0.1 s, were
    /// tried), which capped handshakes per second at one per limit; the reason is not known yet.
    static let closeBound = TimeAmount.milliseconds(0)

    private func identity(into configuration: inout TLSConfiguration) throws {
        switch (cert, key) {
        case (let cert?, let key?):
            configuration.certificateChain = try Self.certificates(cert, what: "cert=").map { .certificate($0) }
            configuration.privateKey = .privateKey(try Self.privateKey(key))
        case (nil, nil):
            break
        case (_?, nil):
            throw TransportError(.invalidURL, "cert= is given without key=: give the private key of the certificate too")
        case (nil, _?):
            throw TransportError(.invalidURL, "key= is given without cert=: give the certificate (chain) of the key too")
        }
    }

    private static func context(_ configuration: TLSConfiguration) throws -> NIOSSLContext {
        do {
            return try NIOSSLContext(configuration: configuration)
        } catch {
            throw TransportError(.invalidURL, "the TLS settings were refused: \(error); check that key= is the private key of cert=")
        }
    }

    static func privateKey(_ path: String) throws -> NIOSSLPrivateKey {
        do {
            return try NIOSSLPrivateKey(file: path, format: .pem)
        } catch {
            throw Self.fileError(path, what: "key=", kind: "a PEM private key", error)
        }
    }

    static func certificates(_ path: String, what: String) throws -> [NIOSSLCertificate] {
        let certificates: [NIOSSLCertificate]
        do {
            certificates = try NIOSSLCertificate.fromPEMFile(path)
        } catch {
            throw fileError(path, what: what, kind: "PEM certificates", error)
        }
        guard !certificates.isEmpty else {
            throw TransportError(.invalidURL, "\(what)\(path) holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
        }
        return certificates
    }

    private static func fileError(_ path: String, what: String, kind: String, _ error: any Error) -> TransportError {
        if access(path, F_OK) != 0 {
            return TransportError(.notFound, "\(what)\(path): no such file; give the path of \(kind)")
        }
        if access(path, R_OK) != 0 {
            return TransportError(.permissionDenied, "\(what)\(path) cannot be read by this user; check its permissions")
        }
        return TransportError(.invalidURL, "\(what)\(path) does not hold \(kind): \(error)")
    }
}

/// Client contexts by the options and files they were built from: a file that changes (its size
/// or modification time) makes a new one. At most 32 are kept.
final class ContextCache: Sendable {
    static let shared = ContextCache()
    private let contexts = Locked<[Key: NIOSSLContext]>([:])

    struct Key: Hashable, Sendable {
        var options: [String]
        var files: [String]

        init(settings: TLSSettings) {
            options = [settings.ca ?? "", settings.cert ?? "", settings.key ?? "", settings.alpn.joined(separator: ","),
                       "\(settings.minVersion)", "\(settings.insecure)"]
            files = [settings.ca, settings.cert, settings.key].map { path in
                guard let path else { return "" }
                var info = stat()
                guard stat(path, &info) == 0 else { return "?" }
                return "\(info.st_size):\(info.st_mtim.tv_sec):\(info.st_mtim.tv_nsec):\(info.st_ino)"
            }
        }
    }

    func context(for key: Key) -> NIOSSLContext? { contexts.withLock { $0[key] } }

    func store(_ context: NIOSSLContext, for key: Key) {
        contexts.withLock { contexts in
            if contexts.count >= 32 { contexts.removeAll() }
            contexts[key] = context
        }
    }
}

/// The TLS layers: a client (verifying the server) and a server (presenting a certificate,
/// optionally requiring the client's).
enum TLSLayer {
    /// The handler names in the pipeline.
    static let readyName = "tls.ready"

    /// A client layer for a server named `name` (SNI and the name checked; `nil` for an IP
    /// address, whose certificate must then carry that address).
    static func client(_ context: NIOSSLContext, settings: TLSSettings, serverName: String?, describing: String) -> ProtocolLayer {
        ProtocolLayer(name: "tls", metadata: metadata, mapError: { error in
            mapError(error, describing: describing, serverName: serverName ?? describing, settings: settings, chain: [])
        }) { channel in
            let chain = VerificationRecord()
            let handler = try LegacyVerification.make(context: context, serverHostname: serverName, record: chain)
            let ready = ChannelReady(on: channel, readyWhen: readyFacts)
            try channel.pipeline.syncOperations.addHandler(handler)
            try channel.pipeline.syncOperations.addHandler(ready, name: readyName)
            try channel.pipeline.syncOperations.addHandler(TruncationReporter(describing: describing))
            return ready.future.flatMapErrorThrowing { error in
                throw mapError(error, describing: describing, serverName: serverName ?? describing, settings: settings, chain: chain.certificates)
            }.flatMapThrowing {
                guard !settings.pins.isEmpty else { return }
                // On the event loop: the handler is the pipeline's, read there.
                let presented = (try? channel.pipeline.syncOperations.handler(type: NIOSSLHandler.self))?.peerCertificate.flatMap(pin)
                guard let presented, settings.pins.contains(presented) else {
                    channel.close(promise: nil)
                    throw TransportError(.protocolError, "the public key of \(describing) is \(presented ?? "unreadable"), which is not among the pinned keys "
                                         + "(pin=\(settings.pins.joined(separator: ","))): the server changed its key, or this is not that server")
                }
            }
        }
    }

    /// `sha256/BASE64`: the SHA-256 digest of the certificate's SubjectPublicKeyInfo, as curl's
    /// --pinnedpubkey and HPKP write it.
    static func pin(_ certificate: NIOSSLCertificate) -> String? {
        guard let spki = try? certificate.extractPublicKey().toSPKIBytes() else { return nil }
        return "sha256/" + Data(SHA256.hash(data: spki)).base64EncodedString()
    }

    /// A server layer; with a client CA, every client must present a certificate it issued.
    static func server(_ context: NIOSSLContext, describing: String) -> ProtocolLayer {
        ProtocolLayer(name: "tls", metadata: metadata, mapError: { error in
            TransportError.from(error, context: "the TLS handshake with a client of \(describing)")
        }) { channel in
            let ready = ChannelReady(on: channel, readyWhen: readyFacts)
            try channel.pipeline.syncOperations.addHandler(NIOSSLServerHandler(context: context))
            try channel.pipeline.syncOperations.addHandler(ready, name: readyName)
            try channel.pipeline.syncOperations.addHandler(TruncationReporter(describing: describing))
            return ready.future
        }
    }

    @Sendable static func readyFacts(_ event: Any) -> [String: String]? {
        guard case TLSUserEvent.handshakeCompleted(let negotiated) = event else { return nil }
        return negotiated.map { ["tls.alpn": $0] } ?? [:]
    }

    /// The negotiated version, ALPN protocol and the peer certificate's subject and issuer. On the
    /// channel's event loop. (swift-nio-ssl does not tell the cipher suite.)
    @Sendable static func metadata(_ channel: any Channel) -> [String: String] {
        var extra: [String: String] = [:]
        let pipeline = channel.pipeline.syncOperations
        if let ready = try? pipeline.context(name: readyName).handler as? ChannelReady {
            extra.merge(ready.facts) { _, new in new }
        }
        if let handler = try? pipeline.handler(type: NIOSSLHandler.self) {
            if let version = handler.tlsVersion { extra["tls.version"] = versionName(version) }
            if let peer = handler.peerCertificate {
                extra["tls.peer"] = describe(peer.subjectName)
                extra["tls.issuer"] = describe(peer.issuerName)
                extra["tls.notAfter"] = date(peer.notValidAfter)
                extra["tls.pin"] = pin(peer)
            }
        }
        return extra
    }

    static func versionName(_ version: TLSVersion) -> String {
        switch version {
        case .tlsv1: "TLS 1.0"
        case .tlsv11: "TLS 1.1"
        case .tlsv12: "TLS 1.2"
        case .tlsv13: "TLS 1.3"
        }
    }

    /// `CN=localhost, O=Example`: the parts people recognise, most specific first.
    static func describe(_ name: [SSLCertificateName]) -> String {
        let parts = name.reversed().map { part in "\(label(part.type))=\(part.value)" }
        return parts.isEmpty ? "(empty)" : parts.joined(separator: ", ")
    }

    private static func label(_ type: SSLCertificateNameType) -> String {
        switch type {
        case .commonName: "CN"
        case .organization: "O"
        case .organizationalUnit: "OU"
        case .country: "C"
        case .state: "ST"
        case .city: "L"
        case .emailAddress: "emailAddress"
        default: "name"
        }
    }

    /// A time_t as `2026-11-26 13:05:00 UTC` (gmtime_r).
    static func date(_ time: time_t) -> String {
        var seconds = time
        var parts = tm()
        guard gmtime_r(&seconds, &parts) != nil else { return "\(time)" }
        func two(_ value: Int32) -> String { value < 10 ? "0\(value)" : "\(value)" }
        return "\(parts.tm_year + 1900)-\(two(parts.tm_mon + 1))-\(two(parts.tm_mday)) \(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)) UTC"
    }

    /// Turns a handshake failure into what went wrong and what to do. `chain` holds the
    /// certificates BoringSSL looked at with its verdict on each, so a refused chain can be
    /// explained: expired, not yet valid, self-signed, or issued by an authority not trusted here.
    static func mapError(_ error: any Error, describing: String, serverName: String, settings: TLSSettings,
                         chain: [(trusted: Bool, certificate: NIOSSLCertificate)]) -> TransportError {
        let closedEarly = "\(error)".contains("EOF during handshake") || (error as? TransportError)?.kind == .disconnected
        if closedEarly {
            return TransportError(.protocolError, "\(describing) closed the connection during the TLS handshake: is it a TLS server? "
                                  + "(a plain-TCP server, or one that refused our TLS version, ALPN protocols or client certificate, does this)")
        }
        if let error = error as? TransportError {
            if error.kind == .disconnected {
                return TransportError(.protocolError, "\(describing) closed the connection during the TLS handshake: is it a TLS server? "
                                      + "(a plain-TCP server, or one that refused our TLS version or client certificate, does this)")
            }
            return error
        }
        let text = "\(error)"
        if let extra = error as? NIOSSLExtraError, text.contains("Couldn't find") {
            _ = extra
            let names = chain.last.map { alternativeNames($0.certificate) } ?? ""
            return TransportError(.protocolError, "the certificate of \(describing) is not for '\(serverName)'\(names.isEmpty ? "" : "; it names \(names)")"
                                  + ": connect by one of its names, or give the name it carries with serverName=")
        }
        if text.contains("CERTIFICATE_VERIFY_FAILED"), let failed = chain.first(where: { !$0.trusted }) ?? chain.first {
            let certificate = failed.certificate
            let subject = describe(certificate.subjectName)
            let now = time(nil)
            if certificate.notValidAfter < now {
                return TransportError(.protocolError, "the certificate of \(describing) (\(subject)) expired on \(date(certificate.notValidAfter)); "
                                      + "it is \(date(now)) now. The server must renew it (or this machine's clock is wrong)")
            }
            if certificate.notValidBefore > now {
                return TransportError(.protocolError, "the certificate of \(describing) (\(subject)) is not valid before \(date(certificate.notValidBefore)); "
                                      + "it is \(date(now)) now. Check this machine's clock")
            }
            let issuer = describe(certificate.issuerName)
            let isLeaf = chain.last.map { $0.certificate == certificate } ?? true
            if issuer == subject && !isLeaf {
                return TransportError(.protocolError, "the certificate chain of \(describing) ends in '\(subject)', a self-signed authority not trusted here: "
                                      + "pass that authority's certificate as ca=PATH\(settings.ca.map { " (ca=\($0) does not hold it)" } ?? "")")
            }
            if issuer == subject {
                return TransportError(.protocolError, "the certificate of \(describing) is self-signed (\(subject)) and not trusted here: "
                                      + "pass its certificate (or the CA that made it) as ca=PATH\(settings.ca.map { " (ca=\($0) does not hold it)" } ?? "")")
            }
            return TransportError(.protocolError, "the certificate of \(describing) (\(subject)) was issued by '\(issuer)', which is not trusted here: "
                                  + "pass that authority's certificate as ca=PATH\(settings.ca.map { " (ca=\($0) does not hold it)" } ?? "")")
        }
        if text.contains("CERTIFICATE_REQUIRED") {
            return certificateRequired(describing)
        }
        if text.contains("SSLV3_ALERT_HANDSHAKE_FAILURE") {
            return TransportError(.protocolError, "\(describing) refused the handshake: "
                                  + (settings.cert == nil ? "it may want a client certificate (cert=PATH and key=PATH), or " : "")
                                  + "it shares no cipher suite, signature algorithm or TLS version with this end (minVersion=)")
        }
        if text.contains("WRONG_VERSION_NUMBER") || text.contains("PACKET_LENGTH_TOO_LONG") || text.contains("HTTP_REQUEST") {
            return TransportError(.protocolError, "\(describing) does not speak TLS (its reply is not a TLS record): is it a plain-TCP server? Use tcp:// for it")
        }
        if text.contains("UNSUPPORTED_PROTOCOL") || text.contains("PROTOCOL_VERSION") {
            return TransportError(.protocolError, "\(describing) and this end share no TLS version (minVersion=\(settings.minVersion == .tlsv13 ? "1.3" : "1.2"))")
        }
        if text.contains("NO_APPLICATION_PROTOCOL") {
            return TransportError(.protocolError, "\(describing) accepts none of the ALPN protocols offered (alpn=\(settings.alpn.joined(separator: ",")))")
        }
        return TransportError(.protocolError, "the TLS handshake with \(describing) failed: \(text)")
    }

    static func certificateRequired(_ describing: String) -> TransportError {
        TransportError(.permissionDenied, "\(describing) wants a client certificate it trusts: give cert=PATH and key=PATH")
    }

    static func alternativeNames(_ certificate: NIOSSLCertificate) -> String {
        let subject = describe(certificate.subjectName)
        let names = "\(certificate)".split(separator: ";").first { $0.hasPrefix("alternative_names=") }
            .map { String($0.dropFirst("alternative_names=".count).filter { $0 != ">" }) }
        return "\(subject)\(names.map { ", alternative names \($0)" } ?? "")"
    }
}

/// The certificates BoringSSL checked during one handshake, with its verdict on each.
final class VerificationRecord: Sendable {
    private let seen = Locked<[(trusted: Bool, certificate: NIOSSLCertificate)]>([])
    var certificates: [(trusted: Bool, certificate: NIOSSLCertificate)] { seen.withLock { $0 } }
    func record(_ trusted: Bool, _ certificate: NIOSSLCertificate) { seen.withLock { $0.append((trusted, certificate)) } }
}

/// swift-nio-ssl's per-certificate verification callback is the one way to learn which
/// certificate BoringSSL refused and why, and it is deprecated (for the callbacks that replace
/// verification). The callback here changes no verdict; it only records. Called through a
/// protocol so the deprecation stays inside this one place.
protocol LegacyVerificationMaking {
    static func clientHandler(context: NIOSSLContext, serverHostname: String?, record: VerificationRecord) throws -> NIOSSLClientHandler
}

enum LegacyVerification: LegacyVerificationMaking {
    @available(*, deprecated, message: "records BoringSSL's verdicts through swift-nio-ssl's deprecated per-certificate callback")
    static func clientHandler(context: NIOSSLContext, serverHostname: String?, record: VerificationRecord) throws -> NIOSSLClientHandler {
        try NIOSSLClientHandler(context: context, serverHostname: serverHostname) { verdict, certificate in
            record.record(verdict == .certificateVerified, certificate)
            return verdict
        }
    }

    static func make(context: NIOSSLContext, serverHostname: String?, record: VerificationRecord) throws -> NIOSSLClientHandler {
        try (Self.self as any LegacyVerificationMaking.Type).clientHandler(context: context, serverHostname: serverHostname, record: record)
    }
}

/// Tells a clean end (the peer's close_notify) from a peer that just dropped the connection,
/// which could have cut the data short: tls:// ends its stream with close_notify.
final class TruncationReporter: ChannelInboundHandler, Sendable {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer
    let describing: String

    init(describing: String) { self.describing = describing }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        context.fireChannelRead(data)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        if let error = error as? NIOSSLError, case .uncleanShutdown = error {
            context.fireErrorCaught(TransportError(.disconnected, "\(describing) closed the connection without a TLS close_notify: "
                                                   + "the data may have been cut short (a truncation), or the peer crashed"))
            return
        }
        if "\(error)".contains("CERTIFICATE_REQUIRED") {
            // TLS 1.3: the server judges the client's certificate after the client's handshake ended.
            context.fireErrorCaught(TLSLayer.certificateRequired(describing))
            return
        }
        context.fireErrorCaught(error)
    }
}
