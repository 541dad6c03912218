import Testing
@testable import TransportKit
@testable import TransportKitSerial
@testable import TransportKitUdev
@testable import TransportKitUSB
@_spi(Plugins) import TransportKitCore

/// The one USB selector behind `usb://VID:PID…` and `tty://usb/VID:PID…`: its two spellings of the
/// serial number, its refusals, its matching and the identity URLs it writes. No device is needed
/// (UMockdev…Tests resolve selectors against fake devices).
@Suite("USB selector: one parse, one match, one canonical spelling")
struct USBSelectorTests {
    static func usb(_ url: String) throws -> USBSelector {
        try USBDiscovery.selector(Transport.registry.resolve(url))
    }

    static func tty(_ url: String) throws -> USBSelector {
        try SerialDiscovery.selector(Transport.registry.resolve(url))
    }

    @Test("?serial= and the path segment give the same selector, in both schemes")
    func twoSpellingsOneSelector() throws {
        let expected = USBSelector(vendorId: "0403", productId: "6001", serialNumber: "A5")
        #expect(try Self.usb("usb://0403:6001?serial=A5") == expected)
        #expect(try Self.usb("usb://0403:6001/A5") == expected)
        #expect(try Self.usb("usb://0403:6001/A5?serial=A5") == expected, "the same value twice is one serial number")
        #expect(try Self.tty("tty://usb/0403:6001?serial=A5") == expected)
        #expect(try Self.tty("tty://usb/0403:6001/A5") == expected, "tty://usb/VID:PID/SERIAL is read too")
        #expect(try Self.tty("tty://usb:115200/0403:6001/A5?serial=A5") == expected)
        #expect(try Self.usb("usb://0403:6001/A%2FB") == Self.usb("usb://0403:6001?serial=A/B"), "a '/' is %2F in the path, itself in ?serial=")
        #expect(try Self.usb("usb://0403:6001?SERIAL=A5&location=1-1.4")
                == USBSelector(vendorId: "0403", productId: "6001", serialNumber: "A5", location: "1-1.4"))
        #expect(try Self.tty("tty://usb/0403:6001?serial=A5&interface=1&location=1-1.4")
                == USBSelector(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 1, location: "1-1.4"))
        #expect(try Self.usb("usb://0403:6001?interface=1").interface == nil, "usb://'s interface= is the one to claim, not the identity")
    }

    @Test("two different serial numbers are refused, naming both and the canonical spelling")
    func conflictingSerials() throws {
        for (url, canonical) in [("usb://0403:6001/A5?serial=B7", "usb://0403:6001?serial=SERIAL"),
                                 ("tty://usb/0403:6001/A5?serial=B7", "tty://usb/0403:6001?serial=SERIAL")] {
            let error = #expect(throws: TransportError.self) { try url.hasPrefix("usb") ? Self.usb(url) : Self.tty(url) }
            #expect(error?.kind == .invalidURL)
            #expect(error?.message.contains("gives two serial numbers, 'A5' after the '/' and serial=B7") == true, "\(String(describing: error))")
            #expect(error?.message.contains(canonical) == true, "\(String(describing: error))")
        }
    }

    @Test("refusals keep their messages, with the scheme's own prefix", arguments: [
        ("usb://0403:6001/", "the serial number after '/' is empty; give it (usb://0403:6001?serial=SERIAL)"),
        ("tty://usb/0403:6001/", "the serial number after '/' is empty; give it (tty://usb/0403:6001?serial=SERIAL)"),
        ("usb://0403:6001/A/B", "'A/B' is not one serial number"),
        ("tty://usb/0403:6001/A/B", "'A/B' is not one serial number"),
        ("usb://0403:6001?serial=", "serial= is empty"),
        ("tty://usb/0403:6001?serial=", "serial= is empty"),
        ("usb://0403:6001?location=", "location= is empty"),
        ("tty://usb/0403:6001?location=", "location= is empty"),
        ("tty://usb/zzzz:0001", "after tty://usb/ comes VENDOR:PRODUCT as two 4-digit hex IDs, such as tty://usb/0403:6001"),
        ("tty://usb/0403", "two 4-digit hex IDs"),
    ])
    func refusals(_ url: String, _ words: String) throws {
        let error = #expect(throws: TransportError.self) { try url.hasPrefix("usb") ? Self.usb(url) : Self.tty(url) }
        #expect(error?.kind == .invalidURL)
        #expect(error?.message.contains(words) == true, "\(String(describing: error))")
        #expect(error?.message.contains("Grammar: ") == true || words.contains("is empty"), "\(String(describing: error))")
    }

    @Test("the VID:PID check names the scheme it reads")
    func badIdPerScheme() {
        let error = #expect(throws: TransportError.self) {
            try USBSelector(.usb, id: "0403:60", segments: [], serial: nil, interface: nil, location: nil, shown: "usb://0403:60", grammar: "usb://VID:PID")
        }
        #expect(error?.message.contains("after usb:// comes VENDOR:PRODUCT as two 4-digit hex IDs, such as usb://0403:6001") == true,
                "\(String(describing: error))")
    }

    @Test("identity URLs use ?serial=, else ?location=; both parse back to the same selector")
    func identityURLs() throws {
        #expect(USBDevices.identityURL(vendorId: "0403", productId: "6001", serialNumber: "A50285BI", location: "1-1")
                == "usb://0403:6001?serial=A50285BI")
        #expect(USBDevices.identityURL(vendorId: "05e3", productId: "0608", serialNumber: nil, location: "1-1") == "usb://05e3:0608?location=1-1")
        #expect(USBDevices.identityURL(vendorId: "05e3", productId: "0608", serialNumber: "", location: "1-1") == "usb://05e3:0608?location=1-1")
        #expect(USBDevices.identityURL(vendorId: "1d50", productId: "6089", serialNumber: "AB/12 ü", location: "1-4")
                == "usb://1d50:6089?serial=AB/12%20%C3%BC", "a '/' needs no %2F in ?serial=")
        #expect(USBDevices.identityURL(vendorId: "1d50", productId: "6089", serialNumber: "A\nB", location: "1-4")
                == "usb://1d50:6089?location=1-4", "a serial no URL can carry gives way to the location")

        let adapter = USBSelector.identity(vendorId: "2341", productId: "0043", serialNumber: "75735323", interface: 0, location: "1-4")
        #expect(adapter == USBSelector(vendorId: "2341", productId: "0043", serialNumber: "75735323", interface: 0))
        #expect(adapter.url(.tty).description == "tty://usb/2341:0043?serial=75735323&interface=0")
        #expect(adapter.url(.usb).description == "usb://2341:0043?serial=75735323&interface=0")
        #expect(try Self.tty(adapter.url(.tty).description) == adapter)

        for serial in ["A50285BI", "AB/12 ü", "a&b=c?d"] {
            let selector = USBSelector.identity(vendorId: "1d50", productId: "6089", serialNumber: serial, location: "1-4")
            #expect(try Self.usb(selector.url(.usb).description) == selector, "\(selector.url(.usb))")
            #expect(try Self.tty(selector.url(.tty).description) == selector, "\(selector.url(.tty))")
        }
    }

    @Test("what messages call a device")
    func descriptions() {
        #expect(USBSelector(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 1, location: "1-1.4").description
                == "USB 0403:6001 serial A5 interface 1 at 1-1.4")
        #expect(USBSelector(vendorId: "0403", productId: "6001").description == "USB 0403:6001")
        #expect(USBSelector(vendorId: "1D50", productId: "6089").vendorId == "1d50", "ids are kept in lower case")
    }

    @Test("a selector matches by ids, then by what it names; a device's interface by number")
    func matching() {
        let byIds = USBSelector(vendorId: "0403", productId: "6001")
        #expect(byIds.matches(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 0, location: "1-1"))
        #expect(!byIds.matches(vendorId: "0403", productId: "6015", serialNumber: "A5", interface: 0, location: "1-1"))
        #expect(!byIds.matches(vendorId: nil, productId: nil, serialNumber: nil, interface: nil, location: nil), "a tty without USB ancestry")
        let named = USBSelector(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 1, location: "1-1")
        #expect(named.matches(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 1, location: "1-1"))
        #expect(!named.matches(vendorId: "0403", productId: "6001", serialNumber: "B7", interface: 1, location: "1-1"))
        #expect(!named.matches(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 0, location: "1-1"))
        #expect(!named.matches(vendorId: "0403", productId: "6001", serialNumber: "A5", interface: 1, location: "1-2"))

        let interface = USBInterfaceInfo(sysPath: "/sys/devices/usb1/1-4/1-4:1.1", number: 1, alternateSetting: 0, interfaceClass: 0xff,
                                         interfaceSubclass: 0, interfaceProtocol: 0, name: nil, driver: nil, endpoints: [])
        let device = USBDeviceInfo(sysPath: "/sys/devices/usb1/1-4", sysName: "1-4", devnode: nil, vendorId: "0403", productId: "6001",
                                   serialNumber: "A5", manufacturer: nil, product: nil, deviceClass: 0, speed: nil, busNumber: 1,
                                   deviceNumber: 2, isConfigured: true, interfaceCount: 1, interfaces: [interface], links: [], properties: [:])
        #expect(USBSelector(vendorId: "0403", productId: "6001", serialNumber: "A5", location: "1-4").matches(device))
        #expect(USBSelector(vendorId: "0403", productId: "6001", interface: 1).matches(device))
        #expect(!USBSelector(vendorId: "0403", productId: "6001", interface: 0).matches(device), "the device has no interface 0")
        #expect(!USBSelector(vendorId: "0403", productId: "6001", location: "1-5").matches(device))
    }
}
