import Foundation
import Glibc
import Synchronization
import TestSupport
import Testing
@testable import TransportKit
@testable import TransportKitSerial
@testable import TransportKitRFC2217
@_spi(Plugins) import TransportKitCore

/// The RFC 2217 server (`Transport.listen(on: "rfc2217://…")` and `RFC2217Session.serve`) in front
/// of a real pty, against a client this test plays on a plain socket: a subnegotiation without its
/// end, IAC split across reads, absurd values. Each is answered or refused as RFC 854 and 2217 say,
/// and leaves the port as it was and no socket open. (The well-behaved clients are in
/// RFC2217BridgeTests: pyserial, gensiot, cyclades-ser-cli.)
@Suite("the RFC 2217 server against clients that break the rules")
struct RFC2217ServerFaultTests {
    /// A server for one client in front of `pty`: it serves the client's requests with the pty's
    /// control (seen through `log`) and collects the data the client sends, until the client leaves.
    struct Server {
        let port: Int
        let done: Task<[UInt8], any Error>
        let listener: Listener

        init(_ pty: TestPTY, log: PortLog = PortLog(), deviceURL: String? = nil) async throws {
            let listener = try await Transport.listen(on: "rfc2217://127.0.0.1:0")
            self.listener = listener
            port = try #require(listener.url.port)
            done = Task {
                let client = try #require(try await listener.accept())
                let session = try #require(client.rfc2217Session)
                let device = try await Transport.connect(to: deviceURL ?? "tty://\(pty.path)")
                let serial = ObservedPort(inner: try #require(device.serialPort), log: log)
                async let served: Void = session.serve(serial)
                var data: [UInt8] = []
                do {
                    while let chunk = try await client.read() {
                        data += chunk
                        log.append("data \(String(decoding: chunk, as: UTF8.self))")
                    }
                } catch {}
                await served
                try await device.close()
                try await client.close()
                return data
            }
        }

        func end() async throws -> [UInt8] {
            let data = try await done.value
            try await listener.close()
            return data
        }
    }

    /// A raw client: connected, past the server's opening negotiation, COM-PORT-OPTION offered.
    static func client(_ port: Int) async throws -> Int32 {
        let fd = Support.rawConnect(port: port)
        try #require(fd >= 0)
        _ = await Support.readSome(fd)   // the server's WILL/DO BINARY, SGA and DO COM-PORT-OPTION
        Support.writeAll(fd, [255, 251, 44])
        return fd
    }

    /// Reads from `fd` until `pattern` has come (or 5 s have passed); everything read.
    static func read(_ fd: Int32, until pattern: [UInt8]) async -> [UInt8] {
        var seen: [UInt8] = []
        let deadline = ContinuousClock.now + .seconds(5)
        while !RFC2217FaultTests.contains(seen, pattern), ContinuousClock.now < deadline {
            let more = await Support.readSome(fd)
            if more.isEmpty { break }
            seen += more
        }
        return seen
    }

    /// What the served port was asked and what data came, in order.
    final class PortLog: Sendable {
        private let entries = Locked<[String]>([])
        func append(_ entry: String) { entries.withLock { $0.append(entry) } }
        var all: [String] { entries.withLock { $0 } }
        func count(_ entry: String) -> Int { all.filter { $0 == entry }.count }
    }

    /// A serial port that logs its break and line-error calls and passes every call on.
    struct ObservedPort: SerialControl {
        let inner: any SerialControl
        let log: PortLog
        var port: String { inner.port }
        func settings() async throws -> SerialSettings { try await inner.settings() }
        func apply(_ settings: SerialSettings) async throws { try await inner.apply(settings) }
        func modemLines() async throws -> ModemLines { try await inner.modemLines() }
        func setLines(_ lines: ModemLines, _ on: Bool) async throws { try await inner.setLines(lines, on) }
        func setBreak(_ on: Bool) async throws {
            log.append(on ? "break on" : "break off")
            try await inner.setBreak(on)
        }
        func flush(_ queue: FlushQueue) async throws { try await inner.flush(queue) }
        func drain() async throws { try await inner.drain() }
        func modemLineChanges() async throws -> AsyncThrowingStream<ModemLines, any Error> { try await inner.modemLineChanges() }
        func lineErrors() async throws -> LineErrorCounts {
            log.append("line errors?")
            return try await inner.lineErrors()
        }
    }

    static func answer(_ command: UInt8, _ value: [UInt8]) -> [UInt8] {
        [255, 250, 44, command + 100] + value + [255, 240]
    }

    @Test func aSubnegotiationWithoutItsEndClosesThatClientAndLeavesThePortAlone() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let server = try await Server(pty)
        let fd = try await Self.client(server.port)
        // SET-BAUDRATE that never ends: 5,000 bytes past the 4-KiB bound, no IAC SE.
        Support.writeAll(fd, [255, 250, 44, 1, 0, 0, 0x4b, 0] + [UInt8](repeating: 7, count: 5000))
        let rest = await Support.readAll(fd)   // to the server's close
        #expect(!RFC2217FaultTests.contains(rest, [255, 250, 44, 101]), "nothing of it was answered: \(rest)")
        _ = Glibc.close(fd)
        _ = try await server.end()
        #expect(try pty.termios2().c_ospeed == 9600, "the port kept the speed the server's tty:// set")
        #expect(await eventually(2) { Support.openSockets(port: server.port) == 0 })
    }

