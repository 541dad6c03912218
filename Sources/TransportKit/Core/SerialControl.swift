// SerialControl.swift: one serial-control API for every transport that carries a serial line:
// a local tty or pty (the Serial plugin: termios, TIOCM* ioctls) and a port served on the network
// (rfc2217://: RFC 2217's COM-PORT-OPTION). An app's code does not change when its device moves to
// another machine. The types here carry no kernel constants but the TIOCM_* bit values, which are
// Linux's ABI (include/uapi/asm-generic/termios.h) and stay the raw values of ModemLines.

/// Line settings of a serial port. They print as the URL options read: `115200 8N1, flow none`.
///
/// ```swift
/// var settings = SerialSettings(baudRate: 115_200)
/// settings.parity = .even
/// try await connection.serialPort?.apply(settings)
/// print(settings)   // "115200 8E1, flow none"
/// ```
public struct SerialSettings: Sendable, Equatable, Codable, CustomStringConvertible {
    /// The parity bit.
    public enum Parity: String, Sendable, Codable, CaseIterable {
        /// No parity bit.
        case none
        /// Set so that the number of one bits is even.
        case even
        /// Set so that the number of one bits is odd.
        case odd
        /// Always one (`CMSPAR`).
        case mark
        /// Always zero (`CMSPAR`).
        case space
    }

    /// Flow control.
    public enum FlowControl: String, Sendable, Codable, CaseIterable {
        /// None.
        case none
        /// Hardware: RTS/CTS (`CRTSCTS`).
        case rtscts
        /// Software: XON/XOFF characters (`IXON | IXOFF`).
        case xonxoff
    }

    /// Bits per second; any positive rate (non-standard rates go through BOTHER).
    public var baudRate: Int
    /// 5, 6, 7 or 8.
    public var dataBits: Int
    /// The parity bit.
    public var parity: Parity
    /// 1 or 2.
    public var stopBits: Int
    /// Flow control.
    public var flowControl: FlowControl

    /// Settings; the defaults are 9600 8N1 without flow control.
    public init(baudRate: Int = 9600, dataBits: Int = 8, parity: Parity = .none, stopBits: Int = 1,
                flowControl: FlowControl = .none) {
        self.baudRate = baudRate
        self.dataBits = dataBits
        self.parity = parity
        self.stopBits = stopBits
        self.flowControl = flowControl
    }

    /// "115200 8N1", with the flow control when there is one ("9600 7E2 rtscts").
    public var summary: String {
        "\(baudRate) \(frame)" + (flowControl == .none ? "" : " \(flowControl.rawValue)")
    }

    /// "115200 8N1, flow none": the bit rate, data bits, parity (N, E, O, M, S) and stop bits, and
    /// the flow control (`none`, `rtscts`, `xonxoff`, as the `flowControl` option spells it).
    ///
    /// ```swift
    /// print(SerialSettings(baudRate: 9600, dataBits: 7, parity: .even, stopBits: 2, flowControl: .rtscts))
    /// // 9600 7E2, flow rtscts
    /// ```
    public var description: String { "\(baudRate) \(frame), flow \(flowControl.rawValue)" }

    /// "8N1": data bits, the parity's letter, stop bits.
    private var frame: String {
        "\(dataBits)\(parity.rawValue.prefix(1).uppercased())\(stopBits)"
    }

    /// The highest bit rate taken (the `baud` option's bound): 20 Mbit/s, above the fastest USB
    /// serial adapters. A pty would store any rate; a rate above this is a mistake or an attack.
    public static let maximumBaudRate = 20_000_000

    /// Checks the values a kernel (or an RFC 2217 server) would reject or silently change.
    @_spi(Plugins)
    public func validated() throws -> SerialSettings {
        guard baudRate > 0 else { throw TransportError(.invalidURL, "baud rate \(baudRate) is not positive") }
        guard baudRate <= Self.maximumBaudRate else {
            throw TransportError(.invalidURL, "baud rate \(baudRate) is above \(Self.maximumBaudRate), more than any serial driver makes")
        }
        guard (5...8).contains(dataBits) else { throw TransportError(.invalidURL, "data bits must be 5, 6, 7 or 8, not \(dataBits)") }
        guard stopBits == 1 || stopBits == 2 else { throw TransportError(.invalidURL, "stop bits must be 1 or 2, not \(stopBits)") }
        return self
    }
}

