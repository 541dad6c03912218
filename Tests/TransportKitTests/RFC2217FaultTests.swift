import Foundation
import Glibc
import TestSupport
import Testing
@testable import TransportKit

/// rfc2217:// against servers that misbehave, played by this test on a plain socket (the real
/// servers are in RFC2217PeerTests): one that never answers a SET, one that refuses
/// COM-PORT-OPTION, one that drops the connection mid-SET, one whose subnegotiation never ends.
/// Each gives a specific error within its limit and leaves no socket open.
@Suite("rfc2217:// against servers that lie or stop")
struct RFC2217FaultTests {
    enum Behaviour {
        case mute, silent, refuse, dropMidSet, endlessSubnegotiation
        /// Answers every SET with its value, or with `overrides[command]`; after its answer to
        /// SET-LINESTATE-MASK, sends `afterLineStateMask`.
        case answers(overrides: [UInt8: [UInt8]], afterLineStateMask: [UInt8] = [])
    }

    /// Serves one client as `behaviour` says, on a thread of its own; returns the port.
    static func server(_ behaviour: Behaviour) throws -> (port: Int, done: Task<[UInt8], Never>) {
        let listener = try Support.RawListener()
        let done = Task {
            let client = await listener.accept()
            defer { _ = Glibc.close(client); listener.close() }
            var seen: [UInt8] = []
            // The client's negotiation: WILL 44 among its first bytes.
            while !contains(seen, [255, 251, 44]) {
                let more = await Support.readSome(client)
                if more.isEmpty { return seen }
                seen += more
            }
            switch behaviour {
            case .mute:
                break   // a raw port: the negotiation is data to it
            case .refuse:
                Support.writeAll(client, [255, 254, 44])   // DONT COM-PORT-OPTION
            case .silent:
                Support.writeAll(client, [255, 253, 44, 255, 251, 0, 255, 253, 0])
            case .dropMidSet:
                Support.writeAll(client, [255, 253, 44])
                while !contains(seen, [255, 250, 44]) {   // the first SB: close without answering
                    let more = await Support.readSome(client)
                    if more.isEmpty { return seen }
                    seen += more
                }
                return seen
            case .endlessSubnegotiation:
                Support.writeAll(client, [255, 253, 44, 255, 250, 44, 101] + [UInt8](repeating: 7, count: 5000))
            case .answers(let overrides, let afterLineStateMask):
                Support.writeAll(client, [255, 253, 44])
                var from = 0
                while true {
                    // Each whole IAC SB 44 command value IAC SE is answered with command + 100.
                    while let start = (from..<max(from, seen.count - 2)).first(where: { seen[$0] == 255 && seen[$0 + 1] == 250 && seen[$0 + 2] == 44 }),
                          let end = ((start + 3)..<max(start + 3, seen.count - 1)).first(where: { seen[$0] == 255 && seen[$0 + 1] == 240 }) {
                        let command = seen[start + 3]
                        let value = overrides[command] ?? Array(seen[(start + 4)..<end])
                        Support.writeAll(client, [255, 250, 44, command + 100] + value + [255, 240])
                        if command == 10 { Support.writeAll(client, afterLineStateMask) }
                        from = end + 2
                    }
                    let more = await Support.readSome(client)
                    if more.isEmpty { return seen }
                    seen += more
                }
            }
            // Keep the connection until the client gives up (its read ends).
            while true {
                let more = await Support.readSome(client)
                if more.isEmpty { return seen }
                seen += more
            }
        }
        return (listener.port, done)
    }

    static func contains(_ bytes: [UInt8], _ pattern: [UInt8]) -> Bool {
        bytes.count >= pattern.count && (0...(bytes.count - pattern.count)).contains { Array(bytes[$0..<$0 + pattern.count]) == pattern }
    }

    @Test func aServerThatNeverAnswersASetIsATimeoutNamingTheCommand() async throws {
        let (port, done) = try Self.server(.silent)
        let started = ContinuousClock.now
        let error = await expectTransportError(.timedOut) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?answerTimeout=4&timeout=60") }
        // 4 s: the negotiation before the SET has the same timeout, and a loaded machine (every
        // suite starting at once) once took 1.5 s to have this test's server answer it.
        #expect(error?.message.contains("did not answer SET-BAUDRATE within 4 s") == true, "\(String(describing: error))")
        #expect(ContinuousClock.now - started < .seconds(30), "within the answer timeout, not the connect's (60 s)")
        let seen = await done.value
        // What the client asked for: BINARY both ways, COM-PORT-OPTION, then 9600 8N1 without flow control.
        #expect(Self.contains(seen, [255, 250, 44, 1, 0, 0, 0x25, 0x80, 255, 240]), "SET-BAUDRATE 9600: \(seen)")
        #expect(Self.contains(seen, [255, 250, 44, 2, 8, 255, 240]) && Self.contains(seen, [255, 250, 44, 3, 1, 255, 240]), "8 bits, no parity: \(seen)")
        #expect(await eventually(2) { Support.openSockets(port: port) == 0 })
    }

