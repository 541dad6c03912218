// DeviceAccess.swift: opening a tty node and explaining why it failed — open(2), tcgetattr(3),
// flock(2), ioctl TIOCEXCL (ioctl_tty(2)). The permission and lock-holder explanations are shared
// (TransportKitLinux's DeviceNode).

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

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
                    throw lockedError(path: path, errno: error.errno)
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
            // EBUSY from open(2) on a tty: a descriptor has TIOCEXCL set on it, this process's
            // own (another connection to the port) or another program's.
            let holder = DeviceNode.openers(of: path)
            if holder == nil, DeviceNode.isOpenInThisProcess(path) {
                return TransportError(.busy, alreadyOpenHere(path) + " (it set TIOCEXCL)", errno: errno, syscall: "open")
            }
            return TransportError(.busy, "\(path) is busy: \(holder ?? "another program (not visible to this user)") opened it exclusively (TIOCEXCL). Close that program first",
                                  errno: errno, syscall: "open")
        default:
            return TransportError.posix("open", errno: errno, what: path)
        }
    }

    /// The `.busy` error for a port whose flock(2) is held: by this process (another connection
    /// to the port still open) or by another program, named where /proc shows it.
    static func lockedError(path: String, errno: Errno?) -> TransportError {
        let pid = DeviceNode.lockHolderPID(path: path)
        if pid == Int(getpid()) {
            return TransportError(.busy, alreadyOpenHere(path), errno: errno, syscall: "flock")
        }
        let holder = pid.map(DeviceNode.describeProcess) ?? DeviceNode.openers(of: path) ?? "another program (not visible to this user)"
        return TransportError(.busy, "\(path) is busy: \(holder) holds it exclusively. Close that program, or open with ?exclusive=false to share "
                              + "the port (bytes then go to whichever reader is first)", errno: errno, syscall: "flock")
    }

    /// "/dev/ttyUSB0 is already open in this process (1234): …": the holder is the caller itself.
    static func alreadyOpenHere(_ path: String) -> String {
        "\(path) is already open in this process (\(getpid())): another connection to it is still open and holds it exclusively. "
            + "Close that connection first, or open both with ?exclusive=false to share the port (bytes then go to whichever reader is first)"
    }

    /// "permission denied on /dev/ttyUSB0: owned by root:dialout, mode crw-rw----; this process
    /// (uid 1000) is not in group dialout. Fix: …". The udev rule suggested matches the port the
    /// way udev can: by the adapter's USB vendor and product when the port is on USB (its sysfs
    /// device has a USB ancestor), else by the kernel's name for it (ttyS0, ttyAMA0). A node of
    /// group root gets the group dialout in the rule, the serial ports' group on Debian, Ubuntu
    /// and Fedora.
    static func permissionMessage(path: String) -> String {
        let record = SerialDiscovery.record(forNode: path)
        let usb: (vendor: String, product: String)? = if let record, record.location != nil, let vendor = record.vendorId, let product = record.productId {
            (vendor: vendor, product: product)
        } else {
            nil
        }
        let kernelName = record?.name ?? resolvedName(path)
        return DeviceNode.permissionMessage(path: path, ruleGroup: "dialout") { group in
            if let usb {
                #"SUBSYSTEM=="tty", ATTRS{idVendor}=="\#(usb.vendor)", ATTRS{idProduct}=="\#(usb.product)", MODE="0660", GROUP="\#(group)""#
            } else {
                #"SUBSYSTEM=="tty", KERNEL=="\#(kernelName)", MODE="0660", GROUP="\#(group)""#
            }
        }
    }

    /// The node's name with links resolved (`/dev/serial/by-path/…` → `ttyS0`), or the path's last part.
    private static func resolvedName(_ path: String) -> String {
        var name = path
        if let resolved = realpath(path, nil) {
            name = String(cString: resolved)
            free(resolved)
        }
        return name.split(separator: "/").last.map(String.init) ?? name
    }
}
