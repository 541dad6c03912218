/// The one error type TransportKit throws (besides `CancellationError` when a task is cancelled).
///
/// It carries a portable ``Kind`` to switch on, the `errno` and system call where one failed, and a
/// message written for a person: what went wrong and what to do about it.
///
/// ```swift
/// do {
///     let connection = try await Transport.connect(to: "tcp://127.0.0.1:1")
/// } catch let error as TransportError where error.kind == .refused {
///     print(error.message)   // "connection refused by 127.0.0.1:1: is the server running? ..."
/// }
/// ```
public struct TransportError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What kind of failure this is, independent of the transport.
    public enum Kind: String, Sendable, Codable, CaseIterable {
        /// The URL or one of its options is malformed. Raised before any I/O.
        case invalidURL
        /// No plugin serves the URL's scheme.
        case unsupportedScheme
        /// The host, path, device or service does not exist.
        case notFound
        /// The operating system refused access.
        case permissionDenied
        /// Someone else holds the resource (a serial port in exclusive use, an address in use).
        case busy
        /// The peer actively refused the connection.
        case refused
        /// The connection ended abnormally: peer reset, device unplugged, link lost.
        case disconnected
        /// A deadline passed.
        case timedOut
        /// The transport cannot do what was asked (half-close on a transport without it, listen on a
        /// client-only scheme, a missing kernel feature).
        case unsupported
        /// Any other I/O failure.
        case io
    }

    /// The portable kind.
    public var kind: Kind
    /// A sentence for a person: what failed and what to do.
    public var message: String
    /// The `errno` value, when a system call failed.
    public var errno: Int32?
    /// The system call (or C library function) that failed, such as `"connect"`.
    public var syscall: String?

    public init(_ kind: Kind, _ message: String, errno: Int32? = nil, syscall: String? = nil) {
        self.kind = kind
        self.message = message
        self.errno = errno
        self.syscall = syscall
    }

    public var description: String {
        var text = message
        if let syscall, let errno {
            text += " [\(syscall): \(ErrnoName.describe(errno))]"
        } else if let errno {
            text += " [\(ErrnoName.describe(errno))]"
        }
        return text
    }

    /// Builds an error from a failed system call, choosing the kind from `errno`.
    ///
    /// `what` names the object (a path, an address) and `hint` is appended when the kind alone
    /// does not tell a person what to do.
    public static func posix(_ syscall: String, errno: Int32, what: String, hint: String? = nil) -> TransportError {
        let kind = Kind(errno: errno)
        var message = "\(syscall) on \(what) failed: \(ErrnoName.describe(errno))"
        if let hint { message += ". " + hint }
        return TransportError(kind, message, errno: errno, syscall: syscall)
    }
}

extension TransportError.Kind {
    /// The portable kind for an `errno` value. Mappings that are not obvious:
    /// EIO and ENXIO/ENODEV mean a device went away (a pty whose other side closed reports EIO);
    /// EADDRINUSE is "busy" because another socket holds the address.
    public init(errno: Int32) {
        switch errno {
        case ErrnoName.ENOENT, ErrnoName.EHOSTUNREACH, ErrnoName.ENETUNREACH: self = .notFound
        case ErrnoName.EACCES, ErrnoName.EPERM: self = .permissionDenied
        case ErrnoName.EBUSY, ErrnoName.EADDRINUSE, ErrnoName.EAGAIN: self = .busy
        case ErrnoName.ECONNREFUSED: self = .refused
        case ErrnoName.ECONNRESET, ErrnoName.EPIPE, ErrnoName.EIO, ErrnoName.ENXIO, ErrnoName.ENODEV,
             ErrnoName.ECONNABORTED, ErrnoName.ENOTCONN, ErrnoName.ESHUTDOWN:
            self = .disconnected
        case ErrnoName.ETIMEDOUT: self = .timedOut
        case ErrnoName.EOPNOTSUPP, ErrnoName.EAFNOSUPPORT, ErrnoName.EPROTONOSUPPORT, ErrnoName.ENOSYS,
             ErrnoName.ENOTTY:
            self = .unsupported
        default: self = .io
        }
    }
}

/// Linux errno values and names. The core imports no C module, so the few values it reasons
/// about are spelled here (asm-generic/errno-base.h and errno.h; identical on every Linux arch
/// Swift supports).
public enum ErrnoName {
    public static let EPERM: Int32 = 1
    public static let ENOENT: Int32 = 2
    public static let EINTR: Int32 = 4
    public static let EIO: Int32 = 5
    public static let ENXIO: Int32 = 6
    public static let EBADF: Int32 = 9
    public static let EAGAIN: Int32 = 11
    public static let EACCES: Int32 = 13
    public static let EBUSY: Int32 = 16
    public static let ENODEV: Int32 = 19
    public static let EINVAL: Int32 = 22
    public static let ENOTTY: Int32 = 25
    public static let EPIPE: Int32 = 32
    public static let ENOSYS: Int32 = 38
    public static let EPROTONOSUPPORT: Int32 = 93
    public static let EOPNOTSUPP: Int32 = 95
    public static let EAFNOSUPPORT: Int32 = 97
    public static let EADDRINUSE: Int32 = 98
    public static let ENETUNREACH: Int32 = 101
    public static let ECONNABORTED: Int32 = 103
    public static let ECONNRESET: Int32 = 104
    public static let ENOBUFS: Int32 = 105
    public static let ENOTCONN: Int32 = 107
    public static let ESHUTDOWN: Int32 = 108
    public static let ETIMEDOUT: Int32 = 110
    public static let ECONNREFUSED: Int32 = 111
    public static let EHOSTUNREACH: Int32 = 113

    static let names: [Int32: String] = [
        EPERM: "EPERM (operation not permitted)", ENOENT: "ENOENT (no such file or directory)",
        EINTR: "EINTR (interrupted)", EIO: "EIO (input/output error)", ENXIO: "ENXIO (no such device or address)",
        EBADF: "EBADF (bad file descriptor)", EAGAIN: "EAGAIN (resource temporarily unavailable)",
        EACCES: "EACCES (permission denied)", EBUSY: "EBUSY (device or resource busy)",
        ENODEV: "ENODEV (no such device)", EINVAL: "EINVAL (invalid argument)",
        ENOTTY: "ENOTTY (not a terminal)", EPIPE: "EPIPE (broken pipe)", ENOSYS: "ENOSYS (not implemented)",
        EPROTONOSUPPORT: "EPROTONOSUPPORT (protocol not supported)",
        EOPNOTSUPP: "EOPNOTSUPP (operation not supported)",
        EAFNOSUPPORT: "EAFNOSUPPORT (address family not supported)",
        EADDRINUSE: "EADDRINUSE (address already in use)", ENETUNREACH: "ENETUNREACH (network unreachable)",
        ECONNABORTED: "ECONNABORTED (connection aborted)", ECONNRESET: "ECONNRESET (connection reset by peer)",
        ENOBUFS: "ENOBUFS (no buffer space)", ENOTCONN: "ENOTCONN (not connected)",
        ESHUTDOWN: "ESHUTDOWN (endpoint shut down)", ETIMEDOUT: "ETIMEDOUT (timed out)",
        ECONNREFUSED: "ECONNREFUSED (connection refused)", EHOSTUNREACH: "EHOSTUNREACH (host unreachable)",
    ]

    /// "ENOENT (no such file or directory)", or "errno 77" for values not in the table.
    public static func describe(_ errno: Int32) -> String {
        names[errno] ?? "errno \(errno)"
    }
}
