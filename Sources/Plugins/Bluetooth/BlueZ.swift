// BlueZ.swift: bluetoothd's D-Bus API (org.bluez: ObjectManager on "/", Adapter1, Device1; BlueZ
// doc/adapter-api.txt and device-api.txt at 5.66) as the Bluetooth plugins need it: adapters,
// devices, the adapter a URL asks for, a device found by address (discovering it when BlueZ does
// not know it yet), and errors a person can act on. Data never goes through D-Bus: it flows
// through kernel sockets (BluetoothSocket.swift) or descriptors BlueZ hands out.

import Glibc
import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus
@_spi(Plugins) import TransportKitLinux

/// A Bluetooth controller as bluetoothd reports it (org.bluez.Adapter1).
public struct BluetoothAdapter: Sendable, Hashable, Codable {
    /// The D-Bus object path, `/org/bluez/hci0`.
    public var path: String
    /// The kernel's name, `hci0`: what `adapter=` takes.
    public var name: String
    /// The controller's index (0 for hci0), as btmgmt's `--index` takes it.
    public var index: Int?
    public var address: String
    public var alias: String?
    public var powered: Bool
    public var discoverable: Bool
    public var discovering: Bool
}

/// A Bluetooth device bluetoothd knows about (org.bluez.Device1): seen in a scan, paired or connected.
public struct BluetoothDevice: Sendable, Hashable, Codable {
    /// The D-Bus object path, `/org/bluez/hci0/dev_00_AA_01_01_00_01`.
    public var path: String
    /// The adapter's object path.
    public var adapterPath: String
    public var address: String
    /// `public` or `random` (LE); BR/EDR devices are `public`.
    public var addressType: String
    public var name: String?
    public var alias: String?
    /// The signal strength of the last advertisement or inquiry result, in dBm; nil when not in range recently.
    public var rssi: Int?
    /// Service UUIDs, lower-case, 128-bit form.
    public var uuids: [String]
    public var connected: Bool
    public var paired: Bool
    public var servicesResolved: Bool
    /// Manufacturer data by company identifier.
    public var manufacturerData: [UInt16: [UInt8]]
    /// Service data by service UUID.
    public var serviceData: [String: [UInt8]]
}

/// bluetoothd's objects (path → interface → properties) as one GetManagedObjects reported them,
/// kept current with the ObjectManager and PropertiesChanged signals that came after it.
struct BlueZObjects: Sendable {
    private(set) var interfaces: [String: [String: [String: DBusValue]]] = [:]

    init(managed reply: DBusValue?) {
        for (path, value) in reply?.dictionary ?? [:] {
            var byInterface: [String: [String: DBusValue]] = [:]
            for (interface, properties) in value.dictionary ?? [:] { byInterface[interface] = properties.dictionary ?? [:] }
            interfaces[path] = byInterface
        }
    }

    /// Applies an InterfacesAdded, InterfacesRemoved or PropertiesChanged signal; others change nothing.
    mutating func apply(_ signal: DBusSignal) {
        switch signal.member {
        case "InterfacesAdded":
            guard let path = signal.values.first?.text, let added = signal.values.dropFirst().first?.dictionary else { return }
            for (interface, properties) in added { interfaces[path, default: [:]][interface] = properties.dictionary ?? [:] }
        case "InterfacesRemoved":
            guard let path = signal.values.first?.text, let removed = signal.values.dropFirst().first?.strings else { return }
            for interface in removed { interfaces[path]?[interface] = nil }
            if interfaces[path]?.isEmpty == true { interfaces[path] = nil }
        case "PropertiesChanged":
            // Only for objects already known: their InterfacesAdded carried every property.
            guard let interface = signal.values.first?.text, interfaces[signal.path]?[interface] != nil,
                  let changed = signal.values.dropFirst().first?.dictionary else { return }
            interfaces[signal.path]?[interface]?.merge(changed) { $1 }
            for name in signal.values.dropFirst(2).first?.strings ?? [] { interfaces[signal.path]?[interface]?[name] = nil }
        default:
            return
        }
    }

    /// The properties of `interface` on the object at `path`.
    func properties(_ path: String, _ interface: String) -> [String: DBusValue]? { interfaces[path]?[interface] }

    /// The adapters, by index.
    var adapters: [BluetoothAdapter] {
        BlueZ.inIndexOrder(interfaces.compactMap { path, byInterface in byInterface[BlueZ.adapterInterface].map { BlueZ.adapter(path: path, $0) } })
    }

