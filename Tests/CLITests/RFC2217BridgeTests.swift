import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// `transportkit bridge --listen rfc2217://…` as an RFC 2217 server, against clients no one here
/// wrote (Peers/rfc2217_client.py): pyserial (every answer checked: it waits for each at open and
/// compares it with its request), gensiot and cyclades-ser-cli, in front of a pty whose termios
/// the script reads.
@Suite("transportkit bridge as an RFC 2217 server")
struct RFC2217BridgeTests {
    static let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers/rfc2217_client.py").path

    @Test func pyserialOpensThePortThroughTheBridgeAndEveryAnswerMatches() async throws {
        await Self.expectChecks("pyserial", ["settings", "to-device", "from-device", "lines", "baud-at-run-time", "purge", "break"])
    }

    /// gensio's own client (gensiot 2.6, telnet(rfc2217)): its escape keys send SETs, queries and
    /// Telnet's break key.
    @Test func gensiotSetsTheLineQueriesItAndSendsItsBreakKey() async throws {
        await Self.expectChecks("gensiot", ["to-device", "from-device", "settings", "settings-asked", "queries", "break-key", "quit"])
    }

    /// cyclades-serial-client 0.94: a local pty in front of the bridge; its LD_PRELOAD library
    /// turns an application's tcsetattr into SETs (as root: it reads /etc/cyclades-devices, which
    /// the script binds over in a mount namespace of its own).
    @Test func cycladesSerialClientsPtyCarriesBytesAndItsTcsetattrReachesThePort() async throws {
        await Self.expectChecks("cyclades", ["to-device", "from-device"] + (getuid() == 0 ? ["settings"] : []))
    }

    /// The device goes while a remote client is connected (a pty's master closing is its
    /// hang-up, as an unplugged USB adapter's): the client reads what the device sent before, then
    /// a clear end, and the bridge says why the session ended.
    @Test func theDeviceHangingUpEndsTheRemoteClientsConnectionClearly() async throws {
        let pty = try RawPTY()
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "rfc2217://127.0.0.1:0", "tty://\(pty.path)"])
        defer { bridge.signal(SIGKILL) }   // a failed check leaves no bridge behind
        let url = try #require(await HostileUseTests.listeningURL(of: bridge), "\(bridge.stderrLines)")
        let client = try await Transport.connect(to: url)
        try await client.write("hello")
        #expect(await pty.read(count: 5) == Array("hello".utf8))
        pty.write("last words")
        #expect(try await client.readFrame(.fixedLength(10), timeout: .seconds(10)) == Array("last words".utf8))
        Glibc.close(pty.master)
        var ending: (any Error)?
        do {
            while try await client.read(timeout: .seconds(10)) != nil {}
        } catch {
            ending = error
        }
        let error = ending as? TransportError
        #expect(ending == nil || error?.kind == .disconnected, "the end of the stream, or .disconnected: \(String(describing: ending))")
        #expect(ending == nil || error?.message.contains("closed the connection") == true, "\(String(describing: ending))")
        #expect(await eventually(10) {
            bridge.stderrLines.contains { line in
                let object = try? JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: String]
                return object?["event"] == "failed" && object?["error"]?.contains(pty.path) == true
            }
        }, "the bridge reports why the session ended, naming the device: \(bridge.stderrLines)")
        try await client.close()
        bridge.signal(SIGTERM)
        _ = await bridge.wait()
    }

    /// `--once` serves one client's RFC 2217 requests too (it relayed the bytes alone before, and
    /// the client's SETs timed out).
    @Test func aOneShotBridgeServesItsClientsRequests() async throws {
        let pty = try RawPTY()
        defer { Glibc.close(pty.master) }
        let bridge = try CLI.Running(["bridge", "--once", "--json", "--listen", "rfc2217://127.0.0.1:0", "tty://\(pty.path)"])
        defer { bridge.signal(SIGKILL) }
        let url = try #require(await HostileUseTests.listeningURL(of: bridge), "\(bridge.stderrLines)")
        let client = try await Transport.connect(to: url + "?baud=19200&stopBits=2")
        var attributes = termios()
        tcgetattr(pty.master, &attributes)
        #expect(cfgetospeed(&attributes) == speed_t(B19200) && attributes.c_cflag & tcflag_t(CSTOPB) != 0)
        try await client.close()
        let result = await bridge.wait()
        #expect(result.status == 0, "\(result.stderr)")
    }

    /// Runs Peers/rfc2217_client.py with `client` and expects an "ok" line for each check and
    /// exit status 0.
    static func expectChecks(_ client: String, _ checks: [String], sourceLocation: SourceLocation = #_sourceLocation) async {
        // timeout(1): a peer that hangs fails the test instead of holding the run.
        let (status, output) = await Self.run("/usr/bin/timeout", ["120", "/usr/bin/python3", Self.script, CLI.binary, client])
        let lines = output.split(separator: "\n").map(String.init)
        for check in checks {
            #expect(lines.contains("ok \(check)"), "\(client) \(check): \(output)", sourceLocation: sourceLocation)
        }
        #expect(status == 0, "\(output)", sourceLocation: sourceLocation)
    }

    @Test func aTargetWithoutASerialLineIsRefusedBeforeListening() async throws {
        let refused = try await CLI.run(["bridge", "--listen", "rfc2217://127.0.0.1:0", "loop://"])
        #expect(refused.status == 64, "\(refused.stderr)")
        #expect(refused.stderr.contains("loop:// has none") && refused.stderr.contains("tcp://"), "\(refused.stderr)")
    }

    /// Runs a program to its end on a thread of its own; its exit status and standard output.
    static func run(_ executable: String, _ arguments: [String]) async -> (Int32, String) {
        await withCheckedContinuation { continuation in
            Thread {
                let process = Process()
                process.executableURL = URL(fileURLWithPath: executable)
                process.arguments = arguments
                let output = Pipe()
                process.standardOutput = output
                process.standardError = FileHandle.nullDevice
                do {
                    try process.run()
                } catch {
                    continuation.resume(returning: (-1, "\(error)"))
                    return
                }
                let data = output.fileHandleForReading.readDataToEndOfFile()
                process.waitUntilExit()
                continuation.resume(returning: (process.terminationStatus, String(decoding: data, as: UTF8.self)))
            }.start()
        }
    }
}
