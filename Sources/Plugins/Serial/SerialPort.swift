// SerialPort.swift: run-time control of an open tty — break (TIOCSBRK/TIOCCBRK), flush
// (tcflush(3)), input and output queues (TIOCINQ, TIOCOUTQ), drain (tcdrain(3)), RS-485
// (TIOCGRS485/TIOCSRS485, RS485.swift) — and the descriptor's owner,
// TTYDevice (TIOCNXCL, close). Man pages: ioctl_tty(2), termios(3). Line settings are in
// Termios.swift, modem lines (TIOCM*) and low latency in TTYConnector.swift, opening and exclusive
// use (O_NOCTTY, flock, TIOCEXCL) in DeviceAccess.swift. Every control call goes through
// Connection.performControl, so wrapping layers (spy+tty://) see it.

import Glibc
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// Run-time control of a `tty://` or `pty://` connection: the local `SerialControl`, with what
/// only a local port has (its path, restoring its settings on close, the driver's output queue).
/// `connection.serialPort` gives it as `any SerialControl`; `connection.ttyPort` as this type.
///
/// ```swift
/// let connection = try await Transport.connect(to: "tty:///dev/ttyUSB0?baud=115200")
/// if let port = connection.ttyPort {
///     try await port.setDTR(false)          // reset an Arduino-style board …
///     try await Task.sleep(for: .milliseconds(100))
///     try await port.setDTR(true)
///     print(try await port.modemLines().contains(.cts), try port.outputQueueBytes())
/// }
/// ```
public struct SerialPort: SerialControl {
    let backend: SerialBackend
    /// The connection the port was reached through: control calls are announced to its layers.
    let connection: Connection

    init(backend: SerialBackend, connection: Connection) {
        self.backend = backend
        self.connection = connection
    }

    private var device: TTYDevice { backend.device }

    /// The device node as opened, such as `/dev/ttyUSB0` or `/dev/pts/3`.
    public var path: String { device.path }
    /// The device node as opened (``path``).
    public var port: String { device.path }

    /// Whether the port gets the line settings it had before this connection back when the
    /// connection closes (also after a signal, if the program closes its connections then).
    /// The `restore=true` URL option sets it on open; `transportkit connect` and `bridge` set it
    /// for every tty they open, as socat does.
    ///
    /// ```swift
    /// connection.ttyPort?.restoresSettingsOnClose = true
    /// ```
    public var restoresSettingsOnClose: Bool {
        get { device.restoresOnClose.load(ordering: .relaxed) }
        nonmutating set { device.restoresOnClose.store(newValue, ordering: .relaxed) }
    }

    // MARK: Line settings

    /// The line settings the driver holds now.
    public func settings() async throws -> SerialSettings {
        try connection.performControl(ControlOperation("settings?"), describe: { $0.summary }) {
            Termios.settings(of: try Termios.get(try device.descriptor(), path: path))
        }
    }

    /// Changes the line settings at once (bytes in flight may be garbled, as on any UART).
    public func apply(_ settings: SerialSettings) async throws {
        try connection.performControl(ControlOperation("settings", settings.summary)) {
            let fd = try device.descriptor()
            try Termios.apply(try settings.validated(), over: try Termios.get(fd, path: path), to: fd, path: path)
        }
    }

    // MARK: Modem lines

    /// The state of every modem line (inputs CTS, DSR, RI, CD and outputs DTR, RTS).
    /// Throws `.unsupported` on a device without modem lines, such as a pty.
    public func modemLines() async throws -> ModemLines {
        try connection.performControl(ControlOperation("modem lines?"), describe: { $0.description }) {
            try TTYLines(fd: device.descriptor(), path: path).get(askedBy: .method("modemLines()"))
        }
    }

    /// Raises (`on`) or lowers the given output lines.
    public func setLines(_ lines: ModemLines, _ on: Bool) async throws {
        try connection.performControl(ControlOperation(lines.description, on ? "on" : "off")) {
            try TTYLines(fd: device.descriptor(), path: path).set(lines, on, askedBy: TTYLines.setter(for: lines))
        }
    }

