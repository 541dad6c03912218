import Foundation
import Synchronization
import Testing
import TestSupport
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// The peripheral role (GATTServer) through the lab's bluetoothd: the app's services published on
/// hci1, and bluetoothd's own GATT client on hci0 as the central (driven through
/// BluetoothPeripheral): reads answered by handlers, long reads cut at their offsets, writes
/// with and without response, refusals as ATT errors, notifications and indications with their
/// confirmations, the central's coming and going as events, and close().
@Suite("lab: GATT server (the peripheral role) through BlueZ", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct GattServerLabTests {
    static let service = "a0c1e000-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let counter = "a0c1e001-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let long = "a0c1e002-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let writable = "a0c1e003-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let unacknowledged = "a0c1e006-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let notifier = "a0c1e004-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let indicator = "a0c1e005-7b2d-4a0e-9d4c-5e7a1b2c3d40"

    /// What the handlers saw.
    final class Seen: Sendable {
        let reads = Locked<[GATTServer.ReadRequest]>([])
        let writes = Locked<[GATTServer.WriteRequest]>([])
    }

    static func services(_ seen: Seen) -> [GATTServer.Service] {
        let longValue = (0..<300).map { UInt8(truncatingIfNeeded: $0) }
        return [GATTServer.Service(uuid: service, characteristics: [
            GATTServer.Characteristic(uuid: counter, properties: .read, descriptors: [.userDescription("reads so far")], onRead: { request in
                let count = seen.reads.withLock { reads in
                    reads.append(request)
                    return reads.count
                }
                return [UInt8(truncatingIfNeeded: count)]
            }),
            GATTServer.Characteristic(uuid: long, properties: .read, value: longValue),
            GATTServer.Characteristic(uuid: writable, properties: [.read, .write], onWrite: { request in
                seen.writes.withLock { $0.append(request) }
                if request.value == [0xff] { throw GATTServer.Failure.application(0x85) }
            }),
            GATTServer.Characteristic(uuid: unacknowledged, properties: [.write, .writeWithoutResponse]),
            GATTServer.Characteristic(uuid: notifier, properties: .notify),
            GATTServer.Characteristic(uuid: indicator, properties: .indicate),
        ])]
    }

    @Test func aCentralReadsWritesAndIsNotifiedByTheAppsServices() async throws {
        let (controllers, _) = try await GattLabTests.setUp()
        let seen = Seen()
        // The lab peripheral advertises on hci1 already: hci0 knows the address, which now
        // serves these services too.
        let server = try await GATTServer.publish(Self.services(seen), advertising: nil, adapter: "hci1")
        let events = Gathered(server.events())
        // A link an earlier test left up would hide the central's arrival: down first.
        try await Self.disconnect(controllers.peripheralText)
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        do {
            let ours = try #require(device.services.first { $0.uuid == Self.service }, "\(device.services.map(\.shortUUID))")
            #expect(ours.characteristics.map(\.uuid) == [Self.counter, Self.long, Self.writable, Self.unacknowledged, Self.notifier, Self.indicator])
            #expect(ours.characteristics.first?.descriptors.contains { $0.shortUUID == "2901" } == true)
            #expect(ours.characteristics.last?.flags == ["indicate"])

            // Reads answered by the handler, with the requesting central and the MTU.
            #expect(try await device.read(Self.counter) == [1])
            #expect(try await device.read(Self.counter) == [2])
            let request = try #require(seen.reads.withLock { $0.first })
            #expect(request.central == controllers.centralText && request.offset == 0 && (request.attMTU ?? 0) >= 23, "\(request)")
            // A 300-byte value: bluetoothd reads it in parts (Read Blob), each cut at its offset here.
            #expect(try await device.read(Self.long) == (0..<300).map { UInt8(truncatingIfNeeded: $0) })

            // Writes, with and without response; a refusal reaches the central as an ATT error.
            try await device.write([1, 2, 3], to: Self.writable)
            #expect(try server.value(of: Self.writable) == [1, 2, 3])
            try await device.write([4], to: Self.unacknowledged, type: .withoutResponse)
            try await device.write([5], to: Self.unacknowledged)
            try await Task.sleep(for: .milliseconds(300))
            #expect(try server.value(of: Self.unacknowledged) == [5])
            #expect(seen.writes.withLock { $0.map(\.value) } == [[1, 2, 3]])
            do {
                try await device.write([0xff], to: Self.writable)
                Issue.record("a write the handler refused succeeded")
            } catch let error as TransportError {
                #expect(error.message.contains("0x85"), "the central hears the app's ATT error: \(error)")
            }
            #expect(try server.value(of: Self.writable) == [1, 2, 3], "a refused write is not stored")
            // A long write (past one packet) arrives in parts; the stored value is whole.
            let longWrite = (0..<200).map { UInt8(truncatingIfNeeded: $0 &* 7) }
            try await device.write(longWrite, to: Self.writable)
            #expect(try server.value(of: Self.writable) == longWrite)

            // Notifications and indications, to the central that subscribed (once bluetoothd has
            // passed the subscription on: a value sent before goes to nobody).
            let notifications = Gathered(try await device.notifications(of: Self.notifier))
            let notifier = Self.notifier, indicator = Self.indicator
            #expect(await events.wait(5) { $0.contains(.subscribed(characteristic: notifier)) }, "StartNotify came: \(events.elements)")
            for value in [[7], [8, 9]] as [[UInt8]] { try await server.notify(value, to: Self.notifier) }
            #expect(await notifications.wait(10) { $0.count >= 2 } && notifications.elements == [[7], [8, 9]], "\(notifications.elements)")
            let indications = Gathered(try await device.notifications(of: Self.indicator))
            #expect(await events.wait(5) { $0.contains(.subscribed(characteristic: indicator)) }, "StartNotify came: \(events.elements)")
            try await server.notify([42], to: Self.indicator)
            #expect(await indications.wait(10) { !$0.isEmpty } && indications.elements == [[42]], "\(indications.elements)")

            // Refusals on this side.
            await expectServerError(.unsupported) { try await server.notify([1], to: Self.long) }
            await expectServerError(.notFound) { try await server.notify([1], to: "2a19") }
        } catch {
            Issue.record(error)
        }
        await device.disconnect()
        try await Task.sleep(for: .seconds(3))
        await server.close()
        #expect(await events.wait(5) { _ in events.ended })
        let happened = events.elements
        let notifierUUID = Self.notifier, indicatorUUID = Self.indicator
        #expect(happened.contains(.centralConnected(address: controllers.centralText)), "\(happened)")
        #expect(happened.contains(.subscribed(characteristic: notifierUUID)) && happened.contains(.subscribed(characteristic: indicatorUUID)), "\(happened)")
        #expect(happened.contains(.indicationConfirmed(characteristic: indicatorUUID)), "the central confirmed the indication: \(happened)")
        #expect(happened.contains(.centralDisconnected(address: controllers.centralText)), "\(happened)")
        #expect(happened.last == .stopped(reason: "closed"), "\(happened)")
        await expectServerError(.disconnected) { try await server.notify([1], to: Self.notifier) }
    }

    /// bleak (Debian's python3-bleak 0.20, the central most Linux users know) against the same
    /// services: it finds the device, reads what the handler answers, writes with response,
    /// receives a notification, and the link holds 3 s more (Peers/bleak_central.py keeps one
    /// event loop: bleak disconnects when the loop that connected ends, the 2-s link loss
    /// PEERS.md recorded).
    @Test func bleakAsTheCentralReadsWritesAndIsNotified() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp()
        let seen = Seen()
        let server = try await GATTServer.publish(Self.services(seen), advertising: nil, adapter: "hci1")
        defer { Task { await server.close() } }
        try await Self.disconnect(controllers.peripheralText)
        // btvirt reports an advertisement only as advertising or scanning starts: the lab
        // peripheral on hci1 announces itself again while bleak's scan runs (LabPeripheral explains).
        let announcer = peripheral.announceWhileDiscovering()
        defer { announcer.cancel() }
        let events = Gathered(server.events())
        // Notifies once bleak has subscribed, until the script ends.
        let notifier = Self.notifier
        let notifying = Task {
            while !Task.isCancelled {
                if events.elements.contains(.subscribed(characteristic: notifier)) { try? await server.notify([0x2a], to: notifier) }
                try? await Task.sleep(for: .milliseconds(300))
            }
        }
        defer { notifying.cancel() }
        let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers/bleak_central.py").path
        let result = try await Lab.run("/usr/bin/python3", [script, controllers.peripheralText, Self.counter, Self.writable, Self.notifier])
        print("lab: bleak as the central: \(result.stdout)\(result.stderr.suffix(2000))")
        #expect(result.status == 0, "bleak_central.py exited \(result.status)")
        #expect(result.stdout.contains("read 01"), "the read handler's answer")
        #expect(try server.value(of: Self.writable) == [1, 2, 3], "bleak's write arrived")
        #expect(result.stdout.contains("notified 2a"))
        #expect(result.stdout.contains("connected after 3 s: True"), "the link held")
        #expect(seen.reads.withLock { $0.first?.central } == controllers.centralText)
        await server.close()
    }

    @Test func advertisingThatBluetoothdWouldIgnoreOrCannotCarryIsRefused() async throws {
        _ = try await GattLabTests.setUp()
        let seen = Seen()
        // Without --experimental, BlueZ 5.66 drops an interval without a word: refused here.
        let interval = await expectServerError(.unsupported) {
            let server = try await GATTServer.publish(Self.services(seen), advertising: BluetoothAdvertising(interval: .milliseconds(100) ... .milliseconds(150)),
                                                      adapter: "hci1")
            await server.close()
        }
        #expect(interval?.message.contains("--experimental") == true, "\(String(describing: interval))")
        let tooLong = await expectServerError(.misuse) {
            let server = try await GATTServer.publish(Self.services(seen), advertising: BluetoothAdvertising(manufacturerData: [0xffff: Array(repeating: 7, count: 30)]),
                                                      adapter: "hci1")
            await server.close()
        }
        #expect(tooLong?.message.contains("31") == true, "\(String(describing: tooLong))")
        // A long name goes in the scan response, cut to fit; close() withdraws the advertisement.
        let server = try await GATTServer.publish(Self.services(seen), advertising: BluetoothAdvertising(localName: String(repeating: "N", count: 40),
                                                                                                     manufacturerData: [0xffff: [1, 2]]),
                                                  adapter: "hci1")
        await server.close()
        await server.close()
    }
}

extension GattServerLabTests {
    /// Drops hci0's link to `address`, if up, and waits until bluetoothd says it is down.
    static func disconnect(_ address: String) async throws {
        let bus = try DBusConnection(.system)
        let path = "/org/bluez/hci0/dev_" + address.replacingOccurrences(of: ":", with: "_")
        let connected = { (try? await bus.call(destination: "org.bluez", path: path, interface: "org.freedesktop.DBus.Properties", member: "Get",
                                               [.string("org.bluez.Device1"), .string("Connected")]))?.first?.boolValue == true }
        if await connected() {
            _ = try? await bus.call(destination: "org.bluez", path: path, interface: "org.bluez.Device1", member: "Disconnect")
            for _ in 0..<50 where await connected() { try await Task.sleep(for: .milliseconds(100)) }
        }
        await bus.close()
    }
}

@discardableResult
private func expectServerError(_ kind: TransportError.Kind, _ body: () async throws -> Void) async -> TransportError? {
    await expectLabFailure(kind, body)
}
