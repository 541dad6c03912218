import Foundation
import Glibc
import Testing
@testable import TransportKit
@testable import TransportKitSerial
import TransportKitUdev
@_spi(Plugins) import TransportKitCore

/// Discovery and hot-plug against fake devices. These suites need `umockdev-wrapper`
/// (Scripts/test runs them that way: `umockdev-wrapper swift test --filter UMockdev`); in a plain
/// run they are skipped and say so.
@Suite("udev discovery with umockdev", .serialized, .enabled(if: UMockdevTestbed.available, "needs umockdev-wrapper (Scripts/test runs this suite under it)"))
struct UMockdevDiscoveryTests {
    @Test("FTDI, CP210x, CH340 and a two-interface CDC-ACM board are listed with their identity")
    func realisticAdapters() throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeSerial.ftdi().record)
        try testbed.add(FakeSerial.cp210x().record)
        try testbed.add(FakeSerial.ch340().record)
        try testbed.add(FakeSerial.cdcACM().record)
        let devices = try SerialDiscovery.list(includeAll: false)
        #expect(devices.map(\.devnode) == ["/dev/ttyACM0", "/dev/ttyUSB0", "/dev/ttyUSB1", "/dev/ttyUSB2"])

        let ftdi = try #require(devices.first { $0.devnode == "/dev/ttyUSB0" })
        #expect(ftdi.vendorId == "0403" && ftdi.productId == "6001")
        #expect(ftdi.serialNumber == "A50285BI")
        #expect(ftdi.manufacturer == "FTDI" && ftdi.product == "FT232R USB UART")
        #expect(ftdi.driver == "ftdi_sio")
        #expect(ftdi.interface == 0)
        #expect(ftdi.location == "1-1")
        #expect(ftdi.links == ["/dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0"])
        #expect(ftdi.sysPath?.hasSuffix("/tty/ttyUSB0") == true)
        #expect(ftdi.url == "tty://usb/0403:6001?serial=A50285BI")

        let cp210x = try #require(devices.first { $0.devnode == "/dev/ttyUSB1" })
        #expect(cp210x.driver == "cp210x" && cp210x.vendorId == "10c4" && cp210x.productId == "ea60")

        // No serial number: identity by bus location.
        let ch340 = try #require(devices.first { $0.devnode == "/dev/ttyUSB2" })
        #expect(ch340.serialNumber == nil)
        #expect(ch340.url == "tty://usb/1a86:7523?location=1-3")

        // Two interfaces: the interface number is part of the identity.
        let acm = try #require(devices.first { $0.devnode == "/dev/ttyACM0" })
        #expect(acm.driver == "cdc_acm" && acm.interface == 0)
        #expect(acm.url == "tty://usb/2341:0043?serial=75735323&interface=0")
    }

    @Test("the sysfs listing reads what libudev's own enumeration reads")
    func sysfsMatchesLibudev() throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeSerial.ftdi().record)
        try testbed.add(FakeSerial.cdcACM().record)
        try testbed.add(FakeSerial.ch340().record)
        try expectSameListing()
    }

    @Test("identity resolution: one match, several matches (listed), none")
    func resolution() async throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeSerial.ftdi(port: "1", serial: "AAAA", tty: "ttyUSB0").record)
        try testbed.add(FakeSerial.ftdi(port: "2", serial: "BBBB", tty: "ttyUSB1").record)
        let devices = try TTYDeviceInfo.all()

        let one = try SerialDiscovery.choose(USBSelector(vendorId: "0403", productId: "6001", serialNumber: "BBBB"), among: devices)
        #expect(one?.devnode == "/dev/ttyUSB1")
        let byLocation = try SerialDiscovery.choose(USBSelector(vendorId: "0403", productId: "6001", location: "1-1"), among: devices)
        #expect(byLocation?.devnode == "/dev/ttyUSB0")

        do {
            _ = try SerialDiscovery.choose(USBSelector(vendorId: "0403", productId: "6001"), among: devices)
            Issue.record("two adapters match; expected an error listing them")
        } catch let error as TransportError {
            #expect(error.kind == .invalidURL)
            #expect(error.message.contains("/dev/ttyUSB0") && error.message.contains("/dev/ttyUSB1"))
            #expect(error.message.contains("serial AAAA") && error.message.contains("serial BBBB"))
            #expect(error.message.contains("?serial="))
        }
        #expect(try SerialDiscovery.choose(USBSelector(vendorId: "0403", productId: "6015"), among: devices) == nil)

        // The serial number's two spellings, ?serial= and the path segment, select the same adapter;
        // the same value in both is one serial number, two different ones are refused.
        func selector(_ url: String) throws -> USBSelector {
            try SerialDiscovery.selector(Transport.registry.resolve(url))
        }
        let byOption = try SerialDiscovery.choose(selector("tty://usb/0403:6001?serial=BBBB"), among: devices)
        let byPath = try SerialDiscovery.choose(selector("tty://usb/0403:6001/BBBB"), among: devices)
        #expect(byOption?.devnode == "/dev/ttyUSB1" && byPath?.devnode == "/dev/ttyUSB1")
        #expect(try selector("tty://usb/0403:6001/BBBB?serial=BBBB") == selector("tty://usb/0403:6001?serial=BBBB"))
        let conflict = #expect(throws: TransportError.self) { try selector("tty://usb/0403:6001/AAAA?serial=BBBB") }
        #expect(conflict?.kind == .invalidURL)
        #expect(conflict?.message.contains("gives two serial numbers") == true, "\(String(describing: conflict))")

        // Through the registry: the URL form and its errors.
        let none = await expectTransportError(.notFound) { try await Transport.connect(to: "tty://usb/0403:6015") }
        #expect(none?.message.contains("wait=true") == true)
        // ?wait=true gives up a little before the connect's timeout and says what did not arrive.
        let started = ContinuousClock.now
        let late = await expectTransportError(.timedOut) { try await Transport.connect(to: "tty://usb/0403:6015?wait=true&timeout=2") }
        #expect(late?.message.contains("no serial port matching USB 0403:6015 was plugged in within the 2 s timeout: ") == true, "\(String(describing: late))")
        #expect(ContinuousClock.now - started < .seconds(2), "the search gave up before the registry's deadline")
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tty://usb/0403:6001") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tty://usb/FTDI") }
    }

    @Test("devices without hardware are left out unless --all")
    func virtualPortsHidden() throws {
        let testbed = try UMockdevTestbed()
        try testbed.add("""
            P: /sys/devices/virtual/tty/ptmx
            N: ptmx
            E: DEVNAME=/dev/ptmx
            E: SUBSYSTEM=tty

            """)
        try testbed.add("""
            P: /sys/devices/platform/serial8250/tty/ttyS3
            N: ttyS3
            E: DEVNAME=/dev/ttyS3
            E: SUBSYSTEM=tty
            A: type=0

            P: /sys/devices/platform/serial8250
            E: DRIVER=serial8250
            E: SUBSYSTEM=platform
            L: driver=../../../bus/platform/drivers/serial8250

            """)
        try testbed.add(FakeSerial.ftdi().record)
        #expect(try SerialDiscovery.list(includeAll: false).map(\.devnode) == ["/dev/ttyUSB0"])
        let all = try SerialDiscovery.list(includeAll: true).compactMap(\.devnode)
        #expect(Set(all) == ["/dev/ptmx", "/dev/ttyS3", "/dev/ttyUSB0"])
    }

    @Test("hot-plug: add and remove arrive once each, with the same record; duplicates dropped")
    func hotPlug() async throws {
        let testbed = try UMockdevTestbed()
        let present = FakeSerial.cp210x()
        try testbed.add(present.record)
        let monitor = try SerialDiscovery.monitor(include: { $0.isReal })
        // An "add" for a device that was already enumerated is a duplicate.
        testbed.uevent(present.ttySysPath, "add")
        let arriving = FakeSerial.ftdi()
        try testbed.add(arriving.record)
        testbed.uevent(arriving.ttySysPath, "add")
        let (firstAction, firstDevice) = try await next(monitor)
        #expect(firstAction == .added)
        #expect(firstDevice.devnode == "/dev/ttyUSB0" && firstDevice.serialNumber == "A50285BI")

        testbed.uevent(arriving.ttySysPath, "remove")
        testbed.remove(arriving.ttySysPath)
        // A second "remove" for the same device is a duplicate too.
        testbed.uevent(arriving.ttySysPath, "remove")
        let (secondAction, secondDevice) = try await next(monitor)
        #expect(secondAction == .removed)
        // The removal carries what was known while the device was there.
        #expect(secondDevice.vendorId == "0403" && secondDevice.serialNumber == "A50285BI")

        testbed.uevent(present.ttySysPath, "change")
        let (thirdAction, thirdDevice) = try await next(monitor)
        #expect(thirdAction == .changed && thirdDevice.devnode == "/dev/ttyUSB1")
    }

    @Test("a resync (what ENOBUFS triggers) reports exactly what changed while events were lost")
    func resyncReportsTheDifference() async throws {
        let testbed = try UMockdevTestbed()
        let leaving = FakeSerial.cp210x()
        try testbed.add(leaving.record)
        try testbed.add(FakeSerial.ch340().record)
        let monitor = try SerialDiscovery.monitor(include: { $0.isReal })
        // Changes whose uevents are "lost": no event is sent for them.
        testbed.remove(leaving.ttySysPath)
        try testbed.add(FakeSerial.ftdi().record)
        try monitor.resync()
        #expect(monitor.resyncCount == 1)
        var seen: [String] = []
        for _ in 0..<2 {
            let (action, device) = try await next(monitor)
            seen.append("\(action.rawValue) \(device.devnode ?? "?")")
        }
        #expect(seen.sorted() == ["added /dev/ttyUSB0", "removed /dev/ttyUSB1"])
        #expect(Set(monitor.knownDevices.compactMap(\.devnode)) == ["/dev/ttyUSB0", "/dev/ttyUSB2"])
    }

    @Test("a resync after events reports nothing for devices that did not change")
    func resyncAfterEventsIsQuiet() async throws {
        let testbed = try UMockdevTestbed()
        let monitor = try SerialDiscovery.monitor(include: { $0.isReal })
        let arriving = FakeSerial.ftdi()
        try testbed.add(arriving.record)
        testbed.uevent(arriving.ttySysPath, "add")
        #expect(try await next(monitor).0 == .added)
        // The record an event produced must equal what a listing reads, or every device that
        // arrived by event would be reported "changed" after an overflow.
        try monitor.resync()
        let other = FakeSerial.ch340()
        try testbed.add(other.record)
        testbed.uevent(other.ttySysPath, "add")
        let (action, device) = try await next(monitor)
        #expect(action == .added && device.devnode == "/dev/ttyUSB2")
    }

    @Test("the registry's event stream and tty://…?wait=true see an arrival")
    func waitForArrival() async throws {
        let testbed = try UMockdevTestbed()
        let events = await Transport.registry.deviceEvents()
        let adapter = FakeSerial.ch340()
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        // The fake node /dev/ttyUSB2 cannot be opened (umockdev has no tty emulation here), so the
        // wait is observed through resolution: the waiting connect fails *after* the arrival with
        // an open error for the node it found, not with "no serial port matches".
        let connect = Task { try await Transport.connect(to: "tty://usb/1a86:7523?wait=true&timeout=10") }
        try await Task.sleep(for: .milliseconds(300))
        try testbed.add(adapter.record)
        testbed.uevent(adapter.ttySysPath, "add")
        var iterator = events.makeAsyncIterator()
        let event = try await iterator.next()
        #expect(event?.action == .added && event?.device.devnode == "/dev/ttyUSB2")
        // umockdev also sends "add" by itself as it builds the devices, child first, so the tty's
        // can come before its USB parent exists: then a "changed" with the identity follows (the
        // kernel adds parents first, so this order is the testbed's).
        var latest = event
        if latest?.device.url != "tty://usb/1a86:7523?location=1-3" {
            latest = try await iterator.next()
            #expect(latest?.action == .changed, "\(String(describing: latest))")
        }
        #expect(latest?.device.url == "tty://usb/1a86:7523?location=1-3")
        do {
            let connection = try await connect.value
            try await connection.close()
        } catch let error as TransportError {
            #expect(!error.message.contains("no serial port matches"), "\(error)")
            #expect(error.message.contains("/dev/ttyUSB2"), "\(error)")
        }
    }

    @Test("1,000 fake serial ports are listed, each once")
    func thousandDevices() throws {
        let testbed = try UMockdevTestbed()
        var text = ""
        for index in 0..<1000 {
            text += FakeSerial.ftdi(bus: 1 + index / 100, port: String(index % 100 + 1), serial: String(format: "S%05d", index),
                                    tty: "ttyUSB\(index)").record + "\n"
        }
        try testbed.add(text)
        let start = ContinuousClock.now
        let devices = try SerialDiscovery.list(includeAll: false)
        let elapsed = ContinuousClock.now - start
        #expect(devices.count == 1000)
        #expect(Set(devices.compactMap(\.serialNumber)).count == 1000)
        // Natural order: ttyUSB2 before ttyUSB10.
        #expect(devices.map(\.devnode) == (0..<1000).map { "/dev/ttyUSB\($0)" })
        print("listed 1000 fake serial ports in \(elapsed)")  // figure only; BENCHMARKS.md has the benchmark
    }
}