    /// The input lines each time one changes (TIOCMIWAIT, on a thread of its own), starting with
    /// their state now. Throws `.unsupported` on a device without modem lines (a pty), and on a
    /// driver that cannot wait for their changes.
    public func modemLineChanges() async throws -> AsyncThrowingStream<ModemLines, any Error> {
        try connection.performControl(ControlOperation("modem line changes")) {
            try backend.modemWatches.start(device)
        }
    }

    /// What the driver counted (TIOCGICOUNT): framing and parity errors, overruns (the UART's and
    /// the driver's buffer's) and breaks, since the driver set the port up. Throws `.unsupported`
    /// on a driver that counts nothing (a pty).
    public func lineErrors() async throws -> LineErrorCounts {
        try connection.performControl(ControlOperation("line errors?"), describe: { $0.description }) {
            // Under the descriptor's lock: an RFC 2217 server polls this four times a second, and
            // a close() in between must not leave it reading a reused descriptor number.
            try device.withDescriptor { try LineErrorCounter(fd: $0, path: path).read() }
        }
    }

    // MARK: Break, flush, drain

    /// Starts (`on`) or ends a break: TIOCSBRK and TIOCCBRK. Closing the port ends a break too.
    ///
    /// The break comes after every byte written before it: starting one first waits until
    /// TransportKit's own buffer is handed to the driver, then the kernel's TIOCSBRK waits until
    /// the driver has sent its output queue (on a thread started for it, as ``drain()``, since
    /// that wait blocks; with flow control holding the output it lasts until the peer lets it go,
    /// and cancelling the task does not end it: aborting the connection does). Ending one does not
    /// wait.
    ///
    /// ```swift
    /// try await port.setBreak(true)      // DMX512: the break before each frame …
    /// try await Task.sleep(for: .microseconds(100))
    /// try await port.setBreak(false)     // … then the mark after break and the slots
    /// try await connection.write([0x00] + levels)
    /// ```
    public func setBreak(_ on: Bool) async throws {
        try await connection.performControl(ControlOperation("break", on ? "on" : "off")) {
            let path = self.path
            if on {
                await backend.channel.flushPendingWrites()
                try await onThreadWithDuplicate("tk break") { fd in
                    try Syscall.run("ioctl(TIOCSBRK)", on: path) { ioctl(fd.rawValue, UInt(TIOCSBRK)) }
                }
            } else {
                _ = try device.withDescriptor { fd in
                    try Syscall.run("ioctl(TIOCCBRK)", on: path) { ioctl(fd.rawValue, UInt(TIOCCBRK)) }
                }
            }
        }
    }

    /// Discards queued bytes. Input flushing also drops bytes TransportKit read from the kernel
    /// that the application has not read yet.
    public func flush(_ queue: FlushQueue) async throws {
        try connection.performControl(ControlOperation("flush", queue.rawValue)) {
            let fd = try device.descriptor()
            let selector: Int32 = switch queue {
            case .input: TCIFLUSH
            case .output: TCOFLUSH
            case .both: TCIOFLUSH
            }
            try Syscall.run("tcflush", on: path) { tcflush(fd.rawValue, selector) }
            if queue != .output {
                backend.channel.discardBufferedInbound()
                connection.discardUnreadInput()
            }
        }
    }

    /// Bytes received that the driver holds and TransportKit has not read from it yet (TIOCINQ,
    /// the same as FIONREAD). Bytes TransportKit already read and holds for the application (up
    /// to the connection's inbound buffer, `Buffering`) are not counted: TransportKit reads
    /// from the driver as bytes arrive, so this is 0 unless the application stopped reading long
    /// enough for that buffer to fill.
    ///
    /// ```swift
    /// if let port = connection.ttyPort, try port.inputQueueBytes() > 0 {
    ///     print("the driver is holding bytes: read faster")
    /// }
    /// ```
    public func inputQueueBytes() throws -> Int {
        try queueBytes("input queue?", "ioctl(TIOCINQ)", UInt(FIONREAD))
    }

