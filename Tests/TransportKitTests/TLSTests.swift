import Foundation
import Glibc
import TestSupport
import Testing
@_spi(Plugins) @testable import TransportKit
@testable import TransportKitSerial

/// A program no one here wrote, as the other end of a test (shared/PEERS.md): started with its
/// arguments, its output kept in a log, killed at the end.
final class Peer: @unchecked Sendable {
    // Process is not Sendable; only the test that made the peer touches it.
    let process = Process()
    let log: String

    init(_ arguments: [String], environment: [String: String] = [:], stdinOpen: Bool = true) throws {
        log = temporaryPath("peer.log")
        _ = FileManager.default.createFile(atPath: log, contents: nil)
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = arguments
        process.environment = ProcessInfo.processInfo.environment.merging(environment) { _, new in new }
        let output = try FileHandle(forWritingTo: URL(fileURLWithPath: log))
        process.standardOutput = output
        process.standardError = output
        // openssl s_server and gnutls-serv end when their input ends; keep it open.
        process.standardInput = stdinOpen ? Pipe() : FileHandle.nullDevice
        try process.run()
    }

    /// Waits until something accepts on 127.0.0.1:`port`.
    func waitForPort(_ port: Int, seconds: Double = 10) async throws {
        let limit = ContinuousClock.now + .seconds(seconds)
        while ContinuousClock.now < limit {
            if portAccepts(port) { return }
            if !process.isRunning { break }
            try await Task.sleep(for: .milliseconds(50))
        }
        throw TransportError(.timedOut, "\(process.arguments ?? []) did not listen on port \(port): \(output)")
    }

    var output: String { (try? String(contentsOfFile: log, encoding: .utf8)) ?? "" }

    /// Sends `signal` and returns (Foundation's waitUntilExit spins a run loop, which stalls a
    /// task on the cooperative pool).
    func kill(_ signal: Int32 = SIGTERM) {
        if process.isRunning { Glibc.kill(process.processIdentifier, signal) }
    }

    /// Polls until `process` ends, without a run loop.
    static func waitForExit(_ process: Process, seconds: Double = 20) {
        var waited = 0.0
        while process.isRunning && waited < seconds {
            usleep(10_000)
            waited += 0.01
        }
    }

    deinit { if process.isRunning { Glibc.kill(process.processIdentifier, SIGKILL) } }

    /// A port nothing listens on right now.
    static func freePort() -> Int {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { Glibc.close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        _ = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, length) }
        }
        _ = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        return Int(UInt16(bigEndian: address.sin_port))
    }
}

/// Throw-away certificates from python3-trustme (Peers/certs.py), made once per test process on
/// a thread of its own (RSA key generation takes seconds; the cooperative pool must not wait).
enum Certificates {
    static let made = Task<String, Never> {
        await withCheckedContinuation { continuation in
            Thread {
                let folder = temporaryPath("certs")
                let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers/certs.py").path
                let process = Process()
                process.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
                process.arguments = [script, folder]
                do {
                    try process.run()
                    Peer.waitForExit(process, seconds: 120)
                } catch {
                    Issue.record("cannot run \(script): \(error); Scripts/setup installs python3-trustme")
                }
                continuation.resume(returning: folder)
            }.start()
        }
    }

    static func path(_ name: String) async -> String { "\(await made.value)/\(name)" }
}

/// `openssl s_server` on a free port with the given certificate, reversing each line it gets.
func opensslServer(cert: String = "cert.pem", key: String = "key.pem", extra: [String] = []) async throws -> (Peer, Int) {
    let port = Peer.freePort()
    let peer = try Peer(["openssl", "s_server", "-accept", "127.0.0.1:\(port)", "-cert", await Certificates.path(cert), "-key", await Certificates.path(key),
                         "-rev", "-quiet"] + extra)
    try await peer.waitForPort(port)
    return (peer, port)
}

@Suite("tls:// against openssl, gnutls and socat", .serialized)
struct TLSTests {

