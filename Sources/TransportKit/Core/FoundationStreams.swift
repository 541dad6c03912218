import Foundation
import Synchronization

extension Connection {
    /// A bound (InputStream, OutputStream) pair over this connection, for code written for
    /// Foundation streams (CornucopiaStreams' stream pairs, `StreamDelegate` state machines).
    ///
    /// The streams deliver `StreamDelegate` events (`.openCompleted`, `.hasBytesAvailable`,
    /// `.hasSpaceAvailable`, `.endEncountered`, `.errorOccurred`) on the run loop and mode they are
    /// scheduled in. Each side buffers at most `bufferSize` bytes. `read` blocks until bytes arrive
    /// and `write` blocks while the buffer is full, as Foundation's blocking streams do; code driven
    /// by the events never blocks. Closing the output stream half-closes the connection where the
    /// transport allows; closing both closes it. `property(forKey:)` answers
    /// ``metadataPropertyKey`` with the connection's ``ConnectionMetadata``.
    ///
    /// ```swift
    /// let (input, output) = try await Transport.connect(to: "tcp://127.0.0.1:35000").makeStreamPair()
    /// for stream in [input, output] as [Stream] {
    ///     stream.delegate = self
    ///     stream.schedule(in: .current, forMode: .default)
    ///     stream.open()
    /// }
    /// ```
    public func makeStreamPair(bufferSize: Int = 64 * 1024) -> (InputStream, OutputStream) {
        let pair = StreamPairOwner(connection: self)
        let input = ConnectionInputStream(core: InboundCore(pair: pair, bufferSize: bufferSize))
        let output = ConnectionOutputStream(core: OutboundCore(pair: pair, bufferSize: bufferSize))
        return (input, output)
    }

    /// The key under which the bridged streams return ``ConnectionMetadata`` from `property(forKey:)`,
    /// like CornucopiaStreams' `CC_meta`.
    public static let metadataPropertyKey = Stream.PropertyKey("TransportKit.metadata")
}

/// Closes the connection once both streams of a pair are closed.
final class StreamPairOwner: Sendable {
    let connection: Connection
    private let openSides = Mutex(2)

    init(connection: Connection) { self.connection = connection }

    func sideClosed() {
        let last = openSides.withLock { sides in
            sides -= 1
            return sides == 0
        }
        if last {
            let connection = self.connection
            Task { try? await connection.close() }
        }
    }
}

/// A weak reference to a bridged stream that may cross threads.
// @unchecked Sendable: the stream is only dereferenced inside the timer block, which runs on the
// run loop the application scheduled the stream in, the thread where Foundation calls delegates.
struct StreamReference: @unchecked Sendable {
    weak var stream: Stream?
}

/// Where a bridged stream's events go. Delivery uses a one-shot `Timer` added to each scheduled
/// run loop: on Linux, adding a timer wakes a sleeping run loop; `RunLoop.perform` does not.
// @unchecked Sendable: RunLoop is thread-safe for adding timers; the list itself is only read and
// written under the owning core's Mutex.
struct EventTarget: @unchecked Sendable {
    var stream = StreamReference()
    weak var delegate: (any StreamDelegate)?
    var schedules: [(runLoop: RunLoop, mode: RunLoop.Mode)] = []

    /// Posts `event`; `stillValid` runs on the run loop just before the delegate is called, so an
    /// event that no longer holds (bytes already read) is not delivered.
    func post(_ event: Stream.Event, stillValid: @escaping @Sendable () -> Bool) {
        let reference = stream
        for (runLoop, mode) in schedules {
            let timer = Timer(fire: Date(), interval: 0, repeats: false) { _ in
                guard stillValid(), let stream = reference.stream, let delegate = stream.delegate else { return }
                delegate.stream(stream, handle: event)
            }
            runLoop.add(timer, forMode: mode)
        }
    }
}

/// What both directions share: status, error, event target, and the condition that blocking
/// `read`/`write` calls wait on.
class BridgeCoreBase: @unchecked Sendable {
    // @unchecked Sendable: subclasses keep every mutable field in `common` (a Mutex) or in their
    // own Mutex; `condition` is only used from synchronous methods.
    let pair: StreamPairOwner
    let bufferSize: Int
    let condition = NSCondition()
    let common = Mutex(Common())

