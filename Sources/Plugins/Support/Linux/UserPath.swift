// UserPath.swift: paths a user gives for the tool to write at (a trace file) or to remove on close
// (a pty's link, a unix socket file), handled so that a program running as root in a shared
// directory such as /tmp cannot be turned against the machine — openat(2) with O_NOFOLLOW,
// readlinkat(2), fstat(2), lstat(2), unlink(2). Paths under /tmp are shared with every user; the kernel's fs.protected_* sysctls
// (proc_sys_fs(5)) defend them only where they are switched on.
//   - openForAppending: never follows a symbolic link at the last component, follows one on the
//     way only when this user or root owns it (walking the path and every link's target one
//     component at a time through O_PATH descriptors, so nothing is swapped between a check and
//     an open), never truncates, creates a new file owner-only
//     (0600), and takes only a regular file of this user with one link, or a character device.
//     O_NONBLOCK: opening a FIFO or a tty cannot hang.
//   - OwnedPath: an entry this process made (a socket file, a symlink), removed only while it is
//     still that entry.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// Opening paths users give for writing.
public enum UserPath {
    /// What a path is for, in messages: "the trace file (spy.file=)".
    public typealias Purpose = String

    /// Opens `path` to append records to it, as described in this file's header. Blocking calls
    /// (open(2) on a slow file system) run on ``Blocking``'s pool, never on the caller's thread.
    /// The descriptor is non-blocking and close-on-exec; the caller owns it.
    ///
    /// ```swift
    /// let fd = try await UserPath.openForAppending("/home/me/trace.txt", purpose: "the trace file (spy.file=)")
    /// ```
    public static func openForAppending(_ path: String, purpose: Purpose) async throws -> FileDescriptor {
        guard !path.isEmpty else {
            throw TransportError(.invalidURL, "\(purpose) needs a path, such as \(example)")
        }
        guard !path.utf8.contains(0) else {
            throw TransportError(.invalidURL, "\(purpose) contains a NUL byte")
        }
        return try await Blocking.run { try openForAppendingNow(path, purpose: purpose) }
    }

    /// A path to suggest in messages: in the home directory, not in a directory every user shares.
    public static var example: String {
        let home = getenv("HOME").map { String(cString: $0) } ?? ""
        return (home.hasPrefix("/") && home.count > 1 ? home : "/home/you") + "/trace.txt"
    }

    static func openForAppendingNow(_ path: String, purpose: Purpose) throws -> FileDescriptor {
        let shown = TransportError.printable(path)
        let (directory, name) = try openParent(of: path, purpose: purpose)
        defer { directory.closeOwned() }
        let flags = O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY
        let fd: FileDescriptor
        switch Syscall.attempt({ openat(directory.rawValue, name, flags, mode_t(0o600)) }) {
        case .success(let raw):
            fd = FileDescriptor(rawValue: raw)
        case .failure(let errno):
            throw openError(errno, path: path, directory: directory, name: name, purpose: purpose)
        }
        var info = stat()
        guard fstat(fd.rawValue, &info) == 0 else {
            let errno = Syscall.errno
            fd.closeOwned()
            throw TransportError.posix("fstat", errno: errno, what: shown)
        }
        if let refusal = refusal(info, path: shown, purpose: purpose) {
            fd.closeOwned()
            throw refusal
        }
        return fd
    }

    /// Why a file that opened must not be written: anything but a regular file of this user with
    /// one link, or a character device.
    static func refusal(_ info: stat, path: String, purpose: Purpose) -> TransportError? {
        switch info.st_mode & S_IFMT {
        case S_IFCHR:
            return nil
        case S_IFREG:
            if info.st_uid != geteuid() {
                return TransportError(.permissionDenied, "\(purpose) \(path) belongs to \(DeviceNode.userName(info.st_uid)), not to this user "
                                      + "(\(DeviceNode.userName(geteuid()))): another user may have put it there to read what is written. "
                                      + "Remove it, or choose a path in a directory only you can write to")
            }
            if info.st_nlink > 1 {
                return TransportError(.permissionDenied, "\(purpose) \(path) has \(info.st_nlink) hard links: it may be another file under a "
                                      + "second name, which would be overwritten. Remove it, or choose another path")
            }
            return nil
        default:
            return TransportError(.invalidURL, "\(purpose) \(path) is \(fileKind(info.st_mode)): give a regular file (created owner-only if it "
                                  + "does not exist, appended to if it does) or a character device such as /dev/null")
        }
    }

