// BluetoothScan.swift: finding nearby devices through bluetoothd's discovery (Adapter1
// SetDiscoveryFilter, StartDiscovery; devices appear as ObjectManager InterfacesAdded and change
// through PropertiesChanged on their Device1 objects). Bluejay's scan, as an AsyncSequence:
// discoveries, updates when duplicates are wanted, and an expiry when a device has not been seen.
//
// A device counts as seen when it appears or when an advertisement or inquiry result updates it
// (RSSI, manufacturer or service data, TX power). BlueZ with a discovery filter reports every
// advertisement's RSSI when DuplicateData is on (adapter.c: the RSSI delta threshold is 0 for a
// filtered discovery), which is what keeps a present device from expiring.

import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus

/// What a scan looks for, and when it ends.
///
/// ```swift
/// var scan = BluetoothScan(services: ["nus"], end: .firstMatch)
/// scan.minimumRSSI = -80
/// for try await event in BluetoothPlugin().scan(scan) {
///     if case .discovered(let device) = event { print(device.name ?? "?", device.url) }
/// }
///
/// // Bluejay's ScanAction: skip devices without a name, stop at the first thermometer.
/// let pick = BluetoothScan(end: .never) { device in
///     guard let name = device.name else { return .ignore }
///     return name.hasPrefix("Thermo") ? .stop : .continue
/// }
/// ```
public struct BluetoothScan: Sendable {
    /// The radio a scan listens on.
    public enum Bearer: String, Sendable, CaseIterable {
        /// Bluetooth LE advertisements.
        case le
        /// Bluetooth Classic (BR/EDR) inquiry.
        case classic
        /// Both.
        case both
    }

    /// When a scan ends.
    public enum End: Sendable {
        /// After this long.
        case after(Duration)
        /// With the first device that matches (its `.discovered` event is the last).
        case firstMatch
        /// When the task iterating it is cancelled.
        case never
    }

    /// What a scan reports.
    public enum Event: Sendable {
        /// A device that matches was seen for the first time in this scan, or again after it expired.
        case discovered(BluetoothDiscovery)
        /// A device already reported was seen again (only when ``BluetoothScan/duplicates`` is on).
        case updated(BluetoothDiscovery)
        /// A device reported earlier has not been seen for ``BluetoothScan/expiry`` (Bluejay's `expired`).
        case expired(BluetoothDiscovery)

        /// The device the event is about.
        public var device: BluetoothDiscovery {
            switch self {
            case .discovered(let device), .updated(let device), .expired(let device): device
            }
        }
    }

    /// Service UUIDs a device must advertise one of (`FFE0`, a 128-bit UUID, or a short name such as
    /// `nus`); empty for any.
    public var services: [String]
    /// The weakest signal reported, in dBm (`-80`); nil for any.
    public var minimumRSSI: Int?
    /// A prefix the device's name must start with; nil for any.
    public var namePrefix: String?
    /// The radio to listen on.
    public var bearer: Bearer
    /// Report every advertisement of a device already reported as ``Event/updated(_:)``.
    public var duplicates: Bool
    /// When the scan ends.
    public var end: End
    /// How long a reported device may go unseen before ``Event/expired(_:)``; nil for never.
    public var expiry: Duration?
    /// The adapter to scan with (`hci0`, or its address); nil for the first powered one.
    public var adapter: String?
    /// With ``duplicates``: an update only when the RSSI moved by at least this many dBm since the
    /// last one reported, or the device's data or name changed; nil for every sighting.
    public var rssiThreshold: Int?
    /// A decision on each device when it is about to be reported as discovered (Bluejay's
    /// ScanAction; again after it expired and came back): report it and go on, ignore it for the
    /// rest of the scan, or report it and stop. Runs on the scan's task; keep it quick.
    public var decide: (@Sendable (BluetoothDiscovery) -> Action)?

    /// What ``decide`` answers for a device.
    public enum Action: Sendable {
        /// Report it (``Event/discovered(_:)``) and go on scanning.
        case `continue`
        /// Do not report it, now or later in this scan.
        case ignore
        /// Report it and end the scan: the device to connect to (``BluetoothPeripheral/connect(to:adapter:timeout:reconnect:bus:)``).
        case stop
    }

