// GattSerial.swift: ble://SERVICE[/DEVICE], the GATT "virtual serial port", through bluetoothd's
// GATT client (BlueZ doc/gatt-api.txt at 5.66: org.bluez.GattService1, GattCharacteristic1).
//
// One characteristic carries the device's bytes to us (notify or indicate), one carries ours to it
// (write without response preferred, else write with response), both in the service the URL names,
// as CornucopiaStreams picks them, or named with rx= and tx=. Each value is one message.
//
// Facts this follows (shared/PLATFORM-NOTES.md):
// - AcquireNotify and AcquireWrite hand out an AF_UNIX SOCK_SEQPACKET descriptor (non-blocking) and
//   the ATT MTU, only when the characteristic shows NotifyAcquired / WriteAcquired. One datagram is
//   one value; the descriptor hangs up when the link drops. Otherwise StartNotify (values arrive as
//   PropertiesChanged on Value) and WriteValue(value, {type: command|request}).
// - A write of MTU − 3 = 514 bytes through AcquireWrite was lost with BlueZ 5.66; 510 passed. Writes
//   are cut to min(MTU − 3, 510) (BlueZ's limit before 5.69; the version is not visible over D-Bus).
// - Device1.Connect picks the bearer last seen; a dual-mode peer may be reached over BR/EDR, where no
//   GATT serial service is. An LE discovery that sees the device right before Connect makes LE the
//   fresher bearer.
// - With bluetoothd's default [GATT] Channels (EATT) notifications were seen out of order: a serial
//   stream needs `Channels = 1` in /etc/bluetooth/main.conf (Docs/Schemes.md says so).

import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
import TransportKitDBus
@_spi(Plugins) import TransportKitLinux

/// Bluetooth UUIDs as BlueZ writes them: 128-bit, lower case.
enum BluetoothUUID {
    /// The Bluetooth base UUID's tail, after the 32-bit part.
    static let baseTail = "-0000-1000-8000-00805f9b34fb"

    /// Well-known GATT serial services by short name: (service, receive characteristic, transmit characteristic).
    static let serialServices: [String: (service: String, rx: String, tx: String)] = [
        // Nordic UART Service: the peripheral notifies on 6e400003 (its TX) and is written on 6e400002 (its RX).
        "nus": ("6e400001-b5a3-f393-e0a9-e50e24dcca9e", "6e400003-b5a3-f393-e0a9-e50e24dcca9e", "6e400002-b5a3-f393-e0a9-e50e24dcca9e"),
        // HM-10 and its clones (CC2541 "transparent UART"): one characteristic both ways.
        "hm10": ("0000ffe0" + baseTail, "0000ffe1" + baseTail, "0000ffe1" + baseTail),
    ]

    /// `FFE0`, `0000FFE0`, a 128-bit UUID with dashes where RFC 4122 puts them (8-4-4-4-12) or
    /// without any, in BlueZ's form; `nil` if none of those (`1101-0000` is not a UUID).
    static func normalize(_ text: String) -> String? {
        let lower = text.lowercased()
        let hex = lower.filter { $0 != "-" }
        guard !hex.isEmpty, hex.allSatisfy({ $0.isASCII && $0.isHexDigit }) else { return nil }
        if lower.contains("-") {
            guard lower.split(separator: "-", omittingEmptySubsequences: false).map(\.count) == [8, 4, 4, 4, 12] else { return nil }
        }
        switch hex.count {
        case 4: return "0000" + hex + baseTail
        case 8: return hex + baseTail
        case 32:
            let characters = Array(hex)
            let groups = [0..<8, 8..<12, 12..<16, 16..<20, 20..<32].map { String(characters[$0]) }
            return groups.joined(separator: "-")
        default: return nil
        }
    }

    /// The short form where the UUID is on the Bluetooth base (`ffe0`), else the whole UUID.
    static func short(_ uuid: String) -> String {
        if uuid.hasSuffix(baseTail), uuid.hasPrefix("0000") { return String(uuid.dropFirst(4).prefix(4)) }
        return uuid
    }
}

