// Helpers every test target shares (the plain suites, the CLI suites, the lab suites): polling for
// a condition, and this process's open descriptors for leak checks. Kept free of Testing and of
// TransportKit so that any target can use it.

import Foundation
import Glibc
import Synchronization
@_spi(Plugins) import TransportKitCore

/// How many times longer than written a wait for a condition lasts before it gives up: 3, or
/// `TK_TEST_PATIENCE`. The suites run in parallel on two cores and once more under
/// ThreadSanitizer, where CI once found the cooperative pool 10 s late. A condition that holds ends
/// the wait at once, so only a test that fails waits the longer time.
public let testPatience: Double = ProcessInfo.processInfo.environment["TK_TEST_PATIENCE"].flatMap(Double.init)
    .flatMap { $0.isFinite ? min(max($0, 1), 100) : nil } ?? 3

/// Polls `condition` every `interval` for up to `seconds` (times ``testPatience``); `true` as
/// soon as it holds.
///
/// ```swift
/// #expect(await eventually { connection.isClosed })
/// ```
public func eventually(_ seconds: Double = 2, every interval: Duration = .milliseconds(10), _ condition: () -> Bool) async -> Bool {
    let deadline = ContinuousClock.now + .milliseconds(Int(seconds * testPatience * 1000))
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

/// A peer program did not say it was ready.
public struct PeerNotReady: Error, CustomStringConvertible {
    public var description: String
}

/// Runs `body` with the port of a peer program (a python server no one here wrote) started with
/// `arguments`; the peer prints "ready PORT" once it listens on the port it chose. The peer is
/// killed when `body` returns or throws.
///
/// ```swift
/// try await withPeer([script, "serve", "0"]) { port in … }
/// ```
public func withPeer(_ arguments: [String], executable: String = "/usr/bin/python3", _ body: (Int) async throws -> Void) async throws {
    let log = temporaryPath("peer.out")
    _ = FileManager.default.createFile(atPath: log, contents: nil)
    defer { unlink(log) }
    let server = Process()
    server.executableURL = URL(fileURLWithPath: executable)
    server.arguments = arguments
    server.standardOutput = try FileHandle(forWritingTo: URL(fileURLWithPath: log))
    server.standardError = FileHandle.nullDevice
    try server.run()
    defer { kill(server.processIdentifier, SIGKILL) }
    var port: Int?
    let ready = await eventually(10, every: .milliseconds(20)) {
        let text = (try? String(contentsOfFile: log, encoding: .utf8)) ?? ""
        // Whole lines only: a print may reach the file in pieces.
        let lines = text.split(separator: "\n", omittingEmptySubsequences: false).dropLast()
        port = lines.first { $0.hasPrefix("ready ") }?.split(separator: " ").last.flatMap { Int($0) }
        return port.map(portAccepts) ?? false
    }
    guard ready, let port else {
        throw PeerNotReady(description: "\(executable) \(arguments.joined(separator: " ")) did not print 'ready PORT' and listen within \(Int(10 * testPatience)) s")
    }
    try await body(port)
}

/// Gathers what a sequence yields (notifications, a server's or a device's events) in a task of
/// its own, so a test waits for it with a limit instead of hanging on `next()`.
public final class Gathered<Element: Sendable>: Sendable {
    private let state = Locked<(elements: [Element], failure: (any Error)?, ended: Bool)>(([], nil, false))
    private let task: Locked<Task<Void, Never>?> = Locked(nil)

    public init<S: AsyncSequence & Sendable>(_ sequence: S) where S.Element == Element {
        let consumer = Task { [self] in
            do {
                for try await element in sequence { self.state.withLock { $0.elements.append(element) } }
            } catch {
                self.state.withLock { $0.failure = error }
            }
            self.state.withLock { $0.ended = true }
        }
        task.withLock { $0 = consumer }
    }

    public var elements: [Element] { state.withLock { $0.elements } }
    public var failure: (any Error)? { state.withLock { $0.failure } }
    public var ended: Bool { state.withLock { $0.ended } }

    /// Waits up to `seconds` until `condition` holds for what came so far.
    public func wait(_ seconds: Double = 5, until condition: @escaping ([Element]) -> Bool) async -> Bool {
        await eventually(seconds, every: .milliseconds(50)) { condition(self.elements) }
    }

    public func stop() { task.withLock { $0?.cancel() } }
}

/// Runs a program to its end on a thread of its own, with standard output to /dev/null: its exit
/// status (-1 when it could not start). posix_spawn and waitpid, not Foundation's Process, whose
/// waitUntilExit never returns when the test bundle runs outside `swift test`; no output pipe,
/// which daemons a set-up script starts would inherit and hold open.
public func runToEnd(_ executable: String, _ arguments: [String]) async -> Int32 {
    await withCheckedContinuation { continuation in
        Thread {
            var actions = posix_spawn_file_actions_t()
            posix_spawn_file_actions_init(&actions)
            posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0)
            // Nothing of this process's past descriptor 2: NIO's sockets are not close-on-exec, and
            // a daemon started here (tmux's server) would keep a test's listening port open after
            // the test closed it, so that another test's reconnects found it still accepting.
            // (glibc 2.34's posix_spawn_file_actions_addclosefrom_np, which Swift's Glibc module
            // does not declare: looked up by name.)
            typealias CloseFrom = @convention(c) (UnsafeMutablePointer<posix_spawn_file_actions_t>?, Int32) -> Int32
            if let symbol = dlsym(nil, "posix_spawn_file_actions_addclosefrom_np") {
                _ = unsafeBitCast(symbol, to: CloseFrom.self)(&actions, 3)
            }
            let argv: [UnsafeMutablePointer<CChar>?] = ([executable] + arguments).map { strdup($0) } + [nil]
            defer {
                argv.forEach { free($0) }
                posix_spawn_file_actions_destroy(&actions)
            }
            // The calling thread blocks signals (dispatch's threads do), and a child inherits that
            // mask: daemons a script starts would then ignore SIGTERM. The child starts with none
            // blocked and every signal at its default.
            var attributes = posix_spawnattr_t()
            posix_spawnattr_init(&attributes)
            defer { posix_spawnattr_destroy(&attributes) }
            var none = sigset_t()
            sigemptyset(&none)
            var all = sigset_t()
            sigfillset(&all)
            posix_spawnattr_setsigmask(&attributes, &none)
            posix_spawnattr_setsigdefault(&attributes, &all)
            posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))
            var pid: pid_t = 0
            guard posix_spawn(&pid, executable, &actions, &attributes, argv, environ) == 0 else {
                continuation.resume(returning: -1)
                return
            }
            var status: Int32 = 0
            while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
            // WIFEXITED and WEXITSTATUS, which Glibc's macros do not export.
            continuation.resume(returning: status & 0x7f == 0 ? (status >> 8) & 0xff : -1)
        }.start()
    }
}