    /// Every device's Device1 properties by object path.
    var devices: [String: [String: DBusValue]] {
        interfaces.compactMapValues { $0[BlueZ.deviceInterface] }
    }

    /// The device at `path`, if bluetoothd has it.
    func device(at path: String) -> BluetoothDevice? {
        properties(path, BlueZ.deviceInterface).map { BlueZ.device(path: path, $0) }
    }
}

/// The BlueZ client the Bluetooth plugins share: one D-Bus connection per process, opened on first
/// use and opened again after it was lost (bluetoothd or dbus-daemon restarted).
final class BlueZ: Sendable {
    static let service = "org.bluez"
    static let objectManager = "org.freedesktop.DBus.ObjectManager"
    static let adapterInterface = "org.bluez.Adapter1"
    static let deviceInterface = "org.bluez.Device1"

    let bus: DBusConnection
    /// This client's discovery sessions, shared by every scan and search in the process.
    let discoveries = DiscoverySessions()
    /// One LE connect at a time per adapter, in this process (GattCentral.swift's header).
    let connectTurns = KeyedTurns()
    /// Notification sessions per characteristic path: bluetoothd keeps one per D-Bus client, and
    /// every user in this process shares the one connection.
    let notifySessions = NotifySessions()

    private init(bus: DBusConnection) { self.bus = bus }

    private static let exported = Atomic<Int>(0)

    /// A path for an object this process exports to bluetoothd (a profile, an advertisement, a
    /// GATT application, an agent): `/org/transportkit/KIND` and a number unique in the process.
    static func exportPath(_ kind: String) -> String {
        "/org/transportkit/\(kind)\(exported.add(1, ordering: .relaxed).newValue)"
    }

    /// What a process serving centrals on `adapter` follows (a GATT server, the serial
    /// peripheral): objects added (a central's device, new to bluetoothd, comes connected) and
    /// removed (the adapter, a central's device), the adapter's devices' property changes
    /// (Connected), and bluetoothd leaving the bus.
    static func servingMatches(_ adapter: BluetoothAdapter) -> [DBusMatch] {
        [
            DBusMatch(sender: service, interface: objectManager, member: "InterfacesAdded"),
            DBusMatch(sender: service, interface: objectManager, member: "InterfacesRemoved"),
            DBusMatch(sender: service, pathNamespace: adapter.path, interface: GattSerial.properties, member: "PropertiesChanged",
                      arg0: deviceInterface),
            DBusMatch(sender: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                      member: "NameOwnerChanged", arg0: service),
        ]
    }

    /// Answers bluetoothd's reads of objects this process exports (a GATT application, an
    /// advertisement): ObjectManager.GetManagedObjects and Properties.Get/GetAll from `objects`
    /// (path → interface → properties); nil for any other call, which is the caller's to answer.
    static func serve(_ call: DBusMethodCall, from objects: [String: [String: [String: DBusValue]]]) -> DBusMethodResult? {
        switch (call.interface, call.member) {
        case (objectManager, "GetManagedObjects"):
            let entries = objects.sorted { $0.key < $1.key }.map { path, interfaces in
                DBusValue.dictEntry(.objectPath(path), .array(element: "{sa{sv}}", interfaces.sorted { $0.key < $1.key }.map {
                    .dictEntry(.string($0.key), .dictionary($0.value))
                }))
            }
            return .reply([.array(element: "{oa{sa{sv}}}", entries)])
        case (GattSerial.properties, "GetAll"):
            guard let interface = call.arguments.first?.text else { return .reply([.dictionary([:])]) }
            return .reply([.dictionary(objects[call.path]?[interface] ?? [:])])
        case (GattSerial.properties, "Get"):
            guard let interface = call.arguments.first?.text, let name = call.arguments.dropFirst().first?.text,
                  let value = objects[call.path]?[interface]?[name] else {
                return .error(name: "org.freedesktop.DBus.Error.InvalidArgs", message: "no such property")
            }
            return .reply([.variant(value)])
        default:
            return nil
        }
    }

    /// One client per bus (the system bus, or the one a host app or test gave the plugin): open,
    /// or being opened by a task that every caller meanwhile waits for.
    private static let clients = Locked<[String: Client]>([:])

    private enum Client: Sendable {
        case open(BlueZ)
        case opening(Task<BlueZ, any Error>)
    }

