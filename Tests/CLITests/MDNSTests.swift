import Foundation
import Glibc
import Testing
import TestSupport
import TransportKit

/// Serial ports found and announced by mDNS: `bridge --announce`, `list --network` and
/// `watch --network`, on a private network of two namespaces (Peers/mdns-net), each side with
/// its own avahi-daemon and bus. The other machine is python-zeroconf (Peers/mdns_peer.py),
/// ser2net and pyserial: no one here wrote them.
@Suite("mDNS: bridge --announce, list --network, watch --network",
       .enabled(if: getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/sbin/avahi-daemon"),
                "needs root (network namespaces) and avahi-daemon (Scripts/setup installs it)"))
struct MDNSTests {
    static let peers = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers").path

    /// The private network: side A (the tool) and side B (the peers).
    struct Net: Sendable {
        let directory: String
        let values: [String: String]

        static func up() async throws -> Net {
            guard let made = mkdtemp(strdup("/tmp/tkmdnsXXXXXX")) else { throw TransportError(.io, "mkdtemp failed: \(errno)") }
            let directory = String(cString: made)
            let status = await runToEnd(MDNSTests.peers + "/mdns-net", ["up", directory])
            guard status == 0 else { throw TransportError(.io, "mdns-net up failed: \(status)") }
            let text = (try? String(contentsOfFile: directory + "/env", encoding: .utf8)) ?? ""
            let values = Dictionary(text.split(separator: "\n").compactMap { line in
                line.firstIndex(of: "=").map { (String(line[..<$0]), String(line[line.index(after: $0)...])) }
            }, uniquingKeysWith: { $1 })
            return Net(directory: directory, values: values)
        }

        func down() async { _ = await runToEnd(MDNSTests.peers + "/mdns-net", ["down", directory]) }

        var addressA: String { values["ADDR_A", default: ""] }
        var addressB: String { values["ADDR_B", default: ""] }

        /// Runs a command line on side A (the tool's), with side A's bus as the system bus.
        var sideA: [String] { ["/usr/sbin/ip", "netns", "exec", values["NS_A", default: ""], "/usr/bin/env", "DBUS_SYSTEM_BUS_ADDRESS=\(values["BUS_A", default: ""])"] }
        /// Likewise on side B.
        var sideB: [String] { ["/usr/sbin/ip", "netns", "exec", values["NS_B", default: ""], "/usr/bin/env", "DBUS_SYSTEM_BUS_ADDRESS=\(values["BUS_B", default: ""])"] }
    }

    static func withNet(_ body: (Net) async throws -> Void) async throws {
        let net = try await Net.up()
        do {
            try await body(net)
        } catch {
            await net.down()
            throw error
        }
        await net.down()
    }

    /// A program run with its output collected, on a thread of its own; stdin stays open until `endInput`.
    typealias Peer = CLI.Running

    static func jsonLines(_ text: String) -> [[String: Any]] {
        text.split(separator: "\n").compactMap { try? JSONSerialization.jsonObject(with: Data($0.utf8)) as? [String: Any] }
    }