/// A GATT characteristic as bluetoothd's client shows it.
struct GattCharacteristic: Sendable {
    let path: String
    let uuid: String
    let flags: [String]
    /// The characteristic offers AcquireNotify / AcquireWrite.
    let notifyAcquirable: Bool
    let writeAcquirable: Bool
    /// The ATT MTU bluetoothd reports (BlueZ 5.62 and later).
    let mtu: Int?

    init(path: String, _ properties: [String: DBusValue]) {
        self.path = path
        uuid = properties["UUID"]?.text?.lowercased() ?? ""
        flags = properties["Flags"]?.strings ?? []
        notifyAcquirable = properties["NotifyAcquired"] != nil
        writeAcquirable = properties["WriteAcquired"] != nil
        mtu = properties["MTU"]?.integer.map { Int($0) }
    }

    var canReceive: Bool { flags.contains("notify") || flags.contains("indicate") }
    var canWriteWithoutResponse: Bool { flags.contains("write-without-response") }
    var canWrite: Bool { canWriteWithoutResponse || flags.contains("write") }
    var summary: String { "\(BluetoothUUID.short(uuid)) [\(flags.joined(separator: ","))]" }
}

/// Connecting ble://SERVICE[/DEVICE] without a PSM.
enum GattSerial {
    static let serviceInterface = "org.bluez.GattService1"
    static let characteristicInterface = "org.bluez.GattCharacteristic1"
    static let properties = "org.freedesktop.DBus.Properties"
    /// How many notifications (PropertiesChanged signals) may wait unread once the inbound queue
    /// is full, before a StartNotify connection fails: GATT cannot ask the device to pause.
    static let unreadNotificationLimit = 4096
    /// BlueZ before 5.69 loses acquired writes longer than this (shared/PLATFORM-NOTES.md).
    static let blueZWriteLimit = 510

    /// The most one write carries: an ATT value (MTU − 3), at least the 20 of the smallest MTU, at
    /// most BlueZ's limit.
    static func writeSize(attMTU: Int) -> Int { min(max(attMTU - 3, 20), blueZWriteLimit) }

    /// The service the URL's host names: a short name (`nus`) or a UUID.
    static func service(_ request: ConnectRequest) throws -> (uuid: String, rx: String?, tx: String?) {
        let host = request.host
        if let known = BluetoothUUID.serialServices[host.lowercased()] {
            return (known.service, known.rx, known.tx)
        }
        guard let uuid = BluetoothUUID.normalize(host) else {
            throw TransportError(.invalidURL, "\(request.url.shown): '\(TransportError.printable(host, limit: 40))' is neither a service UUID (FFE0, 6E400001-B5A3-F393-E0A9-E50E24DCCA9E) "
                                 + "nor a known GATT serial service (\(BluetoothUUID.serialServices.keys.sorted().joined(separator: ", "))). Grammar: \(request.scheme.grammar)")
        }
        return (uuid, nil, nil)
    }

    static func characteristicOption(_ request: ConnectRequest, _ option: URLOption<String?>) throws -> String? {
        guard let text = request[option] else { return nil }
        guard let uuid = BluetoothUUID.normalize(text) else {
            throw TransportError(.invalidURL, "\(request.url.shown): \(option.spec.name)='\(TransportError.printable(text, limit: 40))' is not a characteristic UUID (FFE1, or 128-bit with dashes)")
        }
        return uuid
    }

