// GattApplication.swift: GATT services an app publishes, through bluetoothd's GATT server (BlueZ
// doc/gatt-api.txt, "GATT Manager hierarchy", at 5.66): this process exports an ObjectManager
// with GattService1, GattCharacteristic1 and GattDescriptor1 objects, registers it with
// GattManager1.RegisterApplication, and bluetoothd serves ATT to centrals, calling back here.
//
// Facts this follows (BlueZ 5.66, src/gatt-database.c):
// - ReadValue's options carry "offset", "mtu", "device" (the central's object path) and "link";
//   bluetoothd sends what the reply holds as it is, so the value is cut at the offset here.
// - WriteValue's options carry "offset", "mtu" and "device", not whether the central asked for a
//   response ("type" is the client side's option). For a characteristic that takes writes without
//   response, bluetoothd sends every write as a call expecting no reply and answers the central
//   itself at once: a refusal cannot reach it (chrc_write_cb queues replies only for the others).
//   A long write reaches the application whole, at offset 0: bluetoothd's gatt-server joins the
//   contiguous parts of a prepared write (store_prep_data) before it executes them.
// - encrypt-write, encrypt-authenticated-write and secure-write each add the Write property
//   (parse_chrc_flags): there is no way to secure writes without response alone.
// - An error reply becomes an ATT error: Failed with a message "0x80"–"0x9f" is that
//   application error, NotSupported, NotAuthorized, InvalidValueLength, InvalidOffset, InProgress
//   and NotPermitted their ATT codes, any other name 0x0e (unlikely error).
// - Notifications and indications are sent by emitting PropertiesChanged on the characteristic's
//   Value; bluetoothd sends each to every central subscribed (the API of 5.66 cannot address one
//   central). An indication's confirmation arrives as Confirm().
// - bluetoothd adds the Client Characteristic Configuration (2902) and Extended Properties (2900)
//   descriptors itself; an application that brings its own is refused here.
// - bluetoothd waits for a reply as long as the D-Bus default (25 s); ATT's own limit is 30 s.
//
// Calls are answered one at a time, in the order they came (the export's in-order queue), as ATT
// serves one request at a time per link and writes without response must not be reordered.

import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus

/// GATT services this process publishes as a Bluetooth LE peripheral, through bluetoothd: centrals
/// read and write its characteristics (your handlers answer), subscribe to notifications and
/// indications, and find it by its advertisement.
///
/// ```swift
/// let level = GATTServer.Characteristic(uuid: "2a19", properties: [.read, .notify], value: [87])
/// let server = try await GATTServer.publish([GATTServer.Service(uuid: "180f", characteristics: [level])],
///                                           advertising: BluetoothAdvertising(localName: "Sensor"), adapter: "hci0")
/// try await server.notify([86], to: "2a19")     // to every central subscribed
/// for await event in server.events() { print(event) }
/// ```
public final class GATTServer: Sendable {
    /// A primary (or included) service and its characteristics.
    public struct Service: Sendable {
        /// The service's UUID in any form BlueZ takes (`180f`, `0000180f`, 128-bit).
        public var uuid: String
        /// Whether it is a primary service (the default, and what is advertised) or a secondary one.
        public var primary: Bool
        /// Its characteristics; a service may have none.
        public var characteristics: [Characteristic]

        /// A service with the given UUID and characteristics; primary unless `primary` is false.
        public init(uuid: String, primary: Bool = true, characteristics: [Characteristic]) {
            self.uuid = uuid
            self.primary = primary
            self.characteristics = characteristics
        }
    }

    /// What centrals may do with a characteristic.
    public struct Properties: OptionSet, Sendable, Hashable {
        /// The bits: 1 read, 2 write, 4 write without response, 8 notify, 16 indicate.
        public let rawValue: Int
        /// The properties whose bits are set in `rawValue`.
        public init(rawValue: Int) { self.rawValue = rawValue }
        /// Centrals may read the value (answered by `onRead`, or with the stored value).
        public static let read = Properties(rawValue: 1)
        /// Centrals may write the value with a response (Write Request).
        public static let write = Properties(rawValue: 2)
        /// Centrals may write the value without a response (Write Command); a refusal never reaches them.
        public static let writeWithoutResponse = Properties(rawValue: 4)
        /// Centrals may subscribe to notifications (``GATTServer/notify(_:to:service:)``).
        public static let notify = Properties(rawValue: 8)
        /// Centrals may subscribe to indications, which they confirm (``GATTServer/Event/indicationConfirmed(characteristic:)``).
        public static let indicate = Properties(rawValue: 16)
    }

