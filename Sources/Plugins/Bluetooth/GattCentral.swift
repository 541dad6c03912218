// GattCentral.swift: a GATT central through bluetoothd's GATT client (BlueZ doc/gatt-api.txt and
// device-api.txt at 5.66: Device1.Connect, GattService1, GattCharacteristic1 ReadValue, WriteValue,
// StartNotify, GattDescriptor1), as Bluejay offers it on iOS: a peripheral object with its
// services, reads, writes and notifications, operations on one device in order, and its
// connection's events. ble://SERVICE/MAC (GATT serial) opens its link the same way (GattSession).
//
// Facts this follows (BlueZ 5.66, src/gatt-client.c and src/device.c):
// - WriteValue with type "request" does a long write (Prepare/Execute Write) when the value is
//   longer than MTU − 3; ATT values are at most 512 bytes. "command" (without response) carries at
//   most MTU − 3 and is not acknowledged by the device.
// - A characteristic that needs encryption answers an ATT error; BlueZ's client raises the link's
//   security and retries, which pairs, which needs an agent: without one the call fails with
//   org.bluez.Error.Failed or NotPermitted and the ATT error in its text.
// - Device1's PropertiesChanged says Connected false when the link drops, and ServicesResolved
//   false then true when the device's services change (Service Changed indication): the objects
//   are removed and added again in between.
// - One LE connection attempt at a time per adapter (the kernel answers Busy for a second
//   Connect while one is in progress): connects in this process wait their turn.

import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus

/// An LE link to a device with its services resolved: where GATT serial and the central begin.
///
/// Why the tree is read after ServicesResolved and not followed from signals: bluetoothd (gdbus)
/// sends each object's changes from an idle callback of its own, so the device's ServicesResolved
/// can reach the bus before the InterfacesAdded of the services it announces (seen in the lab:
/// a connect found "no GATT service" that way). The objects are registered by then, so a
/// GetManagedObjects after ServicesResolved has them all.
struct GattSession: Sendable {
    let bluez: BlueZ
    let adapter: BluetoothAdapter
    let device: BluetoothDevice
    let objects: BlueZObjects
    /// bluetoothd's ObjectManager signals and every device's PropertiesChanged on the adapter, from
    /// before the device was first asked for: the caller keeps reading them (those that came
    /// before `objects` was read are already in it, and applying them again changes nothing).
    let events: AsyncThrowingStream<DBusSignal, any Error>
    let link: GattLink
    /// Where the connect spent its time, step by step.
    let steps: [GATTConnectStep]

    /// How many of bluetoothd's signals may wait unread during a connect (the caller reads them
    /// from then on): other devices' changes count too, and a scan with duplicates in a crowded
    /// room sends hundreds a second.
    static let signalLimit = 16384

    /// Connects to `address` over LE (or takes the link that is up) and waits until bluetoothd has
    /// read its services, all within `deadline`. bluetoothd's whole object tree is read once, after
    /// the services were resolved; before that only the adapters (Introspect) and the device
    /// (GetAll) are asked for, after subscribing to their changes.
    static func open(bus: DBusConnection.Bus, address: BluetoothAddress, adapterName: String?, deadline: ContinuousClock.Instant?,
                     timeout: Duration?, what: String) async throws -> GattSession {
        let bluez = try await BlueZ.shared(bus)
        var steps: [GATTConnectStep] = []
        var mark = ContinuousClock.now
        func step(_ name: String) {
            let now = ContinuousClock.now
            steps.append(GATTConnectStep(name: name, duration: now - mark))
            mark = now
        }
        let named = adapterName.flatMap { $0.hasPrefix("hci") ? "/org/bluez/\($0)" : nil }
        let events = try await bluez.bus.signals(matchingAnyOf: [
            DBusMatch(sender: BlueZ.service, interface: BlueZ.objectManager),
            DBusMatch(sender: BlueZ.service, pathNamespace: named ?? "/org/bluez", interface: GattSerial.properties, member: "PropertiesChanged",
                      arg0: BlueZ.deviceInterface),
            // bluetoothd leaving the bus (stopped, crashed): no InterfacesRemoved comes then.
            DBusMatch(sender: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                      member: "NameOwnerChanged", arg0: BlueZ.service),
        ], buffering: .all(limit: signalLimit))
        step("subscribing to bluetoothd's signals")
        var adapter = try BlueZ.adapter(named: adapterName, among: try await bluez.adapters())
        let devicePath = BlueZ.devicePath(on: adapter, address: address.description)
        let known = try await bluez.device(at: devicePath)
        step("finding the adapter and the device")
        var device: BluetoothDevice
        let link: GattLink
        if let known, known.connected {
            device = known
            link = GattLink(bluez: bluez, device: device, address: address, disconnectOnClose: false)
        } else {
            // One LE connect at a time on an adapter (see the header); the discovery and the
            // Connect together, so that Connect takes the bearer just seen.
            let (found, madeLink) = try await bluez.connectTurns.inTurn(adapter.path) { () async throws -> (BluetoothDevice, Bool) in
                step("waiting for the adapter's turn")
                // Seen over LE right now, so that Connect takes LE (GattSerial.swift's header).
                let found = try await bluez.discover(address: address.description, on: adapter, transport: "le", deadline: deadline,
                                                     timeout: timeout, freshSighting: known != nil)
                step("discovery")
                // Connected by another program meanwhile: its link, left up on close.
                guard !found.connected else { return (found, false) }
                // No reply timeout before the deadline: the one enforced around this (the registry's, or
                // BluetoothPeripheral.connect's) reports the timeout.
                let replyTimeout = BluetoothConnector.replyTimeout(enforcedBy: deadline, otherwise: nil)
                do {
                    _ = try await bluez.call(found.path, BlueZ.deviceInterface, "Connect", timeout: replyTimeout,
                                             about: "connecting to Bluetooth device \(address) over LE")
                } catch {
                    // Cut short (the deadline, a cancellation): bluetoothd may still be connecting,
                    // and Disconnect cancels that, so no link is left that nobody owns. Another
                    // failure (one of another program's connects under way, say) is left alone.
                    if error is CancellationError || (error as? TransportError)?.kind == .timedOut {
                        await GattLink(bluez: bluez, device: found, address: address, disconnectOnClose: true).release()
                    }
                    throw error
                }
                step("Connect")
                return (found, true)
            }
            device = found
            link = GattLink(bluez: bluez, device: device, address: address, disconnectOnClose: madeLink)
        }
        let objects: BlueZObjects
        do {
            try await waitForServices(device, bluez: bluez, events: events, what: what)
            step("services resolved")
            objects = try await bluez.objectTree(about: "reading the GATT services of Bluetooth device \(address)")
            step("reading the object tree")
        } catch {
            await link.release()
            throw error
        }
        device = objects.device(at: device.path) ?? device
        adapter = objects.adapters.first { $0.path == adapter.path } ?? adapter
        return GattSession(bluez: bluez, adapter: adapter, device: device, objects: objects, events: events, link: link, steps: steps)
    }