    static func connect(_ request: ConnectRequest, bus: DBusConnection.Bus, device address: BluetoothAddress) async throws -> Connection {
        let url = request.url
        let wanted = try service(request)
        let rxOption = try characteristicOption(request, BluetoothPlugin.rx) ?? wanted.rx
        let txOption = try characteristicOption(request, BluetoothPlugin.tx) ?? wanted.tx
        let session = try await GattSession.open(bus: bus, address: address, adapterName: try BluetoothConnector.adapterName(request),
                                                 deadline: request.deadline, timeout: request.timeout, what: url.shown)
        let (link, objects, device, adapter, events) = (session.link, session.objects, session.device, session.adapter, session.events)
        let describing = url.description
        let security = request[BluetoothPlugin.security]
        do {
            let (rx, tx) = try pick(in: objects, device: device, service: wanted.uuid, rx: rxOption, tx: txOption, url: url)
            // security=medium: a bonded device's link is encrypted by bluetoothd (device.c raises
            // the ATT channel to BT_IO_SEC_MEDIUM when an LTK is known), a new pairing encrypts it.
            // Not read back: bluetoothd's D-Bus API does not say, and Paired is true for a
            // dual-mode device bonded over BR/EDR only too (Docs/Schemes.md says so). The pairing
            // is within the connect's timeout (a person entering a passkey needs a longer one).
            if security == .medium, !device.paired {
                // The registry's deadline bounds it; the reply timeout only past that (60 s without one).
                let replyTimeout = BluetoothConnector.replyTimeout(enforcedBy: request.deadline, otherwise: .seconds(60)) ?? .seconds(60)
                try await BluetoothPairingAgent.pair(session.bluez, device: device.path, timeout: replyTimeout, about: "\(url.shown): pairing for security=medium")
            }
            let backend = try await GattBackend.open(link: link, rx: rx, tx: tx, acquire: request[BluetoothPlugin.acquire] == .auto,
                                                     events: events, describing: describing)
            var metadata = BluetoothConnector.metadata(device: device, address: address, adapter: adapter)
            metadata.maximumWriteSize = backend.maximumWriteSize
            metadata.extra["addressType"] = device.addressType
            metadata.extra["service"] = wanted.uuid
            metadata.extra["rx"] = rx.uuid
            metadata.extra["tx"] = tx.uuid
            metadata.extra["attMTU"] = backend.attMTU.map(String.init) ?? ""
            metadata.extra["notify"] = backend.receivesThroughDescriptor ? "AcquireNotify" : "StartNotify"
            metadata.extra["write"] = backend.sendsThroughDescriptor ? "AcquireWrite" : "WriteValue (\(backend.writeType))"
            metadata.extra["security"] = security.rawValue
            return Connection(url: url, backend: backend, metadata: metadata)
        } catch {
            await link.release()
            throw error
        }
    }

    /// The receive and transmit characteristics in `service` on `device`.
    static func pick(in objects: BlueZObjects, device: BluetoothDevice, service uuid: String, rx wantedRx: String?, tx wantedTx: String?,
                     url: TransportURL) throws -> (rx: GattCharacteristic, tx: GattCharacteristic) {
        var services: [(path: String, uuid: String)] = []
        var characteristics: [(service: String, characteristic: GattCharacteristic)] = []
        for (path, interfaces) in objects.interfaces where path.hasPrefix(device.path + "/") {
            if let properties = interfaces[serviceInterface] {
                services.append((path, properties["UUID"]?.text?.lowercased() ?? ""))
            }
            if let properties = interfaces[characteristicInterface] {
                characteristics.append((properties["Service"]?.text ?? "", GattCharacteristic(path: path, properties)))
            }
        }
        guard let service = services.sorted(by: { $0.path < $1.path }).first(where: { $0.uuid == uuid }) else {
            let offered = Set(services.map { BluetoothUUID.short($0.uuid) }).sorted().joined(separator: ", ")
            throw TransportError(.notFound, "\(url.shown): Bluetooth device \(device.address) has no GATT service \(uuid); it offers: \(offered.isEmpty ? "none" : offered)")
        }
        let inService = characteristics.filter { $0.service == service.path }.map(\.characteristic).sorted { $0.path < $1.path }
        let listing = inService.map(\.summary).joined(separator: "; ")
        func named(_ uuid: String, _ role: String) throws -> GattCharacteristic {
            guard let found = inService.first(where: { $0.uuid == uuid }) else {
                throw TransportError(.notFound, "\(url.shown): service \(BluetoothUUID.short(service.uuid)) has no characteristic \(uuid) (\(role)); it has: \(listing)")
            }
            return found
        }
        let rx: GattCharacteristic
        if let wantedRx {
            rx = try named(wantedRx, "rx")
            guard rx.canReceive else {
                throw TransportError(.unsupported, "\(url.shown): characteristic \(BluetoothUUID.short(rx.uuid)) (rx) neither notifies nor indicates: \(rx.summary)")
            }
        } else {
            guard let found = inService.first(where: \.canReceive) else {
                throw TransportError(.unsupported, "\(url.shown): no characteristic in service \(BluetoothUUID.short(service.uuid)) notifies or indicates; "
                                     + "it has: \(listing). Name the ones to use with rx= and tx=")
            }
            rx = found
        }
        let tx: GattCharacteristic
        if let wantedTx {
            tx = try named(wantedTx, "tx")
            guard tx.canWrite else {
                throw TransportError(.unsupported, "\(url.shown): characteristic \(BluetoothUUID.short(tx.uuid)) (tx) cannot be written: \(tx.summary)")
            }
        } else {
            guard let found = inService.first(where: \.canWriteWithoutResponse) ?? inService.first(where: \.canWrite) else {
                throw TransportError(.unsupported, "\(url.shown): no characteristic in service \(BluetoothUUID.short(service.uuid)) can be written; "
                                     + "it has: \(listing). Name the ones to use with rx= and tx=")
            }
            tx = found
        }
        return (rx, tx)
    }
}