    /// The link a central needs before bluetoothd lets it at an attribute; pairing happens on the
    /// central's side when it asks (bluetoothd answers an unpaired central with ATT's
    /// insufficient-encryption or -authentication error, and the central pairs and retries).
    public enum Security: String, Sendable, Hashable, CaseIterable {
        /// Any link.
        case none
        /// An encrypted link (paired, "just works" is enough).
        case encrypted
        /// An encrypted link whose keys were authenticated (passkey or numeric comparison).
        case authenticated
        /// LE Secure Connections, authenticated.
        case secure

        /// What BlueZ's flags for this level begin with (`encrypt-read`); nil for none.
        var flagPrefix: String? {
            switch self {
            case .none: nil
            case .encrypted: "encrypt-"
            case .authenticated: "encrypt-authenticated-"
            case .secure: "secure-"
            }
        }
    }

    /// A characteristic: its properties and security, its value, and the handlers that answer
    /// centrals. Without `onRead`, reads get the value last set (``GATTServer/notify(_:to:service:)``,
    /// ``GATTServer/setValue(_:of:service:)`` or a write); without `onWrite`, writes set it.
    public struct Characteristic: Sendable {
        /// The characteristic's UUID in any form BlueZ takes (`2a19`, 128-bit).
        public var uuid: String
        /// What centrals may do with it; at least one.
        public var properties: Properties
        /// The link its value needs, for reads, writes and subscriptions alike (`.none` by default).
        public var security: Security
        /// Descriptors besides 2902 and 2900, which bluetoothd adds itself (giving one is refused).
        public var descriptors: [Descriptor]
        /// The value before anything sets it (at most 512 bytes).
        public var value: [UInt8]
        /// Answers a read with the whole value; it is cut at the request's offset here. Throw a
        /// ``Failure`` to send the central an ATT error.
        public var onRead: (@Sendable (ReadRequest) async throws -> [UInt8])?
        /// Takes a write (a long write arrives whole; a write at an offset goes into the stored
        /// value there). Throw a ``Failure`` to refuse it; otherwise the value is stored as well. For a characteristic with
        /// ``Properties/writeWithoutResponse``, BlueZ 5.66 acknowledges every write to the
        /// central before this runs: a refusal keeps the value unstored but the central never
        /// hears of it. Publish the two kinds of write on separate characteristics when refusals matter.
        public var onWrite: (@Sendable (WriteRequest) async throws -> Void)?

        /// A characteristic; each parameter is the property of the same name. It is checked when
        /// published (``GATTServer/publish(_:advertising:adapter:bus:)``), not here.
        public init(uuid: String, properties: Properties, security: Security = .none, descriptors: [Descriptor] = [], value: [UInt8] = [],
                    onRead: (@Sendable (ReadRequest) async throws -> [UInt8])? = nil, onWrite: (@Sendable (WriteRequest) async throws -> Void)? = nil) {
            self.uuid = uuid
            self.properties = properties
            self.security = security
            self.descriptors = descriptors
            self.value = value
            self.onRead = onRead
            self.onWrite = onWrite
        }
    }

    /// A descriptor with a value centrals read (and, when `writable`, write): a User Description
    /// (2901), a Presentation Format (2904), one of the app's own.
    public struct Descriptor: Sendable, Hashable {
        /// The descriptor's UUID (`2901`, 128-bit); not 2902 or 2900.
        public var uuid: String
        /// The value centrals read; a write by a central replaces it.
        public var value: [UInt8]
        /// Whether centrals may write it; a write to one that is not gets Write Not Permitted.
        public var writable: Bool
        /// The link reading (and writing) it needs.
        public var security: Security

        /// A descriptor; readable always, writable only when `writable`.
        public init(uuid: String, value: [UInt8], writable: Bool = false, security: Security = .none) {
            self.uuid = uuid
            self.value = value
            self.writable = writable
            self.security = security
        }

        /// A Characteristic User Description (2901) saying `text`.
        public static func userDescription(_ text: String) -> Descriptor { Descriptor(uuid: "2901", value: Array(text.utf8)) }
    }