    /// The shared client for `bus`, opened at the first call (and again once the connection was
    /// lost). Opening it (connect(2) and the bus thread's start) runs on `Blocking`'s pool, never
    /// on the caller's thread and never under the lock; callers that come meanwhile wait for that
    /// one open. The wait is short and not cancellable; a failed open is tried again at the next call.
    ///
    /// - Throws: `.notFound` when there is no such bus (no dbus-daemon), `.permissionDenied` when
    ///   this user may not connect to it.
    static func shared(_ bus: DBusConnection.Bus) async throws -> BlueZ {
        let key = bus.description
        let opening = clients.withLock { clients -> Client in
            if case .open(let client)? = clients[key], client.bus.isConnected { return .open(client) }
            if case .opening(let task)? = clients[key] { return .opening(task) }
            let task = Task<BlueZ, any Error> {
                do {
                    return BlueZ(bus: try await Blocking.run { try DBusConnection(bus) })
                } catch let error as TransportError {
                    throw TransportError(error.kind, "Bluetooth goes through bluetoothd on the system D-Bus, and that failed: \(error.message)",
                                         errno: error.errno, syscall: error.syscall)
                }
            }
            clients[key] = .opening(task)
            return .opening(task)
        }
        let task: Task<BlueZ, any Error>
        switch opening {
        case .open(let client): return client
        case .opening(let pending): task = pending
        }
        let result = await task.result
        clients.withLock { clients in
            // Only the open this call waited for is replaced (a newer one may have begun since).
            guard case .opening(let current)? = clients[key], current == task else { return }
            switch result {
            case .success(let client): clients[key] = .open(client)
            case .failure: clients[key] = nil
            }
        }
        return try result.get()
    }

    /// `false` only when `bus` certainly is not there: its address names socket files and none
    /// exists (no dbus-daemon). A check that answers at once, without connecting, for APIs that
    /// must decide on the spot (`deviceEvents`).
    static func mayBeReachable(_ bus: DBusConnection.Bus) -> Bool {
        let address: String
        switch bus {
        case .system: address = getenv("DBUS_SYSTEM_BUS_ADDRESS").map { String(cString: $0) } ?? "unix:path=/run/dbus/system_bus_socket"
        case .address(let given): address = given
        }
        // Addresses separated by ';' are tried in turn: any one may answer.
        for entry in address.split(separator: ";") {
            guard entry.hasPrefix("unix:"),
                  let value = entry.dropFirst("unix:".count).split(separator: ",").first(where: { $0.hasPrefix("path=") }),
                  !value.contains("%") else { return true }   // abstract, TCP, escaped: cannot tell
            if access(String(value.dropFirst("path=".count)), F_OK) == 0 { return true }
        }
        return false
    }

    /// Calls a BlueZ method, with BlueZ's errors turned into ones a person can act on.
    func call(_ path: String, _ interface: String, _ member: String, _ arguments: [DBusValue] = [],
              timeout: Duration? = nil, about what: String) async throws -> [DBusValue] {
        do {
            return try await bus.call(destination: Self.service, path: path, interface: interface, member: member, arguments, timeout: timeout)
        } catch let error as TransportError {
            throw Self.explain(error, about: what)
        }
    }

    /// The values the characteristic at `path` notifies, as PropertiesChanged signals (take each
    /// one's bytes with ``notifiedValue(_:)``): subscribed to first, then started (counted per
    /// process, NotifySessions), so that no value is missed. Up to
    /// `GattSerial.unreadNotificationLimit` wait unread; one more ends the stream with
    /// `DBusSignalBuffering.overflowCode`. Stop with `notifySessions.stop` when done.
    func notifications(of path: String, about what: String) async throws -> AsyncThrowingStream<DBusSignal, any Error> {
        let values = try await bus.signals(DBusMatch(sender: Self.service, path: path, interface: "org.freedesktop.DBus.Properties",
                                                     member: "PropertiesChanged", arg0: "org.bluez.GattCharacteristic1"),
                                           buffering: .all(limit: GattSerial.unreadNotificationLimit))
        try await notifySessions.start(self, path: path, about: what)
        return values
    }

    /// The value a characteristic's PropertiesChanged carries, if it carries one.
    static func notifiedValue(_ signal: DBusSignal) -> [UInt8]? {
        signal.values.dropFirst().first?.dictionary?["Value"]?.bytes
    }