    static func status(_ running: CLI.Running, _ event: String) -> [String: String]? {
        running.stderrLines.lazy.compactMap { line -> [String: String]? in
            guard let object = try? JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: String], object["event"] == event else { return nil }
            return object
        }.first
    }

    @Test func aBridgeAnnouncesItsPortZeroconfFindsItPyserialUsesItAndItIsWithdrawnOnSIGTERM() async throws {
        try await Self.withNet { net in
            // zeroconf on side B watches for the type from the start.
            let browser = try Self.python(net.sideB, ["browse", "_telnetcpcd._tcp.local.", net.addressB])
            let bridge = try CLI.Running(["bridge", "--listen", "rfc2217://0.0.0.0:0", "--announce", "--announce-name", "TK Bench", "--json", "pty://"],
                                         prefix: net.sideA)
            #expect(await eventually(15) { Self.status(bridge, "listening") != nil }, "\(bridge.stderrLines)")
            let announced = try #require(Self.status(bridge, "announced"), "\(bridge.stderrLines)")
            #expect(announced["name"] == "TK Bench" && announced["type"] == "_telnetcpcd._tcp", "\(announced)")
            let port = try #require(announced["port"].flatMap(Int.init))
            // The exposure warning comes too: the port is reachable from the network without authentication.
            #expect(bridge.stderrLines.contains { $0.contains("does not authenticate clients") })

            #expect(await eventually(10) { Self.jsonLines(browser.stdoutText).contains { $0["state"] as? String == "added" } }, "\(browser.stdoutText)")
            let added = try #require(Self.jsonLines(browser.stdoutText).first { $0["state"] as? String == "added" })
            #expect(added["name"] as? String == "TK Bench._telnetcpcd._tcp.local." && added["port"] as? Int == port, "\(added)")
            let txt = added["txt"] as? [String: String] ?? [:]
            #expect(txt["protocol"] == "rfc2217" && txt["txtvers"] == "1" && txt["provider"] == "transportkit", "\(txt)")

            // pyserial on side B opens the announced port at 19200 baud: every SET answered.
            let client = await Self.run(net.sideB + ["/usr/bin/python3", "-c", """
                import serial, sys
                port = serial.serial_for_url("rfc2217://\(net.addressA):\(port)", baudrate=19200, timeout=3)
                print("opened", port.baudrate); port.close()
                """])
            #expect(client.status == 0 && client.text.contains("opened 19200"), "\(client.text) \(client.stderr)")

            // SIGTERM: the bridge withdraws the service; zeroconf sees it go.
            bridge.signal(SIGTERM)
            let ended = await bridge.wait(timeout: 10)
            #expect(ended.status == 143, "\(ended.stderr)")
            #expect(await eventually(10) { Self.jsonLines(browser.stdoutText).contains { $0["state"] as? String == "removed" } }, "\(browser.stdoutText)")
            browser.endInput()
            _ = await browser.wait(timeout: 10)
        }
    }

    @Test func aNameTakenOnTheNetworkIsAnnouncedUnderTheNextOne() async throws {
        try await Self.withNet { net in
            let holder = try Self.python(net.sideB, ["register", "_telnetcpcd._tcp.local.", "TK Bench", net.addressB, "4000"])
            #expect(await eventually(10) { browserSaid(holder, "registered") })
            let bridge = try CLI.Running(["bridge", "--listen", "rfc2217://0.0.0.0:0", "--announce", "--announce-name", "TK Bench", "--json", "pty://"],
                                         prefix: net.sideA)
            #expect(await eventually(20) { Self.status(bridge, "listening") != nil }, "\(bridge.stderrLines)")
            let announced = Self.status(bridge, "announced")
            #expect(announced?["name"] == "TK Bench #2" && announced?["asked"] == "TK Bench", "\(bridge.stderrLines)")
            bridge.signal(SIGINT)
            #expect(await bridge.wait(timeout: 10).status == 130)
            holder.endInput()
            _ = await holder.wait(timeout: 10)
        }
    }

    @Test func listNetworkShowsAZeroconfPortAndASer2netPortWithURLsThatConnect() async throws {
        try await Self.withNet { net in
            let holder = try Self.python(net.sideB, ["register", "_telnetcpcd._tcp.local.", "ZC Port", net.addressB, "4242",
                                                     "path=/dev/ttyUSB3", "idVendor=0403", "idProduct=6001", "serial=A5XK3RJT", "product=FT232R USB UART"])
            #expect(await eventually(10) { browserSaid(holder, "registered") })
            // ser2net announces through side B's avahi-daemon (gensio's mDNS, libavahi-client), in
            // front of a pty of this process.
            var master: Int32 = -1
            var slave: Int32 = -1
            try #require(openpty(&master, &slave, nil, nil, nil) == 0)
            _ = fcntl(master, F_SETFD, FD_CLOEXEC)
            let pty = try FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(slave)")
            close(slave)
            defer { close(master) }
            let config = net.directory + "/ser2net.yaml"
            try """
                connection: &bench
                  accepter: telnet(rfc2217),tcp,\(net.addressB),3001
                  connector: serialdev,\(pty),9600n81,local
                  options:
                    mdns: true
                    mdns-name: ser2net bench
                """.write(toFile: config, atomically: true, encoding: .utf8)
            let ser2net = try CLI.Running([], program: net.sideB + ["/usr/sbin/ser2net", "-n", "-d", "-c", config])
            // KILL: started by Foundation's Process from a thread that blocks signals, it inherits
            // SIGTERM blocked.
            defer { ser2net.signal(SIGKILL) }

            var devices: [[String: Any]] = []
            // mDNS takes its time (probing, announcing): list until both are there.
            let deadline = ContinuousClock.now + .seconds(15)
            while devices.count < 2 && ContinuousClock.now < deadline {
                let listed = await Self.run(net.sideA + [CLI.binary, "list", "--network", "--json"])
                let array = (try? JSONSerialization.jsonObject(with: Data(listed.stdout)) as? [[String: Any]]) ?? []
                devices = array.filter { ($0["properties"] as? [String: String])?["serviceType"] != nil }
                if devices.count < 2 { try await Task.sleep(for: .milliseconds(500)) }
            }
            let zeroconf = try #require(devices.first { $0["name"] as? String == "ZC Port" }, "\(devices)")
            #expect(zeroconf["url"] as? String == "rfc2217://\(net.addressB):4242", "\(zeroconf)")
            #expect(zeroconf["vendorId"] as? String == "0403" && zeroconf["productId"] as? String == "6001"
                    && zeroconf["serialNumber"] as? String == "A5XK3RJT" && zeroconf["product"] as? String == "FT232R USB UART", "\(zeroconf)")
            #expect((zeroconf["properties"] as? [String: String])?["txt.path"] == "/dev/ttyUSB3", "\(zeroconf)")
            let bench = try #require(devices.first { $0["name"] as? String == "ser2net bench" }, "\(devices)")
            #expect(bench["url"] as? String == "rfc2217://\(net.addressB):3001", "\(bench)")
            #expect((bench["properties"] as? [String: String])?["txt.provider"] == "ser2net", "\(bench)")

            // The URL listed connects: the tool on side A sends through ser2net to the pty.
            let url = try #require(bench["url"] as? String)
            let connect = try CLI.Running(["connect", url + "?baud=19200"], prefix: net.sideA)
            connect.send(Array("hello from A".utf8))
            var received: [UInt8] = []
            #expect(await eventually(10) {
                var buffer = [UInt8](repeating: 0, count: 256)
                var poller = pollfd(fd: master, events: Int16(POLLIN), revents: 0)
                if poll(&poller, 1, 0) == 1 {
                    let count = read(master, &buffer, buffer.count)
                    if count > 0 { received += buffer[..<count] }
                }
                return String(decoding: received, as: UTF8.self).contains("hello from A")
            }, "\(received)")
            connect.endInput()
            #expect(await connect.wait(timeout: 10).status == 0)
            holder.endInput()
            _ = await holder.wait(timeout: 10)
        }
    }

    @Test func watchNetworkReportsAPortArrivingAndLeaving() async throws {
        try await Self.withNet { net in
            let watch = try CLI.Running(["watch", "--network", "--json"], prefix: net.sideA)
            #expect(await eventually(10) { watch.stderrLines.contains("watching") }, "\(watch.stderrLines)")
            let holder = try Self.python(net.sideB, ["register", "_telnetcpcd._tcp.local.", "Arriving", net.addressB, "4343"])
            func saw(_ action: String) -> Bool {
                Self.jsonLines(watch.stdoutText).contains { event in
                    event["event"] as? String == action && (event["device"] as? [String: Any])?["name"] as? String == "Arriving"
                }
            }
            #expect(await eventually(15) { saw("added") }, "\(watch.stdoutText)")
            holder.endInput()
            #expect(await eventually(15) { saw("removed") }, "\(watch.stdoutText)")
            _ = await holder.wait(timeout: 10)
            watch.signal(SIGINT)
            _ = await watch.wait(timeout: 10)
        }
    }

    @Test func withoutAvahiTheBridgeDoesNotStartAndListWarns() async throws {
        // A bus with no avahi-daemon on it, and no bus at all.
        let directory = try #require(mkdtemp(strdup("/tmp/tkbusXXXXXX")).map { String(cString: $0) })
        try """
            <busconfig><type>system</type><listen>unix:path=\(directory)/bus</listen><auth>EXTERNAL</auth>
            <policy context="default"><allow user="*"/><allow own="*"/><allow send_destination="*"/><allow receive_sender="*"/></policy></busconfig>
            """.write(toFile: directory + "/bus.conf", atomically: true, encoding: .utf8)
        let bus = try CLI.Running([], program: ["/usr/bin/dbus-daemon", "--config-file=\(directory)/bus.conf", "--nofork"])
        defer {
            bus.signal(SIGKILL)   // it inherits SIGTERM blocked, as ser2net above
            try? FileManager.default.removeItem(atPath: directory)
        }
        #expect(await eventually(5) { access(directory + "/bus", F_OK) == 0 })
        let noAvahi = await Self.run(["/usr/bin/env", "DBUS_SYSTEM_BUS_ADDRESS=unix:path=\(directory)/bus", CLI.binary,
                                      "bridge", "--listen", "rfc2217://0.0.0.0:0", "--announce", "pty://"])
        #expect(noAvahi.status == 1 && noAvahi.stderr.contains("avahi-daemon is not running"), "\(noAvahi.stderr)")
        #expect(!noAvahi.stderr.contains("listening"), "the bridge does not serve when its announcement failed: \(noAvahi.stderr)")
        let noBus = await Self.run(["/usr/bin/env", "DBUS_SYSTEM_BUS_ADDRESS=unix:path=\(directory)/none", CLI.binary, "list", "--network"])
        #expect(noBus.stderr.contains("warning: network ports:") && noBus.stderr.contains("is dbus-daemon running?"), "\(noBus.stderr)")
    }

    // MARK: Helpers

    static func python(_ side: [String], _ arguments: [String]) throws -> CLI.Running {
        try CLI.Running([], program: side + ["/usr/bin/python3", peers + "/mdns_peer.py"] + arguments)
    }

    /// Runs a command line to its end, with its output.
    static func run(_ command: [String]) async -> CLI.Result {
        guard let running = try? CLI.Running([], program: command) else { return CLI.Result(status: -1, stdout: [], stderr: "cannot start \(command)") }
        running.endInput()
        return await running.wait(timeout: 20)
    }
}

private func browserSaid(_ peer: CLI.Running, _ key: String) -> Bool {
    MDNSTests.jsonLines(peer.stdoutText).contains { $0[key] != nil }
}

/// What `--announce` refuses needs no network, no avahi-daemon and no root: checked everywhere.
@Suite("mDNS: what bridge --announce refuses")
struct AnnounceRefusalTests {
    @Test func announcingIsRefusedWhereItCannotWork() async throws {
        for (arguments, says) in [
            (["bridge", "--listen", "tcp://0.0.0.0:0", "--announce", "pty://"], "rfc2217:// listener"),
            (["bridge", "--listen", "rfc2217://127.0.0.1:0", "--announce", "pty://"], "only this machine can connect"),
            (["bridge", "--listen", "rfc2217://0.0.0.0:0", "--announce-name", "X", "pty://"], "give --announce too"),
            (["bridge", "--listen", "rfc2217://0.0.0.0:0", "--announce", "--once", "pty://"], "without --once"),
        ] {
            let refused = try await CLI.run(arguments)
            #expect(refused.status == 64 && refused.stderr.contains(says), "\(arguments): \(refused.stderr)")
        }
    }
}
