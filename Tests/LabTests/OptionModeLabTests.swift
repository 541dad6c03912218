import CBlueZ
import Foundation
import Glibc
import Synchronization
import SystemPackage
import Testing
import TestSupport
import TransportKit
import TransportKitDBus
import TransportKitSerial
@_spi(Plugins) import TransportKitCore

/// Issue 25, item 7, for the modes only the lab can run: the Bluetooth modes between the lab's two
/// emulated controllers, usb:// on the Loopback gadget and tty:// on the real CDC-ACM port. Each
/// test connects or listens with every option its mode takes (checked against the registered
/// descriptor, so a newly declared option fails here until a test gives it; the registry refuses a
/// connect or listen whose plugin left a given option unread), moves bytes both ways, and checks
/// each option's effect where the lab can see it. The plain suite does the same for tcp, unix,
/// loop, pty, tty over a pty and spy (Tests/TransportKitTests/OptionModeTests.swift).
///
/// What the lab showed about security= (no pairing agent; both controllers NoInputNoOutput):
/// - BR/EDR pairs by itself: the kernel accepts Secure Simple Pairing's Just Works, so an RFCOMM
///   link is authenticated and encrypted even at security=low; medium connects, and only high (MITM
///   protection, which these devices cannot give) is refused, with EACCES from connect. An RFCOMM
///   listener admits medium (bluetoothd's RequireAuthentication) and turns high away itself.
/// - LE does not pair without an agent (with one registered it did), so medium is refused: connect's
///   EACCES, or a link left at low that the plugin's read-back refuses.
///
/// The guest's kernel (Debian's 6.1) has a race in which an L2CAP socket released while its link
/// is torn down corrupts a list ("kernel BUG at lib/list_debug.c:56" in hci_chan_del, from
/// l2cap_sock_release; upstream: "Bluetooth: L2CAP: Fix corrupted list in hci_chan_del"). It killed
/// bluetoothd (or krfcommd) and with it every later Bluetooth test of the run. It came after an
/// RFCOMM connect to an address nobody answers, and in most runs in which RFCOMM connections went
/// both ways between the controllers (hci1 to hci0 while hci0 was connected to hci1). So these
/// tests never do either, wait for bluetoothd's service discovery before closing or refusing, and
/// let links drop by themselves before forgetting devices (settleAndForget). What that leaves out:
/// an RFCOMM timeout= that expires (the option is given and read, its expiry is not shown), and the
/// effect of an RFCOMM listener's backlog= (one device reaches a channel once, EBUSY for a second;
/// a second caller would be hci1 towards hci0).
///
/// Order matters (the suite is serialized, in declaration order): the SDP test comes before the
/// channel test. A connect to bluetoothd's profile listener right after a paired connect to a plain
/// kernel socket was refused "pairing failed" (EACCES) in three of five runs, though each test
/// passes alone; clearing the kernel's link keys between tests (forgetDevices) did not stop it.
@Suite("lab: every option of each Bluetooth, USB and tty mode, and its effect", .serialized,
       .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct OptionModeLabTests {
    /// The modes of the lab's schemes, each with a test below.
    static let covered: Set<String> = [
        "rfcomm:// connection to a channel", "rfcomm:// connection found through SDP", "rfcomm:// listener",
        "ble:// L2CAP connection", "ble:// GATT serial connection", "ble:// L2CAP listener", "ble:// GATT serial listener",
        "usb:// connection", "usb:// control-only connection", "tty:// connection to a USB adapter", "tty:// connection to a device node",
    ]

    /// The options of `mode` that `url` does not give (as the plain suite's `missing`).
    static func missing(_ url: String, mode name: String, scheme: String) throws -> [String] {
        let descriptor = try #require(Transport.registry.descriptor(for: scheme))
        let mode = try #require(descriptor.effectiveModes.first { $0.name == name }, "no mode '\(name)' in \(scheme)://")
        var layer: TransportURL? = try TransportURL(url)
        var given: [String] = []
        while let current = layer {
            if current.scheme == scheme { given = current.query.map { $0.name.lowercased() } }
            layer = current.inner
        }
        return descriptor.options(of: mode).map { $0.name.lowercased() }.filter { !given.contains($0) }
    }

    @Test func everyModeOfTheLabsSchemesHasATestHere() {
        for scheme in ["rfcomm", "ble", "usb", "tty"] {
            let modes = Transport.registry.descriptor(for: scheme)?.effectiveModes ?? []
            #expect(!modes.isEmpty, "\(scheme):// is not registered")
            for mode in modes {
                #expect(Self.covered.contains(mode.name), "the mode '\(mode.name)' has no test with every option in OptionModeLabTests")
            }
        }
    }

    // MARK: - Helpers

    /// What `hcitool con` lists on `adapter` for the link to `address` ("< ACL … lm CENTRAL AUTH ENCRYPT").
    static func link(to address: String, on adapter: String) async throws -> String? {
        let listed = try await Lab.run("/usr/bin/hcitool", ["-i", adapter, "con"])
        return listed.stdout.split(separator: "\n").first { $0.contains(address) }.map(String.init)
    }

    /// A plain kernel socket on the other side: accepts one connection on `listener` within 20 s,
    /// reads `count` bytes, sends `reply`; returns what it read (nil: nobody came).
    static func kernelPeer(_ listener: Int32, expecting count: Int, reply: [UInt8]) -> Task<[UInt8]?, Never> {
        Task {
            await Lab.onThread {
                var ready = pollfd(fd: listener, events: Int16(POLLIN), revents: 0)
                guard poll(&ready, 1, 20_000) > 0 else { return nil }
                let server = accept(listener, nil, nil)
                guard server >= 0 else { return nil }
                defer { close(server) }
                var limit = timeval(tv_sec: 10, tv_usec: 0)
                setsockopt(server, SOL_SOCKET, SO_RCVTIMEO, &limit, socklen_t(MemoryLayout<timeval>.size))
                var received: [UInt8] = []
                var buffer = [UInt8](repeating: 0, count: 1024)
                while received.count < count {
                    let got = recv(server, &buffer, buffer.count, 0)
                    guard got > 0 else { break }
                    received += buffer[..<got]
                }
                _ = reply.withUnsafeBytes { send(server, $0.baseAddress, $0.count, 0) }
                usleep(500_000)   // the reply goes out before the close
                return received
            }
        }
    }

    /// Connects to a bluetoothd profile listener that demands security=medium. With no agent, the
    /// lab's Just Works pairing was refused ("pairing failed", EACCES from connect) in about one CI
    /// run in five, after other tests' pairings (see the suite's note), though each test passes
    /// alone: the connect is tried once more after the links are gone and the keys cleared, and
    /// the refusal is printed. A second refusal fails the test.
    static func connectPairing(_ url: String) async throws -> Connection {
        do {
            return try await BlueZLabTests.connect(url)
        } catch let error as TransportError where error.errno == .permissionDenied {
            print("lab: \(url): \(error.message); trying once more after clearing the links and keys")
            try await settleAndForget()
            return try await BlueZLabTests.connect(url)
        }
    }

    /// Forgets every device once hci0 has no BR/EDR link left (up to 15 s): every socket closed,
    /// the link dropped by itself, so RemoveDevice tears down no link under an open socket (the
    /// kernel race described at the top of the suite).
    static func settleAndForget() async throws {
        let until = ContinuousClock.now + .seconds(15)
        while ContinuousClock.now < until {
            let listed = try await Lab.run("/usr/bin/hcitool", ["-i", "hci0", "con"])
            if !listed.stdout.contains("ACL") { break }
            try await Task.sleep(for: .milliseconds(200))
        }
        try await BlueZLabTests.forgetDevices()
    }

    /// Waits (up to 10 s) until bluetoothd has finished discovering the services of every connected
    /// device (Device1.ServicesResolved): after a new pairing it browses the peer's SDP records over
    /// an L2CAP channel of its own, which must not be open when the link goes (the kernel race
    /// described at the top of the suite). The tests let it finish before they close or refuse anything.
    static func awaitServiceDiscovery() async throws {
        let bus = try DBusConnection(.system)
        let until = ContinuousClock.now + .seconds(10)
        while ContinuousClock.now < until {
            let reply = try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
            let devices = (reply.first?.dictionary ?? [:]).values.compactMap { $0.dictionary?["org.bluez.Device1"]?.dictionary }
            if devices.allSatisfy({ $0["Connected"]?.boolValue != true || $0["ServicesResolved"]?.boolValue == true }) { break }
            try await Task.sleep(for: .milliseconds(200))
        }
        await bus.close()
    }

    /// The records `sdptool records` finds on `address`, one string each.
    static func sdpRecords(_ address: String) async throws -> [String] {
        let listed = try await Lab.run("/usr/bin/sdptool", ["records", address])
        return listed.stdout.components(separatedBy: "\n\n")
    }

    /// LEAdvertisingManager1.ActiveInstances of hci1: the advertisements registered through bluetoothd.
    static func activeAdvertisements() async throws -> Int64? {
        let bus = try DBusConnection(.system)
        let reply = try? await bus.call(destination: "org.bluez", path: "/org/bluez/hci1", interface: "org.freedesktop.DBus.Properties", member: "Get",
                                        [.string("org.bluez.LEAdvertisingManager1"), .string("ActiveInstances")])
        await bus.close()
        return reply?.first?.integer
    }

    // MARK: - rfcomm://

    /// A few bytes each way between the two ends of one connection, compared.
    static func bothWays(client: Connection, server: Connection, _ label: String) async throws {
        let toServer = Array("\(label): to the server".utf8)
        let toClient = Array("\(label): to the client".utf8)
        async let serverSide = BlueZListenLabTests.exchange(server, send: toClient, expecting: toServer.count)
        let clientReceived = try await BlueZListenLabTests.exchange(client, send: toServer, expecting: toClient.count)
        #expect(try await serverSide == toServer, "\(label)")
        #expect(clientReceived == toClient, "\(label)")
    }

    @Test func rfcommFoundThroughSDPTakesEveryOption() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let service = BlueZListenLabTests.service
        let listener = try await Transport.listen(on: "rfcomm://any?adapter=hci1&uuid=\(service)")
        let channel = try #require(listener.url.port)
        do {
            let accepted = BlueZListenLabTests.acceptOne(listener)
            let url = "rfcomm://\(controllers.peripheralText)?adapter=hci0&uuid=\(service)&security=medium&timeout=20"
            #expect(try Self.missing(url, mode: "rfcomm:// connection found through SDP", scheme: "rfcomm").isEmpty)
            // Agentless BR/EDR pairing between the emulated controllers (connectPairing explains).
            let client = try await Self.connectPairing(url)
            #expect(client.metadata.extra["channel"] == String(channel), "SDP found the channel of the service uuid= names")
            #expect(client.metadata.extra["service"] == service)
            #expect(client.metadata.extra["adapter"] == "hci0")
            #expect(client.metadata.localAddress == controllers.centralText)
            #expect(client.metadata.extra["security"] == "medium")
            let server = try #require(try await accepted.value, "the listener got no connection")
            try await Self.bothWays(client: client, server: server, "sdp")
            try await Self.awaitServiceDiscovery()
            // Without uuid= the Serial Port Profile is looked for, which hci1 does not publish (asked
            // over the link that is up).
            let spp = await expectLabError(.notFound) { try await Transport.connect(to: "rfcomm://\(controllers.peripheralText)?adapter=hci0&timeout=20") }
            #expect(spp?.message.contains("publishes no RFCOMM service") == true, "\(String(describing: spp))")
            try? await client.close()
            try? await server.close()
        } catch {
            Issue.record(error)
        }
        try await listener.close()
        try await Self.settleAndForget()
    }

    @Test func rfcommToAChannelTakesEveryOption() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let listener = BluetoothLabTests.SocketKind.rfcomm(channel: 23).socket(boundTo: controllers.peripheral, listening: true)
        try #require(listener >= 0, "socket and bind: \(errno)")
        defer { close(listener) }
        try #require(listen(listener, 1) == 0)
        let toPeer = Array("every option, to the peer".utf8)
        let toUs = Array("and back".utf8)
        let peer = Self.kernelPeer(listener, expecting: toPeer.count, reply: toUs)

        let url = "rfcomm://\(controllers.peripheralText):23?adapter=hci0&security=medium&timeout=20"
        #expect(try Self.missing(url, mode: "rfcomm:// connection to a channel", scheme: "rfcomm").isEmpty)
        let connection = try await BlueZLabTests.connect(url)
        #expect(connection.metadata.extra["adapter"] == "hci0")
        #expect(connection.metadata.localAddress == controllers.centralText, "adapter=hci0: the link leaves from hci0")
        #expect(connection.metadata.remoteAddress == controllers.peripheralText)
        #expect(connection.metadata.extra["channel"] == "23")
        #expect(connection.metadata.extra["security"] == "medium")
        let link = try await Self.link(to: controllers.peripheralText, on: "hci0")
        #expect(link?.contains("ENCRYPT") == true, "security=medium: an encrypted link: \(link ?? "no link")")
        try await Self.awaitServiceDiscovery()

        try await connection.write(toPeer)
        var received: [UInt8] = []
        while received.count < toUs.count, let chunk = try await connection.read(timeout: .seconds(10)) { received += chunk }
        #expect(received == toUs)
        #expect(await peer.value == toPeer)
        try? await connection.close()
        try await Self.settleAndForget()
    }

    @Test func rfcommListenerTakesEveryOption() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let service = BlueZListenLabTests.service
        // adapter=hci1: only hci1's channels count. A plain socket holds channel 24 on hci0, which
        // makes a listener on every adapter refuse the channel, and leaves one on hci1 alone.
        let holder = BluetoothLabTests.SocketKind.rfcomm(channel: 24).socket(boundTo: controllers.central, listening: true)
        try #require(holder >= 0, "socket and bind on hci0: \(errno)")
        defer { close(holder) }
        let everywhere = await expectLabError(.busy) { try await Transport.listen(on: "rfcomm://any:24?uuid=\(service)") }
        #expect(everywhere?.message.contains("RFCOMM channel 24 is taken") == true, "\(String(describing: everywhere))")

        let url = "rfcomm://any:24?adapter=hci1&uuid=\(service)&name=TKLab-modes&backlog=1&security=medium"
        #expect(try Self.missing(url, mode: "rfcomm:// listener", scheme: "rfcomm").isEmpty)
        let listener = try await Transport.listen(on: url)
        do {
            #expect(listener.url.port == 24)
            // The published SDP record: name=, uuid= and the channel.
            let records = try await Self.sdpRecords(controllers.peripheralText)
            let ours = records.filter { $0.contains("Service Name: TKLab-modes") }
            #expect(!ours.isEmpty, "no record named TKLab-modes: \(records)")
            #expect(ours.allSatisfy { $0.contains("UUID 128: \(service)") && $0.contains("Channel: 24") }, "\(ours)")

            let accepted = BlueZListenLabTests.acceptOne(listener)
            let client = try await Self.connectPairing("rfcomm://\(controllers.peripheralText):24?adapter=hci0")
            let server = try #require(try await accepted.value, "the listener got no connection")
            #expect(server.metadata.extra["adapter"] == "hci1")
            #expect(server.metadata.remoteAddress == controllers.centralText)
            #expect(server.metadata.extra["channel"] == "24")
            let link = try await Self.link(to: controllers.centralText, on: "hci1")
            #expect(link?.contains("ENCRYPT") == true, "security=medium: the peer's link is encrypted: \(link ?? "no link")")
            try await Self.bothWays(client: client, server: server, "listener")
            try await Self.awaitServiceDiscovery()
            try? await client.close()
            try? await server.close()
        } catch {
            Issue.record(error)
        }
        try await listener.close()
        try await Self.settleAndForget()
    }

    /// security= on an RFCOMM connect: BR/EDR pairs with Just Works by itself (the kernel accepts it
    /// for two NoInputNoOutput devices), so low and medium connect over an encrypted link; high
    /// needs MITM protection these devices cannot give and is refused.
    @Test func rfcommSecurityLowAndMediumConnectAndHighIsRefused() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let listener = BluetoothLabTests.SocketKind.rfcomm(channel: 26).socket(boundTo: controllers.peripheral, listening: true)
        try #require(listener >= 0, "socket and bind: \(errno)")
        defer { close(listener) }
        try #require(listen(listener, 4) == 0)
        for level in ["low", "medium"] {
            let connection = try await BlueZLabTests.connect("rfcomm://\(controllers.peripheralText):26?adapter=hci0&security=\(level)")
            #expect(connection.metadata.extra["security"] == level)
            let link = try await Self.link(to: controllers.peripheralText, on: "hci0")
            #expect(link?.contains("AUTH ENCRYPT") == true, "security=\(level): \(link ?? "no link")")
            try await Self.awaitServiceDiscovery()
            // RFCOMM's metadata names the level asked for (the kernel refuses a link below it;
            // BT_SECURITY on an RFCOMM socket reads the socket's setting, not the link's), so a
            // Just Works link that came encrypted still says "low" when low was asked for.
            try? await connection.close()
            try await Self.settleAndForget()
        }
        let high = await expectLabError(.permissionDenied) {
            try await Transport.connect(to: "rfcomm://\(controllers.peripheralText):26?adapter=hci0&security=high&timeout=20")
        }
        #expect(high?.errno == .permissionDenied && high?.syscall == "connect", "\(String(describing: high))")
        #expect(high?.message.contains("refused the link's security: pairing failed") == true, "\(String(describing: high))")
        #expect(high?.message.contains("agent") == true, "the message says what to do: \(String(describing: high))")
        try await Self.settleAndForget()
    }

    /// security= on an RFCOMM listener: bluetoothd demands authentication for medium
    /// (RequireAuthentication), which Just Works gives; high is more than bluetoothd's Profile API
    /// asks for, and the socket it hands over cannot show the link's level, so a listener refuses
    /// security=high when it starts, rather than promise what it cannot check.
    @Test func rfcommListenerSecurityMediumAdmitsAndHighIsRefused() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let medium = try await Transport.listen(on: "rfcomm://any:27?adapter=hci1&security=medium")
        let high = await expectLabError(.invalidURL) {
            try await Transport.listen(on: "rfcomm://any:28?adapter=hci1&uuid=\(BlueZListenLabTests.service)&security=high")
        }
        #expect(high?.message.contains("an rfcomm:// listener takes security=low or medium") == true, "\(String(describing: high))")
        do {
            // One CI run (of about ten) saw the client's connect succeed and bluetoothd never hand
            // the connection over, right after the previous test's paired connects to a plain
            // kernel socket (the pairing oddity described at the top of the suite). A second
            // attempt is made once, after the link is gone, and what the lab showed is printed.
            var attempt = 0
            var pair: (client: Connection, server: Connection)?
            while pair == nil && attempt < 2 {
                attempt += 1
                let accepted = BlueZListenLabTests.acceptOne(medium, within: 10)
                let client = try await Self.connectPairing("rfcomm://\(controllers.peripheralText):27?adapter=hci0")
                if let server = try await accepted.value {
                    pair = (client, server)
                } else {
                    let links = try await Lab.run("/usr/bin/hcitool", ["-i", "hci1", "con"])
                    let log = try await Lab.run("/usr/bin/tail", ["-n", "20", "/run/labctl-bluetoothd.log"])
                    print("lab: rfcomm listener attempt \(attempt): connected, not handed over; links: \(links.stdout) bluetoothd: \(log.stdout)")
                    try? await client.close()
                    try await Self.settleAndForget()
                }
            }
            let (client, server) = try #require(pair, "security=medium admits a Just Works link")
            let link = try await Self.link(to: controllers.centralText, on: "hci1")
            #expect(link?.contains("AUTH ENCRYPT") == true, "\(link ?? "no link")")
            try await Self.bothWays(client: client, server: server, "medium")
            try await Self.awaitServiceDiscovery()
            try? await client.close()
            try? await server.close()
        } catch {
            Issue.record(error)
        }
        try await medium.close()
        try await Self.settleAndForget()
    }

    // MARK: - ble://

    @Test func bleL2CAPConnectionTakesEveryOption() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let listener = try await Transport.listen(on: "ble://FFF0:161?adapter=hci1&advertise=false")
        do {
            let accepted = BlueZListenLabTests.acceptOne(listener)
            let url = "ble://FFF0:161/\(controllers.peripheralText)?adapter=hci0&addressType=public&receiveMTU=200&security=low&timeout=20"
            #expect(try Self.missing(url, mode: "ble:// L2CAP connection", scheme: "ble").isEmpty)
            let client = try await BlueZLabTests.connect(url)
            let server = try #require(try await accepted.value, "the listener got no connection")
            #expect(client.metadata.extra["receiveMTU"] == "200", "receiveMTU= is the receive MTU offered")
            #expect(server.metadata.extra["sendMTU"] == "200", "the peer sends records of at most our receiveMTU=")
            #expect(client.metadata.extra["addressType"] == "public")
            #expect(client.metadata.extra["adapter"] == "hci0" && client.metadata.localAddress == controllers.centralText)
            #expect(server.metadata.remoteAddress == controllers.centralText)
            #expect(client.metadata.extra["security"] == "low")
            #expect(client.metadata.extra["psm"] == "161")
            try await Self.bothWays(client: client, server: server, "l2cap")
            // 500 bytes from the peer arrive as records of at most 200.
            let bulk = BlueZLabTests.pattern(500)
            try await server.write(bulk)
            var records: [[UInt8]] = []
            while records.joined().count < bulk.count, let record = try await client.readMessage(timeout: .seconds(10)) { records.append(record) }
            #expect(Array(records.joined()) == bulk)
            #expect(records.map(\.count) == [200, 200, 100], "\(records.map(\.count))")
            try? await client.close()
            try? await server.close()
        } catch {
            Issue.record(error)
        }
        try await listener.close()
        // timeout= bounds the LE discovery of a device nobody has seen (addressType=bluez, the default).
        let started = ContinuousClock.now
        let absent = await expectLabError(.notFound) { try await Transport.connect(to: "ble://FFF0:161/00:11:22:33:44:55?adapter=hci0&timeout=3") }
        #expect(absent?.message.contains("not found within the 3 s timeout") == true, "\(String(describing: absent))")
        #expect(ContinuousClock.now - started < .seconds(8))
        try await Self.settleAndForget()
    }

    @Test func bleL2CAPListenerTakesEveryOption() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let advertising = try await Self.activeAdvertisements()
        let url = "ble://FFF0:162?adapter=hci1&advertise=true&receiveMTU=300&security=low&backlog=1"
        #expect(try Self.missing(url, mode: "ble:// L2CAP listener", scheme: "ble").isEmpty)
        let listener = try await Transport.listen(on: url)
        var connections: [Connection] = []
        do {
            #expect(try await Self.activeAdvertisements() == advertising.map { $0 + 1 }, "advertise=true registers an advertisement on hci1")
            let client = "ble://FFF0:162/\(controllers.peripheralText)?adapter=hci0&addressType=public&timeout=10"
            // backlog=1: the kernel lets backlog + 1 channels wait (sk_acceptq_is_full is "more
            // than"); the next is refused until one is accepted.
            let first = try await BlueZLabTests.connect(client)
            let second = try await Transport.connect(to: client)
            connections += [first, second]
            let beyond = await expectLabError(.refused) { try await Transport.connect(to: client) }
            #expect(beyond?.errno == .connectionRefused, "\(String(describing: beyond))")
            let one = try #require(try await BlueZListenLabTests.acceptOne(listener, within: 5).value)
            let two = try #require(try await BlueZListenLabTests.acceptOne(listener, within: 5).value)
            connections += [one, two]
            let room = BlueZListenLabTests.acceptOne(listener)
            let third = try await Transport.connect(to: client)
            let three = try #require(try await room.value, "accepted: room in the backlog again")
            connections += [third, three]

            #expect(one.metadata.extra["receiveMTU"] == "300", "receiveMTU= is the listener's receive MTU")
            #expect(first.metadata.maximumWriteSize == 300, "the client sends records of at most 300")
            #expect(one.metadata.extra["adapter"] == "hci1" && one.metadata.localAddress == controllers.peripheralText)
            #expect(one.metadata.remoteAddress == controllers.centralText)
            #expect(one.metadata.extra["security"] == "low")
            try await Self.bothWays(client: first, server: one, "listener")
            let bulk = BlueZLabTests.pattern(700)
            try await first.write(bulk)
            var records: [[UInt8]] = []
            while records.joined().count < bulk.count, let record = try await one.readMessage(timeout: .seconds(10)) { records.append(record) }
            #expect(Array(records.joined()) == bulk)
            #expect(records.map(\.count) == [300, 300, 100], "\(records.map(\.count))")
        } catch {
            Issue.record(error)
        }
        for connection in connections { try? await connection.close() }
        try await listener.close()
        #expect(try await Self.activeAdvertisements() == advertising, "the advertisement is withdrawn on close")
        try await Self.settleAndForget()
    }

    /// security= on LE: LE pairing does not succeed without an agent, so low works and medium is
    /// refused, on the connecting side and on the listening side.
    @Test func bleSecurityLowConnectsAndMediumIsRefusedBothWays() async throws {
        let controllers = try await BlueZListenLabTests.setUp()
        let listener = try await Transport.listen(on: "ble://FFF0:163?adapter=hci1&advertise=false")
        do {
            let accepted = BlueZListenLabTests.acceptOne(listener)
            let low = try await BlueZLabTests.connect("ble://FFF0:163/\(controllers.peripheralText)?adapter=hci0&addressType=public&security=low")
            #expect(low.metadata.extra["security"] == "low")
            let server = try #require(try await accepted.value)
            try await Self.bothWays(client: low, server: server, "low")
            try? await low.close()
            try? await server.close()
            try await Self.settleAndForget()

            let medium = await expectLabError(.permissionDenied) {
                try await Transport.connect(to: "ble://FFF0:163/\(controllers.peripheralText)?adapter=hci0&addressType=public&security=medium&timeout=20")
            }
            // The kernel refuses the channel (pairing failed), or opens it over a link it could not
            // encrypt, which the plugin reads back and refuses.
            let said = medium?.message ?? ""
            #expect(medium?.errno == .permissionDenied, "\(String(describing: medium))")
            #expect(said.contains("refused the link's security: pairing failed") || said.contains("is at security level low, not medium"), "\(said)")
            #expect(said.contains("agent"), "the message says what to do: \(said)")
        } catch {
            Issue.record(error)
        }
        try await listener.close()
        try await Self.settleAndForget()

        // A listener with security=medium: the kernel asks a low client to pair, which fails: its
        // connect is refused (EACCES, "pairing failed") or, in some runs, never completes (the
        // timeout ends it); either way nothing is accepted.
        let guarded = try await Transport.listen(on: "ble://FFF0:164?adapter=hci1&advertise=false&security=medium")
        let waiting = BlueZListenLabTests.acceptOne(guarded, within: 8)
        do {
            let connection = try await Transport.connect(to: "ble://FFF0:164/\(controllers.peripheralText)?adapter=hci0&addressType=public&timeout=5")
            Issue.record("a low client got a channel from a listener with security=medium: \(connection.metadata.extra)")
            try? await connection.close()
        } catch let error as TransportError {
            let pairing = error.kind == .permissionDenied && error.message.contains("pairing failed")
            #expect(pairing || error.kind == .timedOut, "\(error)")
        }
        #expect(try await waiting.value == nil, "a listener with security=medium accepts no unpaired link")
        try await guarded.close()
        try await Self.settleAndForget()
    }

    @Test func bleGattSerialTakesEveryOption() async throws {
        // Earlier tests' devices forgotten first, then hci1's fresh advertising state and the
        // peripheral (forgetting after it registered left hci0 seeing no advertisement once, in a
        // whole lab run after the GATT suites).
        _ = try await BlueZLabTests.setUp(advertising: false)   // bluetoothd up when this test runs alone
        try await Self.settleAndForget()
        let (controllers, peripheral) = try await GattLabTests.setUp()
        // security=medium pairs (Just Works) with the device first. This process's agent answers
        // for the pairing it starts; the device's side is bluez-tools' bt-agent, the default agent
        // (bluetoothd asks it about pairings it did not start), which authorizes it (its answer
        // comes from standard input). A refusal first was tried: once in a CI run the LE link of
        // the pairing after it showed no ENCRYPT, so the refusal is left out until that is understood.
        let peerAgent = try Lab.Background("/usr/bin/stdbuf", ["-oL", "/usr/bin/bt-agent", "--capability", "NoInputNoOutput"], input: "yes\n")
        defer { Task { await peerAgent.stop() } }
        try #require(await eventually(10, every: .milliseconds(50)) { peerAgent.output.contains("Default agent requested") }, "bt-agent: \(peerAgent.output)")
        let agent = try await BluetoothPairingAgent.register(asDefault: false)
        do {
            let url = "ble://6E400001-B5A3-F393-E0A9-E50E24DCCA9E/\(controllers.peripheralText)?adapter=hci0"
                + "&rx=6E400003-B5A3-F393-E0A9-E50E24DCCA9E&tx=6E400002-B5A3-F393-E0A9-E50E24DCCA9E&acquire=never&security=medium&timeout=30"
            #expect(try Self.missing(url, mode: "ble:// GATT serial connection", scheme: "ble").isEmpty)
            let connection = try await GattLabTests.echo(through: url, controllers, peripheral)   // 10 KiB out, echoed back
            #expect(connection.metadata.extra["security"] == "medium")
            #expect(try await Self.isPaired(controllers.peripheralText, on: "hci0"), "security=medium paired with the device")
            #expect(peerAgent.output.contains("Authorize this device pairing"), "bt-agent, the device's agent, was asked: \(peerAgent.output)")
            var link = try await Self.link(to: controllers.peripheralText, on: "hci0")
            for _ in 0..<25 where link?.contains("ENCRYPT") != true {
                try await Task.sleep(for: .milliseconds(200))
                link = try await Self.link(to: controllers.peripheralText, on: "hci0")
            }
            #expect(link?.contains("ENCRYPT") == true, "security=medium: the LE link is encrypted: \(link ?? "no link")")
            #expect(connection.metadata.extra["rx"] == "6e400003-b5a3-f393-e0a9-e50e24dcca9e")
            #expect(connection.metadata.extra["tx"] == "6e400002-b5a3-f393-e0a9-e50e24dcca9e")
            #expect(connection.metadata.extra["notify"] == "StartNotify", "acquire=never: through D-Bus: \(connection.metadata.extra)")
            #expect(connection.metadata.extra["write"] == "WriteValue (command)", "\(connection.metadata.extra)")
            #expect(connection.metadata.extra["adapter"] == "hci0" && connection.metadata.localAddress == controllers.centralText)
            try await connection.close()
            // tx= and rx= are the characteristics used: the notifying one cannot be written to, and
            // the written one does not notify.
            let tx = await expectLabError(.unsupported) {
                try await Transport.connect(to: "ble://nus/\(controllers.peripheralText)?adapter=hci0&tx=6E400003-B5A3-F393-E0A9-E50E24DCCA9E")
            }
            #expect(tx?.message.contains("(tx) cannot be written") == true, "\(String(describing: tx))")
            let rx = await expectLabError(.unsupported) {
                try await Transport.connect(to: "ble://nus/\(controllers.peripheralText)?adapter=hci0&rx=6E400002-B5A3-F393-E0A9-E50E24DCCA9E")
            }
            #expect(rx?.message.contains("(rx) neither notifies nor indicates") == true, "\(String(describing: rx))")
        } catch {
            Issue.record(error)
        }
        let started = ContinuousClock.now
        let absent = await expectLabError(.notFound) { try await Transport.connect(to: "ble://nus/00:11:22:33:44:55?adapter=hci0&timeout=3") }
        #expect(absent?.message.contains("not found within the 3 s timeout") == true, "\(String(describing: absent))")
        #expect(ContinuousClock.now - started < .seconds(8))
        await agent.unregister()
        await peerAgent.stop()
        // The peripheral goes, and hci1 gets a fresh advertising state and its own advertising back
        // for the suites after this one (GattLabTests explains the controller's stale advertising set).
        if let previous = GattLabTests.current.withLock({ $0.take() }) { await previous.close() }
        for state in ["off", "on"] { _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "power", state]) }
        try await Self.settleAndForget()
        _ = try await BlueZLabTests.setUp()
    }

    /// The GATT serial peripheral (ble://SERVICE listening) on hci1, reached by ble:// GATT serial
    /// from hci0, both through the lab's bluetoothd (BlueZ's GATT client against BlueZ's GATT
    /// server serving this process's application): bytes both ways, 2 KiB cut to the MTU, and the
    /// central leaving.
    @Test func bleGattSerialListenerTakesEveryOption() async throws {
        _ = try await BlueZLabTests.setUp(advertising: false)   // bluetoothd up when this test runs alone
        try await Self.settleAndForget()
        // hci0 learns hci1's address from the tests' own peripheral (a fresh advertising state and
        // a scan while it re-announces itself: GattLabTests.setUp), which then goes, so that no
        // other application on hci1 has the same service. bluetoothd keeps the device for 30 s.
        let (controllers, _) = try await GattLabTests.setUp()
        if let previous = GattLabTests.current.withLock({ $0.take() }) { await previous.close() }
        // security=medium: the characteristics need an encrypted link, so the central pairs first
        // (its own security=medium); the one agent answers bluetoothd for both adapters.
        let url = "ble://6E400001-B5A3-F393-E0A9-E50E24DCCA9E?adapter=hci1&rx=6E400003-B5A3-F393-E0A9-E50E24DCCA9E"
            + "&tx=6E400002-B5A3-F393-E0A9-E50E24DCCA9E&advertise=true&security=medium"
        #expect(try Self.missing(url, mode: "ble:// GATT serial listener", scheme: "ble").isEmpty)
        let listener = try await Transport.listen(on: url)
        #expect(listener.exposure?.authenticated == true, "only centrals that pair")
        // Not tried here: a central that does not pair, with no agent anywhere. In the lab (both
        // adapters on one bluetoothd) its connect waited out its timeout and bluetoothd was gone
        // afterwards (the next RegisterAgent found no org.bluez), taking every later test with it.
        // GattServerObjectsTests checks the flags that hold such a central off.
        let agent = try await BluetoothPairingAgent.register()
        do {
            let accepted = BlueZListenLabTests.acceptOne(listener, within: 40)
            let client = try await Transport.connect(to: "ble://nus/\(controllers.peripheralText)?adapter=hci0&security=medium&timeout=30")
            let server = try #require(try await accepted.value, "the peripheral accepted no central")
            #expect(server.metadata.remoteAddress == controllers.centralText, "\(server.metadata)")
            #expect(server.metadata.extra["adapter"] == "hci1")
            try await client.write(Array("to the peripheral".utf8))
            #expect(try await server.readMessage(timeout: .seconds(10)) == Array("to the peripheral".utf8), "one write, one message")
            try await server.write(Array("to the central".utf8))
            let first = try await client.readMessage(timeout: .seconds(10))
            #expect(first == Array("to the central".utf8), "a notification: \(String(describing: first))")
            let block = BlueZLabTests.pattern(2048)
            print("lab: the GATT serial peripheral writes \(server.metadata.maximumWriteSize.map(String.init) ?? "?")-byte notifications, now \(server.maximumWriteSize.map(String.init) ?? "?")")
            try await server.write(block)   // notifications of at most ATT MTU - 3
            var received: [UInt8] = []
            do {
                while received.count < block.count, let message = try await client.readMessage(timeout: .seconds(10)) { received += message }
            } catch {
                Issue.record("after \(received.count) of \(block.count) bytes: \(error)")
            }
            #expect(received == block, "2 KiB from the peripheral, whole and in order")
            try await client.close()
            // The central unsubscribed: the peripheral's reads end.
            #expect(try await server.readMessage(timeout: .seconds(15)) == nil, "the central left")
            try? await server.close()
        } catch {
            Issue.record(error)
        }
        await agent.unregister()
        try await listener.close()
        for state in ["off", "on"] { _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "power", state]) }
        try await Self.settleAndForget()
        _ = try await BlueZLabTests.setUp()
    }

    /// Whether bluetoothd on `adapter` says the device at `address` is paired.
    static func isPaired(_ address: String, on adapter: String) async throws -> Bool {
        let bus = try DBusConnection(.system)
        defer { Task { await bus.close() } }
        let reply = try await bus.call(destination: "org.bluez", path: "/org/bluez/\(adapter)/dev_" + address.replacingOccurrences(of: ":", with: "_"),
                                       interface: "org.freedesktop.DBus.Properties", member: "Get", [.string("org.bluez.Device1"), .string("Paired")])
        return reply.first?.boolValue == true
    }

    // MARK: - tty:// on the real CDC-ACM port

    /// The host side of the port as another open of it sees it (root passes TIOCEXCL).
    struct TTYView {
        var cflag: tcflag_t
        var iflag: tcflag_t
        var speed: speed_t
        /// TIOCGEXCL.
        var exclusive: Bool
        /// flock(LOCK_EX | LOCK_NB) fails with EWOULDBLOCK: someone holds the lock.
        var locked: Bool
        /// serial_struct.flags from TIOCGSERIAL.
        var serialFlags: Int32
    }

    static func view(_ path: String) throws -> TTYView {
        let fd = open(path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC)
        guard fd >= 0 else { throw TransportError(.io, "open \(path)", errno: Errno(rawValue: errno), syscall: "open") }
        defer { close(fd) }
        var tio = termios()
        guard tcgetattr(fd, &tio) == 0 else { throw TransportError(.io, "tcgetattr \(path)", errno: Errno(rawValue: errno), syscall: "tcgetattr") }
        var exclusive: Int32 = 0
        _ = ioctl(fd, UInt(0x8004_5440), &exclusive)   // TIOCGEXCL, _IOR('T', 0x40, int)
        let locked = flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK
        if !locked { _ = flock(fd, LOCK_UN) }
        var serial = [UInt8](repeating: 0, count: 128)
        _ = serial.withUnsafeMutableBytes { ioctl(fd, UInt(TIOCGSERIAL), $0.baseAddress!) }
        let flags = serial.withUnsafeBytes { $0.load(fromByteOffset: 16, as: Int32.self) }
        return TTYView(cflag: tio.c_cflag, iflag: tio.c_iflag, speed: cfgetospeed(&tio), exclusive: exclusive != 0, locked: locked, serialFlags: flags)
    }

    /// `bytes` from `from` to `to`, read back whole within 10 s.
    static func carry(_ bytes: [UInt8], from: Connection, to: Connection) async throws -> [UInt8]? {
        try await from.write(bytes)
        return try await to.readFrame(.fixedLength(bytes.count), timeout: .seconds(10))
    }

    @Test func ttyByPathOnTheRealCDCACMPortTakesEveryOption() async throws {
        let (host, gadgetNode) = try await Gadget.plug()
        let before = try Self.view(host)
        let url = "tty://\(Gadget.byID)?baud=57600&dataBits=7&parity=even&stopBits=2&flowControl=rtscts&dtr=false&rts=true"
            + "&exclusive=true&lowLatency=true&wait=true&restore=true&timeout=5"
        #expect(try Self.missing(url, mode: "tty:// connection to a device node", scheme: "tty").isEmpty)
        let tty = try await Transport.connect(to: url)
        var during: TTYView?
        do {
            let port = try #require(tty.serialPort)
            // The modem lines first: another open of the port raises DTR and RTS again (tty_port_block_til_ready).
            let lines = try await port.modemLines()
            #expect(!lines.contains(.dtr) && lines.contains(.rts), "dtr=false&rts=true: \(lines)")
            // cdc_acm keeps 7E2 (SET_LINE_CODING carries it to the device): read back, no error.
            #expect(try await port.settings() == SerialSettings(baudRate: 57600, dataBits: 7, parity: .even, stopBits: 2, flowControl: .rtscts))
            let now = try Self.view(host)
            during = now
            #expect(now.speed == speed_t(B57600))
            #expect(now.cflag & tcflag_t(CSIZE) == tcflag_t(CS7))
            #expect(now.cflag & tcflag_t(PARENB) != 0 && now.cflag & tcflag_t(PARODD) == 0)
            #expect(now.cflag & tcflag_t(CSTOPB) != 0)
            #expect(now.cflag & tcflag_t(CRTSCTS) != 0)
            #expect(now.exclusive, "exclusive=true sets TIOCEXCL")
            #expect(now.locked, "exclusive=true holds the flock")
            let busy = await expectLabError(.busy) { try await Transport.connect(to: "tty://\(host)") }
            #expect(busy?.message.contains("exclusively") == true, "\(String(describing: busy))")
            // cdc_acm takes TIOCSSERIAL and keeps no ASYNC_LOW_LATENCY (and has no latency timer):
            // read back, the metadata says so instead of claiming it.
            #expect(now.serialFlags & (1 << 13) == 0, "TIOCGSERIAL flags \(String(now.serialFlags, radix: 16))")
            #expect(tty.metadata.extra["lowLatency"] == "not supported by this driver", "\(tty.metadata.extra)")
            // Bytes both ways, seven bits each as a device at 7E2 would send them.
            let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
            let toHost = (0..<600).map { UInt8(($0 * 7) % 128) }
            #expect(try await Self.carry(toHost, from: gadget, to: tty) == toHost)
            let toGadget = (0..<600).map { UInt8(($0 * 13) % 128) }
            #expect(try await Self.carry(toGadget, from: tty, to: gadget) == toGadget)
            try await gadget.close()
        } catch {
            Issue.record(error)
        }
        try await tty.close()
        let after = try Self.view(host)
        #expect(during.map { $0.cflag != before.cflag } == true, "the settings changed while connected")
        #expect(after.cflag == before.cflag && after.speed == before.speed, "restore=true put the port's settings back")
        #expect(!after.exclusive && !after.locked, "TIOCEXCL and the lock go with the connection")
    }

    @Test func ttyByUSBIdentityTakesEveryOptionAndWaitsForThePlug() async throws {
        let (host, _) = try await Gadget.plug()
        let record = try #require(try await SerialPlugin().devices(includeAll: false).first { $0.devnode == host }, "\(host) is not listed")
        let location = try #require(record.location)
        #expect(record.interface == 0)
        // The selectors choose: with ones nothing matches, a connect without wait= is refused at once.
        for (query, named) in [("serial=NOSUCH", "serial NOSUCH"), ("serial=\(Gadget.serial)&interface=2", "interface 2"), ("location=9-9", "at 9-9")] {
            let none = await expectLabError(.notFound) { try await Transport.connect(to: "tty://usb/0525:a4a7?\(query)") }
            #expect(none?.message.contains(named) == true, "\(query): \(String(describing: none))")
        }
        try await Gadget.unplug()
        // timeout= ends wait=.
        let started = ContinuousClock.now
        let late = await expectLabError(.timedOut) { try await Transport.connect(to: "tty://usb/0525:a4a7?serial=\(Gadget.serial)&wait=true&timeout=2") }
        #expect(late?.message.contains("within the 2 s timeout") == true, "\(String(describing: late))")
        #expect(ContinuousClock.now - started < .seconds(5))

        let url = "tty://usb/0525:a4a7?serial=\(Gadget.serial)&interface=0&location=\(location)&baud=115200&dataBits=8&parity=odd&stopBits=1"
            + "&flowControl=xonxoff&dtr=true&rts=false&exclusive=false&lowLatency=false&wait=true&restore=false&timeout=30"
        #expect(try Self.missing(url, mode: "tty:// connection to a USB adapter", scheme: "tty").isEmpty)
        let waiting = Task { try await Transport.connect(to: url) }
        try await Task.sleep(for: .milliseconds(500))
        let (hostAgain, gadgetNode) = try await Gadget.plug()
        let tty = try await waiting.value   // wait=true: connected once the adapter was plugged in
        do {
            #expect(tty.metadata.remoteAddress == hostAgain)
            #expect(tty.metadata.serialNumber == Gadget.serial)
            #expect(tty.metadata.extra["interface"] == "0")
            #expect(tty.metadata.extra["lowLatency"] == nil, "lowLatency=false asks nothing of the driver")
            let port = try #require(tty.serialPort)
            let lines = try await port.modemLines()
            #expect(lines.contains(.dtr) && !lines.contains(.rts), "dtr=true&rts=false: \(lines)")
            #expect(try await port.settings() == SerialSettings(baudRate: 115_200, dataBits: 8, parity: .odd, stopBits: 1, flowControl: .xonxoff))
            let now = try Self.view(hostAgain)
            #expect(now.speed == speed_t(B115200))
            #expect(now.cflag & tcflag_t(PARENB | PARODD) == tcflag_t(PARENB | PARODD))
            #expect(now.iflag & tcflag_t(IXON | IXOFF) == tcflag_t(IXON | IXOFF))
            #expect(!now.exclusive && !now.locked, "exclusive=false: no TIOCEXCL, no lock")
            // Text only: with XON/XOFF, 0x11 and 0x13 are flow control.
            let gadget = try await Transport.connect(to: "tty://\(gadgetNode)")
            let toHost = Array("by identity, gadget to host\r\n".utf8)
            #expect(try await Self.carry(toHost, from: gadget, to: tty) == toHost)
            let toGadget = Array("by identity, host to gadget\r\n".utf8)
            #expect(try await Self.carry(toGadget, from: tty, to: gadget) == toGadget)
            try await gadget.close()
        } catch {
            Issue.record(error)
        }
        try await tty.close()
        let after = try Self.view(hostAgain)
        #expect(after.speed == speed_t(B115200) && after.cflag & tcflag_t(PARODD) != 0, "restore=false leaves the settings as they were set")
    }

    // MARK: - usb:// on the Loopback gadget

    /// Writes `bytes` and reads as many back, each read within 10 s (a missing byte fails, never hangs).
    static func echo(_ connection: Connection, _ bytes: [UInt8]) async throws -> [UInt8] {
        try await connection.write(bytes)
        var received: [UInt8] = []
        while received.count < bytes.count, let chunk = try await connection.read(timeout: .seconds(10)) { received += chunk }
        return received
    }

    @Test func usbTakesEveryOption() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        let record = try #require(try await USBPlugin().devices(includeAll: false).first { $0.url == USBLabTests.url })
        let location = try #require(record.location)
        let bus = String(location.prefix { $0 != "-" })
        let device = try #require(record.devnode?.split(separator: "/").last.map(String.init), "\(record)")
        _ = try await Lab.run("/sbin/modprobe", ["usbmon"])
        _ = try await Lab.run("/sbin/modprobe", ["usbserial", "vendor=0x1d6b", "product=0x0104"])
        let tty = "/dev/ttyUSB0"
        do {
            #expect(await eventually(10) { access(tty, F_OK) == 0 }, "usbserial_generic made no \(tty)")
            let busy = await expectLabError(.busy) { try await Transport.connect(to: USBLabTests.url) }
            #expect(busy?.message.contains("detach=true") == true, "without detach=: \(String(describing: busy))")

            let url = USBLabTests.url + "&interface=0&alt=0&in=0x81&out=0x02&location=\(location)&detach=true"
                + "&transfers=3&transferSize=1024&zlp=true&wait=true&timeout=10&controlOnly=false"
            #expect(try Self.missing(url, mode: "usb:// connection", scheme: "usb").isEmpty)
            // usbmon's text trace of the bus, while the connection lives.
            // SIGKILL: the test process's children inherit a signal mask that blocks timeout's SIGTERM.
            let monitor = Task { try await Lab.run("/usr/bin/timeout", ["-s", "KILL", "8", "/bin/cat", "/sys/kernel/debug/usb/usbmon/\(bus)u"]) }
            try await Task.sleep(for: .seconds(1))
            let connection = try await Transport.connect(to: url)
            #expect(connection.metadata.extra["interface"] == "0" && connection.metadata.extra["alt"] == "0")
            #expect(connection.metadata.extra["in"] == "0x81" && connection.metadata.extra["out"] == "0x02", "\(connection.metadata.extra)")
            #expect(connection.metadata.extra["location"] == location)
            #expect(await eventually(5) { access(tty, F_OK) != 0 }, "detach=true took the interface from usbserial_generic")
            // zlp=true: 1024 bytes (two full packets) end with a zero-length packet, which completes
            // the gadget's 4096-byte OUT request, so they come back on their own.
            let exact = USBLabTests.pattern(1024)
            #expect(try await Self.echo(connection, exact) == exact)
            let odd = USBLabTests.pattern(3000)
            #expect(try await Self.echo(connection, odd) == odd)
            try await connection.close()
            #expect(await eventually(10) { access(tty, F_OK) == 0 }, "usbserial_generic got the interface back on close")

            // "URB TIME S Bi:BUS:DEV:EP -115 LENGTH <": submissions, with the length asked for.
            let trace = try await monitor.value.stdout
            let events = trace.split(separator: "\n").map { $0.split(separator: " ").map(String.init) }
            func submitted(_ endpoint: String) -> [Int] {
                events.filter { $0.count > 5 && $0[2] == "S" && $0[3] == "\(endpoint):\(bus):\(device):\(endpoint == "Bi" ? 1 : 2)" }.compactMap { Int($0[5]) }
            }
            let firstIn = events.firstIndex { $0.count > 3 && $0[2] == "C" && $0[3].hasPrefix("Bi:\(bus):\(device):") } ?? events.count
            let inFlight = events[..<firstIn].filter { $0.count > 3 && $0[2] == "S" && $0[3].hasPrefix("Bi:\(bus):\(device):") }.count
            #expect(inFlight == 3, "transfers=3: IN transfers in flight before the first completes: \(trace)")
            let ins = submitted("Bi")
            #expect(!ins.isEmpty && ins.allSatisfy { $0 == 1024 }, "transferSize=1024: IN transfers of 1024 bytes: \(ins)")
            let outs = submitted("Bo")
            #expect(outs.max() == 1024 && outs.contains(3000 - 2 * 1024), "transferSize=1024: writes cut into 1024-byte transfers: \(outs)")
        } catch {
            Issue.record(error)
        }
        _ = try await Lab.run("/sbin/rmmod", ["usbserial"])
    }

    /// Issue 30, item 7: a device reached for its control requests alone. The loopback gadget has
    /// a bulk pair, but the control-only mode never looks at it; usbserial_generic bound to its
    /// interface shows what is claimed and what is not.
    @Test func usbControlOnlyTakesEveryOption() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        let record = try #require(try await USBPlugin().devices(includeAll: false).first { $0.url == USBLabTests.url })
        let location = try #require(record.location)
        let node = try #require(record.devnode)
        _ = try await Lab.run("/sbin/modprobe", ["usbserial", "vendor=0x1d6b", "product=0x0104"])
        let tty = "/dev/ttyUSB0"
        do {
            #expect(await eventually(10) { access(tty, F_OK) == 0 }, "usbserial_generic made no \(tty)")
            // Without interface=, nothing is claimed: the driver keeps its interface, and requests
            // to the device go through; reads and writes are refused, saying why.
            let plain = try await Transport.connect(to: USBLabTests.url + "&controlOnly=true")
            let usb = try #require(plain.usbDevice)
            let descriptor = try await usb.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18)
            #expect(Array(descriptor.dropFirst(8).prefix(4)) == [0x6b, 0x1d, 0x04, 0x01], "GET_DESCRIPTOR(DEVICE): \(descriptor)")
            #expect(access(tty, F_OK) == 0, "no interface claimed: usbserial_generic keeps its tty")
            #expect(plain.metadata.extra["controlOnly"] == "true" && plain.metadata.extra["interface"] == nil && plain.metadata.extra["in"] == nil,
                    "\(plain.metadata.extra)")
            let read = await #expect(throws: TransportError.self) { _ = try await plain.read() }
            #expect(read?.kind == .unsupported && read?.message.contains("control transfers only (controlOnly=true)") == true, "\(String(describing: read))")
            let write = await #expect(throws: TransportError.self) { try await plain.write([1, 2]) }
            #expect(write?.kind == .unsupported, "\(String(describing: write))")
            #expect(try await usb.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18) == descriptor,
                    "a refused read leaves the connection up")
            try await plain.close()

            // Every option of the mode: interface=0 (alt 0) claimed, taken from usbserial_generic
            // with detach=true and given back on close.
            let url = USBLabTests.url + "&controlOnly=true&interface=0&alt=0&location=\(location)&detach=true&wait=true&timeout=10"
            #expect(try Self.missing(url, mode: "usb:// control-only connection", scheme: "usb").isEmpty)
            let claimed = try await Transport.connect(to: url)
            #expect(await eventually(5) { access(tty, F_OK) != 0 }, "detach=true took the interface from usbserial_generic")
            #expect(claimed.metadata.extra["interface"] == "0" && claimed.metadata.extra["alt"] == "0", "\(claimed.metadata.extra)")
            #expect(try await claimed.usbDevice?.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18) == descriptor)
            let busy = await expectLabError(.busy) { try await Transport.connect(to: USBLabTests.url) }
            #expect(busy != nil, "the claimed interface is busy for a streaming connect")
            try await claimed.close()
            #expect(await eventually(10) { access(tty, F_OK) == 0 }, "usbserial_generic got the interface back on close")

            // Unplugged under a control-only connection: the next request says the device went away.
            let gone = try await Transport.connect(to: USBLabTests.url + "&controlOnly=true")
            try await Lab.ctl("usb-loopback", "unplug")
            #expect(await eventually(10) { access(node, F_OK) != 0 }, "\(node) left")
            let unplugged = await #expect(throws: TransportError.self) {
                _ = try await gone.usbDevice?.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18)
            }
            #expect(unplugged?.kind == .disconnected, "\(String(describing: unplugged))")
            try? await gone.close()
        } catch {
            Issue.record(error)
        }
        _ = try await Lab.run("/sbin/rmmod", ["usbserial"])
    }

    @Test func usbEndpointDirectionsAreRefusedBeforeIOAndWaitAndTimeoutAndZlpFalseDoWhatTheySay() async throws {
        try await Lab.ctl("usb-loopback", "unplug")
        // in= and out= are checked before any I/O: refused at once, though wait=true would wait 20 s.
        for (query, says) in [("in=0x02", "in=0x02 is an OUT endpoint"), ("out=0x81", "out=0x81 is an IN endpoint")] {
            let started = ContinuousClock.now
            let error = await expectLabError(.invalidURL) { try await Transport.connect(to: USBLabTests.url + "&\(query)&wait=true&timeout=20") }
            #expect(error?.message.contains(says) == true, "\(String(describing: error))")
            #expect(ContinuousClock.now - started < .seconds(2))
        }
        let started = ContinuousClock.now
        let late = await expectLabError(.timedOut) { try await Transport.connect(to: USBLabTests.url + "&wait=true&timeout=2") }
        #expect(late?.message.contains("within the 2 s timeout") == true, "\(String(describing: late))")
        #expect(ContinuousClock.now - started < .seconds(5))

        let waiting = Task { try await Transport.connect(to: USBLabTests.url + "&wait=true&timeout=30&zlp=false") }
        try await Task.sleep(for: .milliseconds(500))
        try await Lab.ctl("usb-loopback", "plug")
        let connection = try await waiting.value
        do {
            // zlp=false: 1024 bytes are two full packets and nothing ends the gadget's 4096-byte
            // request, so nothing comes back until a short packet does.
            let exact = USBLabTests.pattern(1024)
            try await connection.write(exact)
            let early = await #expect(throws: TransportError.self) { try await connection.read(timeout: .seconds(2)) }
            #expect(early?.kind == .timedOut, "\(String(describing: early))")
            try await connection.write([0x5a])
            var received: [UInt8] = []
            while received.count < 1025, let chunk = try await connection.read(timeout: .seconds(10)) { received += chunk }
            #expect(received == exact + [0x5a])
        } catch {
            Issue.record(error)
        }
        try await connection.close()
    }
}
