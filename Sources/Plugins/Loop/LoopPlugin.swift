// loop:// — an in-memory loopback: what is written is read back. The hardware-free default for
// tests, like pyserial's loop://.
//
// Grammar:  loop://[?buffer=BYTES]
//   buffer  bytes held between writer and reader (default 4096). A writer that finds the buffer
//           full suspends until the reader makes room, so a slow reader bounds memory.
// Half-close: closeWrite() makes the reader see the end after the buffered bytes.

import NIOCore
import Synchronization
import TransportKitCore

/// The `loop://` scheme.
///
/// ```swift
/// let loop = try await Transport.connect(to: "loop://?buffer=65536")
/// try await loop.write("ping")
/// let echoed = try await loop.read()   // "ping"
/// ```
public struct LoopPlugin: TransportPlugin {
    public init() {}

    public let schemes = [
        SchemeDescriptor(
            scheme: "loop",
            summary: "In-memory loopback: bytes written are read back (for tests)",
            grammar: "loop://[?buffer=BYTES]",
            examples: ["loop://", "loop://?buffer=65536"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [
                OptionSpec("buffer", .integer(min: 1, max: 64 << 20), default: "4096",
                           help: "Bytes buffered between writer and reader; writers suspend when it is full"),
            ]
        ),
    ]

    public func connect(_ request: ConnectRequest) async throws -> Connection {
        let capacity = request.options.int("buffer") ?? 4096
        return Connection(url: request.url, backend: LoopBackend(capacity: capacity),
                          metadata: ConnectionMetadata(name: "loopback", extra: ["buffer": String(capacity)]))
    }
}

/// A bounded byte ring with one reader and any number of writers; each write's bytes stay together.
final class LoopBackend: ConnectionBackend {
    let capacity: Int
    let supportsHalfClose = true
    private let state: Mutex<State>

    private struct State {
        var buffer = ByteBuffer()
        var reader: CheckedContinuation<ByteBuffer?, any Error>?
        /// Writers waiting for room (or for the active writer to finish), by id.
        var writers: [Int: CheckedContinuation<Void, any Error>] = [:]
        var cancelledWriters: Set<Int> = []
        /// The writer that copied part of its bytes and must finish before another starts.
        var activeWriter: Int?
        var nextID = 0
        var writeClosed = false
        var closed = false
    }

    init(capacity: Int) {
        self.capacity = capacity
        self.state = Mutex(State())
    }

    func read() async throws -> ByteBuffer? {
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<ByteBuffer?, any Error>) in
                let (ready, wake) = state.withLock { state -> (Result<ByteBuffer?, any Error>?, [CheckedContinuation<Void, any Error>]) in
                    if state.buffer.readableBytes > 0 {
                        let chunk = state.buffer.readSlice(length: state.buffer.readableBytes) ?? ByteBuffer()
                        state.buffer.discardReadBytes()
                        return (.success(chunk), Self.takeWriters(&state))
                    }
                    if state.writeClosed || state.closed { return (.success(nil), []) }
                    if Task.isCancelled { return (.failure(CancellationError()), []) }
                    state.reader = continuation
                    return (nil, [])
                }
                if let ready { continuation.resume(with: ready) }
                for writer in wake { writer.resume() }
            }
        } onCancel: {
            state.withLock { state in
                defer { state.reader = nil }
                return state.reader
            }?.resume(throwing: CancellationError())
        }
    }

    func write(_ buffer: ByteBuffer) async throws {
        var remaining = buffer
        let id = state.withLock { state in
            state.nextID += 1
            return state.nextID
        }
        do {
            while remaining.readableBytes > 0 {
                try await waitForTurn(id: id)
                let (reader, delivered) = try state.withLock { state -> (CheckedContinuation<ByteBuffer?, any Error>?, ByteBuffer?) in
                    if state.closed || state.writeClosed {
                        throw TransportError(.disconnected, "the loop:// connection is closed")
                    }
                    let room = capacity - state.buffer.readableBytes
                    guard room > 0, state.activeWriter == nil || state.activeWriter == id,
                          var part = remaining.readSlice(length: min(room, remaining.readableBytes)) else {
                        return (nil, nil)
                    }
                    state.activeWriter = remaining.readableBytes > 0 ? id : nil
                    if let reader = state.reader {
                        // Hand the bytes straight to the parked reader.
                        state.reader = nil
                        return (reader, part)
                    }
                    state.buffer.writeBuffer(&part)
                    return (nil, nil)
                }
                if let reader, let delivered { reader.resume(returning: delivered) }
            }
        } catch {
            let wake = state.withLock { state -> [CheckedContinuation<Void, any Error>] in
                if state.activeWriter == id { state.activeWriter = nil }
                return Self.takeWriters(&state)
            }
            for writer in wake { writer.resume() }
            throw error
        }
        let wake = state.withLock { Self.takeWriters(&$0) }
        for writer in wake { writer.resume() }
    }

    /// Returns when there is room and no other writer is mid-write, or the loop is closed.
    private func waitForTurn(id: Int) async throws {
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                let outcome = state.withLock { state -> Result<Void, any Error>? in
                    if state.closed || state.writeClosed { return .success(()) }
                    if state.cancelledWriters.remove(id) != nil || Task.isCancelled { return .failure(CancellationError()) }
                    let free = state.activeWriter == nil || state.activeWriter == id
                    if free && state.buffer.readableBytes < capacity { return .success(()) }
                    state.writers[id] = continuation
                    return nil
                }
                if let outcome { continuation.resume(with: outcome) }
            }
        } onCancel: {
            state.withLock { state -> CheckedContinuation<Void, any Error>? in
                if let writer = state.writers.removeValue(forKey: id) { return writer }
                state.cancelledWriters.insert(id)
                return nil
            }?.resume(throwing: CancellationError())
        }
    }

    private static func takeWriters(_ state: inout State) -> [CheckedContinuation<Void, any Error>] {
        defer { state.writers = [:] }
        return Array(state.writers.values)
    }

    func closeWrite() async throws {
        finish { $0.writeClosed = true }
    }

    func close() async throws {
        finish { $0.closed = true }
    }

    private func finish(_ mark: (inout State) -> Void) {
        let (reader, writers) = state.withLock { state -> (CheckedContinuation<ByteBuffer?, any Error>?, [CheckedContinuation<Void, any Error>]) in
            mark(&state)
            // The reader sees the end only once the buffer is empty; a parked reader means it is.
            defer { state.reader = nil }
            return (state.reader, Self.takeWriters(&state))
        }
        reader?.resume(returning: nil)
        for writer in writers { writer.resume() }
    }
}