    /// The signal says the device's link dropped (Connected false), or the device or its adapter
    /// went away.
    static func endsLink(_ signal: DBusSignal, devicePath: String) -> Bool {
        switch signal.member {
        case "PropertiesChanged":
            return signal.path == devicePath && signal.values.dropFirst().first?.dictionary?["Connected"]?.boolValue == false
        case "InterfacesRemoved":
            // The device object, or its adapter's (a profile interface going is not the end).
            guard case .objectPath(let path)? = signal.values.first, let removed = signal.values.dropFirst().first?.strings else { return false }
            return (devicePath == path && removed.contains(BlueZ.deviceInterface))
                || (devicePath.hasPrefix(path + "/") && removed.contains(BlueZ.adapterInterface))
        case "NameOwnerChanged":
            // bluetoothd left the bus: its new owner is empty.
            return signal.values.first?.text == BlueZ.service && signal.values.last?.text == ""
        default:
            return false
        }
    }

    /// Whether the link is down now: a signal that said so may be from before this connect (the
    /// subscription comes first), so bluetoothd is asked. Down too when it cannot answer.
    static func linkIsDown(_ bluez: BlueZ, devicePath: String) async -> Bool {
        guard let device = (try? await bluez.device(at: devicePath)) ?? nil else { return true }
        return !device.connected
    }

    /// Waits until bluetoothd has read the device's services (ServicesResolved), or the link drops.
    /// `events` was subscribed to before this asks, so a change right after the answer is not missed.
    static func waitForServices(_ device: BluetoothDevice, bluez: BlueZ, events: AsyncThrowingStream<DBusSignal, any Error>,
                                what: String) async throws {
        if try await bluez.device(at: device.path)?.servicesResolved == true { return }
        // A signal may be from before this connect (the subscription came first): each one that
        // would decide is checked with bluetoothd.
        for try await signal in events {
            if endsLink(signal, devicePath: device.path) {
                guard await linkIsDown(bluez, devicePath: device.path) else { continue }
                throw TransportError(.disconnected, "\(what): Bluetooth device \(device.address) disconnected (or bluetoothd removed it) "
                                     + "before its services were read")
            }
            guard signal.member == "PropertiesChanged", signal.path == device.path,
                  signal.values.dropFirst().first?.dictionary?["ServicesResolved"]?.boolValue == true else { continue }
            if try await bluez.device(at: device.path)?.servicesResolved == true { return }
        }
        try Task.checkCancellation()
        throw TransportError(.disconnected, "\(what): Bluetooth device \(device.address) went away before its services were read")
    }
}

/// One step of a connect and how long it took: ``BluetoothPeripheral/connectSteps``.
public struct GATTConnectStep: Sendable, Hashable {
    /// `discovery`, `Connect`, `services resolved`, …
    public let name: String
    /// How long the step took, measured with the continuous clock.
    public let duration: Duration
}

/// Turns per key (an adapter's path): one holder at a time, the others in the order they came.
final class KeyedTurns: Sendable {
    private let taken = AsyncCondition<Set<String>>([])

    func inTurn<T: Sendable>(_ key: String, _ body: () async throws -> T) async throws -> T {
        try await taken.wait { (taken: inout Set<String>) -> Void? in taken.insert(key).inserted ? () : nil }
        defer { taken.update { _ = $0.remove(key) } }
        return try await body()
    }
}

// MARK: - The central's view of a device

/// A GATT descriptor of a characteristic.
public struct GATTDescriptor: Sendable, Hashable, Encodable {
    /// 128-bit, lower case.
    public var uuid: String
    /// BlueZ's flags: `read`, `write`, `encrypt-read`, …
    public var flags: [String]
    let path: String

    private enum CodingKeys: String, CodingKey { case uuid, flags }

    /// The UUID in its short form where it is on the Bluetooth base (`2901`).
    public var shortUUID: String { BluetoothUUID.short(uuid) }
}

/// A GATT characteristic of a connected device.
public struct GATTCharacteristic: Sendable, Hashable, Encodable {
    /// 128-bit, lower case (`00002a19-0000-1000-8000-00805f9b34fb` for Battery Level).
    public var uuid: String
    /// The UUID of the service it belongs to.
    public var service: String
    /// BlueZ's flags (the characteristic's properties and permissions): `read`, `write`,
    /// `write-without-response`, `notify`, `indicate`, `encrypt-read`, …
    public var flags: [String]
    /// Its descriptors, as bluetoothd found them.
    public var descriptors: [GATTDescriptor]
    let path: String

    private enum CodingKeys: String, CodingKey { case uuid, service, flags, descriptors }

    /// Whether the flags include `read` (plain: an `encrypt-read` alone does not count).
    public var canRead: Bool { flags.contains("read") }
    /// Whether some access needs an encrypted link (`encrypt-…`, `encrypt-authenticated-…`, `secure-…`).
    var needsSecurity: Bool { flags.contains { $0.hasPrefix("encrypt-") || $0.hasPrefix("secure-") } }
    /// Whether the flags include `write` (a write with response).
    public var canWrite: Bool { flags.contains("write") }
    /// Whether the flags include `write-without-response`.
    public var canWriteWithoutResponse: Bool { flags.contains("write-without-response") }
    /// Notifies or indicates.
    public var canNotify: Bool { flags.contains("notify") || flags.contains("indicate") }
    /// The UUID in its short form where it is on the Bluetooth base (`2a19`).
    public var shortUUID: String { BluetoothUUID.short(uuid) }
}

