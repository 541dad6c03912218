// tty:// and pty:// — serial ports through termios, driven by SwiftNIO's event loop (no threads
// polling), and serial-port discovery (sysfs) and hot-plug (libudev's uevent monitor).
//
// Grammar:
//   tty://[LABEL[:BAUD]]/DEVICE-PATH[?OPTIONS]
//     tty:///dev/ttyUSB0?baud=115200
//     tty://adapter:19200/dev/ttyUSB0            CornucopiaStreams' form: the port is the bit rate
//     tty:///dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0
//   tty://usb[:BAUD]/VID:PID[?serial=S&interface=N&location=BUS-PORT&OPTIONS]
//     a USB adapter by identity, resolved through discovery at connect time
//   pty://[?link=PATH&OPTIONS]
//     a new pseudo-terminal; the connection is its master side and metadata.extra["peer"] names
//     the node (/dev/pts/N) another program opens as if it were a serial port. The peer side is
//     held open while the connection lives, so programs can open and close it repeatedly.
// Options (tty and pty): baud, dataBits, parity, stopBits, flowControl, dtr, rts; tty only:
//   exclusive, lowLatency, serial, interface, location, wait. See Docs/Schemes.md.

import Foundation
import Glibc
import NIOCore
import NIOPosix
import TransportKitCore

/// The `tty://` and `pty://` schemes, serial-port listing and hot-plug events.
///
/// ```swift
/// let gps = try await Transport.connect(to: "tty://usb/1546:01a7?baud=9600&wait=true&timeout=30")
/// for try await line in gps.lines() { print(line) }
/// ```
public struct SerialPlugin: TransportPlugin {
    public init() {}

    static let lineOptions: [OptionSpec] = [
        OptionSpec("baud", .integer(min: 1, max: 20_000_000), help: "Bit rate, any value the adapter can generate (default 9600, or the URL's port)"),
        OptionSpec("dataBits", .integer(min: 5, max: 8), default: "8", help: "Data bits per character"),
        OptionSpec("parity", .choice(SerialSettings.Parity.allCases.map(\.rawValue)), default: "none", help: "Parity bit"),
        OptionSpec("stopBits", .integer(min: 1, max: 2), default: "1", help: "Stop bits"),
        OptionSpec("flowControl", .choice(SerialSettings.FlowControl.allCases.map(\.rawValue)), default: "none",
                   help: "Hardware (RTS/CTS) or software (XON/XOFF) flow control"),
        OptionSpec("dtr", .bool, help: "Raise (true) or lower (false) DTR on open; unset leaves it as the driver has it"),
        OptionSpec("rts", .bool, help: "Raise (true) or lower (false) RTS on open; unset leaves it as the driver has it"),
    ]

