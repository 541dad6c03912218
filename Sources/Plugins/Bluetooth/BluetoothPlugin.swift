// rfcomm:// and ble:// — Bluetooth through BlueZ: bluetoothd's D-Bus API for adapters and devices
// (BlueZ.swift), kernel sockets for the data (BluetoothSocket.swift). Never raw HCI: it fights
// bluetoothd ("Command Disallowed").
//
// Grammar (each form is a mode of its scheme: an option another form uses is refused):
//   rfcomm://MAC:CHANNEL[?adapter=hciN&security=…]       Bluetooth Classic, RFCOMM channel 1…30
//   rfcomm://MAC[?adapter=hciN&uuid=UUID&security=…]     the channel found through SDP (ServiceDiscovery.swift)
//   rfcomm://any|ADAPTER-MAC[:CHANNEL][?uuid=…&name=…&backlog=N&security=…] (listening)
//                                                        a service published through BlueZ (SerialPortProfile.swift)
//   ble://SERVICE:PSM[?adapter=hciN&advertise=BOOL&receiveMTU=N&security=…&backlog=N] (listening)
//                                                        an LE L2CAP listener that advertises SERVICE (LEListener.swift)
//   ble://SERVICE:PSM/MAC[?adapter=hciN&addressType=…&receiveMTU=N&security=…]
//                                                        an LE L2CAP connection-oriented channel
//   ble://SERVICE/MAC[?adapter=hciN&rx=UUID&tx=UUID&acquire=auto|never]
//                                                        GATT serial (GattSerial.swift)
//   ble://SERVICE[:PSM]                                  no device: the strongest advertising SERVICE (chooseDevice)
//   ble://SERVICE[?adapter=hciN&rx=UUID&tx=UUID&advertise=BOOL] (listening)
//                                                        a GATT serial peripheral (GattServer.swift)
//   ea://…                                               refused: Apple's External Accessory has no Linux counterpart
// security= asks the kernel for an encrypted (medium) or MITM-protected (high) link; the kernel
// refuses an RFCOMM connect it cannot secure, and an L2CAP channel's level is read back and checked.
// An LE listener admits no peer below it; an RFCOMM listener takes low or medium (bluetoothd's
// Profile API asks for medium at most, and hands over sockets that cannot tell). On a GATT serial
// connect, medium pairs with the device unless it is paired (bluetoothd then encrypts its link);
// high is refused there: BlueZ 5.66's D-Bus API cannot ask for or tell a MITM-protected LE bond. A
// GATT serial listener puts BlueZ's encrypt-* (medium) or encrypt-authenticated-* (high) flags on
// its characteristics, so a central must pair before it writes or subscribes.

import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
import TransportKitDBus
@_spi(Plugins) import TransportKitLinux

/// The `rfcomm://` and `ble://` schemes, Bluetooth adapters in the device listing, and their
/// arrival and removal as device events.
///
/// ```swift
/// let spp = try await Transport.connect(to: "rfcomm://00:AA:01:01:00:01")   // channel found through SDP
/// let coc = try await Transport.connect(to: "ble://FFF0:128/00:AA:01:01:00:01?adapter=hci0")
/// print(coc.metadata.maximumWriteSize ?? 0)   // the channel's send MTU
///
/// let server = try await Transport.listen(on: "rfcomm://any")    // published through BlueZ (SDP)
/// print(server.url.port ?? 0)                                    // the channel it took
/// for try await peer in server.connections { try await peer.write("hello\r\n") }
/// ```
public struct BluetoothPlugin: TransportPlugin {
    /// The bus bluetoothd is on.
    public let bus: DBusConnection.Bus

    /// The plugin; `Transport.builtInPlugins` has one on the system bus. Another `bus` is for a
    /// bluetoothd (or a stand-in for it) on a private bus.
    public init(bus: DBusConnection.Bus = .system) {
        self.bus = bus
    }

    static let adapter = URLOption.string("adapter", help: "The Bluetooth adapter to use, by name (hci1) or address (default: the first powered one)")
    static let addressType = URLOption.choice("addressType", default: AddressType.bluez,
                                              help: "ble://: the device's LE address type; bluez (default) asks bluetoothd, discovering the device if needed")
    static let receiveMTU = URLOption.integer("receiveMTU", in: 23...65535,
                                              help: "ble://…:PSM: the receive MTU to offer (default: the kernel's, 672)").formerly("mtu")
    static let security = URLOption.choice("security", default: BluetoothSocket.Security.low,
                                           help: "Link security: low accepts any link; medium (encrypted) and high (paired with MITM protection) may start pairing, which needs an agent. Listening: the least a peer's link must have")

