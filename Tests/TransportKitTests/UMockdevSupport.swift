import Foundation
import Glibc
import TransportKit
import TransportKitUdev

/// A umockdev testbed: fake sysfs devices that libudev (enumeration and monitors) sees as real.
/// Works only in a process started under `umockdev-wrapper` (which preloads the mock); Scripts/test
/// runs the `UMockdev…` suites that way. libumockdev is reached through dlopen so that no C module
/// is needed for tests.
final class UMockdevTestbed: @unchecked Sendable {
    // @unchecked: the testbed is used by one test at a time (the suites are .serialized) and
    // umockdev serialises its own file operations; `pointer` never changes after init.
    private let pointer: OpaquePointer

    private typealias NewFn = @convention(c) () -> OpaquePointer?
    private typealias AddFromStringFn = @convention(c) (OpaquePointer, UnsafePointer<CChar>, UnsafeMutablePointer<OpaquePointer?>?) -> Int32
    private typealias UeventFn = @convention(c) (OpaquePointer, UnsafePointer<CChar>, UnsafePointer<CChar>) -> Void
    private typealias RemoveFn = @convention(c) (OpaquePointer, UnsafePointer<CChar>) -> Void
    private typealias UnrefFn = @convention(c) (OpaquePointer) -> Void
    private typealias InMockFn = @convention(c) () -> Int32
    private typealias SetAttributeFn = @convention(c) (OpaquePointer, UnsafePointer<CChar>, UnsafePointer<CChar>, UnsafePointer<CChar>) -> Void

    private struct Library: @unchecked Sendable {
        // @unchecked: C function pointers resolved once and never mutated.
        let new: NewFn
        let addFromString: AddFromStringFn
        let uevent: UeventFn
        let remove: RemoveFn
        let unref: UnrefFn
        let inMock: InMockFn
        let setAttribute: SetAttributeFn
    }

    private static let library: Library? = {
        guard let umockdev = dlopen("libumockdev.so.0", RTLD_NOW), let gobject = dlopen("libgobject-2.0.so.0", RTLD_NOW) else { return nil }
        func symbol<T>(_ handle: UnsafeMutableRawPointer, _ name: String, as type: T.Type) -> T? {
            dlsym(handle, name).map { unsafeBitCast($0, to: type) }
        }
        guard let new = symbol(umockdev, "umockdev_testbed_new", as: NewFn.self),
              let add = symbol(umockdev, "umockdev_testbed_add_from_string", as: AddFromStringFn.self),
              let uevent = symbol(umockdev, "umockdev_testbed_uevent", as: UeventFn.self),
              let remove = symbol(umockdev, "umockdev_testbed_remove_device", as: RemoveFn.self),
              let unref = symbol(gobject, "g_object_unref", as: UnrefFn.self),
              let inMock = symbol(umockdev, "umockdev_in_mock_environment", as: InMockFn.self),
              let setAttribute = symbol(umockdev, "umockdev_testbed_set_attribute", as: SetAttributeFn.self) else { return nil }
        return Library(new: new, addFromString: add, uevent: uevent, remove: remove, unref: unref, inMock: inMock, setAttribute: setAttribute)
    }()

    /// `true` in a process started under umockdev-wrapper.
    static var available: Bool {
        ProcessInfo.processInfo.environment["LD_PRELOAD"]?.contains("umockdev") == true && library != nil
    }

    init() throws {
        guard let library = Self.library, let pointer = library.new() else {
            throw TestbedError("libumockdev could not be loaded or made no testbed; install umockdev and run under umockdev-wrapper")
        }
        self.pointer = pointer
    }

    deinit {
        // Removes the testbed directory and unsets UMOCKDEV_DIR.
        Self.library?.unref(pointer)
    }

