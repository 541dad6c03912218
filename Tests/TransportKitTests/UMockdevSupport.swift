import Foundation
import Glibc

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

    private struct Library: @unchecked Sendable {
        // @unchecked: C function pointers resolved once and never mutated.
        let new: NewFn
        let addFromString: AddFromStringFn
        let uevent: UeventFn
        let remove: RemoveFn
        let unref: UnrefFn
        let inMock: InMockFn
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
              let inMock = symbol(umockdev, "umockdev_in_mock_environment", as: InMockFn.self) else { return nil }
        return Library(new: new, addFromString: add, uevent: uevent, remove: remove, unref: unref, inMock: inMock)
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

    /// Removes a device (and its children) from the fake sysfs.
    func remove(_ sysPath: String) {
        Self.library?.remove(pointer, sysPath)
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