/// A GATT service of a connected device.
public struct GATTService: Sendable, Hashable, Encodable {
    /// 128-bit, lower case.
    public var uuid: String
    /// Whether it is a primary service (BlueZ's `Primary`); false for a secondary one.
    public var isPrimary: Bool
    /// Its characteristics, as bluetoothd resolved them.
    public var characteristics: [GATTCharacteristic]
    let path: String

    private enum CodingKeys: String, CodingKey { case uuid, isPrimary, characteristics }

    /// The UUID in its short form where it is on the Bluetooth base (`180f`).
    public var shortUUID: String { BluetoothUUID.short(uuid) }
}

/// How a value is written.
public enum GATTWriteType: String, Sendable, CaseIterable {
    /// Acknowledged by the device; values longer than one packet go as a long write (up to 512 bytes).
    case withResponse
    /// Not acknowledged; at most ATT MTU − 3 bytes.
    case withoutResponse
}

/// When ``BluetoothPeripheral/write(_:to:service:type:thenCollectFrom:until:timeout:)`` stops collecting.
public enum GATTCollect: Sendable, Hashable, CustomStringConvertible {
    /// Once this many bytes arrived (more in the last notification are kept).
    case count(Int)
    /// Once these bytes arrived; what came up to and including them is returned.
    case delimiter([UInt8])

    /// `12 bytes`, or `the delimiter 0D 0A`, as timeout messages say it.
    public var description: String {
        switch self {
        case .count(let count): "\(count) bytes"
        case .delimiter(let bytes): "the delimiter \(Hex.text(bytes))"
        }
    }
}

/// The bytes a write-then-collect has gathered, for its timeout's message.
private final class Collected: Sendable {
    let bytes = Locked<[UInt8]>([])
}

/// A Bluetooth LE device this central is connected to, through bluetoothd: its services, reads,
/// writes and notifications (Bluejay's peripheral). Operations on one device run one at a time,
/// in the order they were asked for; several devices are served at once.
///
/// ```swift
/// let sensor = try await BluetoothPeripheral.connect(to: "E3:2E:44:66:A2:4A", adapter: "hci0")
/// let level = try await sensor.read("2a19")                           // Battery Level
/// for try await value in try await sensor.notifications(of: "2a37") { print(value) }   // Heart Rate
/// await sensor.disconnect()
/// ```
public final class BluetoothPeripheral: Sendable {
    /// What happens to the link.
    public enum Event: Sendable, Hashable {
        /// The link dropped (the device went out of range or away, or was switched off, or its
        /// adapter went away). Operations in flight fail with `.disconnected`; none is repeated.
        /// `willReconnect` says whether the reconnect policy tries again: when it does, operations
        /// fail with `.disconnected` until ``connected``; otherwise this is the last event.
        case disconnected(reason: String, willReconnect: Bool)
        /// The reconnect policy's attempt `attempt` (from 1) begins.
        case connecting(attempt: Int)
        /// The link is back: the services were read again and every notification sequence
        /// still iterated was subscribed again.
        case connected
        /// The device said its services changed; ``BluetoothPeripheral/services`` has the new ones.
        case servicesChanged
    }

    /// How ``BluetoothPeripheral`` reconnects when the link drops (not after ``disconnect()``).
    /// Notification sequences stay open across the drop and are subscribed again; reads and
    /// writes in flight or asked for while the link is down fail with `.disconnected`, and are
    /// never repeated.
    ///
    /// ```swift
    /// let sensor = try await BluetoothPeripheral.connect(to: "E3:2E:44:66:A2:4A", reconnect: .init(attempts: 10))
    /// ```
    public struct ReconnectPolicy: Sendable, Hashable {
        /// How many attempts before giving up; nil for no limit.
        public var attempts: Int?
        /// The wait before the first attempt, doubled after each failed one up to `maximumDelay`.
        public var delay: Duration
        /// The longest wait between attempts (30 s by default).
        public var maximumDelay: Duration
        /// The limit for each attempt (finding the device, connecting, reading the services).
        public var timeout: Duration

        /// A policy; by default it tries for ever, after 1 s, then 2 s, 4 s, … up to 30 s apart,
        /// allowing each attempt 20 s.
        public init(attempts: Int? = nil, delay: Duration = .seconds(1), maximumDelay: Duration = .seconds(30), timeout: Duration = .seconds(20)) {
            self.attempts = attempts
            self.delay = delay
            self.maximumDelay = maximumDelay
            self.timeout = timeout
        }
    }

    /// `00:AA:01:01:00:01`.
    public let address: String
    /// The adapter the link is on (`hci0`).
    public let adapter: String
    /// The bluetoothd client of every session this object has (pairing and forgetting use it too).
    let bluez: BlueZ
    /// Opens a new session to the device on the first session's adapter (the reconnect policy's attempts).
    private let reopen: @Sendable (Duration, String) async throws -> GattSession
    private let policy: ReconnectPolicy?
    private let state: Locked<State>
    /// One operation at a time, in order.
    private let turn = AsyncCondition(false)
    /// The ``events()`` sequences.
    private let listeners = EventFanout<Event>()

    private struct State {
        /// The link's session: replaced when the reconnect policy brings the link back.
        var session: GattSession
        /// The reconnect policy's attempts, while the link is down.
        var reconnecter: Task<Void, Never>?
        /// Follows the current session's signals (startWatching).
        var watcher: Task<Void, Never>?
        var objects: BlueZObjects
        var device: BluetoothDevice
        /// Why the link ended, once it has.
        var ended: TransportError?
        var closed = false
        var resolving = false
        /// The services and the ATT MTU as last built from `objects` (nil: build again). Every
        /// operation looks its characteristic up; building walks every object bluetoothd has.
        var cache: (services: [GATTService], attMTU: Int?)?
        /// Notification streams and the characteristics they come from: ended with the link,
        /// or subscribed again when the reconnect policy brings it back.
        var subscriptions: [Int: (continuation: AsyncThrowingStream<[UInt8], any Error>.Continuation, path: String)] = [:]
        var nextSubscription = 0
        /// Why the link is down while the reconnect policy tries to bring it back.
        var down: TransportError?
    }

