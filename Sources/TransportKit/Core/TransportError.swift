import SystemPackage

/// The one error type TransportKit throws (besides `CancellationError` when a task is cancelled).
///
/// It carries a portable ``Kind`` to switch on, the `errno` and system call where one failed, and a
/// message written for a person: what went wrong and what to do about it.
///
/// ```swift
/// do {
///     let connection = try await Transport.connect(to: "tcp://127.0.0.1:1")
/// } catch let error as TransportError where error.kind == .refused {
///     print(error.message)   // "tcp://127.0.0.1:1 refused the connection: is the server running …"
///     print(error.errno == .connectionRefused, error.syscall ?? "")   // true connect
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
        /// client-only scheme, message reads on a byte stream, a missing kernel feature).
        case unsupported
        /// The program used the API in a way it does not allow: two tasks reading one connection at
        /// once, reading or writing after `close()`, a message larger than the transport's MTU, a
        /// plugin that declares a malformed scheme. Fix the calling code; retrying does not help.
        case misuse
        /// Any other I/O failure.
        case io
        /// The peer broke or refused a protocol layered on the transport: a TLS handshake (an
        /// untrusted or expired certificate, a name mismatch, a plain-TCP server), a WebSocket
        /// upgrade, a malformed frame. The message says which rule and what to do.
        case protocolError
    }

    /// The portable kind.
    public var kind: Kind
    /// A sentence for a person: what failed and what to do.
    public var message: String
    /// The `errno` value, when a system call failed.
    public var errno: Errno?
    /// The system call (or C library function) that failed, such as `"connect"`.
    public var syscall: String?
    /// The service's or protocol's own name for the error, when one answered with it: a D-Bus
    /// error name (`org.bluez.Error.NotPermitted`), and later a TLS alert or a WebSocket close
    /// code. Tell errors apart by it, never by their message's words.
    public var code: String?

    /// An error of `kind` with a message for a person.
    ///
    /// ```swift
    /// throw TransportError(.notFound, "no device at \(path): is it plugged in?", errno: .noSuchFileOrDirectory, syscall: "open")
    /// ```
    public init(_ kind: Kind, _ message: String, errno: Errno? = nil, syscall: String? = nil, code: String? = nil) {
        self.code = code
        self.kind = kind
        self.message = message
        self.errno = errno
        self.syscall = syscall
    }

    /// The message, followed by the system call and errno when there are any:
    /// `"… [connect: ECONNREFUSED (Connection refused)]"`.
    public var description: String {
        guard let errno else { return syscall.map { "\(message) [\($0)]" } ?? message }
        return "\(message) [\(syscall.map { $0 + ": " } ?? "")\(errno.symbolicDescription)]"
    }

    /// Builds an error from a failed system call, choosing the kind from `errno`.
    ///
    /// `what` names the object (a path, an address) and `hint` is appended when the kind alone
    /// does not tell a person what to do.
    ///
    /// ```swift
    /// throw TransportError.posix("ioctl(TIOCMGET)", errno: .notATerminal, what: "/dev/ttyUSB0")
    /// ```
    public static func posix(_ syscall: String, errno: Errno, what: String, hint: String? = nil) -> TransportError {
        var message = "\(syscall) on \(what) failed: \(errno.symbolicDescription)"
        if let hint { message += ". " + hint }
        return TransportError(Kind(errno: errno), message, errno: errno, syscall: syscall)
    }

    /// `text` (a value from a URL, a path) as a message may show it: control characters escaped,
    /// and anything longer than `limit` characters cut in the middle with its full length given,
    /// so a 100 KB value does not fill a terminal.
    ///
    /// ```swift
    /// throw TransportError(.notFound, "no device at \(TransportError.printable(path))")
    /// ```
    public static func printable(_ text: String, limit: Int = 160) -> String {
        URLParser.printable(text, limit: limit)
    }

    /// A ``Kind/misuse`` error: the calling code broke a rule of the API.
    ///
    /// ```swift
    /// throw TransportError.misuse("\(url) wraps no URL; only a wrapper scheme may call connectInner()")
    /// ```
    public static func misuse(_ message: String) -> TransportError {
        TransportError(.misuse, message)
    }
}

extension TransportError.Kind {
    /// A few words for the kind, for a peer that may learn what went wrong but not where:
    /// "not found", "busy", "permission denied".
    ///
    /// ```swift
    /// TransportError.Kind.permissionDenied.phrase   // "permission denied"
    /// ```
    public var phrase: String {
        switch self {
        case .invalidURL: "an invalid URL"
        case .unsupportedScheme: "an unsupported scheme"
        case .notFound: "not found"
        case .permissionDenied: "permission denied"
        case .busy: "busy"
        case .refused: "refused"
        case .disconnected: "disconnected"
        case .timedOut: "timed out"
        case .unsupported: "not supported"
        case .misuse: "misused"
        case .io: "an I/O error"
        case .protocolError: "a protocol error"
        }
    }

