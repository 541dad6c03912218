import Testing
@testable import TransportKit
@_spi(Plugins) import TransportKitCore

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

    @Test("wrapped URLs: layers, each layer's own options, the inner URL's untouched", arguments: [
        ("spy+tcp://127.0.0.1:4000", ["spy", "tcp"], [[], []], "tcp://127.0.0.1:4000"),
        ("spy+tty:///dev/ttyUSB0?baud=115200", ["spy", "tty"], [[], ["baud=115200"]], "tty:///dev/ttyUSB0?baud=115200"),
        ("spy+tty:///dev/ttyUSB0?baud=115200&spy.format=raw", ["spy", "tty"], [["format=raw"], ["baud=115200"]], "tty:///dev/ttyUSB0?baud=115200"),
        // Same names at two layers do not collide: the prefix says whose.
        ("spy+loop://?buffer=8&SPY.file=/tmp/t&spy.format=hex", ["spy", "loop"], [["file=/tmp/t", "format=hex"], ["buffer=8"]], "loop://?buffer=8"),
        ("crlf+spy+tcp://[::1]:7?spy.direction=rx&crlf.x=1&noDelay", ["crlf", "spy", "tcp"], [["x=1"], ["direction=rx"], ["noDelay"]], "spy+tcp://[::1]:7?noDelay&spy.direction=rx"),
        // An option whose prefix names no layer stays with the inner URL (its scheme then refuses it).
        ("spy+tcp://h:1?other.x=1", ["spy", "tcp"], [[], ["other.x=1"]], "tcp://h:1?other.x=1"),
    ] as [(String, [String], [[String]], String)])
    func wrapped(_ text: String, layers: [String], options: [[String]], inner: String) throws {
        var url: TransportURL? = try TransportURL(text)
        for (scheme, query) in zip(layers, options) {
            let layer = try #require(url)
            #expect(layer.scheme == scheme)
            #expect(layer.query.map { $0.value.isEmpty ? $0.name : "\($0.name)=\($0.value)" } == query)
            url = layer.inner
        }
        #expect(url == nil, "no more layers than written")
        let parsed = try TransportURL(text)
        #expect(parsed.inner?.description == inner)
        #expect(try TransportURL(parsed.description) == parsed, "the description parses back to the same URL")
    }

    @Test("usb://VID:PID reads hexadecimal ids, not host and port", arguments: [
        ("usb://1546:01a7", UInt16(0x1546), UInt16(0x01a7), ""),
        ("usb://0403:6001", UInt16(0x0403), UInt16(0x6001), ""),
        ("usb://0403:6001/A50285BI", UInt16(0x0403), UInt16(0x6001), "/A50285BI"),
        ("usb://ABCD:ef01?interface=1", UInt16(0xABCD), UInt16(0xEF01), ""),
    ])
    func usbDevice(_ text: String, vendor: UInt16, product: UInt16, path: String) throws {
        let url = try TransportURL(text)
        let id = try #require(url.usbDeviceID)
        #expect(id.vendor == vendor)
        #expect(id.product == product)
        #expect(url.path == path)
        #expect(url.description.lowercased() == text.lowercased())
    }

    @Test func aPercentEncodedColonInAHostRoundTrips() throws {
        let url = try TransportURL("tcp://x%3Ay:1")
        #expect(url.host == "x:y")
        #expect(url.description == "tcp://x%3Ay:1")
        #expect(try TransportURL(url.description) == url)
        #expect(try TransportURL("tcp://[fe80::1%eth0]:80").description == "tcp://[fe80::1%25eth0]:80", "RFC 6874's spelling")
        // RFC 6874: the zone's '%' is "%25" in a URI, and the zone itself may be percent-encoded.
        #expect(try TransportURL("tcp://[fe80::1%25eth0]:80").host == "fe80::1%eth0")
        #expect(try TransportURL("tcp://[fe80::1%25en%201]:80").host == "fe80::1%en 1")
        #expect(try TransportURL("tcp://[fe80::1%25en%201]:80").description == "tcp://[fe80::1%25en%201]:80")
        #expect(TransportURL(scheme: "tcp", host: "fe80::1%eth0", port: 80).description == "tcp://[fe80::1%25eth0]:80")
        // "%25" alone is the bare zone "25" (an interface index), which RFC 6874 writes "%2525".
        #expect(try TransportURL("tcp://[fe80::1%25]:80").host == "fe80::1%25")
        #expect(try TransportURL(TransportURL("tcp://[fe80::1%25]:80").description).host == "fe80::1%25")
        for bad in ["tcp://[fe80::1%]:80", "tcp://[fe80::1%25%]:80", "tcp://[fe80::1%25a%25b]:80"] {
            #expect(throws: TransportError.self, "\(bad)") { try TransportURL(bad) }
        }
    }

    @Test func hostPortIsNotAUSBDevice() throws {
        #expect(try TransportURL("usb://+123:0001").usbDeviceID == nil, "four hex digits, no sign")
        #expect(try TransportURL("usb://0123:-001").usbDeviceID == nil)
        #expect(try TransportURL("tcp://host:4000").usbDeviceID == nil)
        #expect(try TransportURL("usb://403:6001").usbDeviceID == nil, "four digits each")
        #expect(try TransportURL("tcp://127.0.0.1:80").port == 80)
        #expect(try TransportURL("usb://1546:01a7").port == nil, "01a7 is no decimal port")
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
        ("tcp://::1:4000", "brackets"),
        ("tcp://[::1:4000", "no ']' closes"),
        ("tcp://[::1]4000", "expected ':PORT'"),
        ("tcp://[zz]:1", "not an IPv6 address"),
        ("rfcomm://00:0a:3a:22:68:73:3:4", "has 7 colons: an authority is HOST:PORT"),
        ("tcp://host:1#frag", "fragments"),
        ("tcp://host:1?a=1&A=2", "given twice"),
        ("tcp://host:1?=1", "has no name"),
        ("unix:///tmp/%zz", "two hex digits"),
        ("unix:///tmp/%ff", "not valid UTF-8"),
        // User information has no meaning here; it is refused, not silently dropped.
        ("tcp://admin@host:22", "user information"),
        ("tcp://user:secret@host:22", "user information"),
        // Control characters, raw or percent-encoded, in any part.
        ("tcp://127.0.0.1%00.evil:4000", "control character"),
        ("unix:///tmp/a%0Ab", "control character"),
        ("tty:///dev/ttyUSB0?baud=%09", "control character"),
        ("tty:///dev/ttyUSB0?%1Fx=1", "control character"),
        ("tcp://host:1?x=a%7Fb", "control character"),
        ("tcp://host\u{0}:1", "control character"),
        ("loop://?a=\n", "control character"),
        // Wrapper layers need scheme names on both sides of '+'.
        ("+tcp://host:1", "must start with a letter"),
        ("spy+://host:1", "must start with a letter"),
        ("spy++tcp://host:1", "must start with a letter"),
        ("spy+spy+tcp://host:1", "the wrapper 'spy' is given twice"),
        ("a.b+tcp://host:1?a.b.x=1", "has a '.' in its name"),
    ])
    func rejects(_ text: String, reason: String) {
        // (Decimal ports are the scheme's business: see the registry's table in RegistryTests.)
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

@Suite("URL parsing cost")
struct URLParsingCostTests {
    /// 12,000 options took 2 s when duplicates were found by comparing every pair, so 50,000 would
    /// take about 35 s in release and minutes in a debug build. Linear parsing takes a fraction of
    /// a second. No clock is asserted (timed tests flake on a loaded machine): a quadratic return
    /// shows as this test stalling the suite, and `transportkit-bench parse` prints the figures.
    @Test func identityURLsFromParts() throws {
        #expect(TransportURL.percentEncoded("AB/12 ü") == "AB%2F12%20%C3%BC")
        #expect(TransportURL.percentEncoded("/tmp/a b", keeping: "/") == "/tmp/a%20b")
        let usb = TransportURL(scheme: "usb", host: "1d50", portText: "6089", segments: ["AB/12 ü"])
        #expect(usb.description == "usb://1d50:6089/AB%2F12%20%C3%BC")
        #expect(usb.pathSegments == ["", "AB/12 ü"])
        #expect(try TransportURL(usb.description) == usb)
        let hub = TransportURL(scheme: "usb", host: "05e3", portText: "0608", segments: [], query: [("location", "1-1")])
        #expect(hub.description == "usb://05e3:0608?location=1-1")
        #expect(hub.usbDeviceID?.product == 0x0608)
        #expect(TransportURL(scheme: "tty", host: "usb", path: "/0403:6001", query: [("serial", "A5"), ("interface", "0")]).description
                == "tty://usb/0403:6001?serial=A5&interface=0")
    }

    @Test func manyOptionsParseInLinearTime() throws {
        let count = 50_000
        let query = (0..<count).map { "o\($0)=\($0)" }.joined(separator: "&")
        let url = try TransportURL("loop://?" + query)
        #expect(url.query.count == count)
        #expect(url.query.first?.name == "o0" && url.query.last?.value == "\(count - 1)")
        // The registry's validation is linear too: it refuses the first unknown option at once.
        let error = #expect(throws: TransportError.self) { try Transport.registry.resolve(url) }
        #expect(error?.message.contains("unknown option 'o0'") == true)
    }
}
