import Foundation
import Glibc
import Synchronization
import Testing
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// A stand-in for bluetoothd on a private bus: it owns org.bluez and serves ObjectManager on "/"
/// with the adapters a test gives it, announcing changes as bluetoothd does. The real bluetoothd
/// is exercised in the lab (Tests/LabTests/BlueZLabTests.swift); this covers what a machine
/// without Bluetooth can check: adapter choice, listing, events and the errors.
final class StandInBlueZ: Sendable {
    let connection: DBusConnection
    private final class Table: Sendable {
        let adapters = Locked<[String: [String: DBusValue]]>([:])
    }
    private let table = Table()
    private let export = Locked<DBusExport?>(nil)

    init(address: String) async throws {
        connection = try DBusConnection(.address(address))
        let table = self.table
        let served = try await connection.export(path: "/") { call in
            guard call.interface == "org.freedesktop.DBus.ObjectManager", call.member == "GetManagedObjects" else { return .notHandled }
            let objects = table.adapters.withLock { $0 }.sorted { $0.key < $1.key }.map { path, properties in
                DBusValue.dictEntry(.objectPath(path), .array(element: "{sa{sv}}", [.dictEntry(.string("org.bluez.Adapter1"), .dictionary(properties))]))
            }
            return .reply([.array(element: "{oa{sa{sv}}}", objects)])
        }
        export.withLock { $0 = served }
        // DBUS_NAME_FLAG_DO_NOT_QUEUE: fail rather than wait in line.
        let reply = try await connection.call(destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                                              member: "RequestName", [.string("org.bluez"), .uint32(4)])
        #expect(reply.first?.integer == 1, "became the primary owner of org.bluez")
    }

    func add(_ name: String, address: String, powered: Bool) async throws {
        let properties: [String: DBusValue] = ["Address": .string(address), "Alias": .string("lab-\(name)"), "Powered": .bool(powered),
                                               "Discoverable": .bool(false), "Discovering": .bool(false)]
        table.adapters.withLock { $0["/org/bluez/\(name)"] = properties }
        try await connection.emitSignal(path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "InterfacesAdded",
                                        [.objectPath("/org/bluez/\(name)"),
                                         .array(element: "{sa{sv}}", [.dictEntry(.string("org.bluez.Adapter1"), .dictionary(properties))])])
    }

    func remove(_ name: String) async throws {
        _ = table.adapters.withLock { $0.removeValue(forKey: "/org/bluez/\(name)") }
        try await connection.emitSignal(path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "InterfacesRemoved",
                                        [.objectPath("/org/bluez/\(name)"), .array(element: "s", [.string("org.bluez.Adapter1")])])
    }

    func close() async {
        await export.withLock { $0 }?.remove()
        await connection.close()
    }
}

@Suite("Bluetooth plugin: bluetoothd's D-Bus side, without Bluetooth hardware",
       .enabled(if: FileManager.default.isExecutableFile(atPath: "/usr/bin/dbus-daemon"), "needs dbus-daemon (package dbus)"))
struct BluetoothTests {
    static let device = "rfcomm://00:AA:01:01:00:01:1"

    @Test func withoutASystemBusConnectsFailSayingSoAndTheListingIsQuietlyEmpty() async throws {
        let plugin = BluetoothPlugin(bus: .address("unix:path=/tmp/no-such-bus-\(getpid())"))
        let registry = try TransportRegistry(plugins: [plugin])
        let error = await expectTransportError(.notFound) { try await registry.connect(to: Self.device) }
        #expect(error?.message.contains("Bluetooth goes through bluetoothd on the system D-Bus") == true, "\(String(describing: error))")
        #expect(error?.message.contains("is dbus-daemon running?") == true)
        #expect(try await plugin.devices(includeAll: false).isEmpty)
        #expect(await plugin.deviceEvents(includeAll: false) == nil, "no bus, no events to offer")
    }

    @Test func withoutBluetoothdConnectsSayStartIt() async throws {
        let daemon = try await PrivateBus.start()
        let plugin = BluetoothPlugin(bus: .address(daemon.address))
        let registry = try TransportRegistry(plugins: [plugin])
        let error = await expectTransportError(.notFound) { try await registry.connect(to: Self.device) }
        #expect(error?.message.contains("bluetoothd is not running") == true, "\(String(describing: error))")
        #expect(error?.message.contains("systemctl start bluetooth") == true)
        let ble = await expectTransportError(.notFound) { try await registry.connect(to: "ble://FFF0:128/00:AA:01:01:00:01") }
        #expect(ble?.message.contains("bluetoothd is not running") == true, "\(String(describing: ble))")
        #expect(try await plugin.devices(includeAll: false).isEmpty)
    }

