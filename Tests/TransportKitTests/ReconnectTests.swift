import Foundation
import Glibc
import NIOCore
import Synchronization
import TestSupport
import Testing
@_spi(Plugins) @testable import TransportKit
@testable import TransportKitSerial

/// `reconnect+URL` over real sockets and real ptys: a server that drops its client and one that
/// goes away and comes back, writes across a loss (at most once), the attempts running out,
/// close while waiting, a serial port whose by-path link is pointed at a new pty (the identity
/// resolved again, the app's settings set again), 10,000 reconnects that leave nothing behind;
/// and the events of a plain connection.
@Suite("reconnect+URL")
struct ReconnectTests {
    /// Quick attempts, no jitter: the tests' timing does not depend on chance.
    static let quick = "reconnect.initialDelay=0.05&reconnect.jitter=0&reconnect.maxDelay=0.2"

    @Test func aServerThatDropsItsClientIsReachedAgainAndReadsCarryOn() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let serving = Task {
            for index in 1...3 {
                guard let client = try await server.accept() else { return }
                try await client.write("generation \(index)\n")
                try await client.close()   // the client loses its connection
            }
        }
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?\(Self.quick)")
        let events = Gathered(connection.events())
        for index in 1...3 {
            #expect(try await connection.readLine(timeout: .seconds(10)) == "generation \(index)")
            #expect(connection.generation == index)
        }
        try await serving.value
        #expect(await events.wait(5) { $0.contains(.connected(generation: 3)) }, "\(events.elements)")
        let all = events.elements
        #expect(all.first == .connected(generation: 1))
        #expect(all.contains(.disconnected(nil, nextAttempt: .milliseconds(50))), "a clean end, the first delay: \(all)")
        #expect(all.contains(.connecting(attempt: 1)), "\(all)")
        try await connection.close()
        #expect(await events.wait(5) { $0.last == .closed }, "\(events.elements)")
        try await server.close()
    }

    @Test func aServerThatGoesAwayIsWaitedForWithBackoffAndReachedWhenItIsBack() async throws {
        let first = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(first.url.port)
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?\(Self.quick)")
        let events = Gathered(connection.events())
        let accepted = try #require(try await first.accept())
        // A reader finds the loss, waits across it, and reads from the next connection.
        let reading = Task { try await connection.readLine(timeout: .seconds(20)) }
        try await first.close()   // nobody listens: each attempt is refused
        try await accepted.close()
        #expect(await events.wait(5) { events in
            events.filter { if case .waiting(_, let error, _) = $0 { error.kind == .refused } else { false } }.count >= 3
        }, "\(events.elements)")
        // The server comes back on the same port.
        let again = try await Transport.listen(on: "tcp://127.0.0.1:\(port)")
        let next = try #require(try await again.accept())
        try await next.write("back\n")
        #expect(try await reading.value == "back")
        #expect(connection.generation == 2)
        // Delays grew (0.05, 0.08, 0.128, then the 0.2 cap), and are said with each event.
        let delays = events.elements.compactMap { event -> Duration? in
            if case .waiting(_, _, let delay) = event { delay } else { nil }
        }
        #expect(delays.prefix(3) == [.milliseconds(80), .milliseconds(128), .milliseconds(200)], "\(delays)")
        try await next.close()
        try await connection.close()
        try await again.close()
    }

    /// A scheme that takes writes and has nothing to read (as usb://…?controlOnly=true).
    struct WriteOnlyPlugin: TransportPlugin {
        final class Backend: ConnectionBackend {
            let supportsHalfClose = false
            let written = Locked<[UInt8]>([])
            func read() async throws -> ByteBuffer? { throw TransportError(.unsupported, "writeonly:// has nothing to read") }
            func write(_ buffer: ByteBuffer) async throws { written.withLock { $0 += Array(buffer.readableBytesView) } }
            func closeWrite() async throws {}
            func close() async throws {}
        }

        var schemes: [Scheme] {
            [Scheme(SchemeDescriptor(scheme: "writeonly", summary: "Writes only", grammar: "writeonly://",
                                     host: .forbidden, port: .forbidden, path: .forbidden, options: [])) { request in
                Connection(url: request.url, backend: Backend())
            }]
        }
    }

    @Test func aReadTheConnectionDoesNotOfferLeavesAPlainConnectionUp() async throws {
        let registry = try TransportRegistry(plugins: [WriteOnlyPlugin()])
        let connection = try await registry.connect(to: "writeonly://")
        let events = Gathered(connection.events())
        _ = await expectTransportError(.unsupported) { _ = try await connection.read() }
        try await connection.write([1])
        try await Task.sleep(for: .milliseconds(100))
        #expect(!events.elements.contains { if case .disconnected = $0 { true } else { false } }, "not an end of the stream: \(events.elements)")
        try await connection.close()
        // An .unsupported with an errno (EOPNOTSUPP from the system) is a failure like any other.
        #expect(!TransportError(.unsupported, "x", errno: .notSupported).isRefusedCall)
        #expect(TransportError(.unsupported, "x").isRefusedCall)
    }

    @Test func aReadTheConnectionDoesNotOfferIsRefusedWithoutALoss() async throws {
        let registry = try TransportRegistry(plugins: [ReconnectPlugin(), WriteOnlyPlugin()])
        let connection = try await registry.connect(to: "reconnect+writeonly://?\(Self.quick)")
        let events = Gathered(connection.events())
        for _ in 1...2 {
            let error = await expectTransportError(.unsupported) { _ = try await connection.read() }
            #expect(error?.message.contains("nothing to read") == true, "\(String(describing: error))")
        }
        try await connection.write([1, 2, 3])
        try await Task.sleep(for: .milliseconds(200))
        #expect(connection.generation == 1, "no reconnect: \(events.elements)")
        #expect(!events.elements.contains { if case .disconnected = $0 { true } else { false } }, "\(events.elements)")
        try await connection.close()
    }

    @Test func writesAreAtMostOnceAcrossALoss() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        // Attempts far apart: the connection stays down while the writes are tried (10 s: a loaded
        // machine's cooperative pool has been seconds late).
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?reconnect.initialDelay=10&reconnect.jitter=0")
        let events = Gathered(connection.events())
        let first = try #require(try await server.accept())
        try await connection.write("one\n")
        #expect(try await first.readLine(timeout: .seconds(5)) == "one")
        try await first.close()
        // The loss is seen by a read (or the next write).
        _ = Task { try? await connection.read() }
        #expect(await events.wait(5) { $0.contains { if case .disconnected = $0 { true } else { false } } }, "\(events.elements)")
        let refused = await expectTransportError(.disconnected) { try await connection.write("lost\n") }
        #expect(refused?.message.contains("not connected") == true && refused?.message.contains("reconnect.writeWait") == true,
                "\(String(describing: refused))")
        let second = try #require(try await server.accept())
        #expect(await events.wait(5) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        try await connection.write("two\n")
        #expect(try await second.readLine(timeout: .seconds(5)) == "two", "the refused write was not queued or sent again")
        try await second.close()
        try await connection.close()
        try await server.close()
    }

    @Test func aWriteWaitsForTheNextConnectionUpToWriteWait() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?reconnect.initialDelay=0.5&reconnect.jitter=0&reconnect.writeWait=120")
        let events = Gathered(connection.events())
        let first = try #require(try await server.accept())
        try await first.close()
        _ = Task { try? await connection.read() }
        #expect(await events.wait(5) { $0.contains { if case .disconnected = $0 { true } else { false } } }, "\(events.elements)")
        let started = ContinuousClock.now
        try await connection.write("waited\n")   // while down: waits for the attempt after 0.5 s
        #expect(ContinuousClock.now - started < .seconds(60), "the attempt after 0.5 s, not the write's 120 s wait")
        let second = try #require(try await server.accept())
        #expect(try await second.readLine(timeout: .seconds(5)) == "waited")
        try await second.close()
        try await connection.close()
        try await server.close()
    }

    @Test func attemptsRunOutIntoFailedAndTheReaderGetsTheError() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?\(Self.quick)&reconnect.attempts=3")
        let events = Gathered(connection.events())
        let accepted = try #require(try await server.accept())
        try await server.close()
        try await accepted.close()
        let error = await expectTransportError(.refused) { _ = try await connection.read(timeout: .seconds(10)) }
        #expect(error?.message.contains("gave up after 3 attempts") == true, "\(String(describing: error))")
        #expect(await events.wait(5) { $0.contains { if case .failed = $0 { true } else { false } } }, "\(events.elements)")
        #expect(events.elements.filter { if case .connecting = $0 { true } else { false } }.count == 3, "\(events.elements)")
        await expectTransportError(.refused) { try await connection.write("late") }
        try await connection.close()
    }

    @Test func closeWhileWaitingReturnsAtOnceAndLeavesNoSocket() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?reconnect.initialDelay=120")
        let events = Gathered(connection.events())
        let accepted = try #require(try await server.accept())
        try await accepted.close()
        let reading = Task { try await connection.read() }
        #expect(await events.wait(5) { $0.contains { if case .disconnected = $0 { true } else { false } } }, "\(events.elements)")
        let started = ContinuousClock.now
        try await connection.close()
        #expect(ContinuousClock.now - started < .seconds(60), "close did not wait out the 120 s delay")
        #expect(try await reading.value == nil, "a read waiting for the next connection ends with the close")
        #expect(await events.wait(5) { _ in events.ended }, "\(events.elements)")
        #expect(events.elements.last == .closed)
        try await server.close()
        #expect(await eventually(2) { Support.openSockets(port: port) == 0 })
    }

    /// A serial port known by a link (as /dev/serial/by-id/…): unplugged (the pty hung up), the
    /// link then points at a new pty (plugged in again). The connection finds it through the link,
    /// with the URL's settings and the ones the app set since.
    @Test func aSerialPortByLinkIsFoundAgainWithItsSettings() async throws {
        let directory = temporaryPath("reconnect-link")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let link = directory + "/ttyDEVICE"
        let before = try TestPTY()
        try FileManager.default.createSymbolicLink(atPath: link, withDestinationPath: before.path)
        let connection = try await Transport.connect(to: "reconnect+tty://\(link)?baud=19200&\(Self.quick)")
        let events = Gathered(connection.events())
        let port = try #require(connection.serialPort, "serialPort reaches through reconnect+ to a tty")
        try await port.apply(SerialSettings(baudRate: 57_600, stopBits: 2))
        #expect(try before.termios2().c_ospeed == 57_600)
        let reading = Task { try await connection.readFrame(.fixedLength(5), timeout: .seconds(20)) }
        // Unplugged: the device's side hangs up; the link goes with it.
        try FileManager.default.removeItem(atPath: link)
        before.closeMaster()
        #expect(await events.wait(5) { events in
            events.contains { if case .waiting(let what, let error, _) = $0 { what == "the device to be plugged in" && error.kind == .notFound } else { false } }
        }, "\(events.elements)")
        let down = await expectTransportError(.disconnected) { _ = try await port.settings() }
        #expect(down?.message.contains("reconnecting") == true, "\(String(describing: down))")
        // Plugged in again, as another node behind the same link.
        let after = try TestPTY()
        defer { after.closeMaster() }
        try FileManager.default.createSymbolicLink(atPath: link, withDestinationPath: after.path)
        #expect(await events.wait(5) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        #expect(try after.termios2().c_ospeed == 57_600, "the app's settings were set again")
        #expect(try after.termios2().c_cflag & UInt32(CSTOPB) != 0)
        after.write("hello")
        #expect(try await reading.value == Array("hello".utf8), "the reader carried on with the new port")
        try await connection.close()
        // The first pty went with its master, so a descriptor left on it would read "… (deleted)";
        // its number may already belong to another test's new pty.
        #expect(await eventually { Descriptors.count(on: before.path + " (deleted)") == 0 && Descriptors.count(on: after.path) == 0 })
    }

    @Test func aPlainConnectionReportsConnectedItsEndAndClosed() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let connection = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        let events = Gathered(connection.events())
        #expect(await events.wait(5) { $0 == [.connected(generation: 1)] }, "\(events.elements)")
        let accepted = try #require(try await server.accept())
        try await accepted.close()
        #expect(try await connection.read(timeout: .seconds(5)) == nil)
        #expect(await events.wait(5) { $0.last == .disconnected(nil, nextAttempt: nil) }, "\(events.elements)")
        #expect(connection.generation == 1)
        // A late subscriber gets the latest event first.
        let late = Gathered(connection.events())
        #expect(await late.wait(5) { $0 == [.disconnected(nil, nextAttempt: nil)] }, "\(late.elements)")
        try await connection.close()
        #expect(await events.wait(5) { _ in events.ended } && events.elements.last == .closed, "\(events.elements)")
        #expect(await late.wait(5) { _ in late.ended })
        try await server.close()
    }

    @Test func optionsAreCheckedAndTheFirstConnectFailsAsAPlainOneWould() async throws {
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "reconnect+tcp://127.0.0.1:1?reconnect.multiplier=0.5") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "reconnect+tcp://127.0.0.1:1?reconnect.jitter=2") }
        let listener = try Support.RawListener(listening: false)
        defer { listener.close() }
        await expectTransportError(.refused) { try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(listener.port)") }
    }

    /// At most once: a write in progress (held by a peer that does not read) when the link drops
    /// fails with `.disconnected`, and none of its bytes reach the next connection.
    @Test func aWriteInFlightAtTheLossFailsAndIsNotSentAgain() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?\(Self.quick)")
        let events = Gathered(connection.events())
        let first = try #require(try await server.accept())   // never reads: the write below waits
        let big = [UInt8](repeating: 0x55, count: 64 << 20)
        let writing = Task { try await connection.write(big) }
        // 64 MiB cannot all be taken by a peer that does not read: the write is still going (or,
        // on a slow machine, not yet begun: it then meets the dropped link just the same).
        try await Task.sleep(for: .milliseconds(300))
        #expect(connection.bytesWritten == 0)
        first.abort()   // the link drops under the write
        let error = await expectTransportError(.disconnected) { try await writing.value }
        #expect(error?.message.contains("was lost during this write") == true, "\(String(describing: error))")
        _ = Task { try? await connection.read() }
        let second = try #require(try await server.accept())
        #expect(await events.wait(5) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        try await connection.write("after\n")
        #expect(try await second.readLine(timeout: .seconds(5)) == "after", "no byte of the cut write came first")
        try await second.close()
        try await connection.close()
        try await server.close()
    }

    @Test func giveUpAfterBoundsAnOutage() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        // Delays of 120 s would pass the limit: each is cut to the time left.
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?reconnect.initialDelay=120&reconnect.jitter=0&reconnect.giveUpAfter=0.5")
        let accepted = try #require(try await server.accept())
        try await server.close()
        try await accepted.close()
        let started = ContinuousClock.now
        let error = await expectTransportError(.refused) { _ = try await connection.read(timeout: .seconds(180)) }
        #expect(ContinuousClock.now - started < .seconds(60), "given up about 0.5 s after the loss, not after the 120 s delay")
        #expect(error?.message.contains("gave up after") == true, "\(String(describing: error))")
        try await connection.close()
    }

    /// A serial port on another machine (rfc2217://, served here in front of a pty): the server
    /// ends the session, the client connects again, and the new session gets the settings the app
    /// had set, although the port was set back to 9600 meanwhile.
    @Test func anRFC2217PortGetsTheAppsSettingsAgainOnTheNextSession() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let listener = try await Transport.listen(on: "rfc2217://127.0.0.1:0")
        let port = try #require(listener.url.port)
        /// Accepts one client and serves it with the pty, set to 9600 first; ends when told.
        func serveOne() async throws -> (client: Connection, device: Connection, serving: Task<Void, Never>) {
            let client = try #require(try await listener.accept())
            let session = try #require(client.rfc2217Session)
            let device = try await Transport.connect(to: "tty://\(pty.path)?baud=9600")
            let serial = try #require(device.serialPort)
            return (client, device, Task { await session.serve(serial) })
        }
        let connecting = Task { try await Transport.connect(to: "reconnect+rfc2217://127.0.0.1:\(port)?baud=19200&answerTimeout=20&\(Self.quick)") }
        let first = try await serveOne()
        let connection = try await connecting.value
        let events = Gathered(connection.events())
        #expect(await eventually(5) { (try? pty.termios2().c_ospeed) == 19_200 }, "the URL's rate")
        try await #require(connection.serialPort).apply(SerialSettings(baudRate: 57_600, stopBits: 2))
        #expect(await eventually(5) { (try? pty.termios2().c_ospeed) == 57_600 })
        let reading = Task { try await connection.read(timeout: .seconds(20)) }   // a read finds the loss
        // The server ends the session; the port is set back to 9600 by the next session's device.
        try await first.client.close()
        await first.serving.value
        try await first.device.close()
        let second = try await serveOne()
        #expect(await events.wait(10) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        #expect(await eventually(5) { (try? pty.termios2().c_ospeed) == 57_600 && (try? pty.termios2().c_cflag).map { $0 & UInt32(CSTOPB) != 0 } == true },
                "the app's 57600 8N2 set again on the new session")
        try await second.client.write("on the new session")
        #expect(try await reading.value == Array("on the new session".utf8))
        try await connection.close()
        await second.serving.value
        try await second.device.close()
        try await listener.close()
    }

    @Test func whatAFailedAttemptWaitsForIsSaidFromTheErrorsKindAndCode() {
        #expect(ConnectionEvent.missing(TransportError(.notFound, "no device at /dev/ttyUSB0")) == "the device to be plugged in")
        #expect(ConnectionEvent.missing(TransportError(.busy, "held by 123")) == "the device to be free")
        #expect(ConnectionEvent.missing(TransportError(.permissionDenied, "EACCES")) == "permission")
        let off = TransportError(.unsupported, "adapter hci0 is powered off", code: "org.bluez.Error.NotReady")
        #expect(ConnectionEvent.missing(off) == "the adapter to be powered", "by its code, not its words")
        #expect(ConnectionEvent.missing(TransportError(.unsupported, "adapter hci0 is powered off")) == "the next attempt")
    }

    /// The delay each event announces, in milliseconds: after a loss and after each failed attempt.
    static func announcedDelays(_ events: [ConnectionEvent]) -> [Int] {
        events.compactMap { (event: ConnectionEvent) -> Int? in
            let next: Duration?
            switch event {
            case .disconnected(_, let delay), .waiting(_, _, let delay): next = delay
            default: next = nil
            }
            guard let next else { return nil }
            let (seconds, attoseconds) = next.components
            return Int((Double(seconds) * 1000 + Double(attoseconds) / 1e15).rounded())
        }
    }

    /// With no jitter the delays grow by `multiplier` from `initialDelay` and stop at `maxDelay`;
    /// with jitter, each is moved by up to ±jitter of itself, and they differ.
    @Test func delaysGrowToTheirMaximumAndJitterSpreadsThem() async throws {
        for (options, check) in [
            ("reconnect.initialDelay=0.04&reconnect.multiplier=2&reconnect.maxDelay=0.16&reconnect.jitter=0", { (delays: [Int]) in
                #expect(Array(delays.prefix(5)) == [40, 80, 160, 160, 160], "\(delays)")
            }),
            ("reconnect.initialDelay=0.1&reconnect.multiplier=1&reconnect.jitter=0.5", { (delays: [Int]) in
                #expect(delays.allSatisfy { (50...150).contains($0) }, "within ±50 %: \(delays)")
                #expect(Set(delays).count > 1, "spread, not in step: \(delays)")
            }),
        ] as [(String, ([Int]) -> Void)] {
            let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
            let port = try #require(server.url.port)
            let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?\(options)")
            let events = Gathered(connection.events())
            let reading = Task { try? await connection.read(timeout: .seconds(30)) }   // a read finds each loss
            // Each connection is dropped at once, so it never stays up long enough to reset the
            // delays. (The listener stays: a port given back would be reused by another test's
            // listener, which these attempts would then reach.)
            let dropping = Task {
                while let accepted = try await server.accept() { try await accepted.close() }
            }
            #expect(await events.wait(10) { Self.announcedDelays($0).count >= 6 }, "\(events.elements)")
            check(Self.announcedDelays(events.elements))
            try await connection.close()
            reading.cancel()
            dropping.cancel()
            try await server.close()
        }
    }

    /// A connection that stayed up `stableAfter` (1 s; this one 2 s) starts the next outage from the first delay; one
    /// that did not carries on where the last outage's delays were.
    @Test func aConnectionThatStayedUpResetsTheDelays() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?reconnect.initialDelay=0.05&reconnect.multiplier=4"
                                                     + "&reconnect.maxDelay=5&reconnect.jitter=0&reconnect.stableAfter=1")
        let events = Gathered(connection.events())
        let reading = Task { try? await connection.read(timeout: .seconds(30)) }   // a read finds each loss
        defer { reading.cancel() }
        for upFor in [Duration.zero, .zero, .seconds(2)] {
            let accepted = try #require(try await server.accept())
            try await Task.sleep(for: upFor)
            try await accepted.close()
        }
        let fourth = try #require(try await server.accept())   // kept open: no fourth loss
        #expect(await events.wait(10) { Self.announcedDelays($0).count >= 3 }, "\(events.elements)")
        #expect(Array(Self.announcedDelays(events.elements).prefix(3)) == [50, 200, 50], "short lives grew the delay; 2 s up reset it: \(events.elements)")
        try await connection.close()
        try await fourth.close()
        try await server.close()
    }

    @Test func eventsAfterCloseEndAtOnceWithClosed() async throws {
        let connection = try await Transport.connect(to: "loop://")
        try await connection.close()
        let late = Gathered(connection.events())
        #expect(await late.wait(5) { _ in late.ended }, "\(late.elements)")
        #expect(late.elements == [.closed])
    }
}