// In the same (serialized) suite: one umockdev testbed per process at a time.
extension UMockdevDiscoveryTests {
    @Test("list --json shows a fake FTDI adapter with every identity field")
    func listJSON() async throws {
        let testbed = try UMockdevTestbed()
        try testbed.add(FakeSerial.ftdi().record)
        let output = await UMockdevTestbed.runCLI(["list", "--json"])
        let objects = try #require(try JSONSerialization.jsonObject(with: output) as? [[String: Any]])
        #expect(objects.count == 1)
        let device = try #require(objects.first)
        #expect(device["url"] as? String == "tty://usb/0403:6001?serial=A50285BI")
        #expect(device["devnode"] as? String == "/dev/ttyUSB0")
        #expect(device["vendorId"] as? String == "0403" && device["productId"] as? String == "6001")
        #expect(device["serialNumber"] as? String == "A50285BI")
        #expect(device["manufacturer"] as? String == "FTDI" && device["product"] as? String == "FT232R USB UART")
        #expect(device["interface"] as? Int == 0 && device["driver"] as? String == "ftdi_sio")
        #expect(device["links"] as? [String] == ["/dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0"])
        #expect(device["location"] as? String == "1-1")
        #expect((device["sysPath"] as? String)?.hasSuffix("/tty/ttyUSB0") == true)
    }
}

/// Compares the fast sysfs listing with libudev's enumeration, field by field.
func expectSameListing(sourceLocation: SourceLocation = #_sourceLocation) throws {
    let fromSysfs = try TTYDeviceInfo.all().sorted { $0.sysPath < $1.sysPath }
    let fromLibudev = try LibudevReference.ttyDevices().sorted { $0.sysPath < $1.sysPath }
    #expect(fromSysfs.map(\.sysPath) == fromLibudev.map(\.sysPath), sourceLocation: sourceLocation)
    for (mine, reference) in zip(fromSysfs, fromLibudev) {
        // libudev may add properties of its own (USEC_INITIALIZED, tags): every property the sysfs
        // listing has must be libudev's, with libudev's value; everything else must be equal.
        var expected = reference
        expected.properties = reference.properties.filter { mine.properties[$0.key] != nil }
        #expect(mine == expected, "\(mine.sysPath)", sourceLocation: sourceLocation)
        #expect(mine.properties.count >= 3, "DEVPATH, SUBSYSTEM and more", sourceLocation: sourceLocation)
    }
}
