import Foundation
import Glibc
import Testing
@testable import TransportKit
@testable import TransportKitUdev
@testable import TransportKitUSB
@_spi(Plugins) import TransportKitCore

/// usb:// listing, identity and hot-plug against fake devices (umockdev; Scripts/test runs the
/// `UMockdev…` suites under umockdev-wrapper). Nothing here opens a device: umockdev's nodes are
/// plain files, so the data path is tested in the lab.
@Suite("usb:// discovery with umockdev", .serialized, .enabled(if: UMockdevTestbed.available, "needs umockdev-wrapper (Scripts/test runs this suite under it)"))
struct UMockdevUSBTests {
    static let hubPath = "/sys/devices/pci0000:00/0000:00:14.0/usb1/1-1"

    /// A root hub, a hub at 1-1 with a HackRF behind it at 1-1.2, a HackRF at 1-4 and a debug probe at 1-5.
    static func bench(_ testbed: UMockdevTestbed) throws {
        try testbed.add(FakeUSB.rootHub().record)
        try testbed.add(FakeUSB.hub().record)
        try testbed.add(FakeUSB.hackRF(root: hubPath, name: "1-1.2", devnum: 3, serial: "00000000000000000000000000000002").record)
        try testbed.add(FakeUSB.hackRF().record)
        try testbed.add(FakeUSB.debugProbe().record)
    }

