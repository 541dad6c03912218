import Foundation
import Testing
import TestSupport
import TransportKit

/// `reconnect+` around Bluetooth in the lab, through the real kernel stacks and bluetoothd: an
/// RFCOMM channel whose peer closes, then whose adapter is powered off and on; GATT serial whose
/// link the peripheral drops (the notifications subscribed again on the new link). The serial
/// adapter's replug is in USBSerialLabTests.
@Suite("lab: reconnect+ around rfcomm:// and ble://", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct ReconnectLabTests {
    static let quick = "reconnect.initialDelay=0.3&reconnect.maxDelay=1&reconnect.jitter=0"

    @Test(.timeLimit(.minutes(3)))
    func gattSerialIsSubscribedAgainAfterThePeripheralDropsTheLink() async throws {
        var (controllers, _) = try await GattLabTests.setUp()
        let url = { (address: String) in "reconnect+ble://nus/\(address)?adapter=hci0&\(Self.quick)" }
        let connection: Connection
        do {
            connection = try await Transport.connect(to: url(controllers.peripheralText))
        } catch let error as TransportError where error.code == "org.bluez.Error.NotAvailable" {
            // bluetoothd went for BR/EDR, as it last used the device (an RFCOMM test before):
            // forgotten, sighted again over LE, tried once more.
            print("lab: \(error.message) — forgetting the device and trying once more")
            try await BlueZLabTests.forgetDevices()
            (controllers, _) = try await GattLabTests.setUp()
            connection = try await Transport.connect(to: url(controllers.peripheralText))
        }
        let events = Gathered(connection.events())
        defer { events.stop() }
        try await connection.write([0x41, 0x42])
        #expect(try await connection.read(timeout: .seconds(10)) == [0x41, 0x42], "the lab peripheral echoes")

        let reading = Task { try await connection.read(timeout: .seconds(90)) }
        try await BluetoothFaultLabTests.dropFromPeripheral(controllers.centralText)
        #expect(await events.wait(60) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        #expect(events.elements.contains { if case .disconnected = $0 { true } else { false } }, "\(events.elements)")
        // An echo on the new link: written, and its notification back through the new subscription.
        try await connection.write([0x43])
        #expect(try await reading.value == [0x43], "the reader carried on with the new link's notifications")
        try await connection.close()
    }

    @Test(.timeLimit(.minutes(3)))
    func rfcommComesBackAfterThePeerClosesAndWaitsForTheAdapterToBePowered() async throws {
        // A fresh bluetoothd: in the full lab run, one that the suites before had used died when
        // hci0 was powered off (D-Bus then failed to start it: "Launch helper exited").
        _ = try await Lab.run("/usr/bin/pkill", ["-x", "bluetoothd"])
        _ = await eventually(5) { (try? FileManager.default.contentsOfDirectory(atPath: "/proc"))?.contains { entry in
            (try? String(contentsOfFile: "/proc/\(entry)/comm", encoding: .utf8)) == "bluetoothd\n"
        } == false }
        let controllers = try await BlueZListenLabTests.setUp()
        do {
            try await Self.rfcommScenario(controllers)
        } catch {
            // hci0 on again before the error goes on: the Bluetooth tests after this need it.
            _ = try? await Lab.run("/usr/bin/btmgmt", ["--index", "0", "power", "on"])
            throw error
        }
    }

    static func rfcommScenario(_ controllers: BluetoothLabTests.Controllers) async throws {
        var listener = try await Transport.listen(on: "rfcomm://\(controllers.peripheralText):16")
        let connection = try await Transport.connect(to: "reconnect+rfcomm://\(controllers.peripheralText):16?adapter=hci0&\(quick)")
        let events = Gathered(connection.events())
        defer { events.stop() }
        let first = try #require(try await BlueZListenLabTests.acceptOne(listener).value)
        try await connection.write(Array("one".utf8))
        #expect(try await first.readFrame(.fixedLength(3), timeout: .seconds(10)) == Array("one".utf8))

        // The peer closes: the reader carries on with the next connection.
        let reading = Task { try await connection.readFrame(.fixedLength(3), timeout: .seconds(60)) }
        try await first.close()
        let second = try #require(try await BlueZListenLabTests.acceptOne(listener).value, "\(events.elements)")
        try await second.write(Array("two".utf8))
        #expect(try await reading.value == Array("two".utf8))
        #expect(connection.generation == 2, "\(events.elements)")

        // The central's adapter powered off: attempts say they wait for it, and it is found again
        // once powered on. (A read waiting finds the loss.)
        let again = Task { try await connection.readFrame(.fixedLength(5), timeout: .seconds(90)) }
        let off = try await Lab.run("/usr/bin/btmgmt", ["--index", "0", "power", "off"])
        #expect(off.status == 0, "\(off.stderr)")
        let waiting = await events.wait(30) { events in
            events.contains { if case .waiting(let what, let error, _) = $0 { what == "the adapter to be powered" && error.message.contains("powered off") } else { false } }
        }
        #expect(waiting, "\(events.elements)")
        try? await second.close()
        // bluetoothd may release the listener's profile with the adapter: listen again if so.
        try? await listener.close()
        listener = try await Transport.listen(on: "rfcomm://\(controllers.peripheralText):16")
        let on = try await Lab.run("/usr/bin/btmgmt", ["--index", "0", "power", "on"])
        #expect(on.status == 0, "\(on.stderr)")
        let third = try #require(try await BlueZListenLabTests.acceptOne(listener, within: 60).value, "\(events.elements)")
        try await third.write(Array("three".utf8))
        #expect(try await again.value == Array("three".utf8))
        #expect(events.elements.contains(.connected(generation: 3)), "\(events.elements)")
        try await third.close()
        try await connection.close()
        try await listener.close()
    }

}