    /// A central's read, as bluetoothd passed it on.
    public struct ReadRequest: Sendable, Hashable {
        /// The characteristic's UUID in BlueZ's form (`00002a19-0000-1000-8000-00805f9b34fb`).
        public var characteristic: String
        /// Where in the value the central reads from (a long read's later parts).
        public var offset: Int
        /// The link's ATT MTU, when bluetoothd said (a value's longest read is 3 bytes less).
        public var attMTU: Int?
        /// The central's address, when bluetoothd said.
        public var central: String?

        /// The former name of ``attMTU``.
        @available(*, deprecated, renamed: "attMTU")
        public var mtu: Int? { attMTU }
    }

    /// A central's write, as bluetoothd passed it on.
    public struct WriteRequest: Sendable, Hashable {
        /// The characteristic's UUID in BlueZ's form (`00002a19-0000-1000-8000-00805f9b34fb`).
        public var characteristic: String
        /// The bytes written.
        public var value: [UInt8]
        /// Where in the characteristic's value they go.
        public var offset: Int
        /// The link's ATT MTU, when bluetoothd said.
        public var attMTU: Int?
        /// The central's address, when bluetoothd said.
        public var central: String?

        /// The former name of ``attMTU``.
        @available(*, deprecated, renamed: "attMTU")
        public var mtu: Int? { attMTU }
    }

    /// What a handler throws to send the central an ATT error.
    public enum Failure: Error, Sendable, Hashable {
        /// Read Not Permitted or Write Not Permitted (0x02, 0x03).
        case notPermitted
        /// Insufficient Authorization (0x08).
        case notAuthorized
        /// Invalid Offset (0x07).
        case invalidOffset
        /// Invalid Attribute Value Length (0x0d).
        case invalidValueLength
        /// Request Not Supported (0x06).
        case notSupported
        /// An application error, 0x80 to 0x9f; another code is sent as ATT's 0x0e (unlikely error).
        case application(UInt8)

        /// The D-Bus error bluetoothd turns into the ATT error.
        var dbusError: DBusMethodResult {
            switch self {
            case .notPermitted: .error(name: "org.bluez.Error.NotPermitted", message: "not permitted")
            case .notAuthorized: .error(name: "org.bluez.Error.NotAuthorized", message: "not authorized")
            case .invalidOffset: .error(name: "org.bluez.Error.InvalidOffset", message: "invalid offset")
            case .invalidValueLength: .error(name: "org.bluez.Error.InvalidValueLength", message: "invalid value length")
            case .notSupported: .error(name: "org.bluez.Error.NotSupported", message: "not supported")
            case .application(let code) where (0x80...0x9f).contains(code): .error(name: "org.bluez.Error.Failed", message: "0x" + String(code, radix: 16))
            case .application(let code): .error(name: "org.transportkit.Error.Unlikely", message: "application error 0x\(String(code, radix: 16)) is outside 0x80...0x9f")
            }
        }
    }

    /// What happens to the server and its centrals.
    public enum Event: Sendable, Hashable {
        /// A central connected to the adapter (BlueZ 5.66 does not say in which role: a link this
        /// adapter made as a central shows here too).
        case centralConnected(address: String)
        /// A device's link to the adapter dropped (in whichever role, as for ``centralConnected(address:)``).
        case centralDisconnected(address: String)
        /// A central enabled notifications or indications of the characteristic (bluetoothd calls
        /// StartNotify for each central's enabling; it does not say which central).
        case subscribed(characteristic: String)
        /// bluetoothd says the subscribers went (StopNotify); it does not say so for a bonded
        /// central whose link dropped: follow ``centralDisconnected(address:)`` too.
        case unsubscribed(characteristic: String)
        /// A central confirmed an indication.
        case indicationConfirmed(characteristic: String)
        /// The server stopped serving (bluetoothd or the adapter went away, or ``GATTServer/close()``); the last event.
        case stopped(reason: String)
    }

    /// The adapter's name (`hci0`).
    public let adapter: String
    /// The adapter's Bluetooth address (`00:AA:01:00:00:23`), which centrals connect to.
    public let address: String
    private let core: Core
    private let bus: DBusConnection
    private let stopping: Locked<(@Sendable () async -> Void)?>