    private static func openError(_ errno: Errno, path: String, directory: FileDescriptor, name: String, purpose: Purpose) -> TransportError {
        let shown = TransportError.printable(path)
        var info = stat()
        // O_NOFOLLOW on a link answers ELOOP, or EACCES for another user's link in a sticky
        // directory (the kernel refuses O_CREAT there before O_NOFOLLOW is looked at).
        if fstatat(directory.rawValue, name, &info, AT_SYMLINK_NOFOLLOW) == 0, info.st_mode & S_IFMT == S_IFLNK {
            return TransportError(.permissionDenied, "\(purpose) \(shown) is a symbolic link (owned by \(DeviceNode.userName(info.st_uid))); it is "
                                  + "not followed, so that a link someone put there cannot redirect what is written. Give the real path, or "
                                  + "remove the link", errno: errno, syscall: "open")
        }
        switch errno {
        case .noSuchAddressOrDevice:
            // O_NONBLOCK | O_WRONLY on a FIFO without a reader, or a device node without a device.
            let what = fstatat(directory.rawValue, name, &info, AT_SYMLINK_NOFOLLOW) == 0 ? fileKind(info.st_mode) : "not a file"
            return TransportError(.invalidURL, "\(purpose) \(shown) is \(what): give a regular file or a character device such as /dev/null",
                                  errno: errno, syscall: "open")
        case .isDirectory:
            return TransportError(.invalidURL, "\(purpose) \(shown) is a directory: give a file name in it, such as \(shown)/trace.txt",
                                  errno: errno, syscall: "open")
        case .permissionDenied, .notPermitted:
            return TransportError(.permissionDenied, "\(purpose) \(shown) cannot be written by this user: check the permissions of the file "
                                  + "and its directory, or choose a path you can write to", errno: errno, syscall: "open")
        case .noSuchFileOrDirectory:
            return TransportError(.notFound, "\(purpose) \(shown): the directory it would go in does not exist", errno: errno, syscall: "open")
        default:
            return TransportError(TransportError.Kind(errno: errno), "\(purpose) \(shown) cannot be opened for writing", errno: errno, syscall: "open")
        }
    }

    /// The directory `path` names its last component in, opened (O_PATH) by walking the path one
    /// component at a time, each opened with O_NOFOLLOW and examined through its own descriptor
    /// (so nothing can be swapped between a check and an open). A symbolic link on the way is
    /// followed only when this user or root owns it, since another user's link could point
    /// anywhere; its target is read (readlinkat(2)) and walked the same way, so a link inside it
    /// is checked too. A directory of another user on the way is walked: what is opened at the end
    /// is created anew or must be this user's own file (``refusal(_:path:purpose:)``).
    /// Returns the directory and the name.
    static func openParent(of path: String, purpose: Purpose) throws -> (FileDescriptor, String) {
        var components = path.split(separator: "/", omittingEmptySubsequences: true).map(String.init)
        guard let name = components.popLast(), name != ".", name != ".." else {
            throw TransportError(.invalidURL, "\(purpose) \(TransportError.printable(path)) names no file: give a path such as \(example)")
        }
        let shown = TransportError.printable(path)
        let start = path.hasPrefix("/") ? "/" : "."
        var current = try Syscall.descriptor("open", on: start) { open(start, Syscall.openPath | O_DIRECTORY | O_CLOEXEC) }
        var pending = Array(components.reversed())
        var followed = 0
        while let component = pending.popLast() {
            if component == "." { continue }
            let opened = Syscall.attempt { openat(current.rawValue, component, Syscall.openPath | O_NOFOLLOW | O_CLOEXEC) }
            guard case .success(let raw) = opened else {
                current.closeOwned()
                if case .failure(let errno) = opened { throw walkError(errno, path: shown, component: component, purpose: purpose) }
                throw TransportError(.io, "\(purpose) \(shown) cannot be opened")
            }
            let next = FileDescriptor(rawValue: raw)
            var info = stat()
            guard fstat(next.rawValue, &info) == 0 else {
                let errno = Syscall.errno
                next.closeOwned()
                current.closeOwned()
                throw TransportError.posix("fstat", errno: errno, what: shown)
            }
            switch info.st_mode & S_IFMT {
            case S_IFDIR:
                current.closeOwned()
                current = next
            case S_IFLNK:
                followed += 1
                let target = info.st_uid == geteuid() || info.st_uid == 0 ? linkTarget(next) : nil
                next.closeOwned()
                guard let target, followed <= 40 else {
                    current.closeOwned()
                    if followed > 40 {
                        throw TransportError(.invalidURL, "\(purpose) \(shown) goes through more than 40 symbolic links: give the real path",
                                             errno: .tooManySymbolicLinkLevels, syscall: "open")
                    }
                    throw TransportError(.permissionDenied, "\(purpose) \(shown) goes through the symbolic link '\(TransportError.printable(component, limit: 60))', "
                                         + "owned by \(DeviceNode.userName(info.st_uid)): another user's link could send the file anywhere, so it is "
                                         + "not followed. Give the real path")
                }
                if target.hasPrefix("/") {
                    current.closeOwned()
                    current = try Syscall.descriptor("open", on: "/") { open("/", Syscall.openPath | O_DIRECTORY | O_CLOEXEC) }
                }
                pending += target.split(separator: "/", omittingEmptySubsequences: true).map(String.init).reversed()
            default:
                next.closeOwned()
                current.closeOwned()
                throw walkError(.notDirectory, path: shown, component: component, purpose: purpose)
            }
        }
        return (current, name)
    }

