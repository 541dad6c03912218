// Advertisement.swift: an LE advertisement registered with bluetoothd through
// LEAdvertisingManager1 (doc/advertising-api.txt at 5.66): the object is ours, on the bus;
// bluetoothd reads its properties and advertises until it is unregistered or we leave the bus.
// An LE peer can connect only to a device that advertises, so a ble:// listener advertises its
// service while it listens, and a GATTServer what its app asks for.
//
// Facts this follows (BlueZ 5.66, src/advertising.c):
// - MinInterval and MaxInterval are parsed only when bluetoothd runs with --experimental; without
//   it they are dropped without a word. The manager's SupportedFeatures property exists only then
//   too, so an interval is refused unless it is there.
// - Legacy advertising carries 31 bytes; data that does not fit fails as org.bluez.Error.Failed
//   ("Failed to parse advertisement." on the legacy path, "Failed to register advertisement" on
//   the extended one), said here with the estimate.

@_spi(Plugins) import TransportKitCore
import TransportKitDBus

/// What a ``GATTServer`` (or a `ble://` listener) advertises.
///
/// ```swift
/// var advertising = BluetoothAdvertising(localName: "Thermo", appearance: 0x0300)   // a generic thermometer
/// advertising.manufacturerData = [0xffff: [0x01, 0x02]]   // 0xffff: the company ID for tests
/// let server = try await GATTServer.publish([thermometer], advertising: advertising, adapter: "hci0")
/// ```
public struct BluetoothAdvertising: Sendable, Hashable {
    /// The name centrals show (sent in the scan response; bluetoothd shortens a long one); nil for none.
    public var localName: String?
    /// The service UUIDs advertised; nil for the primary services the server publishes.
    public var serviceUUIDs: [String]?
    /// Manufacturer-specific data by company identifier.
    public var manufacturerData: [UInt16: [UInt8]]
    /// Service data by service UUID.
    public var serviceData: [String: [UInt8]]
    /// The GAP appearance (0x0340: a generic heart rate sensor).
    public var appearance: UInt16?
    /// Whether centrals may connect (a "peripheral" advertisement) or only listen (a "broadcast").
    public var connectable: Bool
    /// Whether the advertisement sets the general discoverable flag (a connectable one only: a
    /// broadcast carries no flags).
    public var discoverable: Bool
    /// The advertising interval; BlueZ 5.66 honours it only when bluetoothd runs with
    /// `--experimental`, so it is refused otherwise.
    public var interval: ClosedRange<Duration>?
    /// Whether the transmit power is included.
    public var includesTxPower: Bool

    /// An advertisement with the given fields; every parameter is the property of the same name.
    /// Nothing is checked here: a ``GATTServer`` refuses data that does not fit in 31 bytes, or an
    /// interval without `--experimental`, when it registers the advertisement.
    public init(localName: String? = nil, serviceUUIDs: [String]? = nil, manufacturerData: [UInt16: [UInt8]] = [:], serviceData: [String: [UInt8]] = [:],
                appearance: UInt16? = nil, connectable: Bool = true, discoverable: Bool = true, interval: ClosedRange<Duration>? = nil,
                includesTxPower: Bool = false) {
        self.localName = localName
        self.serviceUUIDs = serviceUUIDs
        self.manufacturerData = manufacturerData
        self.serviceData = serviceData
        self.appearance = appearance
        self.connectable = connectable
        self.discoverable = discoverable
        self.interval = interval
        self.includesTxPower = includesTxPower
    }

    /// The bytes legacy advertising data would take (of 31): each field is a length, a type and
    /// the data, and bluetoothd adds the flags. The local name goes in the scan response, cut to fit.
    var estimatedLength: Int {
        let isShort = { (uuid: String) in BluetoothUUID.short(BluetoothUUID.normalize(uuid) ?? uuid).count == 4 }
        let uuids = serviceUUIDs ?? []
        let short = uuids.filter(isShort).count
        let long = uuids.count - short
        var length = 3
        if short > 0 { length += 2 + 2 * short }
        if long > 0 { length += 2 + 16 * long }
        length += manufacturerData.values.reduce(0) { $0 + 4 + $1.count }
        length += serviceData.reduce(0) { $0 + 2 + (isShort($1.key) ? 2 : 16) + $1.value.count }
        if appearance != nil { length += 4 }
        if includesTxPower { length += 3 }
        return length
    }

