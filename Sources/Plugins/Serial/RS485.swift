// RS485.swift: a local port's RS-485 mode — ioctl TIOCGRS485/TIOCSRS485 with `struct
// serial_rs485` (include/uapi/linux/serial.h; Documentation/driver-api/serial/serial-rs485.rst).
// In RS-485 mode the UART driver switches the transceiver between sending and receiving with RTS
// itself, with the delays asked for. Only serial-core UART drivers that implement rs485_config
// take it (8250 variants, imx, stm32, atmel, omap…); USB adapters (ftdi_sio, cp210x, ch341,
// cdc_acm) and ptys answer ENOTTY. The struct is declared here, its layout checked, as termios2
// is in Termios.swift: no C header is needed for 32 bytes of u32.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// The RS-485 mode of a local serial port (the kernel's `struct serial_rs485`): whether the
/// driver drives the transceiver's direction with RTS, the RTS level while and after sending, and
/// the delays around a transmission. Read it with ``SerialPort/rs485()``, set it with
/// ``SerialPort/setRS485(_:)``. It prints as it reads: `RS-485 on, RTS high while sending and
/// low after, delays 0 ms before and 0 ms after`.
///
/// ```swift
/// var mode = RS485Settings()                       // on, RTS high while sending, low after
/// mode.delayBeforeSend = .milliseconds(1)
/// try await connection.ttyPort?.setRS485(mode)
/// ```
public struct RS485Settings: Sendable, Hashable, CustomStringConvertible {
    /// RS-485 mode on (`SER_RS485_ENABLED`): the driver switches the transceiver with RTS.
    public var isEnabled: Bool
    /// RTS high (`true`) or low while sending (`SER_RS485_RTS_ON_SEND`).
    public var rtsOnSend: Bool
    /// RTS high (`true`) or low after sending (`SER_RS485_RTS_AFTER_SEND`); the opposite of
    /// ``rtsOnSend`` (drivers correct two equal levels to high while sending, low after).
    public var rtsAfterSend: Bool
    /// Keep receiving while sending (`SER_RS485_RX_DURING_TX`): the application reads its own
    /// transmission back, as a bus echo.
    public var receiveDuringTransmit: Bool
    /// Switch the bus termination on, on ports with a GPIO for it (`SER_RS485_TERMINATE_BUS`).
    public var terminateBus: Bool
    /// From RTS switching to sending until the first bit (`delay_rts_before_send`): whole
    /// milliseconds, as the kernel takes it (serial core caps it at 100 ms).
    public var delayBeforeSend: Duration
    /// From the last bit until RTS switches back (`delay_rts_after_send`): whole milliseconds.
    public var delayAfterSend: Duration

    /// RS-485 settings; the defaults are the usual transceiver wiring: on, RTS high while sending
    /// and low after, no delays, not receiving while sending.
    ///
    /// ```swift
    /// let mode = RS485Settings(rtsOnSend: false, rtsAfterSend: true, delayAfterSend: .milliseconds(2))
    /// ```
    public init(isEnabled: Bool = true, rtsOnSend: Bool = true, rtsAfterSend: Bool = false, receiveDuringTransmit: Bool = false,
                terminateBus: Bool = false, delayBeforeSend: Duration = .zero, delayAfterSend: Duration = .zero) {
        self.isEnabled = isEnabled
        self.rtsOnSend = rtsOnSend
        self.rtsAfterSend = rtsAfterSend
        self.receiveDuringTransmit = receiveDuringTransmit
        self.terminateBus = terminateBus
        self.delayBeforeSend = delayBeforeSend
        self.delayAfterSend = delayAfterSend
    }

    /// RS-485 mode off: the port is an RS-232 port again (RTS is the application's or flow control's).
    public static let disabled = RS485Settings(isEnabled: false)

    /// `"RS-485 on, RTS high while sending and low after, delays 1 ms before and 0 ms after"`
    /// (then `", receiving while sending"`, `", bus terminated"` where set), or `"RS-485 off"`.
    public var description: String {
        guard isEnabled else { return "RS-485 off" }
        func level(_ high: Bool) -> String { high ? "high" : "low" }
        var text = "RS-485 on, RTS \(level(rtsOnSend)) while sending and \(level(rtsAfterSend)) after, "
            + "delays \(Self.milliseconds(delayBeforeSend) ?? 0) ms before and \(Self.milliseconds(delayAfterSend) ?? 0) ms after"
        if receiveDuringTransmit { text += ", receiving while sending" }
        if terminateBus { text += ", bus terminated" }
        return text
    }

    /// A delay in whole milliseconds, or nil when it is negative, has a fraction of a millisecond,
    /// or does not fit the kernel's u32.
    static func milliseconds(_ delay: Duration) -> UInt32? {
        let (seconds, attoseconds) = delay.components
        let perMillisecond: Int64 = 1_000_000_000_000_000
        guard seconds >= 0, attoseconds >= 0, attoseconds % perMillisecond == 0 else { return nil }
        let (ms, overflow) = seconds.multipliedReportingOverflow(by: 1000)
        guard !overflow, ms <= Int64(UInt32.max) else { return nil }
        return UInt32(exactly: ms + attoseconds / perMillisecond)
    }
}

/// `struct serial_rs485` as the kernel declares it: flags, the two delays, then a union of 20
/// bytes (padding, or the addressing mode's two addresses).
struct KernelSerialRS485 {
    var flags: UInt32 = 0
    var delayRTSBeforeSend: UInt32 = 0
    var delayRTSAfterSend: UInt32 = 0
    var union: (UInt32, UInt32, UInt32, UInt32, UInt32) = (0, 0, 0, 0, 0)

