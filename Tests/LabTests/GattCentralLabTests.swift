import Foundation
import Glibc
import Synchronization
import Testing
import TestSupport
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// The GATT central (BluetoothPeripheral) and `transportkit gatt` through the lab's bluetoothd:
/// hci0 is the central, the tests' own peripheral (LabPeripheral: Nordic UART echo, Battery, and a
/// service of its own) is served on hci1 by bluetoothd's GATT server.
@Suite("lab: GATT central through BlueZ", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct GattCentralLabTests {
    static let nusRX = "6e400002-b5a3-f393-e0a9-e50e24dcca9e"
    static let nusTX = "6e400003-b5a3-f393-e0a9-e50e24dcca9e"

    @Test func servicesReadsWritesAndNotificationsOfAnotherDevice() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp()
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        do {
            let services = device.services
            let uuids = services.map(\.shortUUID)
            #expect(uuids.contains("180f") && uuids.contains(LabPeripheral.service) && uuids.contains(LabPeripheral.customService), "\(uuids)")
            let battery = try #require(services.first { $0.shortUUID == "180f" }?.characteristics.first)
            #expect(battery.shortUUID == "2a19" && battery.canRead && battery.canNotify, "\(battery)")
            #expect(battery.descriptors.contains { $0.shortUUID == "2901" }, "the User Description descriptor is listed: \(battery.descriptors)")
            #expect(device.attMTU.map { $0 >= 23 } ?? true, "\(String(describing: device.attMTU))")

            #expect(try await device.read("2a19") == [LabPeripheral.batteryLevel])
            try await device.write([1, 2, 3], to: LabPeripheral.stored)
            #expect(try await device.read(LabPeripheral.stored) == [1, 2, 3])
            #expect(peripheral.stored.value.withLock { $0 } == [1, 2, 3], "the peripheral got the write")
            try await device.write([9], to: LabPeripheral.stored, type: .withoutResponse)
            try await Task.sleep(for: .milliseconds(300))
            #expect(try await device.read(LabPeripheral.stored) == [9], "a write without response arrived too")
            // A long write (past one ATT packet) with a response.
            let long = (0..<300).map { UInt8(truncatingIfNeeded: $0) }
            try await device.write(long, to: LabPeripheral.stored)
            // The characteristic also takes writes without response, so bluetoothd (5.66) answers
            // the central before the application has the parts: wait for them.
            #expect(await eventually(5) { peripheral.stored.value.withLock { $0 } == long }, "a 300-byte long write arrived whole")

            // Notifications: subscribed before the values are sent, each one in order.
            let values = try await device.notifications(of: "2a19")
            var iterator = values.makeAsyncIterator()
            for level in [50, 49, 48] as [UInt8] { try await peripheral.notifyBatteryLevel(level) }
            var received: [[UInt8]] = []
            for _ in 0..<3 { if let value = try await iterator.next() { received.append(value) } }
            #expect(received == [[50], [49], [48]])

            // Write, then collect the echo up to a delimiter (Bluejay's writeAndAssemble).
            let answer = try await device.write(Array("ping\n".utf8), to: Self.nusRX, thenCollectFrom: Self.nusTX, until: .delimiter([0x0a]))
            #expect(answer == Array("ping\n".utf8))
            let counted = try await device.write(Array("0123456789".utf8), to: Self.nusRX, type: .withoutResponse, thenCollectFrom: Self.nusTX, until: .count(10))
            #expect(counted == Array("0123456789".utf8))
        } catch {
            Issue.record(error)
        }
        await device.disconnect()
    }

    @Test func errorsSayWhatIsThereAndWhatToDo() async throws {
        let (controllers, _) = try await GattLabTests.setUp()
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        let missing = await expectLabFailure(.notFound) { _ = try await device.read("2a00") }
        #expect(missing?.message.contains("has no characteristic 2a00") == true && missing?.message.contains("180f (2a19 [read,notify])") == true,
                "the characteristics there are listed: \(String(describing: missing))")
        let notReadable = await expectLabFailure(.unsupported) { _ = try await device.read(Self.nusRX) }
        #expect(notReadable?.message.contains("cannot be read") == true, "\(String(describing: notReadable))")
        let cannotNotify = await expectLabFailure(.unsupported) { _ = try await device.notifications(of: LabPeripheral.stored) }
        #expect(cannotNotify?.message.contains("neither notifies nor indicates") == true, "\(String(describing: cannotNotify))")
        let limit = device.maximumWriteLength(for: .withoutResponse)
        let tooLong = await expectLabFailure(.misuse) { try await device.write([UInt8](repeating: 1, count: limit + 1), to: LabPeripheral.stored, type: .withoutResponse) }
        #expect(tooLong?.message.contains("at most \(limit)") == true, "\(String(describing: tooLong))")
        let tooLongWithResponse = await expectLabFailure(.misuse) { try await device.write([UInt8](repeating: 1, count: 513), to: LabPeripheral.stored) }
        #expect(tooLongWithResponse?.message.contains("at most 512") == true, "\(String(describing: tooLongWithResponse))")
        let wrongService = await expectLabFailure(.notFound) { _ = try await device.read("2a19", service: "1800") }
        #expect(wrongService?.message.contains("has no service 1800") == true, "\(String(describing: wrongService))")
        // encrypt-read without pairing: bluetoothd tries to raise the link's security, which
        // needs an agent, and answers ATT error 0x0e, or not at all (NoReply after 25 s), both
        // seen with BlueZ 5.66 here, or an authentication error, or the failed pairing drops the
        // link (once in a CI rehearsal); each way the error says to pair first.
        do {
            _ = try await device.read(LabPeripheral.encrypted)
            Issue.record("an encrypted characteristic read without pairing")
        } catch let error as TransportError {
            #expect([.permissionDenied, .io, .timedOut, .disconnected].contains(error.kind), "\(error)")
            #expect(error.message.contains("pair first"), "\(error)")
            print("lab: encrypt-read without pairing: \(error)")
        }
        await device.disconnect()
        let bad = await expectLabFailure(.invalidURL) { _ = try await BluetoothPeripheral.connect(to: "not-an-address") }
        #expect(bad?.message.contains("is not a Bluetooth address") == true)
    }

    /// The peripheral's adapter powered off mid-notify: the events say disconnected, the
    /// notification sequence ends with `.disconnected`, and a read after fails at once.
    @Test func theLinkDroppingIsAnEventAndEndsWhatWaits() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp()
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        let events = device.events()
        let values = try await device.notifications(of: "2a19")
        try await peripheral.notifyBatteryLevel(40)
        var iterator = values.makeAsyncIterator()
        #expect(try await iterator.next() == [40])
        let started = ContinuousClock.now
        let off = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "power", "off"])
        #expect(off.status == 0, "\(off.stderr)")
        do {
            while try await iterator.next() != nil {}
            Issue.record("the notifications ended without an error")
        } catch let error as TransportError {
            #expect(error.kind == .disconnected, "\(error)")
        }
        var eventIterator = events.makeAsyncIterator()
        let event = await eventIterator.next()
        if case .disconnected(let reason, let willReconnect)? = event {
            #expect(reason.contains("disconnected") && !willReconnect, "\(reason)")
        } else {
            Issue.record("no disconnected event: \(String(describing: event))")
        }
        #expect(ContinuousClock.now - started < .seconds(10), "\(ContinuousClock.now - started)")
        #expect(!device.isConnected)
        await expectLabFailure(.disconnected) { _ = try await device.read("2a19") }
        await device.disconnect()
        _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "power", "on"])
    }

    /// Pairing: without an agent bluetoothd cannot pair over LE and the error says an agent is
    /// needed; with the built-in Just Works agent the central pairs, the characteristic that needs
    /// encryption reads, and forget() removes the device and its keys; then the same with the tool.
    ///
    /// Each connect after a forget finds the device again by discovery, so the peripheral
    /// re-announces itself while hci0 discovers (btvirt reports an advertisement only when
    /// advertising or scanning starts: GattScanLabTests explains).
    @Test func pairingNeedsAnAgentThenOpensTheEncryptedCharacteristicAndForgetRemovesIt() async throws {
        let (controllers, first) = try await GattLabTests.setUp()
        let address = controllers.peripheralText
        let unpaired = try await BluetoothPeripheral.connect(to: address, adapter: "hci0")
        #expect(!unpaired.isPaired)
        let refused = await expectLabFailure(.permissionDenied) { try await unpaired.pair() }
        #expect(refused?.message.contains("agent") == true, "\(String(describing: refused))")
        // A failed LE pairing drops the link: connect again, to a peripheral advertising afresh.
        await unpaired.disconnect()
        _ = first
        final class Asked: Sendable { let requests = Locked<[BluetoothPairingRequest]>([]) }
        let asked = Asked()
        let agent = try await BluetoothPairingAgent.register { request in
            asked.requests.withLock { $0.append(request) }
            return .accept
        }
        do {
            try await BlueZLabTests.forgetDevices()
            let (_, second) = try await GattLabTests.setUp()
            let announcer = second.announceWhileDiscovering()
            let device = try await BluetoothPeripheral.connect(to: address, adapter: "hci0", timeout: .seconds(30))
            announcer.cancel()
            try await device.pair()
            #expect(device.isPaired)
            print("lab: the agent was asked: \(asked.requests.withLock { $0 })")
            #expect(try await device.read(LabPeripheral.encrypted) == [0x5e], "paired: the encrypted characteristic reads")
            try await device.forget()
            #expect(!device.isConnected)
            let bus = try DBusConnection(.system)
            let reply = try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
            await bus.close()
            let path = "/org/bluez/hci0/dev_" + address.replacingOccurrences(of: ":", with: "_")
            #expect(reply.first?.dictionary?[path] == nil, "forgotten: bluetoothd no longer has \(path)")
            await device.disconnect()

            // The tool does the same. The test's agent stays registered: it plays the peer's agent
            // (hci1's side is asked to authorize), while `gatt pair` registers its own for hci0's.
            try await BlueZLabTests.forgetDevices()
            let (_, third) = try await GattLabTests.setUp()
            let toolAnnouncer = third.announceWhileDiscovering()
            let paired = try await Lab.run(Lab.cli, ["gatt", address, "pair", "--adapter", "hci0", "--timeout", "30"])
            toolAnnouncer.cancel()
            #expect(paired.status == 0 && paired.stdout.contains("paired with \(address)"), "pair: \(paired.stdout) \(paired.stderr)")
            let secret = try await Lab.run(Lab.cli, ["gatt", address, "read", LabPeripheral.encrypted, "--adapter", "hci0"])
            #expect(secret.status == 0 && secret.stdout == "5E\n", "paired, the tool reads it: \(secret.stdout) \(secret.stderr)")
            let forgot = try await Lab.run(Lab.cli, ["gatt", address, "forget", "--adapter", "hci0"])
            #expect(forgot.status == 0 && forgot.stdout.contains("forgot \(address)"), "forget: \(forgot.stdout) \(forgot.stderr)")
            let again = try await Lab.run(Lab.cli, ["gatt", address, "forget", "--adapter", "hci0"])
            #expect(again.status == 0 && again.stdout.contains("did not know"), "\(again.stdout) \(again.stderr)")
        } catch {
            Issue.record(error)
        }
        await agent.unregister()
        // hci1 keeps keys for hci0 too: both sides forget, for the tests after.
        try await BlueZLabTests.forgetDevices()
    }

    @Test func theToolListsReadsWritesAndFollowsNotifications() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp()
        // Each invocation connects anew; after a test that forgot the device, that takes a
        // discovery, which needs the peripheral to re-announce itself (see the pairing test).
        let announcer = peripheral.announceWhileDiscovering()
        defer { announcer.cancel() }
        let address = controllers.peripheralText
        let listed = try await Lab.run(Lab.cli, ["gatt", address, "--adapter", "hci0", "--timeout", "30"])
        #expect(listed.status == 0, "list: \(listed.stderr)")
        #expect(listed.stdout.contains("service 0000180f-0000-1000-8000-00805f9b34fb"), "\(listed.stdout)")
        #expect(listed.stdout.contains("characteristic 00002a19-0000-1000-8000-00805f9b34fb [read,notify]"), "\(listed.stdout)")
        #expect(listed.stdout.contains("descriptor 00002901-0000-1000-8000-00805f9b34fb"), "\(listed.stdout)")
        let json = try await Lab.run(Lab.cli, ["gatt", address, "--adapter", "hci0", "--json"])
        let services = try #require(try JSONSerialization.jsonObject(with: Data(json.stdout.utf8)) as? [[String: Any]], "\(json.stdout) \(json.stderr)")
        #expect(services.contains { $0["uuid"] as? String == LabPeripheral.customService }, "\(json.stdout)")

        let read = try await Lab.run(Lab.cli, ["gatt", address, "read", "2a19", "--adapter", "hci0"])
        #expect(read.status == 0 && read.stdout == "57\n", "87 is 0x57: \(read.stdout) \(read.stderr)")
        let written = try await Lab.run(Lab.cli, ["gatt", address, "write", LabPeripheral.stored, "0d:0a:ff", "--adapter", "hci0"])
        #expect(written.status == 0, "write: \(written.stderr)")
        #expect(peripheral.stored.value.withLock { $0 } == [0x0d, 0x0a, 0xff])

        // notify --count 2 while the peripheral notifies every 300 ms.
        let notifier = Task {
            var level: UInt8 = 30
            while !Task.isCancelled {
                try? await peripheral.notifyBatteryLevel(level)
                level &+= 1
                try? await Task.sleep(for: .milliseconds(300))
            }
        }
        let followed = try await Lab.run(Lab.cli, ["gatt", address, "notify", "2a19", "--count", "2", "--adapter", "hci0"])
        notifier.cancel()
        #expect(followed.status == 0, "notify: \(followed.stderr)")
        #expect(followed.stdout.split(separator: "\n").count == 2, "\(followed.stdout)")

        let refused = try await Lab.run(Lab.cli, ["gatt", address, "read", "2a19", "--json"])
        #expect(refused.status == 64 && refused.stderr.contains("--json is for 'gatt ADDRESS list'"), "\(refused.status) \(refused.stderr)")
        let missing = try await Lab.run(Lab.cli, ["gatt", address, "read", "2a00", "--adapter", "hci0"])
        #expect(missing.status == 1 && missing.stderr.contains("has no characteristic 2a00"), "\(missing.stderr)")
    }

    /// A GATT server no one here wrote: bluez-peripheral (PyPI 0.1.7, on dbus-next; Scripts/lab
    /// installs it into its cache) publishes Peers/bluez_peripheral_server.py's service on hci1.
    /// The central lists it, reads a value longer than one packet (bluetoothd reads it at offsets,
    /// which the server's handler cuts), writes with and without response and is notified.
    @Test func aServerWrittenWithBluezPeripheralServesTheCentral() async throws {
        let (controllers, _) = try await GattLabTests.setUp()
        let library = try #require(ProcessInfo.processInfo.environment["TRANSPORTKIT_LAB_PYTHONPATH"], "Scripts/lab installs bluez-peripheral")
        let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers/bluez_peripheral_server.py").path
        let server = try Lab.Background("/usr/bin/python3", [script, "hci1"], environment: ["PYTHONPATH": library])
        defer { Task { await server.stop() } }
        let printed = { server.output }
        try #require(await eventually(20, every: .milliseconds(50)) { printed().contains("ready") }, "bluez_peripheral_server.py: \(printed())")

        // A link made before the server registered carries the services of then: connect anew,
        // and once more if bluetoothd answered from its cache of the device (as bleak's script does).
        try await GattServerLabTests.disconnect(controllers.peripheralText)
        var device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        if !device.services.contains(where: { $0.uuid == Self.bpService }) {
            await device.disconnect()
            device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        }
        do {
            let service = try #require(device.services.first { $0.uuid == Self.bpService }, "\(device.services.map(\.uuid))")
            let flags = Dictionary(uniqueKeysWithValues: service.characteristics.map { ($0.uuid, Set($0.flags)) })
            #expect(flags[Self.bpLong] == ["read"], "\(flags)")
            #expect(flags[Self.bpStored] == ["read", "write", "write-without-response"], "\(flags)")
            #expect(flags[Self.bpTicker] == ["read", "notify"], "\(flags)")

            #expect(try await device.read(Self.bpLong) == Array(0..<100), "read whole, past one packet")
            try await device.write([0xca, 0xfe], to: Self.bpStored)
            // The characteristic also takes writes without response, so bluetoothd (5.66) answers
            // the central before the application has the value: wait for it.
            #expect(await eventually(5) { printed().contains("wrote cafe") }, "\(printed())")
            #expect(try await device.read(Self.bpStored) == [0xca, 0xfe])
            try await device.write([0x5a], to: Self.bpStored, type: .withoutResponse)
            #expect(await eventually(5) { printed().contains("wrote 5a") }, "\(printed())")

            let ticks = try await device.notifications(of: Self.bpTicker)
            var received: [UInt8] = []
            for try await value in ticks {
                received.append(contentsOf: value)
                if received.count == 3 { break }
            }
            #expect(received.count == 3 && zip(received, received.dropFirst()).allSatisfy { $1 == $0 &+ 1 }, "consecutive counts: \(received)")
        } catch {
            Issue.record(error, "bluez_peripheral_server.py: \(printed())")
        }
        await device.disconnect()
        await server.stop()
    }

    static let bpService = "7e1a0000-6c3d-4b8e-9f1a-3c5e2d4b6a70"
    static let bpLong = "7e1a0001-6c3d-4b8e-9f1a-3c5e2d4b6a70"
    static let bpStored = "7e1a0002-6c3d-4b8e-9f1a-3c5e2d4b6a70"
    static let bpTicker = "7e1a0003-6c3d-4b8e-9f1a-3c5e2d4b6a70"
}
