import Foundation
import TransportKit

/// The copy loops behind `connect` and `bridge`. A relay has two directions; when one ends, the
/// other gets the linger to finish, and then the relay is over. An error in either direction ends
/// it at once, and so does a watcher that throws (standard output closing). Every wait in it can be
/// cancelled, so a relay ends at once when its task is (a signal).
enum Relay {
    /// Relays standard input to `connection` and the connection to standard output.
    ///
    /// The relay ends when the peer closes (after the linger for the rest of standard input), when
    /// standard input ends (after the linger for the peer's answer), at once when standard output
    /// closes (`StandardStreamError.outputClosed`), or with the connection's error. The connection
    /// is closed in every case.
    static func pump(_ connection: Connection, linger: Duration) async throws {
        let input = StandardInput()
        try await closing([connection]) {
            try await run(
                { try await StandardOutput.copy(from: connection) },
                {
                    while let chunk = try await input.next() {
                        try await connection.write(chunk)
                    }
                    if connection.supportsHalfClose { try await connection.closeWrite() }
                },
                linger: linger,
                watchers: [{ try await StandardOutput.waitUntilClosed() }]
            )
        }
    }

    /// Copies both ways between `a` and `b`. When one direction ends, the other side is
    /// half-closed (where it can be) and the remaining direction gets `linger` to finish. Both
    /// connections are closed in every case.
    static func bridge(_ a: Connection, _ b: Connection, linger: Duration) async throws {
        try await closing([a, b]) {
            try await run({ try await copy(from: a, to: b) }, { try await copy(from: b, to: a) }, linger: linger)
        }
    }

    /// Runs `body`, then closes `connections` whether it succeeded, failed or was cancelled.
    static func closing(_ connections: [Connection], _ body: () async throws -> Void) async throws {
        do {
            try await body()
        } catch {
            for connection in connections { try? await connection.close() }
            throw error
        }
        for connection in connections { try await connection.close() }
    }

    private struct LingerPassed: Error {}

    /// Runs both directions; see the type's description.
    static func run(_ first: @escaping @Sendable () async throws -> Void,
                    _ second: @escaping @Sendable () async throws -> Void,
                    linger: Duration,
                    watchers: [@Sendable () async throws -> Void] = []) async throws {
        try await withThrowingTaskGroup(of: Void.self) { group in
            group.addTask(operation: first)
            group.addTask(operation: second)
            for watcher in watchers { group.addTask(operation: watcher) }
            // One direction ended. (A watcher returns only when cancelled.) An error here leaves
            // the group, which cancels the rest.
            try await group.next()
            group.addTask {
                try await Task.sleep(for: linger)
                throw LingerPassed()
            }
            do {
                try await group.next()
            } catch is LingerPassed {
                // The linger passed with the other direction still open.
            }
            group.cancelAll()
        }
    }

    /// Copies `source` to `destination` until the source ends, then half-closes the destination
    /// (a destination whose peer already closed both ways takes that as done).
    private static func copy(from source: Connection, to destination: Connection) async throws {
        while let chunk = try await source.readBuffer() {
            try await destination.write(chunk)
        }
        if destination.supportsHalfClose { try await destination.closeWrite() }
    }
}