    /// The adapters, without walking every device bluetoothd knows: the nodes under /org/bluez
    /// (Introspect) and each one's Adapter1 properties.
    func adapters() async throws -> [BluetoothAdapter] {
        let xml = try await call("/org/bluez", "org.freedesktop.DBus.Introspectable", "Introspect", about: "listing Bluetooth adapters").first?.text ?? ""
        var adapters: [BluetoothAdapter] = []
        for name in Self.childNodes(inIntrospection: xml) {
            let path = "/org/bluez/" + name
            // nil: removed in between, or not an adapter.
            if let properties = try await properties(at: path, Self.adapterInterface, about: "reading Bluetooth adapter \(name)") {
                adapters.append(Self.adapter(path: path, properties))
            }
        }
        return Self.inIndexOrder(adapters)
    }

    /// Adapters sorted as their indexes go (hci0, hci1, …).
    static func inIndexOrder(_ adapters: [BluetoothAdapter]) -> [BluetoothAdapter] {
        adapters.sorted { ($0.index ?? 0, $0.name) < ($1.index ?? 0, $1.name) }
    }

    /// The properties of `interface` on the object at `path` (Properties.GetAll), or nil when
    /// bluetoothd has no such object or it has no such interface.
    func properties(at path: String, _ interface: String, about what: String) async throws -> [String: DBusValue]? {
        do {
            let reply = try await bus.call(destination: Self.service, path: path, interface: "org.freedesktop.DBus.Properties", member: "GetAll",
                                           [.string(interface)])
            return reply.first?.dictionary
        } catch let error as TransportError where ["org.freedesktop.DBus.Error.UnknownObject", "org.freedesktop.DBus.Error.UnknownMethod",
                                                   "org.freedesktop.DBus.Error.UnknownInterface", "org.freedesktop.DBus.Error.InvalidArgs"]
                    .contains(error.code ?? "") {
            return nil
        } catch let error as TransportError {
            throw Self.explain(error, about: what)
        }
    }

    /// The names of the child nodes in D-Bus introspection XML (`<node name="hci0"/>`).
    static func childNodes(inIntrospection xml: String) -> [String] {
        var names: [String] = []
        var rest = Substring(xml)
        while let start = rest.firstRange(of: "<node name=\"") {
            rest = rest[start.upperBound...]
            guard let end = rest.firstIndex(of: "\"") else { break }
            let name = String(rest[..<end])
            if !name.isEmpty && !name.contains("/") { names.append(name) }
            rest = rest[end...]
        }
        return names
    }

    /// The device at `path`, or nil when bluetoothd has no such object (Properties.GetAll).
    func device(at path: String) async throws -> BluetoothDevice? {
        try await properties(at: path, Self.deviceInterface, about: "reading Bluetooth device \(Self.address(inDevicePath: path))")
            .map { Self.device(path: path, $0) }
    }

    /// Every adapter and device bluetoothd manages.
    func objects() async throws -> (adapters: [BluetoothAdapter], devices: [BluetoothDevice]) {
        let managed = try await managedObjects(about: "listing Bluetooth adapters and devices")
        return (managed.adapters, managed.devices.map { Self.device(path: $0.key, $0.value) }.sorted { $0.path < $1.path })
    }

    /// The adapters, and every device's Device1 properties by object path, from one GetManagedObjects.
    func managedObjects(about what: String) async throws -> (adapters: [BluetoothAdapter], devices: [String: [String: DBusValue]]) {
        let tree = try await objectTree(about: what)
        return (tree.adapters, tree.devices)
    }

    /// Every object bluetoothd manages, from one GetManagedObjects (the whole tree: each call costs
    /// bluetoothd a walk over every device it knows, so a connect makes one and follows signals).
    func objectTree(about what: String) async throws -> BlueZObjects {
        BlueZObjects(managed: try await call("/", Self.objectManager, "GetManagedObjects", about: what).first)
    }

    static func adapter(path: String, _ properties: [String: DBusValue]) -> BluetoothAdapter {
        let name = String(path.split(separator: "/").last ?? "")
        return BluetoothAdapter(path: path, name: name, index: name.hasPrefix("hci") ? Int(name.dropFirst(3)) : nil,
                                address: properties["Address"]?.text ?? "", alias: properties["Alias"]?.text,
                                powered: properties["Powered"]?.boolValue ?? false,
                                discoverable: properties["Discoverable"]?.boolValue ?? false,
                                discovering: properties["Discovering"]?.boolValue ?? false)
    }

    /// A device's object path on `adapter`: `/org/bluez/hci0/dev_00_AA_01_01_00_01`.
    static func devicePath(on adapter: BluetoothAdapter, address: String) -> String {
        adapter.path + "/dev_" + String(address.uppercased().map { $0 == ":" ? "_" : $0 })
    }