    /// Bytes a read can have now or as soon as TransportKit takes them from the driver, as
    /// pyserial's `in_waiting` counts: what the connection holds for the application
    /// (`Connection.unreadByteCount`) plus the driver's input queue (``inputQueueBytes()``).
    ///
    /// ```swift
    /// if let port = connection.ttyPort, try port.bytesWaiting() >= 8 {
    ///     let record = try await connection.readFrame(.fixedLength(8))
    /// }
    /// ```
    public func bytesWaiting() throws -> Int {
        // TransportKit's share first: bytes that move from the driver into it between the two
        // readings are then missed, never counted twice (a caller trusts the count not to wait).
        let held = connection.unreadByteCount ?? 0
        return held + (try inputQueueBytes())
    }

    /// Bytes the driver still has to send (TIOCOUTQ).
    public func outputQueueBytes() throws -> Int {
        try queueBytes("output queue?", "ioctl(TIOCOUTQ)", UInt(TIOCOUTQ))
    }

    /// One of the driver's queue counts (TIOCINQ, TIOCOUTQ), as a traced control call.
    private func queueBytes(_ operation: String, _ call: String, _ request: UInt) throws -> Int {
        try connection.performControl(ControlOperation(operation), describe: { "\($0) bytes" }) {
            try device.queuedBytes(call, request)
        }
    }

    /// Waits until every byte written so far has left: first TransportKit's own buffer, then the
    /// driver's (tcdrain, on a thread started for it because it blocks, as long as flow control
    /// holds the output; cancelling the task does not end it, aborting the connection does). On a
    /// pty this waits for the other side to read.
    public func drain() async throws {
        try await connection.performControl(ControlOperation("drain")) {
            await backend.channel.flushPendingWrites()
            let path = self.path
            try await onThreadWithDuplicate("tk tcdrain") { fd in
                try Syscall.run("tcdrain", on: path) { tcdrain(fd.rawValue) }
            }
        }
    }

    /// Runs a call that blocks (TIOCSBRK, tcdrain) on a thread started for it, with a duplicate of
    /// the port's descriptor made under the lock `close()` takes: a close or an abort while the
    /// call waits cannot hand the number to another file meanwhile. The duplicate is closed after.
    private func onThreadWithDuplicate(_ name: String, _ call: @escaping @Sendable (FileDescriptor) throws -> Void) async throws {
        let path = self.path
        let duplicate = try device.withDescriptor { fd in
            try Syscall.descriptor("fcntl(F_DUPFD_CLOEXEC)", on: path) { fcntl(fd.rawValue, F_DUPFD_CLOEXEC, 0) }
        }
        try await Blocking.runOnThread(name) {
            defer { try? duplicate.close() }
            try call(duplicate)
        }
    }
}

/// A tty descriptor and who owns it: this object, which closes it once (on connection close, or
/// when released).
///
/// The last close(2) of a tty waits in the kernel until the driver has sent its output queue (up
/// to the port's closing_wait, 30 s by default; flow control holding the output makes it last
/// that long), and restoring the settings polls that queue for up to half a second. So a close
/// that keeps what was written (``drainAndClose()``) runs on a thread started for it, never on the
/// caller's; one that discards it (``close(discardingOutput:)`` with `true`: an abort, a dropped
/// connection, a device released without close) flushes the queue first and does not wait.
final class TTYDevice: Sendable {
    let path: String
    private let fd: Locked<FileDescriptor?>
    /// The line settings the port had before this connection changed them (nil for a pty made
    /// here), and whether to put them back before the descriptor closes.
    private let original: KernelTermios2?
    let restoresOnClose: Atomic<Bool>

    init(path: String, fd: FileDescriptor, original: KernelTermios2? = nil, restoreOnClose: Bool = false) {
        self.path = path
        self.fd = Locked(fd)
        self.original = original
        restoresOnClose = Atomic(restoreOnClose)
    }