    /// A scan; every parameter is also a property.
    ///
    /// - Parameters:
    ///   - services: service UUIDs or short names a device must advertise one of.
    ///   - minimumRSSI: the weakest signal to report, in dBm.
    ///   - namePrefix: what the device's name must start with.
    ///   - bearer: LE (the default), classic, or both.
    ///   - duplicates: report repeated advertisements as updates.
    ///   - end: a duration (10 s by default), the first match, or never.
    ///   - expiry: how long a device may go unseen before it is reported gone (15 s by default).
    ///   - adapter: the adapter to scan with.
    ///   - rssiThreshold: with duplicates, the RSSI change in dBm an update needs.
    ///   - decide: a decision on each new device: report it, ignore it, or stop with it.
    public init(services: [String] = [], minimumRSSI: Int? = nil, namePrefix: String? = nil, bearer: Bearer = .le,
                duplicates: Bool = false, end: End = .after(.seconds(10)), expiry: Duration? = .seconds(15), adapter: String? = nil,
                rssiThreshold: Int? = nil, decide: (@Sendable (BluetoothDiscovery) -> Action)? = nil) {
        self.rssiThreshold = rssiThreshold
        self.decide = decide
        self.services = services
        self.minimumRSSI = minimumRSSI
        self.namePrefix = namePrefix
        self.bearer = bearer
        self.duplicates = duplicates
        self.end = end
        self.expiry = expiry
        self.adapter = adapter
    }
}

/// A device seen in a scan.
public struct BluetoothDiscovery: Sendable, Hashable, Codable {
    /// `E3:2E:44:66:A2:4A`.
    public var address: String
    /// `public` or `random` for LE; `public` for classic.
    public var addressType: String
    /// The device's name as BlueZ reports it (`Name`, else `Alias`); nil when it reports neither.
    public var name: String?
    /// The signal strength of the last sighting, in dBm.
    public var rssi: Int?
    /// Advertised service UUIDs, lower-case 128-bit.
    public var serviceUUIDs: [String]
    /// Manufacturer data by company identifier.
    public var manufacturerData: [UInt16: [UInt8]]
    /// Service data by service UUID.
    public var serviceData: [String: [UInt8]]
    /// The adapter that saw it (`hci0`).
    public var adapter: String
    /// A URL that connects to it: `ble://SERVICE/ADDRESS?adapter=…` with the service the scan asked
    /// for or the device advertises (a short name where one is known), `rfcomm://ADDRESS?adapter=…`
    /// for a classic device (the channel found through SDP), or `ble://SERVICE/ADDRESS?adapter=…`
    /// with SERVICE to fill in when an LE device advertises none.
    public var url: String
}

extension BluetoothDiscovery {
    /// The discovery as a device listing's record (scheme `ble` or `rfcomm`; name the address,
    /// product the device's name), as `transportkit list --scan` prints it.
    public var record: DeviceRecord {
        var properties = ["address": address, "addressType": addressType, "adapter": adapter,
                          "uuids": serviceUUIDs.joined(separator: ",")]
        if let rssi { properties["rssi"] = String(rssi) }
        return DeviceRecord(url: url, scheme: url.hasPrefix("rfcomm:") ? "rfcomm" : "ble", devnode: nil, name: address,
                            product: "\(name ?? "(no name)")\(rssi.map { ", \($0) dBm" } ?? "")", driver: "bluetooth",
                            properties: properties)
    }
}

extension BluetoothPlugin {
    /// Scans for nearby devices with bluetoothd's discovery, as an AsyncSequence of ``BluetoothScan/Event``s.
    /// Discovery stops when the sequence ends or its task is cancelled.
    ///
    /// ```swift
    /// for try await event in BluetoothPlugin().scan(BluetoothScan(services: ["nus"], end: .after(.seconds(5)))) {
    ///     print(event)
    /// }
    /// ```
    ///
    /// - Parameter scan: what to look for and when to stop.
    /// - Returns: the events; the sequence fails with `TransportError` when there is no bus,
    ///   no bluetoothd, no (powered) adapter, or a service given is not a UUID. While the
    ///   application does not read, a device's newest ``BluetoothScan/Event/updated(_:)`` replaces
    ///   the one before it (each discovery and expiry is kept), so a slow reader costs no memory
    ///   per advertisement.
    public func scan(_ scan: BluetoothScan) -> BluetoothScanEvents {
        let events = BluetoothScanEvents()
        // The task holds the feed, not the sequence: the scan stops when the sequence is dropped.
        let feed = events.feed
        let bus = self.bus
        let task = Task {
            do {
                try await Scanner(scan: scan, bus: bus, continuation: feed).run()
                feed.finish(nil)
            } catch {
                feed.finish(error)
            }
        }
        feed.onTermination { task.cancel() }
        return events
    }
}