    /// The address in a device's object path (`00:AA:01:01:00:01`), as ``devicePath(on:address:)`` wrote it.
    static func address(inDevicePath path: String) -> String {
        String((path.split(separator: "/").last?.dropFirst(4) ?? "").map { $0 == "_" ? ":" : $0 })
    }

    /// The device with `address` on the adapter at `adapterPath`, among what bluetoothd reported.
    static func device(_ address: String, onAdapter adapterPath: String, among devices: [BluetoothDevice]) -> BluetoothDevice? {
        let wanted = address.uppercased()
        return devices.first { $0.adapterPath == adapterPath && $0.address.uppercased() == wanted }
    }

    static func device(path: String, _ properties: [String: DBusValue]) -> BluetoothDevice {
        var manufacturer: [UInt16: [UInt8]] = [:]
        for (company, value) in properties["ManufacturerData"]?.unwrapped.integerKeyedDictionary ?? [:] {
            if let bytes = value.bytes, let id = UInt16(exactly: company) { manufacturer[id] = bytes }
        }
        var service: [String: [UInt8]] = [:]
        for (uuid, value) in properties["ServiceData"]?.unwrapped.dictionary ?? [:] {
            if let bytes = value.bytes { service[uuid.lowercased()] = bytes }
        }
        return BluetoothDevice(path: path, adapterPath: properties["Adapter"]?.text ?? "",
                               address: properties["Address"]?.text ?? "", addressType: properties["AddressType"]?.text ?? "public",
                               name: properties["Name"]?.text, alias: properties["Alias"]?.text,
                               rssi: properties["RSSI"]?.integer.map { Int($0) }, uuids: (properties["UUIDs"]?.strings ?? []).map { $0.lowercased() },
                               connected: properties["Connected"]?.boolValue ?? false, paired: properties["Paired"]?.boolValue ?? false,
                               servicesResolved: properties["ServicesResolved"]?.boolValue ?? false,
                               manufacturerData: manufacturer, serviceData: service)
    }

    /// The adapter `name` (`hci1`) among `adapters`, or the first powered one.
    ///
    /// - Throws: `.notFound` when there is no adapter or not the one named (the message lists the
    ///   others), `.unsupported` when the one to use is powered off (with the command that powers it on).
    static func adapter(named name: String?, among adapters: [BluetoothAdapter]) throws -> BluetoothAdapter {
        let known = adapters.map { "\($0.name) (\($0.address)\($0.powered ? "" : ", powered off"))" }.joined(separator: ", ")
        guard !adapters.isEmpty else {
            throw TransportError(.notFound, "no Bluetooth adapter: bluetoothd manages none (is a controller plugged in and not blocked? `rfkill list`, `btmgmt info`)")
        }
        if let name {
            guard let adapter = adapters.first(where: { $0.name == name || $0.address.uppercased() == name.uppercased() }) else {
                throw TransportError(.notFound, "no Bluetooth adapter \(name); adapters: \(known)")
            }
            guard adapter.powered else { throw Self.poweredOff(adapter) }
            return adapter
        }
        guard let adapter = adapters.first(where: \.powered) else {
            guard let first = adapters.first else { throw TransportError(.notFound, "no Bluetooth adapter") }
            throw Self.poweredOff(first)
        }
        return adapter
    }

    /// An adapter that is off, with the code BlueZ's own calls give that state
    /// (`org.bluez.Error.NotReady`), so that a reconnect says it waits for the adapter to be powered.
    static func poweredOff(_ adapter: BluetoothAdapter) -> TransportError {
        TransportError(.unsupported, "Bluetooth adapter \(adapter.name) (\(adapter.address)) is powered off: power it on with "
                       + "`bluetoothctl power on`\(adapter.index.map { " or `btmgmt --index \($0) power on`" } ?? "") (and check `rfkill list`)",
                       code: "org.bluez.Error.NotReady")
    }

    /// Turns BlueZ's D-Bus errors (org.bluez.Error.*, by their name in ``TransportError/code``)
    /// into errors that say what to do; the code stays on the result. (BlueZ's own reasons, such
    /// as "le-connection-abort-by-local", come only in the message of org.bluez.Error.Failed.)
    static func explain(_ error: TransportError, about what: String) -> TransportError {
        var explained = explainWords(error, about: what)
        explained.code = error.code
        return explained
    }

