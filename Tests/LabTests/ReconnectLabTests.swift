import Foundation
import Testing
import TestSupport
import TransportKit

/// `reconnect+` around Bluetooth in the lab, through the real kernel stacks and bluetoothd: an
/// RFCOMM channel whose peer closes; GATT serial whose link the peripheral drops (the
/// notifications subscribed again on the new link). The serial adapter's replug is in
/// USBSerialLabTests, usb://'s in USBLabTests.
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

    /// (Powering the central's adapter off under the connection was tried here too: alone it
    /// passed, the attempts saying they wait for "the adapter to be powered"; in the full lab
    /// run, bluetoothd died at the power-off, and a fresh one then left the first RFCOMM connect
    /// unaccepted. The wording is checked in ReconnectTests.)
    @Test(.timeLimit(.minutes(3)))
    func rfcommComesBackAfterThePeerCloses() async throws {
        // Once in CI the client connected and the listener was handed nothing for 20 s (see
        // BlueZLabTests.forgetDevices): then what the client saw and bluetoothd's devices are
        // printed, and everything is set up once more.
        var listener: Listener
        var connection: Connection
        var events: Gathered<ConnectionEvent>
        var accepted: Connection?
        var attempt = 1
        while true {
            let controllers = try await BlueZListenLabTests.setUp()
            listener = try await Transport.listen(on: "rfcomm://\(controllers.peripheralText):16")
            connection = try await Transport.connect(to: "reconnect+rfcomm://\(controllers.peripheralText):16?adapter=hci0&\(Self.quick)")
            events = Gathered(connection.events())
            accepted = try await BlueZListenLabTests.acceptOne(listener).value
            guard accepted == nil, attempt == 1 else { break }
            let devices = try await BlueZLabTests.removeDeviceObjects()
            print("lab: nothing accepted for 20 s; the client's events: \(events.elements); bluetoothd's devices: \(devices) — once more")
            events.stop()
            try await connection.close()
            try await listener.close()
            attempt += 1
        }
        defer { events.stop() }
        let first = try #require(accepted, "\(events.elements)")
        try await connection.write(Array("one".utf8))
        #expect(try await first.readFrame(.fixedLength(3), timeout: .seconds(10)) == Array("one".utf8))

        // The peer closes: the reader carries on with the next connection.
        let reading = Task { try await connection.readFrame(.fixedLength(3), timeout: .seconds(60)) }
        try await first.close()
        let second = try #require(try await BlueZListenLabTests.acceptOne(listener).value, "\(events.elements)")
        try await second.write(Array("two".utf8))
        #expect(try await reading.value == Array("two".utf8))
        #expect(connection.generation == 2, "\(events.elements)")
        try await connection.write(Array("back".utf8))
        #expect(try await second.readFrame(.fixedLength(4), timeout: .seconds(10)) == Array("back".utf8), "writes go to the new connection")
        try await connection.close()
        try? await second.close()
        try await listener.close()
    }
}
