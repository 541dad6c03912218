import CBlueZ
import Foundation
import Glibc
import SystemPackage
import Testing
import TestSupport
import TransportKit

/// Listening through BlueZ, and rfcomm:// finding its channel through SDP: hci1 listens (a service
/// published through Profile1, an LE L2CAP PSM), hci0 connects, with BlueZ's own tools (sdptool,
/// l2test) or a plain kernel socket on one side where the test says so.
@Suite("lab: Bluetooth listeners and SDP (rfcomm:// and ble:// listening)", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct BlueZListenLabTests {
    /// A service UUID of the tests' own, so no other record answers the search.
    static let service = "5a1e0001-7a3f-4c2b-9d51-0b2e1f3c4d5e"

    /// The lab's bluetoothd up (BlueZLabTests.setUp) and no device known: every test starts unpaired,
    /// with both controllers NoInputNoOutput, so their pairing is Just Works, which needs no agent.
    /// (A CI run in which this suite came right after BlueZLabTests' pairing test, which sets
    /// DisplayYesNo and back, found the SDP-found channel refused for 10 s: a numeric comparison
    /// nobody confirmed is the likely cause.)
    static func setUp() async throws -> BluetoothLabTests.Controllers {
        let controllers = try await BlueZLabTests.setUp()
        try await BlueZLabTests.justWorksAfresh()
        return controllers
    }

    /// Accepts one connection in the background; `nil` when none came within `seconds` (so a test
    /// fails instead of hanging the lab) or the listener closed.
    static func acceptOne(_ listener: Listener, within seconds: Int = 20) -> Task<Connection?, any Error> {
        Task {
            try await withThrowingTaskGroup(of: Connection?.self) { group in
                group.addTask { try await listener.accept() }
                group.addTask {
                    try await Task.sleep(for: .seconds(seconds))
                    return nil
                }
                let first = try await group.next() ?? nil
                group.cancelAll()
                return first
            }
        }
    }

    /// Writes `bytes` and reads `expecting` bytes back, on both sides at once.
    static func exchange(_ connection: Connection, send bytes: [UInt8], expecting: Int) async throws -> [UInt8] {
        async let written: Void = connection.write(bytes)
        var received: [UInt8] = []
        while received.count < expecting, let chunk = try await connection.read() { received += chunk }
        try await written
        return received
    }

    /// 10 KiB each way at once between the two ends of one connection, compared byte for byte.
    static func tenKiBEachWay(client: Connection, server: Connection) async throws {
        let toServer = BlueZLabTests.pattern(10 * 1024)
        let toClient = Array(BlueZLabTests.pattern(10 * 1024).reversed())
        async let serverSide = exchange(server, send: toClient, expecting: toServer.count)
        let clientReceived = try await exchange(client, send: toServer, expecting: toClient.count)
        #expect(try await serverSide == toServer)
        #expect(clientReceived == toClient)
    }

    @Test func rfcommFindsAListenersChannelThroughSDPAndCarriesTenKiBEachWay() async throws {
        let controllers = try await Self.setUp()
        let listener = try await Transport.listen(on: "rfcomm://\(controllers.peripheralText)?name=TKLab-serial")
        let channel = try #require(listener.url.port)
        let accepted = Self.acceptOne(listener)
        // SDP answers with every Serial Port record hci1 publishes, and the client takes the
        // first: a record of an earlier test that bluetoothd has not withdrawn yet would send it
        // to a channel nobody listens on (ECONNREFUSED, seen twice in CI). Ours alone, first.
        let records = try await Self.serialPortChannels(on: controllers.peripheralText, awaiting: channel)
        #expect(records == [channel], "the Serial Port records hci1 publishes: channels \(records)")

        let client = try await Self.connectAfterAPairingTest("rfcomm://\(controllers.peripheralText)?adapter=hci0")
        #expect(client.metadata.extra["channel"] == String(channel), "SDP found the listener's channel")
        #expect(client.metadata.extra["service"] == "1101")
        let server = try #require(try await accepted.value)
        #expect(server.metadata.remoteAddress == controllers.centralText)
        #expect(server.metadata.extra["channel"] == String(channel))

        try await Self.tenKiBEachWay(client: client, server: server)

        // The listening side closes: bluetoothd holds the socket too, and the client must still see the end.
        try await server.close()
        let (rest, ending) = await Lab.readToEnd(client)
        #expect(rest.isEmpty)
        #expect(ending?.kind == .disconnected, "\(String(describing: ending))")
        try? await client.close()

        // BlueZ's own SDP client finds the record bluetoothd published for us.
        let search = try await Lab.run("/usr/bin/sdptool", ["search", "--bdaddr", controllers.peripheralText, "SP"])
        #expect(search.stdout.contains("Channel: \(channel)"), "sdptool: \(search.stdout) \(search.stderr)")
        #expect(search.stdout.contains("TKLab-serial"), "the name= option is the record's name: \(search.stdout)")
        try await listener.close()
    }

    /// `BlueZLabTests.connect`, and once more after a refusal that lasted its 10 s or a failed
    /// pairing: the links dropped and both controllers' devices forgotten (NoInputNoOutput again).
    /// Right after BlueZLabTests' pairing test this suite's first connect was refused for 10 s in
    /// three CI runs, and failed its pairing in one rehearsal (a pairing nobody confirmed is the
    /// likely cause); each time the test passed alone.
    static func connectAfterAPairingTest(_ url: String) async throws -> Connection {
        do {
            return try await BlueZLabTests.connect(url)
        } catch let error as TransportError where error.kind == .refused || error.kind == .permissionDenied {
            // .permissionDenied: the pairing failed, once in a CI rehearsal, right after the suite
            // before had refused a pairing on purpose (pairingThatNeedsAnAgent…).
            let links = try await Lab.run("/usr/bin/hcitool", ["con"])
            print("lab: \(url) failed (\(error.kind): \(error.message)); links: \(links.stdout) — forgetting the devices and trying once more")
            _ = try await setUp()
            try await Task.sleep(for: .seconds(2))
            return try await BlueZLabTests.connect(url)
        }
    }

    /// The channels of the Serial Port records `address` publishes (BlueZ's sdptool), once they
    /// are `[channel]` or after 10 s.
    static func serialPortChannels(on address: String, awaiting channel: Int) async throws -> [Int] {
        var channels: [Int] = []
        for _ in 0..<20 {
            let search = try await Lab.run("/usr/bin/sdptool", ["search", "--bdaddr", address, "SP"])
            channels = search.stdout.split(separator: "\n").compactMap { line in
                line.contains("Channel: ") ? line.split(separator: " ").last.flatMap { Int($0) } : nil
            }
            if channels == [channel] { break }
            try await Task.sleep(for: .milliseconds(500))
        }
        return channels
    }

    @Test func anRfcommListenerOnAnyAdapterOnAGivenChannelTakesTwoSDPConnectsAndUnpublishesWhenClosed() async throws {
        let controllers = try await Self.setUp()
        let socketsBefore = Descriptors.open().filter { $0.target.hasPrefix("socket:[") }.count
        // A channel given in the URL (the test before takes one automatically).
        let listener = try await Transport.listen(on: "rfcomm://any:13?uuid=\(Self.service)")
        let channel = try #require(listener.url.port)
        #expect(channel == 13)

        // Twice through SDP with our own client, the service named by uuid=.
        for round in 1...2 {
            let next = Self.acceptOne(listener)
            let client = try await BlueZLabTests.connect("rfcomm://\(controllers.peripheralText)?adapter=hci0&uuid=\(Self.service)")
            #expect(client.metadata.extra["channel"] == String(channel), "round \(round)")
            let server = try #require(try await next.value)
            try await client.write(Array("round \(round)".utf8))
            let line = try await server.read()
            #expect(line.map { String(decoding: $0, as: UTF8.self) } == "round \(round)")
            try await client.close()
            try? await server.close()
        }

        let waiting = Self.acceptOne(listener)
        try await Task.sleep(for: .milliseconds(200))
        try await listener.close()
        #expect(try await waiting.value == nil, "close() ends an accept() that waits")
        #expect(try await listener.accept() == nil)
        let gone = await expectLabError(.notFound) {
            try await Transport.connect(to: "rfcomm://\(controllers.peripheralText)?adapter=hci0&uuid=\(Self.service)")
        }
        #expect(gone?.message.contains("publishes no RFCOMM service") == true, "\(String(describing: gone))")
        let closed = await eventually(5) { Descriptors.open().filter { $0.target.hasPrefix("socket:[") }.count <= socketsBefore }
        #expect(closed, "sockets left open: \(Descriptors.open())")
    }

    /// The CLI as a user runs it: `transportkit bridge --once --listen rfcomm://any:14 tcp://…`
    /// offers a TCP service over RFCOMM. A client on hci0 talks through it both ways; the service
    /// ends the conversation, the client sees the end, and the bridge exits 0 and unpublishes.
    /// (A client that leaves first ends the bridge with status 1: RFCOMM reports a peer's close as
    /// ECONNRESET, a reset like any other. Docs/Schemes.md says so.)
    @Test func theCLIBridgeOffersATCPServiceOverAnRfcommListener() async throws {
        let controllers = try await Self.setUp()
        let tcp = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(tcp.url.port)
        let behind = Self.acceptOne(tcp, within: 30)
        // timeout(1) so that a bridge that never exits fails the test instead of hanging the lab.
        let bridge = Task {
            try await Lab.run("/usr/bin/timeout", ["60", Lab.cli, "bridge", "--once", "--listen", "rfcomm://any:14?uuid=\(Self.service)", "tcp://127.0.0.1:\(port)"])
        }
        do {
            // Refused until the bridge has registered its profile: BlueZLabTests.connect retries that.
            let client = try await BlueZLabTests.connect("rfcomm://\(controllers.peripheralText):14?adapter=hci0")
            let service = try #require(try await behind.value, "the bridge did not connect to the TCP service")
            try await client.write(Array("over rfcomm".utf8))
            #expect(try await Self.exchange(service, send: Array("and back".utf8), expecting: 11) == Array("over rfcomm".utf8))
            var back: [UInt8] = []
            while back.count < 8, let chunk = try await client.read() { back += chunk }
            #expect(back == Array("and back".utf8))
            try await service.close()
            let (rest, ending) = await Lab.readToEnd(client)
            #expect(rest.isEmpty && ending?.kind == .disconnected, "the bridge closed the RFCOMM side after the service: \(String(describing: ending))")
            try? await client.close()
        } catch {
            Issue.record(error)
        }
        let result = try await bridge.value
        #expect(result.status == 0, "bridge --once exits 0 after its one client: status \(result.status), \(result.stderr)")
        try await tcp.close()
        let gone = await expectLabError(.notFound) {
            try await Transport.connect(to: "rfcomm://\(controllers.peripheralText)?adapter=hci0&uuid=\(Self.service)")
        }
        #expect(gone?.message.contains("publishes no RFCOMM service") == true, "unpublished when the bridge exited: \(String(describing: gone))")
    }

    /// bluetoothd killed with SIGKILL sends no Profile1.Release: the listener sees org.bluez leave
    /// the bus (NameOwnerChanged) and ends a waiting accept() with "disconnected". Once bluetoothd is
    /// back, listening works again.
    @Test func anRfcommListenerWhoseBluetoothdIsKilledEndsItsAccept() async throws {
        let controllers = try await Self.setUp()
        let listener = try await Transport.listen(on: "rfcomm://any?uuid=\(Self.service)")
        let waiting = Self.acceptOne(listener)
        try await Task.sleep(for: .milliseconds(200))
        _ = try await Lab.run("/usr/bin/pkill", ["-KILL", "-x", "bluetoothd"])
        do {
            let connection = try await waiting.value
            Issue.record("accept() did not fail: \(String(describing: connection))")
        } catch let error as TransportError {
            #expect(error.kind == .disconnected, "\(error)")
            #expect(error.message.contains("left the bus"), "\(error)")
        }
        try await listener.close()
        // pkill returns before the process is gone; labctl bluez-start starts one only when none runs.
        var running = true
        for _ in 0..<100 where running {
            running = try await Lab.run("/usr/bin/pgrep", ["-x", "bluetoothd"]).status == 0
            if running { try await Task.sleep(for: .milliseconds(100)) }
        }
        try #require(!running, "bluetoothd still runs 10 s after SIGKILL")
        // bluetoothd started again, both adapters powered, and both NoInputNoOutput again: a new
        // bluetoothd sets its own IO capability, and an unconfirmed numeric comparison then refused
        // the connect below for 10 s (a CI run of 0ebb0ec).
        _ = try await Self.setUp()
        let again = try await Transport.listen(on: "rfcomm://any?uuid=\(Self.service)")
        let next = Self.acceptOne(again)
        // As after the pairing test: a refusal that lasts (the new bluetoothd's pairing wanted a
        // confirmation nobody gives; 2 of 4 runs of 1b19809) gets the devices forgotten and one more try.
        let client = try await Self.connectAfterAPairingTest("rfcomm://\(controllers.peripheralText)?adapter=hci0&uuid=\(Self.service)")
        let server = try #require(try await next.value, "a connection through the new bluetoothd")
        try await client.close()
        try? await server.close()
        try await again.close()
    }

    @Test func anLEListenerTakesL2testAndOurClientBothWays() async throws {
        let controllers = try await Self.setUp()
        let listener = try await Transport.listen(on: "ble://FFF0:141?adapter=hci1&mtu=512")
        #expect(listener.url.port == 141)

        // BlueZ's l2test connects from hci0 and sends ten records of 100 bytes.
        let accepted = Self.acceptOne(listener)
        let sender = try BackgroundProgram("/usr/bin/l2test", ["-s", "-V", "le_public", "-P", "141", "-i", "hci0", "-b", "100", "-N", "10", "-g", "2000",
                                                              controllers.peripheralText])
        defer { sender.kill() }
        let fromL2test = try #require(try await accepted.value)
        #expect(fromL2test.metadata.remoteAddress == controllers.centralText)
        #expect(fromL2test.metadata.extra["receiveMTU"] == "512")
        var records: [[UInt8]] = []
        do {
            for _ in 0..<10 {
                guard let record = try await fromL2test.readMessage(timeout: .seconds(10)) else { break }
                records.append(record)
            }
        } catch {
            Issue.record("after \(records.count) records from l2test: \(error)")
        }
        #expect(records.count == 10)
        #expect(records.allSatisfy { $0.count == 100 }, "\(records.map(\.count))")
        try? await fromL2test.close()

        // Our own client, 10 KiB each way, writes larger than the MTU.
        let next = Self.acceptOne(listener)
        let client = try await BlueZLabTests.connect("ble://FFF0:141/\(controllers.peripheralText)?adapter=hci0&addressType=public")
        let server = try #require(try await next.value)
        try await Self.tenKiBEachWay(client: client, server: server)
        try await client.close()
        try? await server.close()

        // close() while an accept() waits: the accept ends with nil, and so does every later one.
        let racing = try await Transport.listen(on: "ble://FFF0:146?adapter=hci1&advertise=false")
        let waiting = Self.acceptOne(racing)
        try await Task.sleep(for: .milliseconds(200))
        try await racing.close()
        #expect(try await waiting.value == nil)
        #expect(try await racing.accept() == nil)

        // Closed: the PSM is free again, and a connect is refused.
        try await listener.close()
        let refused = await expectLabError(.refused) { try await Transport.connect(to: "ble://FFF0:141/\(controllers.peripheralText)?adapter=hci0&addressType=public") }
        #expect(refused?.message.contains("nobody listens on L2CAP PSM 141") == true, "\(String(describing: refused))")
        let again = try await Transport.listen(on: "ble://FFF0:141?adapter=hci1&advertise=false")
        try await again.close()
    }

    /// A real D-Bus policy that denies one user bluetoothd (written into the guest's overlay, the
    /// bus told to reload): the CLI run as that user says which policy refused it.
    @Test func aDBusPolicyThatRefusesTheUserIsNamed() async throws {
        let controllers = try await Self.setUp()
        let policy = "/etc/dbus-1/system.d/zz-transportkit-lab-deny.conf"
        let text = """
            <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN" "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
            <busconfig><policy user="nobody"><deny send_destination="org.bluez"/></policy></busconfig>
            """
        try text.write(toFile: policy, atomically: true, encoding: .utf8)
        let reload = ["--system", "--print-reply", "--dest=org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus.ReloadConfig"]
        _ = try await Lab.run("/usr/bin/dbus-send", reload)
        var outcome: Result<Lab.Output, any Error>
        do {
            outcome = .success(try await Lab.run("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", Lab.cli,
                                                                      "connect", "rfcomm://\(controllers.peripheralText):7?adapter=hci0"]))
        } catch {
            outcome = .failure(error)
        }
        // The policy goes away whatever happened: the suites after this one run as root, unaffected.
        unlink(policy)
        _ = try await Lab.run("/usr/bin/dbus-send", reload)
        let denied = try outcome.get()
        #expect(denied.status != 0)
        #expect(denied.stderr.contains("AccessDenied"), "\(denied.stderr)")
        #expect(denied.stderr.contains("D-Bus policy"), "the message names the policy: \(denied.stderr)")
        #expect(denied.stderr.contains("/etc/dbus-1/system.d"), "\(denied.stderr)")
    }

    @Test func listenerErrorsSayWhatToDo() async throws {
        let controllers = try await Self.setUp()
        let first = try await Transport.listen(on: "ble://FFF0:142?adapter=hci1&advertise=false")
        let psm = await expectLabError(.busy) { try await Transport.listen(on: "ble://FFF0:142?adapter=hci1&advertise=false") }
        #expect(psm?.message.contains("PSM 142 is taken") == true, "\(String(describing: psm))")
        try await first.close()

        let taken = try await Transport.listen(on: "rfcomm://any:12?uuid=\(Self.service)")
        let channel = await expectLabError(.busy) { try await Transport.listen(on: "rfcomm://any:12") }
        #expect(channel?.message.contains("RFCOMM channel 12 is taken") == true, "\(String(describing: channel))")
        try await taken.close()

        let stranger = await expectLabError(.notFound) { try await Transport.listen(on: "rfcomm://00:11:22:33:44:55") }
        #expect(stranger?.message.contains("no Bluetooth adapter 00:11:22:33:44:55") == true, "\(String(describing: stranger))")
        // An RFCOMM channel nobody serves: refused by the peer, now that hci1 is connectable.
        let unused = await expectLabError(.refused) { try await Transport.connect(to: "rfcomm://\(controllers.peripheralText):25?adapter=hci0") }
        #expect(unused?.message.contains("nobody listens on RFCOMM channel 25") == true, "\(String(describing: unused))")
        // The suites after this one start unpaired too.
        try await BlueZLabTests.forgetDevices()
    }
}