    private static func explainWords(_ error: TransportError, about what: String) -> TransportError {
        let message = error.message
        func has(_ name: String) -> Bool { error.code == "org.bluez.Error.\(name)" }
        if has("NotReady") {
            return TransportError(.unsupported, "\(what): the adapter is not ready (powered off?): `bluetoothctl power on`. \(message)")
        }
        if has("AuthenticationFailed") || has("AuthenticationRejected") || has("AuthenticationCanceled") || has("AuthenticationTimeout") {
            // bluetoothd asks the agent of the client that called Pair, else the default agent.
            if BluetoothPairingAgent.registered.load(ordering: .relaxed) > 0 {
                return TransportError(.permissionDenied, "\(what): pairing failed: the device refused it or did not answer (its agent or its "
                                      + "user said no, or it has no agent to answer); accept the pairing on the device, or ask for less security. \(message)")
            }
            return TransportError(.permissionDenied, "\(what): pairing failed: no agent answered bluetoothd on this side, or the device refused. "
                                  + "Register one (BluetoothPairingAgent.register(), or run `bluetoothctl` with its agent on) and pair again "
                                  + "(`bluetoothctl pair ADDRESS`), or ask for less security. \(message)")
        }
        if has("NotAuthorized") || has("NotPermitted") {
            return TransportError(.permissionDenied, "\(what): BlueZ refused: the device needs pairing or authorization (`bluetoothctl pair ADDRESS`, "
                                  + "`bluetoothctl trust ADDRESS`) with an agent running. \(message)")
        }
        if has("DoesNotExist") {
            return TransportError(.notFound, "\(what): BlueZ no longer knows the device (it expired after its last advertisement); scan again. \(message)")
        }
        if has("InProgress") || has("Busy") {
            return TransportError(.busy, "\(what): another operation is under way on the adapter (one LE connection attempt at a time); try again. \(message)")
        }
        if has("NotAvailable") || message.contains("br-connection-profile-unavailable") {
            return TransportError(.refused, "\(what): the device does not offer that profile or service. \(message)")
        }
        if message.contains("le-connection-abort-by-local") || message.contains("page-timeout") || message.contains("br-connection-page-timeout") {
            return TransportError(.timedOut, "\(what): the device did not answer (out of range, switched off, or not connectable). \(message)")
        }
        if error.code == "org.freedesktop.DBus.Error.ServiceUnknown" || error.code == "org.freedesktop.DBus.Error.NameHasNoOwner" {
            return TransportError(.notFound, "\(what): bluetoothd is not running (org.bluez has no owner on the system bus): "
                                  + "`systemctl start bluetooth`, or start /usr/libexec/bluetooth/bluetoothd")
        }
        if error.kind == .permissionDenied {
            return TransportError(.permissionDenied, "\(what): \(message)")
        }
        return error
    }

    /// How many ObjectManager or device signals may wait unread for a reader that must see each
    /// (a device added or removed): a scan in a crowded room adds hundreds.
    static let objectSignalLimit = 4096

    /// How long a search inside a connect without a timeout looks (a device that is not there is
    /// otherwise searched for until the application gives up).
    static let searchWithoutDeadline: Duration = .seconds(10)

    /// The device with `address` on `adapter`, which bluetoothd did not know when the caller looked:
    /// a discovery runs (LE or BR/EDR by `transport`) until it appears or `deadline` passes.
    ///
    /// - Throws: `.notFound` "not found within N s" when it never appears.
    ///
    /// With `freshSighting`, a device bluetoothd already knows is looked for too: the search ends
    /// when one of its advertisements updates it (RSSI, data), or after two seconds with what is
    /// known; Device1.Connect then prefers the bearer just seen.
    func discover(address: String, on adapter: BluetoothAdapter, transport: String, deadline: ContinuousClock.Instant?,
                  timeout: Duration?, freshSighting: Bool = false) async throws -> BluetoothDevice {
        let wanted = address.uppercased()
        let signals = try await bus.signals(DBusMatch(sender: Self.service, interface: Self.objectManager, member: "InterfacesAdded"),
                                            buffering: .all(limit: Self.objectSignalLimit))
        let devicePath = Self.devicePath(on: adapter, address: wanted)
        // Any change is a sighting: the newest few say as much as all of them.
        let updates = try await bus.signals(DBusMatch(sender: Self.service, path: devicePath, interface: "org.freedesktop.DBus.Properties",
                                                      member: "PropertiesChanged"), buffering: .newest(16))
        let session = try await discoveries.start(self, adapter: adapter, filter: ["Transport": .string(transport), "DuplicateData": .bool(false)])
        do {
            let found = try await discover(wanted, on: adapter, deadline: deadline, timeout: timeout, freshSighting: freshSighting,
                                           signals: signals, updates: updates)
            await discoveries.stop(self, adapter: adapter, session: session)
            return found
        } catch {
            await discoveries.stop(self, adapter: adapter, session: session)
            throw error
        }
    }