    /// Adds devices described in umockdev-record text (P:/N:/E:/A:/L: lines, child first).
    func add(_ record: String) throws {
        guard let library = Self.library else { throw TestbedError("libumockdev is not loaded") }
        var error: OpaquePointer?
        // The record format names devices without the /sys prefix; sysPaths elsewhere keep it.
        // Every device block starts with P: and blocks are separated by a blank line.
        var lines: [Substring] = []
        for line in record.split(separator: "\n", omittingEmptySubsequences: false) {
            if line.hasPrefix("P: "), let last = lines.last, !last.isEmpty { lines.append("") }
            lines.append(line)
        }
        let text = lines.joined(separator: "\n").replacingOccurrences(of: "P: /sys/devices/", with: "P: /devices/")
        guard library.addFromString(pointer, text, &error) != 0 else {
            // GError { GQuark domain; gint code; gchar *message; }
            let message = error.flatMap { UnsafeRawPointer($0).load(fromByteOffset: 8, as: UnsafePointer<CChar>?.self) }
                .map { String(cString: $0) } ?? "no message"
            throw TestbedError("umockdev rejected a device description: \(message)")
        }
    }

    /// Sends a uevent ("add", "remove", "change") for a device, as the kernel would.
    func uevent(_ sysPath: String, _ action: String) {
        Self.library?.uevent(pointer, sysPath, action)
    }

    /// Sets (or creates) a sysfs attribute of a device.
    func setAttribute(_ sysPath: String, _ name: String, _ value: String) {
        Self.library?.setAttribute(pointer, sysPath, name, value)
    }

    /// Removes a device (and its children) from the fake sysfs.
    func remove(_ sysPath: String) {
        Self.library?.remove(pointer, sysPath)
    }

    /// Runs the `transportkit` tool built beside the tests with `arguments` and returns its standard
    /// output. The child gets LD_PRELOAD and the current testbed's UMOCKDEV_DIR, so it sees the same
    /// devices (read with getenv: ProcessInfo caches the environment from before the testbed existed).
    static func runCLI(_ arguments: [String]) async -> Data {
        let binary = URL(fileURLWithPath: ProcessInfo.processInfo.arguments[0]).deletingLastPathComponent()
            .appendingPathComponent("transportkit").path
        return await Support.offPool {
            let process = Process()
            process.executableURL = URL(fileURLWithPath: binary)
            process.arguments = arguments
            var environment = ProcessInfo.processInfo.environment
            environment["UMOCKDEV_DIR"] = getenv("UMOCKDEV_DIR").map { String(cString: $0) }
            process.environment = environment
            let pipe = Pipe()
            process.standardOutput = pipe
            guard (try? process.run()) != nil else { return Data() }
            let data = pipe.fileHandleForReading.readDataToEndOfFile()
            process.waitUntilExit()
            return data
        }
    }

    struct TestbedError: Error, CustomStringConvertible {
        let description: String
        init(_ description: String) { self.description = description }
    }
}

/// Realistic USB-serial adapters in umockdev-record form (the shapes `umockdev-record` prints for
/// these chips: tty, usb-serial port or interface, USB device; child first).
enum FakeSerial {
    static func usbDeviceBlock(_ path: String, busnum: Int, devnum: Int, vid: String, pid: String, serial: String?, manufacturer: String,
                          product: String, interfaces: Int) -> String {
        var text = """
            P: \(path)
            N: bus/usb/\(String(format: "%03d", busnum))/\(String(format: "%03d", devnum))
            E: DEVTYPE=usb_device
            E: SUBSYSTEM=usb
            E: DRIVER=usb
            A: idVendor=\(vid)
            A: idProduct=\(pid)
            A: manufacturer=\(manufacturer)
            A: product=\(product)
            A: bNumInterfaces=\(String(repeating: " ", count: 1))\(interfaces)
            A: busnum=\(busnum)
            A: devnum=\(devnum)

            """
        if let serial { text = text.replacingOccurrences(of: "A: product=", with: "A: serial=\(serial)\nA: product=") }
        return text
    }

    static func interfaceBlock(_ path: String, number: Int, driver: String) -> String {
        """
        P: \(path)
        E: DEVTYPE=usb_interface
        E: DRIVER=\(driver)
        E: SUBSYSTEM=usb
        A: bInterfaceNumber=\(String(format: "%02x", number))
        L: driver=../../../../../../bus/usb/drivers/\(driver)

        """
    }

    static func ttyBlock(_ path: String, name: String, links: [String] = []) -> String {
        var lines = ["P: \(path)", "N: \(name)", "E: DEVNAME=/dev/\(name)", "E: SUBSYSTEM=tty"]
        if !links.isEmpty { lines.append("E: DEVLINKS=\(links.joined(separator: " "))") }
        return lines.joined(separator: "\n") + "\n\n"
    }

