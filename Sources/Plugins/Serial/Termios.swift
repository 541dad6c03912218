// Termios.swift: line settings through the kernel's termios2 interface (TCGETS2/TCSETS2).
//
// Wraps: ioctl_tty(2) and termios(3); the struct is `struct termios2` from
// include/uapi/asm-generic/termbits.h. termios2 carries the bit rate as a number (c_ispeed,
// c_ospeed) next to the BOTHER flag, so any rate a driver can generate (250000, 31250, …) works,
// not only the B-constants. glibc's `struct termios` has a different layout (NCCS 32) and cannot be
// passed to TCGETS2, so the kernel struct is declared here with its layout checked.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// `struct termios2` as the kernel declares it (asm-generic/termbits.h, NCCS = 19).
struct KernelTermios2 {
    var c_iflag: UInt32 = 0
    var c_oflag: UInt32 = 0
    var c_cflag: UInt32 = 0
    var c_lflag: UInt32 = 0
    var c_line: UInt8 = 0
    var c_cc: (UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8,
               UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8) =
        (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    var c_ispeed: UInt32 = 0
    var c_ospeed: UInt32 = 0

    /// The layout the kernel expects; checked before every ioctl that passes this struct.
    static let layoutMatchesKernel = MemoryLayout<KernelTermios2>.size == 44
        && MemoryLayout<KernelTermios2>.offset(of: \.c_line) == 16
        && MemoryLayout<KernelTermios2>.offset(of: \.c_cc) == 17
        && MemoryLayout<KernelTermios2>.offset(of: \.c_ispeed) == 36
        && MemoryLayout<KernelTermios2>.offset(of: \.c_ospeed) == 40
}

enum Termios {
    // ioctl numbers from asm-generic/ioctls.h: _IOR('T', 0x2A, struct termios2) and
    // _IOW('T', 0x2B, struct termios2); glibc's headers do not define them.
    static let TCGETS2 = UInt((2 << 30) | (44 << 16) | (0x54 << 8) | 0x2A)
    static let TCSETS2 = UInt((1 << 30) | (44 << 16) | (0x54 << 8) | 0x2B)
    /// asm-generic/termbits.h: "use the rate in c_ispeed/c_ospeed".
    static let BOTHER: UInt32 = 0o010000
    /// Index of VMIN and VTIME in the kernel's c_cc (asm-generic/termbits.h).
    static let kernelVTIME = 5
    static let kernelVMIN = 6

    /// The B-constants for standard rates; other rates use BOTHER.
    static let standardRates: [Int: UInt32] = {
        let table: [(Int, Int32)] = [
            (50, B50), (75, B75), (110, B110), (134, B134), (150, B150), (200, B200),
            (300, B300), (600, B600), (1200, B1200), (1800, B1800), (2400, B2400), (4800, B4800),
            (9600, B9600), (19200, B19200), (38400, B38400), (57600, B57600), (115200, B115200), (230400, B230400),
            (460800, B460800), (500000, B500000), (576000, B576000), (921600, B921600), (1000000, B1000000), (1152000, B1152000),
            (1500000, B1500000), (2000000, B2000000), (2500000, B2500000), (3000000, B3000000), (3500000, B3500000), (4000000, B4000000),
        ]
        return Dictionary(uniqueKeysWithValues: table.map { ($0.0, UInt32($0.1)) })
    }()

    /// TCGETS2.
    static func get(_ fd: FileDescriptor, path: String) throws -> KernelTermios2 {
        try checkLayout()
        var tio = KernelTermios2()
        try Syscall.run("ioctl(TCGETS2)", on: path) { ioctl(fd.rawValue, TCGETS2, &tio) }
        return tio
    }

    /// TCSETS2 (takes effect at once, like TCSANOW).
    static func set(_ fd: FileDescriptor, _ tio: KernelTermios2, path: String) throws {
        try checkLayout()
        var tio = tio
        try Syscall.run("ioctl(TCSETS2)", on: path) { ioctl(fd.rawValue, TCSETS2, &tio) }
    }

    /// Sets `settings` in raw mode on top of `current` and reads the result back: a driver that
    /// keeps other framing than asked for (an adapter may lack mark parity or 5 data bits) is an
    /// error that names what it kept, never a setting silently not applied. The bit rate is not
    /// compared: drivers round it to what they can make. A pseudo-terminal, whose driver clears
    /// PARENB and forces CS8 whatever is asked, is refused parity and 5 to 7 data bits before
    /// anything is changed, with an error that says why.
    static func apply(_ settings: SerialSettings, over current: KernelTermios2, to fd: FileDescriptor, path: String) throws {
        if settings.parity != .none || settings.dataBits != 8, isPseudoTerminal(fd) {
            throw pseudoTerminalFraming(settings, path: path)
        }
        var tio = current
        configure(&tio, settings)
        try set(fd, tio, path: path)
        var kept = Self.settings(of: try get(fd, path: path))
        kept.baudRate = settings.baudRate
        guard kept == settings else {
            throw TransportError(.unsupported, "the driver of \(TransportError.printable(path)) does not do \(settings.summary); it kept \(kept.summary). "
                                 + "Ask for what the device and its driver support (adapters differ in mark and space parity and in 5 or 6 data bits)")
        }
    }

