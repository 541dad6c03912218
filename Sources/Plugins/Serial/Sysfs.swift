// Sysfs.swift: listing tty devices straight from sysfs (sysfs(5), Documentation/ABI/testing/
// sysfs-class-tty) plus udev's database files when udevd keeps them (/run/udev/data/cMAJOR:MINOR:
// "S:" lines are links below /dev, "E:" lines properties).
//
// Why not libudev's enumeration: it builds a full device object per entry (uevent, database, tags,
// parents); measured on 1,000 fake ports it took ~750 ms where reading the few files a serial
// listing needs takes a small fraction of that (BENCHMARKS.md). libudev receives the
// hot-plug events (UdevMonitor.swift), whose devices are then read here too, and its enumeration
// is the reference the tests check this listing against.

import Foundation
import Glibc
import TransportKitCore

enum Sysfs {
    static let classDirectory = "/sys/class/tty"

    /// Every device of the tty class, read from sysfs.
    static func ttyDevices() throws -> [TTYDeviceInfo] {
        guard let directory = opendir(classDirectory) else {
            // No tty class at all (a container's minimal sysfs, an empty test bed): no ports.
            if errno == ENOENT { return [] }
            throw TransportError.posix("opendir", errno: errno, what: classDirectory, hint: "is /sys mounted?")
        }
        defer { closedir(directory) }
        var names: [String] = []
        while let entry = readdir(directory) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            if name != "." && name != ".." { names.append(name) }
        }
        let hasDatabase = access("/run/udev/data", F_OK) == 0
        return names.compactMap { device(named: $0, udevDatabase: hasDatabase) }
    }

    /// One tty device by its name in /sys/class/tty, or nil if it vanished meanwhile.
    static func device(named name: String, udevDatabase: Bool = true) -> TTYDeviceInfo? {
        let classPath = classDirectory + "/" + name
        guard let sysPath = resolveClassLink(classPath) else { return nil }
        var properties = keyValues(readFile(sysPath + "/uevent") ?? "")
        // What libudev adds to the uevent file's lines: the path, the subsystem, DEVNAME as a path.
        properties["DEVPATH"] = String(sysPath.dropFirst("/sys".count))
        properties["SUBSYSTEM"] = "tty"
        if let name = properties["DEVNAME"], !name.hasPrefix("/") { properties["DEVNAME"] = "/dev/" + name }
        var links: [String] = []
        if udevDatabase, let major = properties["MAJOR"], let minor = properties["MINOR"],
           let database = readFile("/run/udev/data/c\(major):\(minor)") {
            for line in database.split(separator: "\n") {
                if line.hasPrefix("S:") {
                    links.append("/dev/" + line.dropFirst(2))
                } else if line.hasPrefix("E:"), let equals = line.firstIndex(of: "=") {
                    properties[String(line[line.index(line.startIndex, offsetBy: 2)..<equals])] = String(line[line.index(after: equals)...])
                }
            }
        }
        if links.isEmpty, let devlinks = properties["DEVLINKS"] {
            links = devlinks.split(separator: " ").map(String.init)
        }
        var info = TTYDeviceInfo(
            sysPath: sysPath, sysName: name,
            devnode: properties["DEVNAME"],
            isReal: false, links: links.sorted(), properties: properties
        )
        // The tty's parent device: absent for virtual terminals, the console and ptmx. Below a USB
        // interface it is the directory above ".../tty/NAME" (a usb-serial port or the interface),
        // found without probing; and there is no serial-core `type` attribute to read.
        // Components are slices of sysPath, so a directory is the prefix up to one's end.
        let components = sysPath.split(separator: "/")
        func directory(through index: Int) -> String { String(sysPath[..<components[index].endIndex]) }
        let interfaceIndex = components.lastIndex(where: isUSBInterfaceName)
        let underUSB = interfaceIndex != nil
        let parent = underUSB && components.count > 2 && components[components.count - 2] == "tty"
            ? directory(through: components.count - 3)
            : parentDevice(of: sysPath)
        info.isReal = parent != nil
        if let parent {
            info.driver = driver(from: parent)
            if !underUSB, attribute(sysPath, "type") == "0" {
                // A serial-core slot (8250) the kernel reserved with no UART behind it (PORT_UNKNOWN).
                info.isReal = false
            }
        }
        // USB ancestors, found by the kernel's names for them (drivers/usb/core/usb.c, message.c):
        // a device is "BUS-PORT[.PORT…]" (1-1.4), an interface "BUS-PORT…:CONFIG.INTERFACE" (1-1.4:1.0).
        if let index = interfaceIndex {
            // The name ends in ".bInterfaceNumber" (decimal; usb_set_configuration names interfaces
            // "%d-%s:%d.%d"): no file to read.
            let name = components[index]
            info.interface = name.lastIndex(of: ".").flatMap { Int(name[name.index(after: $0)...]) }
            if info.driver == nil { info.driver = driverName(directory(through: index)) }
        }
        if let index = components.lastIndex(where: isUSBDeviceName) {
            let directory = directory(through: index)
            info.vendorId = attribute(directory, "idVendor")?.lowercased()
            info.productId = attribute(directory, "idProduct")?.lowercased()
            info.serialNumber = attribute(directory, "serial")
            info.manufacturer = attribute(directory, "manufacturer")
            info.product = attribute(directory, "product")
            info.usbInterfaceCount = attribute(directory, "bNumInterfaces").flatMap { Int($0) }
            info.location = String(components[index])
        }
        TTYDeviceInfo.complete(&info)
        return info
    }

    /// The nearest ancestor directory that is a device (has a uevent file), as libudev's
    /// udev_device_get_parent finds it.
    private static func parentDevice(of sysPath: String) -> String? {
        var directory = (sysPath as NSString).deletingLastPathComponent
        while directory.count > "/sys/devices".count {
            if access(directory + "/uevent", F_OK) == 0 { return directory }
            directory = (directory as NSString).deletingLastPathComponent
        }
        return nil
    }

    /// The driver of a device or of its first ancestors ("port"/"ctrl", the serial-base bus of
    /// Linux 6.5+, are skipped for the UART's own driver).
    private static func driver(from device: String) -> String? {
        var current: String? = device
        var depth = 0
        while let path = current, depth < 3 {
            if let name = driverName(path), name != "port", name != "ctrl" { return name }
            current = parentDevice(of: path)
            depth += 1
        }
        return nil
    }

    private static func driverName(_ devicePath: String) -> String? {
        guard let target = readLink(devicePath + "/driver") else { return nil }
        return target.utf8.lastIndex(of: UInt8(ascii: "/")).map { String(target[target.index(after: $0)...]) } ?? target
    }

    private static func attribute(_ directory: String, _ name: String) -> String? {
        readFile(directory + "/" + name).map { text in
            // Attributes end in a newline; bNumInterfaces is also padded with a leading space.
            String(text.drop { $0 == " " }.prefix { $0 != "\n" })
        }
    }

    /// "1-1.4": bus, dash, port path of digits and dots.
    static func isUSBDeviceName(_ name: Substring) -> Bool {
        guard let dash = name.firstIndex(of: "-"), dash > name.startIndex else { return false }
        let ports = name[name.index(after: dash)...]
        return name[..<dash].allSatisfy(\.isNumber) && !ports.isEmpty && ports.allSatisfy { $0.isNumber || $0 == "." }
    }

    /// "1-1.4:1.0": a device name, colon, configuration.interface.
    static func isUSBInterfaceName(_ name: Substring) -> Bool {
        guard let colon = name.firstIndex(of: ":") else { return false }
        let suffix = name[name.index(after: colon)...]
        return isUSBDeviceName(name[..<colon]) && suffix.contains(".") && suffix.allSatisfy { $0.isNumber || $0 == "." }
    }

    /// /sys/class/tty/NAME is a symlink "../../devices/…": one readlink(2) instead of realpath(3)'s
    /// lstat per component (sysfs paths contain no further symlinks).
    private static func resolveClassLink(_ path: String) -> String? {
        guard let target = readLink(path) else { return nil }
        guard !target.hasPrefix("/") else { return target }
        // Resolve against the link's directory: each leading "../" drops one trailing component.
        var base = path.utf8.lastIndex(of: UInt8(ascii: "/")).map { path[..<$0] } ?? ""
        var rest = target[...]
        while true {
            if rest.hasPrefix("../") {
                rest = rest.dropFirst(3)
                base = base.utf8.lastIndex(of: UInt8(ascii: "/")).map { base[..<$0] } ?? ""
            } else if rest.hasPrefix("./") {
                rest = rest.dropFirst(2)
            } else {
                break
            }
        }
        return String(base) + "/" + rest
    }

    /// A symbolic link's target, read into a stack buffer.
    private static func readLink(_ path: String) -> String? {
        withUnsafeTemporaryAllocation(of: CChar.self, capacity: Int(PATH_MAX)) { buffer -> String? in
            guard let base = buffer.baseAddress else { return nil }
            let count = readlink(path, base, buffer.count)
            guard count > 0 else { return nil }
            return String(decoding: UnsafeRawBufferPointer(start: base, count: count), as: UTF8.self)
        }
    }

    /// A small file's contents (sysfs attributes are at most a page), or nil. One stack buffer,
    /// no zero-filled heap page per read: a listing reads tens of thousands of these.
    static func readFile(_ path: String) -> String? {
        let fd = open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else { return nil }
        defer { close(fd) }
        return withUnsafeTemporaryAllocation(byteCount: 4096, alignment: 1) { buffer -> String? in
            guard let base = buffer.baseAddress else { return nil }
            var length = 0
            while length < buffer.count {
                let wanted = buffer.count - length
                let count = read(fd, base + length, wanted)
                if count <= 0 { break }
                length += count
                // A short read of a sysfs attribute or a regular file is its end: no second
                // read(2) to see 0 (a listing reads tens of thousands of files).
                if count < wanted { break }
            }
            return String(decoding: UnsafeRawBufferPointer(start: base, count: length), as: UTF8.self)
        }
    }

    private static func keyValues(_ text: String) -> [String: String] {
        var result: [String: String] = [:]
        for line in text.split(separator: "\n") {
            guard let equals = line.firstIndex(of: "=") else { continue }
            result[String(line[..<equals])] = String(line[line.index(after: equals)...])
        }
        return result
    }
}
