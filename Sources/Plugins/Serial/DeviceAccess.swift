// DeviceAccess.swift: opening a tty node and explaining why it failed — open(2), tcgetattr(3),
// flock(2), ioctl TIOCEXCL (ioctl_tty(2)). The permission and lock-holder explanations are shared
// (TransportKitLinux's DeviceNode).

import Glibc
import SystemPackage
import TransportKitCore
import TransportKitLinux

enum DeviceAccess {
    /// Opens a tty node for reading and writing without making it the controlling terminal, in
    /// non-blocking mode (the event loop waits for readiness) and close-on-exec.
    /// With `exclusive`, takes flock(LOCK_EX) and sets TIOCEXCL, as serialport-rs and
    /// node-serialport do; both are released when the descriptor is closed.
    static func openTTY(_ path: String, exclusive: Bool) async throws -> FileDescriptor {
        let fd: FileDescriptor
        switch Syscall.attempt({ open(path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC) }) {
        case .success(let raw): fd = FileDescriptor(rawValue: raw)
        case .failure(let errno): throw openError(path: path, errno: errno)
        }
        do {
            // tcgetattr fails with ENOTTY on anything that is not a terminal (a regular file, a pipe).
            var probe = termios()
            try Syscall.run("tcgetattr", on: path, hint: "\(path) is not a serial port or terminal") { tcgetattr(fd.rawValue, &probe) }
            if exclusive {
                do {
                    try await lockBriefly(fd, path: path)
                } catch let error as TransportError where error.errno == .wouldBlock {
                    throw TransportError(.busy, "\(path) is busy: \(DeviceNode.lockHolder(path: path) ?? DeviceNode.openers(of: path) ?? "another program (not visible to this user)") holds it exclusively. Close that program, or open with ?exclusive=false to share the port (bytes then go to whichever reader is first)",
                                         errno: error.errno, syscall: "flock")
                }
                try Syscall.run("ioctl(TIOCEXCL)", on: path) { ioctl(fd.rawValue, UInt(TIOCEXCL)) }
            }
            return fd
        } catch {
            fd.closeOwned()
            throw error
        }
    }

    /// flock(LOCK_EX | LOCK_NB), tried again for up to `patience` while the lock is held. A lock
    /// can outlive its holder's close(2) by a moment: a process that forks (posix_spawn, say) copies
    /// every descriptor, close-on-exec ones too, into the child until it execs, so a port this
    /// process (or another) has just closed may still be locked through that copy. A port that is
    /// really in use stays locked, and its `.busy` comes `patience` later. The waits are task
    /// sleeps: no thread is blocked, and a cancelled connect stops waiting.
    static func lockBriefly(_ fd: FileDescriptor, path: String, patience: Duration = .milliseconds(50)) async throws {
        let deadline = ContinuousClock.now + patience
        while true {
            do {
                try Syscall.run("flock", on: path) { flock(fd.rawValue, LOCK_EX | LOCK_NB) }
                return
            } catch let error as TransportError where error.errno == .wouldBlock && ContinuousClock.now < deadline {
                try await Task.sleep(for: .milliseconds(5))
            }
        }
    }

    static func openError(path: String, errno: Errno) -> TransportError {
        switch errno {
        case .noSuchFileOrDirectory:
            return TransportError(.notFound, "no device at \(path): is it plugged in? `transportkit list` shows the serial ports this machine has",
                                  errno: errno, syscall: "open")
        case .noSuchAddressOrDevice, .operationNotSupportedByDevice:
            var info = stat()
            if stat(path, &info) == 0, info.st_mode & S_IFMT == S_IFSOCK {
                // open(2) on a unix socket file fails with ENXIO.
                return TransportError(.unsupported, "\(path) is a unix socket, not a serial port: connect to it with unix://\(path)",
                                      errno: errno, syscall: "open")
            }
            return TransportError(.notFound, "\(path) exists but no device answers behind it (unplugged, or an unused port slot)",
                                  errno: errno, syscall: "open")
        case .isDirectory:
            return TransportError(.invalidURL, "\(path) is a directory, not a serial port: give a device node such as /dev/ttyUSB0 (`transportkit list` shows them)",
                                  errno: errno, syscall: "open")
        case .permissionDenied, .notPermitted:
            return TransportError(.permissionDenied, permissionMessage(path: path), errno: errno, syscall: "open")
        case .resourceBusy:
            // EBUSY from open(2) on a tty: another process set TIOCEXCL on it.
            let holder = DeviceNode.openers(of: path)
            return TransportError(.busy, "\(path) is busy: \(holder ?? "another program (not visible to this user)") opened it exclusively (TIOCEXCL). Close that program first",
                                  errno: errno, syscall: "open")
        default:
            return TransportError.posix("open", errno: errno, what: path)
        }
    }

    /// "permission denied on /dev/ttyUSB0: owned by root:dialout, mode crw-rw----; this process
    /// (uid 1000) is not in group dialout. Fix: …"
    static func permissionMessage(path: String) -> String {
        DeviceNode.permissionMessage(path: path) { group in
            #"SUBSYSTEM=="tty", ATTRS{idVendor}=="VID", ATTRS{idProduct}=="PID", MODE="0660", GROUP="\#(group)""#
        }
    }
}
