// LibudevReference.swift: tty devices as libudev's own enumeration sees them (libudev(3),
// udev_enumerate_new(3), udev_device_new_from_syspath(3)). The plugin reads sysfs itself
// (TransportKitUdev's Sysfs, several times faster); this is the reference that listing is checked against.

import CUdev
import Foundation
import SystemPackage
@_spi(Plugins) import TransportKitCore
@testable import TransportKitSerial

/// One libudev context per call: libudev objects are not thread-safe.
enum LibudevReference {
    /// Every device of the tty subsystem.
    static func ttyDevices() throws -> [TTYDeviceInfo] {
        guard let udev = udev_new() else {
            throw TransportError(.unsupported, "libudev could not start (udev_new failed); is /sys mounted?", syscall: "udev_new")
        }
        defer { udev_unref(udev) }
        guard let enumerate = udev_enumerate_new(udev) else {
            throw TransportError(.io, "udev_enumerate_new failed", syscall: "udev_enumerate_new")
        }
        defer { udev_enumerate_unref(enumerate) }
        udev_enumerate_add_match_subsystem(enumerate, "tty")
        let scanned = udev_enumerate_scan_devices(enumerate)
        if scanned < 0 {
            throw TransportError(.io, "listing tty devices failed: \(Errno(rawValue: -scanned).symbolicDescription)", errno: Errno(rawValue: -scanned), syscall: "udev_enumerate_scan_devices")
        }
        var result: [TTYDeviceInfo] = []
        var entry = udev_enumerate_get_list_entry(enumerate)
        while let current = entry {
            if let name = udev_list_entry_get_name(current),
               let device = udev_device_new_from_syspath(udev, name) {
                result.append(info(device))
                udev_device_unref(device)
            }
            entry = udev_list_entry_get_next(current)
        }
        return result
    }

    /// Reads everything discovery needs from a tty device handle.
    static func info(_ device: OpaquePointer) -> TTYDeviceInfo {
        let properties = listEntries(udev_device_get_properties_list_entry(device))
        let sysName = string(udev_device_get_sysname(device)) ?? ""
        var info = TTYDeviceInfo(
            sysPath: string(udev_device_get_syspath(device)) ?? "",
            sysName: sysName,
            devnode: string(udev_device_get_devnode(device)) ?? properties["DEVNAME"].map { $0.hasPrefix("/") ? $0 : "/dev/" + $0 },
            isReal: false,
            links: links(device, properties: properties),
            properties: properties
        )
        // The tty's "device" link: absent for virtual terminals, the console and ptmx.
        let parent = udev_device_get_parent(device)
        info.isReal = parent != nil
        if let parent {
            info.driver = driver(from: parent)
            if let type = string(udev_device_get_sysattr_value(device, "type")), type == "0" {
                // A serial-core slot (8250) the kernel reserved with no UART behind it (PORT_UNKNOWN).
                info.isReal = false
            }
        }
        if let interface = udev_device_get_parent_with_subsystem_devtype(device, "usb", "usb_interface") {
            info.interface = string(udev_device_get_sysattr_value(interface, "bInterfaceNumber")).flatMap { Int($0, radix: 16) }
            info.driver = info.driver ?? string(udev_device_get_driver(interface))
        }
        if let usb = udev_device_get_parent_with_subsystem_devtype(device, "usb", "usb_device") {
            info.vendorId = string(udev_device_get_sysattr_value(usb, "idVendor"))?.lowercased()
            info.productId = string(udev_device_get_sysattr_value(usb, "idProduct"))?.lowercased()
            info.serialNumber = string(udev_device_get_sysattr_value(usb, "serial"))
            info.manufacturer = string(udev_device_get_sysattr_value(usb, "manufacturer"))
            info.product = string(udev_device_get_sysattr_value(usb, "product"))
            info.usbInterfaceCount = string(udev_device_get_sysattr_value(usb, "bNumInterfaces"))
                .flatMap { Int($0.trimmingCharacters(in: .whitespaces)) }
            info.location = string(udev_device_get_sysname(usb))
        }
        TTYDeviceInfo.complete(&info)
        return info
    }

    /// The driver of the tty's device or of its first ancestor that has one (usb-serial port,
    /// USB interface, platform UART).
    private static func driver(from device: OpaquePointer) -> String? {
        var current: OpaquePointer? = device
        var depth = 0
        while let node = current, depth < 3 {
            // "port" and "ctrl" are the serial-base bus (Linux 6.5+) between a UART and its tty;
            // the UART's own driver (serial8250, …) is the one a person knows.
            if let driver = string(udev_device_get_driver(node)), driver != "port", driver != "ctrl" { return driver }
            current = udev_device_get_parent(node)
            depth += 1
        }
        return nil
    }

    /// The node's symlinks from the udev database, or from the DEVLINKS property when the database
    /// has no entry but the event carried it.
    private static func links(_ device: OpaquePointer, properties: [String: String]) -> [String] {
        let fromDatabase = listEntries(udev_device_get_devlinks_list_entry(device)).keys
        if !fromDatabase.isEmpty { return fromDatabase.sorted() }
        return (properties["DEVLINKS"] ?? "").split(separator: " ").map(String.init).sorted()
    }

    static func listEntries(_ first: OpaquePointer?) -> [String: String] {
        var result: [String: String] = [:]
        var entry = first
        while let current = entry {
            if let name = string(udev_list_entry_get_name(current)) {
                result[name] = string(udev_list_entry_get_value(current)) ?? ""
            }
            entry = udev_list_entry_get_next(current)
        }
        return result
    }

    static func string(_ pointer: UnsafePointer<CChar>?) -> String? {
        pointer.map { String(cString: $0) }
    }
}