    @Test func aVerifiedConnectionToOpensslCarriesBytesAndTellsTheSession() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)&timeout=10")
        try await connection.write("hello\n")
        let reply = try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10))
        #expect(reply.map { String(decoding: $0, as: UTF8.self) } == "olleh")
        #expect(connection.metadata.extra["tls.version"] == "TLS 1.3")
        #expect(connection.metadata.extra["tls.peer"]?.contains("CN=localhost") == true)
        #expect(connection.metadata.extra["tls.issuer"]?.contains("TransportKit test CA") == true)
        try await connection.close()
        #expect(await eventually { Support.openSockets(port: port) == 0 })
    }

    @Test func anIPAddressIsCheckedAgainstTheCertificatesAddresses() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "tls://127.0.0.1:\(port)?ca=\(ca)&minVersion=1.3")
        try await connection.write("ab\n")
        #expect(try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("ba".utf8))
        try await connection.close()
    }

    @Test func anUntrustedIssuerIsNamedWithTheOptionThatFixesIt() async throws {
        let (server, port) = try await opensslServer()
        defer { server.kill() }
        let error = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(port)") }
        #expect(error?.message.contains("TransportKit test CA") == true)
        #expect(error?.message.contains("ca=PATH") == true)
        let other = await expectTransportError(.protocolError) {
            try await Transport.connect(to: "tls://localhost:\(port)?ca=\(await Certificates.path("client-ca.pem"))")
        }
        #expect(other?.message.contains("does not hold it") == true)
        #expect(await eventually { Support.openSockets(port: port) == 0 })
    }

    @Test func aNameMismatchGivesBothNames() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer(cert: "wrong-cert.pem", key: "wrong-key.pem")
        defer { server.kill() }
        let error = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)") }
        #expect(error?.message.contains("not for 'localhost'") == true)
        #expect(error?.message.contains("example.com") == true)
        // The name the certificate carries, given as serverName=, passes.
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)&serverName=example.com")
        try await connection.close()
    }

    @Test func anExpiredCertificateGivesItsDate() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer(cert: "expired-cert.pem", key: "expired-key.pem")
        defer { server.kill() }
        let error = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)") }
        #expect(error?.message.contains("expired on 2021-01-01") == true)
    }

    @Test func aSelfSignedCertificateIsCalledThat() async throws {
        let (server, port) = try await opensslServer(cert: "self-cert.pem", key: "self-key.pem")
        defer { server.kill() }
        let error = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(port)") }
        #expect(error?.message.contains("self-signed") == true)
        // insecure=true skips every check.
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?insecure=true")
        try await connection.write("xy\n")
        #expect(try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("yx".utf8))
        try await connection.close()
    }

    @Test func aPlainTCPServerIsRecognised() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let serving = Task {
            let peer = try #require(try await listener.accept())
            try await peer.write("220 plain text server ready\r\n")
            _ = try? await peer.read(timeout: .seconds(5))
            try await peer.close()
        }
        let error = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://127.0.0.1:\(port)?timeout=5") }
        #expect(error?.message.contains("does not speak TLS") == true)
        try await serving.value
        try await listener.close()
    }

    @Test func aServerThatStopsMidHandshakeTimesOutWithinTheConnectTimeout() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let silent = Task { try await listener.accept() }
        let start = ContinuousClock.now
        await expectTransportError(.timedOut) { try await Transport.connect(to: "tls://127.0.0.1:\(port)?timeout=1") }
        #expect(ContinuousClock.now - start < .seconds(3))
        let peer = try #require(try await silent.value)
        // The client's hello arrived, then it hung up.
        var received = 0
        while let chunk = try await peer.read(timeout: .seconds(5)) { received += chunk.count }
        #expect(received > 0)
        try await peer.close()
        try await listener.close()
        #expect(await eventually { Support.openSockets(port: port) == 0 })
    }

    @Test func aClientCertificateIsPresentedWhenAsked() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer(extra: ["-Verify", "1", "-CAfile", await Certificates.path("client-ca.pem")])
        defer { server.kill() }
        let url = "tls://localhost:\(port)?ca=\(ca)&cert=\(await Certificates.path("client-cert.pem"))&key=\(await Certificates.path("client-key.pem"))"
        let connection = try await Transport.connect(to: url)
        try await connection.write("abc\n")
        #expect(try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("cba".utf8))
        try await connection.close()
        // Without one: TLS 1.3 ends the client's handshake before the server judges it, so the
        // refusal arrives on the first read, and says what to do.
        let bare = try? await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)")
        if let bare {
            try? await bare.write("abc\n")
            let error = await expectTransportError(.permissionDenied) { try await bare.read(timeout: .seconds(10)) }
            #expect(error?.message.contains("cert=PATH") == true)
            try? await bare.close()
        }
    }

    @Test func aPinnedKeyIsRequiredAndCanStandInForTheCA() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer()
        defer { server.kill() }
        let first = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)")
        let pin = try #require(first.metadata.extra["tls.pin"])
        #expect(pin.hasPrefix("sha256/") && pin.count == 51)
        try await first.close()
        let pinned = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)&pin=\(pin)")
        try await pinned.close()
        let other = "sha256/" + String(repeating: "A", count: 43) + "="
        let wrong = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)&pin=\(other)") }
        #expect(wrong?.message.contains("not among the pinned keys") == true, "\(wrong?.message ?? "")")
        // A device's own key, pinned, without a CA: insecure=true turns the chain checks off, the pin still holds.
        let (lone, lonePort) = try await opensslServer(cert: "self-cert.pem", key: "self-key.pem")
        defer { lone.kill() }
        let probe = try await Transport.connect(to: "tls://localhost:\(lonePort)?insecure=true")
        let lonePin = try #require(probe.metadata.extra["tls.pin"])
        try await probe.close()
        let trusted = try await Transport.connect(to: "tls://localhost:\(lonePort)?insecure=true&pin=\(lonePin)")
        try await trusted.write("pin\n")
        #expect(try await trusted.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("nip".utf8))
        try await trusted.close()
        await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(lonePort)?insecure=true&pin=\(pin)") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls://localhost:\(port)?pin=sha1/abc") }
    }

    @Test func aChangedCAFileIsReadAgain() async throws {
        let (server, port) = try await opensslServer()
        defer { server.kill() }
        let path = temporaryPath("ca.pem")
        try FileManager.default.copyItem(atPath: await Certificates.path("client-ca.pem"), toPath: path)
        await expectTransportError(.protocolError) { try await Transport.connect(to: "tls://localhost:\(port)?ca=\(path)") }
        try FileManager.default.removeItem(atPath: path)
        try FileManager.default.copyItem(atPath: await Certificates.path("ca.pem"), toPath: path)
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(path)")
        try await connection.close()
    }

    @Test func alpnIsNegotiatedAndReported() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer(extra: ["-alpn", "foo,bar"])
        defer { server.kill() }
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)&alpn=bar")
        #expect(connection.metadata.extra["tls.alpn"] == "bar")
        try await connection.close()
    }

    @Test func gnutlsIsASecondStackThatAgrees() async throws {
        let ca = await Certificates.path("ca.pem")
        let port = Peer.freePort()
        let server = try Peer(["gnutls-serv", "--echo", "-p", "\(port)", "--x509certfile", await Certificates.path("cert.pem"),
                               "--x509keyfile", await Certificates.path("key.pem")])
        defer { server.kill() }
        try await server.waitForPort(port)
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)")
        try await connection.write("echo me\n")
        #expect(try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("echo me".utf8))
        #expect(connection.metadata.extra["tls.version"]?.hasPrefix("TLS 1.") == true)
        try await connection.close()
    }

    @Test func aPeerThatVanishesWithoutCloseNotifyIsReportedAsPossibleTruncation() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer()
        let connection = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(ca)")
        try await connection.write("one\n")
        #expect(try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("eno".utf8))
        server.kill(SIGKILL)
        let error = await expectTransportError(.disconnected) { try await connection.read(timeout: .seconds(10)) }
        #expect(error?.message.contains("close_notify") == true)
        try? await connection.close()
    }

    /// tls+rfc2217://: RFC 2217 over TLS (the tls+ wrapper puts TLS beneath the Telnet layer), to
    /// pyserial's RFC 2217 server behind socat's TLS termination.
    @Test func rfc2217RunsOverTLS() async throws {
        let ca = await Certificates.path("ca.pem")
        let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers/rfc2217_server.py").path
        try await withPeer([script, "loop://"]) { plain in
            let port = Peer.freePort()
            let terminator = try Peer(["socat", "OPENSSL-LISTEN:\(port),bind=127.0.0.1,reuseaddr,fork,verify=0,cert=\(await Certificates.path("cert.pem")),"
                                       + "key=\(await Certificates.path("key.pem"))", "TCP:127.0.0.1:\(plain)"])
            defer { terminator.kill() }
            try await terminator.waitForPort(port)
            let connection = try await Transport.connect(to: "tls+rfc2217://localhost:\(port)?baud=19200&tls.ca=\(ca)")
            #expect(connection.metadata.extra["tls.version"] != nil && connection.metadata.extra["rfc2217"] == "COM-PORT-OPTION", "\(connection.metadata.extra)")
            #expect(try await connection.serialPort?.settings().baudRate == 19200)
            try await connection.write([0x41, 0xff, 0x42])
            #expect(try await connection.readFrame(.fixedLength(3), timeout: .seconds(10)) == [0x41, 0xff, 0x42], "loop:// echoes through TLS and Telnet")
            try await connection.close()
            let untrusted = await expectTransportError(.protocolError) { try await Transport.connect(to: "tls+rfc2217://localhost:\(port)") }
            #expect(untrusted?.message.contains("not trusted here") == true, "certificates are checked: \(untrusted?.message ?? "")")
        }
    }

    @Test func tlsWrapsAUnixSocket() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await opensslServer()
        defer { server.kill() }
        let path = temporaryPath("tls.sock")
        let relay = try Peer(["socat", "UNIX-LISTEN:\(path),fork", "TCP:127.0.0.1:\(port)"])
        defer { relay.kill() }
        #expect(await eventually(10) { FileManager.default.fileExists(atPath: path) })
        let connection = try await Transport.connect(to: "tls+unix://\(path)?tls.serverName=localhost&tls.ca=\(ca)")
        try await connection.write("wrapped\n")
        #expect(try await connection.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("depparw".utf8))
        #expect(connection.metadata.extra["tls.version"] == "TLS 1.3")
        try await connection.close()
        let refused = await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls+unix://\(path)") }
        #expect(refused?.message.contains("tls.serverName=") == true)
        // A failed handshake through the relay is the handshake's error, not the socket pair's.
        let untrusted = await expectTransportError(.protocolError) {
            try await Transport.connect(to: "tls+unix://\(path)?tls.serverName=localhost")
        }
        #expect(untrusted?.message.contains("not trusted here") == true, "\(untrusted?.message ?? "")")
        // Over tcp:// the inner URL's host is the name checked.
        let overTCP = try await Transport.connect(to: "tls+tcp://localhost:\(port)?tls.ca=\(ca)")
        try await overTCP.write("tcp\n")
        #expect(try await overTCP.readFrame(.delimiter("\n"), timeout: .seconds(10)) == Array("pct".utf8))
        try await overTCP.close()
    }

    @Test func badTLSOptionsAreRefusedBeforeAnyIO() async throws {
        let missing = await expectTransportError(.notFound) { try await Transport.connect(to: "tls://localhost:1?ca=/nonexistent/ca.pem") }
        #expect(missing?.message.contains("no such file") == true)
        let notPEM = await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls://localhost:1?ca=/etc/hostname") }
        #expect(notPEM?.message.contains("ca=/etc/hostname") == true)
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls://localhost:1?cert=\(await Certificates.path("cert.pem"))") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls://localhost:1?minVersion=1.1") }
        await expectTransportError(.invalidURL) { try await Transport.listen(on: "tls://127.0.0.1:0") }
        await expectTransportError(.invalidURL) { try await Transport.listen(on: "tls://127.0.0.1:0?insecure=true&cert=a&key=b") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls://localhost:1?handshakeTimeout=3") }
        let ipName = await expectTransportError(.invalidURL) { try await Transport.connect(to: "tls://localhost:1?serverName=10.0.0.1") }
        #expect(ipName?.message.contains("IP address") == true)
        let contradiction = await expectTransportError(.invalidURL) {
            try await Transport.connect(to: "tls://localhost:1?insecure=true&ca=\(await Certificates.path("ca.pem"))")
        }
        #expect(contradiction?.message.contains("contradict") == true)
        let mismatched = "cert=\(await Certificates.path("cert.pem"))&key=\(await Certificates.path("client-key.pem"))"
        await expectTransportError(.invalidURL) { try await Transport.listen(on: "tls://127.0.0.1:0?\(mismatched)") }
    }
}

