import Foundation
import Glibc
import Synchronization
import Testing
import TestSupport
import TransportKit

/// ble:// GATT serial and scanning through the lab's bluetoothd: hci0 is the central, the tests'
/// own peripheral (LabPeripheral: a Nordic-UART-like service that echoes) is served on hci1.
///
/// Not in the lab's default run (Scripts/lab.d/run-lab-tests skips it; `Scripts/lab --filter GattLab`
/// runs it): in the lab, hci0's discovery sometimes sees none of hci1's advertisements for a whole
/// run, and then every test here fails "not found". Every test passed in four runs out of six; the
/// cause (btvirt, the kernel's advertising instances, or bluetoothd) is not found yet.
@Suite("lab: ble:// GATT serial through BlueZ", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct GattLabTests {
    /// Both controllers and bluetoothd up (BlueZLabTests.setUp), hci1's own advertising off, and the
    /// peripheral registered with its advertisement.
    /// The previous test's peripheral: unregistered before the next one registers.
    static let current = Mutex<LabPeripheral?>(nil)

    static func setUp(echo: Bool = true) async throws -> (BluetoothLabTests.Controllers, LabPeripheral) {
        if let previous = current.withLock({ $0.take() }) { await previous.close() }
        let controllers = try await BlueZLabTests.setUp()
        // The controller's own advertising (btmgmt) would hide the registered advertisement.
        _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "advertising", "off"])
        let peripheral = try await LabPeripheral(echo: echo)
        current.withLock { $0 = peripheral }
        return (controllers, peripheral)
    }

    static func echo(through url: String, _ controllers: BluetoothLabTests.Controllers, _ peripheral: LabPeripheral) async throws -> Connection {
        let connection = try await Transport.connect(to: url)
        let toPeer = BlueZLabTests.pattern(10 * 1024)
        let writeSize = try #require(connection.metadata.mtu)
        #expect(writeSize > 20 && writeSize <= 510, "writes cut to min(ATT MTU - 3, 510): \(writeSize)")
        try await connection.write(toPeer)   // one write, larger than the MTU: chunked
        var messages: [[UInt8]] = []
        var received = 0
        while received < toPeer.count, let message = try await connection.readMessage(timeout: .seconds(10)) {
            messages.append(message)
            received += message.count
        }
        #expect(peripheral.log.bytes.withLock { $0 } == toPeer, "the peripheral got every byte, in order")
        #expect(peripheral.log.writes.withLock { $0 }.allSatisfy { $0 <= writeSize }, "\(peripheral.log.writes.withLock { $0 })")
        #expect(peripheral.log.writes.withLock { $0 }.count == (toPeer.count + writeSize - 1) / writeSize)
        #expect(Array(messages.joined()) == toPeer, "the echo came back whole and in order")
        #expect(messages.count == peripheral.log.writes.withLock { $0 }.count, "one message per notification")
        #expect(connection.metadata.remoteAddress == controllers.peripheralText)
        #expect(connection.metadata.extra["addressType"] == "public")
        #expect(connection.metadata.extra["service"] == LabPeripheral.service)
        #expect(connection.metadata.name == LabPeripheral.name, "\(String(describing: connection.metadata.name))")
        return connection
    }

    @Test func nordicUARTEchoesTenKiBThroughAcquiredDescriptors() async throws {
        let (controllers, peripheral) = try await Self.setUp()
        let connection = try await Self.echo(through: "ble://nus/\(controllers.peripheralText)?adapter=hci0", controllers, peripheral)
        #expect(connection.metadata.extra["notify"] == "AcquireNotify", "\(connection.metadata.extra)")
        #expect(connection.metadata.extra["write"] == "AcquireWrite", "\(connection.metadata.extra)")
        #expect(connection.metadata.extra["attMTU"].flatMap { Int($0) }.map { $0 > 23 } == true, "\(connection.metadata.extra)")
        try await connection.close()
    }

    @Test func theSameThroughStartNotifyAndWriteValue() async throws {
        let (controllers, peripheral) = try await Self.setUp()
        let url = "ble://6E400001-B5A3-F393-E0A9-E50E24DCCA9E/\(controllers.peripheralText)?adapter=hci0&acquire=never"
        let connection = try await Self.echo(through: url, controllers, peripheral)
        #expect(connection.metadata.extra["notify"] == "StartNotify", "\(connection.metadata.extra)")
        #expect(connection.metadata.extra["write"] == "WriteValue (command)", "\(connection.metadata.extra)")
        #expect(connection.metadata.extra["rx"] == "6e400003-b5a3-f393-e0a9-e50e24dcca9e", "rx picked by its notify flag")
        #expect(connection.metadata.extra["tx"] == "6e400002-b5a3-f393-e0a9-e50e24dcca9e", "tx picked by write-without-response")
        try await connection.close()
    }

    /// Runs `scan` until it reports something, starting it again (up to three times) when a
    /// start sees nothing within 6 s: in the lab a discovery sometimes sees no advertisement for its
    /// whole run (btvirt reports an advertiser when scanning starts, not per advertisement), where
    /// starting it again finds the device at once. Returns the events collected so far and the task.
    static func scanUntilSeen(_ scan: BluetoothScan) async -> (events: LabPeripheral.Events, task: Task<Void, Never>?) {
        let events = LabPeripheral.Events()
        for _ in 1...3 {
            let task = Task {
                do {
                    for try await event in BluetoothPlugin().scan(scan) { events.list.withLock { $0.append(event) } }
                } catch {
                    Issue.record("the scan failed: \(error)")
                }
            }
            if await eventually(6, { !events.list.withLock { $0 }.isEmpty }) { return (events, task) }
            task.cancel()
            await task.value
        }
        return (events, nil)
    }

    @Test func aFilteredScanFindsThePeripheralAndReportsItsExpiryOnceItStopsAdvertising() async throws {
        let (controllers, peripheral) = try await Self.setUp()
        let scan = BluetoothScan(services: ["nus"], namePrefix: "TK", end: .after(.seconds(60)), expiry: .seconds(3), adapter: "hci0")
        let (events, running) = await Self.scanUntilSeen(scan)
        let collector = try #require(running, "nothing discovered in three scans")
        defer { collector.cancel() }
        guard case .discovered(let found) = events.list.withLock({ $0[0] }) else {
            Issue.record("the first event is not a discovery: \(events.list.withLock { $0 })")
            return
        }
        #expect(found.address == controllers.peripheralText)
        #expect(found.name == LabPeripheral.name)
        #expect(found.serviceUUIDs.contains(LabPeripheral.service), "\(found.serviceUUIDs)")
        #expect(found.url == "ble://nus/\(controllers.peripheralText)?adapter=hci0")
        #expect(found.adapter == "hci0")
        #expect(found.rssi != nil)
        // Not checked here: that a device still advertising does not expire. btvirt reports an
        // advertiser once per scan start, not per advertisement, so in the lab every device looks
        // gone after the expiry interval (seen: discovered, then expired 3 s later while advertising).
        try await peripheral.stopAdvertising()
        let expired = await eventually(15) {
            events.list.withLock { $0 }.contains { if case .expired(let gone) = $0 { gone.address == controllers.peripheralText } else { false } }
        }
        #expect(expired, "no expiry after the advertisement stopped: \(events.list.withLock { $0 })")
    }

    @Test func withoutADeviceTheStrongestAdvertiserOfTheServiceIsChosen() async throws {
        let (controllers, _) = try await Self.setUp()
        let connection = try await Transport.connect(to: "ble://nus?adapter=hci0")
        #expect(connection.metadata.remoteAddress == controllers.peripheralText)
        try await connection.write([0x10, 0x20, 0x30])
        #expect(try await connection.readMessage(timeout: .seconds(10)) == [0x10, 0x20, 0x30])
        try await connection.close()
        let nobody = await expectLabError(.notFound) { try await Transport.connect(to: "ble://FFF3?adapter=hci0&timeout=3") }
        #expect(nobody?.message.contains("no Bluetooth LE device advertising service 0000fff3") == true, "\(String(describing: nobody))")
    }

    @Test("transportkit list --scan shows the peripheral with a URL that connects")
    func listScanShowsThePeripheral() async throws {
        let (controllers, _) = try await Self.setUp()
        // Up to three runs, for the lab's scans that see nothing (scanUntilSeen).
        var objects: [[String: Any]] = []
        var output = ""
        for _ in 1...3 where !objects.contains(where: { $0["name"] as? String == controllers.peripheralText }) {
            let result = try await Lab.run(Lab.cli, ["list", "--scan", "4", "--json"])
            #expect(result.status == 0, "\(result.stderr)")
            output = result.stdout
            objects = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [[String: Any]])
        }
        #expect(objects.contains { $0["scheme"] as? String == "bluetooth" && $0["name"] as? String == "hci0" }, "adapters are listed: \(output)")
        let device = try #require(objects.first { $0["name"] as? String == controllers.peripheralText }, "\(output)")
        #expect(device["url"] as? String == "ble://nus/\(controllers.peripheralText)?adapter=hci0")
        #expect((device["product"] as? String)?.hasPrefix(LabPeripheral.name) == true, "\(device)")
        var text = ""
        for _ in 1...3 where !text.contains("ble://nus/\(controllers.peripheralText)") {
            text = try await Lab.run(Lab.cli, ["list", "--scan", "4"]).stdout
        }
        #expect(text.contains("ble://nus/\(controllers.peripheralText)"), "\(text)")
    }

    @Test func errorsNameWhatTheDeviceOffers() async throws {
        let (controllers, _) = try await Self.setUp()
        let absent = await expectLabError(.notFound) { try await Transport.connect(to: "ble://FFF1/\(controllers.peripheralText)?adapter=hci0") }
        #expect(absent?.message.contains("has no GATT service 0000fff1-0000-1000-8000-00805f9b34fb; it offers:") == true, "\(String(describing: absent))")
        #expect(absent?.message.contains("6e400001-b5a3-f393-e0a9-e50e24dcca9e") == true, "\(String(describing: absent))")
        let noChar = await expectLabError(.notFound) { try await Transport.connect(to: "ble://nus/\(controllers.peripheralText)?adapter=hci0&rx=FFFF") }
        #expect(noChar?.message.contains("has no characteristic 0000ffff-0000-1000-8000-00805f9b34fb (rx)") == true, "\(String(describing: noChar))")
        let notNotifying = await expectLabError(.unsupported) {
            try await Transport.connect(to: "ble://nus/\(controllers.peripheralText)?adapter=hci0&rx=6E400002-B5A3-F393-E0A9-E50E24DCCA9E")
        }
        #expect(notNotifying?.message.contains("neither notifies nor indicates") == true, "\(String(describing: notNotifying))")
        let missing = await expectLabError(.notFound) { try await Transport.connect(to: "ble://nus/00:11:22:33:44:55?adapter=hci0&timeout=3") }
        #expect(missing?.message.contains("not found within") == true, "\(String(describing: missing))")
    }

    /// Last: it takes the controllers away, after which the lab's scans found nothing (the
    /// scan tests run before it).
    @Test func aControllerRemovedMidTransferEndsWithDisconnectedAfterEveryByteAndAReconnectWorks() async throws {
        for acquire in ["auto", "never"] {
            let (controllers, peripheral) = try await Self.setUp(echo: false)
            let socketsBefore = Descriptors.open().filter { $0.target.hasPrefix("socket:[") }.count
            let url = "ble://nus/\(controllers.peripheralText)?adapter=hci0&acquire=\(acquire)"
            let connection = try await Transport.connect(to: url)
            let sent = BlueZLabTests.pattern(3000)
            peripheral.notify(sent, piece: 300)
            var received: [UInt8] = []
            while received.count < sent.count, let message = try await connection.readMessage(timeout: .seconds(10)) { received += message }
            #expect(received == sent, "\(acquire): the bytes before the drop")
            try await Lab.ctl("bt-down")   // both controllers go away mid-connection
            let (rest, ending) = await Lab.readToEnd(connection)
            #expect(rest.isEmpty)
            #expect(ending?.kind == .disconnected, "\(acquire): \(String(describing: ending))")
            await #expect(throws: TransportError.self) { try await connection.write([1, 2, 3]) }
            try? await connection.close()
            await peripheral.close()
            let closed = await eventually(5) { Descriptors.open().filter { $0.target.hasPrefix("socket:[") }.count <= socketsBefore }
            #expect(closed, "\(acquire): sockets left open: \(Descriptors.open())")
        }
        // A reconnect works once the controllers are back.
        let (controllers, _) = try await Self.setUp()
        let again = try await Transport.connect(to: "ble://nus/\(controllers.peripheralText)?adapter=hci0")
        try await again.write([0x41, 0x42])
        #expect(try await again.readMessage(timeout: .seconds(10)) == [0x41, 0x42])
        try await again.close()
    }
}

/// Expects `body` to fail with a TransportError of `kind`; returns it.
func expectLabError(_ kind: TransportError.Kind, _ body: () async throws -> Connection) async -> TransportError? {
    await expectLabError(kind, what: "a connection", release: { try? await $0.close() }, body)
}

/// The same for a listen that must fail (a listener it got is closed).
func expectLabError(_ kind: TransportError.Kind, _ body: () async throws -> Listener) async -> TransportError? {
    await expectLabError(kind, what: "a listener", release: { try? await $0.close() }, body)
}

private func expectLabError<Value>(_ kind: TransportError.Kind, what: String, release: (Value) async -> Void,
                                   _ body: () async throws -> Value) async -> TransportError? {
    do {
        await release(try await body())
        Issue.record("expected a \(kind) error, got \(what)")
    } catch let error as TransportError {
        #expect(error.kind == kind, "\(error)")
        return error
    } catch {
        Issue.record("expected a TransportError, got \(error)")
    }
    return nil
}