    private init(session: GattSession, policy: ReconnectPolicy?, reopen: @escaping @Sendable (Duration, String) async throws -> GattSession) {
        bluez = session.bluez
        self.policy = policy
        self.reopen = reopen
        address = session.device.address.uppercased()
        adapter = session.adapter.name
        state = Locked(State(session: session, objects: session.objects, device: session.device))
    }

    /// Connects to the device at `address` over LE (or takes the link that is up) and reads its
    /// services, within `timeout`.
    ///
    /// - Parameters:
    ///   - address: the device's address (`E3:2E:44:66:A2:4A`).
    ///   - adapter: the adapter (`hci0`, or its address); nil for the first powered one.
    ///   - timeout: the limit for finding, connecting and reading the services.
    ///   - reconnect: what to do when the link drops; nil to end with it (the default).
    ///   - bus: the bus bluetoothd is on.
    /// - Throws: `TransportError`: `.invalidURL` for an address that is not one, `.notFound` when the
    ///   device is not seen within the timeout, `.timedOut`, `.disconnected` when the link drops
    ///   before the services were read, and BlueZ's errors with what to do.
    public static func connect(to address: String, adapter: String? = nil, timeout: Duration = .seconds(20), reconnect: ReconnectPolicy? = nil,
                               bus: DBusConnection.Bus = .system) async throws -> BluetoothPeripheral {
        guard let parsed = BluetoothAddress(address) else {
            throw TransportError(.invalidURL, "'\(TransportError.printable(address, limit: 40))' is not a Bluetooth address (six hex pairs: E3:2E:44:66:A2:4A)")
        }
        if let reconnect, reconnect.attempts.map({ $0 < 1 }) ?? false || reconnect.delay < .zero || reconnect.timeout <= .zero {
            throw TransportError(.misuse, "a reconnect policy needs at least one attempt, a delay of zero or more and a timeout above zero: \(reconnect)")
        }
        let what = "Bluetooth device \(parsed)"
        let open = { @Sendable (timeout: Duration, adapter: String?) async throws -> GattSession in
            let deadline = ContinuousClock.now + timeout
            return try await withDeadline(deadline, TransportError(.timedOut, "connecting to \(what) took longer than \(timeout.secondsText)")) {
                try await GattSession.open(bus: bus, address: parsed, adapterName: adapter, deadline: deadline, timeout: timeout, what: what)
            }
        }
        let peripheral = BluetoothPeripheral(session: try await open(timeout, adapter), policy: reconnect, reopen: { try await open($0, $1) })
        peripheral.startWatching()
        return peripheral
    }

    // MARK: What the device offers

    /// The device's services with their characteristics and descriptors, as bluetoothd read them;
    /// current after a ``Event/servicesChanged``.
    public var services: [GATTService] { cached.services }

    /// The services and ATT MTU, built once per change of bluetoothd's objects under the device.
    private var cached: (services: [GATTService], attMTU: Int?) {
        state.withLock { state in
            if let cache = state.cache { return cache }
            let prefix = state.device.path + "/"
            let mtu = state.objects.interfaces.filter { $0.key.hasPrefix(prefix) }
                .compactMap { $0.value[GattSerial.characteristicInterface]?["MTU"]?.integer }.max().map { Int($0) }
            let built = (Self.services(of: state.device.path, in: state.objects), mtu)
            state.cache = built
            return built
        }
    }

    /// Where the last connect (or reconnect) spent its time: subscribing to bluetoothd's signals,
    /// finding the adapter and the device, waiting for the adapter's turn, discovery, Connect,
    /// services resolved, reading the object tree (the steps a link already up skips are absent).
    ///
    /// ```swift
    /// for step in sensor.connectSteps { print(step.name, step.duration) }
    /// ```
    public var connectSteps: [GATTConnectStep] { state.withLock { $0.session.steps } }

    /// The device's name (what it advertises or its GAP name), if known.
    public var name: String? { state.withLock { $0.device.name ?? $0.device.alias } }

    /// The ATT MTU of the link, when bluetoothd reports it (BlueZ 5.62 and later).
    public var attMTU: Int? { cached.attMTU }

    /// The longest value one write of `type` carries: 512 with a response (a long write), ATT MTU − 3
    /// without (23 − 3 when the MTU is not known).
    public func maximumWriteLength(for type: GATTWriteType) -> Int {
        switch type {
        case .withResponse: 512
        case .withoutResponse: max((attMTU ?? 23) - 3, 20)
        }
    }

    /// `false` while the link is down (the reconnect policy may bring it back), once it ended,
    /// and after ``disconnect()``.
    public var isConnected: Bool { state.withLock { $0.ended == nil && $0.down == nil && !$0.closed } }

    /// The link's events from now on, as a sequence; each call starts a new one. It ends after
    /// ``Event/disconnected(reason:willReconnect:)`` when no reconnect follows, and after ``disconnect()``.
    public func events() -> AsyncStream<Event> { listeners.subscribe() }

    // MARK: Operations

    /// Reads a characteristic's value.
    ///
    /// - Parameters:
    ///   - characteristic: its UUID (`2a19`, `00002a19`, or 128-bit).
    ///   - service: the service's UUID, where two services have the characteristic.
    /// - Throws: `.notFound` (listing what the device has), `.unsupported` when it cannot be read,
    ///   `.permissionDenied` when it needs pairing first, `.disconnected` (on an unpaired device, for
    ///   a characteristic that needs encryption, saying the pairing likely failed and to pair first).
    public func read(_ characteristic: String, service: String? = nil) async throws -> [UInt8] {
        try await inOrder {
            let found = try self.find(characteristic, service: service)
            guard found.canRead else {
                throw TransportError(.unsupported, "\(self.describing): characteristic \(found.shortUUID) cannot be read: [\(found.flags.joined(separator: ","))]")
            }
            let reply = try await self.call(found, "ReadValue", [.dictionary([:])], about: "reading \(found.shortUUID)")
            guard let bytes = reply.first?.bytes else {
                throw TransportError(.protocolError, "\(self.describing): bluetoothd's answer to ReadValue on \(found.shortUUID) carried no bytes: \(reply)")
            }
            return bytes
        }
    }

