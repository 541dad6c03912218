// GattServer.swift: listening on ble://SERVICE without a PSM: a GATT serial peripheral, the mirror
// of ble://SERVICE/MAC, through bluetoothd's GATT server (BlueZ doc/gatt-api.txt, "GATT Manager
// hierarchy", at 5.66): this process exports an ObjectManager with one GattService1 and its
// GattCharacteristic1 objects, registers it with GattManager1.RegisterApplication, and advertises
// the service (Advertisement.swift) so that centrals find it by service.
//
// Facts this follows (BlueZ 5.66, src/gatt-database.c):
// - A central's subscription (its CCC write) reaches the application as StartNotify, its end (an
//   unsubscribe, or the link dropping: subscriptions of unbonded devices are cleared) as
//   StopNotify. WriteValue carries the value and options: "device" (the central's object path),
//   "mtu", "type" (command or request).
// - A value is sent by emitting PropertiesChanged on the characteristic's Value: bluetoothd
//   notifies every central subscribed. The D-Bus API of 5.66 has no way to notify one central
//   among several, so the listener serves one central at a time: a second central that subscribes
//   while one is connected would see the first one's bytes, and gets no connection (documented).
// - A notification carries at most ATT MTU − 3 bytes; bluetoothd cuts longer ones. The MTU is
//   known from the central's first write ("mtu"); until then writes are cut to 20 bytes, and
//   never past 510 (GattSerial.writeSize: BlueZ 5.66 lost 514-byte values).

import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus
import NIOCore

/// Accepts the central that subscribes to (or writes) a GATT serial service this process publishes.
final class GattServerListener: ListenerBackend {
    fileprivate struct State {
        var waiting: [GattServerBackend] = []
        /// The central being served.
        var active: GattServerBackend?
        var closed = false
    }

    private static let serial = Atomic<Int>(0)

    let url: TransportURL
    private let bluez: BlueZ
    private let adapter: BluetoothAdapter
    private let root: String
    private let export: DBusExport
    private let advertisement: Advertisement?
    private let state: AsyncCondition<State>
    private let buffering: Buffering

    private init(url: TransportURL, bluez: BlueZ, adapter: BluetoothAdapter, root: String, export: DBusExport, advertisement: Advertisement?,
                 state: AsyncCondition<State>, buffering: Buffering) {
        self.url = url
        self.bluez = bluez
        self.adapter = adapter
        self.root = root
        self.export = export
        self.advertisement = advertisement
        self.state = state
        self.buffering = buffering
    }

    /// The characteristics of the service: the one notified to the central (the central's rx) and
    /// the one it writes (its tx), as the URL names them for a connect, so one URL serves both ends.
    static func characteristics(_ request: ConnectRequest) throws -> (service: String, notify: String, write: String) {
        let wanted = try GattSerial.service(request)
        guard let notify = try GattSerial.characteristicOption(request, BluetoothPlugin.rx) ?? wanted.rx,
              let write = try GattSerial.characteristicOption(request, BluetoothPlugin.tx) ?? wanted.tx else {
            throw TransportError(.invalidURL, "\(request.url.shown): a GATT serial peripheral of service \(BluetoothUUID.short(wanted.uuid)) needs its characteristics "
                                 + "named: rx=UUID (notified to the central) and tx=UUID (written by it), as a connect to it names them")
        }
        return (wanted.uuid, notify, write)
    }

    @Sendable static func listen(_ request: ConnectRequest, bus: DBusConnection.Bus) async throws -> Listener {
        let url = request.url
        guard url.path.drop(while: { $0 == "/" }).isEmpty else {
            throw TransportError(.invalidURL, "\(url.shown): a listener takes no device; choose the adapter with adapter=hciN: ble://\(request.host)")
        }
        let (service, notify, write) = try characteristics(request)
        let bluez = try BlueZ.shared(bus)
        let adapter = try BlueZ.adapter(named: try BluetoothConnector.adapterName(request), among: try await bluez.adapters())
        let root = "/org/transportkit/gatt\(serial.add(1, ordering: .relaxed).newValue)"
        let objects = Self.objects(root: root, service: service, notify: notify, write: write)
        let state = AsyncCondition(State())
        let describing = url.description
        let buffering = request.buffering
        let notifyPath = Self.notifyPath(root)
        let writePath = Self.writePath(root, sameCharacteristic: notify == write)
        let connection = bluez.bus
        let export = try await bluez.bus.export(path: root, subtree: true, answering: { call in
            await Self.handle(call, objects: objects, notifyPath: notifyPath, writePath: writePath, state: state) { central in
                GattServerBackend(bus: connection, notifyPath: notifyPath, describing: describing, central: central, state: state,
                                  watermarks: buffering.inbound)
            }
        })
        do {
            _ = try await bluez.call(adapter.path, "org.bluez.GattManager1", "RegisterApplication", [.objectPath(root), .dictionary([:])],
                                     about: "\(url.shown): publishing GATT service \(BluetoothUUID.short(service)) on \(adapter.name)")
        } catch {
            await export.remove()
            throw error
        }
        let advertisement: Advertisement?
        do {
            advertisement = request[BluetoothPlugin.advertise]
                ? try await Advertisement.register(bluez, adapter: adapter, service: service, describing: describing) : nil
        } catch {
            _ = try? await bluez.call(adapter.path, "org.bluez.GattManager1", "UnregisterApplication", [.objectPath(root)], about: "withdrawing a GATT service")
            await export.remove()
            throw error
        }
        request.logger.debug("ble listening: GATT service \(BluetoothUUID.short(service)) on \(adapter.name)\(advertisement == nil ? "" : ", advertised")")
        let listener = GattServerListener(url: url, bluez: bluez, adapter: adapter, root: root, export: export, advertisement: advertisement,
                                          state: state, buffering: buffering)
        return Listener(url: url, backend: listener, exposure: RFCOMMListener.exposure(.low, adapter: adapter.name))
    }

