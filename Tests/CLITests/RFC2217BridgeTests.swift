import Foundation
import Glibc
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

    /// Runs Peers/rfc2217_client.py with `client` and expects an "ok" line for each check and
    /// exit status 0.
    static func expectChecks(_ client: String, _ checks: [String], sourceLocation: SourceLocation = #_sourceLocation) async {
        let (status, output) = await Self.run("/usr/bin/python3", [Self.script, CLI.binary, client])
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
