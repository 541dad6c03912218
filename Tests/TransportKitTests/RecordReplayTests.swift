import Foundation
import Glibc
import TestSupport
import Testing
@testable import TransportKit
@testable import TransportKitSpy

/// Record and replay: a session with a device played by a real pty (an ELM327-like responder on
/// the master) recorded with `spy+tty://…?spy.record=FILE`, then the same app code run against
/// `replay://FILE`, which must see the same bytes and serial answers; strict mode against an app
/// that diverges; the format's escapes; bad files.
@Suite("spy.record and replay://")
struct RecordReplayTests {
    /// The app under test: resets the adapter, asks for the supported PIDs, reads its settings.
    static func app(_ connection: Connection) async throws -> [String] {
        var seen: [String] = []
        for command in ["ATZ\r", "0100\r"] {
            try await connection.write(command)
            let answer = try await connection.readFrame(.delimiter(Array(">".utf8)), timeout: .seconds(10))
            seen.append(String(decoding: answer ?? [], as: UTF8.self))
        }
        if let port = connection.serialPort { seen.append(try await port.settings().summary) }
        return seen
    }

    /// The device: answers each command ending in \r on the pty's master, after `delay`, on a
    /// thread of its own until `stop()` (a pipe it polls beside the master, so it never touches
    /// the master after the test closes it).
    final class Device: Sendable {
        private let stopWriter: Int32
        private let thread: Task<Void, Never>

        init(_ pty: TestPTY, delayMilliseconds delay: UInt32) {
            var ends: [Int32] = [-1, -1]
            _ = pipe(&ends)
            let (stopReader, master) = (ends[0], pty.master)
            stopWriter = ends[1]
            thread = Task.detached {
                await Support.offPool {
                    defer { _ = Glibc.close(stopReader) }
                    var pending: [UInt8] = []
                    var buffer = [UInt8](repeating: 0, count: 256)
                    while true {
                        var pollers = [pollfd(fd: master, events: Int16(POLLIN), revents: 0), pollfd(fd: stopReader, events: Int16(POLLIN), revents: 0)]
                        guard poll(&pollers, 2, 20_000) > 0, pollers[1].revents == 0 else { return }
                        let count = buffer.withUnsafeMutableBytes { Glibc.read(master, $0.baseAddress, $0.count) }
                        if count < 0 && errno == EIO {
                            usleep(20_000)   // nobody has the other side open (yet, or any more)
                            continue
                        }
                        if count <= 0 { return }
                        pending += buffer[..<count]
                        while let end = pending.firstIndex(of: 0x0D) {
                            let command = String(decoding: pending[..<end], as: UTF8.self)
                            pending.removeSubrange(...end)
                            let answer = command == "ATZ" ? "\r\rELM327 v1.5\r\r>" : "41 00 BE 3E B8 11\r\r>"
                            usleep(delay * 1000)
                            Support.writeAll(master, Array(answer.utf8))
                        }
                    }
                }
            }
        }

        /// Ends the thread and waits for it.
        func stop() async {
            _ = Glibc.write(stopWriter, "x", 1)
            await thread.value
            _ = Glibc.close(stopWriter)
        }
    }

    @Test func aRecordedSessionReplaysToTheSameAppCode() async throws {
        let file = temporaryPath("elm327") + ".rec"
        defer { unlink(file) }
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let device = Device(pty, delayMilliseconds: 150)
        let live = try await Transport.connect(to: "spy+tty://\(pty.path)?baud=38400&spy.record=\(file)")
        let started = ContinuousClock.now
        let recorded = try await Self.app(live)
        let recordedTime = ContinuousClock.now - started
        try await live.close()
        await device.stop()
        #expect(recorded.count == 3 && recorded[0].contains("ELM327 v1.5") && recorded[1].contains("41 00 BE 3E B8 11") && recorded[2] == "38400 8N1",
                "\(recorded)")
        let text = try String(contentsOfFile: file, encoding: .utf8)
        let lines = text.split(separator: "\n")
        #expect(lines.first == "# transportkit recording 1")
        #expect(lines.contains { $0.hasSuffix(" > \"ATZ\\r\"") }, "\(text)")
        #expect(lines.contains { $0.contains(" < \"") && $0.contains("ELM327 v1.5") }, "\(text)")
        #expect(lines.contains { $0.hasSuffix(" ctrl settings? -> 38400 8N1") }, "\(text)")
        #expect(lines.last?.hasSuffix(" end") == true, "\(text)")

