// BluetoothSocket.swift: the kernel's Bluetooth sockets (AF_BLUETOOTH; bluetooth.h, rfcomm.h,
// l2cap.h): RFCOMM streams for rfcomm://, LE L2CAP connection-oriented channels (SOCK_SEQPACKET)
// for ble://SERVICE:PSM/DEVICE. Every call goes through Syscall (errno and the call's name kept).
//
// Facts (shared/PLATFORM-NOTES.md): the LE address type comes from BlueZ (Device1.AddressType);
// BT_RCVMTU is set before connect, BT_SNDMTU is known only after it; a record larger than the send
// MTU fails with EMSGSIZE; security above low starts pairing, which needs an agent; one LE connect
// may be pending per controller (EBUSY).

import CBlueZ
import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// A Bluetooth device address, `00:AA:01:01:00:01`.
struct BluetoothAddress: Sendable, Hashable, CustomStringConvertible {
    /// The six bytes as written, most significant first.
    let bytes: [UInt8]

    init?(_ text: String) {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 6 else { return nil }
        var bytes: [UInt8] = []
        for part in parts {
            // Two hexadecimal digits each: UInt8(_:radix:) would also take "+0".
            guard let byte = Hex.value(part, width: 2, as: UInt8.self) else { return nil }
            bytes.append(byte)
        }
        self.bytes = bytes
    }

    /// bdaddr_t keeps the bytes least significant first.
    var kernel: bdaddr_t {
        var address = bdaddr_t()
        withUnsafeMutableBytes(of: &address.b) { raw in
            for (index, byte) in bytes.reversed().enumerated() { raw[index] = byte }
        }
        return address
    }

    /// From the kernel's bdaddr_t (least significant byte first).
    init(kernel: bdaddr_t) {
        var bytes: [UInt8] = []
        withUnsafeBytes(of: kernel.b) { raw in bytes = Array(raw.reversed()) }
        self.bytes = bytes
    }

    var description: String { Hex.text(bytes, separator: ":") }
}

/// Opening Bluetooth sockets, bound to an adapter; a connect is bounded by the registry's deadline.
enum BluetoothSocket {
    /// How L2CAP security is asked for (BT_SECURITY): above `low` the link is encrypted and pairing may start.
    enum Security: String, CaseIterable, Sendable {
        case low, medium, high
        var level: UInt8 {
            switch self {
            case .low: UInt8(BT_SECURITY_LOW)
            case .medium: UInt8(BT_SECURITY_MEDIUM)
            case .high: UInt8(BT_SECURITY_HIGH)
            }
        }

        /// A kernel level's name: `sdp` (0), low, medium, high, or `fips` (4, Secure Connections only).
        static func name(of level: UInt8) -> String {
            switch Int32(level) {
            case BT_SECURITY_SDP: "sdp"
            case BT_SECURITY_LOW: "low"
            case BT_SECURITY_MEDIUM: "medium"
            case BT_SECURITY_HIGH: "high"
            case BT_SECURITY_FIPS: "fips"
            default: "level \(level)"
            }
        }
    }