    func descriptor() throws -> FileDescriptor {
        guard let fd = self.fd.withLock({ $0 }) else { throw TransportError(.disconnected, "the serial port \(path) is closed") }
        return fd
    }

    /// One of the driver's queue counts (`call` names the request: TIOCINQ, TIOCOUTQ), read under
    /// the descriptor's lock.
    func queuedBytes(_ call: String, _ request: UInt) throws -> Int {
        try withDescriptor { fd in
            var count: Int32 = 0
            try Syscall.run(call, on: path) { ioctl(fd.rawValue, request, &count) }
            return Int(count)
        }
    }

    /// Runs `body` with the descriptor under the lock `close()` takes, so the number is neither
    /// closed nor reused meanwhile (a duplicate made here is of this port).
    func withDescriptor<Result>(_ body: (FileDescriptor) throws -> Result) throws -> Result {
        try fd.withLock { fd in
            guard let fd else { throw TransportError(.disconnected, "the serial port \(path) is closed") }
            return try body(fd)
        }
    }

    /// Drops what the driver has not sent yet (tcflush(3) TCOFLUSH). Best effort.
    func discardOutput() {
        if let fd = fd.withLock({ $0 }) { _ = tcflush(fd.rawValue, TCOFLUSH) }
    }

    /// Releases the exclusive lock and closes the descriptor on the calling thread. Idempotent.
    /// With `discardingOutput` (an abort, a dropped connection) the driver's output queue is
    /// flushed first (tcflush TCOFLUSH), so nothing waits for it. Without, close(2) on a tty waits
    /// for that queue to drain, up to the port's closing_wait (30 s by default): only for a port
    /// nothing was written to (a connect that failed), or a pty master, whose close does not wait;
    /// ``drainAndClose()`` otherwise.
    func close(discardingOutput: Bool = false) {
        guard let fd = take() else { return }
        if discardingOutput { _ = tcflush(fd.rawValue, TCOFLUSH) }
        finishClosing(fd)
    }

    /// Closes keeping what was written: returns once the driver has sent its output queue (or the
    /// port's closing_wait passed) and the descriptor is closed. The waiting runs on a thread
    /// started for it, never on the caller's (a cooperative-pool thread, or the connection's event
    /// loop); it is not cancellable, since the descriptor is already out of this object's hands.
    /// Idempotent; a ``close(discardingOutput:)`` that comes first wins.
    func drainAndClose() async {
        guard let fd = take() else { return }
        let finish: @Sendable () -> Void = { [self] in finishClosing(fd) }
        await uncancellable {
            do {
                try await Blocking.runOnThread("tk tty close", finish)
            } catch {
                // No thread to be had: close here rather than leak the port.
                finish()
            }
        }
    }

    /// The descriptor, taken out under the lock (nil once closed): no call under the lock sees it
    /// from now on.
    private func take() -> FileDescriptor? {
        fd.withLock { fd in
            defer { fd = nil }
            return fd
        }
    }

    /// The settings restored (with `restore`), TIOCNXCL, close(2): the part that may wait.
    private func finishClosing(_ fd: FileDescriptor) {
        if let original, restoresOnClose.load(ordering: .relaxed) {
            // TCSETS2 applies at once: let the driver send what it holds at the old rate first
            // (TIOCOUTQ, up to half a second; flow control may hold bytes forever). Best effort:
            // a port that went away cannot take its old settings back.
            var pending: Int32 = 0
            for _ in 0..<50 where ioctl(fd.rawValue, UInt(TIOCOUTQ), &pending) == 0 && pending > 0 {
                usleep(10_000)
            }
            try? Termios.set(fd, original, path: path)
        }
        _ = ioctl(fd.rawValue, UInt(TIOCNXCL))
        fd.closeOwned()  // also releases the flock(2) lock held through this descriptor
    }

    // Released without close(): nothing may wait in a deinit, so the output queue is dropped.
    deinit { close(discardingOutput: true) }
}