        // The same app, no device: as fast as it goes, then with the recorded pauses.
        let fast = try await Transport.connect(to: "replay://\(file)?timing=fast")
        #expect(try await Self.app(fast) == recorded)
        try await fast.close()
        let paced = try await Transport.connect(to: "replay://\(file)")
        let replayStarted = ContinuousClock.now
        #expect(try await Self.app(paced) == recorded)
        let replayTime = ContinuousClock.now - replayStarted
        #expect(replayTime >= .milliseconds(250), "two answers of 150 ms each: \(replayTime) (recorded \(recordedTime))")
        try await paced.close()
    }

    @Test func strictModeNamesThePositionAndBothBytesAndTheLine() async throws {
        let file = temporaryPath("strict") + ".rec"
        defer { unlink(file) }
        try """
        # transportkit recording 1
        0.000000 open tty:///dev/ttyUSB0?baud=38400
        0.010000 > "ATZ\\r"
        0.050000 < "ELM327 v1.5\\r>"
        0.100000 end
        """.write(toFile: file, atomically: true, encoding: .utf8)
        let diverging = try await Transport.connect(to: "replay://\(file)?timing=fast")
        let error = await expectTransportError(.protocolError) { try await diverging.write("ATZ\n") }
        #expect(error?.message.contains("wrote 0x0a at byte 3 where the recording (line 3) has 0x0d") == true, "\(String(describing: error))")
        let past = await expectTransportError(.protocolError) { try await diverging.write("ATZ\rX") }
        #expect(past?.message.contains("past the recording's last write") == true, "\(String(describing: past))")
        try await diverging.close()
        // Not strict: any writes are taken, and the device still answers after the recorded one.
        let tolerant = try await Transport.connect(to: "replay://\(file)?timing=fast&strict=false")
        try await tolerant.write("atz\n")
        let answer = try await tolerant.readFrame(.delimiter(Array(">".utf8)), timeout: .seconds(5))
        #expect(answer.map { String(decoding: $0, as: UTF8.self).hasPrefix("ELM327 v1.5\r") } == true, "\(String(describing: answer))")
        #expect(try await tolerant.serialPort?.settings() == SerialSettings(baudRate: 38400), "no settings recorded: the open URL's")
        await expectTransportError(.unsupported) { _ = try await tolerant.serialPort?.modemLines() }
        try await tolerant.close()
    }

    @Test func everyByteSurvivesTheFormat() throws {
        let all = (0...255).map { UInt8($0) }
        let quoted = RecordedEvent.quoted(all)
        #expect(RecordedEvent.unquoted(Substring(quoted)) == all)
        #expect(!quoted.contains("\n") && !quoted.contains("\r"), "one line")
        let event = RecordedEvent(time: 1.5, kind: .fromDevice(all))
        #expect(try RecordedEvent.parse(event.text, describing: "x").map(\.kind) == [event.kind])
        #expect(RecordedEvent.stamp(0.000001) == "0.000001" && RecordedEvent.stamp(12.5) == "12.500000")
    }

    @Test func badRecordingsAndPathsAreRefusedSayingWhy() async throws {
        let missing = await expectTransportError(.notFound) { try await Transport.connect(to: "replay:///nonexistent/session.rec") }
        #expect(missing?.message.contains("spy.record=") == true, "\(String(describing: missing))")
        let file = temporaryPath("bad") + ".rec"
        defer { unlink(file) }
        try "0.1 > \"ok\"\n0.05 < \"back in time\"\n".write(toFile: file, atomically: true, encoding: .utf8)
        let back = await expectTransportError(.invalidURL) { try await Transport.connect(to: "replay://\(file)") }
        #expect(back?.message.contains("line 2: the times go back") == true, "\(String(describing: back))")
        try "0.1 > \"unterminated\n".write(toFile: file, atomically: true, encoding: .utf8)
        let quote = await expectTransportError(.invalidURL) { try await Transport.connect(to: "replay://\(file)") }
        #expect(quote?.message.contains("line 1: bytes are a quoted string") == true, "\(String(describing: quote))")
        // A recording is one session: an existing one is not appended to.
        let taken = await expectTransportError(.busy) { try await Transport.connect(to: "spy+loop://?spy.record=\(file)") }
        #expect(taken?.message.contains("is not empty: a recording is one session") == true, "\(String(describing: taken))")
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "spy+loop://?spy.record=") }
    }

    /// A recording edited on another system (CRLF line ends), and its end of stream at the
    /// recorded time, not at once.
    @Test func aCRLFRecordingPlaysAndItsEndComesOnTime() async throws {
        let file = temporaryPath("crlf") + ".rec"
        defer { unlink(file) }
        try "# transportkit recording 1\r\n0.000000 open loop://\r\n0.010000 < \"hi\"\r\n0.400000 eof\r\n0.500000 end\r\n"
            .write(toFile: file, atomically: true, encoding: .utf8)
        let replay = try await Transport.connect(to: "replay://\(file)")
        let started = ContinuousClock.now
        #expect(try await replay.read(timeout: .seconds(5)) == Array("hi".utf8))
        #expect(try await replay.read(timeout: .seconds(5)) == nil)
        #expect(ContinuousClock.now - started >= .milliseconds(300), "eof at 0.4 s, as recorded")
        #expect(replay.serialPort == nil, "a loop:// recording is no serial line")
        try await replay.close()
        // Nothing in it: refused, not an empty device.
        try "# transportkit recording 1\r\n".write(toFile: file, atomically: true, encoding: .utf8)
        let empty = await expectTransportError(.invalidURL) { try await Transport.connect(to: "replay://\(file)") }
        #expect(empty?.message.contains("holds no event") == true, "\(String(describing: empty))")
    }
}