/// The events of a scan (``BluetoothPlugin/scan(_:)``), in order, with a device's unread update
/// replaced by its newer one. Ending the iteration (or cancelling its task) stops the scan.
public struct BluetoothScanEvents: AsyncSequence, Sendable {
    /// A discovery, an update or an expiry.
    public typealias Element = BluetoothScan.Event
    let feed = Feed()
    /// Held by the sequence and its iterator: when both are gone, the scan stops.
    private let lifetime: Lifetime

    init() { lifetime = Lifetime(feed) }

    /// Reads the next event on each call.
    public struct AsyncIterator: AsyncIteratorProtocol {
        fileprivate let lifetime: Lifetime
        /// The next event; `nil` once the scan has ended (its `end` reached). Throws the error
        /// that ended the scan (`TransportError`: no bus, no bluetoothd, no powered adapter).
        public mutating func next() async throws -> BluetoothScan.Event? { try await lifetime.feed.next() }
    }

    /// An iterator over the events; use one per scan.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(lifetime: lifetime) }

    fileprivate final class Lifetime: Sendable {
        let feed: Feed
        init(_ feed: Feed) { self.feed = feed }
        deinit { feed.finish(nil) }
    }

    /// The buffer between the scanner and the reader.
    final class Feed: Sendable {
        private struct State {
            var events: [BluetoothScan.Event] = []
            var reader: CheckedContinuation<BluetoothScan.Event?, any Error>?
            var end: Result<Void, any Error>?
            var onTermination: (@Sendable () -> Void)?
        }
        /// Guards the events, the one parked reader and the end.
        private let state = Locked(State())

        /// Hands `event` to the reader, or queues it; an update replaces the same device's unread update.
        func yield(_ event: BluetoothScan.Event) {
            let reader = state.withLock { state -> CheckedContinuation<BluetoothScan.Event?, any Error>? in
                guard state.end == nil else { return nil }
                if let reader = state.reader {
                    state.reader = nil
                    return reader
                }
                // Replaces the device's last unread event only when that is an update: an update
                // never moves before the same device's expiry or rediscovery.
                if case .updated(let device) = event, let index = state.events.lastIndex(where: { $0.device.address == device.address }),
                   case .updated = state.events[index] {
                    state.events[index] = event
                } else {
                    state.events.append(event)
                }
                return nil
            }
            reader?.resume(returning: event)
        }

        /// Ends the sequence after the queued events, with `error` or normally.
        func finish(_ error: (any Error)?) {
            let (reader, termination) = state.withLock { state -> (CheckedContinuation<BluetoothScan.Event?, any Error>?, (@Sendable () -> Void)?) in
                guard state.end == nil else { return (nil, nil) }
                state.end = error.map { .failure($0) } ?? .success(())
                defer { state.reader = nil; state.onTermination = nil }
                return (state.events.isEmpty ? state.reader : nil, state.onTermination)
            }
            if let reader {
                if let error { reader.resume(throwing: error) } else { reader.resume(returning: nil) }
            }
            termination?()
        }

        func onTermination(_ body: @escaping @Sendable () -> Void) {
            state.withLock { $0.onTermination = body }
        }

        func next() async throws -> BluetoothScan.Event? {
            try await withTaskCancellationHandler {
                try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<BluetoothScan.Event?, any Error>) in
                    let ready = state.withLock { state -> Result<BluetoothScan.Event?, any Error>? in
                        if !state.events.isEmpty { return .success(state.events.removeFirst()) }
                        switch state.end {
                        case .success?: return .success(nil)
                        case .failure(let error)?: return .failure(error)
                        case nil:
                            guard state.reader == nil else {
                                return .failure(TransportError(.misuse, "a scan's events have one reader; this one was being read already"))
                            }
                            state.reader = continuation
                            return nil
                        }
                    }
                    if let ready { continuation.resume(with: ready) }
                }
            } onCancel: {
                // The reader stops (its next() returns nil), and the scan with it.
                finish(nil)
            }
        }
    }
}

/// One scan's state: what has been seen, and when.
private struct Scanner {
    let scan: BluetoothScan
    let bus: DBusConnection.Bus
    let continuation: BluetoothScanEvents.Feed

    enum Input: Sendable {
        case added(String, [String: DBusValue])
        case changed(String, [String: DBusValue])
        case removed(String)
        case tick
    }

    /// Keys whose change means a fresh advertisement or inquiry result.
    static let sightings: Set<String> = ["RSSI", "ManufacturerData", "ServiceData", "TxPower"]