    struct Common: @unchecked Sendable {
        // @unchecked Sendable: guarded by the Mutex that holds it.
        var status: Stream.Status = .notOpen
        var error: (any Error)?
        var target = EventTarget()
        var buffer: [UInt8] = []
        /// Inbound only: the connection reached its end or failed.
        var ended = false
        /// hasBytesAvailable/hasSpaceAvailable events posted and not yet delivered (at most one each).
        var pending: Set<UInt> = []
    }

    init(pair: StreamPairOwner, bufferSize: Int) {
        self.pair = pair
        self.bufferSize = max(1, bufferSize)
    }

    /// Posts `event` to the delegate. Availability events are coalesced (one pending at a time)
    /// and re-checked on the run loop, so a delegate that reads or writes on them never blocks.
    func post(_ event: Stream.Event) {
        let coalesced = event == .hasBytesAvailable || event == .hasSpaceAvailable
        let target = common.withLock { common -> EventTarget? in
            if coalesced && !common.target.schedules.isEmpty {
                guard common.pending.insert(event.rawValue).inserted else { return nil }
            }
            return common.target
        }
        target?.post(event) { [self] in
            common.withLock { common in
                if coalesced { common.pending.remove(event.rawValue) }
                return stillHolds(event, common)
            }
        }
    }

    /// Whether `event` is still true; subclasses answer for the availability events.
    func stillHolds(_ event: Stream.Event, _ common: Common) -> Bool { true }

    /// Moves from not-open to open; `false` when the stream was opened (or closed) before.
    func beginOpen() -> Bool {
        common.withLock { common in
            guard common.status == .notOpen else { return false }
            common.status = .open
            return true
        }
    }

    /// Adds a run loop to deliver events on, and posts `available` there at once if it holds
    /// (bytes already buffered, or room to write).
    func schedule(in runLoop: RunLoop, forMode mode: RunLoop.Mode, available: Stream.Event) {
        let holds = common.withLock { common in
            common.target.schedules.append((runLoop, mode))
            return common.status == .open && stillHolds(available, common)
        }
        if holds { post(available) }
    }

    func remove(from runLoop: RunLoop, forMode mode: RunLoop.Mode) {
        common.withLock { $0.target.schedules.removeAll { $0.runLoop === runLoop && $0.mode == mode } }
    }

    /// Runs `change` under the condition's lock and wakes blocked readers and writers.
    func signal<T>(_ change: (inout Common) -> T) -> T {
        condition.lock()
        defer {
            condition.broadcast()
            condition.unlock()
        }
        return common.withLock { change(&$0) }
    }

    /// Blocks while `predicate` holds, then runs `body`, all under the condition's lock.
    func wait<T>(while predicate: (Common) -> Bool, then body: (inout Common) -> T) -> T {
        condition.lock()
        defer { condition.unlock() }
        while common.withLock({ predicate($0) }) { condition.wait() }
        return common.withLock { body(&$0) }
    }
}

final class InboundCore: BridgeCoreBase, @unchecked Sendable {
    override func stillHolds(_ event: Stream.Event, _ common: Common) -> Bool {
        event != .hasBytesAvailable || (common.status == .open && !common.buffer.isEmpty)
    }

    private let pump = Mutex<(task: Task<Void, Never>?, room: CheckedContinuation<Void, Never>?, endPosted: Bool)>((nil, nil, false))

    func open() {
        guard beginOpen() else { return }
        post(.openCompleted)
        let task = Task { [self] in await run() }
        pump.withLock { $0.task = task }
    }

    private func run() async {
        let connection = pair.connection
        while !Task.isCancelled {
            await waitForRoom()
            do {
                let room = max(1, bufferSize - common.withLock { $0.buffer.count })
                guard let chunk = try await connection.read(maxBytes: room) else { return finish(nil) }
                signal { $0.buffer += chunk }
                post(.hasBytesAvailable)
            } catch {
                return finish(error is CancellationError ? nil : error)
            }
        }
    }

