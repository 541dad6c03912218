import Foundation
import Synchronization
import Testing
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// The tests' own BLE peripheral on hci1, served by the lab's bluetoothd: a GATT application with
/// a Nordic-UART-like service (the central writes 6e400002, the peripheral notifies on 6e400003)
/// that echoes every write back as a notification, a Battery service (2a19: read and notify, with
/// a User Description descriptor), a service of its own with a characteristic that keeps what is
/// written to it and one that needs encryption to be read, and a connectable advertisement naming it.
/// BlueZ's GattManager1.RegisterApplication and LEAdvertisingManager1.RegisterAdvertisement
/// (doc/gatt-api.txt, doc/advertising-api.txt at 5.66) on a D-Bus connection of its own.
final class LabPeripheral: Sendable {
    static let root = "/org/transportkit/lab"
    static let servicePath = root + "/service0"
    static let writePath = servicePath + "/char0"
    static let notifyPath = servicePath + "/char1"
    static let advertisementPath = root + "/advertisement0"
    static let service = "6e400001-b5a3-f393-e0a9-e50e24dcca9e"
    static let name = "TKLab"
    /// Under the test company id 0xFFFF.
    static let manufacturerData: [UInt8] = [0x54, 0x4b]
    static let characteristic = "org.bluez.GattCharacteristic1"
    static let batteryServicePath = root + "/service1"
    static let batteryLevelPath = batteryServicePath + "/char0"
    static let batteryDescriptionPath = batteryLevelPath + "/desc0"
    static let customServicePath = root + "/service2"
    static let storedPath = customServicePath + "/char0"
    static let encryptedPath = customServicePath + "/char1"
    static let customService = "a0c1f000-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let stored = "a0c1f001-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let encrypted = "a0c1f002-7b2d-4a0e-9d4c-5e7a1b2c3d40"
    static let batteryLevel: UInt8 = 87

    let connection: DBusConnection
    /// Scan events a test collects.
    final class Events: Sendable {
        let list = Locked<[BluetoothScan.Event]>([])
    }
    /// What the central wrote: every byte in order, and the size of each write.
    final class Log: Sendable {
        let bytes = Locked<[UInt8]>([])
        let writes = Locked<[Int]>([])
    }
    let log = Log()
    /// What the central last wrote to the storing characteristic.
    final class Stored: Sendable {
        let value = Locked<[UInt8]>([0x00])
    }
    let stored = Stored()
    private let exports = Locked<[DBusExport]>([])
    private let outbound: AsyncStream<[UInt8]>.Continuation
    private let sender: Task<Void, Never>
    let echo: Bool

