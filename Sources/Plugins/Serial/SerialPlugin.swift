// tty:// and pty:// — serial ports through termios, driven by SwiftNIO's event loop (no threads
// polling), and serial-port discovery (sysfs) and hot-plug (the shared udev monitor).
//
// Grammar:
//   tty://[LABEL[:BAUD]]/DEVICE-PATH[?OPTIONS]
//     tty:///dev/ttyUSB0?baud=115200
//     tty://adapter:19200/dev/ttyUSB0            CornucopiaStreams' form: the port is the bit rate
//     tty:///dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0
//   tty://usb[:BAUD]/VID:PID[?serial=S&interface=N&location=BUS-PORT&OPTIONS]
//     a USB adapter by identity, resolved through discovery at connect time (USBSelector);
//     tty://usb/VID:PID/SERIAL, the serial's other spelling, is read too
//   pty://[?link=PATH&OPTIONS]
//     a new pseudo-terminal; the connection is its master side and metadata.peerPath names
//     the node (/dev/pts/N) another program opens as if it were a serial port. The peer side is
//     held open while the connection lives, so programs can open and close it repeatedly.
// Options: tty: baud, dataBits, parity, stopBits, flowControl, dtr, rts, exclusive, lowLatency,
//   wait, restore, and for tty://usb/… serial, interface, location; pty: baud, stopBits,
//   flowControl, link (a pty always carries 8 data bits without parity). A driver that keeps other
//   framing than asked for is an error (Termios.apply). See Docs/Schemes.md.

import Glibc
import NIOCore
import SystemPackage
import Synchronization
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// The `tty://` and `pty://` schemes, serial-port listing and hot-plug events.
///
/// ```swift
/// let gps = try await Transport.connect(to: "tty://usb/1546:01a7?baud=9600&wait=true&timeout=30")
/// for try await line in gps.lines { print(line) }
/// ```
public struct SerialPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    static let baud = SerialLineOptions.baud
    static let dataBits = SerialLineOptions.dataBits
    static let parity = SerialLineOptions.parity
    static let stopBits = SerialLineOptions.stopBits
    static let flowControl = SerialLineOptions.flowControl
    static let dtr = SerialLineOptions.dtr
    static let rts = SerialLineOptions.rts
    static let exclusive = URLOption.bool("exclusive", default: true, help: "Lock the port (TIOCEXCL and flock) so no other program can open it")
    static let lowLatency = URLOption.bool("lowLatency", default: false,
                                        help: "Ask the driver to pass bytes on at once (ASYNC_LOW_LATENCY; FTDI latency timer 1 ms)")
    static let serial = URLOption.string("serial", help: "tty://usb/…: the adapter's USB serial number (also written tty://usb/VID:PID/SERIAL)")
    static let interface = URLOption.integer("interface", in: 0...255, help: "tty://usb/…: the USB interface number (multi-port adapters, CDC-ACM)")
    static let location = URLOption.string("location", help: "tty://usb/…: the USB bus and port path, such as 1-1.4")
    static let wait = URLOption.bool("wait", default: false, help: "Wait (up to timeout) for the device to be plugged in instead of failing at once")
    static let restore = URLOption.bool("restore", default: false,
                                        help: "Put the port's previous line settings back when the connection closes (as socat does)")
    static let link = URLOption.string("link", help: "Also create this symlink to the peer node (removed on close)")

    static let lineOptions = SerialLineOptions.settings
    /// What opening any tty takes, by path or by USB identity.
    static let ttyOptions: [any OptionDeclaration] = lineOptions + [dtr, rts, exclusive, lowLatency, wait, restore]

    /// The `tty` and `pty` schemes.
    public var schemes: [Scheme] {
        [
            Scheme(SchemeDescriptor(
                scheme: "tty",
                summary: "Serial port (termios): USB adapters, UARTs, by path, by-id link or USB identity",
                grammar: "tty://[LABEL[:BAUD]]/DEVICE-PATH[?OPTIONS] | tty://usb[:BAUD]/VID:PID[?serial=S&interface=N&location=L&OPTIONS]"
                    + " | tty://usb[:BAUD]/VID:PID/SERIAL[?OPTIONS]",
                examples: ["tty:///dev/ttyUSB0?baud=115200", "tty://adapter:19200/dev/ttyUSB0",
                           "tty://usb/0403:6001?serial=A50285BI", "tty:///dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0"],
                host: .optional, port: .optional, portRange: 1...SerialSettings.maximumBaudRate, path: .required,
                options: Self.ttyOptions + [Self.serial, Self.interface, Self.location],
                modes: [SchemeMode("tty:// connection to a USB adapter", form: "tty://usb[:BAUD]/VID:PID", host: "usb",
                                   options: Self.ttyOptions + [Self.serial, Self.interface, Self.location]),
                        SchemeMode("tty:// connection to a device node", form: "tty://[LABEL[:BAUD]]/DEVICE-PATH", options: Self.ttyOptions)],
                exclusive: true, reachesDevice: true
            ), check: TTYConnector.check, connect: TTYConnector.connect),
            Scheme(SchemeDescriptor(
                scheme: "pty",
                summary: "New pseudo-terminal pair: this side plays a serial device for the program that opens the peer",
                grammar: "pty://[?link=PATH&OPTIONS]",
                examples: ["pty://", "pty://?link=/tmp/ttyFAKE0"],
                host: .forbidden, port: .forbidden, path: .forbidden,
                // No dataBits or parity: the kernel's pty driver always carries 8 data bits without parity.
                options: [Self.baud, Self.stopBits, Self.flowControl, Self.link]
            ), connect: PseudoTerminal.connect),
        ]
    }

    /// The serial ports of this machine, each with an identity URL; without `includeAll` only those backed by hardware.
    /// The walk of sysfs runs on `Blocking`'s pool, not on the caller's thread.
    public func devices(includeAll: Bool) async throws -> [DeviceRecord] {
        try await Blocking.run { try SerialDiscovery.list(includeAll: includeAll) }
    }

    /// Arrivals and removals of serial ports, subscribed before this returns (the walk of sysfs
    /// that subscribing makes runs on `Blocking`'s pool).
    public func deviceEvents(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error>? {
        await SerialDiscovery.events(includeAll: includeAll)
    }
}

