import CBlueZ
import Foundation
import Glibc
import Synchronization
import SystemPackage
import Testing
import TestSupport
import TransportKit
import TransportKitDBus

/// A program running in the background in a process group of its own (rctest and l2test fork a
/// child per connection): stopped by killing the group.
final class BackgroundProgram: Sendable {
    let pid: pid_t

    init(_ executable: String, _ arguments: [String]) throws {
        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETPGROUP))
        posix_spawnattr_setpgroup(&attributes, 0)
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 1, "/tmp/lab-background.log", O_WRONLY | O_CREAT | O_APPEND, 0o644)
        posix_spawn_file_actions_adddup2(&actions, 1, 2)
        let argv = ([executable] + arguments).map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let result = posix_spawn(&pid, executable, &actions, &attributes, argv, environ)
        guard result == 0 else { throw TransportError(.io, "posix_spawn \(executable)", errno: Errno(rawValue: result), syscall: "posix_spawn") }
        self.pid = pid
    }

    /// SIGKILL to the whole group, then reaps the leader.
    func kill() {
        _ = Glibc.kill(-pid, SIGKILL)
        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
    }
}

/// rfcomm:// and ble:// L2CAP through the real bluetoothd, between the lab's two emulated
/// controllers: hci0 connects, hci1 is the peer (BlueZ's own rctest and l2test, or a plain socket).
@Suite("lab: Bluetooth through BlueZ (rfcomm://, ble:// L2CAP)", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct BlueZLabTests {
    /// Both controllers up (BluetoothLabTests.controllers(): labctl bt-up), bluetoothd running and
    /// managing them, hci1 advertising (the controller's own advertising, mgmt's instance 0) unless
    /// `advertising` is false (GattLabTests registers an advertisement of its own instead).
    static func setUp(advertising: Bool = true) async throws -> BluetoothLabTests.Controllers {
        let controllers = try await BluetoothLabTests.controllers()
        try await Lab.ctl("bluez-start")
        let plugin = BluetoothPlugin()
        var both = false
        let until = ContinuousClock.now + .seconds(15)
        while !both && ContinuousClock.now < until {
            let records = (try? await plugin.devices(includeAll: false)) ?? []
            both = records.filter { $0.properties["powered"] == "true" }.count >= 2
            if !both { try await Task.sleep(for: .milliseconds(100)) }
        }
        try #require(both, "bluetoothd did not report hci0 and hci1 powered")
        // bluetoothd takes over the controllers' settings: make hci1 connectable (page scan) so hci0
        // can reach it over BR/EDR, and advertise again so hci0 can reach it over LE.
        _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "connectable", "on"])
        _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "advertising", advertising ? "on" : "off"])
        return controllers
    }

    /// Removes every device bluetoothd knows (Adapter1.RemoveDevice, which drops its link keys too).
    /// After a Profile1 connection, the keys of the Just Works pairing left behind made the next
    /// RFCOMM connects between the two controllers fail with EACCES or ECONNRESET; BlueZListenLabTests
    /// starts each test with this and ends with it. LE connects then need a discovery again.
    static func forgetDevices() async throws {
        // Until neither adapter has a device object or a link left (up to 5 s). RemoveDevice
        // disconnects in the background, and a link still up can bring an object back (an LE link
        // of a GATT test before): an LE-only object for the other controller left on hci1 makes
        // bluetoothd drop every BR/EDR profile connection from it ("device not found" in
        // src/profile.c's create_conn): the likely cause of an RFCOMM listener that accepted
        // nothing for 20 s while its reconnect+ client connected, in one CI run.
        let until = ContinuousClock.now + .seconds(5)
        var clearedKeys = false
        var left = (devices: [String](), links: 0)
        while true {
            left = (try await removeDeviceObjects(), 0)
            if !clearedKeys {
                // The kernel's link keys too (mgmt Load Link Keys with none, `btmgmt keys`), in case
                // a device object went while its key stayed: a responder that still holds a key for
                // the initiator leaves a new Just Works pairing to user space
                // (hci_user_confirm_request_evt: "Local host already has link key"), which
                // bluetoothd refuses without an agent. A guess at the occasional EACCES "pairing
                // failed"; it did not stop it (OptionModeLabTests).
                for index in ["0", "1"] { _ = try await Lab.run("/usr/bin/btmgmt", ["--index", index, "keys"]) }
                clearedKeys = true
            }
            // So that the next test pairs afresh on a new link rather than reusing one whose
            // security a removed key set up (an RFCOMM connect right after was refused, EACCES
            // "pairing failed", in one CI run).
            for index in ["0", "1"] {
                let listed = try await Lab.run("/usr/bin/btmgmt", ["--index", index, "con"])
                left.links += listed.stdout.split(separator: "\n").filter { $0.contains("type") && $0.split(separator: ":").count >= 6 }.count
            }
            if left.devices.isEmpty && left.links == 0 { return }
            guard ContinuousClock.now < until else { break }
            try await Task.sleep(for: .milliseconds(100))
        }
        print("lab: forgetDevices: after 5 s, still \(left.links) link(s) and device objects \(left.devices)")
    }

    /// Asks bluetoothd to remove every device object it has; returns the paths it had.
    static func removeDeviceObjects() async throws -> [String] {
        let bus = try DBusConnection(.system)
        let reply = try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
        var removed: [String] = []
        for (path, interfaces) in reply.first?.dictionary ?? [:] {
            guard let adapter = interfaces.dictionary?["org.bluez.Device1"]?.dictionary?["Adapter"]?.text else { continue }
            removed.append(path)
            _ = try? await bus.call(destination: "org.bluez", path: adapter, interface: "org.bluez.Adapter1", member: "RemoveDevice", [.objectPath(path)])
        }
        await bus.close()
        return removed
    }

    /// Connects, retrying while the peer's listener is not up yet (refused) for up to 10 s, and
    /// once after the emulated controllers' occasional "pairing failed" (EACCES) on a link that
    /// asks for no security: a btvirt flake not yet understood (see setUp), which failed whole CI
    /// runs. The error itself is checked where a test asks for security (OptionModeLabTests).
    ///
    /// When that does not help (a refusal past 5 s, or a second pairing failure), the devices are
    /// forgotten and both controllers set to NoInputNoOutput again, and the connect gets 10 s
    /// more, once. The CI run of 9da9ab3 saw why: bluetoothd on the accepting side logged
    /// `new_auth() No agent available for request type 2` for every attempt (the kernel asked user
    /// space to confirm the pairing, which it does for a side that already holds a link key or
    /// does not have NoInputNoOutput), and RFCOMM refused each connect (ECONNREFUSED, or EACCES
    /// "pairing failed") for the 10 s.
    /// `resetting: false` leaves the reset out, for a test that expects the pairing to fail.
    static func connect(_ url: String, resetting: Bool = true) async throws -> Connection {
        var until = ContinuousClock.now + .seconds(10)
        let started = ContinuousClock.now
        var pairingRetried = false
        var reset = false
        let mayReset = resetting && !url.contains("security=")
        while true {
            do {
                return try await Transport.connect(to: url)
            } catch let error as TransportError where error.kind == .refused && mayReset && !reset && ContinuousClock.now - started > .seconds(5) {
                try await resetPairing(after: error, url)
                reset = true
                until = ContinuousClock.now + .seconds(10)
            } catch let error as TransportError where error.kind == .refused && ContinuousClock.now < until {
                try await Task.sleep(for: .milliseconds(200))
            } catch let error as TransportError where error.kind == .permissionDenied && error.message.contains("pairing failed")
                        && !url.contains("security=") && (!pairingRetried || (mayReset && !reset)) {
                if pairingRetried {
                    try await resetPairing(after: error, url)
                    reset = true
                    until = ContinuousClock.now + .seconds(10)
                } else {
                    pairingRetried = true
                    try await Task.sleep(for: .milliseconds(500))
                }
            }
        }
    }

    /// Forgets both controllers' devices and keys and sets both to NoInputNoOutput, saying why in
    /// the lab's output.
    static func resetPairing(after error: TransportError, _ url: String) async throws {
        print("lab: \(url): \(error.message) — forgetting the devices, NoInputNoOutput again, and 10 s more")
        try await justWorksAfresh()
        try await Task.sleep(for: .seconds(1))
    }

    /// Both controllers NoInputNoOutput, so that their pairing is Just Works, which needs no
    /// agent, and every device and key forgotten, so that it happens afresh.
    static func justWorksAfresh() async throws {
        for index in ["0", "1"] {
            let result = try await Lab.run("/usr/bin/btmgmt", ["--index", index, "io-cap", "3"])
            try #require(result.status == 0, "btmgmt --index \(index) io-cap 3: \(result.stderr)")
        }
        try await forgetDevices()
    }

    static func pattern(_ count: Int) -> [UInt8] { (0..<count).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ $0 / 256) } }

    @Test func adaptersAreListedAndTheirRemovalAndArrivalReported() async throws {
        let controllers = try await Self.setUp()
        let records = try await BluetoothPlugin().devices(includeAll: false)
        #expect(records.first { $0.name == "hci0" }?.properties["address"] == controllers.centralText, "\(records)")
        #expect(records.first { $0.name == "hci1" }?.properties["address"] == controllers.peripheralText, "\(records)")

        let collector = await EventCollector()
        defer { collector.stop() }
        try await Task.sleep(for: .milliseconds(300))
        let start = collector.events.count
        try await Lab.ctl("bt-down")
        let removed = await collector.waitFor(from: start, seconds: 15) { $0.action == .removed && $0.device.scheme == "bluetooth" && $0.device.name == "hci1" }
        #expect(removed != nil, "no removal of hci1: \(collector.events) \(collector.failure ?? "")")
        #expect(removed.map { collector.events[$0].device.properties["address"] } == controllers.peripheralText)
        let back = collector.events.count
        _ = try await Self.setUp()
        let added = await collector.waitFor(from: back, seconds: 15) { $0.action == .added && $0.device.scheme == "bluetooth" && $0.device.name == "hci0" }
        #expect(added != nil, "no arrival of hci0: \(collector.events) \(collector.failure ?? "")")
    }

    /// A plain kernel socket on hci1 (RFCOMM channel or LE PSM) that reads `expecting` bytes, then
    /// sends `reply` in pieces of `piece` bytes; returns the sizes of the reads and the bytes.
    static func peer(listener: Int32, expecting: Int, reply: [UInt8], piece: Int) -> Task<(records: [Int], bytes: [UInt8]), Never> {
        // On a thread of its own: accept(2) and recv(2) block.
        Task { await Lab.onThread {
            let server = accept(listener, nil, nil)
            guard server >= 0 else { return ([], []) }
            defer { close(server) }
            var limit = timeval(tv_sec: 10, tv_usec: 0)
            setsockopt(server, SOL_SOCKET, SO_RCVTIMEO, &limit, socklen_t(MemoryLayout<timeval>.size))
            var records: [Int] = []
            var bytes: [UInt8] = []
            var buffer = [UInt8](repeating: 0, count: 4096)
            while bytes.count < expecting {
                let count = recv(server, &buffer, buffer.count, 0)
                guard count > 0 else { break }
                records.append(count)
                bytes += buffer[..<count]
            }
            var offset = 0
            while offset < reply.count {
                let end = min(offset + piece, reply.count)
                guard reply[offset..<end].withUnsafeBytes({ send(server, $0.baseAddress, $0.count, 0) }) > 0 else { break }
                offset = end
            }
            usleep(500_000)
            return (records, bytes)
        } }
    }

    @Test func rfcommCarriesTenKiBEachWayThroughAFixedChannel() async throws {
        let controllers = try await Self.setUp()
        let listener = BluetoothLabTests.SocketKind.rfcomm(channel: 7).socket(boundTo: controllers.peripheral, listening: true)
        try #require(listener >= 0, "socket and bind: \(errno)")
        defer { close(listener) }
        try #require(listen(listener, 1) == 0)
        let toPeer = Self.pattern(10 * 1024)
        let toUs = Array(Self.pattern(10 * 1024).reversed())
        let peer = Self.peer(listener: listener, expecting: toPeer.count, reply: toUs, piece: 1000)
        let connection = try await Self.connect("rfcomm://\(controllers.peripheralText):7?adapter=hci0")
        #expect(connection.metadata.remoteAddress == controllers.peripheralText)
        #expect(connection.metadata.localAddress == controllers.centralText)
        #expect(connection.metadata.extra["channel"] == "7")
        #expect(connection.metadata.extra["adapter"] == "hci0")
        try await connection.write(toPeer)
        var received: [UInt8] = []
        while received.count < toUs.count, let chunk = try await connection.read() { received += chunk }
        #expect(await peer.value.bytes == toPeer)
        #expect(received == toUs)
        try await connection.close()
    }

    @Test func aDroppedRfcommLinkEndsWithDisconnectedAfterEveryByteAndAReconnectWorks() async throws {
        let controllers = try await Self.setUp()
        let socketsBefore = Descriptors.open().filter { $0.target.hasPrefix("socket:[") }.count
        let url = "rfcomm://\(controllers.peripheralText):8?adapter=hci0"
        for round in 1...2 {
            let peer = try BackgroundProgram("/usr/bin/rctest", ["-w", "-i", "hci1", "-P", "8", "-b", "512"])
            let connection = try await Self.connect(url)
            var received = 0
            while received < 4096, let chunk = try await connection.read() { received += chunk.count }
            peer.kill()   // the peer vanishes mid-transfer
            let (rest, ending) = await Lab.readToEnd(connection)
            #expect(ending?.kind == .disconnected, "round \(round): \(String(describing: ending))")
            #expect(ending?.message.contains("disconnected") == true)
            #expect(received + rest.count >= 4096)
            try? await connection.close()
        }
        let closed = await eventually(5) { Descriptors.open().filter { $0.target.hasPrefix("socket:[") }.count <= socketsBefore }
        #expect(closed, "sockets left open: \(Descriptors.open())")
    }

    @Test func bleL2CAPReceivesL2testsRecordsWhole() async throws {
        let controllers = try await Self.setUp()
        let peer = try BackgroundProgram("/usr/bin/l2test", ["-w", "-V", "le_public", "-P", "129", "-i", "hci1", "-b", "100"])
        defer { peer.kill() }
        let connection = try await Self.connect("ble://FFF0:129/\(controllers.peripheralText)?adapter=hci0")
        #expect(connection.metadata.extra["addressType"] == "public")
        #expect((connection.metadata.maximumWriteSize ?? 0) > 0)
        #expect(connection.metadata.extra["psm"] == "129")
        #expect(connection.metadata.extra["security"] == "low", "the level the link has, read back")
        var messages: [[UInt8]] = []
        for _ in 0..<10 {
            guard let message = try await connection.readMessage(timeout: .seconds(10)) else { break }
            messages.append(message)
        }
        #expect(messages.count == 10)
        #expect(messages.allSatisfy { $0.count == 100 }, "\(messages.map(\.count))")
        try await connection.close()
    }

    @Test func bleL2CAPBothWaysWithWritesLargerThanTheMTU() async throws {
        let controllers = try await Self.setUp()
        // A plain kernel listener on hci1 (the C socket loop's side), PSM 131 (its receive MTU is our send MTU).
        let listener = BluetoothLabTests.SocketKind.l2capLE(psm: 131).socket(boundTo: controllers.peripheral, listening: true)
        try #require(listener >= 0, "socket and bind: \(errno)")
        defer { close(listener) }
        try #require(listen(listener, 1) == 0)
        let toPeer = Self.pattern(10 * 1024)
        let toUs = Array(Self.pattern(10 * 1024).reversed())
        let peerSide = Self.peer(listener: listener, expecting: toPeer.count, reply: toUs, piece: 200)
        let connection = try await Self.connect("ble://FFF0:131/\(controllers.peripheralText)?adapter=hci0&mtu=512")
        let sendMTU = try #require(connection.metadata.maximumWriteSize)
        #expect(connection.metadata.extra["sendMTU"] == String(sendMTU))
        #expect(connection.metadata.extra["receiveMTU"] == "512", "mtu=, receiveMTU='s former name, is the receive MTU offered")
        try #require(sendMTU < toPeer.count)
        try await connection.write(toPeer)   // one write, cut into records of the send MTU
        var received: [UInt8] = []
        while received.count < toUs.count, let chunk = try await connection.read() { received += chunk }
        let peer = await peerSide.value
        #expect(peer.bytes == toPeer)
        #expect(peer.records.allSatisfy { $0 <= sendMTU }, "\(peer.records)")
        #expect(peer.records.count == (toPeer.count + sendMTU - 1) / sendMTU, "\(peer.records)")
        #expect(received == toUs)
        try await connection.close()
    }

    /// The lab registers no agent, so bluetoothd refuses every pairing that needs a person to confirm
    /// it, and security that the controllers' input and output cannot give fails as on real devices.
    /// - LE, security=high (MITM) between two NoInputNoOutput controllers: the kernel refuses the
    ///   channel (EACCES from connect), or, when its SMP stays out of the emulated link ("security
    ///   requested but not available" in dmesg; seen in some lab runs even with SMP registered), the
    ///   link comes up unencrypted and the plugin's read-back of BT_SECURITY refuses it. Which of the
    ///   two happens is the kernel's; both are `.permissionDenied` with what to do.
    /// - RFCOMM to `rctest -A` with both controllers set to DisplayYesNo: Secure Simple Pairing
    ///   becomes a numeric comparison that nobody confirms (bluetoothd: "No agent available").
    @Test func pairingThatNeedsAnAgentOrMoreThanTheDevicesOfferIsRefusedWithWhatToDo() async throws {
        let controllers = try await Self.setUp()
        let l2test = try BackgroundProgram("/usr/bin/l2test", ["-w", "-V", "le_public", "-P", "129", "-i", "hci1", "-b", "100"])
        let le = await expectLabError(.permissionDenied) { try await Self.connect("ble://FFF0:129/\(controllers.peripheralText)?adapter=hci0&security=high") }
        l2test.kill()
        #expect(le?.errno == .permissionDenied, "\(String(describing: le))")
        #expect(le?.syscall == "connect" || le?.message.contains("is at security level low, not high") == true, "\(String(describing: le))")
        #expect(le?.message.contains("bluetoothctl") == true, "\(String(describing: le))")

        // No key from an earlier test may stand in for the pairing.
        try await Self.forgetDevices()
        let capabilities = { (value: String) async throws in
            for index in ["0", "1"] {
                let result = try await Lab.run("/usr/bin/btmgmt", ["--index", index, "io-cap", value])
                try #require(result.status == 0, "btmgmt --index \(index) io-cap \(value): \(result.stderr)")
            }
        }
        var classic: TransportError?
        do {
            try await capabilities("1")   // DisplayYesNo
            let rctest = try BackgroundProgram("/usr/bin/rctest", ["-w", "-A", "-i", "hci1", "-P", "9", "-b", "100"])
            classic = await expectLabError(.permissionDenied) { try await Self.connect("rfcomm://\(controllers.peripheralText):9?adapter=hci0", resetting: false) }
            rctest.kill()
        } catch {
            Issue.record(error)
        }
        // NoInputNoOutput, the kernel's default, again for every later test; then both controllers
        // powered off and on, which drops the links the refused pairings left (a later RFCOMM
        // connect over such a link was refused with EACCES in one CI run), and set up again.
        try await capabilities("3")
        for index in ["0", "1"] {
            for state in ["off", "on"] { _ = try await Lab.run("/usr/bin/btmgmt", ["--index", index, "power", state]) }
        }
        try await Self.forgetDevices()
        _ = try await Self.setUp()
        #expect(classic?.errno == .permissionDenied, "\(String(describing: classic))")
        #expect(classic?.message.contains("pairing failed") == true && classic?.message.contains("agent") == true, "\(String(describing: classic))")
    }

    @Test func errorsSayWhatToDo() async throws {
        let controllers = try await Self.setUp()
        // addressType=public: no LE discovery, so this checks the refusal alone.
        let nobody = await expectLabError(.refused) { try await Transport.connect(to: "ble://FFF0:135/\(controllers.peripheralText)?adapter=hci0&addressType=public") }
        #expect(nobody?.message.contains("nobody listens on L2CAP PSM 135") == true, "\(String(describing: nobody))")

        let absent = await expectLabError(.notFound) { try await Transport.connect(to: "ble://FFF0:128/00:11:22:33:44:55?adapter=hci0&timeout=3") }
        #expect(absent?.message.contains("not found within the 3 s timeout on hci0") == true, "\(String(describing: absent))")

        let unknown = await expectLabError(.notFound) { try await Transport.connect(to: "rfcomm://\(controllers.peripheralText):7?adapter=hci9") }
        #expect(unknown?.message.contains("no Bluetooth adapter hci9; adapters: hci0") == true, "\(String(describing: unknown))")

        _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "power", "off"])
        let off = await expectLabError(.unsupported) { try await Transport.connect(to: "rfcomm://\(controllers.centralText):7?adapter=hci1") }
        #expect(off?.message.contains("is powered off") == true, "\(String(describing: off))")
        _ = try await Lab.run("/usr/bin/btmgmt", ["--index", "1", "power", "on"])
    }
}