    /// Registers the application and the advertisement on `adapter`; `echo` sends every write back.
    init(adapter: String = "hci1", echo: Bool = true) async throws {
        connection = try DBusConnection(.system)
        self.echo = echo
        let (stream, outbound) = AsyncStream<[UInt8]>.makeStream()
        self.outbound = outbound
        let connection = self.connection
        // One task emits the notifications, in the order the values were queued.
        sender = Task {
            for await value in stream {
                try? await connection.emitSignal(path: Self.notifyPath, interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
                                                  [.string(Self.characteristic), .dictionary(["Value": .bytes(value)]), .array(element: "s", [])])
            }
        }
        let log = self.log
        let stored = self.stored
        let objects = Self.objects()
        let application = try await connection.export(path: Self.root, subtree: true) { call in
            switch (call.interface, call.member) {
            case ("org.freedesktop.DBus.ObjectManager", "GetManagedObjects"):
                let entries = objects.sorted { $0.key < $1.key }.map { path, interfaces in
                    DBusValue.dictEntry(.objectPath(path), .array(element: "{sa{sv}}", interfaces.map { .dictEntry(.string($0.key), .dictionary($0.value)) }))
                }
                return .reply([.array(element: "{oa{sa{sv}}}", entries)])
            case ("org.freedesktop.DBus.Properties", "GetAll"):
                guard let interface = call.arguments.first?.text, let properties = objects[call.path]?[interface] else { return .reply([.dictionary([:])]) }
                return .reply([.dictionary(properties)])
            case ("org.freedesktop.DBus.Properties", "Get"):
                guard let interface = call.arguments.first?.text, let name = call.arguments.dropFirst().first?.text,
                      let value = objects[call.path]?[interface]?[name] else {
                    return .error(name: "org.freedesktop.DBus.Error.InvalidArgs", message: "no such property")
                }
                return .reply([.variant(value)])
            case (Self.characteristic, "WriteValue") where call.path == Self.storedPath:
                stored.value.withLock { $0 = call.arguments.first?.bytes ?? [] }
                return .reply([])
            case (Self.characteristic, "WriteValue"):
                let value = call.arguments.first?.bytes ?? []
                log.bytes.withLock { $0 += value }
                log.writes.withLock { $0.append(value.count) }
                if echo { outbound.yield(value) }
                return .reply([])
            case (Self.characteristic, "ReadValue"):
                switch call.path {
                case Self.batteryLevelPath: return .reply([.bytes([Self.batteryLevel])])
                case Self.storedPath: return .reply([.bytes(stored.value.withLock { $0 })])
                case Self.encryptedPath: return .reply([.bytes([0x5e])])
                default: return .reply([.bytes([])])
                }
            case ("org.bluez.GattDescriptor1", "ReadValue"):
                return .reply([.bytes(Array("Battery level".utf8))])
            case (Self.characteristic, "StartNotify"), (Self.characteristic, "StopNotify"), ("org.bluez.LEAdvertisement1", "Release"):
                return .reply([])
            default:
                return .notHandled
            }
        }
        exports.withLock { $0.append(application) }
        let adapterPath = "/org/bluez/\(adapter)"
        // The adapter's name is the device name the central reads from GAP once connected.
        _ = try await connection.call(destination: "org.bluez", path: adapterPath, interface: "org.freedesktop.DBus.Properties", member: "Set",
                                      [.string("org.bluez.Adapter1"), .string("Alias"), .variant(.string(Self.name))])
        _ = try await connection.call(destination: "org.bluez", path: adapterPath, interface: "org.bluez.GattManager1", member: "RegisterApplication",
                                      [.objectPath(Self.root), .dictionary([:])])
        try await startAdvertising(adapter: adapter)
    }

    /// The objects of the application (GetManagedObjects) and the advertisement (GetAll).
    static func objects() -> [String: [String: [String: DBusValue]]] {
        [
            servicePath: ["org.bluez.GattService1": ["UUID": .string(service), "Primary": .bool(true)]],
            writePath: [characteristic: ["UUID": .string("6e400002-b5a3-f393-e0a9-e50e24dcca9e"), "Service": .objectPath(servicePath),
                                         "Flags": .array(element: "s", [.string("write-without-response"), .string("write")])]],
            notifyPath: [characteristic: ["UUID": .string("6e400003-b5a3-f393-e0a9-e50e24dcca9e"), "Service": .objectPath(servicePath),
                                          "Flags": .array(element: "s", [.string("notify")])]],
            batteryServicePath: ["org.bluez.GattService1": ["UUID": .string("0000180f-0000-1000-8000-00805f9b34fb"), "Primary": .bool(true)]],
            batteryLevelPath: [characteristic: ["UUID": .string("00002a19-0000-1000-8000-00805f9b34fb"), "Service": .objectPath(batteryServicePath),
                                                "Flags": .array(element: "s", [.string("read"), .string("notify")])]],
            batteryDescriptionPath: ["org.bluez.GattDescriptor1": ["UUID": .string("00002901-0000-1000-8000-00805f9b34fb"),
                                                                   "Characteristic": .objectPath(batteryLevelPath),
                                                                   "Flags": .array(element: "s", [.string("read")])]],
            customServicePath: ["org.bluez.GattService1": ["UUID": .string(customService), "Primary": .bool(true)]],
            storedPath: [characteristic: ["UUID": .string(stored), "Service": .objectPath(customServicePath),
                                          "Flags": .array(element: "s", [.string("read"), .string("write"), .string("write-without-response")])]],
            encryptedPath: [characteristic: ["UUID": .string(encrypted), "Service": .objectPath(customServicePath),
                                             "Flags": .array(element: "s", [.string("encrypt-read")])]],
            advertisementPath: ["org.bluez.LEAdvertisement1": ["Type": .string("peripheral"), "ServiceUUIDs": .array(element: "s", [.string(service)]),
                                                                "LocalName": .string(name), "Discoverable": .bool(true),
                                                                // Changes bluetoothd reports on every advertisement (DuplicateData), so a
                                                                // scan sees each re-announcement (announceWhileDiscovering) as a sighting.
                                                                "ManufacturerData": .array(element: "{qv}", [.dictEntry(.uint16(0xffff), .variant(.bytes(Self.manufacturerData)))])]],
        ]
    }