    /// Writes a characteristic's value, with a response (acknowledged by the device; up to 512
    /// bytes, a long write past one packet) or without (at most ATT MTU − 3 bytes).
    ///
    /// - Throws: `.misuse` for a value longer than the device takes (the message says the limit),
    ///   `.unsupported` when the characteristic takes no such write, and as ``read(_:service:)``.
    public func write(_ value: [UInt8], to characteristic: String, service: String? = nil, type: GATTWriteType = .withResponse) async throws {
        try await inOrder { try await self.writeNow(value, to: characteristic, service: service, type: type) }
    }

    private func writeNow(_ value: [UInt8], to characteristic: String, service: String?, type: GATTWriteType) async throws {
        let found = try find(characteristic, service: service)
        let allowed = type == .withResponse ? found.canWrite : found.canWriteWithoutResponse
        guard allowed else {
            throw TransportError(.unsupported, "\(describing): characteristic \(found.shortUUID) takes no write \(type == .withResponse ? "with" : "without") response: "
                                 + "[\(found.flags.joined(separator: ","))]")
        }
        let limit = maximumWriteLength(for: type)
        guard value.count <= limit else {
            throw TransportError(.misuse, "\(describing): \(value.count) bytes is longer than characteristic \(found.shortUUID) takes in one write "
                                 + "\(type == .withResponse ? "with" : "without") response: at most \(limit) (ATT MTU \(attMTU.map(String.init) ?? "23"))")
        }
        _ = try await call(found, "WriteValue", [.bytes(value), .dictionary(["type": .string(type == .withResponse ? "request" : "command")])],
                           about: "writing \(value.count) bytes to \(found.shortUUID)")
    }

    /// The values a characteristic notifies or indicates, from now on, as a sequence. Ending the
    /// iteration (or dropping the sequence) stops the notifications; the sequence ends with
    /// `.disconnected` when the link drops (with a reconnect policy: when it gives up, or when the
    /// characteristic is gone after a reconnect), and with an error if more than 4,096 values wait unread.
    ///
    /// - Throws: `.unsupported` when the characteristic neither notifies nor indicates, and as
    ///   ``read(_:service:)``.
    public func notifications(of characteristic: String, service: String? = nil) async throws -> AsyncThrowingStream<[UInt8], any Error> {
        try await inOrder { try await self.subscribe(characteristic, service: service) }
    }

    private func subscribe(_ characteristic: String, service: String?) async throws -> AsyncThrowingStream<[UInt8], any Error> {
        let found = try find(characteristic, service: service)
        guard found.canNotify else {
            throw TransportError(.unsupported, "\(describing): characteristic \(found.shortUUID) neither notifies nor indicates: [\(found.flags.joined(separator: ","))]")
        }
        let bluez = self.bluez
        let limit = GattSerial.unreadNotificationLimit
        let values: AsyncThrowingStream<DBusSignal, any Error>
        do {
            values = try await bluez.notifications(of: found.path, about: "\(describing): starting notifications from \(found.shortUUID)")
        } catch let error as TransportError {
            throw failure(error, on: found)
        }
        let (stream, continuation) = AsyncThrowingStream<[UInt8], any Error>.makeStream(bufferingPolicy: .bufferingOldest(limit))
        // Registered only while the link is up and this object open (disconnect() may have run
        // since the turn began): otherwise nothing would ever end the stream.
        let registered = state.withLock { state -> Int? in
            // Not while the link is down either: the reconnect may have listed the paths already.
            guard !state.closed, state.ended == nil, state.down == nil else { return nil }
            state.nextSubscription += 1
            state.subscriptions[state.nextSubscription] = (continuation, found.path)
            return state.nextSubscription
        }
        guard let id = registered else {
            await bluez.notifySessions.stop(bluez, path: found.path)
            throw state.withLock { $0.ended ?? $0.down.map(Self.reconnecting) }
                ?? TransportError(.misuse, "\(describing) was disconnected by this side (disconnect())")
        }
        let overflow = TransportError(.io, "\(describing): more than \(limit) notifications from \(found.shortUUID) waited unread: "
                                      + "read them as fast as the device sends", code: DBusSignalBuffering.overflowCode)
        let feeder = Task {
            do {
                for try await signal in values {
                    guard let value = BlueZ.notifiedValue(signal) else { continue }
                    if case .dropped = continuation.yield(value) {
                        continuation.finish(throwing: overflow)
                        return
                    }
                }
            } catch is CancellationError {
            } catch let error as TransportError where error.code == DBusSignalBuffering.overflowCode {
                continuation.finish(throwing: overflow)
            } catch {
                continuation.finish(throwing: error)
            }
        }
        continuation.onTermination = { [weak self] _ in
            feeder.cancel()
            _ = self?.state.withLock { $0.subscriptions.removeValue(forKey: id) }
            startCleanup { await bluez.notifySessions.stop(bluez, path: found.path) }
        }
        return stream
    }

    /// Writes `value`, then collects what `source` notifies until `until` is met: Bluejay's
    /// writeAndAssemble, for request/response protocols over two characteristics. The
    /// subscription is made before the write, so no answer is missed.
    ///
    /// ```swift
    /// let reply = try await device.write(Array("AT\r".utf8), to: "6e400002-b5a3-f393-e0a9-e50e24dcca9e",
    ///                                    thenCollectFrom: "6e400003-b5a3-f393-e0a9-e50e24dcca9e", until: .delimiter([0x0d]))
    /// ```
    ///
    /// - Throws: `.timedOut` when `until` is not met within `timeout` (the message says what came),
    ///   `.disconnected`, and as ``write(_:to:service:type:)`` and ``notifications(of:service:)``.
    public func write(_ value: [UInt8], to characteristic: String, service: String? = nil, type: GATTWriteType = .withResponse,
                      thenCollectFrom source: String, until: GATTCollect, timeout: Duration = .seconds(10)) async throws -> [UInt8] {
        switch until {
        case .count(let count) where count < 1:
            throw TransportError(.misuse, "\(describing): collect a count of at least 1 byte; got \(count)")
        case .delimiter(let delimiter) where delimiter.isEmpty:
            throw TransportError(.misuse, "\(describing): collect up to a delimiter of at least one byte")
        default:
            break
        }
        return try await inOrder {
            let values = try await self.subscribe(source, service: service)
            try await self.writeNow(value, to: characteristic, service: service, type: type)
            let describing = self.describing
            let collected = Collected()
            return try await withTimeout(timeout, TransportError(.timedOut, "\(describing): \(until) did not arrive within \(timeout.secondsText) after the write; "
                                                                 + "\(collected.bytes.withLock { $0.count }) bytes came")) {
                for try await piece in values {
                    let result = collected.bytes.withLock { bytes -> [UInt8]? in
                        bytes += piece
                        switch until {
                        case .count(let count): return bytes.count >= count ? bytes : nil
                        case .delimiter(let delimiter):
                            guard !delimiter.isEmpty, let range = bytes.firstRange(of: delimiter) else { return nil }
                            return Array(bytes[..<range.upperBound])
                        }
                    }
                    if let result { return result }
                }
                throw TransportError(.disconnected, "\(describing): the notifications ended before \(until) arrived")
            }
        }
    }

