import Foundation
import Glibc
import Testing
import TestSupport
import TransportKit
import TransportKitDBus

/// DNS-SD through avahi-daemon (Avahi, NetworkPorts): the API on a private avahi-daemon (side A of
/// Tests/CLITests/Peers/mdns-net), and how a service found becomes a device with a URL.
@Suite("mDNS: Avahi and NetworkPorts")
struct AvahiTests {
    static let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("CLITests/Peers/mdns-net").path

    @Test(.enabled(if: getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/sbin/avahi-daemon"),
                   "needs root (network namespaces) and avahi-daemon (Scripts/setup installs it)"))
    func publishBrowseResolveRenameAndWithdraw() async throws {
        guard let made = mkdtemp(strdup("/tmp/tkavahiXXXXXX")) else { throw TransportError(.io, "mkdtemp: \(errno)") }
        let directory = String(cString: made)
        try #require(await runToEnd(Self.script, ["up", directory]) == 0)
        do {
            try await Self.exercise(Self.values(directory))
        } catch {
            _ = await runToEnd(Self.script, ["down", directory])
            throw error
        }
        _ = await runToEnd(Self.script, ["down", directory])
    }

    static func exercise(_ values: [String: String]) async throws {
        let bus = try DBusConnection(.address(try #require(values["BUS_A"])))
        let avahi = Avahi(bus: bus)

        let events = Gathered(try await avahi.browse(types: ["_tktest._tcp"]))
        defer { events.stop() }
        // TXT: order kept, the first of a repeated key wins (RFC 6763 §6.4), a bare key is "".
        let first = try await avahi.publish(DNSServiceName(name: "Dup", type: "_tktest._tcp"), port: 4100,
                                            txt: ["first=1", "second=2", "flag", "FIRST=shadowed"])
        // The same name on the same daemon collides at once: the next name is taken.
        let second = try await avahi.publish(DNSServiceName(name: "Dup", type: "_tktest._tcp"), port: 4101, txt: [])
        #expect(first.name == "Dup" && second.name == "Dup #2")

        func found() -> [String: DNSService] {
            Dictionary(events.elements.compactMap { event in
                if case .found(let service) = event { return (service.service.name, service) }
                return nil
            }, uniquingKeysWith: { $1 })
        }
        #expect(await eventually(10) { found().count == 2 }, "\(events.elements)")
        let found = found()
        let dup = try #require(found["Dup"], "\(found)")
        #expect(dup.port == 4100 && dup.address == values["ADDR_A"] && dup.host == "tk-mdns-a.local" && dup.interface == "va" && dup.isLocal, "\(dup)")
        #expect(dup.txt == ["first": "1", "second": "2", "flag": ""], "\(dup.txt)")
        #expect(found["Dup #2"]?.port == 4101 && found["Dup #2"]?.txt == [:])

        await first.withdraw()
        #expect(await eventually(10) { events.elements.contains(.removed(DNSServiceName(name: "Dup", type: "_tktest._tcp"))) }, "\(events.elements)")
        try await Task.sleep(for: .seconds(1))
        #expect(!events.elements.contains(.removed(DNSServiceName(name: "Dup #2", type: "_tktest._tcp"))), "the other one stays")
        #expect(events.elements.contains(.allForNow))
        await second.withdraw()

        // A type avahi refuses is an error that says so; so is a name too long for DNS-SD.
        let badType = await expectTransportError(.invalidURL) { _ = try await avahi.publish(DNSServiceName(name: "X", type: "telnet"), port: 1, txt: []) }
        #expect(badType?.message.contains("avahi-daemon refused the service") == true, "\(String(describing: badType))")
        let longName = await expectTransportError(.invalidURL) {
            _ = try await avahi.publish(DNSServiceName(name: String(repeating: "x", count: 64), type: "_tktest._tcp"), port: 1, txt: [])
        }
        #expect(longName?.message.contains("1 to 63 bytes") == true)
        await bus.close()
    }

    @Test func aServiceFoundBecomesADeviceWithAURLThatConnects() throws {
        func service(_ type: String, address: String = "192.168.1.20", txt: [String: String] = [:]) -> DNSService {
            DNSService(service: DNSServiceName(name: "Bench", type: type), host: "pi.local", address: address, port: 4001, txt: txt, interface: "eth0")
        }
        let ours = NetworkPorts.record(for: service("_telnetcpcd._tcp", txt: ["idVendor": "0403", "idProduct": "6001", "serial": "A5", "path": "/dev/ttyUSB0"]))
        #expect(ours?.url == "rfc2217://192.168.1.20:4001" && ours?.scheme == "rfc2217" && ours?.name == "Bench")
        #expect(ours?.vendorId == "0403" && ours?.productId == "6001" && ours?.serialNumber == "A5" && ours?.properties["txt.path"] == "/dev/ttyUSB0")
        #expect(ours?.properties["host"] == "pi.local" && ours?.properties["serviceType"] == "_telnetcpcd._tcp" && ours?.properties["interface"] == "eth0")
        #expect(NetworkPorts.record(for: service("_serial_port._tcp"))?.url == "rfc2217://192.168.1.20:4001")
        #expect(NetworkPorts.record(for: service("_telnetcpcd._tcp", txt: ["tls": "1"]))?.url == "tls+rfc2217://192.168.1.20:4001")
        #expect(NetworkPorts.txt(for: nil, tls: true) == ["txtvers=1", "protocol=rfc2217", "provider=transportkit", "tls=1"])
        // ser2net: what its gensio stack says it speaks.
        for (stack, url) in [("telnet(rfc2217),tcp", "rfc2217://192.168.1.20:4001"), ("tcp", "tcp://192.168.1.20:4001"),
                             ("telnet(rfc2217,winsize),ssl(CA=/etc/ca.pem,mode=server),tcp", "tls+rfc2217://192.168.1.20:4001"),
                             ("ssl,tcp", "tls+tcp://192.168.1.20:4001")] {
            #expect(NetworkPorts.record(for: service("_iostream._tcp", txt: ["gensiostack": stack]))?.url == url, "\(stack)")
        }
        for stack in ["udp", "telnet,sctp", "mux,tcp"] {
            #expect(NetworkPorts.record(for: service("_iostream._tcp", txt: ["gensiostack": stack])) == nil, "\(stack)")
        }
        // An IPv6 link-local address keeps its scope, percent-encoded in the URL.
        #expect(NetworkPorts.record(for: service("_telnetcpcd._tcp", address: "fe80::1%eth0"))?.url == "rfc2217://[fe80::1%25eth0]:4001")
        let scoped = try #require(NetworkPorts.record(for: service("_telnetcpcd._tcp", address: "fe80::1%eth0")))
        #expect(try TransportURL(scoped.url).host == "fe80::1%eth0", "and it reads back as the scoped address")
        // What TransportKit announces for a USB serial port: ser2net's mdns-sysattrs keys.
        let device = DeviceRecord(url: "tty://usb/0403:6001?serial=A5", scheme: "tty", devnode: "/dev/ttyUSB0", vendorId: "0403",
                                  productId: "6001", serialNumber: "A5", manufacturer: "FTDI", product: "FT232R USB UART")
        #expect(NetworkPorts.txt(for: device) == ["txtvers=1", "protocol=rfc2217", "provider=transportkit", "path=/dev/ttyUSB0", "devicetype=serialusb",
                                                  "idVendor=0403", "idProduct=6001", "serial=A5", "manufacturer=FTDI", "product=FT232R USB UART"])
        #expect(NetworkPorts.txt(for: nil) == ["txtvers=1", "protocol=rfc2217", "provider=transportkit"])
        #expect(DNSService.txt(fromItems: [Array("a=1".utf8), Array("=x".utf8), [], Array("A=2".utf8), Array("b".utf8), Array("c==".utf8)])
                == ["a": "1", "b": "", "c": "="])
    }

    /// What mdns-net up wrote: NAME=value lines.
    static func values(_ directory: String) -> [String: String] {
        let text = (try? String(contentsOfFile: directory + "/env", encoding: .utf8)) ?? ""
        return Dictionary(text.split(separator: "\n").compactMap { line in
            line.firstIndex(of: "=").map { (String(line[..<$0]), String(line[line.index(after: $0)...])) }
        }, uniquingKeysWith: { $1 })
    }
}
