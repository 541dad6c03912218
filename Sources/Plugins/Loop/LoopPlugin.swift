// loop:// — an in-memory loopback: what is written is read back. The hardware-free default for
// tests, like pyserial's loop://.
//
// Grammar:  loop://[?buffer=BYTES&messages=BOOL&maxWrite=BYTES] (maxWrite was mtu before)
//   buffer    bytes held between writer and reader (default 4096). A writer that finds the buffer
//             full suspends until the reader makes room, so a slow reader bounds memory.
//   messages  each write is read back as one message (readMessage), as on a SEQPACKET socket.
//   maxWrite  the largest write the loop takes at once; longer writes are chunked by the connection,
//             as on a BLE or L2CAP link. Shown as metadata.maximumWriteSize.
// Half-close: closeWrite() makes the reader see the end after the buffered bytes.

import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore

/// The `loop://` scheme.
///
/// ```swift
/// let loop = try await Transport.connect(to: "loop://?buffer=65536")
/// try await loop.write("ping")
/// let echoed = try await loop.read()   // "ping"
/// ```
public struct LoopPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    /// `buffer`: bytes held between writer and reader, 1…64 MiB, default 4096.
    @_spi(Plugins) public static let buffer = URLOption.integer("buffer", in: 1...(64 << 20), default: 4096,
                                                                help: "Bytes buffered between writer and reader; writers suspend when it is full")
    /// `messages`: each write is read back as one message.
    @_spi(Plugins) public static let messages = URLOption.bool("messages", default: false, help: "Carry messages: each write is read back whole by readMessage()")
    /// `maxWrite` (formerly `mtu`): the largest write taken at once; longer writes are chunked.
    @_spi(Plugins) public static let maxWrite = URLOption.integer("maxWrite", in: 1...(64 << 20),
                                                                  help: "Largest write taken at once; longer writes are chunked (metadata.maximumWriteSize)").formerly("mtu")
    /// The option's name before it became `maxWrite`.
    @available(*, deprecated, renamed: "maxWrite")
    @_spi(Plugins) public static var mtu: URLOption<Int?> { maxWrite }

    /// The `loop` scheme.
    public var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(
            scheme: "loop",
            summary: "In-memory loopback: bytes written are read back (for tests)",
            grammar: "loop://[?buffer=BYTES&messages=BOOL&maxWrite=BYTES]",
            examples: ["loop://", "loop://?buffer=65536", "loop://?messages=true&maxWrite=20"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [Self.buffer, Self.messages, Self.maxWrite]
        )) { request in
            let capacity = request[Self.buffer]
            let mtu = request[Self.maxWrite]
            var extra = ["buffer": String(capacity)]
            if request[Self.messages] { extra["messages"] = "true" }
            return Connection(url: request.url, backend: LoopBackend(capacity: capacity, messages: request[Self.messages], mtu: mtu),
                              metadata: ConnectionMetadata(name: "loopback", maximumWriteSize: mtu, extra: extra))
        }]
    }

    /// A `loop://?buffer=BYTES` connection made at once, without a registry: what is written is
    /// read back, at most `buffer` bytes wait in between. TransportKitFoundation's bound stream
    /// pair is one.
    ///
    /// ```swift
    /// let loop = LoopPlugin.makeConnection(buffer: 4096)
    /// ```
    public static func makeConnection(buffer: Int = 4096) -> Connection {
        let capacity = min(max(1, buffer), 64 << 20)
        let url = TransportURL(scheme: "loop", query: [("buffer", String(capacity))])
        return Connection(url: url, backend: LoopBackend(capacity: capacity, messages: false, mtu: nil),
                          metadata: ConnectionMetadata(name: "loopback", extra: ["buffer": String(capacity)]))
    }
}

/// A bounded ring with one reader and any number of writers; each write's bytes stay together.
/// The ring is an ``InboundQueue`` whose high watermark is the capacity; writers wait at a
/// ``WriterGate`` for room and for their turn.
final class LoopBackend: ConnectionBackend {
    let capacity: Int
    let supportsHalfClose = true
    let carriesMessages: Bool
    let maximumWriteSize: Int?
    /// A write returns once its bytes are in the buffer the reader reads: none wait to be sent.
    let unsentByteCount: Int? = 0
    /// Bytes in the buffer that the reader has not read.
    var unreadByteCount: Int? { inbound.bufferedBytes }
    private let inbound: InboundQueue
    private let writers: WriterGate
    private let turn = Locked(Turn())

    private struct Turn {
        /// The writer that queued part of its bytes and must finish before another starts.
        var active: Int?
        var nextID = 0
        var ended = false
    }

    init(capacity: Int, messages: Bool, mtu: Int?) {
        let writers = WriterGate()
        self.capacity = capacity
        self.carriesMessages = messages
        self.maximumWriteSize = mtu
        self.writers = writers
        // Paused once the ring is full; resumed (writers woken) as soon as the reader made room.
        self.inbound = InboundQueue(watermarks: .init(low: capacity, high: capacity), messages: messages) {
            writers.signal()
        }
    }

    func read() async throws -> ByteBuffer? {
        try await inbound.next()
    }

    func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        try await inbound.next(deadline: deadline).map { TransportMessage(.binary, $0) }
    }

    func write(_ buffer: ByteBuffer) async throws {
        let id = turn.withLock { turn in
            turn.nextID += 1
            return turn.nextID
        }
        var rest = buffer
        defer {
            // A cancelled or failed writer gives up its turn.
            let released = turn.withLock { turn in
                guard turn.active == id else { return false }
                turn.active = nil
                return true
            }
            if released { writers.signal() }
        }
        repeat {
            try await writers.wait { [self] in
                turn.withLock { turn in
                    turn.ended || ((turn.active == nil || turn.active == id) && inbound.bufferedBytes < capacity)
                }
            }
            // Room and turn are checked again and the bytes queued under the same lock, so two
            // writers never both fill the same room.
            let finishedTurn = try turn.withLock { turn -> Bool in
                if turn.ended { throw TransportError(.disconnected, "the loop:// connection is closed") }
                let room = capacity - inbound.bufferedBytes
                guard turn.active == nil || turn.active == id, room > 0 else { return false }
                // A message goes whole; bytes fill the room and the writer keeps its turn for the rest.
                let piece = carriesMessages ? rest.readSlice(length: rest.readableBytes) : rest.readSlice(length: min(room, rest.readableBytes))
                let wasActive = turn.active == id
                turn.active = rest.readableBytes > 0 ? id : nil
                inbound.append(piece ?? ByteBuffer())
                return wasActive && turn.active == nil
            }
            if finishedTurn { writers.signal() }
        } while rest.readableBytes > 0
    }

    func closeWrite() async throws {
        end()
    }

    func close() async throws {
        end()
        inbound.discardBuffered()
    }

    /// Dropped or aborted: wake a parked reader and writer at once.
    func connectionDropped() {
        end()
        inbound.discardBuffered()
    }

    private func end() {
        turn.withLock { $0.ended = true }
        inbound.finish()
        writers.fail(TransportError(.disconnected, "the loop:// connection is closed"))
    }
}
