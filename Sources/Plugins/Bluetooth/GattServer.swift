// GattServer.swift: listening on ble://SERVICE without a PSM: a GATT serial peripheral, the mirror
// of ble://SERVICE/MAC, through bluetoothd's GATT server (BlueZ doc/gatt-api.txt, "GATT Manager
// hierarchy", at 5.66): this process exports an ObjectManager with one GattService1 and its
// GattCharacteristic1 objects, registers it with GattManager1.RegisterApplication, and advertises
// the service (Advertisement.swift) so that centrals find it by service.
//
// Facts this follows (BlueZ 5.66, src/gatt-database.c):
// - A central's subscription (its CCC write) reaches the application as StartNotify; StopNotify
//   comes only when the last subscriber is gone, and not for a bonded central whose link dropped.
//   So the central served is followed through its Device1 object (Connected false, removed) as
//   well. WriteValue carries the value and options: "device" (the central's object path) and
//   "mtu". The written characteristic takes writes without response, so bluetoothd answers every
//   write to the central at once and they reach this process back to back: they are handled in the order they
//   came, on the bus thread (the export's immediate handler), never from tasks that could reorder
//   them.
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
        /// Set when bluetoothd went away (its registration with it): accept() throws it.
        var failure: TransportError?
    }

    let url: TransportURL
    private let bluez: BlueZ
    private let adapter: BluetoothAdapter
    private let root: String
    private let export: DBusExport
    private let advertisement: Advertisement?
    private let state: AsyncCondition<State>
    private let watcher: Task<Void, Never>

    private init(url: TransportURL, bluez: BlueZ, adapter: BluetoothAdapter, root: String, export: DBusExport, advertisement: Advertisement?,
                 state: AsyncCondition<State>, watcher: Task<Void, Never>) {
        self.url = url
        self.bluez = bluez
        self.adapter = adapter
        self.root = root
        self.export = export
        self.advertisement = advertisement
        self.state = state
        self.watcher = watcher
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
        let bluez = try await BlueZ.shared(bus)
        let adapter = try BlueZ.adapter(named: try BluetoothConnector.adapterName(request), among: try await bluez.adapters())
        let root = BlueZ.exportPath("gatt")
        let security = request[BluetoothPlugin.security]
        let objects = Self.objects(root: root, service: service, notify: notify, write: write, security: security)
        let state = AsyncCondition(State())
        let describing = url.description
        let buffering = request.buffering
        let notifyPath = Self.notifyPath(root)
        let writePath = Self.writePath(root, sameCharacteristic: notify == write)
        let connection = bluez.bus
        // The served central's link, its device object, and bluetoothd itself, followed from
        // before the service is published.
        let events = try await bluez.bus.signals(matchingAnyOf: BlueZ.servingMatches(adapter), buffering: .all(limit: GattSession.signalLimit))
        let export = try await bluez.bus.export(path: root, subtree: true) { call in
            Self.handle(call, objects: objects, notifyPath: notifyPath, writePath: writePath, state: state) { central in
                GattServerBackend(bus: connection, notifyPath: notifyPath, describing: describing, central: central, state: state,
                                  watermarks: buffering.inbound)
            }
        }
        let unpublish: @Sendable () async -> Void = {
            await uncancellable {
                _ = try? await bluez.call(adapter.path, "org.bluez.GattManager1", "UnregisterApplication", [.objectPath(root)], about: "withdrawing a GATT service")
                await export.remove()
            }
        }
        do {
            _ = try await bluez.call(adapter.path, "org.bluez.GattManager1", "RegisterApplication", [.objectPath(root), .dictionary([:])],
                                     about: "\(url.shown): publishing GATT service \(BluetoothUUID.short(service)) on \(adapter.name)")
        } catch {
            // Cut short, bluetoothd may have taken it all the same.
            await unpublish()
            throw error
        }
        let advertisement: Advertisement?
        do {
            advertisement = request[BluetoothPlugin.advertise]
                ? try await Advertisement.register(bluez, adapter: adapter, service: service, describing: describing) : nil
        } catch {
            await unpublish()
            throw error
        }
        request.logger.debug("ble listening: GATT service \(BluetoothUUID.short(service)) on \(adapter.name)\(advertisement == nil ? "" : ", advertised")")
        let watcher = Task { await Self.follow(events, state: state, adapter: adapter) }
        let listener = GattServerListener(url: url, bluez: bluez, adapter: adapter, root: root, export: export, advertisement: advertisement,
                                          state: state, watcher: watcher)
        return Listener(url: url, backend: listener, exposure: RFCOMMListener.exposure(security, adapter: adapter.name))
    }

    /// The served central leaving (its link dropped, its device removed) ends its connection;
    /// bluetoothd or the adapter going away ends the listener.
    private static func follow(_ events: AsyncThrowingStream<DBusSignal, any Error>, state: AsyncCondition<State>, adapter: BluetoothAdapter) async {
        var failure = TransportError(.disconnected, "bluetoothd went away while \(adapter.name) served a GATT service: listen again once it is back")
        do {
            for try await signal in events {
                let central = state.withLock { $0.active }
                let path = central?.centralPath
                switch signal.member {
                case "NameOwnerChanged" where signal.values.last?.text == "":
                    throw failure
                case "InterfacesRemoved":
                    guard let removed = signal.values.first?.text else { continue }
                    if removed == adapter.path, signal.values.dropFirst().first?.strings?.contains(BlueZ.adapterInterface) == true {
                        failure = TransportError(.disconnected, "adapter \(adapter.name) went away while it served a GATT service")
                        throw failure
                    }
                    if let path, removed == path { central?.centralLeft() }
                case "PropertiesChanged":
                    if let path, signal.path == path, signal.values.dropFirst().first?.dictionary?["Connected"]?.boolValue == false {
                        central?.centralLeft()
                    }
                default:
                    continue
                }
            }
        } catch is CancellationError {
            return
        } catch {}
        guard !Task.isCancelled else { return }
        let (active, waiting) = state.update { state in
            defer { if state.failure == nil { state.failure = failure }; state.waiting = []; state.active = nil }
            return (state.active, state.waiting)
        }
        for backend in waiting + [active].compactMap({ $0 }) { backend.centralLeft() }
    }

    /// The notified characteristic's object path; the written one's is the same for one
    /// characteristic both ways (HM-10).
    static func notifyPath(_ root: String) -> String { root + "/service0/char0" }
    static func writePath(_ root: String, sameCharacteristic: Bool) -> String { sameCharacteristic ? notifyPath(root) : root + "/service0/char1" }

    /// The application's objects: one service, and either one characteristic both ways (HM-10) or
    /// two; with security=medium or high, BlueZ's encrypt-* or encrypt-authenticated-* flags too,
    /// so a central pairs before it writes or subscribes.
    static func objects(root: String, service: String, notify: String, write: String,
                        security: BluetoothSocket.Security = .low) -> [String: [String: [String: DBusValue]]] {
        let servicePath = root + "/service0"
        let level: GATTServer.Security = switch security {
        case .low: .none
        case .medium: .encrypted
        case .high: .authenticated
        }
        let characteristic = { (uuid: String, properties: GATTServer.Properties) -> [String: [String: DBusValue]] in
            [GattSerial.characteristicInterface: ["UUID": .string(uuid), "Service": .objectPath(servicePath),
                                                  "Flags": .array(element: "s", GATTServer.Core.flags(properties, level).map { .string($0) })]]
        }
        var objects: [String: [String: [String: DBusValue]]] = [
            servicePath: [GattSerial.serviceInterface: ["UUID": .string(service), "Primary": .bool(true)]],
        ]
        if notify == write {
            objects[notifyPath(root)] = characteristic(notify, [.notify, .write, .writeWithoutResponse])
        } else {
            objects[notifyPath(root)] = characteristic(notify, .notify)
            objects[writePath(root, sameCharacteristic: false)] = characteristic(write, [.write, .writeWithoutResponse])
        }
        return objects
    }

    /// One call from bluetoothd to the application, on the bus thread, in the order the calls came.
    fileprivate static func handle(_ call: DBusMethodCall, objects: [String: [String: [String: DBusValue]]], notifyPath: String, writePath: String,
                                   state: AsyncCondition<State>, makeBackend: (String?) -> GattServerBackend) -> DBusMethodResult {
        if let served = BlueZ.serve(call, from: objects) { return served }
        switch (call.interface, call.member) {
        case (GattSerial.characteristicInterface, "StartNotify") where call.path == notifyPath:
            // A central subscribed: it is served, unless another one is.
            state.update { state in
                guard !state.closed, state.failure == nil, state.active == nil else { return }
                let backend = makeBackend(nil)
                state.active = backend
                // Centrals that came and went while nobody accepted are dropped here, not only in
                // accept(): one that subscribes and unsubscribes in a loop must not pile them up.
                state.waiting.removeAll { $0.hasEnded }
                state.waiting.append(backend)
            }
            return .reply([])
        case (GattSerial.characteristicInterface, "StopNotify") where call.path == notifyPath:
            // The last subscriber went.
            state.withLock { $0.active }?.centralLeft()
            return .reply([])
        case (GattSerial.characteristicInterface, "WriteValue") where call.path == writePath:
            let value = call.arguments.first?.bytes ?? []
            let options = call.arguments.dropFirst().first?.dictionary ?? [:]
            let central = options["device"]?.text
            let backend = state.update { state -> GattServerBackend? in
                if let active = state.active {
                    // Another central's write (one that subscribed while this one is served) is
                    // not this connection's: it is dropped (bluetoothd has acknowledged it).
                    return active.owns(central) ? active : nil
                }
                // A central that writes before (or without) subscribing is served too.
                guard !state.closed, state.failure == nil else { return nil }
                let backend = makeBackend(central)
                state.active = backend
                state.waiting.removeAll { $0.hasEnded }
                state.waiting.append(backend)
                return backend
            }
            backend?.received(value, mtu: options["mtu"]?.integer.map { Int($0) })
            return .reply([])
        case (GattSerial.characteristicInterface, "ReadValue"):
            return .reply([.bytes([])])
        default:
            return .notHandled
        }
    }

    func accept() async throws -> Connection? {
        let next = try await state.wait(until: { state -> Result<GattServerBackend?, TransportError>? in
            // A central that left before it was accepted is skipped.
            state.waiting.removeAll { $0.hasEnded }
            if !state.waiting.isEmpty { return .success(state.waiting.removeFirst()) }
            if let failure = state.failure { return .failure(failure) }
            return state.closed ? .success(nil) : nil
        })
        guard let backend = try next.get() else { return nil }
        await backend.learnCentral(bluez: bluez, adapter: adapter)
        var metadata = ConnectionMetadata(name: nil, localAddress: adapter.address, remoteAddress: backend.centralPath.map(BlueZ.address(inDevicePath:)))
        metadata.extra["adapter"] = adapter.name
        metadata.maximumWriteSize = backend.maximumWriteSize
        return Connection(url: url, backend: backend, metadata: metadata)
    }

    /// Stops serving: the service is withdrawn, and the central being served is disconnected from it.
    func close() async throws {
        guard let withdraw = stop() else { return }
        await uncancellable(withdraw)
    }

    deinit {
        // Dropped without close(): the connections end, the service is withdrawn in the background.
        guard let withdraw = stop() else { return }
        startCleanup(withdraw)
    }

    /// Marks the listener closed and ends its connections, once; returns what withdraws the
    /// service and the advertisement (nil when it was closed already).
    private func stop() -> (@Sendable () async -> Void)? {
        let (first, active, waiting) = state.update { state in
            defer { state.closed = true; state.waiting = []; state.active = nil }
            return (!state.closed, state.active, state.waiting)
        }
        guard first else { return nil }
        watcher.cancel()
        for backend in waiting + [active].compactMap({ $0 }) { backend.centralLeft() }
        let (bluez, adapter, root, export, advertisement) = (bluez, adapter, root, export, advertisement)
        return {
            await advertisement?.unregister()
            _ = try? await bluez.call(adapter.path, "org.bluez.GattManager1", "UnregisterApplication", [.objectPath(root)], about: "withdrawing a GATT service")
            await export.remove()
        }
    }
}

