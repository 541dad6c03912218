import CBlueZ
import Foundation
import Glibc
import Testing

/// The ground the Bluetooth plugins will stand on: two controllers emulated by BlueZ (btvirt),
/// wired together, and plain kernel sockets between them.
///
/// LE L2CAP needs LE enabled on the host side of both controllers (`btmgmt le on`; `hciconfig up`
/// alone leaves it off and the kernel refuses an LE connect with ECONNREFUSED before sending any
/// HCI command) and the listening side advertising as connectable. `labctl bt-up` does both.
@Suite("lab: Bluetooth sockets between two emulated controllers", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab's USB and Bluetooth drivers: run Scripts/lab"))
struct BluetoothLabTests {
    struct Controllers {
        var central: bdaddr_t
        var centralText: String
        var peripheral: bdaddr_t
        var peripheralText: String
    }

    /// Brings up hci0 and hci1 and reads their addresses from labctl.
    static func controllers() async throws -> Controllers {
        let output = try await Lab.ctl("bt-up")
        var addresses: [String: String] = [:]
        for line in output.split(separator: "\n") {
            let words = line.split(separator: " ")
            if words.count == 2 { addresses[String(words[0])] = String(words[1]) }
        }
        let first = try #require(addresses["hci0"], "bt-up printed \(output)")
        let second = try #require(addresses["hci1"], "bt-up printed \(output)")
        var a = bdaddr_t()
        var b = bdaddr_t()
        try #require(str2ba(first, &a) == 0 && str2ba(second, &b) == 0)
        return Controllers(central: a, centralText: first, peripheral: b, peripheralText: second)
    }

    enum SocketKind {
        case rfcomm(channel: UInt8)
        case l2capLE(psm: UInt16)

        /// A socket with 10 s timeouts bound to `address` (on the channel or PSM when it is to
        /// listen, else on any); -1 with errno set on failure.
        func socket(boundTo address: bdaddr_t, listening: Bool) -> Int32 {
            let fd: Int32
            let bound: Int32
            switch self {
            case .rfcomm(let channel):
                fd = Glibc.socket(AF_BLUETOOTH, Int32(SOCK_STREAM.rawValue | SOCK_CLOEXEC.rawValue), BTPROTO_RFCOMM)
                guard fd >= 0 else { return -1 }
                bound = tk_bt_rfcomm_bind(fd, address, listening ? channel : 0)
            case .l2capLE(let psm):
                fd = Glibc.socket(AF_BLUETOOTH, Int32(SOCK_SEQPACKET.rawValue | SOCK_CLOEXEC.rawValue), BTPROTO_L2CAP)
                guard fd >= 0 else { return -1 }
                bound = tk_bt_l2cap_bind(fd, address, UInt8(BDADDR_LE_PUBLIC), listening ? psm : 0)
            }
            var limit = timeval(tv_sec: 10, tv_usec: 0)
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, socklen_t(MemoryLayout<timeval>.size))
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, socklen_t(MemoryLayout<timeval>.size))
            guard bound == 0 else {
                let code = errno
                close(fd)
                errno = code
                return -1
            }
            return fd
        }

        func connect(_ fd: Int32, to address: bdaddr_t) -> Int32 {
            switch self {
            case .rfcomm(let channel): tk_bt_rfcomm_connect(fd, address, channel)
            case .l2capLE(let psm): tk_bt_l2cap_connect(fd, address, UInt8(BDADDR_LE_PUBLIC), psm)
            }
        }
    }

    struct Exchange: Sendable {
        var serverReceived: [UInt8]
        var clientReceived: [UInt8]
        var connectTime: Duration
        var failure: String?
    }

    /// A server socket on the peripheral and a client on the central; each side sends one message
    /// and reads the other's. Blocking sockets on threads of their own, with 10 s timeouts.
    static func exchange(_ kind: SocketKind, _ controllers: Controllers, toServer: [UInt8], toClient: [UInt8]) async -> Exchange {
        await withCheckedContinuation { continuation in
            Thread {
                continuation.resume(returning: exchangeBlocking(kind, controllers, toServer: toServer, toClient: toClient))
            }.start()
        }
    }

    private static func exchangeBlocking(_ kind: SocketKind, _ c: Controllers, toServer: [UInt8], toClient: [UInt8]) -> Exchange {
        var result = Exchange(serverReceived: [], clientReceived: [], connectTime: .zero, failure: nil)
        func fail(_ what: String) -> Exchange {
            result.failure = "\(what): \(String(cString: strerror(errno))) (errno \(errno))"
            return result
        }
        let listener = kind.socket(boundTo: c.peripheral, listening: true)
        guard listener >= 0 else { return fail("socket and bind (server)") }
        defer { close(listener) }
        guard listen(listener, 1) == 0 else { return fail("listen") }
        // Bound to the central's address: that picks the controller the connection leaves from.
        let client = kind.socket(boundTo: c.central, listening: false)
        guard client >= 0 else { return fail("socket and bind (client)") }
        defer { close(client) }

        let started = ContinuousClock.now
        let connected = kind.connect(client, to: c.peripheral)
        guard connected == 0 else { return fail("connect") }
        result.connectTime = ContinuousClock.now - started
        let server = accept(listener, nil, nil)
        guard server >= 0 else { return fail("accept") }
        _ = fcntl(server, F_SETFD, FD_CLOEXEC)
        defer { close(server) }

        guard sendAll(client, toServer) else { return fail("send (client)") }
        result.serverReceived = receive(server, count: toServer.count)
        guard sendAll(server, toClient) else { return fail("send (server)") }
        result.clientReceived = receive(client, count: toClient.count)
        return result
    }

    /// Writes in pieces of at most 200 bytes (under the default L2CAP MTU of 672).
    private static func sendAll(_ fd: Int32, _ bytes: [UInt8]) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let end = min(offset + 200, bytes.count)
            let sent = bytes[offset..<end].withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
            guard sent > 0 else { return false }
            offset += sent
        }
        return true
    }

    private static func receive(_ fd: Int32, count: Int) -> [UInt8] {
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while bytes.count < count {
            let got = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            guard got > 0 else { break }
            bytes += buffer[..<got]
        }
        return bytes
    }

    enum Channel: String, CaseIterable, Sendable, CustomTestStringConvertible {
        case rfcomm = "RFCOMM channel 7"
        case l2capLE = "LE L2CAP connection-oriented channel, PSM 0x80"
        var kind: SocketKind { self == .rfcomm ? .rfcomm(channel: 7) : .l2capLE(psm: 0x80) }
        var testDescription: String { rawValue }
    }

    @Test("hci0 connects to a listening socket on hci1 (advertising, for LE); bytes pass both ways", arguments: Channel.allCases)
    func bytesPassBothWays(_ channel: Channel) async throws {
        let controllers = try await Self.controllers()
        let toServer = (0..<5000).map { UInt8(truncatingIfNeeded: $0 &* 7) }
        let toClient = Array("hello from \(controllers.peripheralText) over \(channel.rawValue)".utf8)
        let result = await Self.exchange(channel.kind, controllers, toServer: toServer, toClient: toClient)
        #expect(result.failure == nil, "\(result.failure ?? "")")
        #expect(result.serverReceived == toServer)
        #expect(result.clientReceived == toClient)
        print("lab: \(channel.rawValue): connect took \(result.connectTime)")
    }

    @Test("LE L2CAP to a PSM nobody listens on is refused, not hung")
    func l2capLERefused() async throws {
        let controllers = try await Self.controllers()
        let kind = SocketKind.l2capLE(psm: 0x0091)
        let client = kind.socket(boundTo: controllers.central, listening: false)
        try #require(client >= 0)
        defer { close(client) }
        let connected = kind.connect(client, to: controllers.peripheral)
        let code = errno
        #expect(connected == -1 && code == ECONNREFUSED, "connect returned \(connected), errno \(code)")
    }
}