    static let uuid = URLOption.string("uuid", help: "rfcomm://: the service to find through SDP when the URL has no channel, and to publish when listening (default: 1101, the Serial Port Profile)")
    static let name = URLOption.string("name", help: "rfcomm:// listening: the service name in the published SDP record (default: TransportKit serial port)")
    static let advertise = URLOption.bool("advertise", default: true,
                                          help: "ble:// listening (ble://SERVICE:PSM, ble://SERVICE): advertise SERVICE (connectable) on the adapter while listening, so centrals can find and reach it")
    static let backlog = URLOption.integer("backlog", in: 1...128, default: 8, help: "Listening: connections waiting to be accepted before more are refused")

    static let rx = URLOption.string("rx", help: "ble:// GATT serial: the characteristic that brings the device's bytes (notify or indicate); default: the first in the service that notifies. Listening: the one notified to the central (nus and hm10 have defaults)")
    static let tx = URLOption.string("tx", help: "ble:// GATT serial: the characteristic written with ours; default: the first that takes writes without response, else with response. Listening: the one the central writes (nus and hm10 have defaults)")
    static let acquire = URLOption.choice("acquire", default: Acquire.auto,
                                          help: "ble:// GATT serial: auto uses the descriptors BlueZ hands out (AcquireNotify, AcquireWrite) where offered; never goes through D-Bus (StartNotify, WriteValue)")

    enum Acquire: String, CaseIterable, Sendable {
        case auto, never
    }

    enum AddressType: String, CaseIterable, Sendable {
        case bluez, `public`, random
    }