/// The URL options of a serial line, the same for every scheme that carries one (`tty://`,
/// `rfc2217://`): plugins list them in their descriptors and read them into ``SerialSettings``.
///
/// ```swift
/// options: SerialLineOptions.settings + [SerialLineOptions.dtr, SerialLineOptions.rts]
/// ```
@_spi(Plugins)
public enum SerialLineOptions {
    /// `baud`: the bit rate, 1 to ``SerialSettings/maximumBaudRate``; nil when the URL gives none
    /// (the scheme's own default applies, 9600 unless it has another source).
    @_spi(Plugins) public static let baud = URLOption.integer("baud", in: 1...SerialSettings.maximumBaudRate,
                                                              help: "Bit rate, any value the adapter can generate (default 9600; tty://LABEL:BAUD/… also gives it)")
    /// `dataBits`: 5 to 8 data bits per character; 8 by default.
    @_spi(Plugins) public static let dataBits = URLOption.integer("dataBits", in: 5...8, default: 8, help: "Data bits per character")
    /// `parity`: `none` (the default), `even` or `odd`.
    @_spi(Plugins) public static let parity = URLOption.choice("parity", default: SerialSettings.Parity.none, help: "Parity bit")
    /// `stopBits`: 1 (the default) or 2.
    @_spi(Plugins) public static let stopBits = URLOption.integer("stopBits", in: 1...2, default: 1, help: "Stop bits")
    /// `flowControl`: `none` (the default), `rtscts` or `xonxoff`.
    @_spi(Plugins) public static let flowControl = URLOption.choice("flowControl", default: SerialSettings.FlowControl.none,
                                                                    help: "Hardware (RTS/CTS) or software (XON/XOFF) flow control")
    /// `dtr`: raise (`true`) or lower (`false`) DTR on open; nil leaves it as the driver has it.
    @_spi(Plugins) public static let dtr = URLOption.bool("dtr", help: "Raise (true) or lower (false) DTR on open; unset leaves it as the driver has it")
    /// `rts`: raise (`true`) or lower (`false`) RTS on open; nil leaves it as the driver has it.
    @_spi(Plugins) public static let rts = URLOption.bool("rts", help: "Raise (true) or lower (false) RTS on open; unset leaves it as the driver has it")

    /// The line settings: baud, dataBits, parity, stopBits, flowControl.
    public static let settings: [any OptionDeclaration] = [baud, dataBits, parity, stopBits, flowControl]
}

extension ConnectRequest {
    /// The line settings the URL asks for (``SerialLineOptions``), validated; `baudRate` when the
    /// URL gives no `baud` (9600 unless the scheme has another source, as tty://LABEL:BAUD/).
    @_spi(Plugins)
    public func serialSettings(baudRate: Int = 9600) throws -> SerialSettings {
        try SerialSettings(
            baudRate: self[SerialLineOptions.baud] ?? baudRate,
            dataBits: self[SerialLineOptions.dataBits],
            parity: self[SerialLineOptions.parity],
            stopBits: self[SerialLineOptions.stopBits],
            flowControl: self[SerialLineOptions.flowControl]
        ).validated()
    }
}

/// The modem control and status lines of a serial port.
public struct ModemLines: OptionSet, Sendable, Hashable, CustomStringConvertible {
    /// The lines as Linux's `TIOCM_*` bits.
    public let rawValue: Int32
    /// Lines from their `TIOCM_*` bits.
    public init(rawValue: Int32) { self.rawValue = rawValue }

    /// Data Terminal Ready (output), `TIOCM_DTR`.
    public static let dtr = ModemLines(rawValue: 0x002)
    /// Request To Send (output), `TIOCM_RTS`.
    public static let rts = ModemLines(rawValue: 0x004)
    /// Clear To Send (input), `TIOCM_CTS`.
    public static let cts = ModemLines(rawValue: 0x020)
    /// Carrier Detect (input), `TIOCM_CAR`.
    public static let cd = ModemLines(rawValue: 0x040)
    /// Ring Indicator (input), `TIOCM_RNG`.
    public static let ri = ModemLines(rawValue: 0x080)
    /// Data Set Ready (input), `TIOCM_DSR`.
    public static let dsr = ModemLines(rawValue: 0x100)

