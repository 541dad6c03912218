import Foundation
import Synchronization
import TransportKit
@_spi(Plugins) import TransportKitCore

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
    ///
    /// With `textLines` (`connect --text`, for transports whose messages have kinds), each line of
    /// standard input goes out as one text message, and each message read is printed with a newline.
    static func pump(_ connection: Connection, linger: Duration, textLines: Bool = false) async throws {
        let input = StandardInput()
        try await closing([connection]) {
            try await run(
                { try await StandardOutput.copy(from: connection, lines: textLines) },
                {
                    // However this direction ends, the read-ahead thread stops: it would go on
                    // taking what the shell (or the next program of a script) should read.
                    defer { input.cancel() }
                    var lines = LineSplitter()
                    while let chunk = try await input.next() {
                        guard textLines else {
                            try await deliver(chunk.readableBytes, to: connection) { try await connection.write(chunk) }
                            continue
                        }
                        for line in lines.feed(Array(chunk.readableBytesView)) {
                            try await deliver(line.utf8.count, to: connection) { try await connection.writeMessage(.text(line)) }
                        }
                    }
                    if textLines, let rest = lines.rest() {
                        try await deliver(rest.utf8.count, to: connection) { try await connection.writeMessage(.text(rest)) }
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
    /// connections are closed in every case; `beforeClosing` runs first, however the relay ended
    /// (an RFC 2217 session releases the break its client left on while the port is still open).
    static func bridge(_ a: Connection, _ b: Connection, linger: Duration, beforeClosing: (@Sendable () async -> Void)? = nil) async throws {
        try await closing([a, b]) {
            do {
                try await run({ try await copy(from: a, to: b) }, { try await copy(from: b, to: a) }, linger: linger)
            } catch {
                await beforeClosing?()
                throw error
            }
            await beforeClosing?()
        }
    }

    /// How long closing may wait for a peer to take the bytes still queued for it.
    static let closeLimit: Duration = .seconds(2)
    /// How long a close with nothing left to send may go on releasing the transport (a Bluetooth
    /// LE disconnect takes bluetoothd two seconds) before the tool stops waiting for it.
    static let releaseLimit: Duration = .seconds(10)

    /// Runs `body`, then closes `connections` whether it succeeded, failed or was cancelled.
    static func closing(_ connections: [Connection], _ body: () async throws -> Void) async throws {
        do {
            try await body()
        } catch {
            _ = await close(connections)
            throw error
        }
        if let failure = await close(connections) { throw failure }
    }

    /// Closes `connections` side by side, each within ``closeLimit``: a peer that stopped reading
    /// (a client suspended with Ctrl-Z) would otherwise hold a close, and with it a tty's restore
    /// and the tool's exit, forever. One that takes longer is aborted, its queued bytes dropped,
    /// and that is the failure; one with nothing left to send gets ``releaseLimit`` more to release
    /// its transport, and is then left with a warning, not a failure. Returns the first failure.
    static func close(_ connections: [Connection]) async -> (any Error)? {
        await withTaskGroup(of: (any Error)?.self) { group in
            for connection in connections {
                group.addTask {
                    let outcome = Outcome()
                    let closing = Task {
                        do {
                            try await connection.close()
                            outcome.settle(nil)
                        } catch {
                            outcome.settle(error)
                        }
                    }
                    let timer = Task {
                        try await Task.sleep(for: closeLimit)
                        let shown = connection.url.shown
                        switch connection.unsentByteCount {
                        case 0?:
                            try await Task.sleep(for: releaseLimit)
                            StandardError.write("transportkit: releasing \(shown) took longer than \(closeLimit + releaseLimit) (nothing was left to send); not waiting for it\n")
                            outcome.settle(nil)
                        case let unsent?:
                            // Settled first: the relay goes on even if releasing takes a while.
                            outcome.settle(TransportError(.timedOut, "closing \(shown) took longer than \(closeLimit): its peer did not take the last \(unsent) bytes queued for it; they were dropped"))
                        case nil:
                            outcome.settle(TransportError(.timedOut, "closing \(shown) took longer than \(closeLimit): its peer is not taking the bytes queued for it; those not yet delivered were dropped"))
                        }
                        connection.abort()
                    }
                    let result = await outcome.value()
                    timer.cancel()
                    _ = closing
                    return result
                }
            }
            var first: (any Error)?
            for await failure in group where first == nil { first = failure }
            return first
        }
    }

    /// The first of two outcomes, awaited once.
    private final class Outcome: Sendable {
        private struct State {
            var result: (any Error)??
            var waiter: CheckedContinuation<(any Error)?, Never>?
        }
        /// Guards the result and the one waiter.
        private let state = Locked(State())

        func settle(_ error: (any Error)?) {
            let waiter = state.withLock { state -> CheckedContinuation<(any Error)?, Never>? in
                guard state.result == nil else { return nil }
                state.result = .some(error)
                defer { state.waiter = nil }
                return state.waiter
            }
            waiter?.resume(returning: error)
        }

        func value() async -> (any Error)? {
            await withCheckedContinuation { continuation in
                let ready = state.withLock { state -> (any Error)?? in
                    if let result = state.result { return .some(result) }
                    state.waiter = continuation
                    return nil
                }
                if let ready { continuation.resume(returning: ready) }
            }
        }
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

    /// Runs `write`; on a `reconnect+` connection a write that the lost link cut short
    /// (`.disconnected`) is reported, not fatal: its bytes are gone (they are never sent twice),
    /// and the relay goes on with the next connection.
    private static func deliver(_ count: Int, to destination: Connection, _ write: () async throws -> Void) async throws {
        do {
            try await write()
        } catch let error as TransportError where error.kind == .disconnected && destination.url.hasLayer("reconnect") {
            StandardError.write("transportkit: \(count) bytes to \(destination.url.shown) were not delivered: \(error.message)\n")
        }
    }

    /// Copies `source` to `destination` until the source ends, then half-closes the destination
    /// (a destination whose peer already closed both ways takes that as done).
    private static func copy(from source: Connection, to destination: Connection) async throws {
        if source.carriesMessages, destination.carriesMessages, destination.maximumWriteSize == nil {
            // Message to message (ws:// to ws://): each one whole, text kept text.
            while let message = try await source.nextMessage() {
                try await destination.writeMessage(message)
            }
        } else {
            while let chunk = try await source.readBuffer() {
                try await deliver(chunk.readableBytes, to: destination) { try await destination.write(chunk) }
            }
        }
        if destination.supportsHalfClose { try await destination.closeWrite() }
    }
}

/// Cuts standard input into lines (without their `\n`, and a `\r` before it), for `connect --text`.
struct LineSplitter {
    private var pending: [UInt8] = []

    /// The complete lines in `chunk` after what came before; the rest waits for more.
    mutating func feed(_ chunk: [UInt8]) -> [String] {
        pending += chunk
        var lines: [String] = []
        while let end = pending.firstIndex(of: UInt8(ascii: "\n")) {
            var line = pending[..<end]
            if line.last == UInt8(ascii: "\r") { line = line.dropLast() }
            lines.append(String(decoding: line, as: UTF8.self))
            pending.removeSubrange(...end)
        }
        return lines
    }

    /// A last line without a newline, if any.
    mutating func rest() -> String? {
        defer { pending = [] }
        return pending.isEmpty ? nil : String(decoding: pending, as: UTF8.self)
    }
}
