import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// `spy.record` and `replay://` from the command line: a session recorded through
/// `transportkit connect`, replayed by the same command, a diverging replay's exit status and
/// message, and a bridge that would record client after client into one file refused.
@Suite("transportkit with spy.record and replay://")
struct RecordCLITests {
    @Test func connectRecordsAndReplaysASession() async throws {
        let file = temporaryPath("cli-session") + ".rec"
        defer { unlink(file) }
        let recorded = try await CLI.run(["connect", "spy+loop://?spy.record=\(file)"], stdin: Array("hello\n".utf8))
        #expect(recorded.status == 0 && recorded.stdout == Array("hello\n".utf8), "\(recorded.stderr)")
        #expect(recorded.stderr.isEmpty, "spy.record alone writes no trace: \(recorded.stderr)")
        let replayed = try await CLI.run(["connect", "replay://\(file)?timing=fast"], stdin: Array("hello\n".utf8))
        #expect(replayed.status == 0 && replayed.stdout == Array("hello\n".utf8), "\(replayed.stderr)")
        let diverging = try await CLI.run(["connect", "replay://\(file)?timing=fast"], stdin: Array("HELLO\n".utf8))
        #expect(diverging.status == 1, "\(diverging.stderr)")
        #expect(diverging.stderr.contains("wrote 0x48 'H' at byte 0 where the recording (line 3) has 0x68 'h'"), "\(diverging.stderr)")
        let again = try await CLI.run(["connect", "spy+loop://?spy.record=\(file)"], stdin: Array("hello\n".utf8))
        #expect(again.status != 0 && again.stderr.contains("is not empty"), "one session per file: \(again.stderr)")
    }

    @Test func aBridgeServingClientAfterClientRefusesToRecordItsTarget() async throws {
        let file = temporaryPath("cli-bridge") + ".rec"
        let refused = try await CLI.run(["bridge", "--listen", "tcp://127.0.0.1:0", "spy+loop://?spy.record=\(file)"])
        #expect(refused.status == 64, "\(refused.stderr)")
        #expect(refused.stderr.contains("use --once, or --keep-open"), "\(refused.stderr)")
        #expect(!FileManager.default.fileExists(atPath: file), "nothing made before the refusal")
    }
}