    /// Whether `fd` is either side of a pseudo-terminal: a Unix 98 slave (`/dev/pts/N`, majors
    /// 136–143), a master opened through the multiplexer (it reports `/dev/ptmx`, 5:2), or a
    /// BSD-style pty (majors 2 and 3). Documentation/admin-guide/devices.txt.
    static func isPseudoTerminal(_ fd: FileDescriptor) -> Bool {
        var info = stat()
        guard fstat(fd.rawValue, &info) == 0, info.st_mode & S_IFMT == S_IFCHR else { return false }
        let (major, minor) = DeviceNode.numbers(of: info.st_rdev)
        return (136...143).contains(major) || (major == 5 && minor == 2) || major == 2 || major == 3
    }

    /// The kernel's pty driver (drivers/tty/pty.c, pty_set_termios) clears PARENB and sets CS8 on
    /// every change, so parity and other data bits would be dropped without a word.
    static func pseudoTerminalFraming(_ settings: SerialSettings, path: String) -> TransportError {
        let lacks = switch (settings.parity != .none, settings.dataBits != 8) {
        case (true, true): "has no parity bit and carries only 8 data bits"
        case (true, false): "has no parity bit"
        default: "carries only 8 data bits"
        }
        return TransportError(.unsupported, "\(TransportError.printable(path)) is a pseudo-terminal, which \(lacks) (the kernel's pty driver clears "
                              + "PARENB and forces CS8 whatever is asked), so it cannot do \(settings.summary); nothing was changed. "
                              + "Ask a pty for 8 data bits without parity (8N1, 8N2); parity and 5 to 7 data bits need a real serial port")
    }

    private static func checkLayout() throws {
        guard KernelTermios2.layoutMatchesKernel else {
            throw TransportError(.unsupported, "internal: struct termios2 layout differs from the kernel's on this architecture")
        }
    }

    /// Raw mode (what cfmakeraw(3) does) plus the given settings: no echo, no signals, no line
    /// editing, no CR/LF translation; read returns as soon as one byte is there (VMIN 1, VTIME 0).
    static func configure(_ tio: inout KernelTermios2, _ settings: SerialSettings) {
        tio.c_iflag &= ~UInt32(IGNBRK | BRKINT | PARMRK | ISTRIP | INLCR | IGNCR | ICRNL | IXON | IXOFF | IXANY | INPCK)
        tio.c_oflag &= ~UInt32(OPOST)
        tio.c_lflag &= ~UInt32(ECHO | ECHONL | ICANON | ISIG | IEXTEN)
        let lineBits: UInt32 = UInt32(CSIZE) | UInt32(PARENB) | UInt32(PARODD) | UInt32(CSTOPB)
        tio.c_cflag &= ~(lineBits | UInt32(CMSPAR) | UInt32(CRTSCTS))
        tio.c_cflag |= UInt32(CLOCAL | CREAD)
        withUnsafeMutableBytes(of: &tio.c_cc) { cc in
            cc[kernelVMIN] = 1
            cc[kernelVTIME] = 0
        }

        switch settings.dataBits {
        case 5: tio.c_cflag |= UInt32(CS5)
        case 6: tio.c_cflag |= UInt32(CS6)
        case 7: tio.c_cflag |= UInt32(CS7)
        default: tio.c_cflag |= UInt32(CS8)
        }
        switch settings.parity {
        case .none: break
        case .even: tio.c_cflag |= UInt32(PARENB)
        case .odd: tio.c_cflag |= UInt32(PARENB | PARODD)
        case .mark: tio.c_cflag |= UInt32(PARENB | PARODD) | UInt32(CMSPAR)
        case .space: tio.c_cflag |= UInt32(PARENB) | UInt32(CMSPAR)
        }
        if settings.parity != .none { tio.c_iflag |= UInt32(INPCK) }
        if settings.stopBits == 2 { tio.c_cflag |= UInt32(CSTOPB) }
        switch settings.flowControl {
        case .none: break
        case .rtscts: tio.c_cflag |= UInt32(CRTSCTS)
        case .xonxoff: tio.c_iflag |= UInt32(IXON | IXOFF)
        }

        // Bit rate: the B-constant when there is one, else BOTHER with the number. CIBAUD cleared
        // means "input rate = output rate".
        tio.c_cflag &= ~(UInt32(CBAUD) | UInt32(CIBAUD))
        tio.c_cflag |= standardRates[settings.baudRate] ?? BOTHER
        tio.c_ispeed = UInt32(clamping: settings.baudRate)
        tio.c_ospeed = UInt32(clamping: settings.baudRate)
    }

    /// Reads the settings back out of a termios2 (what a driver actually accepted).
    static func settings(of tio: KernelTermios2) -> SerialSettings {
        let cflag = tio.c_cflag
        let dataBits: Int = switch cflag & UInt32(CSIZE) {
        case UInt32(CS5): 5
        case UInt32(CS6): 6
        case UInt32(CS7): 7
        default: 8
        }
        let parity: SerialSettings.Parity
        if cflag & UInt32(PARENB) == 0 {
            parity = .none
        } else if cflag & UInt32(CMSPAR) != 0 {
            parity = cflag & UInt32(PARODD) != 0 ? .mark : .space
        } else {
            parity = cflag & UInt32(PARODD) != 0 ? .odd : .even
        }
        let flow: SerialSettings.FlowControl = if cflag & UInt32(CRTSCTS) != 0 {
            .rtscts
        } else if tio.c_iflag & UInt32(IXON) != 0 {
            .xonxoff
        } else {
            .none
        }
        let code = cflag & UInt32(CBAUD)
        let rate = code == BOTHER ? Int(tio.c_ospeed) : (standardRates.first { $0.value == code }?.key ?? Int(tio.c_ospeed))
        return SerialSettings(baudRate: rate, dataBits: dataBits, parity: parity,
                              stopBits: cflag & UInt32(CSTOPB) != 0 ? 2 : 1, flowControl: flow)
    }
}