    /// The inputs: CTS, DSR, RI and CD.
    public static let inputs: ModemLines = [.cts, .dsr, .ri, .cd]

    /// The raised lines by name, such as `"DTR RTS CTS"`, or `"none"`.
    public var description: String {
        let names: [(ModemLines, String)] = [(.dtr, "DTR"), (.rts, "RTS"), (.cts, "CTS"), (.dsr, "DSR"), (.ri, "RI"), (.cd, "CD")]
        let raised = names.filter { contains($0.0) }.map(\.1)
        return raised.isEmpty ? "none" : raised.joined(separator: " ")
    }
}

/// What a serial port's receiver counted: characters with framing or parity errors, characters
/// lost to overruns, and breaks. Counters only grow; compare two readings with ``since(_:)``.
///
/// A local port's driver counts from when it set the port up (TIOCGICOUNT), so a first reading
/// can hold errors from before this connection; an `rfc2217://` port counts the server's
/// NOTIFY-LINESTATE messages since the connection opened.
///
/// ```swift
/// let before = try await port.lineErrors()
/// // … a transfer …
/// let during = try await port.lineErrors().since(before)
/// if during.total > 0 { print("line errors: \(during)") }   // "framing 2, parity 0, overrun 0, …"
/// ```
public struct LineErrorCounts: Sendable, Hashable, CustomStringConvertible {
    /// Characters received without a valid stop bit (a wrong bit rate, noise).
    public var framing: Int
    /// Characters received with a wrong parity bit.
    public var parity: Int
    /// Characters lost because the UART's receiver overran (the driver read too late).
    public var overrun: Int
    /// Characters lost because the driver's buffer was full (the application read too late).
    public var bufferOverrun: Int
    /// Breaks received (the line held at zero for longer than a character).
    public var breaks: Int

    /// Counts as given (zero where not).
    public init(framing: Int = 0, parity: Int = 0, overrun: Int = 0, bufferOverrun: Int = 0, breaks: Int = 0) {
        self.framing = framing
        self.parity = parity
        self.overrun = overrun
        self.bufferOverrun = bufferOverrun
        self.breaks = breaks
    }

    /// Every count added up.
    public var total: Int { framing + parity + overrun + bufferOverrun + breaks }

    /// What grew from `earlier` to this reading (a counter that went back, as a driver's after a
    /// replug, counts from zero).
    public func since(_ earlier: LineErrorCounts) -> LineErrorCounts {
        func grown(_ now: Int, _ then: Int) -> Int { now >= then ? now - then : now }
        return LineErrorCounts(framing: grown(framing, earlier.framing), parity: grown(parity, earlier.parity),
                               overrun: grown(overrun, earlier.overrun), bufferOverrun: grown(bufferOverrun, earlier.bufferOverrun),
                               breaks: grown(breaks, earlier.breaks))
    }

    /// `"framing 0, parity 1, overrun 0, buffer overrun 0, breaks 2"`.
    public var description: String {
        "framing \(framing), parity \(parity), overrun \(overrun), buffer overrun \(bufferOverrun), breaks \(breaks)"
    }
}

/// Which queued bytes ``SerialControl/flush(_:)`` discards.
public enum FlushQueue: String, Sendable, Equatable {
    /// Received but not yet read (the kernel's or the server's queue, and bytes TransportKit
    /// holds unread).
    case input
    /// Written but not yet sent by the driver.
    case output
    /// Both queues.
    case both
}

