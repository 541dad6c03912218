// SerialPortProfile.swift: rfcomm:// listen mode through BlueZ's ProfileManager1 and Profile1
// (doc/profile-api.txt; src/profile.c at 5.66). bluetoothd publishes the SDP record (so peers find
// the channel without it being hard-coded), listens on the RFCOMM channel on every adapter, and
// hands each accepted connection to Profile1.NewConnection as a descriptor.
//
// Facts (shared/PLATFORM-NOTES.md, src/profile.c):
// - RequireAuthentication and RequireAuthorization default to true: a connect is then refused with
//   "Authentication attempt without agent" unless an agent runs. RequireAuthentication follows
//   security= (false for low, the default: any device in range may connect, which the tool says);
//   RequireAuthorization is false (no agent prompt per connection). BlueZ asks for at most medium
//   (src/profile.c: RequireAuthentication sets BT_IO_SEC_MEDIUM), and the socket it hands over
//   reads back its own setting (RFCOMM's BT_SECURITY), not the link's: security=high cannot be
//   had, or checked, through it, and is refused.
// - A UUID BlueZ has no defaults for gets an RFCOMM server only when "Channel" is given (0 = the
//   kernel's first free one, which is not reported back), so the channel is always chosen here.
// - bluetoothd keeps its own reference to each connection's socket (it watches it for a hang-up),
//   so closing our descriptor alone would leave the link up: closing shuts the socket down first.

import Glibc
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
import TransportKitDBus
@_spi(Plugins) import TransportKitLinux

/// Accepts rfcomm:// connections for a service published through BlueZ.
final class RFCOMMListener: ListenerBackend {
    private struct Incoming {
        let device: String
        let fd: SystemPackage.FileDescriptor
    }

    private struct State {
        var incoming: [Incoming] = []
        var closed = false
        /// Set when bluetoothd released the profile (it is shutting down), or left the bus without
        /// doing so (killed, crashed).
        var released = false
        /// Set when the bluetoothd that took the profile left the bus: nothing to unpublish then
        /// (and on a systemd host a call to org.bluez could start a new one just to answer it).
        var ownerLeft = false
        /// The connections accepted from each device, for Profile1.RequestDisconnection.
        var accepted: [String: [Accepted]] = [:]
    }

    private struct Accepted: Sendable {
        weak var backend: ChannelBackend?
    }

    private enum Next {
        case connection(Incoming)
        case closed
        case released
    }


    let url: TransportURL
    private let bluez: BlueZ
    private let channel: UInt8
    private let path: String
    private let state = AsyncCondition(State())
    private let export = Locked<DBusExport?>(nil)
    /// Watches org.bluez's owner: a bluetoothd that dies without Release still ends accept().
    private let ownerWatch = Locked<Task<Void, Never>?>(nil)

    /// How much each accepted connection may buffer (the listen request's).
    private let buffering: Buffering

    private init(url: TransportURL, bluez: BlueZ, channel: UInt8, path: String, buffering: Buffering) {
        self.buffering = buffering
        self.url = url
        self.bluez = bluez
        self.channel = channel
        self.path = path
    }

    /// rfcomm://any[:CHANNEL] or rfcomm://ADAPTER-ADDRESS[:CHANNEL]: publishes `uuid=` (the Serial
    /// Port Profile by default) on `CHANNEL` (default: the lowest free one) and accepts connections.
    /// The local side a listening URL names, as tcp://0.0.0.0 does: every adapter (`nil`), or
    /// one by address.
    static func localHost(_ request: ConnectRequest) throws -> String? {
        let host = request.host.uppercased()
        if host == "ANY" || host == "00:00:00:00:00:00" { return nil }
        guard BluetoothAddress(host) != nil else {
            throw TransportError(.invalidURL, "\(request.url.shown): to listen, give `any` (every adapter) or an adapter's address "
                                 + "as the host: rfcomm://any:CHANNEL; '\(TransportError.printable(request.host, limit: 40))' is neither")
        }
        return host
    }