    public let schemes = [
        SchemeDescriptor(
            scheme: "tty",
            summary: "Serial port (termios): USB adapters, UARTs, by path, by-id link or USB identity",
            grammar: "tty://[LABEL[:BAUD]]/DEVICE-PATH[?OPTIONS] | tty://usb[:BAUD]/VID:PID[?serial=S&interface=N&location=L&OPTIONS]",
            examples: ["tty:///dev/ttyUSB0?baud=115200", "tty://adapter:19200/dev/ttyUSB0",
                       "tty://usb/0403:6001?serial=A50285BI", "tty:///dev/serial/by-id/usb-FTDI_FT232R_USB_UART_A50285BI-if00-port0"],
            host: .optional, port: .optional, portRange: 1...20_000_000, path: .required,
            options: lineOptions + [
                OptionSpec("exclusive", .bool, default: "true", help: "Lock the port (TIOCEXCL and flock) so no other program can open it"),
                OptionSpec("lowLatency", .bool, default: "false",
                           help: "Ask the driver to pass bytes on at once (ASYNC_LOW_LATENCY; FTDI latency timer 1 ms)"),
                OptionSpec("serial", .string, help: "tty://usb/…: the adapter's USB serial number"),
                OptionSpec("interface", .integer(min: 0, max: 255), help: "tty://usb/…: the USB interface number (multi-port adapters, CDC-ACM)"),
                OptionSpec("location", .string, help: "tty://usb/…: the USB bus and port path, such as 1-1.4"),
                OptionSpec("wait", .bool, default: "false", help: "Wait (up to timeout) for the device to be plugged in instead of failing at once"),
            ]
        ),
        SchemeDescriptor(
            scheme: "pty",
            summary: "New pseudo-terminal pair: this side plays a serial device for the program that opens the peer",
            grammar: "pty://[?link=PATH&OPTIONS]",
            examples: ["pty://", "pty://?link=/tmp/ttyFAKE0"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: lineOptions.filter { $0.name != "dtr" && $0.name != "rts" } + [
                OptionSpec("link", .string, help: "Also create this symlink to the peer node (removed on close)"),
            ]
        ),
    ]

    public func connect(_ request: ConnectRequest) async throws -> Connection {
        switch request.url.scheme {
        case "pty": try await PseudoTerminal.connect(request)
        default: try await TTYConnector.connect(request)
        }
    }

    public func devices(includeAll: Bool) async throws -> [DeviceRecord] {
        try SerialDiscovery.list(includeAll: includeAll)
    }

    public func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? {
        SerialDiscovery.events(includeAll: includeAll)
    }
}

extension Connection {
    /// Run-time control of a `tty://` or `pty://` connection; `nil` for other transports.
    public var serialPort: SerialPort? {
        backend(as: SerialBackend.self).map { SerialPort(device: $0.device, connection: self, channel: $0.channel) }
    }
}

extension ConnectRequest {
    /// The line settings asked for: options, with the URL's port as the bit rate
    /// (CornucopiaStreams' `tty://adapter:19200/dev/ttyUSB0`).
    func serialSettings() throws -> SerialSettings {
        let baud = options.int("baud")
        if let baud, let port = url.port, port != baud {
            throw TransportError(.invalidURL, "\(url) gives two bit rates (port \(port) and baud=\(baud)); use one. Grammar: \(scheme.grammar)")
        }
        return try SerialSettings(
            baudRate: baud ?? url.port ?? 9600,
            dataBits: options.int("dataBits") ?? 8,
            parity: SerialSettings.Parity(rawValue: options.string("parity") ?? "none") ?? .none,
            stopBits: options.int("stopBits") ?? 1,
            flowControl: SerialSettings.FlowControl(rawValue: options.string("flowControl") ?? "none") ?? .none
        ).validated()
    }
}

/// A ``ConnectionBackend`` for a tty: bytes through a ``ChannelBackend`` on NIO's event loop
/// (reading a duplicate of the descriptor), control through ``TTYDevice``.
///
/// A tty in raw mode never reports end-of-file; read(2) returns 0 only after a hang-up (USB
/// adapter unplugged) and a pty master gets EIO once its peer is closed. Both end the connection
/// with `.disconnected`, after every byte received before.
final class SerialBackend: ConnectionBackend {
    let device: TTYDevice
    let channel: ChannelBackend
    let describing: String
    /// Extra cleanup after the descriptors are closed (a pty's peer side, its symlink).
    private let cleanup: @Sendable () -> Void
    let supportsHalfClose = false

    init(device: TTYDevice, channel: ChannelBackend, describing: String, cleanup: @escaping @Sendable () -> Void = {}) {
        self.device = device
        self.channel = channel
        self.describing = describing
        self.cleanup = cleanup
    }

    var preferredExecutor: (any TaskExecutor)? { channel.preferredExecutor }

    func read() async throws -> ByteBuffer? {
        do {
            guard let buffer = try await channel.read() else { throw gone(errno: nil, syscall: nil) }
            return buffer
        } catch let error as TransportError where error.kind == .disconnected {
            throw gone(errno: error.errno, syscall: error.syscall)
        }
    }

    func write(_ buffer: ByteBuffer) async throws {
        do {
            try await channel.write(buffer)
        } catch let error as TransportError where error.kind == .disconnected {
            throw gone(errno: error.errno, syscall: error.syscall)
        }
    }

    private func gone(errno: Int32?, syscall: String?) -> TransportError {
        TransportError(.disconnected, "\(describing) went away (adapter unplugged, or the other side of the pty closed); reconnect when it is back (?wait=true waits for it)",
                       errno: errno, syscall: syscall)
    }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "a serial port cannot half-close; close the connection instead")
    }

    func close() async throws {
        defer {
            device.close()
            cleanup()
        }
        do {
            try await channel.close()
        } catch let error as TransportError where error.kind == .disconnected {
            // Closing a port that is already gone is not an error.
        }
    }
}

/// Puts a tty descriptor on NIO's event loop. NIO owns the duplicate it is given.
enum SerialChannel {
    static func attach(fd: Int32, describing: String) async throws -> ChannelBackend {
        let duplicate = fcntl(fd, F_DUPFD_CLOEXEC, 0)
        guard duplicate >= 0 else { throw TransportError.posix("fcntl(F_DUPFD_CLOEXEC)", errno: errno, what: describing) }
        let backend = ChannelBackend(describing: describing, supportsHalfClose: false)
        let channel: any Channel
        do {
            channel = try await NIOPipeBootstrap(group: MultiThreadedEventLoopGroup.singleton)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture { try channel.pipeline.syncOperations.addHandler(backend.handler) }
                }
                .takingOwnershipOfDescriptor(inputOutput: duplicate)
                .get()
        } catch {
            throw TransportError.from(error, context: "putting \(describing) on the event loop")
        }
        backend.attach(channel)
        return backend
    }
}
