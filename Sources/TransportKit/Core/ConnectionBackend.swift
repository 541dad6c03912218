import NIOCore
import SystemPackage

/// The error a backend reports when its device, link or peer goes away without a close of ours:
/// given the errno and the system call when there was one (`nil` for a plain end of stream).
/// ``ChannelBackend`` and `PacketSocketBackend` take one, so that every read and write of a
/// connection to a serial adapter or a Bluetooth device says the same thing when it is gone.
///
/// ```swift
/// let hangUp: HangUp = { errno, syscall in
///     TransportError(.disconnected, "serial port \(path) went away; reconnect when it is back", errno: errno, syscall: syscall)
/// }
/// ```
@_spi(Plugins)
public typealias HangUp = @Sendable (_ errno: Errno?, _ syscall: String?) -> TransportError

/// What a plugin implements to carry bytes. ``Connection`` wraps it with everything else
/// (counters, leftovers, read timeouts, message reads, chunking to the MTU, closing exactly once).
///
/// Contract:
/// - `read()` returns the next chunk (or message) of inbound bytes, `nil` at the end of the
///   stream, and throws a ``TransportError`` when the stream ended abnormally. It is called by one
///   task at a time, must return bytes that already arrived before reporting an end or error, and
///   must honour task cancellation (throw `CancellationError` without consuming bytes). An
///   ``InboundQueue`` does all of this.
/// - `write(_:)` suspends while the transport's bounded buffer is full (a ``WriterGate``); returning
///   means the bytes were accepted into that buffer. It never gets more than
///   ``maximumWriteSize`` bytes: a larger write goes to ``writeRecords(_:accepted:)``, whose
///   default cuts it into records and calls `write(_:)` for each.
/// - `closeWrite()` sends an end-of-stream to the peer after every accepted byte (TCP FIN);
///   transports without half-close throw ``TransportError/Kind/unsupported``.
/// - `close()` delivers bytes already accepted where the transport allows, then releases every
///   resource. It is called once.
/// - `connectionDropped()` is called instead of `close()` when the application let the connection
///   go without closing it: release what you hold without waiting.
///
/// ```swift
/// final class SensorBackend: ConnectionBackend {
///     let inbound = InboundQueue()
///     let supportsHalfClose = false
///     func read() async throws -> ByteBuffer? { try await inbound.next() }
///     func write(_ buffer: ByteBuffer) async throws { try await device.send(buffer) }
///     func closeWrite() async throws { throw TransportError(.unsupported, "sensor:// cannot half-close") }
///     func close() async throws { device.stop(); inbound.finish() }
/// }
/// ```
@_spi(Plugins)
public protocol ConnectionBackend: AnyObject, Sendable {
    /// The next chunk (or message) of inbound bytes; `nil` at the end of the stream.
    func read() async throws -> ByteBuffer?
    /// Accepts `buffer` (at most ``maximumWriteSize`` bytes), suspending while the transport is full.
    func write(_ buffer: ByteBuffer) async throws
    /// Sends an end of stream after every accepted byte, or throws ``TransportError/Kind/unsupported``.
    func closeWrite() async throws
    /// Delivers accepted bytes where the transport allows, then releases everything; called once.
    func close() async throws
    /// `true` when ``closeWrite()`` is supported.
    var supportsHalfClose: Bool { get }
    /// An executor that runs tasks where this backend does its I/O, if it has one; see
    /// ``Connection/preferredExecutor``.
    var preferredExecutor: (any TaskExecutor)? { get }
    /// `true` when every chunk ``read()`` returns is one message (a SEQPACKET record, a GATT value,
    /// a WebSocket message, a USB packet) and every ``write(_:)`` sends one.
    var carriesMessages: Bool { get }
    /// The most bytes one ``write(_:)`` may carry (an L2CAP send MTU, an ATT payload), read before
    /// every write, so it may change while connected; `nil` for no limit.
    var maximumWriteSize: Int? { get }
    /// The application dropped its connection without closing it.
    func connectionDropped()
    /// Bytes ``write(_:)`` accepted that the transport has not passed on yet, which a
    /// ``close()`` cut short would drop: 0 when none, `nil` when the backend cannot tell (the
    /// default). A close that takes long with 0 here is releasing, not delivering.
    var unsentByteCount: Int? { get }
    /// Bytes received and held for the application, not read yet (an inbound queue's content, or
    /// the socket's receive buffer for a backend that keeps no queue of its own): `nil` when the
    /// backend cannot tell (the default). ``Connection/unreadByteCount`` adds what
    /// the connection itself holds.
    var unreadByteCount: Int? { get }
    /// The next message with its kind, on a backend that ``carriesMessages``; `nil` at the end.
    /// Backends whose messages have kinds (WebSocket) implement it; the default reads a
    /// ``TransportMessage/Kind/binary`` message with ``read()``. A ``WrappingBackend`` that should
    /// pass kinds on implements both (`spy+` does); with the defaults its `read()` and `write(_:)`
    /// see every message, as binary.
    func readMessage() async throws -> TransportMessage?
    /// Sends one message with its kind; the default sends the payload with ``write(_:)``.
    func writeMessage(_ message: TransportMessage) async throws
    /// ``readMessage()``, waiting at most until `deadline`: throws ``ReadDeadlinePassed`` when it
    /// passes with nothing read, and then nothing is consumed (bytes that arrive later go to the
    /// next read). The default races ``readMessage()`` against a timer in a task group; a backend
    /// that parks its reader itself (``InboundQueue/next(deadline:)``) does it without a task.
    func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage?
    /// ``write(_:)``, waiting at most until `deadline`: throws ``WriteDeadlinePassed`` when it
    /// passes first, saying whether nothing of `buffer` was sent. The default races ``write(_:)``
    /// against a timer (so part may have gone); a backend that can wait for room before it hands
    /// anything over (``ChannelBackend``) sends all or nothing.
    func write(_ buffer: ByteBuffer, deadline: ContinuousClock.Instant) async throws
    /// Sends `buffer` as consecutive records of at most ``maximumWriteSize`` bytes each, in order,
    /// and tells `accepted` the size of each record the transport took. ``Connection`` calls it
    /// for a write larger than one record on a backend with a ``maximumWriteSize``, with no other
    /// write in between. The default reads ``maximumWriteSize`` before each record (it may change
    /// while connected) and writes the record with ``write(_:)``; a backend that can send several
    /// records per wake-up overrides it (`PacketSocketBackend` sends them from a thread the kernel
    /// wakes as room comes, and resumes the writing task once).
    func writeRecords(_ buffer: ByteBuffer, accepted: @escaping @Sendable (Int) -> Void) async throws
}