    /// Sends `bytes` to the central as notifications of up to `piece` bytes.
    func notify(_ bytes: [UInt8], piece: Int) {
        var offset = 0
        while offset < bytes.count {
            let end = min(offset + piece, bytes.count)
            outbound.yield(Array(bytes[offset..<end]))
            offset = end
        }
    }

    /// Notifies `level` on the Battery Level characteristic (to a central that started notifications).
    func notifyBatteryLevel(_ level: UInt8) async throws {
        try await connection.emitSignal(path: Self.batteryLevelPath, interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
                                        [.string(Self.characteristic), .dictionary(["Value": .bytes([level])]), .array(element: "s", [])])
    }

    /// Stops advertising (the device then expires from scans), keeping the GATT application.
    func stopAdvertising(adapter: String = "hci1") async throws {
        _ = try await connection.call(destination: "org.bluez", path: "/org/bluez/\(adapter)", interface: "org.bluez.LEAdvertisingManager1",
                                      member: "UnregisterAdvertisement", [.objectPath(Self.advertisementPath)])
    }

    /// Registers the advertisement (at init, and again after ``stopAdvertising(adapter:)``).
    func startAdvertising(adapter: String = "hci1") async throws {
        _ = try await connection.call(destination: "org.bluez", path: "/org/bluez/\(adapter)", interface: "org.bluez.LEAdvertisingManager1",
                                      member: "RegisterAdvertisement", [.objectPath(Self.advertisementPath), .dictionary([:])])
    }

    /// Plays a real advertiser's repetition for scans from `central`, for as long as the task runs.
    ///
    /// btvirt (BlueZ 5.66's emulator/btdev.c) sends an advertising report only when the scanner
    /// enables scanning or the advertiser enables advertising, never per advertising interval.
    /// The report sent at scan enable comes within a millisecond, and the kernel drops a report
    /// that arrives before mgmt's Start Discovery has completed (the discovery is not "finding"
    /// yet; seen with btmon: the report on hci0, no Device1 in bluetoothd). A real controller
    /// reports again at the next interval; btvirt never does, so about one scan in three saw
    /// nothing. Here, 300 ms after `central` starts discovering, and then every `interval` while it
    /// discovers, the advertisement is registered again, and btvirt reports it then.
    func announceWhileDiscovering(central: String = "hci0", every interval: Duration = .seconds(1)) -> Task<Void, Never> {
        Task {
            var announced: ContinuousClock.Instant?
            while !Task.isCancelled {
                let reply = try? await connection.call(destination: "org.bluez", path: "/org/bluez/\(central)", interface: "org.freedesktop.DBus.Properties",
                                                       member: "Get", [.string("org.bluez.Adapter1"), .string("Discovering")])
                if reply?.first?.boolValue == true {
                    if announced == nil { try? await Task.sleep(for: .milliseconds(300)) }
                    if announced.map({ ContinuousClock.now - $0 >= interval }) ?? true {
                        try? await stopAdvertising()
                        try? await startAdvertising()
                        announced = .now
                    }
                } else {
                    announced = nil
                }
                try? await Task.sleep(for: .milliseconds(100))
            }
        }
    }

    /// Unregisters everything (closing the connection does too: bluetoothd watches the owner).
    func close() async {
        outbound.finish()
        await sender.value
        for export in exports.withLock({ $0 }) { await export.remove() }
        await connection.close()
    }
}