    @Test("a vendor bulk device, a composite device and one behind a hub are listed with identity, speed, class and interfaces")
    func listing() async throws {
        let testbed = try UMockdevTestbed()
        try Self.bench(testbed)
        let devices = try await USBPlugin().devices(includeAll: false)
        #expect(devices.map(\.location) == ["1-1.2", "1-4", "1-5"], "hubs only with --all, in port order: \(devices.map(\.location))")

        let hackRF = try #require(devices.first { $0.location == "1-4" })
        #expect(hackRF.scheme == "usb")
        #expect(hackRF.url == "usb://1d50:6089?serial=0000000000000000a06063c8234e925f", "the canonical spelling: ?serial=")
        #expect(hackRF.devnode == "/dev/bus/usb/001/005")
        #expect(hackRF.vendorId == "1d50" && hackRF.productId == "6089")
        #expect(hackRF.manufacturer == "Great Scott Gadgets" && hackRF.product == "HackRF One")
        #expect(hackRF.properties["speed"] == "high (480 Mbit/s)")
        #expect(hackRF.properties["class"] == "00")
        #expect(hackRF.properties["interface.0"] == "ff/ff/ff, bulk out 0x02 512, bulk in 0x81 512, driver -")
        #expect(hackRF.driver == nil)

        let probe = try #require(devices.first { $0.location == "1-5" })
        #expect(probe.properties["class"] == "ef")
        #expect(probe.properties["speed"] == "full (12 Mbit/s)")
        #expect(probe.properties["interface.0"] == "ff/00/00, bulk out 0x04 64, bulk in 0x85 64, driver -")
        #expect(probe.properties["interface.1"] == "02/02/01, interrupt in 0x83 16, driver cdc_acm")
        #expect(probe.properties["interface.2"] == "0a/00/00, bulk out 0x02 64, bulk in 0x81 64, driver cdc_acm")
        #expect(probe.driver == "cdc_acm")

        let all = try await USBPlugin().devices(includeAll: true)
        #expect(all.map(\.location) == ["usb1", "1-1", "1-1.2", "1-4", "1-5"], "\(all.map(\.location))")
        let hub = try #require(all.first { $0.location == "1-1" })
        #expect(hub.url == "usb://05e3:0608?location=1-1", "no serial number: identity by location")
        #expect(hub.properties["interface.0"] == "09/00/00, interrupt in 0x81 1, driver hub")
        #expect(all.first { $0.location == "usb1" }?.properties["interface.0"] == "09/00/00, interrupt in 0x81 4, driver hub",
                "a root hub's interfaces are named N-0:1.N")
    }

    @Test("identity: one match by serial, several (listed with serials and locations), by location, none")
    func identity() async throws {
        let testbed = try UMockdevTestbed()
        try Self.bench(testbed)
        func selector(_ url: String) throws -> USBSelector {
            try USBDiscovery.selector(Transport.registry.resolve(url))
        }
        let one = try await USBDiscovery.resolve(selector("usb://1d50:6089?serial=0000000000000000a06063c8234e925f"), wait: false)
        #expect(one.location == "1-4")
        let byPath = try await USBDiscovery.resolve(selector("usb://1d50:6089/0000000000000000a06063c8234e925f"), wait: false)
        #expect(byPath == one, "the path spelling selects the same device as ?serial=")
        let twice = try await USBDiscovery.resolve(selector("usb://1d50:6089/0000000000000000a06063c8234e925f?serial=0000000000000000a06063c8234e925f"), wait: false)
        #expect(twice == one, "the same serial number in both spellings is one serial number")
        let conflict = #expect(throws: TransportError.self) {
            try selector("usb://1d50:6089/0000000000000000a06063c8234e925f?serial=00000000000000000000000000000002")
        }
        #expect(conflict?.kind == .invalidURL)
        #expect(conflict?.message.contains("gives two serial numbers") == true, "\(String(describing: conflict))")

        do {
            _ = try await USBDiscovery.resolve(selector("usb://1D50:6089"), wait: false)
            Issue.record("two HackRFs match usb://1d50:6089")
        } catch let error as TransportError {
            #expect(error.kind == .invalidURL)
            #expect(error.message.contains("2 USB devices match USB 1d50:6089"), "\(error)")
            #expect(error.message.contains("serial 00000000000000000000000000000002 at 1-1.2"), "\(error)")
            #expect(error.message.contains("serial 0000000000000000a06063c8234e925f at 1-4"), "\(error)")
            #expect(error.message.contains("?location="), "\(error)")
            #expect(error.message.contains("usb://1d50:6089?serial=SERIAL"), "the canonical spelling is suggested: \(error)")
            #expect(error.message.contains("(usb://1d50:6089?serial=00000000000000000000000000000002)"), "\(error)")
        }

        let byLocation = try await USBDiscovery.resolve(selector("usb://1d50:6089?location=1-1.2"), wait: false)
        #expect(byLocation.serialNumber == "00000000000000000000000000000002")

        do {
            _ = try await USBDiscovery.resolve(selector("usb://1d50:6089?serial=NOSUCHSERIAL"), wait: false)
            Issue.record("no device has that serial number")
        } catch let error as TransportError {
            #expect(error.kind == .notFound)
            #expect(error.message.contains("no USB device matches USB 1d50:6089 serial NOSUCHSERIAL"), "\(error)")
            #expect(error.message.contains("wait=true"), "\(error)")
        }

        // ?wait=true gives up a little before the connect's timeout and says what did not arrive.
        let started = ContinuousClock.now
        let late = await expectTransportError(.timedOut) {
            try await Transport.connect(to: "usb://1d50:6089/NOSUCHSERIAL?wait=true&timeout=2")
        }
        #expect(late?.message.contains("no USB device matching USB 1d50:6089 serial NOSUCHSERIAL was plugged in within the 2 s timeout: ") == true, "\(String(describing: late))")
        #expect(late?.message.contains("?timeout=") == true)
        #expect(ContinuousClock.now - started < .seconds(2), "the search gave up before the registry's deadline")
    }

    @Test("a serial number that is not URL-safe round-trips through the identity URL")
    func awkwardSerial() async throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeUSB.hackRF(serial: "AB/12 ü").record)
        let device = try #require(try await USBPlugin().devices(includeAll: false).first)
        #expect(device.url == "usb://1d50:6089?serial=AB/12%20%C3%BC", "a '/' in ?serial= needs no %2F")
        let found = try await USBDiscovery.resolve(USBDiscovery.selector(Transport.registry.resolve(device.url)), wait: false)
        #expect(found.serialNumber == "AB/12 ü")
        let byPath = try await USBDiscovery.resolve(USBDiscovery.selector(Transport.registry.resolve("usb://1d50:6089/AB%2F12%20%C3%BC")), wait: false)
        #expect(byPath == found, "the path spelling, with the '/' written %2F, finds it too")
    }

    @Test("hot-plug: an arrival is reported once the device is configured (its bind), once; a removal once with what was known")
    func hotPlug() async throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeUSB.debugProbe().record)
        let monitor = try USBDiscovery.monitor(includeAll: false)
        // Already listed: its "add" is a duplicate.
        testbed.uevent(FakeUSB.debugProbe().sysPath, "add")
        // The kernel's "add" comes before the configuration is set: not an arrival yet.
        let arriving = FakeUSB.hackRF(configured: false)
        try testbed.add(arriving.record)
        testbed.uevent(arriving.sysPath, "add")
        testbed.setAttribute(arriving.sysPath, "bConfigurationValue", "1")
        testbed.uevent(arriving.sysPath, "bind")
        let (firstAction, firstDevice) = try await next(monitor)
        #expect(firstAction == .added)
        #expect(firstDevice.location == "1-4" && firstDevice.interfaces.count == 1)

        testbed.uevent(arriving.sysPath, "remove")
        testbed.remove(arriving.sysPath)
        testbed.uevent(arriving.sysPath, "remove")
        let (secondAction, secondDevice) = try await next(monitor)
        #expect(secondAction == .removed)
        #expect(secondDevice.serialNumber == "0000000000000000a06063c8234e925f", "the removal carries what was known")

        // A hub is not reported without includeAll.
        let hub = FakeUSB.hub()
        try testbed.add(hub.record)
        testbed.uevent(hub.sysPath, "add")
        let probe = FakeUSB.debugProbe()
        testbed.uevent(probe.sysPath, "change")
        let (thirdAction, thirdDevice) = try await next(monitor)
        #expect(thirdAction == .changed && thirdDevice.location == "1-5", "the hub's add was not reported")
    }

    @Test("the registry's event stream carries USB arrivals, and usb://…?wait=true waits for one")
    func registryEventsAndWait() async throws {
        let testbed = try UMockdevTestbed()
        let events = await Transport.registry.deviceEvents()
        let waiting = Task { try await USBDiscovery.resolve(USBDiscovery.selector(Transport.registry.resolve("usb://1d50:6089?wait=true")), wait: true) }
        try await Task.sleep(for: .milliseconds(300))
        let arriving = FakeUSB.hackRF()
        try testbed.add(arriving.record)
        testbed.uevent(arriving.sysPath, "add")
        var iterator = events.makeAsyncIterator()
        let event = try await iterator.next()
        #expect(event?.action == .added && event?.device.scheme == "usb")
        #expect(event?.device.url == "usb://1d50:6089?serial=0000000000000000a06063c8234e925f")
        let found = try await waiting.value
        #expect(found.location == "1-4")
    }

    @Test("a tty on a USB adapter links to its USB device's identity URL")
    func serialRowsLinkToTheirUSBDevice() async throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeSerial.ftdi().record)
        try testbed.add(FakeSerial.ch340().record)
        let ports = try await SerialPlugin().devices(includeAll: false)
        #expect(ports.first { $0.devnode == "/dev/ttyUSB0" }?.properties["usbDevice"] == "usb://0403:6001?serial=A50285BI")
        #expect(ports.first { $0.devnode == "/dev/ttyUSB2" }?.properties["usbDevice"] == "usb://1a86:7523?location=1-3")
    }

    @Test("transportkit list shows each USB device with its interfaces under it")
    func listText() async throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeUSB.debugProbe().record)
        let text = String(decoding: await UMockdevTestbed.runCLI(["list"]), as: UTF8.self)
        let lines = text.split(separator: "\n").map(String.init)
        guard let row = lines.firstIndex(where: { $0.hasPrefix("/dev/bus/usb/001/006") }) else { Issue.record("no row for the probe: \(text)"); return }
        #expect(lines[row].contains("0d28:0204") && lines[row].contains("cdc_acm") && lines[row].contains("DAPLink CMSIS-DAP"), "\(text)")
        #expect(lines[row].hasSuffix("usb://0d28:0204?serial=0240000034544e45001b00028aa9001e8011000097969900"), "\(text)")
        #expect(Array(lines.dropFirst(row + 1).prefix(3)) == [
            "    interface 0: ff/00/00, bulk out 0x04 64, bulk in 0x85 64, driver -",
            "    interface 1: 02/02/01, interrupt in 0x83 16, driver cdc_acm",
            "    interface 2: 0a/00/00, bulk out 0x02 64, bulk in 0x81 64, driver cdc_acm",
        ], "\(text)")
    }
}