/// 10,000 losses and reconnects in a row (about 11 s of both cores): run in a test process of its
/// own (Scripts/test), so the timing of other suites does not suffer and the thread count is this
/// test's alone.
@Suite("reconnect+URL under load")
struct ReconnectLoadTests {
    @Test func tenThousandReconnectsLeaveNoSocketAndFreeTheirState() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let rounds = 10_000
        let serving = Task {
            // Each client is closed as soon as it is accepted.
            for _ in 0..<rounds {
                guard let client = try await server.accept() else { return }
                try await client.close()
            }
        }
        // One plain connection first, so the threads a first connect starts (the event loops, a
        // resolver's) are there before counting.
        let warmUp = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        try await warmUp.close()
        let threadsBefore = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task").count) ?? 0
        weak var freed: Connection?
        do {
            let connection = try await Transport.connect(to: "reconnect+tcp://127.0.0.1:\(port)?reconnect.initialDelay=0&reconnect.jitter=0")
            freed = connection
            let reading = Task { try await connection.read() }
            #expect(await eventually(120) { connection.generation >= rounds }, "generation \(connection.generation)")
            try await connection.close()
            #expect(try await reading.value == nil)
        }
        serving.cancel()
        try await server.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 }, "sockets to the server left open")
        #expect(await eventually(5) { freed == nil }, "the connection (and its reconnect state and tasks) was freed")
        let threadsAfter = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task").count) ?? 0
        #expect(threadsAfter <= threadsBefore + 2, "threads: \(threadsBefore) before, \(threadsAfter) after")
    }
}