    /// The portable kind for an `errno` value. Mappings that are not obvious:
    /// EIO and ENXIO/ENODEV mean a device went away (a pty whose other side closed reports EIO);
    /// EADDRINUSE is "busy" because another socket holds the address.
    ///
    /// ```swift
    /// TransportError.Kind(errno: .connectionReset)   // .disconnected
    /// ```
    public init(errno: Errno) {
        switch errno {
        case .noSuchFileOrDirectory, .noRouteToHost, .networkUnreachable: self = .notFound
        case .permissionDenied, .notPermitted: self = .permissionDenied
        case .resourceBusy, .addressInUse, .resourceTemporarilyUnavailable: self = .busy
        case .connectionRefused: self = .refused
        case .connectionReset, .brokenPipe, .ioError, .noSuchAddressOrDevice, .operationNotSupportedByDevice,
             .connectionAbort, .socketNotConnected, .socketShutdown:
            self = .disconnected
        case .timedOut: self = .timedOut
        case .notSupportedOnSocket, .addressFamilyNotSupported, .protocolNotSupported, .noFunction, .inappropriateIOCTLForDevice:
            self = .unsupported
        default: self = .io
        }
    }
}

extension Errno {
    /// The C name and the C library's text, such as `"ECONNRESET (Connection reset by peer)"`; values
    /// without a name here read `"errno 77 (…)"`. The values come from the platform (swift-system), only
    /// the names are spelled here, for the errors transports meet.
    ///
    /// ```swift
    /// Errno.connectionRefused.symbolicDescription   // "ECONNREFUSED (Connection refused)"
    /// ```
    public var symbolicDescription: String {
        "\(Errno.names[self] ?? "errno \(rawValue)") (\(description))"
    }

    private static let names: [Errno: String] = [
        .notPermitted: "EPERM", .noSuchFileOrDirectory: "ENOENT", .interrupted: "EINTR", .ioError: "EIO",
        .noSuchAddressOrDevice: "ENXIO", .badFileDescriptor: "EBADF", .resourceTemporarilyUnavailable: "EAGAIN",
        .noMemory: "ENOMEM", .permissionDenied: "EACCES", .resourceBusy: "EBUSY", .fileExists: "EEXIST",
        .operationNotSupportedByDevice: "ENODEV", .notDirectory: "ENOTDIR", .isDirectory: "EISDIR", .invalidArgument: "EINVAL",
        .inappropriateIOCTLForDevice: "ENOTTY", .brokenPipe: "EPIPE", .noFunction: "ENOSYS", .messageTooLong: "EMSGSIZE",
        .protocolNotSupported: "EPROTONOSUPPORT", .notSupportedOnSocket: "EOPNOTSUPP",
        .addressFamilyNotSupported: "EAFNOSUPPORT", .addressInUse: "EADDRINUSE", .addressNotAvailable: "EADDRNOTAVAIL", .networkUnreachable: "ENETUNREACH",
        .connectionAbort: "ECONNABORTED", .connectionReset: "ECONNRESET", .noBufferSpace: "ENOBUFS",
        .socketNotConnected: "ENOTCONN", .socketShutdown: "ESHUTDOWN", .timedOut: "ETIMEDOUT",
        .connectionRefused: "ECONNREFUSED", .noRouteToHost: "EHOSTUNREACH", .protocolNotAvailable: "ENOPROTOOPT", .readOnlyFileSystem: "EROFS",
        .noSpace: "ENOSPC", .tooManySymbolicLinkLevels: "ELOOP", .fileNameTooLong: "ENAMETOOLONG", .tooManyOpenFiles: "EMFILE",
        .tooManyOpenFilesInSystem: "ENFILE", .fileTooLarge: "EFBIG", .diskQuotaExceeded: "EDQUOT", .textFileBusy: "ETXTBSY",
        .improperLink: "EXDEV", .directoryNotEmpty: "ENOTEMPTY", .badAddress: "EFAULT", .argListTooLong: "E2BIG", .noSuchProcess: "ESRCH",
        .hostIsDown: "EHOSTDOWN", .alreadyInProcess: "EALREADY", .nowInProgress: "EINPROGRESS",
    ]
}

extension TransportError {
    /// A call the connection does not offer at all (`.unsupported` without an errno, such as a
    /// read on `usb://…?controlOnly=true`): refused before any I/O and the same on every attempt,
    /// so neither an end of the stream nor a loss to reconnect after. An `.unsupported` that
    /// carries an errno (EOPNOTSUPP, ENOSYS from the system) is a failure like any other.
    @_spi(Plugins) public var isRefusedCall: Bool { kind == .unsupported && errno == nil }
}