/// The LE link a GATT serial connection holds: disconnected on close when the connection made it.
final class GattLink: Sendable {
    let bluez: BlueZ
    let device: BluetoothDevice
    let address: BluetoothAddress
    let disconnectOnClose: Bool
    private let released = Locked(false)

    init(bluez: BlueZ, device: BluetoothDevice, address: BluetoothAddress, disconnectOnClose: Bool) {
        self.bluez = bluez
        self.device = device
        self.address = address
        self.disconnectOnClose = disconnectOnClose
    }

    func release() async {
        guard released.withLock({ flag in defer { flag = true }; return !flag }) else { return }
        guard disconnectOnClose else { return }
        // Also when the caller was cancelled (a connect's deadline, Ctrl-C): a call from a cancelled
        // task would not be sent, and the device would stay connected.
        let (bluez, path, address) = (bluez, device.path, address)
        await uncancellable {
            _ = try? await bluez.call(path, BlueZ.deviceInterface, "Disconnect", about: "disconnecting \(address)")
        }
    }

    /// The link dropped by itself: release() has nothing to disconnect (and must not drop a link
    /// made since to the same device).
    func forget() { released.withLock { $0 = true } }

    func disconnected(errno: Errno? = nil, syscall: String? = nil) -> TransportError {
        address.disconnected(errno: errno, syscall: syscall)
    }
}

/// A GATT serial connection: values from the receive characteristic in, writes to the transmit one
/// out, each one message. Each half goes through a descriptor bluetoothd hands out where it offers
/// one (AcquireNotify, AcquireWrite), else through D-Bus (StartNotify, WriteValue).
///
/// GATT has no flow control towards us: a notification the application does not read in time waits
/// in memory (or in the descriptor's socket buffer, where bluetoothd drops what does not fit). Writes
/// wait for the link: the socket's buffer, or WriteValue's reply.
final class GattBackend: ConnectionBackend {
    enum Receiver: Sendable {
        case socket(PacketSocketBackend)
        case notifications(InboundQueue, path: String, feeder: Task<Void, Never>)
    }

    enum Sender: Sendable {
        case socket(PacketSocketBackend)
        case writeValue(path: String)
    }

    let supportsHalfClose = false
    let carriesMessages = true
    let maximumWriteSize: Int?
    let attMTU: Int?
    /// WriteValue's type: `command` (without response) or `request`.
    let writeType: String
    private let link: GattLink
    private let receiver: Receiver
    private let sender: Sender
    private let watcher = Locked<Task<Void, Never>?>(nil)
    /// Why the link ended, once it has; set at most once.
    private let ended = Locked<TransportError?>(nil)
    private let closing = Locked(false)

    var receivesThroughDescriptor: Bool { if case .socket = receiver { true } else { false } }
    var sendsThroughDescriptor: Bool { if case .socket = sender { true } else { false } }

    private init(link: GattLink, receiver: Receiver, sender: Sender, maximumWriteSize: Int, attMTU: Int?, writeType: String) {
        self.link = link
        self.receiver = receiver
        self.sender = sender
        self.maximumWriteSize = maximumWriteSize
        self.attMTU = attMTU
        self.writeType = writeType
    }