    /// A USB-serial converter (the usb-serial bus): tty → usb-serial port → interface 0 → device.
    private static func usbSerial(bus: Int, port: String, tty: String, driver: String, devnum: Int, vid: String, pid: String,
                                  serial: String?, manufacturer: String, product: String, links: [String] = [],
                                  portAttributes: [String] = []) -> (record: String, ttySysPath: String) {
        let device = "/sys/devices/pci0000:00/0000:00:14.0/usb\(bus)/\(bus)-\(port)"
        let interface = device + "/\(bus)-\(port):1.0"
        let usbSerialPort = interface + "/\(tty)"
        let ttyPath = usbSerialPort + "/tty/\(tty)"
        let portBlock = (["P: \(usbSerialPort)", "E: DRIVER=\(driver)", "E: SUBSYSTEM=usb-serial"] + portAttributes
            + ["L: driver=../../../../../../../bus/usb-serial/drivers/\(driver)"]).joined(separator: "\n") + "\n\n"
        let record = ttyBlock(ttyPath, name: tty, links: links) + portBlock
            + interfaceBlock(interface, number: 0, driver: driver)
            + usbDeviceBlock(device, busnum: bus, devnum: devnum, vid: vid, pid: pid, serial: serial, manufacturer: manufacturer,
                             product: product, interfaces: 1)
        return (record, ttyPath)
    }

    /// An FTDI FT232R (driver ftdi_sio, with its latency timer and a by-id link).
    static func ftdi(bus: Int = 1, port: String = "1", serial: String = "A50285BI", tty: String = "ttyUSB0") -> (record: String, ttySysPath: String) {
        usbSerial(bus: bus, port: port, tty: tty, driver: "ftdi_sio", devnum: 2, vid: "0403", pid: "6001", serial: serial,
                  manufacturer: "FTDI", product: "FT232R USB UART",
                  links: ["/dev/serial/by-id/usb-FTDI_FT232R_USB_UART_\(serial)-if00-port0"], portAttributes: ["A: latency_timer=16"])
    }

    /// A CP2102 (driver cp210x).
    static func cp210x(bus: Int = 1, port: String = "2", serial: String = "0001", tty: String = "ttyUSB1") -> (record: String, ttySysPath: String) {
        usbSerial(bus: bus, port: port, tty: tty, driver: "cp210x", devnum: 3, vid: "10c4", pid: "ea60", serial: serial,
                  manufacturer: "Silicon Labs", product: "CP2102 USB to UART Bridge Controller")
    }

    /// A CH340 (driver ch341): no serial number, so identity falls back to the bus location.
    static func ch340(bus: Int = 1, port: String = "3", tty: String = "ttyUSB2") -> (record: String, ttySysPath: String) {
        usbSerial(bus: bus, port: port, tty: tty, driver: "ch341", devnum: 4, vid: "1a86", pid: "7523", serial: nil,
                  manufacturer: "QinHeng Electronics", product: "USB Serial")
    }

    /// A CDC-ACM board (an Arduino-like microcontroller): two interfaces (control 0 with the
    /// tty, data 1), driver cdc_acm.
    static func cdcACM(bus: Int = 1, port: String = "4", serial: String = "75735323", tty: String = "ttyACM0") -> (record: String, ttySysPath: String) {
        let device = "/sys/devices/pci0000:00/0000:00:14.0/usb\(bus)/\(bus)-\(port)"
        let control = device + "/\(bus)-\(port):1.0"
        let ttyPath = control + "/tty/\(tty)"
        let record = ttyBlock(ttyPath, name: tty)
            + interfaceBlock(control, number: 0, driver: "cdc_acm")
            + usbDeviceBlock(device, busnum: bus, devnum: 5, vid: "2341", pid: "0043", serial: serial, manufacturer: "Arduino (www.arduino.cc)",
                        product: "Arduino Uno", interfaces: 2)
            + "\n" + interfaceBlock(device + "/\(bus)-\(port):1.1", number: 1, driver: "cdc_acm")
        return (record, ttyPath)
    }
}

