import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit
import TransportKitSerial

/// A real USB CDC-ACM device: the kernel's cdc_acm driver on the host side of an emulated USB
/// controller (dummy_hcd), a configfs ACM gadget on the other. Unplugging is unbinding the gadget
/// from the controller, which the host side sees exactly as a cable pulled out.
@Suite("lab: USB CDC-ACM serial", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab's USB and Bluetooth drivers: run Scripts/lab"))
struct USBSerialLabTests {
    @Test("transportkit list --json shows the adapter with its IDs, serial number and by-id link")
    func listShowsTheAdapter() async throws {
        let (host, _) = try await Gadget.plug()
        let result = try await Lab.run(Lab.cli, ["list", "--json"])
        #expect(result.status == 0, "\(result.stderr)")
        let objects = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: Any]])
        let device = try #require(objects.first { $0["devnode"] as? String == host }, "\(host) is not in \(result.stdout)")
        #expect(device["vendorId"] as? String == Gadget.vendorID)
        #expect(device["productId"] as? String == Gadget.productID)
        #expect(device["serialNumber"] as? String == Gadget.serial)
        #expect(device["manufacturer"] as? String == "TransportKit")
        #expect(device["product"] as? String == "Lab Serial")
        #expect(device["driver"] as? String == "cdc_acm")
        #expect(device["interface"] as? Int == 0)
        #expect((device["links"] as? [String])?.contains(Gadget.byID) == true, "\(device["links"] ?? "none")")
        #expect(device["url"] as? String == "\(Gadget.selector)&interface=0")
        // The tty row links to its USB device, which is listed too, with its two CDC interfaces.
        let usbURL = "usb://\(Gadget.vendorID):\(Gadget.productID)?serial=\(Gadget.serial)"
        #expect((device["properties"] as? [String: String])?["usbDevice"] == usbURL, "\(device)")
        let usb = try #require(objects.first { $0["url"] as? String == usbURL }, "\(result.stdout)")
        #expect((usb["properties"] as? [String: String])?["interface.0"]?.contains("driver cdc_acm") == true, "\(usb)")
    }

    /// Line settings cdc_acm passes to the device (SET_LINE_CODING); each is read back from the
    /// host tty after opening, and bytes must pass both ways unchanged.
    static let lineSettings: [(query: String, settings: SerialSettings)] = [
        ("baud=9600", SerialSettings(baudRate: 9600)),
        ("baud=115200&parity=even&stopBits=2", SerialSettings(baudRate: 115_200, parity: .even, stopBits: 2)),
        ("baud=250000&dataBits=7&parity=odd", SerialSettings(baudRate: 250_000, dataBits: 7, parity: .odd)),
        ("baud=921600&parity=mark", SerialSettings(baudRate: 921_600, parity: .mark)),
    ]

    @Test("connect by USB selector and by-id path; bytes pass both ways at several line settings")
    func connectByIdentity() async throws {
        let (host, gadgetNode) = try await Gadget.plug()
        for (index, (query, expected)) in Self.lineSettings.enumerated() {
            let url = index.isMultiple(of: 2) ? "\(Gadget.selector)&\(query)" : "tty://\(Gadget.byID)?\(query)"
            let connection = try await Transport.connect(to: url)
            let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
            let opened = connection.metadata.remoteAddress.map { URL(fileURLWithPath: $0).resolvingSymlinksInPath().path }
            #expect(opened == host, "\(url) opened \(connection.metadata.remoteAddress ?? "nothing")")
            let port = try #require(connection.serialPort)
            #expect(try await port.settings() == expected, "\(url)")

            // Seven data bits: payload below 0x80, as a device at 7 bits would send.
            let limit = expected.dataBits == 8 ? 256 : 128
            let toHost = (0..<3000).map { UInt8(($0 * 7 + index) % limit) }
            try await gadget.write(toHost)
            #expect(try await connection.readFrame(.fixedLength(toHost.count), timeout: .seconds(10)) == toHost, "gadget → host at \(query)")
            let toGadget = (0..<3000).map { UInt8(($0 * 13 + index) % limit) }
            try await connection.write(toGadget)
            #expect(try await gadget.readFrame(.fixedLength(toGadget.count), timeout: .seconds(10)) == toGadget, "host → gadget at \(query)")

            try await connection.close()
            try await gadget.close()
        }
    }

    @Test("unplug mid-transfer: every byte received is delivered, then .disconnected within a second; events and wait=true after replug")
    func unplugMidTransfer() async throws {
        let (host, gadgetNode) = try await Gadget.plug()
        let events = await EventCollector()
        defer { events.stop() }
        let descriptorsBefore = Descriptors.targets()

        let connection = try await Transport.connect(to: Gadget.selector)
        let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")

        // The gadget streams a counting pattern until the unplug ends its side too.
        let writer = Task {
            var sent = 0
            while !Task.isCancelled {
                let chunk = (sent..<(sent + 512)).map(Self.pattern)
                do { try await gadget.write(chunk) } catch { break }
                sent += chunk.count
            }
            return sent
        }
        // The host reads everything until the connection ends, noting when it ended and how.
        let reader = Task { () -> ([UInt8], TransportError?, ContinuousClock.Instant) in
            let (received, ending) = await Lab.readToEnd(connection)
            return (received, ending, .now)
        }
        #expect(await eventually(20) { connection.bytesRead >= 64 * 1024 }, "the transfer is under way before the unplug")
        let unplugged = ContinuousClock.now
        try Gadget.setBound(false)

        let (received, error, ended) = await reader.value
        let delay = ended - unplugged
        print("lab: unplug to .disconnected took \(delay) after \(received.count) bytes")
        #expect(error?.kind == .disconnected, "\(String(describing: error))")
        #expect(delay < .seconds(1), "the connection ended \(delay) after the unplug")
        #expect(received.count >= 64 * 1024)
        let firstBad = received.indices.first { received[$0] != Self.pattern($0) }
        #expect(firstBad == nil, "byte \(firstBad ?? -1) differs: bytes were lost or reordered before the unplug")
        writer.cancel()
        _ = await writer.value
        try await connection.close()
        try await gadget.close()

        // The hot-plug stream reports the removal, exactly once so far.
        #expect(await events.waitFor(from: 0, seconds: 10) { $0.action == .removed && Gadget.isOurs($0) && $0.device.devnode == host } != nil,
                "no removal event: \(events.events)")

        // A connect that waits, started before the device is back, finds it after the replug.
        let waiting = Task { try await Transport.connect(to: "\(Gadget.selector)&wait=true&timeout=30") }
        try await Task.sleep(for: .milliseconds(300))
        try Gadget.setBound(true)
        let again = try await waiting.value
        #expect(again.metadata.remoteAddress?.hasPrefix("/dev/ttyACM") == true)
        #expect(await events.waitFor(from: 0, seconds: 10) { $0.action == .added && Gadget.isOurs($0) } != nil,
                "no arrival event: \(events.events)")
        try await again.close()
        #expect(events.events.filter(Gadget.isOurs).map(\.action) == [.removed, .added], "\(events.events)")

        // No descriptor left behind by the connections that ended with the unplug.
        #expect(await eventually(3) { Descriptors.targets() == descriptorsBefore },
                "descriptors before: \(descriptorsBefore), after: \(Descriptors.targets())")
    }

    @Sendable static func pattern(_ index: Int) -> UInt8 { UInt8(truncatingIfNeeded: index % 251) }

    /// Threads of this process that watch modem lines (/proc/self/task/*/comm).
    static func watchThreads() -> Int {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task")) ?? []
        return tasks.filter { ((try? String(contentsOfFile: "/proc/self/task/\($0)/comm", encoding: .utf8)) ?? "").hasPrefix("tk modem lines") }.count
    }

    @Test("closing a port while its modem lines are watched ends the watch and returns at once")
    func closingEndsAModemLineWatch() async throws {
        _ = try await Gadget.plug()
        let connection = try await Transport.connect(to: "tty://\(Gadget.byID)")
        let changes = Gathered(try await #require(connection.serialPort).modemLineChanges())
        #expect(await changes.wait(5) { $0.count == 1 })
        let started = ContinuousClock.now
        try await connection.close()
        #expect(ContinuousClock.now - started < .seconds(2), "close did not wait for the watch")
        #expect(await eventually(3) { changes.ended && Self.watchThreads() == 0 }, "\(changes.elements)")
        #expect(changes.failure == nil, "closed by the app: the sequence ends without an error: \(String(describing: changes.failure))")
        // The port is free again at once (no duplicate of its descriptor holds the lock).
        let again = try await Transport.connect(to: "tty://\(Gadget.byID)")
        try await again.close()
    }

    /// Also the modem lines' changes (TIOCMIWAIT on cdc_acm): the ACM gadget raises DSR and CD
    /// when its side of the port is opened (f_acm's acm_connect, a SERIAL_STATE notification), and
    /// the watch ends with `.disconnected` at the unplug.
    @Test("bytes the host received before the unplug are all delivered after it, then .disconnected")
    func bufferedBytesSurviveTheUnplug() async throws {
        let (_, gadgetNode) = try await Gadget.plug()
        let descriptorsBefore = Descriptors.targets()
        let connection = try await Transport.connect(to: "tty://\(Gadget.byID)")
        // A watch the app stops (its sequence dropped) ends its thread: TIOCMIWAIT interrupted.
        let dropped = Gathered(try await #require(connection.serialPort).modemLineChanges())
        #expect(await dropped.wait(5) { $0.count == 1 })
        // The sequence yields the lines now before its thread is named: wait for it.
        #expect(await eventually(3) { Self.watchThreads() == 1 }, "one thread per watch")
        dropped.stop()
        #expect(await eventually(3) { Self.watchThreads() == 0 }, "the dropped watch's thread ended")
        let changes = Gathered(try await #require(connection.serialPort).modemLineChanges())
        defer { changes.stop() }
        #expect(await changes.wait(5) { $0.count == 1 }, "the lines now, first: \(changes.elements)")
        #expect(changes.elements.first.map { !$0.contains(.dsr) && !$0.contains(.cd) } == true, "\(changes.elements)")
        let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
        #expect(await changes.wait(5) { $0.last?.isSuperset(of: [.dsr, .cd]) == true }, "the gadget's open raised DSR and CD: \(changes.elements)")
        let payload = (0..<20_000).map { UInt8(truncatingIfNeeded: $0 * 31) }
        try await gadget.write(payload)
        // Drained on the gadget: the bytes crossed the bus and cdc_acm acknowledged them.
        try await #require(gadget.serialPort).drain()
        // The host side has had them for a while (TransportKit reads ahead of the application).
        try await Task.sleep(for: .milliseconds(500))
        #expect(connection.bytesRead == 0)
        try Gadget.setBound(false)
        // The application reads only now, after the unplug.
        let (received, ending) = await Lab.readToEnd(connection)
        #expect(received == payload, "\(received.count) of \(payload.count) bytes delivered")
        #expect(ending?.kind == .disconnected, "\(String(describing: ending))")
        #expect(await eventually(5) { changes.ended }, "the watch ends at the unplug")
        #expect((changes.failure as? TransportError)?.kind == .disconnected, "\(String(describing: changes.failure))")
        #expect(await eventually(3) { Self.watchThreads() == 0 })
        try await connection.close()
        try await gadget.close()
        try Gadget.setBound(true)
        #expect(await eventually(3) { Descriptors.targets() == descriptorsBefore },
                "descriptors before: \(descriptorsBefore), after: \(Descriptors.targets())")
    }

    /// The RFC 2217 server over a real port with modem lines: 7E2 set by the client is what the
    /// host's port then has (a pty keeps 8N1), and the client's modemLineChanges() come from the
    /// server's NOTIFY-MODEMSTATE, which follows the CDC-ACM port's TIOCMIWAIT watch.
    /// (Its first version hung at `serving.value`: a session's serve() waited for a client's FIN
    /// that the accepted channel reported as half-closure, not inactivity. Each step is logged.)
    @Test("an rfc2217:// server sets the real port's framing and notifies its client when DSR and CD rise", .timeLimit(.minutes(2)))
    func rfc2217ServerNotifiesTheRealPortsModemLines() async throws {
        let (_, gadgetNode) = try await Gadget.plug()
        let served = try await Self.serveOverRFC2217("modem lines")
        // Framing a pty would not keep, on a real driver: the client's SETs reach cdc_acm's termios.
        let asked = SerialSettings(baudRate: 57_600, dataBits: 7, parity: .even, stopBits: 2)
        try await #require(served.remote.serialPort).apply(asked)
        #expect(try await served.device.serialPort?.settings() == asked, "the host's port, read locally")
        #expect(try await served.remote.serialPort?.settings() == asked, "the server's answers")
        let changes = Gathered(try await #require(served.remote.serialPort).modemLineChanges())
        defer { changes.stop() }
        #expect(await changes.wait(10) { $0.count >= 1 }, "the lines now, first: \(changes.elements)")
        #expect(changes.elements.first.map { !$0.contains(.dsr) && !$0.contains(.cd) } == true, "\(changes.elements)")
        Self.step("modem lines", "gadget opens")
        let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
        #expect(await changes.wait(10) { $0.last?.isSuperset(of: [.dsr, .cd]) == true },
                "the gadget's open raised DSR and CD on the host's port, and the server told its client: \(changes.elements)")
        try await gadget.close()
        try await served.end()
    }

    /// Line errors from a real driver: the gadget's break reaches the host as a CDC SERIAL_STATE
    /// notification with its BREAK bit, which cdc_acm counts (TIOCGICOUNT); an RFC 2217 server
    /// in front of the port notifies it (NOTIFY-LINESTATE), and its client counts it too.
    @Test("a break from the device is counted by the tty and by an rfc2217:// client of a server in front of it", .timeLimit(.minutes(2)))
    func aBreakFromTheDeviceIsCountedLocallyAndRemotely() async throws {
        let (_, gadgetNode) = try await Gadget.plug()
        let served = try await Self.serveOverRFC2217("line errors")
        let local = try #require(served.device.serialPort)
        let before = try await local.lineErrors()
        // The server's watch reads its first count within a quarter second of the client's mask.
        try await Task.sleep(for: .seconds(1))
        Self.step("line errors", "gadget sends a break")
        let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
        try await #require(gadget.serialPort).sendBreak(duration: .milliseconds(300))
        let remote = try #require(served.remote.serialPort)
        var grown = LineErrorCounts()
        var counted = LineErrorCounts()
        for _ in 0..<100 where grown.breaks == 0 || counted.breaks == 0 {
            grown = try await local.lineErrors().since(before)
            counted = try await remote.lineErrors()
            try await Task.sleep(for: .milliseconds(50))
        }
        #expect(grown.breaks >= 1 && grown.framing == 0 && grown.parity == 0, "cdc_acm's counters: \(grown)")
        #expect(counted.breaks >= 1 && counted.framing == 0, "NOTIFY-LINESTATE to the client: \(counted)")
        try await gadget.close()
        try await served.end()
    }

    /// The adapter unplugged under a remote client: `transportkit bridge --once --listen
    /// rfc2217://…` serves the CDC-ACM port; the client reads every byte the device sent before the
    /// unplug, then the end of its connection, and the bridge ends saying the device went away.
    @Test("unplugged under an rfc2217:// client of the bridge: the bytes before, then a clear end", .timeLimit(.minutes(2)))
    func unplugUnderARemoteClient() async throws {
        let (_, gadgetNode) = try await Gadget.plug()
        defer { try? Gadget.setBound(true) }   // plugged back in, however the test ends
        let address = "127.0.0.1:42170"
        let bridge = Task {
            try await Lab.run("/usr/bin/timeout", ["60", Lab.cli, "bridge", "--once", "--json", "--listen", "rfc2217://\(address)", "tty://\(Gadget.byID)"])
        }
        step("unplug", "client connects")
        var remote: Connection?
        for _ in 0..<100 where remote == nil {
            remote = try? await Transport.connect(to: "rfc2217://\(address)?baud=115200")
            if remote == nil { try await Task.sleep(for: .milliseconds(100)) }
        }
        let client = try #require(remote, "the bridge never listened")
        let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
        let payload = (0..<4096).map { UInt8(truncatingIfNeeded: $0 * 7) }
        try await gadget.write(payload)
        try await #require(gadget.serialPort).drain()
        try await Task.sleep(for: .milliseconds(300))
        step("unplug", "gadget unbound")
        try Gadget.setBound(false)
        let (received, ending) = await Lab.readToEnd(client)
        #expect(received == payload, "\(received.count) of \(payload.count) bytes")
        #expect(ending == nil || ending?.kind == .disconnected, "the end of the stream, or .disconnected: \(String(describing: ending))")
        try await client.close()
        try await gadget.close()
        step("unplug", "bridge ends")
        let result = try await bridge.value
        #expect(result.stderr.contains("\(Gadget.byID) went away (adapter unplugged"), "the bridge says why: \(result.stderr)")
        #expect(result.status == 1, "\(result.status)")
        step("unplug", "done")
    }

    /// `reconnect+` around the adapter's USB identity: unplugged and plugged in again, it is found
    /// again (a new ttyACM node, resolved from its serial number), woken by the arrival long
    /// before its 30 s delay, with the settings the app had set; bytes flow on the same Connection.
    @Test("reconnect+tty://usb/…: back after a replug, woken by the arrival, with the app's settings", .timeLimit(.minutes(2)))
    func reconnectFindsTheAdapterAgainAfterAReplug() async throws {
        let (_, gadgetNode) = try await Gadget.plug()
        defer { try? Gadget.setBound(true) }
        let connection = try await Transport.connect(to: "reconnect+\(Gadget.selector)&reconnect.initialDelay=30&reconnect.jitter=0")
        let events = Gathered(connection.events())
        defer { events.stop() }
        let asked = SerialSettings(baudRate: 57_600, dataBits: 7, parity: .even)
        try await #require(connection.serialPort).apply(asked)
        // A reader finds the loss, waits across it, and reads from the next connection.
        let reading = Task { try await connection.readFrame(.fixedLength(16), timeout: .seconds(60)) }
        step("reconnect", "unplug")
        try Gadget.setBound(false)
        #expect(await events.wait(10) { $0.contains { if case .disconnected = $0 { true } else { false } } }, "\(events.elements)")
        step("reconnect", "replug")
        let replugged = ContinuousClock.now
        try Gadget.setBound(true)
        #expect(await events.wait(20) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        let back = ContinuousClock.now - replugged
        step("reconnect", "connected again \(back) after the replug")
        #expect(back < .seconds(15), "the arrival started the attempt, not the 30 s delay: \(back)")
        #expect(try await connection.serialPort?.settings() == asked, "the app's settings were set on the new port")
        let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
        try await gadget.write("after the replug")
        #expect(try await reading.value == Array("after the replug".utf8))
        try await gadget.close()
        try await connection.close()
    }

    /// A listener on loopback whose first client is served with the host side of the gadget
    /// (`tty://` by its by-id link), and that client, connected.
    struct Served {
        let device: Connection
        let remote: Connection
        let serving: Task<Void, any Error>
        let listener: Listener
        let label: String

        func end() async throws {
            USBSerialLabTests.step(label, "client closes")
            try await remote.close()
            USBSerialLabTests.step(label, "session ends")
            try await serving.value
            try await device.close()
            try await listener.close()
            USBSerialLabTests.step(label, "done")
        }
    }

    static func serveOverRFC2217(_ label: String) async throws -> Served {
        let device = try await Transport.connect(to: "tty://\(Gadget.byID)")
        let listener = try await Transport.listen(on: "rfc2217://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let serving = Task {
            guard let client = try await listener.accept(), let session = client.rfc2217Session, let serial = device.serialPort else { return }
            await session.serve(serial)
            step(label, "serve returned")
            try await client.close()
        }
        step(label, "client connects")
        let remote = try await Transport.connect(to: "rfc2217://127.0.0.1:\(port)")
        return Served(device: device, remote: remote, serving: serving, listener: listener, label: label)
    }

    func step(_ label: String, _ what: String) { Self.step(label, what) }

    static func step(_ label: String, _ what: String) {
        FileHandle.standardError.write(Data("[\(label)] \(what)\n".utf8))
    }

    @Test("100 unplug/replug cycles with a watcher: every removal and arrival reported exactly once")
    func hundredReplugCycles() async throws {
        _ = try await Gadget.plug()
        let events = await EventCollector()
        defer { events.stop() }
        let cycles = 100
        let started = ContinuousClock.now
        var next = 0
        for cycle in 1...cycles {
            try Gadget.setBound(false)
            let removal = try #require(await events.waitFor(from: next, seconds: 15) { Gadget.isOurs($0) },
                                       "cycle \(cycle): no event after the unplug")
            #expect(events.events[removal].action == .removed, "cycle \(cycle): \(events.events[removal])")
            try Gadget.setBound(true)
            let arrival = try #require(await events.waitFor(from: removal + 1, seconds: 15) { Gadget.isOurs($0) },
                                       "cycle \(cycle): no event after the replug")
            #expect(events.events[arrival].action == .added, "cycle \(cycle): \(events.events[arrival])")
            next = arrival + 1
        }
        let elapsed = ContinuousClock.now - started
        // Anything late (a duplicate) would arrive within this grace period.
        try await Task.sleep(for: .seconds(2))
        let ours = events.events.filter(Gadget.isOurs)
        print("lab: \(cycles) replug cycles in \(elapsed), \(ours.count) events")
        #expect(ours.filter { $0.action == .removed }.count == cycles)
        #expect(ours.filter { $0.action == .added }.count == cycles)
        #expect(ours.count == 2 * cycles, "unexpected events: \(ours.filter { $0.action == .changed })")
        #expect(events.failure == nil)
        // The device works after the cycles.
        let connection = try await Transport.connect(to: "\(Gadget.selector)&wait=true&timeout=20")
        #expect(connection.metadata.remoteAddress?.hasPrefix("/dev/ttyACM") == true)
        try await connection.close()
    }
}