    /// Opens both halves on `rx` and `tx`, acquiring descriptors where `acquire` allows and BlueZ
    /// offers them; `events` (bluetoothd's PropertiesChanged and InterfacesRemoved: the device's
    /// link dropped, or the device or its adapter went away) tell when the link drops.
    static func open(link: GattLink, rx: GattCharacteristic, tx: GattCharacteristic, acquire: Bool,
                     events: AsyncThrowingStream<DBusSignal, any Error>, describing: String) async throws -> GattBackend {
        let bluez = link.bluez
        let interface = GattSerial.characteristicInterface
        let hangUp: HangUp = { errno, syscall in link.disconnected(errno: errno, syscall: syscall) }
        var attMTU: Int?
        let receiver: Receiver
        if acquire && rx.notifyAcquirable {
            let (fd, mtu) = try await acquired(bluez.call(rx.path, interface, "AcquireNotify", [.dictionary([:])],
                                                          about: "acquiring notifications from \(BluetoothUUID.short(rx.uuid)) on \(link.address)"), describing)
            attMTU = mtu
            receiver = .socket(PacketSocketBackend(adopting: fd, describing: describing, receiveSize: max(mtu, 23), maximumWriteSize: nil, hangUp: hangUp))
        } else {
            // GATT has no flow control: while the application does not read, values wait in the
            // queue up to its high watermark, then (the feeder paused) in the subscription, up to
            // its limit; one more ends the connection with an error that says so.
            let producing = AsyncCondition(true)
            let queue = InboundQueue(messages: true) { producing.update { $0 = true } }
            let limit = GattSerial.unreadNotificationLimit
            let values = try await bluez.notifications(of: rx.path, about: "starting notifications from \(BluetoothUUID.short(rx.uuid)) on \(link.address)")
            let feeder = Task {
                do {
                    for try await signal in values {
                        guard let value = BlueZ.notifiedValue(signal) else { continue }
                        if queue.append(ByteBuffer(bytes: value)) == .pause {
                            producing.update { $0 = false }
                            if queue.shouldProduce() { producing.update { $0 = true } }
                            try await producing.wait { $0 ? () : nil }
                        }
                    }
                } catch is CancellationError {
                } catch let error as TransportError where error.kind == .io {
                    queue.fail(TransportError(.io, "\(describing): more than \(limit) notifications waited unread after \(queue.watermarks.high) bytes: "
                                              + "GATT has no flow control, so the application must read as fast as the device sends "
                                              + "(with acquire=auto, where the device offers it, the kernel's socket buffer holds them instead)"))
                } catch {
                    queue.fail(link.disconnected())
                }
            }
            receiver = .notifications(queue, path: rx.path, feeder: feeder)
        }
        let sender: Sender
        let writeSize: Int
        let writeType = tx.canWriteWithoutResponse ? "command" : "request"
        do {
            if acquire && tx.writeAcquirable && tx.canWriteWithoutResponse {
                let (fd, mtu) = try await acquired(bluez.call(tx.path, interface, "AcquireWrite", [.dictionary([:])],
                                                              about: "acquiring writes to \(BluetoothUUID.short(tx.uuid)) on \(link.address)"), describing)
                attMTU = attMTU.map { min($0, mtu) } ?? mtu
                writeSize = GattSerial.writeSize(attMTU: mtu)
                sender = .socket(PacketSocketBackend(adopting: fd, describing: describing, receiveSize: 16, maximumWriteSize: writeSize, hangUp: hangUp))
            } else {
                let mtu = tx.mtu ?? attMTU ?? 23
                attMTU = attMTU ?? tx.mtu
                writeSize = GattSerial.writeSize(attMTU: mtu)
                sender = .writeValue(path: tx.path)
            }
        } catch {
            await close(receiver, bluez: bluez)
            throw error
        }
        let backend = GattBackend(link: link, receiver: receiver, sender: sender, maximumWriteSize: writeSize, attMTU: attMTU, writeType: writeType)
        let devicePath = link.device.path
        let watcher = Task { [weak backend] in
            do {
                for try await signal in events where GattSession.endsLink(signal, devicePath: devicePath) {
                    if await GattSession.linkIsDown(bluez, devicePath: devicePath) { break }
                }
            } catch {}
            // The link dropped (or bluetoothd went away): unless this side is closing, say so.
            if !Task.isCancelled { backend?.linkEnded() }
        }
        backend.watcher.withLock { $0 = watcher }
        return backend
    }