    /// Disconnects (if this object made the link) and ends the events and notification
    /// sequences. Calling it again does nothing.
    public func disconnect() async {
        // The link is read in the lock that closes: a reconnect that succeeds after this finds
        // the object closed and releases its own link.
        let (first, subscriptions, link, tasks) = state.withLock { state in
            defer { state.closed = true; state.subscriptions = [:]; state.reconnecter = nil; state.watcher = nil }
            return (!state.closed, state.subscriptions.values, state.session.link, [state.reconnecter, state.watcher])
        }
        guard first else { return }
        for task in tasks { task?.cancel() }
        listeners.finish(with: nil)
        for subscription in subscriptions { subscription.continuation.finish(throwing: TransportError(.disconnected, "\(describing) was disconnected by this side")) }
        await link.release()
    }

    deinit {
        let (closed, link, tasks, subscriptions) = state.withLock { state in
            (state.closed, state.session.link, [state.reconnecter, state.watcher], Array(state.subscriptions.values))
        }
        for task in tasks { task?.cancel() }
        // Dropped without disconnect(): the link this object made is released all the same, and
        // the sequences still iterated end rather than wait for values that cannot come.
        if !closed {
            listeners.finish(with: nil)
            let dropped = TransportError(.disconnected, "\(describing): the BluetoothPeripheral was dropped without disconnect()")
            for subscription in subscriptions { subscription.continuation.finish(throwing: dropped) }
            startCleanup { await link.release() }
        }
    }

    // MARK: Inside

    private var describing: String { "Bluetooth device \(address)" }

    /// The device as bluetoothd last reported it.
    var deviceSnapshot: BluetoothDevice { state.withLock { $0.device } }


    /// Records what a call's success says, before bluetoothd's signal about it arrives.
    func updateDevice(_ body: (inout BluetoothDevice) -> Void) { state.withLock { body(&$0.device) } }

    /// A Device1 method on the device, in its turn (Pair may take as long as a person does: 60 s).
    func callDevice(_ member: String, about what: String) async throws -> [DBusValue] {
        try await inOrder {
            do {
                return try await self.bluez.call(self.deviceSnapshot.path, BlueZ.deviceInterface, member, timeout: .seconds(60),
                                                         about: "\(self.describing): \(what)")
            } catch let error as TransportError {
                if let ended = self.state.withLock({ $0.ended }) { throw ended }
                throw error
            }
        }
    }

    /// Runs `body` after the operations asked for before it, and before those asked for after it.
    private func inOrder<T: Sendable>(_ body: () async throws -> T) async throws -> T {
        try await turn.wait { (taken: inout Bool) -> Void? in
            if taken { return nil }
            taken = true
            return ()
        }
        defer { turn.update { $0 = false } }
        try state.withLock { state in
            if state.closed { throw TransportError(.misuse, "\(describing) was disconnected by this side (disconnect())") }
            if let ended = state.ended { throw ended }
            if let down = state.down { throw Self.reconnecting(down) }
        }
        return try await body()
    }

    /// The characteristic with `uuid` (in `service`), or an error that lists what there is.
    private func find(_ uuid: String, service: String?) throws -> GATTCharacteristic {
        guard let wanted = BluetoothUUID.normalize(uuid) else {
            throw TransportError(.misuse, "'\(TransportError.printable(uuid, limit: 40))' is not a characteristic UUID (2A19, or 128-bit with dashes)")
        }
        let inService = try service.map { text -> String in
            guard let normalized = BluetoothUUID.normalize(text) else {
                throw TransportError(.misuse, "'\(TransportError.printable(text, limit: 40))' is not a service UUID (180F, or 128-bit with dashes)")
            }
            return normalized
        }
        let services = self.services
        let candidates = services.filter { inService == nil || $0.uuid == inService }
        if let inService, candidates.isEmpty {
            throw TransportError(.notFound, "\(describing) has no service \(BluetoothUUID.short(inService)); it has: "
                                 + (services.isEmpty ? "none" : services.map(\.shortUUID).joined(separator: ", ")))
        }
        let matches = candidates.flatMap(\.characteristics).filter { $0.uuid == wanted }
        guard let first = matches.first else {
            let listing = candidates.map { service in
                "\(service.shortUUID) (\(service.characteristics.map { "\($0.shortUUID) [\($0.flags.joined(separator: ","))]" }.joined(separator: "; ")))"
            }.joined(separator: ", ")
            throw TransportError(.notFound, "\(describing) has no characteristic \(BluetoothUUID.short(wanted))"
                                 + "\(inService.map { " in service \(BluetoothUUID.short($0))" } ?? ""); it has: \(listing.isEmpty ? "no services" : listing)")
        }
        if matches.count > 1 && inService == nil {
            throw TransportError(.misuse, "\(describing): characteristic \(BluetoothUUID.short(wanted)) is in several services "
                                 + "(\(matches.map { BluetoothUUID.short($0.service) }.joined(separator: ", "))); name one with service:")
        }
        return first
    }

    /// A call on a characteristic, with the errors a person can act on.
    private func call(_ characteristic: GATTCharacteristic, _ member: String, _ arguments: [DBusValue] = [], about what: String) async throws -> [DBusValue] {
        do {
            return try await bluez.call(characteristic.path, GattSerial.characteristicInterface, member, arguments, about: "\(describing): \(what)")
        } catch let error as TransportError {
            throw failure(error, on: characteristic)
        }
    }