    private init(adapter: BluetoothAdapter, core: Core, bus: DBusConnection, stop: @escaping @Sendable () async -> Void) {
        self.adapter = adapter.name
        self.bus = bus
        address = adapter.address
        self.core = core
        stopping = Locked(stop)
    }

    /// Publishes `services` on `adapter` and advertises them, until ``close()``.
    ///
    /// - Parameters:
    ///   - services: what to publish; UUIDs in any form BlueZ takes (`180f`, `0000180f`, 128-bit).
    ///   - advertising: what to advertise (by default the primary services' UUIDs, connectable);
    ///     nil for no advertisement (another program advertises, or centrals know the address).
    ///   - adapter: `hci0` or its address; nil for the first powered adapter.
    ///   - bus: the bus bluetoothd is on.
    /// - Throws: `.misuse` for a definition bluetoothd would refuse (a UUID that is not one, a
    ///   2902 descriptor, a value over 512 bytes), `.unsupported` for an advertising interval
    ///   bluetoothd would ignore, `.busy` when no advertising slot is left, and BlueZ's refusals explained.
    public static func publish(_ services: [Service], advertising: BluetoothAdvertising? = BluetoothAdvertising(), adapter: String? = nil,
                               bus: DBusConnection.Bus = .system) async throws -> GATTServer {
        let bluez = try await BlueZ.shared(bus)
        let root = BlueZ.exportPath("app")
        let core = try Core(services: services, root: root)
        let adapter = try BlueZ.adapter(named: adapter, among: try await bluez.adapters())
        let describing = "publishing GATT services \(core.serviceList) on \(adapter.name)"
        var advertising = advertising
        if advertising != nil, advertising?.serviceUUIDs == nil {
            advertising?.serviceUUIDs = services.filter(\.primary).compactMap { BluetoothUUID.normalize($0.uuid) }
        }
        _ = try advertising?.properties()
        let events = try await bluez.bus.signals(matchingAnyOf: BlueZ.servingMatches(adapter), buffering: .all(limit: GattSession.signalLimit))
        let export = try await bluez.bus.export(path: root, subtree: true, inOrder: true) { call in await core.answer(call) }
        let withdraw: @Sendable () async -> Void = {
            _ = try? await bluez.call(adapter.path, "org.bluez.GattManager1", "UnregisterApplication", [.objectPath(root)], about: "withdrawing GATT services")
            await export.remove()
        }
        do {
            _ = try await bluez.call(adapter.path, "org.bluez.GattManager1", "RegisterApplication", [.objectPath(root), .dictionary([:])], about: describing)
        } catch {
            // Cut short, bluetoothd may have taken it all the same.
            await uncancellable(withdraw)
            throw Self.explained(error, core: core)
        }
        var advertisement: Advertisement?
        do {
            if let advertising {
                advertisement = try await Advertisement.register(bluez, adapter: adapter, advertising: advertising, describing: "advertising \(core.serviceList) on \(adapter.name)")
            }
        } catch {
            await uncancellable(withdraw)
            throw error
        }
        let watcher = Task { await core.follow(events, adapter: adapter) }
        let advertised = advertisement
        return GATTServer(adapter: adapter, core: core, bus: bluez.bus) {
            watcher.cancel()
            core.events.finish(with: .stopped(reason: "closed"))
            await advertised?.unregister()
            await withdraw()
        }
    }

    /// RegisterApplication's refusal, with the definitions' likely fault.
    private static func explained(_ error: any Error, core: Core) -> any Error {
        guard let error = error as? TransportError, error.code == "org.bluez.Error.Failed" || error.code == "org.bluez.Error.InvalidArguments" else { return error }
        return TransportError(.misuse, "bluetoothd refused the GATT services \(core.serviceList): \(error.message) (its log says which attribute; "
                              + "a security flag on a characteristic that cannot be read or written is one cause)")
    }

    /// The server's events from now on; each call starts a new sequence, which ends after ``Event/stopped(reason:)``.
    public func events() -> AsyncStream<Event> { core.events.subscribe() }