    /// The notified characteristic's object path; the written one's is the same for one
    /// characteristic both ways (HM-10).
    static func notifyPath(_ root: String) -> String { root + "/service0/char0" }
    static func writePath(_ root: String, sameCharacteristic: Bool) -> String { sameCharacteristic ? notifyPath(root) : root + "/service0/char1" }

    /// The application's objects: one service, and either one characteristic both ways (HM-10) or two.
    static func objects(root: String, service: String, notify: String, write: String) -> [String: [String: [String: DBusValue]]] {
        let servicePath = root + "/service0"
        let characteristic = GattSerial.characteristicInterface
        let writeFlags: [DBusValue] = [.string("write-without-response"), .string("write")]
        var objects: [String: [String: [String: DBusValue]]] = [
            servicePath: [GattSerial.serviceInterface: ["UUID": .string(service), "Primary": .bool(true)]],
        ]
        if notify == write {
            objects[notifyPath(root)] = [characteristic: [
                "UUID": .string(notify), "Service": .objectPath(servicePath), "Flags": .array(element: "s", [.string("notify")] + writeFlags)]]
        } else {
            objects[notifyPath(root)] = [characteristic: [
                "UUID": .string(notify), "Service": .objectPath(servicePath), "Flags": .array(element: "s", [.string("notify")])]]
            objects[writePath(root, sameCharacteristic: false)] = [characteristic: [
                "UUID": .string(write), "Service": .objectPath(servicePath), "Flags": .array(element: "s", writeFlags)]]
        }
        return objects
    }

    /// One call from bluetoothd to the application.
    fileprivate static func handle(_ call: DBusMethodCall, objects: [String: [String: [String: DBusValue]]], notifyPath: String, writePath: String,
                       state: AsyncCondition<State>, makeBackend: @Sendable (String?) -> GattServerBackend) async -> DBusMethodResult {
        switch (call.interface, call.member) {
        case ("org.freedesktop.DBus.ObjectManager", "GetManagedObjects"):
            let entries = objects.sorted { $0.key < $1.key }.map { path, interfaces in
                DBusValue.dictEntry(.objectPath(path), .array(element: "{sa{sv}}", interfaces.sorted { $0.key < $1.key }.map {
                    .dictEntry(.string($0.key), .dictionary($0.value))
                }))
            }
            return .reply([.array(element: "{oa{sa{sv}}}", entries)])
        case ("org.freedesktop.DBus.Properties", "GetAll"):
            guard let interface = call.arguments.first?.text else { return .reply([.dictionary([:])]) }
            return .reply([.dictionary(objects[call.path]?[interface] ?? [:])])
        case ("org.freedesktop.DBus.Properties", "Get"):
            guard let interface = call.arguments.first?.text, let name = call.arguments.dropFirst().first?.text,
                  let value = objects[call.path]?[interface]?[name] else {
                return .error(name: "org.freedesktop.DBus.Error.InvalidArgs", message: "no such property")
            }
            return .reply([.variant(value)])
        case (GattSerial.characteristicInterface, "StartNotify") where call.path == notifyPath:
            // A central subscribed: it is served, unless another one is.
            state.update { state in
                guard !state.closed, state.active == nil else { return }
                let backend = makeBackend(nil)
                state.active = backend
                state.waiting.append(backend)
            }
            return .reply([])
        case (GattSerial.characteristicInterface, "StopNotify") where call.path == notifyPath:
            state.withLock { $0.active }?.centralLeft()
            return .reply([])
        case (GattSerial.characteristicInterface, "WriteValue") where call.path == writePath:
            let value = call.arguments.first?.bytes ?? []
            let options = call.arguments.dropFirst().first?.dictionary ?? [:]
            let central = options["device"]?.text
            let backend = state.update { state -> GattServerBackend? in
                if let active = state.active { return active }
                // A central that writes before (or without) subscribing is served too.
                guard !state.closed else { return nil }
                let backend = makeBackend(central)
                state.active = backend
                state.waiting.append(backend)
                return backend
            }
            backend?.received(value, central: central, mtu: options["mtu"]?.integer.map { Int($0) })
            return .reply([])
        case (GattSerial.characteristicInterface, "ReadValue"):
            return .reply([.bytes([])])
        default:
            return .notHandled
        }
    }