    /// The `rfcomm` and `ble` schemes (both able to listen), and `ea`, which Linux refuses.
    public var schemes: [Scheme] {
        [
            Scheme(SchemeDescriptor(
                scheme: "rfcomm",
                summary: "Bluetooth Classic RFCOMM (Serial Port Profile) through BlueZ",
                grammar: "rfcomm://MAC[:CHANNEL][?adapter=hciN&uuid=UUID&security=low|medium|high]; "
                    + "listening: rfcomm://any|ADAPTER-MAC[:CHANNEL][?uuid=UUID&name=NAME&backlog=N&security=…]",
                examples: ["rfcomm://00:0A:3A:22:68:73", "rfcomm://00:0A:3A:22:68:73:1", "rfcomm://00:0A:3A:22:68:73?uuid=1101&adapter=hci1",
                           "rfcomm://any?security=medium (listening)"],
                host: .required, port: .optional, portRange: 1...30, path: .forbidden,
                options: [Self.adapter, Self.uuid, Self.name, Self.backlog, Self.security],
                modes: [SchemeMode("rfcomm:// connection to a channel", form: "rfcomm://MAC:CHANNEL", port: .required,
                                   options: [Self.adapter, Self.security]),
                        SchemeMode("rfcomm:// connection found through SDP", form: "rfcomm://MAC", port: .forbidden,
                                   options: [Self.adapter, Self.uuid, Self.security]),
                        SchemeMode("rfcomm:// listener", role: .listen, form: "rfcomm://any|ADAPTER-MAC[:CHANNEL]",
                                   options: [Self.adapter, Self.uuid, Self.name, Self.backlog, Self.security])],
                reachesDevice: true
            ), check: { request in try BluetoothConnector.checkRFCOMM(request) },
               connect: { [bus] in try await BluetoothConnector.rfcomm($0, bus: bus) },
               listen: { [bus] in try await RFCOMMListener.listen($0, bus: bus) }),
            Scheme(SchemeDescriptor(
                scheme: "ble",
                summary: "Bluetooth LE through BlueZ: GATT serial (ble://SERVICE/DEVICE) or an L2CAP connection-oriented channel (ble://SERVICE:PSM/DEVICE); no DEVICE: the strongest advertiser of SERVICE",
                grammar: "ble://SERVICE[:PSM][/MAC][?adapter=hciN&rx=UUID&tx=UUID&acquire=auto|never&addressType=bluez|public|random&receiveMTU=N&security=low|medium|high]; "
                    + "listening: ble://SERVICE:PSM[?adapter=hciN&advertise=true|false&receiveMTU=N&security=…&backlog=N], "
                    + "or a GATT serial peripheral: ble://SERVICE[?adapter=hciN&rx=UUID&tx=UUID&advertise=true|false&security=…]",
                examples: ["ble://nus/E3:2E:44:66:A2:4A", "ble://FFE0/E3:2E:44:66:A2:4A?rx=FFE1&tx=FFE1",
                           "ble://FFF0:128/E3:2E:44:66:A2:4A", "ble://FFF0:128/00:AA:01:01:00:01?adapter=hci0&receiveMTU=1024", "ble://nus",
                           "ble://FFF0:128?adapter=hci1 (listening)", "ble://nus?adapter=hci1 (listening: a GATT serial peripheral)"],
                host: .required, port: .optional, portRange: 1...255, path: .optional,
                options: [Self.adapter, Self.rx, Self.tx, Self.acquire, Self.addressType, Self.receiveMTU, Self.security, Self.advertise, Self.backlog],
                modes: [SchemeMode("ble:// L2CAP connection", form: "ble://SERVICE:PSM[/MAC]", port: .required,
                                   options: [Self.adapter, Self.addressType, Self.receiveMTU, Self.security]),
                        SchemeMode("ble:// GATT serial connection", form: "ble://SERVICE[/MAC]", port: .forbidden,
                                   options: [Self.adapter, Self.rx, Self.tx, Self.acquire, Self.security]),
                        SchemeMode("ble:// L2CAP listener", role: .listen, form: "ble://SERVICE:PSM", port: .required,
                                   options: [Self.adapter, Self.advertise, Self.receiveMTU, Self.security, Self.backlog]),
                        SchemeMode("ble:// GATT serial listener", role: .listen, form: "ble://SERVICE", port: .forbidden,
                                   options: [Self.adapter, Self.rx, Self.tx, Self.advertise, Self.security])],
                reachesDevice: true
            ), check: { request in try BluetoothConnector.checkBLE(request) },
               connect: { [bus] in try await BluetoothConnector.ble($0, bus: bus) },
               listen: { [bus] request in
                   request.url.port == nil ? try await GattServerListener.listen(request, bus: bus) : try await LEListener.listen(request, bus: bus)
               }),
            Scheme(SchemeDescriptor(
                scheme: "ea",
                summary: "Apple External Accessory: not available on Linux (use rfcomm:// or usb://)",
                grammar: "ea://PROTOCOL (refused on Linux)",
                examples: ["ea://com.example.protocol"],
                host: .optional, port: .forbidden, path: .optional,
                options: []
            ), connect: { request in
                throw TransportError(.unsupported, "\(request.url.shown): ea:// is Apple's External Accessory framework (MFi accessories on iOS), which Linux "
                                     + "does not have. The same accessories are reached here over Bluetooth Classic as rfcomm://MAC:CHANNEL, "
                                     + "or over USB as usb://VID:PID")
            }),
        ]
    }

    /// The Bluetooth adapters bluetoothd manages. Quietly none when this machine has no system bus
    /// or no bluetoothd (no Bluetooth to offer); an error when the D-Bus policy refuses this user.
    public func devices(includeAll: Bool) async throws -> [DeviceRecord] {
        do {
            return try await BlueZ.shared(bus).objects().adapters.map(Self.record)
        } catch let error as TransportError where error.kind == .notFound {
            return []
        }
    }

    /// Adapters arriving and going away (a USB dongle plugged in, a controller removed), from
    /// bluetoothd's InterfacesAdded and InterfacesRemoved, subscribed when this returns (the
    /// adapters are listed afterwards, by the stream's task, so that a removal can say what went
    /// away). `nil` when there is no system bus (its socket file is missing); the sequence ends at
    /// once, without an error, when the bus is there but cannot be connected to (the connection
    /// is opened on `Blocking`'s pool, off the caller's thread).
    public func deviceEvents(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error>? {
        guard BlueZ.mayBeReachable(bus) else { return nil }
        return await AdapterEvents.stream(bus)
    }

    static func record(_ adapter: BluetoothAdapter) -> DeviceRecord {
        DeviceRecord(url: "adapter=\(adapter.name)", scheme: "bluetooth", devnode: nil, name: adapter.name,
                     product: "Bluetooth adapter \(adapter.address)\(adapter.powered ? "" : " (powered off)")",
                     driver: "bluetooth", sysPath: "/sys/class/bluetooth/\(adapter.name)",
                     properties: ["address": adapter.address, "powered": String(adapter.powered), "discoverable": String(adapter.discoverable),
                                  "index": adapter.index.map(String.init) ?? "", "alias": adapter.alias ?? "", "path": adapter.path])
    }
}

/// Adapter arrivals and removals.
enum AdapterEvents {
    /// Events unread before the sequence ends with an error (as many as the signals it reads).
    static let limit = BlueZ.objectSignalLimit

