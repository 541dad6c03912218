// TransportKitFoundation: a bound (InputStream, OutputStream) pair over a Connection, for code
// written for Foundation streams. Its own target, so the core stays free of Foundation.

import Foundation
import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitLoop

#if !canImport(Darwin)
extension Stream {
    /// A bound pair of streams: what is written to `outputStream` is read from `inputStream`, at
    /// most `bufferSize` bytes in between. Apple's Foundation has this method and
    /// swift-corelibs-foundation does not; this one takes the same call, so code written after
    /// Apple's "Uploading streams of data" (a streamed `URLSession` upload fed through a bound
    /// pair) builds and runs on Linux. The pair is a `Connection.makeStreamPair(bufferSize:)`
    /// over an in-memory `loop://` connection: the output's `write` blocks while the buffer is full
    /// and its events say when there is room; the input's `read` blocks until bytes come, and
    /// reads the end once the output is closed. Closing the input (URLSession does when its task
    /// ends, failed or not) makes the output's writes fail, so a producer never waits forever.
    /// Up to three times `bufferSize` bytes wait in between (each stream's buffer and the loop's).
    /// URLSession reads the input on its own queue, blocking there until bytes come: feed it
    /// steadily, or give each upload its own session.
    ///
    /// ```swift
    /// var inputOrNil: InputStream? = nil
    /// var outputOrNil: OutputStream? = nil
    /// Stream.getBoundStreams(withBufferSize: 4096, inputStream: &inputOrNil, outputStream: &outputOrNil)
    /// // hand inputOrNil to URLSession in urlSession(_:task:needNewBodyStream:); write to outputOrNil
    /// ```
    public static func getBoundStreams(withBufferSize bufferSize: Int, inputStream: inout InputStream?,
                                       outputStream: inout OutputStream?) {
        // The bytes wait in the loop; each stream's own buffer holds one read or write's worth.
        let (input, output) = LoopPlugin.makeConnection(buffer: bufferSize).makeStreamPair(bufferSize: bufferSize, endsWithInput: true)
        inputStream = input
        outputStream = output
    }
}
#endif

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
    /// ``metadataPropertyKey`` with the connection's `ConnectionMetadata`. Closing a stream ends
    /// its task: the input side's at once, the output side's once the bytes written to it went out
    /// (or the connection failed). A stream scheduled on a run loop is kept alive until it is closed
    /// or unscheduled, as Foundation's own are; one released unscheduled and open is closed.
    ///
    /// Streams are scheduled on a thread's run loop, so they are made and used on that thread: in
    /// Swift 6 `RunLoop.current` is not available in an `async` function. Connect in async code,
    /// then hand the (Sendable) connection to the thread:
    ///
    /// ```swift
    /// final class Exchange: NSObject, StreamDelegate {
    ///     private(set) var received: [UInt8] = []
    ///     private(set) var ended = false
    ///
    ///     /// Call on the thread whose run loop delivers the events.
    ///     func start(_ connection: Connection) {
    ///         let (input, output) = connection.makeStreamPair()
    ///         for stream in [input, output] as [Stream] {
    ///             stream.delegate = self
    ///             stream.schedule(in: .current, forMode: .default)
    ///             stream.open()
    ///         }
    ///     }
    ///
    ///     func stream(_ stream: Stream, handle event: Stream.Event) {
    ///         switch event {
    ///         case .hasSpaceAvailable:
    ///             guard let output = stream as? OutputStream else { return }
    ///             _ = output.write(Array("ping\n".utf8), maxLength: 5)
    ///             output.close()
    ///         case .hasBytesAvailable:
    ///             guard let input = stream as? InputStream else { return }
    ///             var buffer = [UInt8](repeating: 0, count: 1024)
    ///             let count = input.read(&buffer, maxLength: buffer.count)
    ///             if count > 0 { received += buffer[..<count] }
    ///         case .endEncountered, .errorOccurred:
    ///             ended = true
    ///             stream.close()
    ///         default:
    ///             break
    ///         }
    ///     }
    /// }
    ///
    /// /// Runs an exchange on the calling thread's run loop until the input ends.
    /// func exchange(over connection: Connection) -> [UInt8] {
    ///     let exchange = Exchange()
    ///     exchange.start(connection)
    ///     // A scheduled stream adds no run-loop source on Linux: keep the run loop waiting with a timer.
    ///     let keepAlive = Timer(timeInterval: 3600, repeats: true) { _ in }
    ///     RunLoop.current.add(keepAlive, forMode: .default)
    ///     defer { keepAlive.invalidate() }
    ///     while !exchange.ended {
    ///         _ = RunLoop.current.run(mode: .default, before: Date(timeIntervalSinceNow: 0.1))
    ///     }
    ///     return exchange.received
    /// }
    ///
    /// let connection = try await Transport.connect(to: "loop://")
    /// Thread { print(exchange(over: connection)) }.start()   // "ping\n", echoed by loop://
    /// ```
    public func makeStreamPair(bufferSize: Int = 64 * 1024) -> (InputStream, OutputStream) {
        makeStreamPair(bufferSize: bufferSize, endsWithInput: false)
    }

    func makeStreamPair(bufferSize: Int, endsWithInput: Bool) -> (InputStream, OutputStream) {
        let pair = StreamPairOwner(connection: self, endsWithInput: endsWithInput)
        let input = ConnectionInputStream(core: InboundCore(pair: pair, bufferSize: bufferSize))
        let output = ConnectionOutputStream(core: OutboundCore(pair: pair, bufferSize: bufferSize))
        return (input, output)
    }

    /// The key under which the bridged streams return `ConnectionMetadata` from `property(forKey:)`,
    /// like CornucopiaStreams' `CC_meta`.
    public static let metadataPropertyKey = Stream.PropertyKey("TransportKit.metadata")
}