    /// The descriptor and the MTU in an AcquireNotify or AcquireWrite reply.
    private static func acquired(_ reply: [DBusValue], _ describing: String) throws -> (SystemPackage.FileDescriptor, Int) {
        guard case .unixFD(let fd)? = reply.first, let mtu = reply.dropFirst().first?.integer else {
            DBusValue.closeDescriptors(in: reply)
            throw TransportError(.io, "\(describing): bluetoothd's reply to an Acquire call carried no descriptor and MTU: \(reply)")
        }
        return (SystemPackage.FileDescriptor(rawValue: fd), Int(mtu))
    }

    private func linkEnded() {
        guard !closing.withLock({ $0 }) else { return }
        let error = link.disconnected()
        ended.withLock { if $0 == nil { $0 = error } }
        switch receiver {
        case .notifications(let queue, _, _): queue.fail(error)
        // bluetoothd closes an acquired descriptor when the link goes; this does not wait for that.
        case .socket(let socket): socket.endReading()
        }
    }

    func read() async throws -> ByteBuffer? {
        switch receiver {
        case .socket(let socket):
            guard let buffer = try await socket.read() else {
                if closing.withLock({ $0 }) { return nil }
                throw ended.withLock { $0 } ?? link.disconnected()
            }
            return buffer
        case .notifications(let queue, _, _):
            return try await queue.next()
        }
    }

    func write(_ buffer: ByteBuffer) async throws {
        if let error = ended.withLock({ $0 }) { throw error }
        switch sender {
        case .socket(let socket):
            try await socket.write(buffer)
        case .writeValue(let path):
            do {
                _ = try await link.bluez.call(path, GattSerial.characteristicInterface, "WriteValue",
                                              [.bytes(Array(buffer.readableBytesView)), .dictionary(["type": .string(writeType)])],
                                              about: "writing to \(link.address)")
            } catch let error as TransportError {
                if let ended = ended.withLock({ $0 }) { throw ended }
                // BlueZ answers NotConnected, or Failed with the reason "Not connected" (gatt-client.c,
                // when the GATT client is gone): BlueZ's reasons come only as text.
                if error.code == "org.bluez.Error.NotConnected" || (error.code == "org.bluez.Error.Failed" && error.message.contains("Not connected")) {
                    throw link.disconnected()
                }
                throw error
            }
        }
    }

    /// Several records: an acquired socket sends them from its own thread once it is full
    /// (`PacketSocketBackend.writeRecords`); WriteValue takes one call per record.
    func writeRecords(_ buffer: ByteBuffer, accepted: @escaping @Sendable (Int) -> Void) async throws {
        if let error = ended.withLock({ $0 }) { throw error }
        if case .socket(let socket) = sender {
            try await socket.writeRecords(buffer, accepted: accepted)
        } else {
            try await writeRecordByRecord(buffer, accepted: accepted)
        }
    }

    /// WriteValue returns once bluetoothd has the value; an acquired socket says what bluetoothd
    /// has not read from it yet.
    var unsentByteCount: Int? {
        switch sender {
        case .socket(let socket): socket.unsentByteCount
        case .writeValue: 0
        }
    }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "ble:// GATT serial cannot half-close (GATT has no end of stream); close the connection instead")
    }

    func close() async throws {
        guard closing.withLock({ flag in defer { flag = true }; return !flag }) else { return }
        watcher.withLock { $0 }?.cancel()
        await Self.close(receiver, bluez: link.bluez)
        if case .socket(let socket) = sender { try? await socket.close() }
        await link.release()
    }

    private static func close(_ receiver: Receiver, bluez: BlueZ) async {
        switch receiver {
        case .socket(let socket):
            try? await socket.close()
        case .notifications(let queue, let path, let feeder):
            feeder.cancel()
            queue.finish()
            await bluez.notifySessions.stop(bluez, path: path)
        }
    }

    func connectionDropped() {
        startCleanup { try? await self.close() }
    }
}