/// What ``ConnectionBackend/write(_:deadline:)`` throws when the deadline passed before the write
/// was accepted; ``Connection/write(_:timeout:)-(ByteBuffer,_)`` turns it into a
/// ``TransportError/Kind/timedOut`` error that names the connection.
///
/// ```swift
/// throw WriteDeadlinePassed(nothingSent: true)   // no room came: nothing of the bytes was handed over
/// ```
@_spi(Plugins)
public struct WriteDeadlinePassed: Error, Sendable {
    /// `true` when none of the bytes was handed to the transport; `false` when part may have been.
    public let nothingSent: Bool

    /// The error; `nothingSent` as the backend knows it.
    public init(nothingSent: Bool) {
        self.nothingSent = nothingSent
    }
}

/// What ``ConnectionBackend/readMessage(deadline:)`` throws when the deadline passed with nothing
/// read; ``Connection/read(maxBytes:timeout:)`` turns it into a ``TransportError/Kind/timedOut``
/// error that names the connection.
///
/// ```swift
/// do { _ = try await backend.readMessage(deadline: .now + .seconds(1)) } catch is ReadDeadlinePassed { /* nothing came */ }
/// ```
@_spi(Plugins)
public struct ReadDeadlinePassed: Error, Sendable {
    /// The error.
    public init() {}
}