/// The central being served by a ``GattServerListener``: its writes in, notifications out, each
/// one message. It ends when the central unsubscribes, its link drops or its device goes.
final class GattServerBackend: ConnectionBackend {
    let supportsHalfClose = false
    let carriesMessages = true
    private let bus: DBusConnection
    private let notifyPath: String
    private let describing: String
    private let inbound: InboundQueue
    private let listenerState: AsyncCondition<GattServerListener.State>
    private let central = Locked<(path: String?, mtu: Int?, ended: Bool)>((nil, nil, false))

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

    /// Not known: bluetoothd queues notifications for the central.
    var unsentByteCount: Int? { nil }

    /// The central's device object path, once known.
    var centralPath: String? { central.withLock { $0.path } }

    var hasEnded: Bool { central.withLock { $0.ended } }

    /// Whether a write from `device` (its object path, when bluetoothd said) is this central's:
    /// the first one known becomes it.
    func owns(_ device: String?) -> Bool {
        central.withLock { state in
            guard let device else { return true }
            if state.path == nil { state.path = device }
            return state.path == device
        }
    }

    /// A write from the central (on bluetoothd's behalf). GATT writes have no flow control: past
    /// twice the high watermark unread, the connection fails rather than grow (later writes are
    /// dropped by the failed queue), as a GATT serial client's notifications do.
    func received(_ value: [UInt8], mtu: Int?) {
        if let mtu { central.withLock { $0.mtu = mtu } }
        if inbound.append(ByteBuffer(bytes: value)) == .pause, inbound.bufferedBytes >= 2 * inbound.watermarks.high {
            inbound.fail(TransportError(.io, "\(describing): the central wrote more than \(2 * inbound.watermarks.high) bytes that waited unread: "
                                        + "GATT writes have no flow control, so the application must read as fast as the central writes"))
        }
    }

    /// The central unsubscribed or went away: reads end after what it wrote.
    func centralLeft() {
        central.withLock { $0.ended = true }
        inbound.finish()
        listenerState.update { state in if state.active === self { state.active = nil } }
    }

    /// When the central subscribed without writing yet, the one device connected on the adapter
    /// is taken as it (bluetoothd's StartNotify does not say which device), so that its leaving is seen.
    func learnCentral(bluez: BlueZ, adapter: BluetoothAdapter) async {
        guard centralPath == nil, let tree = try? await bluez.objectTree(about: "finding the central") else { return }
        let connected = tree.devices.filter { $0.key.hasPrefix(adapter.path + "/") && $0.value["Connected"]?.boolValue == true }
        guard connected.count == 1, let path = connected.first?.key else { return }
        central.withLock { if $0.path == nil { $0.path = path } }
    }

    func read() async throws -> ByteBuffer? { try await inbound.next() }

    func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        try await inbound.next(deadline: deadline).map { TransportMessage(.binary, $0) }
    }

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