    /// Subscribes before it returns; the adapters are listed and the signals read by a task the
    /// stream owns.
    static func stream(_ bus: DBusConnection.Bus) async -> AsyncThrowingStream<DeviceEvent, any Error> {
        // Bounded: a reader that falls `limit` events behind gets an error, not a growing queue.
        let (stream, continuation) = AsyncThrowingStream<DeviceEvent, any Error>.makeStream(bufferingPolicy: .bufferingOldest(limit))
        let overflow = TransportError(.io, "the reader of Bluetooth adapter events fell \(limit) events behind; list the adapters again")
        // No bus to be had: no events to offer, as `devices` lists none.
        guard let bluez = try? await BlueZ.shared(bus) else {
            continuation.finish()
            return stream
        }
        let signals: AsyncThrowingStream<DBusSignal, any Error>
        do {
            // Every object bluetoothd adds or removes (a scan's devices too), read as they come.
            signals = try await bluez.bus.signals(DBusMatch(sender: BlueZ.service, interface: BlueZ.objectManager),
                                                  buffering: .all(limit: BlueZ.objectSignalLimit))
        } catch {
            continuation.finish(throwing: error)
            return stream
        }
        let task = Task {
            // Known adapters, so a removal can say what went away. Listed here, not before the
            // call returns: a bluetoothd that is slow to answer (restarting) would otherwise hold
            // up every plugin's events (the registry waits for all to subscribe), and the
            // subscription above already buffers what happens meanwhile. An adapter removed
            // before the listing is reported with what its object path says.
            var known: [String: BluetoothAdapter] = [:]
            if let adapters = try? await bluez.objects().adapters {
                for adapter in adapters { known[adapter.path] = adapter }
            }
            do {
                for try await signal in signals {
                    guard case .objectPath(let path)? = signal.values.first else { continue }
                    switch signal.member {
                    case "InterfacesAdded":
                        guard let properties = signal.values.dropFirst().first?.dictionary?[BlueZ.adapterInterface]?.dictionary else { continue }
                        let adapter = BlueZ.adapter(path: path, properties)
                        known[path] = adapter
                        if case .dropped = continuation.yield(DeviceEvent(.added, BluetoothPlugin.record(adapter))) { throw overflow }
                    case "InterfacesRemoved":
                        guard signal.values.dropFirst().first?.strings?.contains(BlueZ.adapterInterface) == true else { continue }
                        let adapter = known.removeValue(forKey: path) ?? BluetoothAdapter(
                            path: path, name: String(path.split(separator: "/").last ?? ""), index: nil, address: "",
                            alias: nil, powered: false, discoverable: false, discovering: false)
                        if case .dropped = continuation.yield(DeviceEvent(.removed, BluetoothPlugin.record(adapter))) { throw overflow }
                    default:
                        continue
                    }
                }
                continuation.finish()
            } catch {
                continuation.finish(throwing: error)
            }
        }
        continuation.onTermination = { _ in task.cancel() }
        return stream
    }
}

/// Connecting rfcomm:// and ble://.
enum BluetoothConnector {
    /// What a server checks about an rfcomm:// URL before it listens: everything but the radio.
    /// Only what can fail is read here: connect runs this first, and an option read marks it used,
    /// which would hide from the registry a connect path that forgot it (its unread-option check).
    static func checkRFCOMM(_ request: ConnectRequest) throws {
        _ = try adapterName(request)
        if request.mode?.role == .listen {
            _ = try RFCOMMListener.localHost(request)
            _ = try RFCOMMListener.security(request)
            _ = try serviceUUID(request)
        } else {
            _ = try deviceAddress(request.host, request)
            if request.url.port == nil { _ = try serviceUUID(request) }
        }
    }