    /// The LEAdvertisement1 properties.
    func properties() throws -> [String: DBusValue] {
        var properties: [String: DBusValue] = [
            "Type": .string(connectable ? "peripheral" : "broadcast"),
            "ServiceUUIDs": .array(element: "s", (serviceUUIDs ?? []).map { .string($0) }),
        ]
        // A broadcast sets no flags (advertising.c: "Broadcast cannot set flags").
        if connectable { properties["Discoverable"] = .bool(discoverable) }
        if let localName { properties["LocalName"] = .string(localName) }
        if let appearance { properties["Appearance"] = .uint16(appearance) }
        if !manufacturerData.isEmpty {
            properties["ManufacturerData"] = .array(element: "{qv}", manufacturerData.sorted { $0.key < $1.key }.map {
                .dictEntry(.uint16($0.key), .variant(.bytes($0.value)))
            })
        }
        if !serviceData.isEmpty {
            properties["ServiceData"] = .array(element: "{sv}", serviceData.sorted { $0.key < $1.key }.map {
                .dictEntry(.string($0.key), .variant(.bytes($0.value)))
            })
        }
        if includesTxPower { properties["Includes"] = .array(element: "s", [.string("tx-power")]) }
        if let interval {
            let (low, high) = (UInt32(clamping: interval.lowerBound.wholeMilliseconds), UInt32(clamping: interval.upperBound.wholeMilliseconds))
            // advertising.c: 0x20 to 0xFFFFFF units of 0.625 ms.
            guard low >= 20, high <= 10_485_759 else {
                throw TransportError(.misuse, "an advertising interval runs from 20 ms to 10485.759 s; \(low) ms to \(high) ms is outside it")
            }
            properties["MinInterval"] = .uint32(low)
            properties["MaxInterval"] = .uint32(high)
        }
        return properties
    }
}

/// An advertisement registered on one adapter.
final class Advertisement: Sendable {
    static let interface = "org.bluez.LEAdvertisement1"
    static let manager = "org.bluez.LEAdvertisingManager1"

    private let bluez: BlueZ
    private let adapter: BluetoothAdapter
    private let export: DBusExport

    private init(bluez: BlueZ, adapter: BluetoothAdapter, export: DBusExport) {
        self.bluez = bluez
        self.adapter = adapter
        self.export = export
    }

    /// Advertises `service` (connectable, general discoverable) on `adapter` until ``unregister()``.
    static func register(_ bluez: BlueZ, adapter: BluetoothAdapter, service: String, describing: String) async throws -> Advertisement {
        try await register(bluez, adapter: adapter, advertising: BluetoothAdvertising(serviceUUIDs: [service]),
                           describing: "\(describing): advertising service \(BluetoothUUID.short(service)) on \(adapter.name)")
    }

    /// Advertises `advertising` on `adapter` until ``unregister()``.
    ///
    /// - Throws: `.busy` when the controller has no advertising slot left, `.unsupported` for an
    ///   interval this bluetoothd would ignore, `.misuse` for data that does not fit, and BlueZ's
    ///   other refusals explained.
    static func register(_ bluez: BlueZ, adapter: BluetoothAdapter, advertising: BluetoothAdvertising, describing: String) async throws -> Advertisement {
        let properties = try advertising.properties()
        if advertising.interval != nil,
           try await bluez.properties(at: adapter.path, manager, about: describing)?["SupportedFeatures"] == nil {
            throw TransportError(.unsupported, "\(describing): bluetoothd on \(adapter.name) ignores an advertising interval unless it runs with "
                                 + "--experimental (BlueZ 5.66); leave the interval out, or start bluetoothd with -E")
        }
        let path = BlueZ.exportPath("advertisement")
        let objects = [path: [interface: properties]]
        let export = try await bluez.bus.export(path: path) { call in
            if let served = BlueZ.serve(call, from: objects) { return served }
            return call.interface == interface && call.member == "Release" ? .reply([]) : .notHandled
        }
        do {
            _ = try await bluez.call(adapter.path, manager, "RegisterAdvertisement", [.objectPath(path), .dictionary([:])], about: describing)
        } catch {
            // Cancelled after bluetoothd took it, or refused: unregister (best effort) and leave the bus.
            _ = try? await bluez.call(adapter.path, manager, "UnregisterAdvertisement", [.objectPath(path)], about: "withdrawing an advertisement")
            await export.remove()
            guard let error = error as? TransportError else { throw error }
            // advertising.c answers NotPermitted "Maximum advertisements reached" when no slot is left.
            if error.code == "org.bluez.Error.NotPermitted" {
                throw TransportError(.busy, "\(describing): \(adapter.name) has no advertising slot left (other advertisers); stop one, "
                                     + "or listen with advertise=false while something else advertises this adapter. \(error.message)")
            }
            if error.code == "org.bluez.Error.Failed", advertising.estimatedLength > 31 {
                throw TransportError(.misuse, "\(describing): the advertisement takes about \(advertising.estimatedLength) bytes and legacy "
                                     + "advertising carries 31; shorten the name or the data, or advertise fewer UUIDs. \(error.message)")
            }
            throw error
        }
        return Advertisement(bluez: bluez, adapter: adapter, export: export)
    }

    /// Stops advertising.
    func unregister() async {
        _ = try? await bluez.call(adapter.path, Self.manager, "UnregisterAdvertisement", [.objectPath(export.path)], about: "stopping an advertisement")
        await export.remove()
    }
}