/// Realistic USB devices in umockdev-record form, for the usb:// listing: the attributes the
/// kernel writes (drivers/usb/core/sysfs.c, endpoint.c) in its formats, child blocks first.
enum FakeUSB {
    struct Endpoint {
        var address: UInt8
        /// 2 bulk, 3 interrupt.
        var type: UInt8
        var packetSize: Int
    }

    struct Interface {
        var number: Int
        var triple: (UInt8, UInt8, UInt8)
        var driver: String?
        var endpoints: [Endpoint]
    }

    static func hex(_ value: UInt8) -> String { String(format: "%02x", value) }

    /// A device and its interfaces; `configured: false` leaves bConfigurationValue empty, as the
    /// kernel's "add" uevent finds it.
    static func device(root: String = "/sys/devices/pci0000:00/0000:00:14.0/usb1", name: String, busnum: Int = 1, devnum: Int,
                       vid: String, pid: String, serial: String?, manufacturer: String?, product: String?, deviceClass: UInt8 = 0,
                       speed: String = "480", interfaces: [Interface], configured: Bool = true, maxchild: Int = 0) -> (record: String, sysPath: String) {
        let path = root + "/" + name
        var blocks: [String] = []
        for interface in interfaces {
            // A root hub usbN names its interfaces N-0:1.0 (drivers/usb/core/message.c).
            let interfaceStem = name.hasPrefix("usb") ? "\(name.dropFirst(3))-0" : name
            let interfacePath = path + "/\(interfaceStem):1.\(interface.number)"
            var lines = ["P: \(interfacePath)", "E: DEVTYPE=usb_interface", "E: SUBSYSTEM=usb",
                         "E: INTERFACE=\(interface.triple.0)/\(interface.triple.1)/\(interface.triple.2)",
                         "A: bInterfaceNumber=\(hex(UInt8(interface.number)))", "A: bAlternateSetting= 0",
                         "A: bInterfaceClass=\(hex(interface.triple.0))", "A: bInterfaceSubClass=\(hex(interface.triple.1))",
                         "A: bInterfaceProtocol=\(hex(interface.triple.2))", "A: bNumEndpoints=\(hex(UInt8(interface.endpoints.count)))"]
            for endpoint in interface.endpoints {
                let directory = "ep_\(hex(endpoint.address))"
                lines += ["A: \(directory)/bEndpointAddress=\(hex(endpoint.address))", "A: \(directory)/bmAttributes=\(hex(endpoint.type))",
                          "A: \(directory)/wMaxPacketSize=\(String(format: "%04x", endpoint.packetSize))",
                          "A: \(directory)/type=\(endpoint.type == 2 ? "Bulk" : "Interrupt")",
                          "A: \(directory)/direction=\(endpoint.address & 0x80 != 0 ? "in" : "out")"]
            }
            if let driver = interface.driver {
                lines += ["E: DRIVER=\(driver)", "L: driver=../../../../../../bus/usb/drivers/\(driver)"]
            }
            blocks.append(lines.joined(separator: "\n") + "\n\n")
        }
        var lines = ["P: \(path)", "N: bus/usb/\(String(format: "%03d", busnum))/\(String(format: "%03d", devnum))",
                     "E: DEVTYPE=usb_device", "E: SUBSYSTEM=usb", "E: DRIVER=usb", "E: BUSNUM=\(String(format: "%03d", busnum))",
                     "E: DEVNUM=\(String(format: "%03d", devnum))", "E: PRODUCT=\(vid)/\(pid)/100",
                     "A: idVendor=\(vid)", "A: idProduct=\(pid)", "A: bDeviceClass=\(hex(deviceClass))",
                     "A: bNumInterfaces=\(String(format: "%2d", interfaces.count))", "A: bConfigurationValue=\(configured ? "1" : "")",
                     "A: busnum=\(busnum)", "A: devnum=\(devnum)", "A: speed=\(speed)", "A: maxchild=\(maxchild)",
                     "L: driver=../../../../../bus/usb/drivers/usb"]
        if let manufacturer { lines.append("A: manufacturer=\(manufacturer)") }
        if let product { lines.append("A: product=\(product)") }
        if let serial { lines.append("A: serial=\(serial)") }
        blocks.append(lines.joined(separator: "\n") + "\n\n")
        return (blocks.joined(), path)
    }

