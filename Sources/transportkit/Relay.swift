import Foundation
import SystemPackage
import TransportKit

/// Standard input read one chunk at a time on a private thread: a blocking read(2) per request,
/// so at most one chunk is in flight and nothing queues up.
struct StandardInput: Sendable {
    private static let queue = DispatchQueue(label: "transportkit.stdin")

    func next() async -> [UInt8]? {
        await withCheckedContinuation { continuation in
            Self.queue.async {
                var buffer = [UInt8](repeating: 0, count: 65536)
                while true {
                    let count = buffer.withUnsafeMutableBytes { Glibc.read(0, $0.baseAddress, $0.count) }
                    if count < 0 && errno == EINTR { continue }
                    continuation.resume(returning: count > 0 ? Array(buffer[..<count]) : nil)
                    return
                }
            }
        }
    }
}

enum StandardOutput {
    /// Copies the connection's inbound bytes to standard output until the end of the stream.
    static func copy(from connection: Connection) async throws {
        while let chunk = try await connection.read() {
            try writeAll(chunk)
        }
    }

    static func writeAll(_ bytes: [UInt8]) throws {
        var offset = 0
        while offset < bytes.count {
            let written = bytes[offset...].withUnsafeBytes { Glibc.write(1, $0.baseAddress, $0.count) }
            if written < 0 {
                if errno == EINTR { continue }
                throw TransportError.posix("write", errno: Errno(rawValue: errno), what: "standard output")
            }
            offset += written
        }
    }
}

enum Relay {
    /// Runs `inbound` while copying `input` to `connection`; after the input ends, half-closes and
    /// gives `inbound` up to `linger` to finish, then closes the connection.
    static func pump(from input: StandardInput, to connection: Connection,
                     inbound: @escaping @Sendable () async throws -> Void, linger: Duration) async throws {
        try await withThrowingTaskGroup(of: Bool.self) { group in
            group.addTask {
                try await inbound()
                return true
            }
            group.addTask {
                while let chunk = await input.next() {
                    try await connection.write(chunk)
                }
                if connection.supportsHalfClose { try await connection.closeWrite() }
                try await Task.sleep(for: linger)
                return false
            }
            // Whichever ends first decides: the peer closed (inbound done), or input ended and the
            // linger passed. Either way the relay is over.
            _ = try await group.next()
            group.cancelAll()
        }
        try await connection.close()
    }

    /// Copies both ways between `a` and `b`. When one direction ends, the other side is
    /// half-closed (where it can be) and the remaining direction gets `linger` to finish.
    static func bridge(_ a: Connection, _ b: Connection, linger: Duration) async throws {
        defer {
            Task {
                try? await a.close()
                try? await b.close()
            }
        }
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask { try await copy(from: a, to: b) }
            group.addTask { try await copy(from: b, to: a) }
            try await group.next()
            let lingering = Task { try await Task.sleep(for: linger) }
            group.addTask {
                try? await lingering.value
                throw CancellationError()
            }
            do {
                try await group.next()
            } catch is CancellationError {
                // The linger passed with the other direction still open.
            }
            lingering.cancel()
            group.cancelAll()
        }
        try await a.close()
        try await b.close()
    }

    private static func copy(from source: Connection, to destination: Connection) async throws {
        while let chunk = try await source.readBuffer() {
            try await destination.write(chunk)
        }
        if destination.supportsHalfClose { try await destination.closeWrite() }
    }
}