/// Run-time control of a serial port, on this machine (`tty://`, `pty://`) or served on the
/// network (`rfc2217://`): line settings, modem lines, break, flush and drain, and the modem
/// lines' changes as they happen. Get it with ``Connection/serialPort``; through a wrapper such as
/// `spy+tty://` every call is traced.
///
/// ```swift
/// let connection = try await Transport.connect(to: "rfc2217://rack-pi:4001?baud=115200")
/// if let port = connection.serialPort {
///     try await port.setDTR(false)          // reset an Arduino-style board …
///     try await Task.sleep(for: .milliseconds(100))
///     try await port.setDTR(true)
///     print(try await port.modemLines().contains(.cts))
///     try await port.sendBreak()
/// }
/// ```
public protocol SerialControl: Sendable {
    /// Where the port is: the device node as opened (`/dev/ttyUSB0`), or the server's URL.
    var port: String { get }
    /// The line settings in force now (for a remote port, as the server last confirmed them).
    func settings() async throws -> SerialSettings
    /// Changes the line settings at once (bytes in flight may be garbled, as on any UART). A
    /// remote port's server confirms each value; one it answers differently is an error.
    func apply(_ settings: SerialSettings) async throws
    /// The state of every modem line (inputs CTS, DSR, RI, CD and outputs DTR, RTS). Throws
    /// `.unsupported` where the port has none (a pty).
    func modemLines() async throws -> ModemLines
    /// Raises (`on`) or lowers the given output lines (DTR, RTS).
    func setLines(_ lines: ModemLines, _ on: Bool) async throws
    /// Puts the line in the break state (`on`: it sends zeros until released) or releases it.
    /// ``sendBreak(duration:)`` is a timed break built on this; an open-ended break is for
    /// protocols that hold it as long as they need (LIN, DMX, a console's break key held down).
    func setBreak(_ on: Bool) async throws
    /// Discards queued bytes.
    func flush(_ queue: FlushQueue) async throws
    /// Waits until every byte written so far has left the port.
    func drain() async throws
    /// The input lines (CTS, DSR, RI, CD) each time one of them changes, starting with their state
    /// now; the sequence ends when the connection does. Throws `.unsupported` where the port has
    /// no modem lines.
    func modemLineChanges() async throws -> AsyncThrowingStream<ModemLines, any Error>
    /// What the port's receiver counted: framing and parity errors, overruns, breaks (see
    /// ``LineErrorCounts``). Throws `.unsupported` where nothing counts them (a pty). A
    /// conformance without it gets one that throws `.unsupported`.
    func lineErrors() async throws -> LineErrorCounts
}

extension SerialControl {
    /// Raises or lowers DTR.
    public func setDTR(_ on: Bool) async throws { try await setLines(.dtr, on) }
    /// Raises or lowers RTS. With `flowControl=rtscts` the driver also drives RTS itself.
    public func setRTS(_ on: Bool) async throws { try await setLines(.rts, on) }
    /// A break of 250 ms.
    public func sendBreak() async throws { try await sendBreak(duration: .milliseconds(250)) }

    /// Holds the line in the break state for `duration`, then releases it. The release happens
    /// even when the task is cancelled during the wait (then the cancellation is thrown): a line
    /// left in break looks like a dead device.
    ///
    /// ```swift
    /// try await port.sendBreak(duration: .milliseconds(100))
    /// ```
    public func sendBreak(duration: Duration) async throws {
        try await setBreak(true)
        var interrupted: (any Error)?
        do { try await Task.sleep(for: duration) } catch { interrupted = error }
        let release: (any Error)? = await uncancellable { [self] in
            do {
                try await setBreak(false)
                return nil
            } catch {
                return error
            }
        }
        if let interrupted { throw interrupted }
        if let release { throw release }
    }
    /// Discards both queues.
    public func flush() async throws { try await flush(.both) }

    /// Throws `.unsupported`: this port does not count line errors.
    public func lineErrors() async throws -> LineErrorCounts {
        throw TransportError(.unsupported, "\(port) does not count line errors")
    }
}

/// A backend that offers ``SerialControl`` (a tty's, an RFC 2217 client's).
///
/// ```swift
/// final class RemotePortBackend: ConnectionBackend, SerialControlling {
///     func serialControl(through connection: Connection) -> any SerialControl { RemotePort(self, connection) }
///     // … read, write, close …
/// }
/// ```
@_spi(Plugins)
public protocol SerialControlling: ConnectionBackend {
    /// The control of this backend's port; `connection` is the one the app holds (control calls
    /// are announced to its wrapping layers through `performControl`).
    func serialControl(through connection: Connection) -> any SerialControl
}

extension Connection {
    /// Run-time control of a serial line: `tty://`, `pty://` and `rfc2217://` connections (also
    /// through wrappers such as `spy+tty://`); `nil` for other transports.
    ///
    /// ```swift
    /// try await connection.serialPort?.apply(SerialSettings(baudRate: 57_600))
    /// ```
    public var serialPort: (any SerialControl)? {
        firstBackend((any SerialControlling).self).map { $0.serialControl(through: self) }
    }
}
