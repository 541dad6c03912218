// The floor under a task-based socket backend that owns its descriptors: 32-byte round trips over
// raw loopback TCP sockets, each end a task that sends with send(2) from its own thread and, when
// recv(2) finds nothing, parks on TransportKitLinux's readiness poller (FileDescriptor.wait). No
// Connection, no buffers beyond one array: what such a backend could reach with Swift's default
// executor, beside the C loop and TransportKit's NIO-based tcp:// in the same run.

import CBenchLoops
import Glibc
import SystemPackage
import TransportKit
@_spi(Plugins) import TransportKitLinux

enum PollerBench {
    /// Round trips with both ends as tasks, or (`peerInC`) a task client against the C echo thread.
    static func roundTrips(peerInC: Bool) async throws -> Double {
        let client: Int32
        var echo: Task<Void, any Error>?
        if peerInC {
            client = tk_bench_c_connect(tk_bench_c_echo_server())
        } else {
            var pair: [Int32] = [-1, -1]
            guard tk_bench_c_tcp_pair(&pair) == 0 else { throw TransportError(.io, "tk_bench_c_tcp_pair failed") }
            client = pair[0]
            let server = pair[1]
            try nonBlocking(server)
            echo = Task {
                defer { close(server) }
                var buffer = [UInt8](repeating: 0, count: 32)
                while try await exchange(server, &buffer, sendFirst: false) {}
            }
        }
        guard client >= 0 else { throw TransportError(.io, "connect failed") }
        defer { close(client) }
        try nonBlocking(client)
        var buffer = [UInt8](repeating: 7, count: 32)
        let start = ContinuousClock.now
        for _ in 0..<rounds {
            guard try await exchange(client, &buffer, sendFirst: true) else { throw TransportError(.disconnected, "echo closed") }
        }
        let elapsed = ContinuousClock.now - start
        shutdown(client, Int32(SHUT_RDWR))
        try await echo?.value
        return elapsed.seconds
    }

    private static func nonBlocking(_ fd: Int32) throws {
        _ = try Syscall.run("fcntl", on: "a bench socket") { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) }
    }

    /// The client sends 32 bytes then reads 32; the echo reads 32 then sends them. `false` at end of stream.
    private static func exchange(_ fd: Int32, _ buffer: inout [UInt8], sendFirst: Bool) async throws -> Bool {
        if sendFirst { try await sendAll(fd, buffer) }
        var got = 0
        while got < 32 {
            let count = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress.map { $0 + got }, 32 - got, 0) }
            if count > 0 {
                got += count
            } else if count == 0 {
                return false
            } else if errno == EAGAIN {
                try await FileDescriptor(rawValue: fd).wait(until: .readable)
            } else {
                return false
            }
        }
        if !sendFirst { try await sendAll(fd, buffer) }
        return true
    }

    private static func sendAll(_ fd: Int32, _ buffer: [UInt8]) async throws {
        var sent = 0
        while sent < buffer.count {
            let count = buffer.withUnsafeBytes { send(fd, $0.baseAddress.map { $0 + sent }, buffer.count - sent, Int32(MSG_NOSIGNAL)) }
            if count >= 0 {
                sent += count
            } else if errno == EAGAIN {
                try await FileDescriptor(rawValue: fd).wait(until: .writable)
            } else {
                throw TransportError.posix("send", errno: Syscall.errno, what: "a bench socket")
            }
        }
    }
}