    private func waitForRoom() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let full = common.withLock { $0.buffer.count >= bufferSize && $0.status == .open }
            let parked = full && pump.withLock { pump in
                pump.room = continuation
                return true
            }
            if !parked { continuation.resume() }
            // A reader that made room between the check and parking resumes `room` itself.
            else if common.withLock({ $0.buffer.count < bufferSize || $0.status != .open }) { resumeRoom() }
        }
    }

    private func resumeRoom() {
        pump.withLock { pump in
            defer { pump.room = nil }
            return pump.room
        }?.resume()
    }

    private func finish(_ error: (any Error)?) {
        let empty = signal { common -> Bool in
            common.ended = true
            if let error, common.status == .open {
                common.error = error
                common.status = .error
            }
            return common.buffer.isEmpty
        }
        if error != nil {
            post(.errorOccurred)
        } else if empty {
            postEndOnce()
        }
    }

    private func postEndOnce() {
        let post = pump.withLock { pump in
            defer { pump.endPosted = true }
            return !pump.endPosted
        } && common.withLock { common in
            guard common.status == .open else { return false }
            common.status = .atEnd
            return true
        }
        if post { self.post(.endEncountered) }
    }

    var hasBytesAvailable: Bool {
        common.withLock { $0.status == .open && (!$0.buffer.isEmpty || !$0.ended) }
    }

    func read(_ buffer: UnsafeMutablePointer<UInt8>, maxLength: Int) -> Int {
        let count = wait(while: { $0.buffer.isEmpty && $0.status == .open && !$0.ended }) { common -> Int in
            if common.status == .error { return -1 }
            let count = min(maxLength, common.buffer.count)
            common.buffer.withUnsafeBufferPointer { source in
                if let base = source.baseAddress { buffer.update(from: base, count: count) }
            }
            common.buffer.removeFirst(count)
            return count
        }
        guard count >= 0 else { return -1 }
        resumeRoom()
        let (left, ended) = common.withLock { ($0.buffer.count, $0.ended) }
        if left == 0 && ended {
            postEndOnce()
        } else if left > 0 {
            post(.hasBytesAvailable)
        }
        return count
    }

    func close() {
        let wasOpen = signal { common in
            defer { common.status = .closed }
            return common.status != .closed
        }
        guard wasOpen else { return }
        pump.withLock { $0.task }?.cancel()
        resumeRoom()
        pair.sideClosed()
    }
}

final class OutboundCore: BridgeCoreBase, @unchecked Sendable {
    override func stillHolds(_ event: Stream.Event, _ common: Common) -> Bool {
        event != .hasSpaceAvailable || (common.status == .open && common.buffer.count < bufferSize)
    }

    private let pump = Mutex<(data: CheckedContinuation<Void, Never>?, closing: Bool)>((nil, false))

    func open() {
        guard beginOpen() else { return }
        post(.openCompleted)
        post(.hasSpaceAvailable)
        Task { [self] in await run() }
    }

    private func run() async {
        let connection = pair.connection
        while true {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let ready = common.withLock { !$0.buffer.isEmpty } || pump.withLock { pump in
                    if pump.closing { return true }
                    pump.data = continuation
                    return false
                }
                if ready { continuation.resume() }
                // A writer that added bytes between the check and parking resumes `data` itself.
                else if common.withLock({ !$0.buffer.isEmpty }) { resumeData() }
            }
            let chunk = common.withLock { $0.buffer }
            let closing = pump.withLock { $0.closing }
            if !chunk.isEmpty {
                do {
                    try await connection.write(chunk)
                } catch {
                    return fail(error)
                }
                let wasFull = signal { common -> Bool in
                    let full = common.buffer.count >= bufferSize
                    common.buffer.removeFirst(chunk.count)
                    return full
                }
                if wasFull && !closing { post(.hasSpaceAvailable) }
            } else if closing {
                if connection.supportsHalfClose { try? await connection.closeWrite() }
                return pair.sideClosed()
            }
        }
    }

    private func resumeData() {
        pump.withLock { pump in
            defer { pump.data = nil }
            return pump.data
        }?.resume()
    }

    private func fail(_ error: any Error) {
        signal { common in
            if common.status == .open {
                common.status = .error
                common.error = error
            }
        }
        post(.errorOccurred)
        if pump.withLock({ $0.closing }) { pair.sideClosed() }
    }

    var hasSpaceAvailable: Bool {
        common.withLock { $0.status == .open && $0.buffer.count < bufferSize }
    }

    func write(_ buffer: UnsafePointer<UInt8>, maxLength: Int) -> Int {
        guard maxLength > 0 else { return 0 }
        let count = wait(while: { $0.status == .open && $0.buffer.count >= self.bufferSize }) { common -> Int in
            guard common.status == .open else { return -1 }
            let count = min(maxLength, bufferSize - common.buffer.count)
            common.buffer.append(contentsOf: UnsafeBufferPointer(start: buffer, count: count))
            return count
        }
        guard count > 0 else { return count }
        resumeData()
        if hasSpaceAvailable { post(.hasSpaceAvailable) }
        return count
    }

    func close() {
        let previous = signal { common in
            defer { common.status = .closed }
            return common.status
        }
        switch previous {
        case .open:
            // The pump drains what was written, half-closes, and reports this side closed.
            pump.withLock { $0.closing = true }
            resumeData()
        case .closed:
            break
        default:
            // Never opened, or the pump already stopped on an error.
            pair.sideClosed()
        }
    }
}

