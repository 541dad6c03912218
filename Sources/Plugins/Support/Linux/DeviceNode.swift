// DeviceNode.swift: explaining why a device node (/dev/ttyUSB0, /dev/bus/usb/001/004) cannot be
// used — stat(2), getgroups(2), getpwuid(3)/getgrgid(3) for "permission denied", and /proc/locks
// (proc(5)) with /proc/PID/comm and /proc/PID/fd to name the process holding a lock or a node. Shared by every plugin that
// opens device nodes, so each error tells a person what to do.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// Facts about a device node for error messages.
public enum DeviceNode {
    /// "permission denied opening /dev/ttyUSB0: owned by root:dialout, mode crw-rw----; this process
    /// (uid 1000) is not in group dialout. Fixes: …", ending with `udevRule` as the rule to install.
    ///
    /// Joining the node's group is advised only where it helps: not for group root (a node such
    /// as `crw------- root:root`), nor for a group the mode gives no access. Then the fixes are
    /// running as root, or a udev rule that gives `ruleGroup` access and joining that group.
    ///
    /// ```swift
    /// DeviceNode.permissionMessage(path: "/dev/bus/usb/001/004", ruleGroup: "plugdev") { group in
    ///     #"SUBSYSTEM=="usb", ATTR{idVendor}=="1d6b", ATTR{idProduct}=="0104", MODE="0660", GROUP="\#(group)""#
    /// }
    /// ```
    public static func permissionMessage(path: String, ruleGroup: String = "plugdev", udevRule: (_ group: String) -> String) -> String {
        var message = "permission denied opening \(path)"
        var info = stat()
        guard stat(path, &info) == 0 else { return message + ": check its permissions" }
        let owner = userName(info.st_uid)
        let group = groupName(info.st_gid)
        message += ": owned by \(owner):\(group), mode \(modeString(info.st_mode))"
        let groupAccess = info.st_mode & (S_IRGRP | S_IWGRP) == (S_IRGRP | S_IWGRP)
        guard info.st_gid != 0, groupAccess else {
            // Group root, or a group without read and write: joining it would not help.
            let target = info.st_gid == 0 ? ruleGroup : group
            let users = owner == "root" ? "root" : owner + " and root"
            message += info.st_gid == 0
                ? "; only \(users) may use it (this process is uid \(geteuid()))"
                : "; its group \(group) may not read and write it either (this process is uid \(geteuid()))"
            message += ". Fixes: run the program as root (sudo), or install a udev rule that gives a group access, such as "
                + "\(udevRule(target)) in /etc/udev/rules.d/, then add the user to that group (`sudo usermod -aG \(target) $USER`) and log in again"
            return message
        }
        let member = getegid() == info.st_gid || supplementaryGroups().contains(info.st_gid)
        message += member
            ? "; this process (uid \(geteuid())) is in group \(group), so something else refuses access (an LSM policy, or a group added after login: log in again)"
            : "; this process (uid \(geteuid())) is not in group \(group)"
        message += ". Fixes: add the user to the group (`sudo usermod -aG \(group) $USER`, then log in again), or install a udev rule such as \(udevRule(group)) in /etc/udev/rules.d/"
        return message
    }

    /// A device number's major and minor: glibc's gnu_dev_major and gnu_dev_minor, macros Swift
    /// does not see (major in bits 8–19 and 32–63, minor in 0–7 and 20–63).
    ///
    /// ```swift
    /// var info = stat()
    /// if stat("/dev/ptmx", &info) == 0, DeviceNode.numbers(of: info.st_rdev) == (5, 2) { … }
    /// ```
    public static func numbers(of device: dev_t) -> (major: UInt64, minor: UInt64) {
        let dev = UInt64(device)
        return (((dev >> 8) & 0xfff) | ((dev >> 32) & ~UInt64(0xfff)), (dev & 0xff) | ((dev >> 12) & ~UInt64(0xff)))
    }

    /// "process 1234 (minicom)" when /proc/locks shows who holds a flock(2) on the node.
    public static func lockHolder(path: String) -> String? {
        lockHolderPID(path: path).map(describeProcess)
    }

    /// The process that holds a flock(2) on the node, as /proc/locks shows it; compare it with
    /// `getpid()` to tell a lock of this very process (another descriptor it opened) from another
    /// program's.
    ///
    /// ```swift
    /// if DeviceNode.lockHolderPID(path: "/dev/ttyUSB0") == Int(getpid()) { … }
    /// ```
    public static func lockHolderPID(path: String) -> Int? {
        var info = stat()
        guard stat(path, &info) == 0, let locks = readText("/proc/locks") else { return nil }
        // Lines look like "1: FLOCK  ADVISORY  WRITE 1234 00:05:87 0 EOF" (device as major:minor in hex).
        let (major, minor) = numbers(of: info.st_dev)
        let device = "\(Hex.digits(major)):\(Hex.digits(minor)):\(UInt64(info.st_ino))"
        for line in locks.split(separator: "\n") {
            let fields = line.split(separator: " ", omittingEmptySubsequences: true)
            guard fields.count >= 6, fields[1] == "FLOCK", fields[5] == device, let pid = Int(fields[4]) else { continue }
            return pid
        }
        return nil
    }

