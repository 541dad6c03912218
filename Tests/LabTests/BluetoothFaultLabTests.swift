import Foundation
import Synchronization
import Testing
import TestSupport
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// Faults in the middle of GATT operations, in the lab: the device removed while a read waits for
/// the peripheral's answer, bluetoothd restarted under a connected central and a published
/// server, the peripheral dropping the link under a central with a reconnect policy.
/// (GattCentralLabTests powers the peripheral's adapter off mid-notify.)
/// Each ends in an error or an event within seconds (never a hang), and leaves no descriptor open.
@Suite("lab: Bluetooth LE faults mid-operation", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct BluetoothFaultLabTests {
    /// Runs `body`, failing the test if it takes longer than `limit` (then it is cancelled).
    static func within<T: Sendable>(_ limit: Duration, _ what: String, _ body: @escaping @Sendable () async throws -> T) async throws -> T {
        try await withThrowingTaskGroup(of: T?.self) { group in
            group.addTask { try await body() }
            group.addTask {
                try await Task.sleep(for: limit)
                return nil
            }
            defer { group.cancelAll() }
            guard let first = try await group.next(), let value = first else {
                throw TransportError(.timedOut, "\(what) took longer than \(limit): a hang")
            }
            return value
        }
    }

    @Test func theDeviceRemovedWhileAReadWaitsEndsTheReadAtOnce() async throws {
        let (controllers, _) = try await GattLabTests.setUp()
        let service = "a0c1d000-7b2d-4a0e-9d4c-5e7a1b2c3d40", slow = "a0c1d001-7b2d-4a0e-9d4c-5e7a1b2c3d40"
        let asked = AsyncCondition(false)
        // A peripheral whose read answer never comes (within bluetoothd's 25-s call timeout).
        let server = try await GATTServer.publish([GATTServer.Service(uuid: service, characteristics: [
            GATTServer.Characteristic(uuid: slow, properties: .read, onRead: { _ in
                asked.update { $0 = true }
                try await Task.sleep(for: .seconds(20))
                return [1]
            }),
        ])], advertising: nil, adapter: "hci1")
        let before = Descriptors.targets()
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        let read = Task { try await device.read(slow) }
        try await Self.within(.seconds(10), "the peripheral being asked") { try await asked.wait { $0 ? () : nil } }
        let start = ContinuousClock.now
        try await Self.remove(controllers.peripheralText)
        let failure = try await Self.within(.seconds(10), "the read's end after RemoveDevice") { () -> TransportError? in
            do {
                _ = try await read.value
                return nil
            } catch let error as TransportError {
                return error
            }
        }
        let elapsed = ContinuousClock.now - start
        #expect(failure?.kind == .disconnected, "the read says the device went: \(String(describing: failure))")
        #expect(elapsed < .seconds(8), "ended \(elapsed) after the removal, not at bluetoothd's 25-s timeout")
        #expect(!device.isConnected)
        await device.disconnect()
        await server.close()
        #expect(await eventually(5) { Descriptors.targets() == before }, "descriptors before \(before), after \(Descriptors.targets())")
    }

    @Test func bluetoothdRestartedEndsTheCentralsLinkAndStopsTheServer() async throws {
        let (controllers, _) = try await GattLabTests.setUp()
        let server = try await GATTServer.publish([GATTServer.Service(uuid: "a0c1d100-7b2d-4a0e-9d4c-5e7a1b2c3d40", characteristics: [
            GATTServer.Characteristic(uuid: "a0c1d101-7b2d-4a0e-9d4c-5e7a1b2c3d40", properties: [.read, .notify], value: [1]),
        ])], advertising: nil, adapter: "hci1")
        let serverEvents = Gathered(server.events())
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        let events = Gathered(device.events())
        let killed = try await Lab.run("/usr/bin/pkill", ["-x", "bluetoothd"])
        #expect(killed.status == 0, "pkill bluetoothd: \(killed.stderr)")
        // bluetoothd stopping by SIGTERM removes its adapters before it leaves the bus: the
        // central hears of its link, the server of its adapter (or of bluetoothd, killed harder).
        #expect(await events.wait(10) { !$0.isEmpty }, "the central's disconnected event")
        if case .disconnected(let reason, let willReconnect)? = events.elements.first {
            #expect(!willReconnect && (reason.contains("adapter went away") || reason.contains("bluetoothd")), "\(reason)")
        } else {
            Issue.record("no disconnected event: \(events.elements)")
        }
        #expect(await serverEvents.wait(10) { $0.contains { if case .stopped = $0 { true } else { false } } }, "the server's stopped event")
        let stopped = serverEvents.elements.last
        #expect(stopped == .stopped(reason: "adapter hci1 went away") || stopped == .stopped(reason: "bluetoothd went away: publish again once it is back"),
                "\(String(describing: stopped))")
        await expectFault(.disconnected) { try await server.notify([2], to: "a0c1d101-7b2d-4a0e-9d4c-5e7a1b2c3d40") }
        await device.disconnect()
        await server.close()
        // Back: bluetoothd started again (whatever failed above: the suites after this need it),
        // and a connect works as before.
        _ = try await GattLabTests.setUp()
        let again = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0")
        #expect(try await again.read("2a19") == [LabPeripheral.batteryLevel])
        await again.disconnect()
    }

    @Test func aReconnectPolicyBringsTheLinkBackSubscribesAgainAndStopsOnDisconnect() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp()
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0",
                                                           reconnect: .init(attempts: 5, delay: .milliseconds(500)))
        let events = Gathered(device.events())
        let values = Gathered(try await device.notifications(of: "2a19"))
        try await peripheral.notifyBatteryLevel(70)
        #expect(await values.wait(10) { $0.contains([70]) }, "the first notification: \(values.elements)")

        // The peripheral drops the link; the policy brings it back.
        try await Self.dropFromPeripheral(controllers.centralText)
        #expect(await events.wait(40) { $0.contains(.connected) }, "the link came back: \(events.elements)")
        let seen = events.elements
        #expect(device.isConnected, "\(seen)")
        #expect(seen.first.map { if case .disconnected(_, true) = $0 { true } else { false } } == true,
                "the drop was said first, with a reconnect to follow: \(seen)")
        #expect(seen.contains(.connecting(attempt: 1)) && seen.last == .connected, "\(seen)")

        // The same notification sequence goes on: it was subscribed again on the new link.
        try await peripheral.notifyBatteryLevel(71)
        #expect(await values.wait(10) { $0.contains([71]) }, "a notification after the reconnect: \(values.elements)")
        #expect(try await device.read("2a19").count == 1)

        // Dropped again, and disconnect() while an attempt is under way (discovering or
        // connecting): the attempt is cancelled, and no link comes back behind the app's back.
        try await Self.dropFromPeripheral(controllers.centralText)
        #expect(await events.wait(10) { $0.filter { $0 == .connecting(attempt: 1) }.count == 2 }, "the second drop's first attempt began: \(events.elements)")
        await device.disconnect()
        await expectFault(.misuse) { _ = try await device.read("2a19") }
        try await Task.sleep(for: .seconds(4))
        #expect(!events.elements.dropFirst(seen.count).contains(.connected), "no reconnect after disconnect(): \(events.elements)")
        #expect(try await !Self.isConnected(controllers.peripheralText), "hci0 holds no link to the device")
        #expect(await values.wait(5) { _ in values.ended } && !device.isConnected, "the notifications ended with disconnect()")
    }
}