    @Test func adaptersAreListedChosenAndTheirComingsAndGoingsReported() async throws {
        let daemon = try await PrivateBus.start()
        let bluez = try await StandInBlueZ(address: daemon.address)
        let plugin = BluetoothPlugin(bus: .address(daemon.address))
        let registry = try TransportRegistry(plugins: [plugin])

        let none = await expectTransportError(.notFound) { try await registry.connect(to: Self.device) }
        #expect(none?.message.contains("no Bluetooth adapter") == true, "\(String(describing: none))")

        let events = try #require(await plugin.deviceEvents(includeAll: false))
        var iterator = events.makeAsyncIterator()
        // Subscribed when deviceEvents returned: adapters added right after are reported.
        try await bluez.add("hci0", address: "00:AA:01:00:00:00", powered: false)
        try await bluez.add("hci1", address: "00:AA:01:01:00:01", powered: true)
        let first = try await iterator.next()
        #expect(first?.action == .added)
        #expect(first?.device.name == "hci0")
        #expect(first?.device.properties["address"] == "00:AA:01:00:00:00")
        #expect(first?.device.url == "adapter=hci0")
        let second = try await iterator.next()
        #expect(second?.device.name == "hci1")

        let listed = try await plugin.devices(includeAll: false)
        #expect(listed.map(\.name) == ["hci0", "hci1"])
        #expect(listed.first?.product?.contains("powered off") == true)
        #expect(listed.last?.properties["powered"] == "true")

        let off = await expectTransportError(.unsupported) { try await registry.connect(to: Self.device + "?adapter=hci0") }
        #expect(off?.message.contains("hci0 (00:AA:01:00:00:00) is powered off") == true, "\(String(describing: off))")
        #expect(off?.message.contains("btmgmt --index 0 power on") == true)
        let missing = await expectTransportError(.notFound) { try await registry.connect(to: Self.device + "?adapter=hci7") }
        #expect(missing?.message.contains("no Bluetooth adapter hci7; adapters: hci0 (00:AA:01:00:00:00, powered off), hci1 (00:AA:01:01:00:01)") == true,
                "\(String(describing: missing))")

        // The default is the first powered adapter (hci1). This machine's kernel may have no
        // Bluetooth sockets at all: then the error says that, naming the call.
        if socket(AF_BLUETOOTH, Int32(SOCK_STREAM.rawValue), 3) < 0 {
            let noKernel = await expectTransportError(.unsupported) { try await registry.connect(to: Self.device) }
            #expect(noKernel?.message.contains("this kernel has no Bluetooth support") == true, "\(String(describing: noKernel))")
            #expect(noKernel?.syscall == "socket(AF_BLUETOOTH)")
        }