@Suite("tls:// listening, against openssl s_client", .serialized)
struct TLSListenerTests {
    var identity: String {
        get async { "cert=\(await Certificates.path("cert.pem"))&key=\(await Certificates.path("key.pem"))" }
    }

    /// `openssl s_client` that verifies our listener, sends `input` and prints what it gets.
    func client(_ port: Int, input: String, extra: [String] = []) async throws -> (status: Int32, output: String) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        process.arguments = ["s_client", "-connect", "127.0.0.1:\(port)", "-servername", "localhost", "-CAfile", await Certificates.path("ca.pem"),
                             "-verify_return_error", "-quiet", "-ign_eof"] + extra
        let stdin = Pipe()
        let stdout = Pipe()
        process.standardInput = stdin
        process.standardOutput = stdout
        process.standardError = stdout
        try process.run()
        // -ign_eof: it stays after its input ends, until the server closes.
        stdin.fileHandleForWriting.write(Data(input.utf8))
        try? stdin.fileHandleForWriting.close()
        // Not FileHandle.readDataToEndOfFile: it traps on EINTR.
        let output = await Support.readAll(stdout.fileHandleForReading.fileDescriptor)
        await Support.offPool { Peer.waitForExit(process) }
        return (process.isRunning ? -1 : process.terminationStatus, String(decoding: output, as: UTF8.self))
    }

    @Test func opensslVerifiesTheListenerAndItsBytesArrive() async throws {
        let listener = try await Transport.listen(on: "tls://127.0.0.1:0?\(await identity)")
        let port = try #require(listener.url.port)
        #expect(listener.exposure?.authenticated == false)
        let serving = Task {
            let peer = try #require(try await listener.accept())
            #expect(peer.url.scheme == "tls")
            #expect(peer.metadata.extra["tls.version"] == "TLS 1.3")
            let line = try #require(try await peer.readFrame(.delimiter("\n"), timeout: .seconds(10)))
            try await peer.write(Array(line.reversed()) + Array("\n".utf8))
            try await peer.close()
        }
        let result = try await client(port, input: "hello\n")
        try await serving.value
        #expect(result.output.contains("olleh"))
        try await listener.close()
    }

    @Test func requiredClientCertificatesKeepStrangersOut() async throws {
        let listener = try await Transport.listen(on: "tls://127.0.0.1:0?\(await identity)&ca=\(await Certificates.path("client-ca.pem"))&handshakeTimeout=2")
        let port = try #require(listener.url.port)
        #expect(listener.exposure?.authenticated == true)
        let accepted = Task { try await listener.accept() }
        // A stranger without a certificate never reaches accept().
        let stranger = try await client(port, input: "let me in\n")
        #expect(!stranger.output.contains("let me in"))
        let known = Task {
            try await client(port, input: "ping\n", extra: ["-cert", await Certificates.path("client-cert.pem"), "-key", await Certificates.path("client-key.pem")])
        }
        let peer = try #require(try await accepted.value)
        #expect(peer.metadata.extra["tls.peer"]?.contains("CN=client") == true)
        #expect(try await peer.read(timeout: .seconds(10)) == Array("ping\n".utf8))
        try await peer.write("pong\n")
        try await peer.close()
        #expect(try await known.value.output.contains("pong"))
        try await listener.close()
    }

    /// `tls+rfc2217://` listening: RFC 2217 over TLS, client certificates required (as ser2net with
    /// gensio's TLS). A stranger's openssl is turned away; a client with a certificate sets the
    /// line of the pty the session serves.
    @Test func rfc2217ListensOverTLSAndRequiresClientCertificates() async throws {
        let clientCA = await Certificates.path("client-ca.pem")
        let listener = try await Transport.listen(on: "tls+rfc2217://127.0.0.1:0?tls.\(await identity.replacingOccurrences(of: "&", with: "&tls."))&tls.ca=\(clientCA)")
        #expect(listener.url.scheme == "tls" && listener.url.inner?.scheme == "rfc2217", "\(listener.url)")
        #expect(listener.exposure?.authenticated == true, "client certificates required: no stranger warning")
        let port = try #require(listener.url.innermost.port)
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let serving = Task {
            let client = try #require(try await listener.accept())
            let session = try #require(client.rfc2217Session, "an accepted tls+rfc2217 connection carries the client's COM-PORT requests")
            let device = try await Transport.connect(to: "tty://\(pty.path)")
            let port = try #require(device.serialPort)
            let served = Task { await session.serve(port) }
            let bytes = try await client.readFrame(.fixedLength(8), timeout: .seconds(10))
            try await client.close()
            await served.value
            try await device.close()
            return bytes
        }
        // openssl without a client certificate: the handshake is refused, nothing is accepted.
        let stranger = try await client(port, input: "let me in\n")
        #expect(stranger.output.contains("alert"), "refused in the handshake: \(stranger.output)")
        let ca = await Certificates.path("ca.pem")
        let mine = "tls.cert=\(await Certificates.path("client-cert.pem"))&tls.key=\(await Certificates.path("client-key.pem"))"
        let connection = try await Transport.connect(to: "tls+rfc2217://localhost:\(port)?baud=19200&tls.ca=\(ca)&\(mine)")
        #expect(try pty.termios2().c_ospeed == 19200, "the client's setting reached the served port")
        try await connection.write("over TLS")
        #expect(try await serving.value == Array("over TLS".utf8))
        try await connection.close()
        try await listener.close()

        // Refused before listening: no client certificates asked for, or a wrapped URL with no protocol to run TLS beneath.
        let noCA = await expectTransportError(.invalidURL) { try await Transport.listen(on: "tls+rfc2217://127.0.0.1:0?tls.\(await identity.replacingOccurrences(of: "&", with: "&tls."))") }
        #expect(noCA?.message.contains("requires client certificates") == true, "\(String(describing: noCA))")
        let overTCP = await expectTransportError(.unsupported) {
            try await Transport.listen(on: "tls+tcp://127.0.0.1:0?tls.\(await identity.replacingOccurrences(of: "&", with: "&tls."))&tls.ca=\(clientCA)")
        }
        #expect(overTCP?.message.contains("tls://ADDRESS:PORT") == true, "\(String(describing: overTCP))")
        let clientOnly = await expectTransportError(.invalidURL) {
            try await Transport.listen(on: "tls+rfc2217://127.0.0.1:0?tls.\(await identity.replacingOccurrences(of: "&", with: "&tls."))&tls.ca=\(clientCA)&tls.serverName=x")
        }
        #expect(clientOnly?.message.contains("option 'tls.serverName' is not used by this mode") == true, "\(String(describing: clientOnly))")
        let noKey = await expectTransportError(.invalidURL) { try await Transport.listen(on: "tls+rfc2217://127.0.0.1:0?tls.ca=\(clientCA)") }
        #expect(noKey?.message.contains("tls.cert=PATH and tls.key=PATH") == true, "\(String(describing: noKey))")
    }

    @Test func aSilentClientDoesNotHoldUpTheNext() async throws {
        let listener = try await Transport.listen(on: "tls://127.0.0.1:0?\(await identity)&handshakeTimeout=30")
        let port = try #require(listener.url.port)
        let silent = Support.rawConnect(port: port)
        #expect(silent >= 0)
        defer { Glibc.close(silent) }
        let accepted = Task { try await listener.accept() }
        try await Task.sleep(for: .milliseconds(200))
        let client = try await Transport.connect(to: "tls://localhost:\(port)?ca=\(await Certificates.path("ca.pem"))&timeout=10")
        let peer = try #require(try await accepted.value)
        try await client.write("first\n")
        #expect(try await peer.read(timeout: .seconds(10)) == Array("first\n".utf8))
        try await client.close()
        try await peer.close()
        try await listener.close()
        #expect(await eventually { Support.openSockets(port: port, excluding: [silent]) == 0 })
    }
}