    /// A HackRF One: a vendor bulk device, one interface with bulk IN 0x81 and OUT 0x02 of 512 bytes.
    static func hackRF(root: String = "/sys/devices/pci0000:00/0000:00:14.0/usb1", name: String = "1-4", devnum: Int = 5,
                       serial: String? = "0000000000000000a06063c8234e925f", configured: Bool = true) -> (record: String, sysPath: String) {
        device(root: root, name: name, devnum: devnum, vid: "1d50", pid: "6089", serial: serial, manufacturer: "Great Scott Gadgets",
               product: "HackRF One", interfaces: [Interface(number: 0, triple: (0xff, 0xff, 0xff), driver: nil,
                                                             endpoints: [Endpoint(address: 0x81, type: 2, packetSize: 512),
                                                                         Endpoint(address: 0x02, type: 2, packetSize: 512)])],
               configured: configured)
    }

    /// A composite debug probe (DAPLink: bDeviceClass ef): a vendor interface with bulk endpoints,
    /// and CDC-ACM control (interrupt IN) and data (bulk) interfaces bound to cdc_acm.
    static func debugProbe(name: String = "1-5", devnum: Int = 6) -> (record: String, sysPath: String) {
        device(name: name, devnum: devnum, vid: "0d28", pid: "0204", serial: "0240000034544e45001b00028aa9001e8011000097969900",
               manufacturer: "ARM", product: "DAPLink CMSIS-DAP", deviceClass: 0xef, speed: "12",
               interfaces: [Interface(number: 0, triple: (0xff, 0x00, 0x00), driver: nil,
                                      endpoints: [Endpoint(address: 0x04, type: 2, packetSize: 64), Endpoint(address: 0x85, type: 2, packetSize: 64)]),
                            Interface(number: 1, triple: (0x02, 0x02, 0x01), driver: "cdc_acm",
                                      endpoints: [Endpoint(address: 0x83, type: 3, packetSize: 16)]),
                            Interface(number: 2, triple: (0x0a, 0x00, 0x00), driver: "cdc_acm",
                                      endpoints: [Endpoint(address: 0x02, type: 2, packetSize: 64), Endpoint(address: 0x81, type: 2, packetSize: 64)])])
    }

    /// A four-port hub (05e3:0608) at 1-1, bound to the hub driver.
    static func hub(name: String = "1-1", devnum: Int = 2) -> (record: String, sysPath: String) {
        device(name: name, devnum: devnum, vid: "05e3", pid: "0608", serial: nil, manufacturer: nil, product: "USB2.0 Hub", deviceClass: 9,
               interfaces: [Interface(number: 0, triple: (0x09, 0x00, 0x00), driver: "hub",
                                      endpoints: [Endpoint(address: 0x81, type: 3, packetSize: 1)])], maxchild: 4)
    }

    /// The root hub usb1 (1d6b:0002), bound to the hub driver.
    static func rootHub() -> (record: String, sysPath: String) {
        device(root: "/sys/devices/pci0000:00/0000:00:14.0", name: "usb1", devnum: 1, vid: "1d6b", pid: "0002", serial: "0000:00:14.0",
               manufacturer: "Linux 6.1.0 xhci-hcd", product: "xHCI Host Controller", deviceClass: 9,
               interfaces: [Interface(number: 0, triple: (0x09, 0x00, 0x00), driver: "hub",
                                      endpoints: [Endpoint(address: 0x81, type: 3, packetSize: 4)])], maxchild: 12)
    }
}

/// The monitor's next event, or a thrown timeout after 5 s (so a missing event fails the test
/// instead of hanging it).
func next<Record: SysfsRecord>(_ monitor: UdevMonitor<Record>) async throws -> (UdevMonitor<Record>.Action, Record) {
    try await withThrowingTaskGroup(of: (UdevMonitor<Record>.Action, Record)?.self) { group in
        group.addTask { try await monitor.next() }
        group.addTask {
            try await Task.sleep(for: .seconds(5))
            return nil
        }
        let first = try await group.next() ?? nil
        group.cancelAll()
        guard let first else { throw TransportError(.timedOut, "no uevent within 5 s") }
        return first
    }
}