    /// `security=` for a listener: low or medium (see the file's header: high cannot be had through
    /// bluetoothd's Profile API).
    static func security(_ request: ConnectRequest) throws -> BluetoothSocket.Security {
        let security = request[BluetoothPlugin.security]
        guard security != .high else {
            throw TransportError(.invalidURL, "\(request.url.shown): an rfcomm:// listener takes security=low or medium: bluetoothd, which accepts "
                                 + "its connections, asks for medium at most (an encrypted link with a paired device), and the socket it hands "
                                 + "over cannot show more. Use security=medium. Grammar: \(request.scheme.grammar)")
        }
        return security
    }

    /// Who can reach a Bluetooth listener: any device in range, authenticated when `security`
    /// asks for pairing.
    static func exposure(_ security: BluetoothSocket.Security, adapter: String) -> ListenerExposure {
        ListenerExposure(reach: .radio, authenticated: security != .low,
                         who: security == .low ? "any Bluetooth device in range of \(adapter), without pairing (security=low)"
                                               : "Bluetooth devices in range of \(adapter) that pair (security=\(security.rawValue))")
    }

    @Sendable static func listen(_ request: ConnectRequest, bus: DBusConnection.Bus) async throws -> Listener {
        let url = request.url
        let localHost = try localHost(request)
        let every = localHost == nil
        let host = localHost ?? "ANY"
        let service = try BluetoothConnector.serviceUUID(request)
        let security = try security(request)
        let option = try BluetoothConnector.adapterName(request)
        let bluez = try await BlueZ.shared(bus)
        let adapters = try await bluez.objects().adapters
        let named: String?
        if every {
            named = option
        } else {
            if let option, try BlueZ.adapter(named: option, among: adapters).address.uppercased() != host {
                throw TransportError(.invalidURL, "\(url.shown): adapter=\(option) is not the adapter with address \(host)")
            }
            named = host
        }
        let chosen = try BlueZ.adapter(named: named, among: adapters)
        let only = named == nil ? nil : chosen.path
        let describing = url.description
        let locals = adapters.filter { (only == nil && $0.powered) || $0.path == only }.compactMap { BluetoothAddress($0.address) }
        let channel: UInt8
        if let port = url.port {
            channel = UInt8(port)
            guard try locals.allSatisfy({ try BluetoothSocket.isRFCOMMChannelFree(channel, on: $0, describing: describing) }) else {
                throw TransportError(.busy, "\(describing): RFCOMM channel \(channel) is taken (another server listens on it); choose another, "
                                     + "or leave the channel out and one is picked: rfcomm://\(request.host)", errno: .addressInUse, syscall: "bind")
            }
        } else {
            channel = try BluetoothSocket.freeRFCOMMChannel(on: locals, describing: describing)
        }
        // Only bluetoothd may hand us connections. Its leaving the bus is watched from before the
        // owner is read, so that nothing in between is missed.
        let ownerChanges = try await bluez.bus.signals(DBusMatch(sender: "org.freedesktop.DBus", path: "/org/freedesktop/DBus",
                                                                 interface: "org.freedesktop.DBus", member: "NameOwnerChanged",
                                                                 arg0: BlueZ.service), buffering: .all(limit: 64))
        let owner = try await bluez.bus.call(destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                                             member: "GetNameOwner", [.string(BlueZ.service)]).first?.text ?? ""
        var bound = url
        bound.port = Int(channel)
        let path = BlueZ.exportPath("rfcomm")
        let listener = RFCOMMListener(url: bound, bluez: bluez, channel: channel, path: path, buffering: request.buffering)
        let state = listener.state
        let backlog = request[BluetoothPlugin.backlog]
        let exported = try await bluez.bus.export(path: path) { call in
            guard call.interface == "org.bluez.Profile1" else { return .notHandled }
            guard call.sender == owner else {
                DBusValue.closeDescriptors(in: call.arguments)
                return .error(name: "org.bluez.Error.Rejected", message: "only bluetoothd may call this profile")
            }
            switch call.member {
            case "NewConnection":
                guard case .objectPath(let device)? = call.arguments.first, case .unixFD(let raw)? = call.arguments.dropFirst().first else {
                    DBusValue.closeDescriptors(in: call.arguments)
                    return .error(name: "org.bluez.Error.InvalidArguments", message: "NewConnection(o, h, a{sv}) expected")
                }
                let fd = SystemPackage.FileDescriptor(rawValue: raw)
                let taken = state.update { state -> Bool in
                    guard !state.closed, only.map({ device.hasPrefix($0 + "/") }) ?? true, state.incoming.count < backlog else { return false }
                    state.incoming.append(Incoming(device: device, fd: fd))
                    return true
                }
                guard taken else {
                    _ = shutdown(fd.rawValue, Int32(SHUT_RDWR))
                    fd.closeOwned()
                    return .error(name: "org.bluez.Error.Rejected", message: "not accepting connections on this adapter now")
                }
                return .reply([])
            case "RequestDisconnection":
                if case .objectPath(let device)? = call.arguments.first {
                    let accepted = state.update { $0.accepted.removeValue(forKey: device) ?? [] }
                    accepted.forEach { $0.backend?.connectionDropped() }
                }
                return .reply([])
            case "Release":
                state.update { $0.released = true }
                return .reply([])
            default:
                return .notHandled
            }
        }
        listener.export.withLock { $0 = exported }
        do {
            _ = try await bluez.call("/org/bluez", "org.bluez.ProfileManager1", "RegisterProfile", [
                .objectPath(path), .string(service),
                .dictionary([
                    "Name": .string(request[BluetoothPlugin.name] ?? "TransportKit serial port"),
                    "Role": .string("server"),
                    "Channel": .uint16(UInt16(channel)),
                    "RequireAuthentication": .bool(security != .low),
                    "RequireAuthorization": .bool(false),
                    "AutoConnect": .bool(false),
                ]),
            ], about: "\(describing): publishing service \(BluetoothUUID.short(service)) on RFCOMM channel \(channel)")
            // bluetoothd answers RegisterProfile even when its own bind failed (src/profile.c logs
            // "RFCOMM server failed" and publishes nothing): make sure the channel is now taken.
            guard try !locals.contains(where: { try BluetoothSocket.isRFCOMMChannelFree(channel, on: $0, describing: describing) }) else {
                throw TransportError(.busy, "\(describing): bluetoothd accepted the service but did not listen on RFCOMM channel \(channel) "
                                     + "(taken meanwhile?); try again, or give another channel")
            }
        } catch {
            await Self.unpublish(path, on: bluez, about: "\(describing): unpublishing")
            await exported.remove()
            // RegisterProfile answers NotPermitted for one thing only: the UUID is registered already
            // (src/profile.c), by another program or another listener of this one.
            if let refused = error as? TransportError, refused.code == "org.bluez.Error.NotPermitted" {
                throw TransportError(.busy, "\(describing): service \(BluetoothUUID.short(service)) is already published through bluetoothd, by another "
                                     + "program or another listener; stop that one, or publish another service with uuid=",
                                     code: refused.code)
            }
            throw error
        }
        listener.ownerWatch.withLock {
            $0 = Task {
                do {
                    // NameOwnerChanged(name, old owner, new owner): our bluetoothd losing the name
                    // takes this registration with it. (A change buffered from before GetNameOwner,
                    // an older bluetoothd's, names another old owner and is passed over.)
                    for try await signal in ownerChanges
                    where signal.values.count == 3 && signal.values[1].text == owner && signal.values[2].text != owner { break }
                } catch {
                    // The bus connection ended: bluetoothd cannot reach this profile either.
                }
                guard !Task.isCancelled else { return }
                state.update {
                    $0.released = true
                    $0.ownerLeft = true
                }
            }
        }
        request.logger.debug("rfcomm listening: \(BluetoothUUID.short(service)) on channel \(channel)\(only.map { " of \($0)" } ?? " of every adapter")")
        return Listener(url: bound, backend: listener, exposure: exposure(security, adapter: every ? "every adapter" : chosen.name))
    }

