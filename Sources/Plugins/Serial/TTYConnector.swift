// TTYConnector.swift: tty:// connect — resolve the URL to a device node (path, by-id link or USB
// identity), open it exclusively, set raw mode and the line settings, the modem lines and low
// latency, then hand it to the event loop.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

enum TTYConnector {
    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let settings = try request.ttySettings()
        let (path, record) = try await resolve(request)
        request.logger.debug("opening serial port", metadata: ["path": "\(path)"])
        let fd = try await DeviceAccess.openTTY(path, exclusive: request[SerialPlugin.exclusive])
        let original: KernelTermios2
        do {
            original = try Termios.get(fd, path: path)
        } catch {
            fd.closeOwned()
            throw error
        }
        let device = TTYDevice(path: path, fd: fd, original: original, restoreOnClose: request[SerialPlugin.restore])
        var notes: [String: String] = ["path": path]
        let channel: ChannelBackend
        do {
            try Termios.apply(settings, over: original, to: fd, path: path)
            let port = TTYLines(fd: fd, path: path)
            if let dtr = request[SerialPlugin.dtr] { try port.set(.dtr, dtr, askedBy: .urlOption("dtr")) }
            if let rts = request[SerialPlugin.rts] { try port.set(.rts, rts, askedBy: .urlOption("rts")) }
            if request[SerialPlugin.lowLatency] {
                notes["lowLatency"] = LowLatency.enable(fd: fd, path: path)
            }
            channel = try await DescriptorChannel.adoptDuplicate(of: fd, describing: "tty://\(path)", buffering: request.buffering,
                                                                 hangUp: SerialBackend.hangUp("serial port \(path)"))
        } catch {
            // A connect that failed hands nothing over: the port gets its settings back.
            device.restoresOnClose.store(true, ordering: .relaxed)
            await device.drainAndClose()
            throw error
        }
        if let record {
            notes["devnode"] = record.devnode
            notes["vendorId"] = record.vendorId
            notes["productId"] = record.productId
            if let interface = record.interface { notes["interface"] = String(interface) }
            notes["driver"] = record.driver
        }
        let metadata = ConnectionMetadata(name: record?.product ?? path, manufacturer: record?.manufacturer,
                                          model: record?.product, serialNumber: record?.serialNumber,
                                          remoteAddress: path, extra: notes.compactMapValues { $0 })
        return Connection(url: request.url, backend: SerialBackend(device: device, channel: channel),
                          metadata: metadata)
    }

    /// What a server checks before it listens: the line settings, the USB selector, and a device
    /// path that can never be a serial port (a directory, a regular file, a socket, a FIFO,
    /// /dev/ptmx). A path that is missing may be plugged in later.
    @Sendable static func check(_ request: ConnectRequest) async throws {
        _ = try request.ttySettings()
        if request.url.host?.lowercased() == "usb" {
            _ = try SerialDiscovery.selector(request)
            return
        }
        let path = try devicePath(request)
        var info = stat()
        guard stat(path, &info) == 0 else { return }
        let shown = TransportError.printable(path)
        switch info.st_mode & S_IFMT {
        case S_IFCHR: return
        case S_IFSOCK:
            throw TransportError(.unsupported, "\(shown) is a unix socket, not a serial port: connect to it with unix://\(shown)")
        default:
            throw TransportError(.invalidURL, "\(shown) is \(UserPath.fileKind(info.st_mode)), not a serial port or terminal: give a device node such as /dev/ttyUSB0 (`transportkit list` shows them)")
        }
    }

    /// The absolute device path of a tty:// URL of the device-node form; never /dev/ptmx, which
    /// would open a new pseudo-terminal rather than a device.
    static func devicePath(_ request: ConnectRequest) throws -> String {
        let path = request.url.path
        guard path.hasPrefix("/") else {
            throw TransportError(.invalidURL, "\(request.url.shown): the device path must be absolute, such as tty:///dev/ttyUSB0. Grammar: \(request.scheme.grammar)")
        }
        var info = stat()
        // The multiplexer (character device 5:2, /dev/ptmx and /dev/pts/ptmx): each open makes a
        // new pseudo-terminal master, unrelated to anything the user meant.
        if stat(path, &info) == 0, info.st_mode & S_IFMT == S_IFCHR, DeviceNode.numbers(of: info.st_rdev) == (5, 2) {
            throw TransportError(.invalidURL, "\(TransportError.printable(path)) is the pseudo-terminal multiplexer: opening it makes a new, unrelated "
                                 + "pseudo-terminal. To make one that plays a serial device, use pty:// (pty://?link=/tmp/ttyFAKE0); to open an "
                                 + "existing one, give its /dev/pts/N")
        }
        return path
    }

    /// The device node to open, and what discovery knows about it (when it knows it).
    static func resolve(_ request: ConnectRequest) async throws -> (String, DeviceRecord?) {
        let url = request.url
        let wait = request[SerialPlugin.wait]
        if url.host?.lowercased() == "usb" {
            let selector = try SerialDiscovery.selector(request)
            let record = try await SerialDiscovery.resolve(selector, wait: wait, deadline: request.deadline, timeout: request.timeout)
            guard let node = record.devnode else {
                throw TransportError(.notFound, "\(record.sysPath ?? "the device") matches \(selector) but has no device node")
            }
            return (node, record)
        }
        let path = try devicePath(request)
        if wait, access(path, F_OK) != 0 {
            try await SerialDiscovery.waitForNode(path, deadline: request.deadline, timeout: request.timeout)
        }
        return (path, SerialDiscovery.record(forNode: path))
    }
}