extension ConnectionBackend {
    /// `nil` by default: tasks run on the global concurrent executor.
    public var preferredExecutor: (any TaskExecutor)? { nil }
    /// `false` by default: a byte stream.
    public var carriesMessages: Bool { false }
    /// `nil` by default: no limit, the connection hands over each write whole.
    public var maximumWriteSize: Int? { nil }
    /// Does nothing by default; a backend that holds resources releases them here.
    public func connectionDropped() {}
    /// `nil` by default: the backend cannot tell.
    public var unsentByteCount: Int? { nil }
    /// `nil` by default: the backend cannot tell.
    public var unreadByteCount: Int? { nil }
    /// By default the next ``read()`` chunk as a ``TransportMessage/Kind/binary`` message; `nil` at the end.
    public func readMessage() async throws -> TransportMessage? {
        try await read().map { TransportMessage(.binary, $0) }
    }
    /// By default writes the payload with ``write(_:)``, dropping the kind.
    public func writeMessage(_ message: TransportMessage) async throws {
        try await write(message.payload)
    }

    /// By default races ``readMessage()`` against a timer; a message that arrives as the timer
    /// fires is returned, never dropped. Throws ``ReadDeadlinePassed`` when nothing came.
    public func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        // resultWins: a message that arrived as the timer fired is returned, never dropped.
        guard let message = try await withDeadline(deadline, resultWins: true, { try await self.readMessage() }) else {
            throw ReadDeadlinePassed()
        }
        return message
    }

    /// By default ``writeRecordByRecord(_:accepted:)``.
    public func writeRecords(_ buffer: ByteBuffer, accepted: @escaping @Sendable (Int) -> Void) async throws {
        try await writeRecordByRecord(buffer, accepted: accepted)
    }

    /// One ``write(_:)`` per record, each at most ``maximumWriteSize`` bytes (read before each: it
    /// may change while connected): the default ``writeRecords(_:accepted:)``, for an override
    /// that sends some writes another way.
    public func writeRecordByRecord(_ buffer: ByteBuffer, accepted: @escaping @Sendable (Int) -> Void) async throws {
        var rest = buffer
        while rest.readableBytes > 0, let record = rest.readSlice(length: min(max(1, maximumWriteSize ?? rest.readableBytes), rest.readableBytes)) {
            try await write(record)
            accepted(record.readableBytes)
        }
    }

    /// By default races ``write(_:)`` against a timer: at the deadline the write is cancelled,
    /// and part of it may have been sent (``WriteDeadlinePassed/nothingSent`` is `false`).
    public func write(_ buffer: ByteBuffer, deadline: ContinuousClock.Instant) async throws {
        guard try await withDeadline(deadline, { try await self.write(buffer) }) != nil else {
            throw WriteDeadlinePassed(nothingSent: false)
        }
    }
}

/// A transport-specific control call (serial line settings, modem lines, break, flush), as the
/// layers around a connection see it: ``WrappingBackend/willPerform(_:)`` before it runs.
///
/// ```swift
/// ControlOperation("DTR", "on")
/// ```
@_spi(Plugins)
public struct ControlOperation: Sendable, Equatable, CustomStringConvertible {
    /// What is done, short: `"DTR"`, `"break"`, `"settings"`, `"modem lines?"`.
    public var name: String
    /// The arguments, readable: `"on"`, `"250 ms"`, `"115200 8N1"`.
    public var detail: String
    /// A query repeated on a timer (an RFC 2217 server reading a port's line-error counters
    /// four times a second): tracing layers report it only when its answer changes.
    public var isPoll: Bool

    /// An operation named `name` with its arguments as `detail`; `isPoll` for a query repeated
    /// on a timer.
    public init(_ name: String, _ detail: String = "", isPoll: Bool = false) {
        self.name = name
        self.detail = detail
        self.isPoll = isPoll
    }

    /// Whether control calls made in this task are a poll on a timer (``isPoll``): set it around
    /// a query that a loop repeats, and tracing layers report the query only when its answer
    /// changes.
    ///
    /// ```swift
    /// let lines = try await ControlOperation.$polling.withValue(true) { try await port.modemLines() }
    /// ```
    @TaskLocal public static var polling = false

    /// `"DTR on"`: the name and the detail.
    public var description: String { detail.isEmpty ? name : "\(name) \(detail)" }
}