    @Test func iacSplitAcrossReadsIsJoinedInDataAndInsideAValue() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let server = try await Server(pty)
        let fd = try await Self.client(server.port)
        // SET-BAUDRATE 65280 (0x0000ff00): the value's 0xff doubled, cut between the two IACs and
        // before SE; then data with IAC IAC cut between its two bytes.
        for piece: [UInt8] in [[255, 250, 44, 1, 0, 0, 255], [255, 0, 255], [240], [0x41, 255], [255, 0x42]] {
            Support.writeAll(fd, piece)
            try await Task.sleep(for: .milliseconds(50))
        }
        let answers = await Self.read(fd, until: Self.answer(1, [0, 0, 255, 255, 0]))
        #expect(RFC2217FaultTests.contains(answers, Self.answer(1, [0, 0, 255, 255, 0])), "answered 65280, its IAC doubled: \(answers)")
        #expect(try pty.termios2().c_ospeed == 65280)
        _ = Glibc.close(fd)
        #expect(try await server.end() == [0x41, 0xff, 0x42], "the data: IAC IAC is one 0xff")
    }

    @Test func absurdValuesAreAnsweredWithWhatIsInForceAndTheSessionGoesOn() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let server = try await Server(pty)
        let fd = try await Self.client(server.port)
        // 4,294,967,295 bit/s, 200 data bits, parity 77, stop size 9, and command 50 (none such).
        Support.writeAll(fd, [255, 250, 44, 1, 255, 255, 255, 255, 255, 255, 255, 255, 255, 240])
        Support.writeAll(fd, [255, 250, 44, 2, 200, 255, 240, 255, 250, 44, 3, 77, 255, 240, 255, 250, 44, 4, 9, 255, 240])
        Support.writeAll(fd, [255, 250, 44, 50, 1, 255, 240])
        // Then a sane one: the session still serves.
        Support.writeAll(fd, [255, 250, 44, 1, 0, 0, 0x4b, 0, 255, 240])
        let answers = await Self.read(fd, until: Self.answer(1, [0, 0, 0x4b, 0]))
        #expect(RFC2217FaultTests.contains(answers, Self.answer(1, [0, 0, 0x25, 0x80])), "the absurd rate answered with 9600, in force: \(answers)")
        #expect(RFC2217FaultTests.contains(answers, Self.answer(2, [8])), "\(answers)")
        #expect(RFC2217FaultTests.contains(answers, Self.answer(3, [1])), "\(answers)")
        #expect(RFC2217FaultTests.contains(answers, Self.answer(4, [1])), "\(answers)")
        #expect(!RFC2217FaultTests.contains(answers, [255, 250, 44, 150]), "no answer to a command that does not exist: \(answers)")
        #expect(RFC2217FaultTests.contains(answers, Self.answer(1, [0, 0, 0x4b, 0])), "19200 after all that: \(answers)")
        #expect(try pty.termios2().c_ospeed == 19200)
        _ = Glibc.close(fd)
        _ = try await server.end()
    }

    /// Telnet's BRK between data: the data after it reaches the port after the break, and a
    /// second BRK meanwhile is the same break.
    @Test func theBreakKeyKeepsItsPlaceInTheData() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let log = PortLog()
        let server = try await Server(pty, log: log)
        let fd = try await Self.client(server.port)
        Support.writeAll(fd, Array("before".utf8) + [255, Telnet.brk, 255, Telnet.brk] + Array("after".utf8))
        #expect(await eventually(5) { log.all.contains("data after") }, "\(log.all)")
        let order = log.all.filter { $0 != "line errors?" }
        #expect(order == ["data before", "break on", "break off", "data after"], "\(order)")
        _ = Glibc.close(fd)
        #expect(try await server.end() == Array("beforeafter".utf8))
    }

    /// The server's line-error watch on a port that counts none (a pty): read once, not again,
    /// and traced once by a spy+ target.
    @Test func theLineErrorWatchReadsAPortThatCountsNoneOnce() async throws {
        let file = temporaryPath("spy-linestate") + ".txt"
        defer { unlink(file) }
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let log = PortLog()
        let server = try await Server(pty, log: log, deviceURL: "spy+tty://\(pty.path)?spy.file=\(file)")
        // Our own client asks for line errors (SET-LINESTATE-MASK) at connect.
        let remote = try await Transport.connect(to: "rfc2217://127.0.0.1:\(server.port)?answerTimeout=20&timeout=30")
        #expect(await eventually(5) { log.count("line errors?") >= 1 })
        try await Task.sleep(for: .milliseconds(800))   // three rounds of the watch, were it still running
        #expect(log.count("line errors?") == 1, "\(log.all)")
        #expect(try await remote.serialPort?.lineErrors() == LineErrorCounts())
        try await remote.close()
        _ = try await server.end()
        let text = (try? String(contentsOfFile: file, encoding: .utf8)) ?? ""
        let polls = text.split(separator: "\n").filter { $0.contains("line errors?") }
        #expect(polls.count == 1 && polls.first?.contains("failed") == true, "\(text)")
    }
}