/// Modem lines by descriptor (TIOCMGET, TIOCMBIS, TIOCMBIC), used on open and by SerialPort.
struct TTYLines {
    let fd: FileDescriptor
    let path: String

    /// What asked for the lines, so that a port without them gets advice that fits: a URL option
    /// to drop, or a method call to leave out.
    enum Asker {
        /// `dtr=` or `rts=` in the URL (the option's name).
        case urlOption(String)
        /// A `SerialPort` method, as written in Swift (`setDTR(_:)`, `modemLines()`).
        case method(String)

        var advice: String {
            switch self {
            case .urlOption(let name): "drop \(name)= from the URL for it"
            case .method(let name): "leave the \(name) call out for it"
            }
        }
    }

    func get(askedBy asker: Asker = .method("modemLines()")) throws -> ModemLines {
        var bits: Int32 = 0
        try call("ioctl(TIOCMGET)", asker) { ioctl(fd.rawValue, UInt(TIOCMGET), &bits) }
        return ModemLines(rawValue: bits)
    }

    func set(_ lines: ModemLines, _ on: Bool, askedBy asker: Asker) throws {
        var bits = lines.rawValue
        try call(on ? "ioctl(TIOCMBIS)" : "ioctl(TIOCMBIC)", asker) { ioctl(fd.rawValue, UInt(on ? TIOCMBIS : TIOCMBIC), &bits) }
    }

    /// The method a `setLines(_:_:)` call most likely came through: `setDTR(_:)` and `setRTS(_:)`
    /// are built on it.
    static func setter(for lines: ModemLines) -> Asker {
        switch lines {
        case .dtr: .method("setDTR(_:)")
        case .rts: .method("setRTS(_:)")
        default: .method("setLines(_:_:)")
        }
    }

    private func call(_ name: String, _ asker: Asker, _ body: () -> Int32) throws {
        do {
            try Syscall.run(name, on: path, body)
        } catch let error as TransportError where error.errno == .inappropriateIOCTLForDevice || error.errno == .invalidArgument {
            // ENOTTY/EINVAL: the driver has no tiocmget/tiocmset (ptys, some virtual ports).
            throw TransportError(.unsupported, "\(path) has no modem control lines (DTR, RTS, CTS, DSR, RI, CD): a pty or virtual port cannot do this; \(asker.advice)",
                                 errno: error.errno, syscall: error.syscall)
        }
    }
}