    /// Sets a characteristic's value and notifies (or indicates) it to every central subscribed.
    /// A value longer than the link's ATT MTU − 3 is cut by bluetoothd for a notification.
    ///
    /// - Throws: `.notFound` (listing what the server has), `.unsupported` when the characteristic
    ///   neither notifies nor indicates, `.misuse` for more than 512 bytes, `.disconnected` once
    ///   the server stopped.
    public func notify(_ value: [UInt8], to characteristic: String, service: String? = nil) async throws {
        let path = try core.store(value, characteristic: characteristic, service: service, notifying: true)
        if let stopped = core.events.stopped {
            throw TransportError(.disconnected, "the GATT server on \(adapter) stopped (\(stopped)); nothing is notified")
        }
        do {
            try await bus.emitSignal(path: path, interface: GattSerial.properties, member: "PropertiesChanged",
                                          [.string(GattSerial.characteristicInterface), .dictionary(["Value": .bytes(value)]), .array(element: "s", [])])
        } catch let error as TransportError {
            throw TransportError(.disconnected, "notifying \(BluetoothUUID.short(BluetoothUUID.normalize(characteristic) ?? characteristic)): \(error.message)")
        }
    }

    /// Sets a characteristic's value, which reads get from now on (when it has no `onRead`), without notifying.
    public func setValue(_ value: [UInt8], of characteristic: String, service: String? = nil) throws {
        _ = try core.store(value, characteristic: characteristic, service: service, notifying: false)
    }

    /// A characteristic's value as last set or written.
    public func value(of characteristic: String, service: String? = nil) throws -> [UInt8] {
        let path = try core.find(characteristic, service: service).path
        return core.values.withLock { $0[path] ?? [] }
    }

    /// Stops advertising and withdraws the services; centrals connected lose them. Idempotent.
    public func close() async {
        guard let stop = stopping.withLock({ stop in defer { stop = nil }; return stop }) else { return }
        await uncancellable(stop)
    }

    deinit {
        // Dropped without close(): withdrawn in the background.
        guard let stop = stopping.withLock({ stop in defer { stop = nil }; return stop }) else { return }
        startCleanup(stop)
    }
}

extension GATTServer {
    /// A published attribute, by object path.
    enum Attribute: Sendable {
        case characteristic(Characteristic, service: String)
        case descriptor(Descriptor)
    }

    /// The definitions, the values, and the answers to bluetoothd: what the export's handler and
    /// the server share (the handler must not keep the server alive).
    final class Core: Sendable {
        static let descriptorInterface = "org.bluez.GattDescriptor1"

        let objects: [String: [String: [String: DBusValue]]]
        let attributes: [String: Attribute]
        /// (service UUID, characteristic UUID, path, properties), in definition order.
        let characteristics: [(service: String, uuid: String, path: String, properties: Properties)]
        let serviceList: String
        let values: Locked<[String: [UInt8]]>
        let events = EventFanout<Event>()