    func accept() async throws -> Connection? {
        guard let backend = try await state.wait(until: { state -> GattServerBackend?? in
            if !state.waiting.isEmpty { return .some(state.waiting.removeFirst()) }
            return state.closed ? .some(nil) : nil
        }) else { return nil }
        let central = await backend.centralAddress(bluez: bluez, adapter: adapter)
        var metadata = ConnectionMetadata(name: nil, localAddress: adapter.address, remoteAddress: central)
        metadata.extra["adapter"] = adapter.name
        metadata.mtu = backend.maximumWriteSize
        return Connection(url: url, backend: backend, metadata: metadata)
    }

    /// Stops serving: the service is withdrawn, and the central being served is disconnected from it.
    func close() async throws {
        let (first, active, waiting) = state.update { state in
            defer { state.closed = true; state.waiting = []; state.active = nil }
            return (!state.closed, state.active, state.waiting)
        }
        guard first else { return }
        for backend in waiting + [active].compactMap({ $0 }) { backend.centralLeft() }
        let (bluez, adapter, root, export, advertisement) = (bluez, adapter, root, export, advertisement)
        await uncancellable {
            await advertisement?.unregister()
            _ = try? await bluez.call(adapter.path, "org.bluez.GattManager1", "UnregisterApplication", [.objectPath(root)], about: "withdrawing a GATT service")
            await export.remove()
        }
    }

    deinit {
        guard !state.withLock({ $0.closed }) else { return }
        let (bluez, adapter, root, export, advertisement) = (bluez, adapter, root, export, advertisement)
        Task.detached {
            await advertisement?.unregister()
            _ = try? await bluez.call(adapter.path, "org.bluez.GattManager1", "UnregisterApplication", [.objectPath(root)], about: "withdrawing a GATT service")
            await export.remove()
        }
    }
}

/// The central being served by a ``GattServerListener``: its writes in, notifications out, each
/// one message. It ends when the central unsubscribes or its link drops (StopNotify).
final class GattServerBackend: ConnectionBackend {
    let supportsHalfClose = false
    let carriesMessages = true
    private let bus: DBusConnection
    private let notifyPath: String
    private let describing: String
    private let inbound: InboundQueue
    private let listenerState: AsyncCondition<GattServerListener.State>
    private let central = Mutex<(path: String?, mtu: Int?, ended: Bool)>((nil, nil, false))

    fileprivate init(bus: DBusConnection, notifyPath: String, describing: String, central: String?, state: AsyncCondition<GattServerListener.State>,
                     watermarks: InboundQueue.Watermarks) {
        self.bus = bus
        self.notifyPath = notifyPath
        self.describing = describing
        self.listenerState = state
        inbound = InboundQueue(watermarks: watermarks, messages: true)
        self.central.withLock { $0.path = central }
    }

    /// ATT MTU − 3 once the central's first write said the MTU (at most BlueZ 5.66's 510, as for
    /// GATT serial's writes), else 20.
    var maximumWriteSize: Int? { GattSerial.writeSize(attMTU: central.withLock { $0.mtu } ?? 23) }

    /// A central's write never waits: GATT has no flow control towards a peripheral either.
    var unsentByteCount: Int? { 0 }

    /// A write from the central (on bluetoothd's behalf).
    func received(_ value: [UInt8], central path: String?, mtu: Int?) {
        central.withLock { state in
            if state.path == nil { state.path = path }
            if let mtu { state.mtu = mtu }
        }
        _ = inbound.append(ByteBuffer(bytes: value))
    }

    /// The central unsubscribed or went away: reads end after what it wrote.
    func centralLeft() {
        central.withLock { $0.ended = true }
        inbound.finish()
        listenerState.update { state in if state.active === self { state.active = nil } }
    }

    /// The central's address, from its first write, or the one device connected on the adapter.
    func centralAddress(bluez: BlueZ, adapter: BluetoothAdapter) async -> String? {
        if let path = central.withLock({ $0.path }) { return BlueZ.address(inDevicePath: path) }
        guard let tree = try? await bluez.objectTree(about: "finding the central") else { return nil }
        let connected = tree.devices.filter { $0.key.hasPrefix(adapter.path + "/") && $0.value["Connected"]?.boolValue == true }
        return connected.count == 1 ? connected.first.map { BlueZ.address(inDevicePath: $0.key) } : nil
    }

    func read() async throws -> ByteBuffer? { try await inbound.next() }

    func write(_ buffer: ByteBuffer) async throws {
        if central.withLock({ $0.ended }) {
            throw TransportError(.disconnected, "\(describing): the central unsubscribed or disconnected")
        }
        try await bus.emitSignal(path: notifyPath, interface: GattSerial.properties, member: "PropertiesChanged",
                                 [.string(GattSerial.characteristicInterface), .dictionary(["Value": .bytes(Array(buffer.readableBytesView))]),
                                  .array(element: "s", [])])
    }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "ble:// GATT serial cannot half-close (GATT has no end of stream); close the connection instead")
    }

    /// Stops serving this central (the next one that subscribes is accepted); the link is the central's to drop.
    func close() async throws { centralLeft() }
}
