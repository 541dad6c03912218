import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// The tool over TLS against `openssl s_server` with a self-signed certificate made by
/// `openssl req` (fast: an EC key), the way a user reaches a device with its own certificate.
@Suite("transportkit connect tls://", .serialized)
struct TLSCLITests {
    /// A self-signed certificate for localhost and the `openssl s_server` that presents it,
    /// reversing lines; runs `body` with its port.
    func withServer(_ body: (Int, String) async throws -> Void) async throws {
        let folder = temporaryPath("tls-cli")
        try FileManager.default.createDirectory(atPath: folder, withIntermediateDirectories: true)
        let made = try await Self.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                                       "-keyout", "\(folder)/key.pem", "-out", "\(folder)/cert.pem", "-days", "2", "-subj", "/CN=localhost",
                                       "-addext", "subjectAltName=DNS:localhost"])
        #expect(made == 0)
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = listener.url.port ?? 0
        try await listener.close()
        let server = Process()
        server.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        server.arguments = ["s_server", "-accept", "127.0.0.1:\(port)", "-cert", "\(folder)/cert.pem", "-key", "\(folder)/key.pem", "-rev", "-quiet"]
        server.standardInput = Pipe()
        server.standardOutput = FileHandle.nullDevice
        server.standardError = FileHandle.nullDevice
        try server.run()
        defer { kill(server.processIdentifier, SIGKILL) }
        // Ready when a connect succeeds (the probe is a failed handshake to s_server, which goes on).
        #expect(await eventually(10) { portAccepts(port) })
        try await body(port, "\(folder)/cert.pem")
    }

    static func run(_ arguments: [String]) async throws -> Int32 {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = arguments
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        while process.isRunning { try await Task.sleep(for: .milliseconds(20)) }
        return process.terminationStatus
    }

    @Test func theCertificateIsCheckedAndInsecureIsWarnedAboutOnEveryUse() async throws {
        try await withServer { port, cert in
            let refused = try await CLI.run(["connect", "tls://localhost:\(port)"], stdin: Array("hi\n".utf8))
            #expect(refused.status == 1)
            #expect(refused.stderr.contains("self-signed") && refused.stderr.contains("ca=PATH"), "\(refused.stderr)")
            #expect(refused.stdout.isEmpty)

            let trusted = try await CLI.run(["connect", "tls://localhost:\(port)?ca=\(cert)"], stdin: Array("hello\n".utf8))
            #expect(trusted.status == 0, "\(trusted.stderr)")
            #expect(trusted.text == "olleh\n")
            #expect(trusted.stderr.isEmpty, "\(trusted.stderr)")

            for _ in 0..<2 {
                let insecure = try await CLI.run(["connect", "tls://localhost:\(port)?insecure=true"], stdin: Array("abc\n".utf8))
                #expect(insecure.status == 0, "\(insecure.stderr)")
                #expect(insecure.text == "cba\n")
                let warnings = insecure.stderr.components(separatedBy: "warning: insecure=true").count - 1
                #expect(warnings == 1, "one warning per use, in the tool's words: \(insecure.stderr)")
            }
        }
    }
}