    static let layoutMatchesKernel = MemoryLayout<KernelSerialRS485>.size == 32
        && MemoryLayout<KernelSerialRS485>.offset(of: \.delayRTSAfterSend) == 8

    // Flags (linux/serial.h).
    static let enabled: UInt32 = 1 << 0
    static let rtsOnSend: UInt32 = 1 << 1
    static let rtsAfterSend: UInt32 = 1 << 2
    static let rxDuringTx: UInt32 = 1 << 4
    static let terminateBus: UInt32 = 1 << 5

    /// asm-generic/ioctls.h (x86-64, arm64, riscv): TIOCGRS485 0x542E, TIOCSRS485 0x542F.
    static let getRequest: UInt = 0x542E
    static let setRequest: UInt = 0x542F

    init() {}

    init(_ settings: RS485Settings, path: String) throws {
        guard let before = RS485Settings.milliseconds(settings.delayBeforeSend),
              let after = RS485Settings.milliseconds(settings.delayAfterSend) else {
            throw TransportError.misuse("RS-485 delays on \(path) are whole milliseconds from 0 (the kernel's unit), not "
                                        + "\(settings.delayBeforeSend) and \(settings.delayAfterSend)")
        }
        if settings.isEnabled { flags |= Self.enabled }
        if settings.rtsOnSend { flags |= Self.rtsOnSend }
        if settings.rtsAfterSend { flags |= Self.rtsAfterSend }
        if settings.receiveDuringTransmit { flags |= Self.rxDuringTx }
        if settings.terminateBus { flags |= Self.terminateBus }
        delayRTSBeforeSend = before
        delayRTSAfterSend = after
    }

    var settings: RS485Settings {
        RS485Settings(isEnabled: flags & Self.enabled != 0, rtsOnSend: flags & Self.rtsOnSend != 0,
                      rtsAfterSend: flags & Self.rtsAfterSend != 0, receiveDuringTransmit: flags & Self.rxDuringTx != 0,
                      terminateBus: flags & Self.terminateBus != 0, delayBeforeSend: .milliseconds(Int64(delayRTSBeforeSend)),
                      delayAfterSend: .milliseconds(Int64(delayRTSAfterSend)))
    }

    /// TIOCGRS485 or TIOCSRS485 on `fd`; a driver without RS-485 (ENOTTY, or EINVAL) is `.unsupported`.
    mutating func call(_ request: UInt, on fd: FileDescriptor, path: String) throws {
        let name = request == Self.setRequest ? "TIOCSRS485" : "TIOCGRS485"
        guard Self.layoutMatchesKernel else {
            throw TransportError(.unsupported, "internal: struct serial_rs485 layout differs from the kernel's on this architecture")
        }
        var value = self
        defer { self = value }
        do {
            try Syscall.run("ioctl(\(name))", on: path) { ioctl(fd.rawValue, request, &value) }
        } catch let error as TransportError where error.errno == .inappropriateIOCTLForDevice || error.errno == .invalidArgument {
            throw TransportError(.unsupported, "the driver of \(TransportError.printable(path)) has no RS-485 mode (ioctl \(name) answered "
                                 + "\(error.errno == .invalidArgument ? "EINVAL" : "ENOTTY")): only UART drivers with RS-485 support take it, not a "
                                 + "pseudo-terminal or a USB adapter (ftdi_sio, cp210x, ch341, cdc_acm). Use a transceiver that switches "
                                 + "direction itself, or raise RTS around each write with setRTS(_:) and drain()",
                                 errno: error.errno, syscall: error.syscall)
        }
    }
}

extension SerialPort {
    /// The port's RS-485 mode as the driver holds it (TIOCGRS485). Throws `.unsupported`, naming
    /// the call, on a driver without RS-485 support: a pty, a USB adapter.
    ///
    /// ```swift
    /// if let port = connection.ttyPort { print(try await port.rs485()) }   // "RS-485 off"
    /// ```
    public func rs485() async throws -> RS485Settings {
        try connection.performControl(ControlOperation("rs485?"), describe: { $0.description }) {
            var kernel = KernelSerialRS485()
            try kernel.call(KernelSerialRS485.getRequest, on: try backend.device.descriptor(), path: path)
            return kernel.settings
        }
    }

    /// Sets the port's RS-485 mode (TIOCSRS485) and reads back what the driver kept: a driver
    /// that changes what was asked (drivers drop flags they lack, cap the delays, correct two
    /// equal RTS levels) is an error that names what it kept, never a setting silently not
    /// applied. ``RS485Settings/disabled`` turns the mode off. Throws `.unsupported`, naming the
    /// call, on a driver without RS-485 support: a pty, a USB adapter.
    ///
    /// ```swift
    /// let connection = try await Transport.connect(to: "tty:///dev/ttyS1?baud=19200&parity=even")
    /// try await connection.ttyPort?.setRS485(RS485Settings(delayAfterSend: .milliseconds(1)))
    /// try await connection.write(modbusRequest)     // the driver raises RTS for it, then lowers it
    /// ```
    public func setRS485(_ settings: RS485Settings) async throws {
        try connection.performControl(ControlOperation("rs485", settings.description)) {
            let fd = try backend.device.descriptor()
            var kernel = try KernelSerialRS485(settings, path: path)
            try kernel.call(KernelSerialRS485.setRequest, on: fd, path: path)
            var readBack = KernelSerialRS485()
            try readBack.call(KernelSerialRS485.getRequest, on: fd, path: path)
            let kept = readBack.settings
            // Off is off: the kernel clears every other field then.
            guard settings.isEnabled ? kept == settings : !kept.isEnabled else {
                throw TransportError(.unsupported, "the driver of \(TransportError.printable(path)) does not do \(settings); it kept \(kept)")
            }
        }
    }
}
