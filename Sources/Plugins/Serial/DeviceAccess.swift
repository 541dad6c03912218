// DeviceAccess.swift: opening a device node and explaining why it failed — open(2), fstat(2),
// flock(2), getgroups(2), getgrgid(3), and /proc/locks (proc(5)) to name who holds a lock.

import Foundation
import Glibc
import TransportKitCore

enum DeviceAccess {
    /// Opens a tty node for reading and writing without making it the controlling terminal, in
    /// non-blocking mode (the event loop waits for readiness) and close-on-exec.
    /// With `exclusive`, takes flock(LOCK_EX) and sets TIOCEXCL, as serialport-rs and
    /// node-serialport do; both are released when the descriptor is closed.
    static func openTTY(_ path: String, exclusive: Bool) throws -> Int32 {
        let fd = Glibc.open(path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC)
        guard fd >= 0 else { throw openError(path: path, errno: errno) }
        do {
            // tcgetattr fails with ENOTTY on anything that is not a terminal (a regular file, a pipe).
            var probe = termios()
            try Posix.call("tcgetattr", what: path, hint: "\(path) is not a serial port or terminal") { tcgetattr(fd, &probe) }
            if exclusive {
                do {
                    try Posix.call("flock", what: path) { flock(fd, LOCK_EX | LOCK_NB) }
                } catch let error as TransportError where error.errno == EWOULDBLOCK {
                    throw TransportError(.busy, "\(path) is busy: \(lockHolder(path: path) ?? "another program") holds it exclusively. Close that program, or open with ?exclusive=false to share the port (bytes then go to whichever reader is first)",
                                         errno: error.errno, syscall: "flock")
                }
                try Posix.call("ioctl(TIOCEXCL)", what: path) { ioctl(fd, UInt(TIOCEXCL)) }
            }
            return fd
        } catch {
            Posix.close(fd)
            throw error
        }
    }

    static func openError(path: String, errno code: Int32) -> TransportError {
        switch code {
        case ENOENT:
            return TransportError(.notFound, "no device at \(path): is it plugged in? `transportkit list` shows the serial ports this machine has",
                                  errno: code, syscall: "open")
        case ENXIO, ENODEV:
            return TransportError(.notFound, "\(path) exists but no device answers behind it (unplugged, or an unused port slot)",
                                  errno: code, syscall: "open")
        case EACCES, EPERM:
            return TransportError(.permissionDenied, permissionMessage(path: path), errno: code, syscall: "open")
        case EBUSY:
            // EBUSY from open(2) on a tty: another process set TIOCEXCL on it.
            return TransportError(.busy, "\(path) is busy: another program opened it exclusively (TIOCEXCL). Close that program first",
                                  errno: code, syscall: "open")
        default:
            return TransportError.posix("open", errno: code, what: path)
        }
    }

    /// "permission denied on /dev/ttyUSB0: owned by root:dialout, mode crw-rw----; this process
    /// (uid 1000) is not in group dialout. Fix: …"
    static func permissionMessage(path: String) -> String {
        var message = "permission denied opening \(path)"
        var info = stat()
        guard stat(path, &info) == 0 else { return message + ": check its permissions" }
        let owner = userName(info.st_uid)
        let group = groupName(info.st_gid)
        message += ": owned by \(owner):\(group), mode \(modeString(info.st_mode))"
        let member = getegid() == info.st_gid || supplementaryGroups().contains(info.st_gid)
        message += member
            ? "; this process (uid \(geteuid())) is in group \(group), so something else refuses access (an LSM policy, or a group added after login: log in again)"
            : "; this process (uid \(geteuid())) is not in group \(group)"
        message += ". Fixes: add the user to the group (`sudo usermod -aG \(group) $USER`, then log in again), or install a udev rule such as SUBSYSTEM==\"tty\", ATTRS{idVendor}==\"VID\", ATTRS{idProduct}==\"PID\", MODE=\"0660\", GROUP=\"\(group)\" in /etc/udev/rules.d/"
        return message
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

    private static func userName(_ uid: uid_t) -> String {
        guard let entry = getpwuid(uid), let name = entry.pointee.pw_name else { return String(uid) }
        return String(cString: name)
    }

    static func modeString(_ mode: mode_t) -> String {
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

    /// "process 1234 (minicom)" when /proc/locks shows who holds a flock on the node.
    static func lockHolder(path: String) -> String? {
        var info = stat()
        guard stat(path, &info) == 0,
              let locks = try? String(contentsOfFile: "/proc/locks", encoding: .utf8) else { return nil }
        // Lines look like "1: FLOCK  ADVISORY  WRITE 1234 00:05:87 0 EOF" (device as major:minor in hex).
        let dev = UInt64(info.st_dev)
        let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & ~UInt64(0xfff))   // glibc's gnu_dev_major, a macro in C
        let minor = (dev & 0xff) | ((dev >> 12) & ~UInt64(0xff))
        let device = String(format: "%02llx:%02llx:%llu", major, minor, UInt64(info.st_ino))
        for line in locks.split(separator: "\n") {
            let fields = line.split(separator: " ", omittingEmptySubsequences: true)
            guard fields.count >= 6, fields[1] == "FLOCK", fields[5] == device, let pid = Int(fields[4]) else { continue }
            let command = (try? String(contentsOfFile: "/proc/\(pid)/comm", encoding: .utf8))?
                .trimmingCharacters(in: .whitespacesAndNewlines)
            return "process \(pid)" + (command.map { " (\($0))" } ?? "")
        }
        return nil
    }
}