    /// What a failed call on `characteristic` means: its own reason when that is about security,
    /// else the link's end if it ended, else the reason explained. A failed pairing drops an LE
    /// link too: bluetoothd starts one to raise an unpaired link's security for a characteristic
    /// that needs it, and BlueZ 5.66 in the lab answered that way once, beside ATT errors and no
    /// answer; the link's end then says so.
    private func failure(_ error: TransportError, on characteristic: GATTCharacteristic) -> TransportError {
        let paired = deviceSnapshot.paired
        let explained = Self.explain(error, describing: describing, paired: paired)
        guard explained.kind != .permissionDenied, let ended = state.withLock({ $0.ended ?? $0.down }) else { return explained }
        guard !paired, characteristic.needsSecurity else { return ended }
        var pairing = TransportError(.disconnected, "\(ended.message), while bluetoothd raised the link's security for characteristic "
                                     + "\(characteristic.shortUUID) [\(characteristic.flags.joined(separator: ","))], which needs an encrypted link: "
                                     + "the pairing likely failed; pair first (BluetoothPeripheral.pair() with an agent registered), then connect again")
        pairing.code = ended.code
        return pairing
    }

    /// BlueZ's GATT errors, by their name and (for ATT errors, which come only as text) their code.
    static func explain(_ error: TransportError, describing: String, paired: Bool) -> TransportError {
        let message = error.message
        // ATT errors (Core Specification Vol 3 Part F 3.4.1.1) come only as text: 0x05
        // Insufficient Authentication, 0x08 Insufficient Authorization, 0x0C Insufficient
        // Encryption Key Size, 0x0F Insufficient Encryption.
        let needsPairing = ["0x05", "0x0f", "0x08", "0x0c"].contains { message.contains("ATT error: \($0)") }
            || error.code == "org.bluez.Error.NotAuthorized" || error.kind == .permissionDenied
        if needsPairing {
            var explained = TransportError(.permissionDenied, "\(message). The characteristic needs an encrypted or paired link: pair first "
                                           + "(BluetoothPeripheral.pair() with an agent registered, or `bluetoothctl pair ADDRESS`), then try again")
            explained.code = error.code
            return explained
        }
        // 0x0E Unlikely Error, or no answer at all (NoReply after 25 s): what BlueZ 5.66 did in the
        // lab, one or the other, when it could not raise an unpaired link's security for a
        // characteristic that needs encryption (the pairing it starts has no agent to answer).
        if !paired && error.kind == .timedOut {
            var explained = TransportError(.timedOut, "\(message). The device is not paired: if the characteristic needs an encrypted link, "
                                           + "bluetoothd may have waited for a pairing no agent answered: pair first (BluetoothPeripheral.pair() "
                                           + "with an agent registered), then try again")
            explained.code = error.code
            return explained
        }
        if message.contains("ATT error: 0x0e") && !paired {
            var explained = TransportError(.io, "\(message). The device is not paired: if the characteristic needs an encrypted link, "
                                           + "pair first (BluetoothPeripheral.pair() with an agent registered), then try again")
            explained.code = error.code
            return explained
        }
        if error.code == "org.bluez.Error.NotConnected" || (error.code == "org.bluez.Error.Failed" && message.contains("Not connected")) {
            var explained = TransportError(.disconnected, "\(describing) is not connected (the link dropped): \(message)")
            explained.code = error.code
            return explained
        }
        return error
    }

    static func services(of devicePath: String, in objects: BlueZObjects) -> [GATTService] {
        var descriptors: [String: [GATTDescriptor]] = [:]
        var characteristics: [String: [GATTCharacteristic]] = [:]
        var services: [(path: String, uuid: String, primary: Bool)] = []
        let serviceUUIDs = objects.interfaces.compactMapValues { $0[GattSerial.serviceInterface]?["UUID"]?.text?.lowercased() }
        for (path, interfaces) in objects.interfaces where path.hasPrefix(devicePath + "/") {
            if let properties = interfaces[GattSerial.serviceInterface] {
                services.append((path, properties["UUID"]?.text?.lowercased() ?? "", properties["Primary"]?.boolValue ?? true))
            }
            if let properties = interfaces["org.bluez.GattDescriptor1"], let owner = properties["Characteristic"]?.text {
                descriptors[owner, default: []].append(GATTDescriptor(uuid: properties["UUID"]?.text?.lowercased() ?? "",
                                                                      flags: properties["Flags"]?.strings ?? [], path: path))
            }
        }
        for (path, interfaces) in objects.interfaces where path.hasPrefix(devicePath + "/") {
            guard let properties = interfaces[GattSerial.characteristicInterface], let owner = properties["Service"]?.text else { continue }
            characteristics[owner, default: []].append(GATTCharacteristic(
                uuid: properties["UUID"]?.text?.lowercased() ?? "", service: serviceUUIDs[owner] ?? "", flags: properties["Flags"]?.strings ?? [],
                descriptors: (descriptors[path] ?? []).sorted { $0.path < $1.path }, path: path))
        }
        return services.sorted { $0.path < $1.path }.map { service in
            GATTService(uuid: service.uuid, isPrimary: service.primary,
                        characteristics: (characteristics[service.path] ?? []).sorted { $0.path < $1.path }, path: service.path)
        }
    }

    /// Starts following the current session's link (once connected).
    private func startWatching() {
        state.withLock { state in state.watcher = watching(state.session) }
    }

    /// Follows `current`'s link: objects kept current, the drop and service changes reported.
    /// The caller keeps the task in `state.watcher`.
    private func watching(_ current: GattSession) -> Task<Void, Never> {
        let events = current.events
        let devicePath = current.device.path
        let bluez = self.bluez
        let task = Task { [weak self] in
            do {
                for try await signal in events {
                    if GattSession.endsLink(signal, devicePath: devicePath), await GattSession.linkIsDown(bluez, devicePath: devicePath) {
                        self?.linkEnded(TransportError(.disconnected, "Bluetooth device \(BlueZ.address(inDevicePath: devicePath)) disconnected: "
                                                       + "the link dropped (out of range, switched off, or its adapter went away)"), confirmedDown: true)
                        return
                    }
                    guard let self else { return }
                    if self.apply(signal, devicePath: devicePath) {
                        // The new services' objects may reach the bus after ServicesResolved
                        // (GattSession's note): read them.
                        if let objects = try? await bluez.objectTree(about: "reading the changed services of \(self.describing)") {
                            self.state.withLock { state in
                                state.objects = objects
                                state.cache = nil
                            }
                        }
                        self.emit(.servicesChanged)
                    }
                }
                // The stream ended (the bus connection closed): the link may still be up, and
                // stays this object's to release; no reconnect.
                self?.linkEnded(TransportError(.disconnected, "bluetoothd went away"), confirmedDown: false)
            } catch is CancellationError {
            } catch {
                self?.linkEnded(TransportError(.disconnected, "the D-Bus connection to bluetoothd ended: \(error)"), confirmedDown: false)
            }
        }
        return task
    }