/// Closes the connection once both streams of a pair are closed, and cancels what is left of
/// their tasks then.
final class StreamPairOwner: Sendable {
    let connection: Connection
    /// Closing the input ends the connection at once (a bound pair: nothing else reads its loop,
    /// so a writer would otherwise wait forever for room).
    let endsWithInput: Bool
    private let state = Locked<(openSides: Int, tasks: [Task<Void, Never>])>((2, []))

    init(connection: Connection, endsWithInput: Bool = false) {
        self.connection = connection
        self.endsWithInput = endsWithInput
    }

    /// The input side closed: for a bound pair, the output's writer fails from now on.
    func inputClosed() {
        if endsWithInput { connection.abort() }
        sideClosed()
    }

    /// Keeps a side's task, to cancel it when the pair is done.
    func adopt(_ task: Task<Void, Never>) {
        state.withLock { $0.tasks.append(task) }
    }

    func sideClosed() {
        let finished = state.withLock { state -> [Task<Void, Never>]? in
            state.openSides -= 1
            return state.openSides == 0 ? state.tasks : nil
        }
        guard let finished else { return }
        for task in finished { task.cancel() }
        let connection = self.connection
        startCleanup { try? await connection.close() }
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
// written under the owning core's lock (Locked).
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
    // @unchecked Sendable: subclasses keep every mutable field in `common` (a Locked) or in their
    // own Locked; `condition` is only used from synchronous methods.
    let pair: StreamPairOwner
    let bufferSize: Int
    let condition = NSCondition()
    let common = Locked(Common())
    /// Where the side's task waits (for room, for bytes to send); every `signal` re-checks it.
    /// Lock order: `pumpWake`'s lock, then `common`'s; never the other way round.
    let pumpWake = AsyncCondition(())

    struct Common: @unchecked Sendable {
        // @unchecked Sendable: guarded by the Locked that holds it.
        var status: Stream.Status = .notOpen
        var error: (any Error)?
        var target = EventTarget()
        var buffer: [UInt8] = []
        /// Inbound only: the connection reached its end or failed.
        var ended = false
        /// hasBytesAvailable/hasSpaceAvailable events posted and not yet delivered (at most one each).
        var pending: Set<UInt> = []
        /// Outbound only: the application closed the stream; send what is buffered, then stop.
        var closing = false
        /// The stream itself while it is scheduled and not closed, as a run loop retains its
        /// sources: an application need not keep its own reference for events to arrive. Released
        /// outside the lock (releasing it may run the stream's deinit, which closes this core).
        var retained: Stream?
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
            if common.status != .closed { common.retained = common.target.stream.stream }
            return common.status == .open && stillHolds(available, common)
        }
        if holds { post(available) }
    }

    func remove(from runLoop: RunLoop, forMode mode: RunLoop.Mode) {
        let released = common.withLock { common -> Stream? in
            common.target.schedules.removeAll { $0.runLoop === runLoop && $0.mode == mode }
            guard common.target.schedules.isEmpty else { return nil }
            defer { common.retained = nil }
            return common.retained
        }
        withExtendedLifetime(released) {}
    }

    /// Marks the stream closed and hands out the stream's own reference, to be dropped by the caller
    /// outside the locks.
    func markClosed(_ common: inout Common) -> (previous: Stream.Status, retained: Stream?) {
        let previous = common.status
        common.status = .closed
        defer { common.retained = nil }
        return (previous, common.retained)
    }

