import Testing
@testable import TransportKit

@Suite("URL model")
struct TransportURLTests {
    @Test("CornucopiaStreams' URL forms parse with their meaning", arguments: [
        ("tcp://192.168.0.10:35000", "tcp", "192.168.0.10", 35000, ""),
        ("tty://adapter:19200/dev/ttyUSB0", "tty", "adapter", 19200, "/dev/ttyUSB0"),
        ("rfcomm://00:0a:3a:22:68:73", "rfcomm", "00:0a:3a:22:68:73", nil, ""),
        ("rfcomm://00:0a:3a:22:68:73:3", "rfcomm", "00:0a:3a:22:68:73", 3, ""),
        ("ble://FFF0", "ble", "FFF0", nil, ""),
        ("ble://FFF0/E3:2E:44:66:A2:4A", "ble", "FFF0", nil, "/E3:2E:44:66:A2:4A"),
        ("ble://FFF0:128/E3:2E:44:66:A2:4A", "ble", "FFF0", 128, "/E3:2E:44:66:A2:4A"),
        ("unix:///tmp/app.sock", "unix", nil, nil, "/tmp/app.sock"),
        ("tty:///dev/ttyUSB0?baud=115200", "tty", nil, nil, "/dev/ttyUSB0"),
        ("tcp://[::1]:4000", "tcp", "::1", 4000, ""),
        ("tcp://[fe80::1%eth0]:80", "tcp", "fe80::1%eth0", 80, ""),
        ("TCP://localhost:1", "tcp", "localhost", 1, ""),
        ("loop://", "loop", nil, nil, ""),
    ] as [(String, String, String?, Int?, String)])
    func parses(_ text: String, scheme: String, host: String?, port: Int?, path: String) throws {
        let url = try TransportURL(text)
        #expect(url.scheme == scheme)
        #expect(url.host == host)
        #expect(url.port == port)
        #expect(url.path == path)
    }

    @Test func bluetoothHostIsRecognised() throws {
        #expect(try TransportURL("rfcomm://00:0a:3a:22:68:73:3").hostIsBluetoothAddress)
        #expect(try !TransportURL("tcp://10.0.0.1:3").hostIsBluetoothAddress)
    }

    @Test func queryOptionsKeepOrderAndDecode() throws {
        let url = try TransportURL("tty:///dev/serial/by-id/usb-FTDI%20A?baud=115200&parity=even&lowLatency")
        #expect(url.path == "/dev/serial/by-id/usb-FTDI A")
        #expect(url.query.map(\.name) == ["baud", "parity", "lowLatency"])
        #expect(url.queryValue("BAUD") == "115200")
        #expect(url.queryValue("lowlatency") == "")
        #expect(url.queryValue("missing") == nil)
    }

    @Test func userInfoIsSeparated() throws {
        let url = try TransportURL("tcp://admin@host:22")
        #expect(url.user == "admin")
        #expect(url.host == "host")
    }

    @Test("descriptions round-trip", arguments: [
        "tcp://192.168.0.10:35000", "rfcomm://00:0a:3a:22:68:73:3", "ble://FFF0:128/E3:2E:44:66:A2:4A",
        "tcp://[::1]:4000?noDelay=false", "unix:///tmp/a%20b.sock", "loop://?buffer=10",
    ])
    func roundTrips(_ text: String) throws {
        let url = try TransportURL(text)
        #expect(try TransportURL(url.description) == url)
    }

    @Test("malformed URLs are rejected with the reason", arguments: [
        ("no-scheme", "expected scheme://"),
        ("1tcp://host:1", "must start with a letter"),
        ("tcp://host:port", "must be a decimal number"),
        ("tcp://host:", "must be a decimal number"),
        ("tcp://host:99999999999", "must be a decimal number"),
        ("tcp://::1:4000", "brackets"),
        ("tcp://[::1:4000", "no ']' closes"),
        ("tcp://[::1]4000", "expected ':PORT'"),
        ("tcp://[zz]:1", "not an IPv6 address"),
        ("rfcomm://00:0a:3a:22:68:73:3:4", "neither HOST:PORT nor a Bluetooth address"),
        ("tcp://host:1#frag", "fragments"),
        ("tcp://host:1?a=1&A=2", "given twice"),
        ("tcp://host:1?=1", "has no name"),
        ("unix:///tmp/%zz", "two hex digits"),
        ("unix:///tmp/%ff", "not valid UTF-8"),
    ])
    func rejects(_ text: String, reason: String) {
        do {
            _ = try TransportURL(text)
            Issue.record("\(text) parsed")
        } catch let error as TransportError {
            #expect(error.kind == .invalidURL)
            #expect(error.message.contains(reason), "\(error.message)")
        } catch {
            Issue.record("unexpected \(error)")
        }
    }
}