    private func discover(_ wanted: String, on adapter: BluetoothAdapter, deadline: ContinuousClock.Instant?, timeout: Duration?, freshSighting: Bool,
                          signals: AsyncThrowingStream<DBusSignal, any Error>, updates: AsyncThrowingStream<DBusSignal, any Error>) async throws -> BluetoothDevice {
        let started = ContinuousClock.now
        let limit = ConnectRequest.searchLimit(before: deadline, from: started) ?? started + Self.searchWithoutDeadline
        // The device may have appeared between the first look and the subscription: ask for it
        // alone (UnknownObject when bluetoothd does not have it), not for the whole tree.
        let known = try await device(at: Self.devicePath(on: adapter, address: wanted))
        if let known, !freshSighting { return known }
        var searches: [@Sendable () async throws -> BluetoothDevice?] = [{
            for try await signal in signals {
                guard case .objectPath(let path)? = signal.values.first, path.hasPrefix(adapter.path + "/"),
                      let properties = signal.values.dropFirst().first?.dictionary?[Self.deviceInterface]?.dictionary else { continue }
                let device = Self.device(path: path, properties)
                if device.address.uppercased() == wanted { return device }
            }
            return nil
        }]
        if let known {
            searches.append {
                for try await signal in updates {
                    guard let changed = signal.values.dropFirst().first?.dictionary else { continue }
                    if changed["RSSI"] != nil || changed["ManufacturerData"] != nil || changed["ServiceData"] != nil || changed["TxPower"] != nil {
                        return known
                    }
                }
                return nil
            }
            searches.append {
                try await Task.sleep(until: min(limit, ContinuousClock.now + .seconds(2)), clock: .continuous)
                return known
            }
        }
        guard let found = try await ConnectRequest.first(of: searches, until: limit) else {
            let within = ConnectRequest.searchTime(timeout: timeout, orElse: Self.searchWithoutDeadline)
            throw TransportError(.notFound, "Bluetooth device \(wanted) not found within \(within) on \(adapter.name): is it switched on, in range, "
                                 + "and advertising (LE) or discoverable (classic)? Give more time with timeout=SECONDS")
        }
        return found
    }
}

/// The notification sessions of one BlueZ client, counted: bluetoothd keeps one StartNotify per
/// D-Bus client and characteristic (a second StartNotify does nothing; the first StopNotify ends it
/// for every user), so the first user starts it and the last one stops it. The calls for one
/// characteristic go out one after the other, in the order the users came: a StopNotify still on
/// its way must not overtake the next user's StartNotify and end it.
actor NotifySessions {
    private var users: [String: Int] = [:]
    /// The last call for each characteristic, which the next one waits for.
    private var last: [String: Task<Result<Void, TransportError>, Never>] = [:]

    /// Starts notifications on `path` unless another user in this process has.
    func start(_ bluez: BlueZ, path: String, about what: String) async throws {
        users[path, default: 0] += 1
        if users[path] == 1 { enqueue(path, Self.starting(bluez, path: path, about: what)) }
        // The start this user joins (its own, or one under way for an earlier user): its outcome.
        let outcome = await last[path]?.value ?? .success(())
        if case .failure(let error) = outcome {
            leave(path)
            throw error
        }
    }

    /// Starts notifications on `path` again for its users, after a reconnect (bluetoothd stopped
    /// them with the link).
    func restart(_ bluez: BlueZ, path: String, about what: String) async throws {
        guard users[path] != nil else { return }
        enqueue(path, Self.starting(bluez, path: path, about: what))
        if case .failure(let error) = await last[path]?.value ?? .success(()) { throw error }
    }

    /// A StartNotify call, as a queued step.
    private static func starting(_ bluez: BlueZ, path: String, about what: String) -> @Sendable () async -> Result<Void, TransportError> {
        {
            do {
                _ = try await bluez.call(path, "org.bluez.GattCharacteristic1", "StartNotify", about: what)
                return .success(())
            } catch let error as TransportError {
                return .failure(error)
            } catch {
                return .failure(TransportError(.io, "\(what): \(error)"))
            }
        }
    }

    /// Leaves; the last user stops them. The StopNotify is sent even when the caller is cancelled.
    func stop(_ bluez: BlueZ, path: String) async {
        guard users[path] != nil else { return }
        guard leave(path) else { return }
        enqueue(path) {
            _ = try? await bluez.call(path, "org.bluez.GattCharacteristic1", "StopNotify", about: "stopping notifications")
            return .success(())
        }
        _ = await last[path]?.value
    }

    /// Counts one user less; `true` when it was the last.
    @discardableResult
    private func leave(_ path: String) -> Bool {
        let remaining = (users[path] ?? 1) - 1
        users[path] = remaining > 0 ? remaining : nil
        return remaining <= 0
    }

    /// Runs `call` after the previous call for `path`, detached (a cancelled caller still sends it).
    private func enqueue(_ path: String, _ call: @escaping @Sendable () async -> Result<Void, TransportError>) {
        let previous = last[path]
        last[path] = Task.detached {
            _ = await previous?.value
            return await call()
        }
    }
}