    /// What a server checks about a ble:// URL before it listens: the service, the device's
    /// address, the characteristics, the adapter's name (only what can fail, as in checkRFCOMM).
    static func checkBLE(_ request: ConnectRequest) throws {
        _ = try GattSerial.service(request)
        _ = try adapterName(request)
        if request.mode?.role == .listen {
            if request.url.port == nil {
                guard request.url.path.drop(while: { $0 == "/" }).isEmpty else {
                    throw TransportError(.invalidURL, "\(request.url.shown): a listener takes no device; choose the adapter with adapter=hciN: ble://\(request.host)")
                }
                _ = try GattServerListener.characteristics(request)
            } else {
                _ = try LEListener.psm(request)
            }
            return
        }
        _ = try device(request)
        if request.url.port == nil {
            _ = try GattSerial.characteristicOption(request, BluetoothPlugin.rx)
            _ = try GattSerial.characteristicOption(request, BluetoothPlugin.tx)
            if request[BluetoothPlugin.security] == .high {
                throw TransportError(.unsupported, "\(request.url.shown): security=high on a GATT serial connect: BlueZ's D-Bus API can neither ask for "
                                     + "nor tell a MITM-protected LE bond. Pair with an agent that can show or enter a passkey "
                                     + "(`transportkit gatt ADDRESS pair`, BluetoothPairingAgent with .keyboardDisplay), then use security=medium")
            }
        }
    }

    /// `adapter=`: an adapter's name (hci0) or address; `nil` when not given (the first powered one).
    static func adapterName(_ request: ConnectRequest) throws -> String? {
        guard let name = request[BluetoothPlugin.adapter] else { return nil }
        let isName = name.hasPrefix("hci") && name.utf8.count > 3 && name.utf8.count <= 6 && name.utf8.dropFirst(3).allSatisfy { $0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "9") }
        guard isName || BluetoothAddress(name) != nil else {
            throw TransportError(.invalidURL, "\(request.url.shown): adapter='\(TransportError.printable(name, limit: 40))' names no adapter: "
                                 + "give its name (hci0) or its address (00:1A:7D:DA:71:13); `transportkit list` shows the adapters. Grammar: \(request.scheme.grammar)")
        }
        return name
    }

    /// A device's address as a URL gives it.
    static func deviceAddress(_ text: String, _ request: ConnectRequest) throws -> BluetoothAddress {
        guard let device = BluetoothAddress(text) else {
            throw TransportError(.invalidURL, "\(request.url.shown): '\(TransportError.printable(text, limit: 40))' is not a Bluetooth address "
                                 + "(six pairs of hexadecimal digits, 00:0A:3A:22:68:73). Grammar: \(request.scheme.grammar)")
        }
        return device
    }

    /// The device of a ble:// URL (its path), or `nil` when it names none (the strongest advertiser).
    static func device(_ request: ConnectRequest) throws -> BluetoothAddress? {
        let text = String(request.url.path.drop { $0 == "/" })
        return text.isEmpty ? nil : try deviceAddress(text, request)
    }

    static func rfcomm(_ request: ConnectRequest, bus: DBusConnection.Bus) async throws -> Connection {
        let url = request.url
        try checkRFCOMM(request)   // every part, before any I/O
        let device = try deviceAddress(request.host, request)
        let service = url.port == nil ? try serviceUUID(request) : ServiceDiscovery.serialPort
        let security = request[BluetoothPlugin.security]
        let (adapter, local, known, _) = try await resolve(request, bluez: try await BlueZ.shared(bus), device: device)
        let describing = url.description
        let channel: Int
        let fd: SystemPackage.FileDescriptor
        if let port = url.port {
            channel = port
            // The connect and the SDP search have no timer of their own: the registry's deadline bounds them.
            fd = try await BluetoothSocket.connectRFCOMM(adapter: local, device: device, channel: UInt8(port), security: security, describing: describing)
        } else {
            (channel, fd) = try await ServiceDiscovery.withRFCOMMChannel(adapter: local, device: device, service: service,
                                                                        describing: describing) { found in
                request.logger.debug("SDP: \(device) offers \(BluetoothUUID.short(service)) on RFCOMM channel \(found)")
                return (Int(found), try await BluetoothSocket.connectRFCOMM(adapter: local, device: device, channel: found, security: security,
                                                                             describing: describing))
            }
        }
        // RFCOMM has no half-close an application relies on: any end this side did not ask for
        // (the peer closed, the link dropped, the adapter went away) is the link gone.
        let backend = try await DescriptorChannel.adoptSocket(fd, describing: describing, buffering: request.buffering, supportsHalfClose: false,
                                                              hangUp: device.hangUp)
        var metadata = metadata(device: known, address: device, adapter: adapter)
        metadata.extra["addressType"] = "public"
        metadata.extra["channel"] = String(channel)
        if url.port == nil { metadata.extra["service"] = BluetoothUUID.short(service) }
        // The level asked for: the kernel refused the connect if the link could not have it.
        metadata.extra["security"] = security.rawValue
        return Connection(url: url, backend: backend, metadata: metadata)
    }

