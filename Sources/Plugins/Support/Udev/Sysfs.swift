// Sysfs.swift: devices of any subsystem read straight from sysfs (sysfs(5),
// Documentation/ABI/testing/sysfs-class-*, sysfs-bus-usb) plus udev's database files when udevd keeps
// them (/run/udev/data/cMAJOR:MINOR or +SUBSYSTEM:NAME: "S:" lines are links below /dev, "E:" lines
// properties).
//
// Why not libudev's enumeration: it builds a full device object per entry (uevent, database, tags,
// parents); measured on 1,000 fake ports it took ~750 ms where reading the few files a listing needs
// takes a small fraction of that (BENCHMARKS.md). libudev receives the hot-plug events
// (UdevMonitor.swift), whose devices are then read here too, and its enumeration is the reference
// the tests check this listing against.

import Glibc
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// One device as sysfs and udev's database describe it.
public struct SysfsDevice: Sendable, Equatable {
    /// The device's directory, such as `/sys/devices/pci0000:00/…/ttyUSB0`.
    public var sysPath: String
    /// Its name in the subsystem, such as `ttyUSB0`, `1-1.4`, `hci0`.
    public var sysName: String
    /// The subsystem: `tty`, `usb`, `bluetooth`.
    public var subsystem: String
    /// The node below /dev, such as `/dev/ttyUSB0`, when the device has one.
    public var devnode: String?
    /// Links udev made to the node (`/dev/serial/by-id/…`), sorted.
    public var links: [String]
    /// The uevent file's lines plus udev's properties, as libudev reports them (DEVPATH, SUBSYSTEM,
    /// DEVNAME as a path, ID_*).
    public var properties: [String: String]
}

/// Reads devices from sysfs, for any subsystem.
///
/// ```swift
/// for device in try Sysfs.devices(subsystem: "tty") { print(device.sysName, device.devnode ?? "-") }
/// let usb = Sysfs.device(subsystem: "usb", name: "1-1")
/// ```
public enum Sysfs {
    /// Where a subsystem lists its devices: `/sys/bus/NAME/devices` for buses (usb), else
    /// `/sys/class/NAME` (tty, bluetooth).
    public static func directory(of subsystem: String) -> String {
        let bus = "/sys/bus/\(subsystem)/devices"
        return access(bus, F_OK) == 0 ? bus : "/sys/class/\(subsystem)"
    }

    /// The names of a subsystem's devices; none when sysfs has no such directory (a container's
    /// minimal sysfs, an empty test bed).
    public static func names(subsystem: String) throws -> [String] {
        let directory = directory(of: subsystem)
        guard let names = readDirectory(directory) else {
            if errno == ENOENT { return [] }
            throw TransportError.posix("opendir", errno: Syscall.errno, what: directory, hint: "is /sys mounted?")
        }
        return names
    }

    /// The names in a directory (a device's attributes and child directories); none when it cannot
    /// be read (gone meanwhile).
    public static func entries(of directory: String) -> [String] {
        readDirectory(directory) ?? []
    }

    /// The names in `directory` without "." and "..", or nil with errno set.
    private static func readDirectory(_ directory: String) -> [String]? {
        guard let stream = opendir(directory) else { return nil }
        defer { closedir(stream) }
        var names: [String] = []
        while let entry = readdir(stream) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            if name != "." && name != ".." { names.append(name) }
        }
        return names
    }

    /// Every device of `subsystem`.
    public static func devices(subsystem: String) throws -> [SysfsDevice] {
        let database = hasUdevDatabase
        let directory = directory(of: subsystem)
        return try names(subsystem: subsystem).compactMap {
            device(subsystem: subsystem, name: $0, udevDatabase: database, directory: directory)
        }
    }

    /// `true` when udevd keeps its database (it does not in containers, or without udevd).
    public static var hasUdevDatabase: Bool { access("/run/udev/data", F_OK) == 0 }

    /// One device by its name in the subsystem, or nil if it vanished meanwhile. `directory` is
    /// ``directory(of:)`` when the caller already knows it.
    public static func device(subsystem: String, name: String, udevDatabase: Bool = true, directory: String? = nil) -> SysfsDevice? {
        guard let sysPath = resolveLink((directory ?? self.directory(of: subsystem)) + "/" + name) else { return nil }
        var properties = keyValues(readFile(sysPath + "/uevent") ?? "")
        // What libudev adds to the uevent file's lines: the path, the subsystem, DEVNAME as a path.
        properties["DEVPATH"] = String(sysPath.dropFirst("/sys".count))
        properties["SUBSYSTEM"] = subsystem
        if let node = properties["DEVNAME"], !node.hasPrefix("/") { properties["DEVNAME"] = "/dev/" + node }
        var links: [String] = []
        if udevDatabase, let database = readFile("/run/udev/data/" + databaseKey(subsystem: subsystem, name: name, properties: properties)) {
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
        return SysfsDevice(sysPath: sysPath, sysName: name, subsystem: subsystem, devnode: properties["DEVNAME"],
                           links: links.sorted(), properties: properties)
    }

    /// udev's database file name: `c189:3` for a character device, `+bluetooth:hci0` otherwise.
    private static func databaseKey(subsystem: String, name: String, properties: [String: String]) -> String {
        if let major = properties["MAJOR"], let minor = properties["MINOR"] {
            return (subsystem == "block" ? "b" : "c") + "\(major):\(minor)"
        }
        return "+\(subsystem):\(name)"
    }

    /// The nearest ancestor directory that is a device (has a uevent file), as libudev's
    /// udev_device_get_parent finds it.
    public static func parentDevice(of sysPath: String) -> String? {
        var directory = parentDirectory(sysPath)
        while directory.utf8.count > "/sys/devices".utf8.count {
            if access(directory + "/uevent", F_OK) == 0 { return directory }
            directory = parentDirectory(directory)
        }
        return nil
    }

    /// The driver bound to the device in `devicePath` (the last component of its `driver` link).
    public static func driverName(_ devicePath: String) -> String? {
        guard let target = readLink(devicePath + "/driver") else { return nil }
        return target.utf8.lastIndex(of: UInt8(ascii: "/")).map { String(target[target.index(after: $0)...]) } ?? target
    }

    /// An attribute's value without its newline (and without the leading blanks some have).
    public static func attribute(_ directory: String, _ name: String) -> String? {
        readFile(directory + "/" + name).map { text in
            String(text.drop { $0 == " " }.prefix { $0 != "\n" })
        }
    }

    /// `path` without its last component.
    public static func parentDirectory(_ path: String) -> String {
        guard let slash = path.utf8.lastIndex(of: UInt8(ascii: "/")) else { return "" }
        return String(path[..<slash])
    }

    /// A subsystem's entry is a symlink "../../devices/…": one readlink(2) instead of realpath(3)'s
    /// lstat per component (sysfs paths contain no further symlinks).
    public static func resolveLink(_ path: String) -> String? {
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
    public static func readLink(_ path: String) -> String? {
        DeviceNode.readLink(path)
    }

    /// A small file's contents (sysfs attributes are at most a page), or nil. One stack buffer,
    /// no zero-filled heap page per read: a listing reads tens of thousands of these.
    public static func readFile(_ path: String) -> String? {
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