/// The discovery sessions of one BlueZ client. bluetoothd keeps one session and one filter per
/// D-Bus client and adapter, so overlapping scans in one process share it: StartDiscovery when the
/// first begins, StopDiscovery when the last ends, and a filter that lets through what each wants
/// (every scan also filters for itself).
actor DiscoverySessions {
    private var active: [String: [Int: [String: DBusValue]]] = [:]
    private var next = 0

    /// Joins (or starts) discovery on `adapter` with `filter` (SetDiscoveryFilter's keys); returns
    /// the session to pass to ``stop(_:adapter:session:)``.
    func start(_ bluez: BlueZ, adapter: BluetoothAdapter, filter: [String: DBusValue]) async throws -> Int {
        next += 1
        let session = next
        let idle = active[adapter.path, default: [:]].isEmpty
        active[adapter.path, default: [:]][session] = filter
        do {
            _ = try await bluez.call(adapter.path, BlueZ.adapterInterface, "SetDiscoveryFilter", [.dictionary(merged(adapter.path))],
                                     about: "setting a discovery filter on \(adapter.name)")
            if idle {
                _ = try await bluez.call(adapter.path, BlueZ.adapterInterface, "StartDiscovery", about: "starting discovery on \(adapter.name)")
            }
        } catch {
            active[adapter.path]?[session] = nil
            throw error
        }
        return session
    }

    /// Leaves discovery; the last session to leave stops it. Runs to the end even when the caller is cancelled.
    func stop(_ bluez: BlueZ, adapter: BluetoothAdapter, session: Int) async {
        active[adapter.path]?[session] = nil
        let remaining = active[adapter.path] ?? [:]
        let filter = merged(adapter.path)
        await Task.detached {
            if remaining.isEmpty {
                _ = try? await bluez.call(adapter.path, BlueZ.adapterInterface, "StopDiscovery", about: "stopping discovery on \(adapter.name)")
            } else {
                _ = try? await bluez.call(adapter.path, BlueZ.adapterInterface, "SetDiscoveryFilter", [.dictionary(filter)],
                                          about: "setting a discovery filter on \(adapter.name)")
            }
        }.value
    }

    /// One filter for every session: the only one as it is, or the loosest of several.
    private func merged(_ path: String) -> [String: DBusValue] {
        let filters = Array((active[path] ?? [:]).values)
        guard filters.count > 1 else { return filters.first ?? [:] }
        var merged: [String: DBusValue] = [:]
        let transports = Set(filters.map { $0["Transport"]?.text ?? "auto" })
        merged["Transport"] = .string(transports.count == 1 ? transports.first ?? "auto" : "auto")
        merged["DuplicateData"] = .bool(filters.contains { $0["DuplicateData"]?.boolValue ?? true })
        if filters.allSatisfy({ $0["UUIDs"] != nil }) {
            let uuids = Set(filters.flatMap { $0["UUIDs"]?.strings ?? [] }).sorted()
            merged["UUIDs"] = .array(element: "s", uuids.map { .string($0) })
        }
        if filters.allSatisfy({ $0["RSSI"] != nil }), let weakest = filters.compactMap({ $0["RSSI"]?.integer }).min() {
            merged["RSSI"] = .int16(Int16(clamping: weakest))
        }
        return merged
    }
}
