/// How much of a connection's data TransportKit may hold in memory, each way: what arrived and
/// the application has not read yet, and what it wrote and the kernel has not taken yet. Plugins
/// whose backends buffer (`ChannelBackend`, `InboundQueue`) take it from
/// ``ConnectRequest/buffering``; an application picks it per connect or listen. tcp:// keeps no
/// queue of its own (the kernel's socket buffers are its queues) and takes only ``readSize``.
///
/// - ``standard``: for a few fast connections; large enough that a writer rarely waits (the tcp
///   throughput figures in BENCHMARKS.md), up to about 5 MB per connection when its peer stops reading.
/// - ``compact``: for a server with many clients, such as `transportkit bridge --listen`; about
///   300 KB per connection whose peer stops reading, at some cost in throughput.
///
/// ```swift
/// let listener = try await registry.listen(on: "unix:///run/bridge.sock", buffering: .compact)
/// let target = try await registry.connect(to: "tty:///dev/ttyUSB0?baud=115200", buffering: .compact)
/// ```
public struct Buffering: Sendable, Hashable {
    /// Bytes received and not read yet: past `high` the transport stops reading from the kernel,
    /// below `low` it reads again.
    public var inbound: Watermarks
    /// Bytes written and queued in the event loop: past `high` a writer waits, below `low` it
    /// goes on (SwiftNIO's write-buffer watermarks).
    public var outbound: Watermarks
    /// Bytes handed to the event loop and not yet written, counted by the writer: a writer off the
    /// loop sees ``outbound`` late, so past `high` it waits until `low` are left. The hard bound.
    public var inFlight: Watermarks
    /// The largest single read from the kernel, in bytes (a power of two).
    public var readSize: Int
    /// Reads from the kernel per readiness event, before the loop turns to other connections.
    public var readsPerWakeup: Int

    /// A profile; see the properties.
    public init(inbound: Watermarks, outbound: Watermarks, inFlight: Watermarks,
                readSize: Int, readsPerWakeup: Int) {
        self.inbound = inbound
        self.outbound = outbound
        self.inFlight = inFlight
        self.readSize = max(64, readSize)
        self.readsPerWakeup = max(1, readsPerWakeup)
    }

    /// 128/256 KiB in, 256/512 KiB queued out, 2/4 MiB in flight, 64 KiB reads, 4 per wakeup
    /// (SwiftNIO's own read defaults).
    public static let standard = Buffering(inbound: .standard, outbound: .init(low: 256 * 1024, high: 512 * 1024),
                                           inFlight: .init(low: 2 * 1024 * 1024, high: 4 * 1024 * 1024), readSize: 65536, readsPerWakeup: 4)

    /// 32/64 KiB in, 32/64 KiB queued out, 64/128 KiB in flight, 64 KiB reads, one per wakeup.
    public static let compact = Buffering(inbound: .init(low: 32 * 1024, high: 64 * 1024), outbound: .init(low: 32 * 1024, high: 64 * 1024),
                                          inFlight: .init(low: 64 * 1024, high: 128 * 1024), readSize: 65536, readsPerWakeup: 1)
}

extension Buffering {
    /// Where a producer is asked to pause and to resume, in bytes waiting.
    public struct Watermarks: Sendable, Hashable {
        /// A paused producer is resumed once fewer bytes than this wait.
        public let low: Int
        /// The producer is asked to pause once this many bytes wait.
        public let high: Int

        /// Watermarks with `0 < low <= high` (`low == high`: resume as soon as there is room).
        ///
        /// ```swift
        /// let small = Buffering.Watermarks(low: 2048, high: 4096)
        /// ```
        public init(low: Int, high: Int) {
            precondition(low > 0 && low <= high, "Buffering.Watermarks needs 0 < low <= high (got \(low), \(high))")
            self.low = low
            self.high = high
        }

        /// 128 KiB and 256 KiB: what a socket's own buffers hold, so a fast peer is not stalled by
        /// the hand-over while a slow application still bounds memory.
        public static let standard = Watermarks(low: 128 * 1024, high: 256 * 1024)
    }
}
