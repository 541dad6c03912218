// LEListener.swift: ble://SERVICE:PSM listen mode: a listening LE L2CAP socket
// (BluetoothSocket.listenL2CAP), demand-driven like tcp://: accept(2) runs only when the
// application asks for a connection, so the others wait in the kernel's backlog. While it
// listens, the adapter advertises SERVICE (Advertisement.swift) unless advertise=false.

import SystemPackage
@_spi(Plugins) import TransportKitCore
import TransportKitDBus
@_spi(Plugins) import TransportKitLinux

/// Accepts LE L2CAP connection-oriented channels on one PSM of one adapter.
final class LEListener: ListenerBackend {
    let url: TransportURL
    private let fd: SystemPackage.FileDescriptor
    private let bluez: BlueZ
    private let adapter: BluetoothAdapter
    private let service: String
    private let psm: UInt16
    /// The least a peer's link must have; a peer below it is closed on accept.
    private let security: BluetoothSocket.Security
    /// How much each accepted channel may buffer (the listen request's).
    private let buffering: Buffering
    private let advertisement: Advertisement?
    /// accept() calls inside a readiness wait or accept(2) on the socket; closes it once they left.
    private let gate: DescriptorGate

    private init(url: TransportURL, fd: SystemPackage.FileDescriptor, bluez: BlueZ, adapter: BluetoothAdapter, service: String, psm: UInt16,
                 security: BluetoothSocket.Security, buffering: Buffering, advertisement: Advertisement?) {
        self.security = security
        self.buffering = buffering
        self.url = url
        self.fd = fd
        gate = DescriptorGate(fd)
        self.bluez = bluez
        self.adapter = adapter
        self.service = service
        self.psm = psm
        self.advertisement = advertisement
    }

    /// The PSM of a listening URL, which names no device.
    static func psm(_ request: ConnectRequest) throws -> Int {
        let url = request.url
        guard let port = url.port else {
            throw TransportError(.unsupported, "\(url.shown): listening for GATT serial (a GATT server) is not built; listen on an L2CAP channel: ble://SERVICE:PSM")
        }
        guard url.path.drop(while: { $0 == "/" }).isEmpty else {
            throw TransportError(.invalidURL, "\(url.shown): a listener takes no device; choose the adapter with adapter=hciN: ble://\(request.host):\(port)")
        }
        return port
    }

    @Sendable static func listen(_ request: ConnectRequest, bus: DBusConnection.Bus) async throws -> Listener {
        let url = request.url
        let port = try psm(request)
        // The same names a connect takes (a UUID, or nus / hm10), so one URL serves both ends.
        let service = try GattSerial.service(request).uuid
        let security = request[BluetoothPlugin.security]
        let name = try BluetoothConnector.adapterName(request)
        let bluez = try await BlueZ.shared(bus)
        let adapter = try BlueZ.adapter(named: name, among: try await bluez.objects().adapters)
        let local = try BluetoothConnector.localAddress(of: adapter, request)
        let describing = url.description
        let fd = try BluetoothSocket.listenL2CAP(adapter: local, psm: UInt16(port), receiveMTU: request[BluetoothPlugin.receiveMTU],
                                                 security: security, backlog: Int32(request[BluetoothPlugin.backlog]),
                                                 describing: describing)
        let advertisement: Advertisement?
        do {
            advertisement = request[BluetoothPlugin.advertise]
                ? try await Advertisement.register(bluez, adapter: adapter, service: service, describing: describing) : nil
        } catch {
            fd.closeOwned()
            throw error
        }
        request.logger.debug("ble listening: PSM \(port) on \(adapter.name)\(advertisement == nil ? "" : ", advertising \(BluetoothUUID.short(service))")")
        let listener = LEListener(url: url, fd: fd, bluez: bluez, adapter: adapter, service: service, psm: UInt16(port), security: security,
                                  buffering: request.buffering, advertisement: advertisement)
        return Listener(url: url, backend: listener, exposure: RFCOMMListener.exposure(security, adapter: adapter.name))
    }

    func accept() async throws -> Connection? {
        guard gate.enter() else { return nil }
        defer { gate.leave() }
        let describing = url.description
        while true {
            if gate.isClosed { return nil }
            if let accepted = try BluetoothSocket.acceptL2CAP(fd, security: security, describing: describing) {
                return await connection(accepted.channel, peer: accepted.peer, addressType: accepted.addressType)
            }
            // Readable (a connection waits), or the listener closed, whichever comes first.
            try await gate.wait(until: .readable)
        }
    }

    private func connection(_ channel: BluetoothSocket.Channel, peer: BluetoothAddress, addressType: String) async -> Connection {
        let describing = "ble://\(BluetoothUUID.short(service)):\(psm)/\(peer)"
        let backend = PacketSocketBackend(adopting: channel.fd, describing: describing, receiveSize: channel.receiveMTU,
                                          maximumWriteSize: channel.sendMTU, watermarks: buffering.inbound, hangUp: peer.hangUp)
        let device = (try? await bluez.objects().devices).flatMap { BlueZ.device(peer.description, onAdapter: adapter.path, among: $0) }
        var metadata = BluetoothConnector.metadata(device: device, address: peer, adapter: adapter)
        metadata.maximumWriteSize = channel.sendMTU
        metadata.extra["addressType"] = addressType
        metadata.extra["psm"] = String(psm)
        metadata.extra["sendMTU"] = String(channel.sendMTU)
        metadata.extra["receiveMTU"] = String(channel.receiveMTU)
        metadata.extra["security"] = channel.security
        return Connection(url: (try? TransportURL(describing)) ?? url, backend: backend, metadata: metadata)
    }

    deinit {
        // Dropped without close(): no accept() can be running (it holds the listener), so the
        // socket is closed here and the advertisement withdrawn in the background.
        guard !gate.isClosed else { return }
        fd.closeOwned()
        if let advertisement { startCleanup { await advertisement.unregister() } }
    }

    /// Stops accepting and advertising; connections accepted before stay open.
    func close() async throws {
        // Not cancellable: the descriptor is closed only once no accept() waits on it.
        guard await gate.close() else { return }
        await advertisement?.unregister()
    }
}