        init(services: [Service], root: String) throws {
            guard !services.isEmpty else { throw TransportError(.misuse, "a GATT server needs at least one service") }
            func uuid(_ text: String, _ what: String) throws -> String {
                guard let normalized = BluetoothUUID.normalize(text) else {
                    throw TransportError(.misuse, "'\(TransportError.printable(text, limit: 40))' is not a UUID (\(what)): 180f, 0000180f or 128 bits with dashes")
                }
                return normalized
            }
            var objects: [String: [String: [String: DBusValue]]] = [:]
            var attributes: [String: Attribute] = [:]
            var characteristics: [(service: String, uuid: String, path: String, properties: Properties)] = []
            var values: [String: [UInt8]] = [:]
            for (s, service) in services.enumerated() {
                let serviceUUID = try uuid(service.uuid, "a service")
                let servicePath = "\(root)/service\(s)"
                objects[servicePath] = [GattSerial.serviceInterface: ["UUID": .string(serviceUUID), "Primary": .bool(service.primary)]]
                for (c, characteristic) in service.characteristics.enumerated() {
                    let characteristicUUID = try uuid(characteristic.uuid, "a characteristic of \(BluetoothUUID.short(serviceUUID))")
                    let what = "characteristic \(BluetoothUUID.short(characteristicUUID))"
                    guard !characteristic.properties.isEmpty else { throw TransportError(.misuse, "\(what) has no properties: give it read, write, notify, …") }
                    guard characteristic.value.count <= 512 else { throw TransportError(.misuse, "\(what): a value holds at most 512 bytes, not \(characteristic.value.count)") }
                    if characteristic.security != .none, characteristic.properties.contains(.writeWithoutResponse), !characteristic.properties.contains(.write) {
                        throw TransportError(.unsupported, "\(what): BlueZ cannot secure writes without response alone (its encrypt-write flags add "
                                             + "the Write property); add .write, or publish it with security .none")
                    }
                    let path = "\(servicePath)/char\(c)"
                    var normalized = characteristic
                    normalized.uuid = characteristicUUID
                    objects[path] = [GattSerial.characteristicInterface: [
                        "UUID": .string(characteristicUUID), "Service": .objectPath(servicePath),
                        "Flags": .array(element: "s", Self.flags(characteristic.properties, characteristic.security).map { .string($0) }),
                    ]]
                    attributes[path] = .characteristic(normalized, service: serviceUUID)
                    characteristics.append((serviceUUID, characteristicUUID, path, characteristic.properties))
                    values[path] = characteristic.value
                    for (d, descriptor) in characteristic.descriptors.enumerated() {
                        let descriptorUUID = try uuid(descriptor.uuid, "a descriptor of \(BluetoothUUID.short(characteristicUUID))")
                        let short = BluetoothUUID.short(descriptorUUID)
                        guard short != "2902", short != "2900" else {
                            throw TransportError(.misuse, "\(what): bluetoothd adds descriptor \(short) itself (from the properties); leave it out")
                        }
                        let descriptorPath = "\(path)/desc\(d)"
                        objects[descriptorPath] = [Self.descriptorInterface: [
                            "UUID": .string(descriptorUUID), "Characteristic": .objectPath(path),
                            "Flags": .array(element: "s", Self.flags(descriptor).map { .string($0) }),
                        ]]
                        attributes[descriptorPath] = .descriptor(descriptor)
                        values[descriptorPath] = descriptor.value
                    }
                }
            }
            self.objects = objects
            self.attributes = attributes
            self.characteristics = characteristics
            self.values = Locked(values)
            serviceList = services.compactMap { BluetoothUUID.normalize($0.uuid).map(BluetoothUUID.short) }.joined(separator: ", ")
        }

        /// GattCharacteristic1's Flags for `properties` under `security`.
        static func flags(_ properties: Properties, _ security: Security) -> [String] {
            let prefix = security.flagPrefix
            var flags: [String] = []
            if properties.contains(.read) { flags.append((prefix ?? "") + "read") }
            if properties.contains(.write) { flags.append("write") }
            if properties.contains(.writeWithoutResponse) { flags.append("write-without-response") }
            if let prefix, !properties.isDisjoint(with: [.write, .writeWithoutResponse]) { flags.append(prefix + "write") }
            if properties.contains(.notify) { flags += ["notify"] + (prefix.map { [$0 + "notify"] } ?? []) }
            if properties.contains(.indicate) { flags += ["indicate"] + (prefix.map { [$0 + "indicate"] } ?? []) }
            return flags
        }

        /// GattDescriptor1's Flags.
        static func flags(_ descriptor: Descriptor) -> [String] {
            let prefix = descriptor.security.flagPrefix ?? ""
            return [prefix + "read"] + (descriptor.writable ? [prefix + "write"] : [])
        }

        /// The characteristic with `uuid` (in `service`, when given).
        func find(_ characteristic: String, service: String?) throws -> (service: String, uuid: String, path: String, properties: Properties) {
            let wanted = BluetoothUUID.normalize(characteristic)
            let inService = service.map { BluetoothUUID.normalize($0) ?? $0 }
            let matches = characteristics.filter { $0.uuid == wanted && (inService == nil || $0.service == inService) }
            guard let found = matches.first else {
                let listed = characteristics.map { "\(BluetoothUUID.short($0.service))/\(BluetoothUUID.short($0.uuid))" }.joined(separator: ", ")
                throw TransportError(.notFound, "this GATT server has no characteristic \(TransportError.printable(characteristic, limit: 40))"
                                     + "\(service.map { " in service \($0)" } ?? ""); it has \(listed)")
            }
            guard matches.count == 1 else {
                throw TransportError(.misuse, "characteristic \(BluetoothUUID.short(found.uuid)) is in \(matches.count) services; name the service")
            }
            return found
        }