    /// The service an rfcomm:// URL names with `uuid=` (default: the Serial Port Profile), normalized.
    static func serviceUUID(_ request: ConnectRequest) throws -> String {
        guard let text = request[BluetoothPlugin.uuid] else { return ServiceDiscovery.serialPort }
        guard let uuid = BluetoothUUID.normalize(text) else {
            throw TransportError(.invalidURL, "\(request.url.shown): uuid=\(TransportError.printable(text, limit: 40)) is not a service UUID "
                                 + "(1101, 32-bit, or 128-bit written 8-4-4-4-12 or without dashes)")
        }
        return uuid
    }

    static func ble(_ request: ConnectRequest, bus: DBusConnection.Bus) async throws -> Connection {
        let url = request.url
        // Every part is checked before any I/O, the service also when a device is given.
        try checkBLE(request)
        let named = try device(request)
        let device: BluetoothAddress
        if let named {
            device = named
        } else {
            device = try deviceAddress(try await chooseDevice(request, bus: bus), request)
        }
        guard let psm = url.port else {
            return try await GattSerial.connect(request, bus: bus, device: device)
        }
        let bluez = try await BlueZ.shared(bus)
        let (adapter, local, seen, _) = try await resolve(request, bluez: bluez, device: device)
        var known = seen
        let addressType: String
        switch request[BluetoothPlugin.addressType] {
        case .public: addressType = "public"
        case .random: addressType = "random"
        case .bluez:
            let found: BluetoothDevice
            if let seen {
                found = seen
            } else {
                found = try await bluez.discover(address: device.description, on: adapter, transport: "le", deadline: request.deadline,
                                                 timeout: request.timeout)
            }
            known = found
            addressType = found.addressType
        }
        let describing = url.description
        let channel = try await BluetoothSocket.connectL2CAP(adapter: local, device: device, addressType: addressType, psm: UInt16(psm),
                                                             receiveMTU: request[BluetoothPlugin.receiveMTU], security: request[BluetoothPlugin.security],
                                                             describing: describing)
        let backend = PacketSocketBackend(adopting: channel.fd, describing: describing, receiveSize: channel.receiveMTU,
                                          maximumWriteSize: channel.sendMTU, watermarks: request.buffering.inbound, hangUp: device.hangUp)
        var metadata = metadata(device: known, address: device, adapter: adapter)
        metadata.maximumWriteSize = channel.sendMTU
        metadata.extra["addressType"] = addressType
        metadata.extra["psm"] = String(psm)
        metadata.extra["sendMTU"] = String(channel.sendMTU)
        metadata.extra["receiveMTU"] = String(channel.receiveMTU)
        metadata.extra["security"] = channel.security
        return Connection(url: url, backend: backend, metadata: metadata)
    }

    /// How long a ble:// URL without a device keeps listening after the first match, for a stronger one.
    static let choiceWindow = Duration.seconds(1)

    /// The reply timeout of a D-Bus call inside a connect whose `deadline` is enforced around it
    /// (by the registry, or by `BluetoothPeripheral.connect`): a few seconds past the deadline, so
    /// that the deadline's error is the one timeout reported (it cancels the call); `otherwise`
    /// when the connect has no deadline.
    static func replyTimeout(enforcedBy deadline: ContinuousClock.Instant?, otherwise: Duration?) -> Duration? {
        deadline.map { max($0 - ContinuousClock.now, .zero) + .seconds(5) } ?? otherwise
    }