extension BluetoothFaultLabTests {
    /// Whether hci0 has a link to `address`, as bluetoothd says.
    static func isConnected(_ address: String) async throws -> Bool {
        let bus = try DBusConnection(.system)
        defer { Task { await bus.close() } }
        let reply = try? await bus.call(destination: "org.bluez", path: "/org/bluez/hci0/dev_" + address.replacingOccurrences(of: ":", with: "_"),
                                        interface: "org.freedesktop.DBus.Properties", member: "Get", [.string("org.bluez.Device1"), .string("Connected")])
        return reply?.first?.boolValue == true
    }

    /// hci1 (the peripheral's side) drops its link to the central at `address`.
    static func dropFromPeripheral(_ address: String) async throws {
        let bus = try DBusConnection(.system)
        defer { Task { await bus.close() } }
        _ = try await bus.call(destination: "org.bluez", path: "/org/bluez/hci1/dev_" + address.replacingOccurrences(of: ":", with: "_"),
                               interface: "org.bluez.Device1", member: "Disconnect")
    }

    /// hci0 forgets the device at `address` (Adapter1.RemoveDevice), through a bus connection of
    /// its own that is gone when this returns.
    static func remove(_ address: String) async throws {
        let bus = try DBusConnection(.system)
        defer { Task { await bus.close() } }
        _ = try await bus.call(destination: "org.bluez", path: "/org/bluez/hci0", interface: "org.bluez.Adapter1", member: "RemoveDevice",
                               [.objectPath("/org/bluez/hci0/dev_" + address.replacingOccurrences(of: ":", with: "_"))])
    }
}

private func expectFault(_ kind: TransportError.Kind, _ body: () async throws -> Void) async {
    _ = await expectLabFailure(kind, body)
}