        /// Stores a value set by the app; returns the characteristic's path.
        func store(_ value: [UInt8], characteristic: String, service: String?, notifying: Bool) throws -> String {
            let found = try find(characteristic, service: service)
            if notifying, found.properties.isDisjoint(with: [.notify, .indicate]) {
                throw TransportError(.unsupported, "characteristic \(BluetoothUUID.short(found.uuid)) neither notifies nor indicates; publish it with .notify or .indicate")
            }
            guard value.count <= 512 else {
                throw TransportError(.misuse, "characteristic \(BluetoothUUID.short(found.uuid)): a value holds at most 512 bytes, not \(value.count)")
            }
            values.withLock { $0[found.path] = value }
            return found.path
        }

        /// One call from bluetoothd, in the order the calls came.
        func answer(_ call: DBusMethodCall) async -> DBusMethodResult {
            if let served = BlueZ.serve(call, from: objects) { return served }
            guard let attribute = attributes[call.path] else { return .notHandled }
            switch (attribute, call.interface, call.member) {
            case (.characteristic(let characteristic, _), GattSerial.characteristicInterface, "ReadValue"):
                let options = call.arguments.first?.dictionary ?? [:]
                let offset = Int(options["offset"]?.integer ?? 0)
                let request = ReadRequest(characteristic: characteristic.uuid, offset: offset, attMTU: options["mtu"]?.integer.map { Int($0) },
                                          central: options["device"]?.text.map(BlueZ.address(inDevicePath:)))
                do {
                    let value = try await characteristic.onRead?(request) ?? values.withLock { $0[call.path] ?? [] }
                    return try Self.reply(value, from: offset)
                } catch {
                    return Self.failure(error)
                }
            case (.characteristic(let characteristic, _), GattSerial.characteristicInterface, "WriteValue"):
                let value = call.arguments.first?.bytes ?? []
                let options = call.arguments.dropFirst().first?.dictionary ?? [:]
                let request = WriteRequest(characteristic: characteristic.uuid, value: value, offset: Int(options["offset"]?.integer ?? 0),
                                           attMTU: options["mtu"]?.integer.map { Int($0) }, central: options["device"]?.text.map(BlueZ.address(inDevicePath:)))
                do {
                    // What the stored value would become is checked first: a write refused for
                    // its offset or length reaches no handler.
                    _ = try assembled(value, at: request.offset, onto: values.withLock { $0[call.path] ?? [] })
                    try await characteristic.onWrite?(request)
                    try write(value, at: request.offset, to: call.path)
                    return .reply([])
                } catch {
                    return Self.failure(error)
                }
            case (.characteristic(let characteristic, _), GattSerial.characteristicInterface, "StartNotify"):
                events.yield(.subscribed(characteristic: characteristic.uuid))
                return .reply([])
            case (.characteristic(let characteristic, _), GattSerial.characteristicInterface, "StopNotify"):
                events.yield(.unsubscribed(characteristic: characteristic.uuid))
                return .reply([])
            case (.characteristic(let characteristic, _), GattSerial.characteristicInterface, "Confirm"):
                events.yield(.indicationConfirmed(characteristic: characteristic.uuid))
                return .reply([])
            case (.descriptor, Self.descriptorInterface, "ReadValue"):
                let offset = Int(call.arguments.first?.dictionary?["offset"]?.integer ?? 0)
                do {
                    return try Self.reply(values.withLock { $0[call.path] ?? [] }, from: offset)
                } catch {
                    return Self.failure(error)
                }
            case (.descriptor(let descriptor), Self.descriptorInterface, "WriteValue"):
                guard descriptor.writable else { return Failure.notPermitted.dbusError }
                do {
                    try write(call.arguments.first?.bytes ?? [], at: Int(call.arguments.dropFirst().first?.dictionary?["offset"]?.integer ?? 0), to: call.path)
                    return .reply([])
                } catch {
                    return Self.failure(error)
                }
            default:
                return .notHandled
            }
        }

        /// The value from `offset` on.
        static func reply(_ value: [UInt8], from offset: Int) throws -> DBusMethodResult {
            guard offset <= value.count else { throw Failure.invalidOffset }
            return .reply([.bytes(Array(value[offset...]))])
        }

        /// Stores a central's write at `offset` (the value up to there kept).
        private func write(_ value: [UInt8], at offset: Int, to path: String) throws {
            try values.withLock { values in values[path] = try assembled(value, at: offset, onto: values[path] ?? []) }
        }

