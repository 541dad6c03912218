// Helpers every test target shares (the plain suites, the CLI suites, the lab suites): polling for
// a condition, and this process's open descriptors for leak checks. Kept free of Testing and of
// TransportKit so that any target can use it.

import Foundation
import Glibc

/// Polls `condition` every `interval` for up to `seconds`; `true` as soon as it holds.
///
/// ```swift
/// #expect(await eventually { connection.isClosed })
/// ```
public func eventually(_ seconds: Double = 2, every interval: Duration = .milliseconds(10), _ condition: () -> Bool) async -> Bool {
    let deadline = ContinuousClock.now + .milliseconds(Int(seconds * 1000))
    while ContinuousClock.now < deadline {
        if condition() { return true }
        try? await Task.sleep(for: interval)
    }
    return condition()
}

/// A path for a file a test creates (a socket, a link, a FIFO), unique to this process and call,
/// in a directory of this process under the temporary directory. Nothing exists there yet.
///
/// ```swift
/// let path = temporaryPath("echo.sock")
/// ```
public func temporaryPath(_ name: String) -> String {
    let directory = FileManager.default.temporaryDirectory.path + "/tk-tests-\(getpid())"
    try? FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
    return directory + "/" + name + "-\(UInt32.random(in: 0...UInt32.max))"
}

/// This process's open file descriptors, read from /proc/self/fd.
public enum Descriptors {
    /// Each open descriptor with what it refers to ("socket:[4711]", "/dev/pts/3", …).
    ///
    /// ```swift
    /// let sockets = Descriptors.open().filter { $0.target.hasPrefix("socket:[") }
    /// ```
    public static func open() -> [(fd: Int32, target: String)] {
        let entries = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd")) ?? []
        return entries.compactMap { entry in
            guard let fd = Int32(entry),
                  let target = try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/" + entry) else { return nil }
            return (fd, target)
        }
    }

    /// What every open descriptor refers to, sorted: equal before and after means nothing leaked.
    public static func targets() -> [String] {
        open().map(\.target).sorted()
    }

    /// How many descriptors refer to `path`.
    public static func count(on path: String) -> Int {
        open().filter { $0.target == path }.count
    }
}

/// `true` when a connect(2) to 127.0.0.1:`port` succeeds: something listens there. For tests that
/// start a peer program and wait for its port.
public func portAccepts(_ port: Int) -> Bool {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
    guard fd >= 0 else { return false }
    defer { Glibc.close(fd) }
    var address = sockaddr_in()
    address.sin_family = sa_family_t(AF_INET)
    address.sin_addr.s_addr = inet_addr("127.0.0.1")
    address.sin_port = UInt16(port).bigEndian
    return withUnsafePointer(to: &address) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
    } == 0
}