/// A backend that wraps another connection (`spy+tcp://…`). The ``Connection`` around it is
/// transparent: its ``Connection/metadata``, ``Connection/preferredExecutor`` and the plugin
/// accessors that look for a backend type (`connection.serialPort`) reach through to the wrapped
/// connection; control calls made through them are announced to every wrapping layer first.
///
/// ```swift
/// final class CountingBackend: WrappingBackend {
///     let wrapped: Connection
///     init(wrapping connection: Connection) { wrapped = connection }
///     func read() async throws -> ByteBuffer? { try await wrapped.readBuffer() }
///     func write(_ buffer: ByteBuffer) async throws { try await wrapped.write(buffer) }
///     func closeWrite() async throws { try await wrapped.closeWrite() }
///     func close() async throws { try await wrapped.close() }
/// }
/// ```
@_spi(Plugins)
public protocol WrappingBackend: ConnectionBackend {
    /// The connection this backend wraps. It owns it: `close()` closes it.
    var wrapped: Connection { get }
    /// A control call is about to run on the wrapped transport.
    func willPerform(_ operation: ControlOperation)
    /// A control call finished: its result, described (`"CTS DSR"`), or its error.
    func didPerform(_ operation: ControlOperation, outcome: Result<String?, any Error>)
}

extension WrappingBackend {
    /// The wrapped connection's.
    public var supportsHalfClose: Bool { wrapped.supportsHalfClose }
    /// The wrapped connection's: the wrapper's tasks run where the transport does its I/O.
    public var preferredExecutor: (any TaskExecutor)? { wrapped.preferredExecutor }
    /// The wrapped connection's.
    public var carriesMessages: Bool { wrapped.carriesMessages }
    /// The wrapped connection's limit: the outer connection chunks, so each chunk passes through
    /// the wrapper as it will go out.
    public var maximumWriteSize: Int? { wrapped.maximumWriteSize }
    /// The wrapped connection's: a wrapper that queues bytes of its own says so itself.
    public var unsentByteCount: Int? { wrapped.unsentByteCount }
    /// The wrapped connection's: a wrapper that holds or transforms bytes of its own says so itself.
    public var unreadByteCount: Int? { wrapped.unreadByteCount }
    /// Does nothing by default.
    public func willPerform(_ operation: ControlOperation) {}
    /// Does nothing by default.
    public func didPerform(_ operation: ControlOperation, outcome: Result<String?, any Error>) {}
}

/// What a transport knows about the other end, like CornucopiaStreams' `CC_meta`.
/// Every field is optional; `extra` holds transport-specific facts (a port's `lowLatency`, …),
/// and the common ones also have a typed accessor (``peerPath``: a pty's peer node).
public struct ConnectionMetadata: Sendable, Equatable, Codable {
    /// A name for the peer: a product, a host, a path.
    public var name: String?
    /// The maker, as the device reports it.
    public var manufacturer: String?
    /// The model, as the device reports it.
    public var model: String?
    /// The device's serial number.
    public var serialNumber: String?
    /// The firmware's version, where the transport learns it.
    public var firmwareVersion: String?
    /// The largest write the transport carries in one unit, when it has one: a GATT write's or
    /// notification's payload (the ATT MTU less 3), an LE L2CAP channel's send MTU, `loop://`'s
    /// `mtu=`. Longer writes are cut into units of this size; a longer message is refused.
    /// (Formerly `mtu`, a name that meant four different things across the Bluetooth API.)
    public var maximumWriteSize: Int?
    /// This end's address (a socket address, an adapter).
    public var localAddress: String?
    /// The other end's address (a socket address, a device node, a Bluetooth address).
    public var remoteAddress: String?
    /// Transport-specific facts, by name (a pty's `peer`, also ``peerPath``; a port's `lowLatency`).
    public var extra: [String: String]