    /// Whether this process has a descriptor open on `path` (the same device or file, through any
    /// name), found through /proc/self/fd.
    ///
    /// ```swift
    /// if DeviceNode.isOpenInThisProcess("/dev/ttyUSB0") { print("close the other connection first") }
    /// ```
    public static func isOpenInThisProcess(_ path: String) -> Bool {
        var info = stat()
        guard stat(path, &info) == 0, let fds = opendir("/proc/self/fd") else { return false }
        defer { closedir(fds) }
        while let fd = readdir(fds) {
            let number = withUnsafeBytes(of: fd.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            guard Int(number) != nil, let link = readLink("/proc/self/fd/\(number)"), link.hasPrefix("/") else { continue }
            var target = stat()
            if stat(link, &target) == 0, target.st_dev == info.st_dev, target.st_ino == info.st_ino { return true }
        }
        return false
    }

    /// The processes other than this one with a descriptor open on `path` (found through the
    /// /proc/PID/fd links; processes of other users are invisible without privilege), described as
    /// `"process 1234 (minicom)"`. `nil` when none can be seen.
    ///
    /// ```swift
    /// DeviceNode.openers(of: "/dev/ttyUSB0")   // "process 1234 (minicom)"
    /// ```
    public static func openers(of path: String) -> String? {
        var info = stat()
        guard stat(path, &info) == 0 else { return nil }
        let (device, inode) = (info.st_dev, info.st_ino)
        return describeHolders { link in
            var target = stat()
            return link.hasPrefix("/") && stat(link, &target) == 0 && target.st_dev == device && target.st_ino == inode
        }
    }

    /// The processes other than this one with a descriptor whose /proc/PID/fd link satisfies
    /// `matches` (such as `"socket:[12345]"`), described as `"process 1234 (name)"` and joined
    /// with "and"; `nil` when there is none this process may see.
    public static func describeHolders(matching matches: (String) -> Bool) -> String? {
        guard let proc = opendir("/proc") else { return nil }
        defer { closedir(proc) }
        let me = Int(getpid())
        var holders: [Int] = []
        while let entry = readdir(proc) {
            let name = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            guard let pid = Int(name), pid != me, let fds = opendir("/proc/\(pid)/fd") else { continue }
            defer { closedir(fds) }
            while let fd = readdir(fds) {
                let number = withUnsafeBytes(of: fd.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
                guard Int(number) != nil, let link = readLink("/proc/\(pid)/fd/\(number)"), matches(link) else { continue }
                holders.append(pid)
                break
            }
            if holders.count == 4 { break }
        }
        return holders.isEmpty ? nil : holders.map(describeProcess).joined(separator: " and ")
    }

    /// The target of a symbolic link, or nil.
    public static func readLink(_ path: String) -> String? {
        withUnsafeTemporaryAllocation(of: CChar.self, capacity: Int(PATH_MAX)) { buffer -> String? in
            guard let base = buffer.baseAddress else { return nil }
            let count = readlink(path, base, buffer.count)
            guard count > 0 else { return nil }
            return String(decoding: UnsafeRawBufferPointer(start: base, count: count), as: UTF8.self)
        }
    }

    /// "process 1234 (minicom)", or "process 1234" when its name cannot be read.
    public static func describeProcess(_ pid: Int) -> String {
        let command = readText("/proc/\(pid)/comm").map { String($0.prefix { $0 != "\n" }) }
        return "process \(pid)" + (command.map { " (\($0))" } ?? "")
    }

    /// `crw-rw----`, as ls(1) shows a mode.
    public static func modeString(_ mode: mode_t) -> String {
        let type: Character = switch mode & S_IFMT {
        case S_IFCHR: "c"
        case S_IFDIR: "d"
        case S_IFLNK: "l"
        default: "-"
        }
        let letters: [(mode_t, Character)] = [(S_IRUSR, "r"), (S_IWUSR, "w"), (S_IXUSR, "x"), (S_IRGRP, "r"), (S_IWGRP, "w"),
                                              (S_IXGRP, "x"), (S_IROTH, "r"), (S_IWOTH, "w"), (S_IXOTH, "x")]
        return String(type) + String(letters.map { mode & $0.0 != 0 ? $0.1 : "-" })
    }

    /// A text file's contents (a /proc file, up to `limit` bytes), or nil.
    public static func readText(_ path: String, limit: Int = 1 << 20) -> String? {
        guard let fd = try? FileDescriptor.open(path, .readOnly, options: [.closeOnExec]) else { return nil }
        defer { try? fd.close() }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 4096)
        while bytes.count < limit {
            guard let count = try? chunk.withUnsafeMutableBytes({ try fd.read(into: $0) }), count > 0 else { break }
            bytes += chunk[..<count]
        }
        return String(decoding: bytes, as: UTF8.self)
    }

    private static func supplementaryGroups() -> [gid_t] {
        let count = getgroups(0, nil)
        guard count > 0 else { return [] }
        var groups = [gid_t](repeating: 0, count: Int(count))
        let filled = getgroups(count, &groups)
        return filled > 0 ? Array(groups.prefix(Int(filled))) : []
    }

    private static func groupName(_ gid: gid_t) -> String {
        guard let entry = getgrgid(gid), let name = entry.pointee.gr_name else { return String(gid) }
        return String(cString: name)
    }

    /// The user's name, or the number when it has none.
    public static func userName(_ uid: uid_t) -> String {
        guard let entry = getpwuid(uid), let name = entry.pointee.pw_name else { return String(uid) }
        return String(cString: name)
    }
}