    /// The device a ble:// URL without one connects to: an LE scan for the URL's service; of the
    /// devices seen within ``choiceWindow`` of the first match, the one with the strongest signal
    /// (the first seen on a tie). Never every match in turn.
    static func chooseDevice(_ request: ConnectRequest, bus: DBusConnection.Bus) async throws -> String {
        // GATT serial and L2CAP URLs name the service alike: a UUID, or nus / hm10.
        let service = try GattSerial.service(request).uuid
        let plugin = BluetoothPlugin(bus: bus)
        let adapter = try adapterName(request)
        let started = ContinuousClock.now
        let first = try await ConnectRequest.first(of: [{ @Sendable in
            for try await event in plugin.scan(BluetoothScan(services: [service], end: .firstMatch, expiry: nil, adapter: adapter)) {
                if case .discovered(let found) = event { return found }
            }
            return nil
        }], until: request.searchLimit(from: started) ?? started + BlueZ.searchWithoutDeadline)
        guard var best = first else {
            let within = ConnectRequest.searchTime(timeout: request.timeout, orElse: BlueZ.searchWithoutDeadline)
            throw TransportError(.notFound, "\(request.url.shown): no Bluetooth LE device advertising service \(service) found within \(within): "
                                 + "is it switched on, in range and advertising? Give more time with timeout=SECONDS, or the device: ble://\(request.host)\(request.url.port.map { ":\($0)" } ?? "")/MAC")
        }
        for try await event in plugin.scan(BluetoothScan(services: [service], end: .after(choiceWindow), expiry: nil, adapter: adapter)) {
            if case .discovered(let found) = event, (found.rssi ?? Int.min) > (best.rssi ?? Int.min) { best = found }
        }
        request.logger.debug("ble:// without a device: chose \(best.address) (\(best.name ?? "no name"), RSSI \(best.rssi.map(String.init) ?? "?"))")
        return best.address
    }

    /// The shared BlueZ client, the adapter the URL asks for (with its address) and what bluetoothd
    /// knows of `device` on it, from one GetManagedObjects.
    /// The adapter the request names and what bluetoothd knows of `device` on it, from one look at
    /// bluetoothd's objects (returned too, for a caller that follows them with signals).
    static func resolve(_ request: ConnectRequest, bluez: BlueZ, device: BluetoothAddress) async throws
        -> (adapter: BluetoothAdapter, local: BluetoothAddress, known: BluetoothDevice?, objects: BlueZObjects) {
        let objects = try await bluez.objectTree(about: "listing Bluetooth adapters and devices")
        let adapter = try BlueZ.adapter(named: try adapterName(request), among: objects.adapters)
        let known = objects.device(at: BlueZ.devicePath(on: adapter, address: device.description))
        return (adapter, try localAddress(of: adapter, request), known, objects)
    }

    /// The adapter's own address, for binding sockets to it.
    static func localAddress(of adapter: BluetoothAdapter, _ request: ConnectRequest) throws -> BluetoothAddress {
        guard let local = BluetoothAddress(adapter.address) else {
            throw TransportError(.io, "\(request.url.shown): bluetoothd reports adapter \(adapter.name) with the address '\(adapter.address)'")
        }
        return local
    }

    /// CornucopiaStreams' CC_meta: the device's name, address, address type and signal strength where known.
    static func metadata(device: BluetoothDevice?, address: BluetoothAddress, adapter: BluetoothAdapter) -> ConnectionMetadata {
        var metadata = ConnectionMetadata(name: device?.alias ?? device?.name, localAddress: adapter.address, remoteAddress: address.description)
        metadata.extra["adapter"] = adapter.name
        if let rssi = device?.rssi { metadata.extra["rssi"] = String(rssi) }
        if let name = device?.name { metadata.extra["deviceName"] = name }
        return metadata
    }
}

extension BluetoothAddress {
    /// What every connection to this device reports when the link goes without a close of ours
    /// (the peer closed, the link dropped, the adapter went away).
    func disconnected(errno: Errno?, syscall: String?) -> TransportError {
        TransportError(.disconnected, "Bluetooth device \(self) disconnected (the link dropped, the peer closed it, or the adapter went away); "
                       + "reconnect when it is back", errno: errno, syscall: syscall)
    }

    /// ``disconnected(errno:syscall:)`` as a backend's ``HangUp``.
    var hangUp: HangUp { { errno, syscall in disconnected(errno: errno, syscall: syscall) } }
}