    /// Metadata; every field is optional.
    ///
    /// ```swift
    /// ConnectionMetadata(name: "loopback", extra: ["buffer": "4096"])
    /// ```
    public init(name: String? = nil, manufacturer: String? = nil, model: String? = nil, serialNumber: String? = nil,
                firmwareVersion: String? = nil, maximumWriteSize: Int? = nil, localAddress: String? = nil,
                remoteAddress: String? = nil, extra: [String: String] = [:]) {
        self.name = name
        self.manufacturer = manufacturer
        self.model = model
        self.serialNumber = serialNumber
        self.firmwareVersion = firmwareVersion
        self.maximumWriteSize = maximumWriteSize
        self.localAddress = localAddress
        self.remoteAddress = remoteAddress
        self.extra = extra
    }

    /// The former spelling of ``init(name:manufacturer:model:serialNumber:firmwareVersion:maximumWriteSize:localAddress:remoteAddress:extra:)``.
    @available(*, deprecated, renamed: "init(name:manufacturer:model:serialNumber:firmwareVersion:maximumWriteSize:localAddress:remoteAddress:extra:)")
    public init(name: String? = nil, manufacturer: String? = nil, model: String? = nil, serialNumber: String? = nil,
                firmwareVersion: String? = nil, mtu: Int?, localAddress: String? = nil,
                remoteAddress: String? = nil, extra: [String: String] = [:]) {
        self.init(name: name, manufacturer: manufacturer, model: model, serialNumber: serialNumber, firmwareVersion: firmwareVersion,
                  maximumWriteSize: mtu, localAddress: localAddress, remoteAddress: remoteAddress, extra: extra)
    }

    /// The former name of ``maximumWriteSize``.
    @available(*, deprecated, renamed: "maximumWriteSize")
    public var mtu: Int? {
        get { maximumWriteSize }
        set { maximumWriteSize = newValue }
    }

    private enum CodingKeys: String, CodingKey {
        case name, manufacturer, model, serialNumber, firmwareVersion, maximumWriteSize, localAddress, remoteAddress, extra
    }

    /// The key ``maximumWriteSize`` was encoded under before it was renamed.
    private enum FormerKeys: String, CodingKey {
        case mtu
    }

    /// Decodes what `encode(to:)` writes, and what it wrote before the rename (`mtu`).
    public init(from decoder: any Decoder) throws {
        let container = try decoder.container(keyedBy: CodingKeys.self)
        name = try container.decodeIfPresent(String.self, forKey: .name)
        manufacturer = try container.decodeIfPresent(String.self, forKey: .manufacturer)
        model = try container.decodeIfPresent(String.self, forKey: .model)
        serialNumber = try container.decodeIfPresent(String.self, forKey: .serialNumber)
        firmwareVersion = try container.decodeIfPresent(String.self, forKey: .firmwareVersion)
        maximumWriteSize = try container.decodeIfPresent(Int.self, forKey: .maximumWriteSize)
            ?? decoder.container(keyedBy: FormerKeys.self).decodeIfPresent(Int.self, forKey: .mtu)
        localAddress = try container.decodeIfPresent(String.self, forKey: .localAddress)
        remoteAddress = try container.decodeIfPresent(String.self, forKey: .remoteAddress)
        extra = try container.decodeIfPresent([String: String].self, forKey: .extra) ?? [:]
    }
}

extension ConnectionMetadata {
    /// The node another program opens to reach the other side of this connection: a `pty://`
    /// connection's peer, such as `/dev/pts/3`; `nil` for transports without one. The same value
    /// as `extra["peer"]`, which stays for code written before this property.
    ///
    /// ```swift
    /// let device = try await Transport.connect(to: "pty://?baud=115200")
    /// guard let peer = device.metadata.peerPath else { return }
    /// print("point the program under test at \(peer)")   // "/dev/pts/3"
    /// ```
    public var peerPath: String? {
        get { extra["peer"] }
        set { extra["peer"] = newValue }
    }

    /// The symbolic link made to ``peerPath`` (`pty://?link=/tmp/ttyFAKE0`), removed when the
    /// connection closes; `nil` when none was asked for. The same value as `extra["link"]`.
    ///
    /// ```swift
    /// let device = try await Transport.connect(to: "pty://?link=/tmp/ttyFAKE0")
    /// print(device.metadata.peerLink ?? "-")   // "/tmp/ttyFAKE0"
    /// ```
    public var peerLink: String? {
        get { extra["link"] }
        set { extra["link"] = newValue }
    }
}