    @Test func aPortWithoutTelnetIsATimeoutOfTheNegotiation() async throws {
        let (port, done) = try Self.server(.mute)
        let started = ContinuousClock.now
        let error = await expectTransportError(.timedOut) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?answerTimeout=0.5&timeout=60") }
        #expect(error?.message.contains("did not agree to COM-PORT-OPTION within 0.5 s") == true && error?.message.contains("tcp://") == true,
                "\(String(describing: error))")
        // Well short of the connect's own 60 s (a loaded CI machine once took 3.2 s here).
        #expect(ContinuousClock.now - started < .seconds(30), "within the answer timeout, not the connect's (60 s)")
        _ = await done.value
        #expect(await eventually(2) { Support.openSockets(port: port) == 0 })
    }

    @Test func aServerWithoutComPortOptionIsRefusedSayingToUseTCP() async throws {
        let (port, done) = try Self.server(.refuse)
        let error = await expectTransportError(.unsupported) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?answerTimeout=20&timeout=30") }
        #expect(error?.message.contains("refused COM-PORT-OPTION") == true && error?.message.contains("tcp://") == true, "\(String(describing: error))")
        _ = await done.value
        #expect(await eventually(2) { Support.openSockets(port: port) == 0 })
    }

    @Test func aServerThatDropsMidSetIsDisconnected() async throws {
        let (port, done) = try Self.server(.dropMidSet)
        let error = await expectTransportError(.disconnected) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?answerTimeout=5") }
        #expect(error?.message.contains("closed") == true, "\(String(describing: error))")
        _ = await done.value
    }

    @Test func anEndlessSubnegotiationIsAProtocolError() async throws {
        let (port, done) = try Self.server(.endlessSubnegotiation)
        let error = await expectTransportError(.protocolError) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?answerTimeout=5") }
        #expect(error?.message.contains("broke the Telnet protocol") == true, "\(String(describing: error))")
        _ = await done.value
        #expect(await eventually(2) { Support.openSockets(port: port) == 0 })
    }

    @Test func aServerThatAnswersOtherSettingsOrNonsenseIsRefused() async throws {
        let (port, done) = try Self.server(.answers(overrides: [3: [2]]))   // parity: odd, whatever was asked
        let kept = await expectTransportError(.unsupported) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?parity=even&answerTimeout=20&timeout=30") }
        #expect(kept?.message.contains("does not do 9600 8E1; its port kept 9600 8O1") == true, "\(String(describing: kept))")
        _ = await done.value
        let (other, answered) = try Self.server(.answers(overrides: [3: [9]]))   // no parity has the code 9
        let nonsense = await expectTransportError(.protocolError) { try await Transport.connect(to: "rfc2217://127.0.0.1:\(other)?answerTimeout=20&timeout=30") }
        #expect(nonsense?.message.contains("answered SET-PARITY with 9, which is no parity") == true, "\(String(describing: nonsense))")
        _ = await answered.value
        // One that answers as asked: connected, and the settings are the answers.
        let (good, served) = try Self.server(.answers(overrides: [:]))
        let connection = try await Transport.connect(to: "rfc2217://127.0.0.1:\(good)?baud=4800&stopBits=2&answerTimeout=20&timeout=30")
        #expect(try await connection.serialPort?.settings() == SerialSettings(baudRate: 4800, stopBits: 2))
        try await connection.close()
        _ = await served.value
    }

    /// NOTIFY-LINESTATE: the client asks for the four errors at connect (SET-LINESTATE-MASK 0x1E;
    /// servers start at 0) and counts each notification, data ready and timeout aside.
    @Test func lineStateNotificationsAreCountedAsLineErrors() async throws {
        func notify(_ state: UInt8) -> [UInt8] { [255, 250, 44, 106, state, 255, 240] }
        // A break; framing and overrun together; data ready and timeout (no errors); parity.
        let notifications = notify(0x10) + notify(0x0A) + notify(0x81) + notify(0x04)
        let (port, served) = try Self.server(.answers(overrides: [:], afterLineStateMask: notifications))
        let connection = try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)?answerTimeout=20&timeout=30")
        let serial = try #require(connection.serialPort)
        var counted = LineErrorCounts()
        for _ in 0..<500 where counted.total < 4 {
            counted = try await serial.lineErrors()
            try await Task.sleep(for: .milliseconds(10))
        }
        #expect(counted == LineErrorCounts(framing: 1, parity: 1, overrun: 1, breaks: 1))
        try await connection.close()
        let seen = await served.value
        #expect(Self.contains(seen, [255, 250, 44, 10, 0x1E, 255, 240]), "SET-LINESTATE-MASK overrun, parity, framing, break: \(seen)")
    }

    @Test func optionsAreCheckedBeforeConnecting() async throws {
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "rfc2217://127.0.0.1:1?baud=0") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "rfc2217://127.0.0.1:1?baud=99999999") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "rfc2217://127.0.0.1:1?answerTimeout=0") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "rfc2217://127.0.0.1") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "rfc2217://127.0.0.1:1/dev/ttyUSB0") }
    }
}