        try await bluez.remove("hci0")
        let removed = try await iterator.next()
        #expect(removed?.action == .removed)
        #expect(removed?.device.name == "hci0")
        #expect(removed?.device.properties["address"] == "00:AA:01:00:00:00", "a removal names what went away")
        await bluez.close()
    }

    @Test func eaIsRefusedWithTheLinuxWaysToReachSuchAccessories() async throws {
        let error = await expectTransportError(.unsupported) { try await Transport.connect(to: "ea://com.example.protocol") }
        #expect(error?.message.contains("rfcomm://") == true && error?.message.contains("usb://") == true, "\(String(describing: error))")
    }

    @Test func urlsAreCheckedBeforeBluetoothIsAsked() async throws {
        let daemonless = try TransportRegistry(plugins: [BluetoothPlugin(bus: .address("unix:path=/tmp/no-such-bus-\(getpid())"))])
        // Without a channel the URL asks SDP, through the adapter: that needs the bus, and says so.
        let sdp = await expectTransportError(.notFound) { try await daemonless.connect(to: "rfcomm://00:AA:01:01:00:01") }
        #expect(sdp?.message.contains("Bluetooth goes through bluetoothd") == true, "\(String(describing: sdp))")
        let uuid = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "rfcomm://00:AA:01:01:00:01?uuid=serial") }
        #expect(uuid?.message.contains("uuid=serial is not a service UUID") == true, "\(String(describing: uuid))")
        // Without a device the URL scans: that needs the bus, and says so.
        let scan = await expectTransportError(.notFound) { try await daemonless.connect(to: "ble://FFF0:128") }
        #expect(scan?.message.contains("Bluetooth goes through bluetoothd") == true, "\(String(describing: scan))")
        let scanName = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "ble://not-a-uuid:128") }
        #expect(scanName?.message.contains("'not-a-uuid' is neither a service UUID") == true, "\(String(describing: scanName))")
        // A short name scans for its service as it does for GATT serial: that needs the bus.
        let named = await expectTransportError(.notFound) { try await daemonless.connect(to: "ble://nus:128") }
        #expect(named?.message.contains("Bluetooth goes through bluetoothd") == true, "\(String(describing: named))")
        let bad = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "ble://FFF0:128/00:AA:01:01:00") }
        #expect(bad?.message.contains("is not a Bluetooth address") == true, "\(String(describing: bad))")
    }

    @Test func listenURLsAreCheckedBeforeBluetoothIsAsked() async throws {
        let daemonless = try TransportRegistry(plugins: [BluetoothPlugin(bus: .address("unix:path=/tmp/no-such-bus-\(getpid())"))])
        let host = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "rfcomm://everywhere:3") }
        #expect(host?.message.contains("give `any` (every adapter) or an adapter's address") == true, "\(String(describing: host))")
        let uuid = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "rfcomm://any?uuid=12") }
        #expect(uuid?.message.contains("uuid=12 is not a service UUID") == true, "\(String(describing: uuid))")
        let device = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "ble://FFF0:128/00:AA:01:01:00:01") }
        #expect(device?.message.contains("a listener takes no device") == true, "\(String(describing: device))")
        // A GATT serial peripheral: a service without known characteristics needs them named, and
        // it takes no device; both refused before bluetoothd is asked.
        let unnamed = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "ble://FFF0") }
        #expect(unnamed?.message.contains("needs its characteristics named: rx=UUID") == true, "\(String(describing: unnamed))")
        let peripheralDevice = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "ble://nus/00:AA:01:01:00:01") }
        #expect(peripheralDevice?.message.contains("a listener takes no device") == true, "\(String(describing: peripheralDevice))")
        let gatt = await expectTransportError(.notFound) { try await daemonless.listen(on: "ble://nus") }
        #expect(gatt?.message.contains("is dbus-daemon running?") == true, "valid, so bluetoothd is asked: \(String(describing: gatt))")
        let service = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "ble://uart:128") }
        #expect(service?.message.contains("'uart' is neither a service UUID") == true && service?.message.contains("hm10, nus") == true,
                "the names a connect takes: \(String(describing: service))")
        let psm = await expectTransportError(.invalidURL) { try await daemonless.listen(on: "ble://FFF0:300") }
        #expect(psm?.message.contains("300") == true, "\(String(describing: psm))")
        // Well-formed listeners get as far as the bus.
        for url in ["rfcomm://any", "rfcomm://00:AA:01:01:00:01:5?uuid=1101&name=Console", "ble://FFF0:128?adapter=hci1&advertise=false"] {
            let error = await expectTransportError(.notFound) { try await daemonless.listen(on: url) }
            #expect(error?.message.contains("Bluetooth goes through bluetoothd") == true, "\(url): \(String(describing: error))")
        }
    }

    @Test func gattSerialURLsAreCheckedBeforeBluetoothIsAsked() async throws {
        let daemonless = try TransportRegistry(plugins: [BluetoothPlugin(bus: .address("unix:path=/tmp/no-such-bus-\(getpid())"))])
        let service = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "ble://uart-ish/00:AA:01:01:00:01") }
        #expect(service?.message.contains("'uart-ish' is neither a service UUID") == true, "\(String(describing: service))")
        #expect(service?.message.contains("hm10, nus") == true, "the known short names are listed")
        let rx = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "ble://nus/00:AA:01:01:00:01?rx=6e40-zz") }
        #expect(rx?.message.contains("rx='6e40-zz' is not a characteristic UUID") == true, "\(String(describing: rx))")
        let short = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "ble://FFE0/00:AA:01:01:00:01?tx=12345") }
        #expect(short?.message.contains("tx='12345'") == true, "\(String(describing: short))")
        let mode = await expectTransportError(.invalidURL) { try await daemonless.connect(to: "ble://nus/00:AA:01:01:00:01?acquire=sometimes") }
        #expect(mode?.message.contains("acquire") == true, "\(String(describing: mode))")
        // Well-formed forms (a short name, 16-bit, 128-bit with and without dashes) get as far as the bus.
        for url in ["ble://nus/00:AA:01:01:00:01", "ble://FFE0/00:AA:01:01:00:01?rx=FFE1&tx=FFE1",
                    "ble://6E400001-B5A3-F393-E0A9-E50E24DCCA9E/00:AA:01:01:00:01", "ble://6e400001b5a3f393e0a9e50e24dcca9e/00:AA:01:01:00:01"] {
            let error = await expectTransportError(.notFound) { try await daemonless.connect(to: url) }
            #expect(error?.message.contains("Bluetooth goes through bluetoothd") == true, "\(url): \(String(describing: error))")
        }
    }
}
