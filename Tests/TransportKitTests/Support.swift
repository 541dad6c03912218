import Foundation
import Glibc
import SystemPackage
import TestSupport
import Testing
@testable import TransportKit

/// Test helpers built on plain system calls, independent of the code under test.
enum Support {
    /// Runs a blocking call on a thread of its own. Blocking a cooperative-pool thread starves the
    /// whole run (on a 2-core machine that pool has two threads), and on Linux so does blocking in
    /// `DispatchQueue.global()`: Swift's global executor runs on that same width-limited queue.
    static func offPool<T: Sendable>(_ body: @escaping @Sendable () -> T) async -> T {
        await withCheckedContinuation { continuation in
            Thread { continuation.resume(returning: body()) }.start()
        }
    }

    /// A listening TCP socket on 127.0.0.1 made with plain system calls.
    struct RawListener {
        let fd: Int32
        let port: Int

        /// `listening: false` binds without listen(2): the port stays this test's (no other test's
        /// listener on port 0 can be given it) and a connect to it is refused (an RST).
        init(backlog: Int32 = 16, listening: Bool = true) throws {
            // SOCK_CLOEXEC on every test socket: other tests spawn processes, and an inherited
            // duplicate would keep a "closed" socket open (no FIN, no RST) for as long as they run.
            fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
            guard fd >= 0 else { throw TransportError.posix("socket", errno: Errno(rawValue: errno), what: "test listener") }
            var address = sockaddr_in()
            address.sin_family = sa_family_t(AF_INET)
            address.sin_addr.s_addr = inet_addr("127.0.0.1")
            let socketFD = fd
            let bound = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(socketFD, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
            }
            guard bound == 0, !listening || Glibc.listen(fd, backlog) == 0 else {
                throw TransportError.posix("bind/listen", errno: Errno(rawValue: errno), what: "test listener")
            }
            var length = socklen_t(MemoryLayout<sockaddr_in>.size)
            _ = withUnsafeMutablePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(socketFD, $0, &length) }
            }
            port = Int(UInt16(bigEndian: address.sin_port))
        }

        /// Waits for a client; the blocking accept(2) runs off the cooperative pool.
        func accept() async -> Int32 {
            await Support.accept(on: fd)
        }

        func close() { _ = Glibc.close(fd) }
    }

    /// Accepts a client on listening socket `fd`; the blocking accept(2) runs off the cooperative pool.
    static func accept(on fd: Int32) async -> Int32 {
        await offPool {
            // accept4(2) is not visible from Swift's Glibc module; set FD_CLOEXEC right after.
            let client = Glibc.accept(fd, nil, nil)
            if client >= 0 { _ = fcntl(client, F_SETFD, FD_CLOEXEC) }
            return client
        }
    }

    /// A plain blocking client socket connected to 127.0.0.1:`port` (non-blocking when asked, so
    /// connects to a full backlog return at once).
    static func rawConnect(port: Int, nonBlocking: Bool = false) -> Int32 {
        let flags = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | (nonBlocking ? Int32(SOCK_NONBLOCK.rawValue) : 0)
        let fd = socket(AF_INET, flags, 0)
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = UInt16(port).bigEndian
        _ = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        return fd
    }

    /// Closes `fd` with SO_LINGER 0, so the peer gets a reset (RST) instead of an orderly end.
    static func resetClose(_ fd: Int32) {
        var linger = Glibc.linger(l_onoff: 1, l_linger: 0)
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &linger, socklen_t(MemoryLayout<Glibc.linger>.size))
        _ = Glibc.close(fd)
    }

    static func writeAll(_ fd: Int32, _ bytes: [UInt8]) {
        var offset = 0
        while offset < bytes.count {
            let count = bytes[offset...].withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
            if count <= 0 { return }
            offset += count
        }
    }

    /// One read(2) of what is there (up to 64 KiB), off the cooperative pool; empty at the end.
    static func readSome(_ fd: Int32) async -> [UInt8] {
        await offPool {
            var buffer = [UInt8](repeating: 0, count: 65536)
            let count = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            return count > 0 ? Array(buffer[..<count]) : []
        }
    }

    /// Reads until the end of the stream; the blocking reads run off the cooperative pool.
    static func readAll(_ fd: Int32) async -> [UInt8] {
        await offPool { readAllBlocking(fd) }
    }

    private static func readAllBlocking(_ fd: Int32) -> [UInt8] {
        var result: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            if count < 0 && errno == EINTR { continue }
            if count <= 0 { return result }
            result += buffer[..<count]
        }
    }

    /// A TCP port whose SYNs go unanswered: a listener with a zero backlog, already full, that
    /// never accepts. Connects to it hang until their timeout. Keep the returned fds open.
    static func blackHole() async throws -> (listener: RawListener, fillers: [Int32]) {
        let listener = try RawListener(backlog: 0)
        var fillers: [Int32] = []
        for _ in 0..<4 {
            fillers.append(rawConnect(port: listener.port, nonBlocking: true))
            try await Task.sleep(for: .milliseconds(20))
        }
        return (listener, fillers)
    }

    /// The number of this process's file descriptors that are connected (or connecting) TCP
    /// sockets with `port` at either end; listening sockets are not counted. Precise where a plain
    /// fd count is not (tests run in parallel).
    static func openSockets(port: Int, excluding: [Int32] = []) -> Int {
        let inodes = socketInodes(table: ["/proc/net/tcp", "/proc/net/tcp6"]) { fields in
            let hexPort = String(format: "%04X", port)
            let listening = fields[3] == "0A"
            return !listening && (fields[1].hasSuffix(":" + hexPort) || fields[2].hasSuffix(":" + hexPort))
        }
        return ownSocketInodes(excluding: excluding).filter(inodes.contains).count
    }

    /// The number of this process's file descriptors that are Unix sockets bound to `path`.
    static func openUnixSockets(path: String) -> Int {
        let inodes = socketInodes(table: ["/proc/net/unix"]) { fields in fields.count > 7 && fields[7] == path }
        return ownSocketInodes().filter(inodes.contains).count
    }

    private static func socketInodes(table paths: [String], matching: ([String]) -> Bool) -> Set<String> {
        var inodes = Set<String>()
        for path in paths {
            guard let text = try? String(contentsOfFile: path, encoding: .utf8) else { continue }
            for line in text.split(separator: "\n").dropFirst() {
                let fields = line.split(separator: " ").map(String.init)
                guard fields.count > 9 else { continue }
                if matching(fields) { inodes.insert(path.hasSuffix("unix") ? fields[6] : fields[9]) }
            }
        }
        return inodes
    }

    private static func ownSocketInodes(excluding: [Int32] = []) -> [String] {
        Descriptors.open().filter { !excluding.contains($0.fd) && $0.target.hasPrefix("socket:[") }.map {
            String($0.target.dropFirst("socket:[".count).dropLast())
        }
    }

    static func temporaryPath(_ name: String) -> String {
        TestSupport.temporaryPath(name) + ".sock"
    }
}

/// Expects `body` to throw a TransportError of `kind`; returns it for further checks.
@discardableResult
func expectTransportError<T>(_ kind: TransportError.Kind, sourceLocation: SourceLocation = #_sourceLocation,
                             _ body: () async throws -> T) async -> TransportError? {
    do {
        _ = try await body()
        Issue.record("expected a \(kind) error, got success", sourceLocation: sourceLocation)
    } catch let error as TransportError {
        #expect(error.kind == kind, "wrong kind: \(error)", sourceLocation: sourceLocation)
        return error
    } catch {
        Issue.record("expected a TransportError, got \(error)", sourceLocation: sourceLocation)
    }
    return nil
}