        /// `stored` with `value` written at `offset`, or the ATT error that refuses it.
        private func assembled(_ value: [UInt8], at offset: Int, onto stored: [UInt8]) throws -> [UInt8] {
            guard offset <= stored.count else { throw Failure.invalidOffset }
            let updated = Array(stored.prefix(offset)) + value
            guard updated.count <= 512 else { throw Failure.invalidValueLength }
            return updated
        }

        /// A handler's error as bluetoothd takes it: a ``Failure`` as its ATT error, anything else
        /// as ATT's "unlikely error" (0x0e), its text in bluetoothd's debug log.
        static func failure(_ error: any Error) -> DBusMethodResult {
            if let failure = error as? Failure { return failure.dbusError }
            return .error(name: "org.transportkit.Error.Unlikely", message: "\(error)")
        }

        /// Centrals coming and going; bluetoothd or the adapter going away stops the server.
        func follow(_ signals: AsyncThrowingStream<DBusSignal, any Error>, adapter: BluetoothAdapter) async {
            var reason = "bluetoothd went away: publish again once it is back"
            do {
                for try await signal in signals {
                    switch signal.member {
                    case "NameOwnerChanged" where signal.values.last?.text == "":
                        throw CancellationError()
                    case "InterfacesRemoved" where signal.values.first?.text == adapter.path
                        && signal.values.dropFirst().first?.strings?.contains(BlueZ.adapterInterface) == true:
                        reason = "adapter \(adapter.name) went away"
                        throw CancellationError()
                    case "PropertiesChanged":
                        guard signal.path.hasPrefix(adapter.path + "/dev_"),
                              let connected = signal.values.dropFirst().first?.dictionary?["Connected"]?.boolValue else { continue }
                        let address = BlueZ.address(inDevicePath: signal.path)
                        events.yield(connected ? .centralConnected(address: address) : .centralDisconnected(address: address))
                    case "InterfacesAdded":
                        // A central bluetoothd did not know yet: its device object comes connected.
                        guard let path = signal.values.first?.text, path.hasPrefix(adapter.path + "/dev_"),
                              signal.values.dropFirst().first?.dictionary?[BlueZ.deviceInterface]?.dictionary?["Connected"]?.boolValue == true else { continue }
                        events.yield(.centralConnected(address: BlueZ.address(inDevicePath: path)))
                    default:
                        continue
                    }
                }
            } catch {}
            guard !Task.isCancelled else { return }
            events.finish(with: .stopped(reason: reason))
        }
    }
}

/// Events fanned out to every sequence taken with ``subscribe()``, each bounded to the newest 64;
/// ``finish(with:)`` sends a last event to all and ends them, and a later subscriber gets just that one.
final class EventFanout<Event: Sendable>: Sendable {
    private struct State {
        var listeners: [Int: AsyncStream<Event>.Continuation] = [:]
        var next = 0
        var last: Event?
        var finished = false
    }

    private let state = Locked(State())

    func subscribe() -> AsyncStream<Event> {
        let (stream, continuation) = AsyncStream<Event>.makeStream(bufferingPolicy: .bufferingNewest(64))
        let id = state.withLock { state -> Int? in
            guard !state.finished else {
                if let last = state.last { continuation.yield(last) }
                return nil
            }
            state.next += 1
            state.listeners[state.next] = continuation
            return state.next
        }
        guard let id else {
            continuation.finish()
            return stream
        }
        continuation.onTermination = { [weak self] _ in _ = self?.state.withLock { $0.listeners.removeValue(forKey: id) } }
        return stream
    }

    /// The last event, once finished.
    var stopped: Event? { state.withLock { $0.finished ? $0.last : nil } }

    func yield(_ event: Event) {
        for listener in state.withLock({ Array($0.listeners.values) }) { listener.yield(event) }
    }

    /// Sends `last` and ends every sequence, once.
    func finish(with last: Event?) {
        let listeners = state.withLock { state -> [AsyncStream<Event>.Continuation] in
            guard !state.finished else { return [] }
            state.finished = true
            state.last = last
            defer { state.listeners = [:] }
            return Array(state.listeners.values)
        }
        for listener in listeners {
            if let last { listener.yield(last) }
            listener.finish()
        }
    }
}