/// Forwards every `InputStream` entry point to an ``InboundCore``.
final class ConnectionInputStream: InputStream {
    private let core: InboundCore

    init(core: InboundCore) {
        self.core = core
        super.init(data: Data())
        core.common.withLock { $0.target.stream = StreamReference(stream: self) }
    }

    override var delegate: (any StreamDelegate)? {
        get { core.common.withLock { $0.target.delegate } }
        set { core.common.withLock { $0.target.delegate = newValue } }
    }

    override var streamStatus: Stream.Status { core.common.withLock { $0.status } }
    override var streamError: (any Error)? { core.common.withLock { $0.error } }
    override var hasBytesAvailable: Bool { core.hasBytesAvailable }
    override func open() { core.open() }
    override func close() { core.close() }

    override func read(_ buffer: UnsafeMutablePointer<UInt8>, maxLength len: Int) -> Int {
        core.read(buffer, maxLength: len)
    }

    override func getBuffer(_ buffer: UnsafeMutablePointer<UnsafeMutablePointer<UInt8>?>,
                            length len: UnsafeMutablePointer<Int>) -> Bool { false }

    override func schedule(in aRunLoop: RunLoop, forMode mode: RunLoop.Mode) {
        core.schedule(in: aRunLoop, forMode: mode, available: .hasBytesAvailable)
    }

    override func remove(from aRunLoop: RunLoop, forMode mode: RunLoop.Mode) {
        core.remove(from: aRunLoop, forMode: mode)
    }

    override func property(forKey key: Stream.PropertyKey) -> AnyObject? {
        key == Connection.metadataPropertyKey ? core.pair.connection.metadata as AnyObject : nil
    }
}

/// Forwards every `OutputStream` entry point to an ``OutboundCore``.
final class ConnectionOutputStream: OutputStream {
    private let core: OutboundCore?

    init(core: OutboundCore) {
        self.core = core
        super.init(toMemory: ())
        core.common.withLock { $0.target.stream = StreamReference(stream: self) }
    }

    /// Foundation requires this initializer; a stream made this way has no connection and
    /// reports an error when used. Use ``Connection/makeStreamPair(bufferSize:)``.
    required init(toMemory: ()) {
        self.core = nil
        super.init(toMemory: ())
    }

    override var delegate: (any StreamDelegate)? {
        get { core?.common.withLock { $0.target.delegate } }
        set { core?.common.withLock { $0.target.delegate = newValue } }
    }

    override var streamStatus: Stream.Status { core?.common.withLock { $0.status } ?? .error }
    override var streamError: (any Error)? {
        guard let core else {
            return TransportError(.unsupported, "this OutputStream has no connection; create bridged streams with Connection.makeStreamPair()")
        }
        return core.common.withLock { $0.error }
    }

    override var hasSpaceAvailable: Bool { core?.hasSpaceAvailable ?? false }
    override func open() { core?.open() }
    override func close() { core?.close() }

    override func write(_ buffer: UnsafePointer<UInt8>, maxLength len: Int) -> Int {
        core?.write(buffer, maxLength: len) ?? -1
    }

    override func schedule(in aRunLoop: RunLoop, forMode mode: RunLoop.Mode) {
        core?.schedule(in: aRunLoop, forMode: mode, available: .hasSpaceAvailable)
    }

    override func remove(from aRunLoop: RunLoop, forMode mode: RunLoop.Mode) {
        core?.remove(from: aRunLoop, forMode: mode)
    }

    override func property(forKey key: Stream.PropertyKey) -> AnyObject? {
        key == Connection.metadataPropertyKey ? core?.pair.connection.metadata as AnyObject? : nil
    }
}
