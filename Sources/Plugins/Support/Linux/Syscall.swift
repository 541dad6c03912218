// Syscall.swift: the one funnel every system call of the plugins goes through. It reads errno at
// once (before anything else can overwrite it), retries EINTR, and turns a failure into a
// TransportError that names the call, the errno (swift-system's Errno) and the object.
// Modelled on SwiftNIO's System.swift; see Docs/Plugins.md.

import CLinux
import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// Runs system calls: errno read at once, EINTR retried, the call's name kept.
///
/// ```swift
/// var bits: Int32 = 0
/// try Syscall.run("ioctl(TIOCMGET)", on: path) { ioctl(fd.rawValue, UInt(TIOCMGET), &bits) }
/// let fd = try Syscall.descriptor("open", on: path) { open(path, O_RDWR | O_CLOEXEC) }
/// ```
public enum Syscall {
    /// Runs `body`, a call that returns -1 and sets errno on failure, until it is not
    /// interrupted. Returns its result; throws `TransportError.posix(_:errno:what:hint:)`.
    @discardableResult
    public static func run(_ name: String, on what: String, hint: String? = nil, _ body: () -> Int32) throws -> Int32 {
        switch attempt(body) {
        case .success(let value): return value
        case .failure(let errno): throw TransportError.posix(name, errno: errno, what: what, hint: hint)
        }
    }

    /// `run(_:on:hint:_:)` as above, for calls that return `ssize_t` (read, write, recv, send).
    @discardableResult
    public static func run(_ name: String, on what: String, hint: String? = nil, _ body: () -> Int) throws -> Int {
        switch attempt(body) {
        case .success(let value): return value
        case .failure(let errno): throw TransportError.posix(name, errno: errno, what: what, hint: hint)
        }
    }

    /// Runs a call that returns a new descriptor and hands it out as a `FileDescriptor` (the caller
    /// owns it and closes it exactly once).
    public static func descriptor(_ name: String, on what: String, hint: String? = nil, _ body: () -> Int32) throws -> FileDescriptor {
        FileDescriptor(rawValue: try run(name, on: what, hint: hint, body))
    }

    /// Runs `body` until it is not interrupted, for callers that act on particular errno values
    /// (EAGAIN, ENOTTY) themselves. The errno is read right after the call.
    public static func attempt<Value: BinaryInteger>(_ body: () -> Value) -> Result<Value, Errno> {
        while true {
            let result = body()
            guard result == -1 else { return .success(result) }
            let code = Errno(rawValue: Glibc.errno)
            if code == .interrupted { continue }
            return .failure(code)
        }
    }

    /// The current errno, for C library calls with other failure conventions (a NULL pointer).
    public static var errno: Errno { Errno(rawValue: Glibc.errno) }

    /// accept4(2) on a listening socket: the connection, non-blocking and close-on-exec (no
    /// window in which a fork could inherit it), or the errno (EAGAIN when none waits).
    ///
    /// ```swift
    /// switch Syscall.accept(listener) {
    /// case .success(let connection): adopt(connection)
    /// case .failure(.resourceTemporarilyUnavailable): try await gate.wait(until: .readable)
    /// case .failure(let errno): throw TransportError.posix("accept4", errno: errno, what: url)
    /// }
    /// ```
    public static func accept(_ listener: FileDescriptor) -> Result<FileDescriptor, Errno> {
        attempt { tk_accept_nonblocking(listener.rawValue, nil, nil) }.map { FileDescriptor(rawValue: $0) }
    }

    /// O_PATH (open(2)): a descriptor that only locates a file. glibc defines it only under
    /// _GNU_SOURCE, so Swift does not see it; the value is asm-generic/fcntl.h's (x86-64, arm64).
    public static let openPath: Int32 = 0o10000000
}

extension FileDescriptor {
    /// A new descriptor for the same open file, close-on-exec (`fcntl(F_DUPFD_CLOEXEC)`).
    ///
    /// ```swift
    /// let forTheEventLoop = try fd.duplicateCloseOnExec(describing: "/dev/ttyUSB0")
    /// ```
    public func duplicateCloseOnExec(describing what: String) throws -> FileDescriptor {
        try Syscall.descriptor("fcntl(F_DUPFD_CLOEXEC)", on: what) { fcntl(rawValue, F_DUPFD_CLOEXEC, 0) }
    }

    /// Closes a descriptor this code owns. close(2) is not retried on EINTR: on Linux the
    /// descriptor is released either way, and a retry could close a number reused meanwhile.
    public func closeOwned() {
        _ = Glibc.close(rawValue)
    }
}