@Suite("SDK seams: server-owned query items, a wrapper sharing a scheme's name, one deadline race")
struct ProtocolSeamTests {
    struct ResourcePlugin: TransportPlugin {
        static let token = URLOption.string("mode", help: "an option of the scheme's own")
        var schemes: [Scheme] {
            var descriptor = SchemeDescriptor(scheme: "res", summary: "a resource on a server", grammar: "res://HOST/PATH", host: .required,
                                              port: .optional, path: .optional, options: [Self.token])
            descriptor.serverQuery = true
            return [Scheme(descriptor) { request in
                let items = request.serverQuery.map { "\($0.name)=\($0.value)" }.joined(separator: "&")
                let connection = try await request.connect(to: TransportURL("loop://"))
                connection.updateMetadata { $0.extra["sent"] = items; $0.extra["mode"] = request[Self.token] ?? "" }
                return connection
            }]
        }
    }

    @Test func undeclaredQueryItemsGoToTheServerAndDeclaredOnesNever() async throws {
        let registry = try TransportRegistry(plugins: [LoopPlugin(), ResourcePlugin()])
        let connection = try await registry.connect(to: "res://example.com/feed?token=a%20b&mode=fast&server.mode=slow&timeout=3")
        #expect(connection.metadata.extra["sent"] == "token=a b&mode=slow")
        #expect(connection.metadata.extra["mode"] == "fast")
        try await connection.close()
    }

    @Test func aWrapperAndASchemeMayShareAName() async throws {
        let registry = Transport.registry
        #expect(try registry.resolve("tls://localhost:443").scheme.wraps == false)
        #expect(try registry.resolve("tls+unix:///tmp/x?tls.serverName=x").scheme.wraps == true)
        #expect(registry.schemes.filter { $0.scheme == "tls" }.count == 2)
    }

    @Test func withDeadlineReturnsTheResultOrTheErrorOnTime() async throws {
        let quick = try await withTimeout(.seconds(5), TransportError(.timedOut, "slow")) { 42 }
        #expect(quick == 42)
        let start = ContinuousClock.now
        await expectTransportError(.timedOut) {
            try await withTimeout(.milliseconds(100), TransportError(.timedOut, "slow")) { try await Task.sleep(for: .seconds(30)) }
        }
        #expect(ContinuousClock.now - start < .seconds(5))
        let done = await uncancellable { 7 }
        #expect(done == 7)
    }
}