/// A driver's receive counters by descriptor: TIOCGICOUNT, which fills `struct
/// serial_icounter_struct` (linux/serial.h: cts, dsr, rng, dcd, rx, tx, frame, overrun, parity,
/// brk, buf_overrun and nine reserved ints). Drivers without `get_icount` (ptys) answer ENOTTY
/// (EINVAL is taken the same way).
struct LineErrorCounter {
    let fd: FileDescriptor
    let path: String

    func read() throws -> LineErrorCounts {
        var counters = [Int32](repeating: 0, count: 20)
        do {
            try Syscall.run("ioctl(TIOCGICOUNT)", on: path) {
                counters.withUnsafeMutableBytes { bytes in bytes.baseAddress.map { ioctl(fd.rawValue, UInt(TIOCGICOUNT), $0) } ?? -1 }
            }
        } catch let error as TransportError where error.errno == .inappropriateIOCTLForDevice || error.errno == .invalidArgument {
            throw TransportError(.unsupported, "the driver of \(path) counts no line errors (a pty or virtual port has no receiver to count them)",
                                 errno: error.errno, syscall: error.syscall)
        }
        return LineErrorCounts(framing: Int(counters[6]), parity: Int(counters[8]), overrun: Int(counters[7]),
                               bufferOverrun: Int(counters[10]), breaks: Int(counters[9]))
    }
}

/// Low latency: ASYNC_LOW_LATENCY through TIOCGSERIAL/TIOCSSERIAL (linux/serial.h), and for FTDI
/// adapters the latency timer in sysfs (16 ms by default) set to 1 ms.
enum LowLatency {
    /// `flags` is the int at offset 16 of `struct serial_struct` (72 bytes on 64-bit Linux; the
    /// buffer below is 128 so a larger struct on another architecture cannot overflow it).
    static let flagsOffset = 16
    /// ASYNC_LOW_LATENCY (1 << ASYNCB_LOW_LATENCY, 13) from linux/tty_flags.h.
    static let asyncLowLatency: Int32 = 1 << 13

    /// Returns what was done, for the connection's metadata. Drivers without these knobs (ptys,
    /// CDC-ACM) are left as they are: low latency is a request, not a requirement. What the
    /// driver kept is read back: cdc_acm takes TIOCSSERIAL and drops ASYNC_LOW_LATENCY.
    static func enable(fd: FileDescriptor, path: String) -> String {
        var done: [String] = []
        var raw = [UInt8](repeating: 0, count: 128)
        func serial(_ request: Int32) -> Bool {
            raw.withUnsafeMutableBytes { bytes in bytes.baseAddress.map { ioctl(fd.rawValue, UInt(request), $0) } ?? -1 } == 0
        }
        func flags() -> Int32 { raw.withUnsafeBytes { $0.load(fromByteOffset: flagsOffset, as: Int32.self) } }
        if serial(Int32(TIOCGSERIAL)) {
            let asked = flags() | asyncLowLatency
            raw.withUnsafeMutableBytes { $0.storeBytes(of: asked, toByteOffset: flagsOffset, as: Int32.self) }
            if serial(Int32(TIOCSSERIAL)), serial(Int32(TIOCGSERIAL)), flags() & asyncLowLatency != 0 {
                done.append("ASYNC_LOW_LATENCY")
            }
        }
        let name = resolvedName(path)
        let timer = "/sys/class/tty/\(name)/device/latency_timer"
        if let file = try? FileDescriptor.open(timer, .writeOnly, options: [.closeOnExec]) {
            if (try? file.writeAll(Array("1".utf8))) != nil { done.append("latency_timer=1ms") }
            try? file.close()
        }
        return done.isEmpty ? "not supported by this driver" : done.joined(separator: ",")
    }

    /// The node's name after resolving links (`/dev/serial/by-id/…` → `ttyUSB0`).
    private static func resolvedName(_ path: String) -> String {
        guard let resolved = realpath(path, nil) else { return "" }
        defer { free(resolved) }
        let text = String(cString: resolved)
        return text.split(separator: "/").last.map(String.init) ?? ""
    }
}