    func run() async throws {
        var services: [String] = []
        for service in scan.services {
            guard let uuid = BluetoothUUID.serialServices[service.lowercased()]?.service ?? BluetoothUUID.normalize(service) else {
                throw TransportError(.misuse, "scan: '\(service)' is not a service UUID (FFE0, 6E400001-B5A3-F393-E0A9-E50E24DCCA9E) or a known short name")
            }
            services.append(uuid)
        }
        let bluez = try await BlueZ.shared(bus)
        let adapter = try BlueZ.adapter(named: scan.adapter, among: try await bluez.adapters())
        // Unbounded, and need not be: the loop in run(inputs:…) waits for nothing but the next
        // input (never for the application: Feed keeps a device's newest update), so this holds
        // only what arrives while it handles one.
        let (inputs, feed) = AsyncStream<Input>.makeStream()
        let manager = try await bluez.bus.signals(DBusMatch(sender: BlueZ.service, interface: BlueZ.objectManager),
                                                  buffering: .all(limit: BlueZ.objectSignalLimit))
        let properties = try await bluez.bus.signals(DBusMatch(sender: BlueZ.service, pathNamespace: adapter.path,
                                                               interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged"),
                                                     buffering: .all(limit: BlueZ.objectSignalLimit))
        // The devices bluetoothd knows, read after subscribing: a change in between is not missed.
        let managed = try await bluez.managedObjects(about: "scanning")
        var filter: [String: DBusValue] = [
            "Transport": .string(scan.bearer == .le ? "le" : scan.bearer == .classic ? "bredr" : "auto"),
            // Every advertisement, so that a present device keeps being seen (see the header).
            "DuplicateData": .bool(scan.duplicates || scan.expiry != nil),
        ]
        if !services.isEmpty { filter["UUIDs"] = .array(element: "s", services.map { .string($0) }) }
        if let rssi = scan.minimumRSSI { filter["RSSI"] = .int16(Int16(clamping: rssi)) }
        let session = try await bluez.discoveries.start(bluez, adapter: adapter, filter: filter)
        do {
            try await run(inputs: inputs, feed: feed, manager: manager, properties: properties, adapter: adapter, known: managed.devices, services: services)
            await bluez.discoveries.stop(bluez, adapter: adapter, session: session)
        } catch {
            await bluez.discoveries.stop(bluez, adapter: adapter, session: session)
            throw error
        }
    }

    private func run(inputs: AsyncStream<Input>, feed: AsyncStream<Input>.Continuation, manager: AsyncThrowingStream<DBusSignal, any Error>,
                     properties: AsyncThrowingStream<DBusSignal, any Error>, adapter: BluetoothAdapter,
                     known devices: [String: [String: DBusValue]], services: [String]) async throws {
        let feeders = Task {
            await withTaskGroup(of: Void.self) { group in
                group.addTask {
                    do {
                        for try await signal in manager {
                            guard case .objectPath(let path)? = signal.values.first, path.hasPrefix(adapter.path + "/") else { continue }
                            if signal.member == "InterfacesAdded", let device = signal.values.dropFirst().first?.dictionary?[BlueZ.deviceInterface]?.dictionary {
                                feed.yield(.added(path, device))
                            } else if signal.member == "InterfacesRemoved", signal.values.dropFirst().first?.strings?.contains(BlueZ.deviceInterface) == true {
                                feed.yield(.removed(path))
                            }
                        }
                    } catch {}
                    feed.finish()
                }
                group.addTask {
                    do {
                        for try await signal in properties where signal.values.first?.text == BlueZ.deviceInterface {
                            if let changed = signal.values.dropFirst().first?.dictionary { feed.yield(.changed(signal.path, changed)) }
                        }
                    } catch {}
                    feed.finish()
                }
                if let expiry = scan.expiry {
                    group.addTask {
                        while !Task.isCancelled {
                            try? await Task.sleep(for: max(expiry / 4, .milliseconds(100)))
                            feed.yield(.tick)
                        }
                    }
                }
                if case .after(let duration) = scan.end {
                    group.addTask {
                        try? await Task.sleep(for: duration)
                        feed.finish()
                    }
                }
            }
        }
        defer { feeders.cancel() }

        var known = devices
        var reported: [String: BluetoothDiscovery] = [:]
        /// Devices the scan's `decide` turned away: not reported again in this scan.
        var ignored: Set<String> = []
        var lastSeen: [String: ContinuousClock.Instant] = [:]
        for await input in inputs {
            try Task.checkCancellation()
            var path: String
            switch input {
            case .added(let added, let properties):
                path = added
                known[path] = properties
                lastSeen[path] = .now
            case .changed(let changed, let properties):
                path = changed
                known[path, default: [:]].merge(properties) { $1 }
                if !Self.sightings.isDisjoint(with: properties.keys) { lastSeen[path] = .now }
            case .removed(let removed):
                known[removed] = nil
                lastSeen[removed] = nil
                if let gone = reported.removeValue(forKey: removed) { continuation.yield(.expired(gone)) }
                continue
            case .tick:
                guard let expiry = scan.expiry else { continue }
                let now = ContinuousClock.now
                for (path, device) in reported where (lastSeen[path] ?? now) < now - expiry {
                    reported[path] = nil
                    continuation.yield(.expired(device))
                }
                continue
            }
            guard lastSeen[path] != nil, let properties = known[path] else { continue }
            let discovery = Self.discovery(path: path, properties, adapter: adapter, services: services)
            guard !ignored.contains(path), matches(discovery, services: services) else { continue }
            if reported[path] == nil {
                switch scan.decide?(discovery) ?? .continue {
                case .ignore:
                    ignored.insert(path)
                    continue
                case .stop:
                    continuation.yield(.discovered(discovery))
                    return
                case .continue:
                    reported[path] = discovery
                    continuation.yield(.discovered(discovery))
                    if case .firstMatch = scan.end { return }
                }
            } else if scan.duplicates {
                if let previous = reported[path], !Self.isChange(from: previous, to: discovery, threshold: scan.rssiThreshold) { continue }
                reported[path] = discovery
                continuation.yield(.updated(discovery))
            } else {
                reported[path] = discovery
            }
        }
        try Task.checkCancellation()
    }

    /// Whether a sighting is worth an update: its data or name changed, or its RSSI moved by at
    /// least `threshold` dBm from the last one reported (any move without a threshold).
    static func isChange(from previous: BluetoothDiscovery, to next: BluetoothDiscovery, threshold: Int?) -> Bool {
        guard let threshold else { return true }
        if previous.manufacturerData != next.manufacturerData || previous.serviceData != next.serviceData || previous.name != next.name
            || previous.serviceUUIDs != next.serviceUUIDs {
            return true
        }
        guard let before = previous.rssi, let now = next.rssi else { return previous.rssi != next.rssi }
        return abs(now - before) >= threshold
    }

    func matches(_ device: BluetoothDiscovery, services: [String]) -> Bool {
        if !services.isEmpty && Set(services).isDisjoint(with: device.serviceUUIDs) { return false }
        if let minimum = scan.minimumRSSI, (device.rssi ?? Int.min) < minimum { return false }
        if let prefix = scan.namePrefix, !(device.name ?? "").hasPrefix(prefix) { return false }
        return true
    }

    /// The discovery for a device, with a URL that connects: ble:// with the service the scan asked
    /// for or a known serial service it offers; else rfcomm:// for a classic device (it has a Class of
    /// Device); else ble:// with the first service it offers, or SERVICE to fill in.
    static func discovery(path: String, _ properties: [String: DBusValue], adapter: BluetoothAdapter, services: [String]) -> BluetoothDiscovery {
        let device = BlueZ.device(path: path, properties)
        let address = device.address.uppercased()
        let serial = BluetoothUUID.serialServices.values.map(\.service)
        let url: String
        func ble(_ service: String) -> String {
            let name = BluetoothUUID.serialServices.first { $0.value.service == service }?.key ?? BluetoothUUID.short(service)
            return TransportURL(scheme: "ble", host: name, path: "/" + address, query: [("adapter", adapter.name)]).description
        }
        if let service = services.first(where: device.uuids.contains) ?? device.uuids.first(where: serial.contains) {
            url = ble(service)
        } else if properties["Class"] != nil {
            url = TransportURL(scheme: "rfcomm", host: address, query: [("adapter", adapter.name)]).description
        } else if let service = device.uuids.first {
            url = ble(service)
        } else {
            url = TransportURL(scheme: "ble", host: "SERVICE", path: "/" + address, query: [("adapter", adapter.name)]).description
        }
        return BluetoothDiscovery(address: address, addressType: device.addressType, name: device.name ?? device.alias, rssi: device.rssi,
                                  serviceUUIDs: device.uuids, manufacturerData: device.manufacturerData, serviceData: device.serviceData,
                                  adapter: adapter.name, url: url)
    }
}