    /// Applies one signal; `true` when the device's services were resolved again (they changed).
    private func apply(_ signal: DBusSignal, devicePath: String) -> Bool {
        state.withLock { state -> Bool in
            state.objects.apply(signal)
            // Only a change under the device's path changes what it offers.
            let subject = signal.member == "PropertiesChanged" ? signal.path : (signal.values.first?.text ?? "")
            if subject.hasPrefix(devicePath + "/") || subject == devicePath { state.cache = nil }
            if let device = state.objects.device(at: devicePath) { state.device = device }
            guard signal.member == "PropertiesChanged", signal.path == devicePath,
                  let resolved = signal.values.dropFirst().first?.dictionary?["ServicesResolved"]?.boolValue else { return false }
            if !resolved {
                state.resolving = true
                return false
            }
            defer { state.resolving = false }
            return state.resolving
        }
    }

    private func emit(_ event: Event) {
        listeners.yield(event)
    }

    /// The link ended; `confirmedDown` when bluetoothd said it is down (only then is it
    /// forgotten and, with a policy, made again).
    private func linkEnded(_ error: TransportError, confirmedDown: Bool) {
        if let policy, confirmedDown {
            // The task is made and kept in the lock that marks the link down: a disconnect() from
            // then on cancels it.
            let (reconnecting, link) = state.withLock { state -> (Bool, GattLink?) in
                guard state.ended == nil, state.down == nil, !state.closed else { return (false, nil) }
                state.down = error
                let peripheral: @Sendable () -> BluetoothPeripheral? = { [weak self] in self }
                state.reconnecter = Task { await Self.reconnect(peripheral, policy, after: error) }
                return (true, state.session.link)
            }
            if reconnecting {
                // The link this object made is gone: nothing is left to disconnect.
                link?.forget()
                listeners.yield(.disconnected(reason: error.message, willReconnect: true))
                return
            }
        }
        end(error)
    }

    /// What an operation asked for while the link is down (after `drop`) fails with.
    private static func reconnecting(_ drop: TransportError) -> TransportError {
        TransportError(.disconnected, "\(drop.message); reconnecting")
    }

    /// The link ended for good: the event sequences end after saying so, and the notification sequences with `error`.
    private func end(_ error: TransportError) {
        let (first, subscriptions) = state.withLock { state in
            defer {
                if state.ended == nil { state.ended = error }
                state.down = nil
                state.subscriptions = [:]
            }
            return (state.ended == nil && !state.closed, Array(state.subscriptions.values))
        }
        guard first else { return }
        listeners.finish(with: .disconnected(reason: error.message, willReconnect: false))
        for subscription in subscriptions { subscription.continuation.finish(throwing: error) }
    }

    /// The reconnect policy's attempts, until one brings the link back (then the watching goes on
    /// with the new session and the notifications are subscribed again) or the last one failed.
    /// The object is held only during an attempt's own steps: dropped, it stops the attempts.
    private static func reconnect(_ peripheral: @Sendable () -> BluetoothPeripheral?, _ policy: ReconnectPolicy, after drop: TransportError) async {
        var delay = policy.delay
        var attempt = 0
        var last = drop
        while policy.attempts.map({ attempt < $0 }) ?? true {
            attempt += 1
            do {
                try await Task.sleep(for: delay)
            } catch {
                return
            }
            delay = min(delay * 2, policy.maximumDelay)
            guard let self = peripheral(), !self.state.withLock({ $0.closed }) else { return }
            self.listeners.yield(.connecting(attempt: attempt))
            let opened: GattSession
            do {
                opened = try await self.reopen(policy.timeout, self.adapter)
            } catch let error as TransportError {
                last = error
                continue
            } catch {
                // Cancelled: by disconnect() (closed), or the task's owner went; otherwise end.
                if !self.state.withLock({ $0.closed }) { self.end(TransportError(.disconnected, "\(drop.message); reconnecting stopped: \(error)")) }
                return
            }
            guard await self.resume(with: opened) else { return }
            return
        }
        peripheral()?.end(TransportError(.disconnected, "\(drop.message); no reconnect after \(attempt) attempt\(attempt == 1 ? "" : "s"): \(last.message)"))
    }

    /// Takes the new session (unless disconnect() came first: then its link is released),
    /// subscribes the notifications again, and goes on watching; `false` when closed.
    private func resume(with opened: GattSession) async -> Bool {
        let paths = state.withLock { state -> [Int: String]? in
            guard !state.closed else { return nil }
            state.session = opened
            state.objects = opened.objects
            state.device = opened.device
            state.cache = nil
            return state.subscriptions.mapValues(\.path)
        }
        guard let paths else {
            await opened.link.release()
            return false
        }
        // Subscribed again before anything else may run on the new link; a characteristic
        // that is gone ends its sequence.
        for (id, path) in paths.sorted(by: { $0.key < $1.key }) {
            do {
                try await bluez.notifySessions.restart(bluez, path: path, about: "\(describing): subscribing again after a reconnect")
            } catch {
                let subscription = state.withLock { $0.subscriptions.removeValue(forKey: id) }
                subscription?.continuation.finish(throwing: TransportError(.disconnected, "\(describing): the link came back, but "
                                                                             + "notifications could not be started again: \(error)"))
            }
        }
        // Up again, said, and watched, in the lock that disconnect() closes with: a disconnect()
        // before this finds the new link (and releases it), one after it cancels this watcher.
        return state.withLock { state in
            guard !state.closed else { return false }
            state.down = nil
            state.reconnecter = nil
            state.resolving = false
            // Said before the new watcher may say anything of the new link.
            listeners.yield(.connected)
            state.watcher = watching(opened)
            return true
        }
    }
}