    /// Runs `change` under the condition's lock and wakes blocked readers and writers, and the
    /// side's task.
    @discardableResult
    func signal<T>(_ change: (inout Common) -> T) -> T {
        condition.lock()
        let result = common.withLock { change(&$0) }
        condition.broadcast()
        condition.unlock()
        pumpWake.update { _ in }
        return result
    }

    /// Suspends the side's task until `predicate` holds; throws `CancellationError` when the task
    /// is cancelled (the stream was closed).
    func pumpWait(until predicate: @escaping @Sendable (Common) -> Bool) async throws {
        try await pumpWake.wait { [self] _ in common.withLock { predicate($0) } ? () : nil }
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
    // @unchecked Sendable: as BridgeCoreBase; the task handle is behind its own Locked.
    override func stillHolds(_ event: Stream.Event, _ common: Common) -> Bool {
        event != .hasBytesAvailable || (common.status == .open && !common.buffer.isEmpty)
    }

    private let endPosted = Locked(false)
    /// The task that reads from the connection; cancelled when the stream is closed.
    private let task = Locked<Task<Void, Never>?>(nil)

    func open() {
        guard beginOpen() else { return }
        post(.openCompleted)
        let task = Task { [self] in await run() }
        self.task.withLock { $0 = task }
        pair.adopt(task)
    }

    private func run() async {
        let connection = pair.connection
        let bufferSize = self.bufferSize
        do {
            while true {
                try await pumpWait { $0.buffer.count < bufferSize || $0.status != .open }
                let room = common.withLock { $0.status == .open ? max(1, bufferSize - $0.buffer.count) : 0 }
                guard room > 0 else { return }
                guard let chunk = try await connection.read(maxBytes: room) else { return finish(nil) }
                signal { $0.buffer += chunk }
                post(.hasBytesAvailable)
            }
        } catch is CancellationError {
            // The stream was closed.
        } catch {
            finish(error)
        }
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
        let post = endPosted.withLock { posted in
            defer { posted = true }
            return !posted
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
        pumpWake.update { _ in }  // room for the task
        let (left, ended) = common.withLock { ($0.buffer.count, $0.ended) }
        if left == 0 && ended {
            postEndOnce()
        } else if left > 0 {
            post(.hasBytesAvailable)
        }
        return count
    }

    func close() {
        let (previous, retained) = signal { markClosed(&$0) }
        withExtendedLifetime(retained) {}
        guard previous != .closed else { return }
        task.withLock { $0 }?.cancel()
        pair.inputClosed()
    }
}

final class OutboundCore: BridgeCoreBase, @unchecked Sendable {
    // @unchecked Sendable: as BridgeCoreBase.
    override func stillHolds(_ event: Stream.Event, _ common: Common) -> Bool {
        event != .hasSpaceAvailable || (common.status == .open && common.buffer.count < bufferSize)
    }

    func open() {
        guard beginOpen() else { return }
        post(.openCompleted)
        post(.hasSpaceAvailable)
        pair.adopt(Task { [self] in await run() })
    }

    private func run() async {
        let connection = pair.connection
        do {
            while true {
                try await pumpWait { !$0.buffer.isEmpty || $0.closing }
                let (chunk, closing) = common.withLock { ($0.buffer, $0.closing) }
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
        } catch {
            // Cancelled: the pair is done, or the connection closed under it.
        }
    }

    private func fail(_ error: any Error) {
        let closing = signal { common -> Bool in
            if common.status == .open {
                common.status = .error
                common.error = error
            }
            return common.closing
        }
        post(.errorOccurred)
        if closing { pair.sideClosed() }
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
        pumpWake.update { _ in }  // bytes for the task
        if hasSpaceAvailable { post(.hasSpaceAvailable) }
        return count
    }

    func close() {
        let (previous, retained) = signal { common -> (Stream.Status, Stream?) in
            // The task sends what is buffered, half-closes, and reports this side closed.
            if common.status == .open { common.closing = true }
            return markClosed(&common)
        }
        withExtendedLifetime(retained) {}
        switch previous {
        case .open, .closed:
            break
        default:
            // Never opened, or the task already stopped on an error.
            pair.sideClosed()
        }
    }
}

/// Forwards every `InputStream` entry point to an ``InboundCore``.
final class ConnectionInputStream: InputStream {
    let core: InboundCore

    init(core: InboundCore) {
        self.core = core
        super.init(data: Data())
        core.common.withLock { $0.target.stream = StreamReference(stream: self) }
    }

    deinit {
        // Released without close(): end the side's task, as close() would.
        core.close()
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
    let core: OutboundCore?

    init(core: OutboundCore) {
        self.core = core
        super.init(toMemory: ())
        core.common.withLock { $0.target.stream = StreamReference(stream: self) }
    }

    deinit {
        // Released without close(): send what was written, then end the side's task.
        core?.close()
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