    func accept() async throws -> Connection? {
        let next = try await state.wait { state -> Next? in
            if state.closed { return .closed }
            if !state.incoming.isEmpty { return .connection(state.incoming.removeFirst()) }
            if state.released { return .released }
            return nil
        }
        switch next {
        case .closed: return nil
        case .released:
            throw TransportError(.disconnected, "\(url.shown): bluetoothd released the service or left the bus (it stopped, restarted or "
                                 + "crashed); listen again once it is back")
        case .connection(let incoming):
            return try await connection(incoming)
        }
    }

    private func connection(_ incoming: Incoming) async throws -> Connection {
        guard let address = BluetoothAddress(BlueZ.address(inDevicePath: incoming.device)) else {
            _ = shutdown(incoming.fd.rawValue, Int32(SHUT_RDWR))
            incoming.fd.closeOwned()
            throw TransportError(.io, "\(url.shown): bluetoothd handed over a connection from '\(incoming.device)', not a device path")
        }
        var peer = url
        peer.host = address.description
        let describing = "rfcomm://\(address):\(channel)"
        // bluetoothd holds the socket too (Profile1.NewConnection): closing shuts it down, or the link would stay up.
        let backend = try await DescriptorChannel.adoptSocket(incoming.fd, describing: describing, buffering: buffering, supportsHalfClose: false,
                                                              hangUp: address.hangUp, shutsDownOnClose: true)
        state.update { state in
            // Connections closed since are forgotten here, so the table stays as small as what is open.
            state.accepted = state.accepted.compactMapValues { list in
                let open = list.filter { $0.backend != nil }
                return open.isEmpty ? nil : open
            }
            state.accepted[incoming.device, default: []].append(Accepted(backend: backend))
        }
        let objects = try? await bluez.objects()
        let device = objects?.devices.first { $0.path == incoming.device }
        let adapterPath = "/" + incoming.device.split(separator: "/").dropLast().joined(separator: "/")
        let adapter = objects?.adapters.first { $0.path == adapterPath }
            ?? BluetoothAdapter(path: adapterPath, name: "", index: nil, address: "", alias: nil, powered: true, discoverable: false, discovering: false)
        var metadata = BluetoothConnector.metadata(device: device, address: address, adapter: adapter)
        metadata.extra["addressType"] = "public"
        metadata.extra["channel"] = String(channel)
        return Connection(url: (try? TransportURL(describing)) ?? peer, backend: backend, metadata: metadata)
    }