extension Connection {
    /// The local port of a `tty://` or `pty://` connection (also through wrappers such as
    /// `spy+tty://`), with what only a local port has; `nil` for other transports.
    /// `Connection.serialPort` is the same port as `any SerialControl`.
    ///
    /// ```swift
    /// connection.ttyPort?.restoresSettingsOnClose = true
    /// ```
    public var ttyPort: SerialPort? {
        backend(as: SerialBackend.self).map { SerialPort(backend: $0, connection: self) }
    }
}

extension ConnectRequest {
    /// The line settings asked for, with the URL's port as the bit rate
    /// (CornucopiaStreams' `tty://adapter:19200/dev/ttyUSB0`).
    func ttySettings() throws -> SerialSettings {
        let baud = self[SerialPlugin.baud]
        if let baud, let port = url.port, port != baud {
            throw TransportError(.invalidURL, "\(url.shown) gives two bit rates (port \(port) and baud=\(baud)); use one. Grammar: \(scheme.grammar)")
        }
        return try serialSettings(baudRate: url.port ?? 9600)
    }
}

/// A ``ConnectionBackend`` for a tty: bytes through a ``ChannelBackend`` on NIO's event loop
/// (reading a duplicate of the descriptor), control through ``TTYDevice``, and a close that
/// waits for the driver to send what was written.
///
/// A tty in raw mode never reports end-of-file; read(2) returns 0 only after a hang-up (USB
/// adapter unplugged) and a pty master gets EIO once its peer is closed. The channel's
/// `hangUp(_:)` ends the connection with `.disconnected` for both, after every byte received before.
final class SerialBackend: ConnectionBackend, SerialControlling {
    let device: TTYDevice
    let channel: ChannelBackend
    /// `modemLineChanges()` threads, stopped before the descriptor closes.
    let modemWatches = ModemLineWatches()
    /// Extra cleanup after the descriptors are closed (a pty's peer side, its symlink), run once
    /// whether close() or connectionDropped() (an abort, possibly during close()) comes first.
    private let extraCleanup: @Sendable () -> Void
    private let cleanedUp = Atomic<Bool>(false)
    let supportsHalfClose = false

    init(device: TTYDevice, channel: ChannelBackend, cleanup: @escaping @Sendable () -> Void = {}) {
        self.device = device
        self.channel = channel
        self.extraCleanup = cleanup
    }

    /// What the channel of `describing` (such as "serial port /dev/ttyUSB0") reports when the
    /// port goes away.
    static func hangUp(_ describing: String) -> HangUp {
        { errno, syscall in
            TransportError(.disconnected, "\(describing) went away (adapter unplugged, or the other side of the pty closed); reconnect when it is back (?wait=true waits for it)",
                           errno: errno, syscall: syscall)
        }
    }

    private func cleanup() {
        if !cleanedUp.exchange(true, ordering: .acquiringAndReleasing) { extraCleanup() }
    }

    var preferredExecutor: (any TaskExecutor)? { channel.preferredExecutor }

    func serialControl(through connection: Connection) -> any SerialControl { SerialPort(backend: self, connection: connection) }

    func read() async throws -> ByteBuffer? { try await channel.read() }

    func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        try await channel.readMessage(deadline: deadline)
    }

    func write(_ buffer: ByteBuffer) async throws { try await channel.write(buffer) }

    func write(_ buffer: ByteBuffer, deadline: ContinuousClock.Instant) async throws {
        try await channel.write(buffer, deadline: deadline)
    }

    var unreadByteCount: Int? { channel.unreadByteCount }

    /// TransportKit's bytes in flight plus the driver's output queue (TIOCOUTQ), which close()
    /// waits for and an abort discards; nil when the driver's cannot be read (the port is closed).
    var unsentByteCount: Int? {
        guard let inFlight = channel.unsentByteCount, let driver = try? device.queuedBytes("ioctl(TIOCOUTQ)", UInt(TIOCOUTQ)) else { return nil }
        return inFlight + driver
    }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "a serial port cannot half-close; close the connection instead")
    }

    func close() async throws {
        await modemWatches.stopAll()
        var failure: (any Error)?
        do {
            try await channel.close()
        } catch let error as TransportError where error.kind == .disconnected {
            // Closing a port that is already gone is not an error.
        } catch {
            failure = error
        }
        // The last descriptor: its close(2) waits until the driver has sent what was written
        // (up to closing_wait), on a thread of its own (TTYDevice.drainAndClose).
        await device.drainAndClose()
        cleanup()
        if let failure { throw failure }
    }

    func connectionDropped() {
        // Output flushed before any descriptor closes, so neither NIO's duplicate nor ours waits
        // for a queue that flow control holds.
        device.discardOutput()
        modemWatches.stopSoon()
        channel.connectionDropped()
        device.close(discardingOutput: true)
        cleanup()
    }
}
