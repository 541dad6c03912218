// Posix.swift: the one helper every system call of this plugin goes through. It retries EINTR and
// turns a failure into a TransportError that names the call, errno and the object.

import Glibc
import TransportKitCore

enum Posix {
    /// Runs `body` (a system call returning -1 and setting errno on failure) until it is not
    /// interrupted; throws ``TransportError/posix(_:errno:what:hint:)`` on failure.
    @discardableResult
    static func call(_ syscall: String, what: String, hint: String? = nil, _ body: () -> Int32) throws -> Int32 {
        while true {
            let result = body()
            if result != -1 { return result }
            let code = errno
            if code == EINTR { continue }
            throw TransportError.posix(syscall, errno: code, what: what, hint: hint)
        }
    }

    /// Closes a descriptor this code owns, once. close(2) must not be retried on EINTR on Linux:
    /// the descriptor is released either way.
    static func close(_ fd: Int32) {
        _ = Glibc.close(fd)
    }

    /// The current errno as an Int32 (for calls with other failure conventions).
    static var errnoValue: Int32 { errno }
}
