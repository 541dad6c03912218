import Foundation
import Glibc
import Testing
import TransportKit

/// `transportkit bridge --listen rfc2217://…` as an RFC 2217 server, against pyserial's client
/// (Peers/rfc2217_client.py, every answer checked: pyserial waits for each at open and compares
/// it with its request), in front of a pty whose termios the script reads.
@Suite("transportkit bridge as an RFC 2217 server")
struct RFC2217BridgeTests {
    static let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers/rfc2217_client.py").path

    @Test func pyserialOpensThePortThroughTheBridgeAndEveryAnswerMatches() async throws {
        let (status, output) = await Self.run("/usr/bin/python3", [Self.script, CLI.binary])
        let lines = output.split(separator: "\n").map(String.init)
        for check in ["settings", "to-device", "from-device", "lines", "baud-at-run-time", "purge", "break"] {
            #expect(lines.contains("ok \(check)"), "\(check): \(output)")
        }
        #expect(status == 0, "\(output)")
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