    /// Takes the profile back from bluetoothd (its record and its servers); best effort.
    private static func unpublish(_ path: String, on bluez: BlueZ, about what: String) async {
        _ = try? await bluez.call("/org/bluez", "org.bluez.ProfileManager1", "UnregisterProfile", [.objectPath(path)], about: what)
    }

    /// Ends connections that were handed over but never accepted (bluetoothd holds them too).
    private static func refuse(_ incoming: [Incoming]) {
        for connection in incoming {
            _ = shutdown(connection.fd.rawValue, Int32(SHUT_RDWR))
            connection.fd.closeOwned()
        }
    }

    deinit {
        // Dropped without close(): refuse what waits, and unpublish in the background.
        let left = state.update { state -> (waiting: [Incoming], ownerLeft: Bool)? in
            guard !state.closed else { return nil }
            state.closed = true
            defer { state.incoming = [] }
            return (state.incoming, state.ownerLeft)
        }
        ownerWatch.withLock { $0?.cancel() }
        guard let left else { return }
        Self.refuse(left.waiting)
        let (bluez, path, exported, ownerLeft) = (bluez, path, export.withLock { $0 }, left.ownerLeft)
        startCleanup {
            if !ownerLeft { await Self.unpublish(path, on: bluez, about: "unpublishing") }
            await exported?.remove()
        }
    }

    /// Unpublishes the service and refuses connections from then on; accepted ones stay open.
    func close() async throws {
        let (waiting, ownerLeft) = state.update { state -> ([Incoming], Bool) in
            state.closed = true
            defer { state.incoming = [] }
            return (state.incoming, state.ownerLeft)
        }
        Self.refuse(waiting)
        ownerWatch.withLock { $0?.cancel() }
        if !ownerLeft { await Self.unpublish(path, on: bluez, about: "\(url): unpublishing") }
        if let exported = export.withLock({ $0 }) { await exported.remove() }
    }
}