    /// Where the link open as `link` (O_PATH | O_NOFOLLOW) points; nil when it cannot be read.
    private static func linkTarget(_ link: FileDescriptor) -> String? {
        var buffer = [UInt8](repeating: 0, count: Int(PATH_MAX) + 1)
        let count = buffer.withUnsafeMutableBufferPointer { bytes in
            bytes.baseAddress.map { readlinkat(link.rawValue, "", UnsafeMutableRawPointer($0).assumingMemoryBound(to: CChar.self), bytes.count - 1) } ?? -1
        }
        guard count > 0, count < buffer.count - 1 else { return nil }
        return String(decoding: buffer[..<count], as: UTF8.self)
    }

    private static func walkError(_ errno: Errno, path shown: String, component: String, purpose: Purpose) -> TransportError {
        let name = TransportError.printable(component, limit: 60)
        switch errno {
        case .noSuchFileOrDirectory:
            return TransportError(.notFound, "\(purpose) \(shown): the directory it would go in does not exist ('\(name)' on the way is missing)",
                                  errno: errno, syscall: "open")
        case .notDirectory:
            return TransportError(.notFound, "\(purpose) \(shown): '\(name)' on the way is not a directory", errno: errno, syscall: "open")
        default:
            return TransportError(TransportError.Kind(errno: errno), "\(purpose) \(shown): '\(name)' on the way cannot be reached by this user",
                                  errno: errno, syscall: "open")
        }
    }

    /// "a directory", "a regular file", … for messages about a path of the wrong kind.
    public static func fileKind(_ mode: mode_t) -> String {
        switch mode & S_IFMT {
        case S_IFDIR: "a directory"
        case S_IFREG: "a regular file"
        case S_IFIFO: "a FIFO (named pipe)"
        case S_IFCHR: "a character device"
        case S_IFBLK: "a block device"
        case S_IFLNK: "a symbolic link"
        case S_IFSOCK: "a unix socket"
        default: "of an unknown kind"
        }
    }
}

/// A file-system entry this process made at a path a user gave (a unix socket file, a symbolic
/// link), recorded by device and inode so that it is removed only while it is still that entry: a
/// file someone put in its place, or another process's socket bound there since, stays.
///
/// ```swift
/// try Syscall.run("symlink", on: link) { symlink(peer, link) }
/// let owned = OwnedPath(recording: link, kind: S_IFLNK, target: peer)
/// // … later, on close:
/// owned?.remove()
/// ```
///
/// The record is taken right after the call that made the entry, but another process can unlink
/// it and put its own file there in between: a record of whatever is there would then remove that
/// file on close. So the record is refused unless the entry is of the kind just made (and, for a
/// link, points where it was made to point). An entry of the same kind put there in that moment
/// (another program's socket bound at the path, another link to the same target) is still taken
/// for this one: only a program that may unlink this process's entries can do that.
public struct OwnedPath: Sendable {
    /// The path as given.
    public let path: String
    private let device: UInt64
    private let inode: UInt64
    private let type: UInt32

    /// The entry now at `path` (lstat(2): a link itself, not what it points to) when it is of
    /// `kind` (`S_IFLNK`, `S_IFSOCK`, …) and, when `target` is given, is a link to `target`;
    /// `nil` when nothing is there or something else is.
    public init?(recording path: String, kind: mode_t, target: String? = nil) {
        var info = stat()
        guard lstat(path, &info) == 0, info.st_mode & S_IFMT == kind else { return nil }
        if let target, DeviceNode.readLink(path) != target { return nil }
        self.path = path
        device = UInt64(info.st_dev)
        inode = UInt64(info.st_ino)
        type = UInt32(info.st_mode & S_IFMT)
    }

    /// Whether the entry at the path is still the one recorded.
    public var isStillOurs: Bool {
        var info = stat()
        return lstat(path, &info) == 0 && isEntry(info)
    }

    /// Whether `info` (from fstat(2) of a descriptor opened at the path) is the entry recorded.
    public func isEntry(_ info: stat) -> Bool {
        UInt64(info.st_dev) == device && UInt64(info.st_ino) == inode && UInt32(info.st_mode & S_IFMT) == type
    }

    /// unlink(2)s the path if it is still the entry recorded; returns whether it did. (Between
    /// the check and the unlink another process could still swap the entry; only one that can
    /// write to the directory, and in a sticky directory such as /tmp only the entry's owner.)
    @discardableResult
    public func remove() -> Bool {
        guard isStillOurs else { return false }
        return unlink(path) == 0
    }
}
