// Advertisement.swift: an LE advertisement registered with bluetoothd through
// LEAdvertisingManager1 (doc/advertising-api.txt at 5.66): the object is ours, on the bus;
// bluetoothd reads its properties and advertises until it is unregistered or we leave the bus.
// An LE peer can connect only to a device that advertises, so a ble:// listener advertises its
// service while it listens.

import TransportKitCore
import TransportKitDBus

/// A connectable advertisement of one service UUID on one adapter.
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
    ///
    /// - Throws: BlueZ's refusal explained (`.busy` when the controller has no advertising slot left).
    static func register(_ bluez: BlueZ, adapter: BluetoothAdapter, service: String, describing: String) async throws -> Advertisement {
        let path = BlueZ.exportPath("advertisement")
        let properties: [String: DBusValue] = [
            "Type": .string("peripheral"),
            "ServiceUUIDs": .array(element: "s", [.string(service)]),
            "Discoverable": .bool(true),
        ]
        let export = try await bluez.bus.export(path: path) { call in
            switch (call.interface, call.member) {
            case ("org.freedesktop.DBus.Properties", "GetAll"):
                return .reply([.dictionary(call.arguments.first?.text == interface ? properties : [:])])
            case ("org.freedesktop.DBus.Properties", "Get"):
                guard let name = call.arguments.dropFirst().first?.text, let value = properties[name] else {
                    return .error(name: "org.freedesktop.DBus.Error.InvalidArgs", message: "no such property")
                }
                return .reply([.variant(value)])
            case (interface, "Release"):
                return .reply([])
            default:
                return .notHandled
            }
        }
        do {
            _ = try await bluez.call(adapter.path, manager, "RegisterAdvertisement", [.objectPath(path), .dictionary([:])],
                                     about: "\(describing): advertising service \(BluetoothUUID.short(service)) on \(adapter.name)")
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