    /// An RFCOMM stream socket connected to `device` on `channel`, bound to `adapter`, its link
    /// at `security` at least: the kernel secures the link before it opens the channel and refuses
    /// the connect when it cannot (rfcomm_check_security, hci_conn_security). BT_SECURITY read
    /// back on an RFCOMM socket gives the socket's own setting, not the link's, so there is nothing
    /// to check afterwards, unlike L2CAP.
    static func connectRFCOMM(adapter: BluetoothAddress, device: BluetoothAddress, channel: UInt8, security: Security = .low,
                              describing: String) async throws -> SystemPackage.FileDescriptor {
        let fd = try open(SOCK_STREAM, BTPROTO_RFCOMM, describing: describing)
        do {
            try Syscall.run("bind", on: describing) { tk_bt_rfcomm_bind(fd.rawValue, adapter.kernel, 0) }
            try configure(fd, receiveMTU: nil, security: security, describing: describing)
            try await connect(fd, describing: describing, what: "RFCOMM channel \(channel) on \(device)") {
                tk_bt_rfcomm_connect(fd.rawValue, device.kernel, channel)
            }
            return fd
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// The MTUs of a connected L2CAP channel.
    struct Channel {
        let fd: SystemPackage.FileDescriptor
        let sendMTU: Int
        let receiveMTU: Int
        /// The link's security level when the channel opened (``Security/name(of:)``).
        let security: String
    }

    /// An LE L2CAP connection-oriented channel (SOCK_SEQPACKET) to `device` on `psm`.
    static func connectL2CAP(adapter: BluetoothAddress, device: BluetoothAddress, addressType: String, psm: UInt16,
                             receiveMTU: Int?, security: Security, describing: String) async throws -> Channel {
        let fd = try open(SOCK_SEQPACKET, BTPROTO_L2CAP, describing: describing)
        do {
            let type = UInt8(addressType == "random" ? BDADDR_LE_RANDOM : BDADDR_LE_PUBLIC)
            try Syscall.run("bind", on: describing) { tk_bt_l2cap_bind(fd.rawValue, adapter.kernel, UInt8(BDADDR_LE_PUBLIC), 0) }
            try configure(fd, receiveMTU: receiveMTU, security: security, describing: describing)
            try await connect(fd, describing: describing, what: "L2CAP PSM \(psm) on \(device)") {
                tk_bt_l2cap_connect(fd.rawValue, device.kernel, type, psm)
            }
            let achieved = try requireSecurity(security, fd, device: device, describing: describing)
            return Channel(fd: fd, sendMTU: try mtu(fd, BT_SNDMTU, describing), receiveMTU: try mtu(fd, BT_RCVMTU, describing),
                           security: Security.name(of: achieved))
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// The link's level on a connected socket, or `.permissionDenied` when it is below `security`.
    @discardableResult
    static func requireSecurity(_ security: Security, _ fd: SystemPackage.FileDescriptor, device: BluetoothAddress, describing: String) throws -> UInt8 {
        let achieved = try securityLevel(fd, describing)
        guard achieved >= security.level else {
            throw TransportError(.permissionDenied, "\(describing): the link to \(device) is at security level \(Security.name(of: achieved)), "
                                 + "not \(security.rawValue): the kernel did not pair or encrypt it. Pair the device first "
                                 + "(`bluetoothctl pair \(device)` with an agent running); if the kernel log says \"security requested "
                                 + "but not available\", the adapter was brought up without mgmt (`btmgmt power off; btmgmt power on`)",
                                 errno: .permissionDenied, syscall: "getsockopt(BT_SECURITY)")
        }
        return achieved
    }

    /// The security level the connected link has now. On L2CAP sockets BT_SECURITY reads the
    /// link's; on RFCOMM ones, only the socket's own setting.
    static func securityLevel(_ fd: SystemPackage.FileDescriptor, _ describing: String) throws -> UInt8 {
        var value = bt_security()
        var length = socklen_t(MemoryLayout<bt_security>.size)
        try Syscall.run("getsockopt(BT_SECURITY)", on: describing) {
            getsockopt(fd.rawValue, SOL_BLUETOOTH, BT_SECURITY, &value, &length)
        }
        return value.level
    }

    /// A BR/EDR L2CAP channel (SOCK_SEQPACKET) to `device` on `psm`: PSM 1 is SDP (ServiceDiscovery.swift).
    static func connectClassicL2CAP(adapter: BluetoothAddress, device: BluetoothAddress, psm: UInt16,
                                    describing: String) async throws -> SystemPackage.FileDescriptor {
        let fd = try open(SOCK_SEQPACKET, BTPROTO_L2CAP, describing: describing)
        do {
            try Syscall.run("bind", on: describing) { tk_bt_l2cap_bind(fd.rawValue, adapter.kernel, UInt8(BDADDR_BREDR), 0) }
            try await connect(fd, describing: describing, what: "L2CAP PSM \(psm) (SDP) on \(device)") {
                tk_bt_l2cap_connect(fd.rawValue, device.kernel, UInt8(BDADDR_BREDR), psm)
            }
            return fd
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// The lowest RFCOMM channel that no socket listens on (or is bound to) on any of `adapters`:
    /// bind(2) answers EADDRINUSE for a taken one (net/bluetooth/rfcomm/sock.c). bluetoothd's own
    /// servers are kernel sockets bound to each adapter's address, so they count.
    static func freeRFCOMMChannel(on adapters: [BluetoothAddress], describing: String) throws -> UInt8 {
        for channel in UInt8(1)...30 {
            if try adapters.allSatisfy({ try isRFCOMMChannelFree(channel, on: $0, describing: describing) }) { return channel }
        }
        throw TransportError(.busy, "\(describing): every RFCOMM channel (1…30) is taken on the adapters to listen on; stop another RFCOMM server first")
    }

    /// `true` when `channel` is bound by no socket on `adapter` (bind(2) succeeds; EADDRINUSE: taken).
    static func isRFCOMMChannelFree(_ channel: UInt8, on adapter: BluetoothAddress, describing: String) throws -> Bool {
        let fd = try open(SOCK_STREAM, BTPROTO_RFCOMM, describing: describing)
        defer { fd.closeOwned() }
        switch Syscall.attempt({ tk_bt_rfcomm_bind(fd.rawValue, adapter.kernel, channel) }) {
        case .success: return true
        case .failure(.addressInUse): return false
        case .failure(let errno): throw TransportError.posix("bind", errno: errno, what: "\(describing) (RFCOMM channel \(channel))")
        }
    }

    /// A listening LE L2CAP socket on `psm`, bound to `adapter` (SOCK_SEQPACKET, non-blocking).
    static func listenL2CAP(adapter: BluetoothAddress, psm: UInt16, receiveMTU: Int?, security: Security, backlog: Int32,
                            describing: String) throws -> SystemPackage.FileDescriptor {
        let fd = try open(SOCK_SEQPACKET, BTPROTO_L2CAP, describing: describing)
        do {
            switch Syscall.attempt({ tk_bt_l2cap_bind(fd.rawValue, adapter.kernel, UInt8(BDADDR_LE_PUBLIC), psm) }) {
            case .success: break
            case .failure(.addressInUse):
                throw TransportError(.busy, "\(describing): PSM \(psm) is taken on this adapter (another listener, or bluetoothd's own service); choose another PSM",
                                     errno: .addressInUse, syscall: "bind")
            case .failure(let errno) where errno == .permissionDenied || errno == .notPermitted:
                throw TransportError(.permissionDenied, "\(describing): listening on PSM \(psm) needs CAP_NET_BIND_SERVICE (PSMs below 128); use a PSM from 128 to 255",
                                     errno: errno, syscall: "bind")
            case .failure(let errno): throw TransportError.posix("bind", errno: errno, what: describing)
            }
            try configure(fd, receiveMTU: receiveMTU, security: security, describing: describing)
            try Syscall.run("listen", on: describing) { Glibc.listen(fd.rawValue, backlog) }
            return fd
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// One connection from a listening L2CAP socket, if one is waiting (else `nil`, EAGAIN). One
    /// whose link is below `security` is closed and passed over (`nil`): the kernel asked for it,
    /// but a peer that failed to pair must not be let in regardless.
    static func acceptL2CAP(_ listener: SystemPackage.FileDescriptor, security: Security, describing: String) throws -> (channel: Channel, peer: BluetoothAddress, addressType: String)? {
        var peer = bdaddr_t()
        var type: UInt8 = 0
        switch Syscall.attempt({ tk_bt_l2cap_accept(listener.rawValue, &peer, &type) }) {
        case .success(let raw):
            let fd = SystemPackage.FileDescriptor(rawValue: raw)
            do {
                let level = try securityLevel(fd, describing)
                guard level >= security.level else {
                    fd.closeOwned()
                    return nil
                }
                let channel = Channel(fd: fd, sendMTU: try mtu(fd, BT_SNDMTU, describing), receiveMTU: try mtu(fd, BT_RCVMTU, describing),
                                      security: Security.name(of: level))
                return (channel, BluetoothAddress(kernel: peer), type == UInt8(BDADDR_LE_RANDOM) ? "random" : "public")
            } catch {
                fd.closeOwned()
                throw error
            }
        case .failure(.resourceTemporarilyUnavailable): return nil
        case .failure(.connectionAbort), .failure(.connectionReset): return nil   // gone before it was taken
        case .failure(let errno): throw TransportError.posix("accept4", errno: errno, what: describing)
        }
    }

    /// BT_RCVMTU and BT_SECURITY, set before connect(2) or listen(2).
    private static func configure(_ fd: SystemPackage.FileDescriptor, receiveMTU: Int?, security: Security, describing: String) throws {
        if let receiveMTU {
            var mtu = UInt16(clamping: receiveMTU)
            try Syscall.run("setsockopt(BT_RCVMTU)", on: describing) {
                setsockopt(fd.rawValue, SOL_BLUETOOTH, BT_RCVMTU, &mtu, socklen_t(MemoryLayout<UInt16>.size))
            }
        }
        if security != .low {
            var level = bt_security(level: security.level, key_size: 0)
            try Syscall.run("setsockopt(BT_SECURITY)", on: describing) {
                setsockopt(fd.rawValue, SOL_BLUETOOTH, BT_SECURITY, &level, socklen_t(MemoryLayout<bt_security>.size))
            }
        }
    }

    private static func mtu(_ fd: SystemPackage.FileDescriptor, _ option: Int32, _ describing: String) throws -> Int {
        var value: UInt16 = 0
        var length = socklen_t(MemoryLayout<UInt16>.size)
        try Syscall.run(option == BT_SNDMTU ? "getsockopt(BT_SNDMTU)" : "getsockopt(BT_RCVMTU)", on: describing) {
            getsockopt(fd.rawValue, SOL_BLUETOOTH, option, &value, &length)
        }
        return Int(value)
    }

    private static func open(_ type: __socket_type, _ proto: Int32, describing: String) throws -> SystemPackage.FileDescriptor {
        try Syscall.descriptor("socket(AF_BLUETOOTH)", on: describing,
                               hint: "this kernel has no Bluetooth support (module bluetooth not loaded?)") {
            socket(AF_BLUETOOTH, Int32(type.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue), proto)
        }
    }

    /// A non-blocking connect(2): waits for writability, then reads SO_ERROR. No timer of its own:
    /// the registry's connect deadline cancels the wait, and its error is the one timeout reported.
    private static func connect(_ fd: SystemPackage.FileDescriptor, describing: String, what: String, _ start: () -> Int32) async throws {
        switch Syscall.attempt(start) {
        case .success: return
        case .failure(.nowInProgress), .failure(.resourceTemporarilyUnavailable): break
        case .failure(let errno): throw failure(errno, describing: describing, what: what)
        }
        if let errno = try await fd.waitForConnect(describing: describing) { throw failure(errno, describing: describing, what: what) }
    }

    static func failure(_ errno: Errno, describing: String, what: String) -> TransportError {
        switch errno {
        case .connectionRefused:
            // An RFCOMM server that demands more security than the pairing gave (MITM, say) answers
            // the same way as a channel nobody serves.
            let also = what.hasPrefix("RFCOMM") ? ", or the service there demands more security than this link has"
                : ", or its listener's backlog is full"
            return TransportError(.refused, "\(describing): nobody listens on \(what)\(also) (the device refused the connection)", errno: errno, syscall: "connect")
        case .hostIsDown, .timedOut, .noRouteToHost:
            return TransportError(.timedOut, "\(describing): \(what) did not answer: out of range, switched off, or not connectable", errno: errno, syscall: "connect")
        case .resourceBusy where what.hasPrefix("RFCOMM"):
            return TransportError(.busy, "\(describing): \(what) is already connected from this machine (a channel carries one connection between "
                                  + "two devices); close the other connection first", errno: errno, syscall: "connect")
        case .resourceBusy:
            return TransportError(.busy, "\(describing): the adapter is busy with another connection attempt (one LE connect at a time); try again", errno: errno, syscall: "connect")
        case .permissionDenied, .notPermitted:
            // The kernel's answer when pairing fails: the peer wants authentication and nobody
            // confirmed it (bluetoothd refuses a confirmation when no agent is registered), or the
            // MITM protection asked for cannot be had with these devices' input and output.
            return TransportError(.permissionDenied, "\(describing): \(what) refused the link's security: pairing failed. Pair the device "
                                  + "first with an agent running to confirm it (`bluetoothctl`, then `pair ADDRESS` and `trust ADDRESS`), "
                                  + "or ask for less security", errno: errno, syscall: "connect")
        case .connectionReset, .connectionAbort:
            return TransportError(.refused, "\(describing): \(what) closed the connection during setup (security or pairing refused?)", errno: errno, syscall: "connect")
        default:
            return TransportError.posix("connect", errno: errno, what: "\(describing) (\(what))")
        }
    }
}
