import Foundation
import Glibc
import TestSupport
import SystemPackage
import Testing
@_spi(Plugins) @testable import TransportKit
@testable import TransportKitSerial
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

/// A pseudo-terminal pair made with plain openpty(3): the test holds the master and plays the
/// device; the code under test opens `path` (the slave) as tty://.
final class TestPTY: Sendable {
    let master: Int32
    let path: String
    private let slave: Int32

    init() throws {
        var master: Int32 = -1
        var slave: Int32 = -1
        guard openpty(&master, &slave, nil, nil, nil) == 0 else {
            throw TransportError.posix("openpty", errno: Errno(rawValue: errno), what: "test pty")
        }
        _ = fcntl(master, F_SETFD, FD_CLOEXEC)
        _ = fcntl(slave, F_SETFD, FD_CLOEXEC)
        var raw = termios()
        tcgetattr(master, &raw)
        cfmakeraw(&raw)
        tcsetattr(master, TCSANOW, &raw)
        self.master = master
        self.slave = slave
        self.path = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(slave)")) ?? ""
        // Only the code under test keeps the slave open; the test's own copy goes now, so closing
        // the master later really hangs the line up.
        _ = Glibc.close(slave)
    }

    /// The slave's termios as the kernel holds it, read through the master (TCGETS2 on a pty
    /// master reports its slave's settings).
    func termios2() throws -> KernelTermios2 { try Termios.get(FileDescriptor(rawValue: master), path: "test master") }

    func write(_ text: String) { Support.writeAll(master, Array(text.utf8)) }

    /// Reads what is there within `seconds`, without blocking a cooperative thread.
    func read(count: Int, seconds: Double = 2) async -> [UInt8] {
        let fd = master
        return await Support.offPool {
            var result: [UInt8] = []
            var buffer = [UInt8](repeating: 0, count: 4096)
            let deadline = Date().addingTimeInterval(seconds)
            while result.count < count, Date() < deadline {
                var poller = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
                guard poll(&poller, 1, 50) > 0 else { continue }
                let got = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
                if got <= 0 { break }
                result += buffer[..<got]
            }
            return result
        }
    }

    func closeMaster() { _ = Glibc.close(master) }
}


@Suite("tty:// over real pseudo-terminals")
struct TTYTests {
    @Test("bytes pass both ways, raw and untouched")
    func bytesBothWays() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)?baud=115200")
        pty.write("AT\r\n\u{0}\u{3}\u{7f}")
        let inbound = try await connection.readFrame(.fixedLength(7))
        #expect(inbound == Array("AT\r\n\u{0}\u{3}\u{7f}".utf8))
        try await connection.write("OK\n\u{4}")
        #expect(await pty.read(count: 4) == Array("OK\n\u{4}".utf8))
        #expect(connection.metadata.remoteAddress == pty.path)
        try await connection.close()
    }

    // A pty's driver forces CS8 and clears PARENB whatever is asked (drivers/tty/pty.c,
    // pty_set_termios), so data bits and parity are checked in the lab on a real CDC-ACM port; here
    // every bit a pty keeps is checked (rate, BOTHER, CSTOPB, CRTSCTS, IXON/IXOFF), and what it does
    // not keep is refused before anything changes (below).
    @Test("every line option reaches the kernel's termios", arguments: [
        ("baud=115200", 115_200, SerialSettings.Parity.none, 1, SerialSettings.FlowControl.none),
        ("baud=250000&dataBits=8&parity=none", 250_000, .none, 1, .none),
        ("baud=31250&stopBits=2", 31_250, .none, 2, .none),
        ("baud=9600&flowControl=rtscts", 9_600, .none, 1, .rtscts),
        ("baud=1000000&flowControl=xonxoff", 1_000_000, .none, 1, .xonxoff),
    ])
    func lineOptions(query: String, baud: Int, parity: SerialSettings.Parity, stopBits: Int,
                     flow: SerialSettings.FlowControl) async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)?\(query)")
        let tio = try pty.termios2()
        #expect(tio.c_ospeed == UInt32(baud) && tio.c_ispeed == UInt32(baud))
        // A rate without a B-constant must travel as BOTHER, a standard one as its constant.
        let code = tio.c_cflag & UInt32(CBAUD)
        #expect(code == (Termios.standardRates[baud] ?? Termios.BOTHER))
        let odd = tio.c_cflag & UInt32(PARODD) != 0
        let stick = tio.c_cflag & UInt32(CMSPAR) != 0
        #expect(odd == (parity == .odd || parity == .mark))
        #expect(stick == (parity == .mark || parity == .space))
        #expect((tio.c_cflag & UInt32(CSTOPB) != 0) == (stopBits == 2))
        #expect((tio.c_cflag & UInt32(CRTSCTS) != 0) == (flow == .rtscts))
        #expect((tio.c_iflag & UInt32(IXON | IXOFF) == UInt32(IXON | IXOFF)) == (flow == .xonxoff))
        #expect((tio.c_iflag & UInt32(INPCK) != 0) == (parity != .none))
        // Raw mode: no echo, no canonical input, no output processing, reads return per byte.
        #expect(tio.c_lflag & UInt32(ICANON | ECHO | ISIG) == 0)
        #expect(tio.c_oflag & UInt32(OPOST) == 0)
        #expect(tio.c_iflag & UInt32(ICRNL) == 0)
        try await connection.close()
    }

    @Test("framing a pty cannot carry is refused, saying why", arguments: [
        ("dataBits=7&parity=even", "has no parity bit and carries only 8 data bits (the kernel's pty driver clears PARENB and forces CS8 whatever is asked), so it cannot do 9600 7E1"),
        ("dataBits=5&parity=none&stopBits=2", "carries only 8 data bits (the kernel's pty driver clears PARENB and forces CS8 whatever is asked), so it cannot do 9600 5N2"),
        ("parity=mark&flowControl=rtscts", "has no parity bit (the kernel's pty driver clears PARENB and forces CS8 whatever is asked), so it cannot do 9600 8M1 rtscts"),
    ])
    func framingAPtyCannotCarry(query: String, words: String) async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let before = try pty.termios2()
        let error = await expectTransportError(.unsupported) { try await Transport.connect(to: "tty://\(pty.path)?\(query)") }
        #expect(error?.message.contains(words) == true, "\(error?.message ?? "")")
        #expect(try pty.termios2().c_ospeed == before.c_ospeed, "the port was closed again (and restore is the tool's default, not the library's)")
    }

    @Test("data bits and parity encode as the kernel defines them (checked without a driver)")
    func encoding() {
        for bits in 5...8 {
            for parity in SerialSettings.Parity.allCases {
                var tio = KernelTermios2()
                let settings = SerialSettings(baudRate: 4800, dataBits: bits, parity: parity, stopBits: 2)
                Termios.configure(&tio, settings)
                #expect(Termios.settings(of: tio) == settings)
            }
        }
        var tio = KernelTermios2()
        Termios.configure(&tio, SerialSettings(dataBits: 7, parity: .even))
        #expect(tio.c_cflag & UInt32(CSIZE) == UInt32(CS7))
        #expect(tio.c_cflag & UInt32(PARENB) != 0 && tio.c_cflag & UInt32(PARODD) == 0)
    }

    @Test("CornucopiaStreams' tty://adapter:19200/path sets 19200 bit/s; two rates are refused")
    func portIsBitRate() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://adapter:19200\(pty.path)")
        #expect(try await connection.serialPort?.settings().baudRate == 19200)
        try await connection.close()
        let error = await expectTransportError(.invalidURL) {
            try await Transport.connect(to: "tty://adapter:19200\(pty.path)?baud=9600")
        }
        #expect(error?.message.contains("two bit rates") == true)
    }

    @Test("settings change on an open connection")
    func applyAtRunTime() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        #expect(try await port.settings() == SerialSettings())
        // dataBits/parity stay 8/none: a pty forces them (see lineOptions).
        let changed = SerialSettings(baudRate: 57_600, dataBits: 8, parity: .none, stopBits: 2, flowControl: .rtscts)
        try await port.apply(changed)
        #expect(Termios.settings(of: try pty.termios2()) == changed)
        #expect(try await port.settings() == changed)
        try await port.apply(SerialSettings(baudRate: 123_456))
        #expect(try pty.termios2().c_ospeed == 123_456)
        await #expect(throws: TransportError.self) { try await port.apply(SerialSettings(dataBits: 9)) }
        try await connection.close()
    }

    @Test("exclusive by default: a second opener is told the port is busy and by whom; released on close")
    func exclusive() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let first = try await Transport.connect(to: "tty://\(pty.path)")
        let error = await expectTransportError(.busy) { try await Transport.connect(to: "tty://\(pty.path)") }
        // The holder is this very process (the first connection): said so, not "close that program".
        #expect(error?.message.contains("already open in this process (\(getpid()))") == true, "names the holder: \(error?.message ?? "")")
        #expect(error?.message.contains("Close that connection first") == true, "\(error?.message ?? "")")
        #expect(error?.message.contains("Close that program") == false, "\(error?.message ?? "")")
        #expect(error?.syscall == "flock" || error?.syscall == "open", "flock as root, EBUSY from TIOCEXCL otherwise")
        try await first.close()
        let second = try await Transport.connect(to: "tty://\(pty.path)")
        try await second.close()
    }

    @Test("a lock released a moment later (a forked child's copy of a closed descriptor) is waited for, not called busy")
    func lockReleasedSoon() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        // Another open file description holds the flock, as a child between fork and exec would
        // through its copy of a descriptor this process has closed.
        let holder = open(pty.path, O_RDWR | O_NOCTTY | O_CLOEXEC)
        let opener = open(pty.path, O_RDWR | O_NOCTTY | O_CLOEXEC)
        defer {
            if holder >= 0 { close(holder) }
            if opener >= 0 { close(opener) }
        }
        try #require(holder >= 0 && opener >= 0)
        try #require(flock(holder, LOCK_EX | LOCK_NB) == 0)
        let fd = FileDescriptor(rawValue: opener)
        // Held: with little patience, the would-block error comes through (openTTY makes it .busy).
        do {
            try await DeviceAccess.lockBriefly(fd, path: pty.path, patience: .milliseconds(10))
            Issue.record("the lock is held; lockBriefly should have given up")
        } catch let error as TransportError {
            #expect(error.errno == .wouldBlock && error.syscall == "flock", "\(error)")
        }
        // Released 20 ms later: waited for.
        let release = Thread { usleep(20_000); flock(holder, LOCK_UN) }
        let started = ContinuousClock.now
        release.start()
        try await DeviceAccess.lockBriefly(fd, path: pty.path, patience: .seconds(5))
        #expect(ContinuousClock.now - started >= .milliseconds(15), "it waited for the release")
    }

    @Test("exclusive=false lets two openers share the port")
    func shared() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let first = try await Transport.connect(to: "tty://\(pty.path)?exclusive=false")
        let second = try await Transport.connect(to: "tty://\(pty.path)?exclusive=false")
        try await first.write("a")
        try await second.write("b")
        #expect(await pty.read(count: 2).sorted() == Array("ab".utf8))
        try await first.close()
        try await second.close()
    }

    @Test("a pty has no modem lines and counts no line errors: asking is a clear .unsupported error")
    func modemLinesOnPTY() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        let error = await expectTransportError(.unsupported) { _ = try await port.modemLines() }
        #expect(error?.message.contains("modem control lines") == true)
        await expectTransportError(.unsupported) { try await port.setDTR(true) }
        let changes = await expectTransportError(.unsupported) { _ = try await port.modemLineChanges() }
        #expect(changes?.message.contains("modem control lines") == true, "\(String(describing: changes))")
        await expectTransportError(.unsupported) { try await port.setRTS(false) }
        let counts = await expectTransportError(.unsupported) { _ = try await port.lineErrors() }
        #expect(counts?.message.contains("counts no line errors") == true && counts?.errno == .inappropriateIOCTLForDevice,
                "TIOCGICOUNT: ENOTTY on a pty: \(String(describing: counts))")
        try await connection.close()
        // Asked for on open: refused before the connection exists, descriptor released.
        await expectTransportError(.unsupported) { try await Transport.connect(to: "tty://\(pty.path)?dtr=true") }
        #expect(Descriptors.count(on: pty.path) == 0)
    }

    @Test("break holds the line for the duration and leaves the port usable")
    func sendBreak() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        let start = ContinuousClock.now
        try await port.sendBreak(duration: .milliseconds(60))
        #expect(ContinuousClock.now - start >= .milliseconds(60))
        try await connection.write("x")
        #expect(await pty.read(count: 1) == Array("x".utf8))
        try await connection.close()
    }

    @Test("input flush drops bytes received but not read, also those already taken from the kernel")
    func flushInput() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        pty.write("stale bytes")
        try await Task.sleep(for: .milliseconds(200))
        try await port.flush(.input)
        pty.write("fresh")
        let frame = try await connection.readFrame(.fixedLength(5))
        #expect(frame.map { String(decoding: $0, as: UTF8.self) } == "fresh")
        try await port.flush(.output)
        #expect(try #require(connection.ttyPort).outputQueueBytes() == 0)
        try await connection.close()
    }

    @Test("drain returns once the other side has taken every byte")
    func drain() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        let payload = [UInt8](repeating: 0x55, count: 2048)
        let reader = Task { await pty.read(count: payload.count) }
        try await connection.write(payload)
        try await port.drain()
        #expect(try #require(connection.ttyPort).outputQueueBytes() == 0)
        let received = await reader.value
        #expect(received.count == payload.count)
        try await connection.close()
    }

    @Test("hang-up while open: bytes first, then .disconnected at once, no descriptor leaked")
    func hangUp() async throws {
        let pty = try TestPTY()
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        pty.write("last words")
        try await Task.sleep(for: .milliseconds(100))
        pty.closeMaster()
        let start = ContinuousClock.now
        let frame = try await connection.readFrame(.fixedLength(10))
        #expect(frame.map { String(decoding: $0, as: UTF8.self) } == "last words")
        let error = await expectTransportError(.disconnected) { try await connection.read() }
        // Without the hang-up seen, the read would wait for ever; the bound leaves room for a
        // loaded machine and ThreadSanitizer.
        #expect(ContinuousClock.now - start < .seconds(30))
        #expect(error?.message.contains("went away") == true)
        // The pty is gone with its master, so the connection's descriptors now show the node as deleted.
        let gone = pty.path + " (deleted)"
        #expect(Descriptors.count(on: gone) > 0)
        try await connection.close()
        #expect(await eventually { Descriptors.count(on: gone) == 0 })
    }

    @Test("missing device, a file that is not a tty, and a relative path give specific errors")
    func badPaths() async throws {
        let missing = await expectTransportError(.notFound) { try await Transport.connect(to: "tty:///dev/ttyDOESNOTEXIST9") }
        #expect(missing?.message.contains("transportkit list") == true)
        #expect(missing?.syscall == "open")
        let file = Support.temporaryPath("not-a-tty")
        _ = FileManager.default.createFile(atPath: file, contents: Data())
        defer { unlink(file) }
        let notTTY = await expectTransportError(.unsupported) { try await Transport.connect(to: "tty://\(file)") }
        #expect(notTTY?.syscall == "tcgetattr")
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tty://?baud=9600") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tty:///dev/ttyS0?parity=sometimes") }
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "tty:///dev/ttyS0?dataBits=9") }
    }

    @Test("the permission message names owner, group, mode and the fixes")
    func permissionMessage() throws {
        let message = DeviceAccess.permissionMessage(path: "/dev/ptmx")
        #expect(message.contains("owned by root:"))
        #expect(message.contains("mode crw"))
        #expect(message.contains("usermod -aG"))
        #expect(message.contains("udev rule"))
    }

    @Test("open/close cycles leak no descriptor")
    func noLeaks() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        for _ in 0..<20 {
            let connection = try await Transport.connect(to: "tty://\(pty.path)?lowLatency=true")
            // A pty has neither ASYNC_LOW_LATENCY nor an FTDI latency timer; the request is reported.
            #expect(connection.metadata.extra["lowLatency"] == "not supported by this driver")
            try await connection.write("z")
            try await connection.close()
        }
        #expect(await eventually { Descriptors.count(on: pty.path) == 0 })
    }
}

@Suite("serial listing on this machine")
struct ListingTests {
    @Test("the sysfs listing reads what libudev's own enumeration reads (this machine's ttys)",
          .enabled(if: !UMockdevTestbed.available, "runs in the plain suite"))
    func sysfsMatchesLibudev() throws {
        try expectSameListing()
    }

    @Test("ports sort by name, then by their number: ttyS2 before ttyS10")
    func naturalOrder() {
        let names = ["ttyUSB10", "ttyS10", "ttyUSB2", "ttyS2", "ttyACM0", "console", "ttyS0", "rfcomm1"]
        let sorted = names.sorted { SerialDiscovery.naturalKey($0) < SerialDiscovery.naturalKey($1) }
        #expect(sorted == ["console", "rfcomm1", "ttyACM0", "ttyS0", "ttyS2", "ttyS10", "ttyUSB2", "ttyUSB10"])
    }
}

@Suite("pty:// plays a serial device")
struct PTYSchemeTests {
    @Test("the peer path is in the metadata and behaves like a serial port for tty://")
    func peerIsASerialPort() async throws {
        let device = try await Transport.connect(to: "pty://?baud=38400")
        let peer = try #require(device.metadata.extra["peer"])
        #expect(peer.hasPrefix("/dev/pts/"))
        // A program (here: TransportKit itself) opens the peer like any serial port.
        let client = try await Transport.connect(to: "tty://\(peer)?baud=38400")
        try await client.write("ATI\r")
        #expect(try await device.readFrame(.delimiter("\r")).map { String(decoding: $0, as: UTF8.self) } == "ATI")
        try await device.write("ELM327 v1.5\r\r>")
        let reply = try await client.readFrame(.delimiter(">"))
        #expect(reply.map { String(decoding: $0, as: UTF8.self) } == "ELM327 v1.5\r\r")
        // The peer can close and come back: the device side stays up.
        try await client.close()
        let again = try await Transport.connect(to: "tty://\(peer)")
        try await again.write("+")
        #expect(try await device.readFrame(.fixedLength(1)).map { String(decoding: $0, as: UTF8.self) } == "+")
        try await again.close()
        try await device.close()
        #expect(await eventually { access(peer, F_OK) != 0 }, "the pty is released with the connection")
    }

    @Test("link= makes a symlink that lives as long as the connection")
    func link() async throws {
        let link = Support.temporaryPath("ttyFAKE")
        let device = try await Transport.connect(to: "pty://?link=\(link)")
        #expect((try? FileManager.default.destinationOfSymbolicLink(atPath: link)) == device.metadata.extra["peer"])
        let client = try await Transport.connect(to: "tty://\(link)")
        try await client.write("via link")
        #expect(try await device.readFrame(.fixedLength(8)).map { String(decoding: $0, as: UTF8.self) } == "via link")
        try await client.close()
        try await device.close()
        #expect(access(link, F_OK) != 0)
    }
}

/// The monitor against the real kernel's uevents (no udevd here: the "kernel" netlink group).
/// As root, writing "change" to a device's uevent file makes the kernel announce it.
@Suite("uevent monitor on the real kernel", .serialized,
       .enabled(if: access("/sys/class/tty/ptmx/uevent", W_OK) == 0, "needs root to trigger uevents"))
struct KernelUeventTests {
    static func trigger(_ count: Int = 1) {
        for _ in 0..<count {
            try? "change".write(toFile: "/sys/class/tty/ptmx/uevent", atomically: false, encoding: .utf8)
        }
    }

    /// The calling thread's name, as ps shows it.
    static func threadName() -> String {
        ((try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8)) ?? "").trimmingCharacters(in: .newlines)
    }

    @Test("an overflowing socket (ENOBUFS) is re-enumerated and the monitor keeps going")
    func overflowResyncs() async throws {
        // The threads the monitor read devices on, after the initializer's listing (this test's thread).
        let listedOn = Locked<Set<String>>([])
        // A receive buffer the kernel rounds up to its minimum: a burst overflows it.
        let monitor = try SerialDiscovery.monitor(include: { _ in listedOn.withLock { _ = $0.insert(Self.threadName()) }; return true },
                                                  receiveBufferSize: 1)
        #expect(monitor.group == "kernel" || monitor.group == "udev")
        listedOn.withLock { $0.removeAll() }
        Self.trigger(300)
        let waiter = Task { try await monitor.next() }
        #expect(await eventually(5) { monitor.resyncCount >= 1 }, "ENOBUFS was reported and answered with a resync")
        // (`include` also reads each received event's device, on the consumer's thread: one device, not a walk.)
        #expect(listedOn.withLock { $0 }.contains("tk uevent resyn"), "the resync walks sysfs on a thread of its own (named as ps shows it: 15 bytes)")
        // After the resync the monitor must deliver events again. Other tests (and processes) can
        // trigger uevents too, and with this tiny buffer a few at once overflow it again, so keep
        // triggering until one arrives.
        let result = try await withThrowingTaskGroup(of: (TTYMonitor.Action, TTYDeviceInfo)?.self) { group in
            group.addTask { try await waiter.value }
            group.addTask {
                for _ in 0..<25 {
                    Self.trigger()
                    try await Task.sleep(for: .milliseconds(200))
                }
                waiter.cancel()
                return nil
            }
            let first = try await group.next() ?? nil
            group.cancelAll()
            return first
        }
        #expect(result?.0 == .changed)
        #expect(result?.1.devnode == "/dev/ptmx")
    }

    @Test("deviceEvents lists on Blocking's pool, returns subscribed, and reports what happens next")
    func deviceEventsSubscribeOffTheCallersThread() async throws {
        let madeOn = Locked<String?>(nil)
        let events = await TTYMonitor.deviceEvents({
            madeOn.withLock { $0 = Self.threadName() }
            return try SerialDiscovery.monitor(include: { _ in true })
        }, record: SerialDiscovery.record)
        // Made before the call returned, on a thread of Blocking's pool, not this task's.
        let poolThread = try await Blocking.run { Self.threadName() }
        let made = try #require(madeOn.withLock { $0 }, "the monitor was made (and the ttys listed) before deviceEvents returned")
        #expect(!poolThread.isEmpty && made != Self.threadName())
        #expect(made.prefix { $0 != "#" } == poolThread.prefix { $0 != "#" }, "made on \(made), the pool's threads are named like \(poolThread)")
        // Subscribed: an event right after the call is reported (retriggered, as other tests may
        // overflow nothing here but the kernel group carries every process's events).
        let first = Task { () -> DeviceEvent? in
            for try await event in events where event.device.devnode == "/dev/ptmx" { return event }
            return nil
        }
        Self.trigger()
        let event = try await withTimeout(.seconds(5)) { try await first.value } ?? nil
        #expect(event?.action == .changed)
        first.cancel()
    }

    @Test("a waiting monitor is cancelled promptly")
    func cancellation() async throws {
        let monitor = try SerialDiscovery.monitor(include: { _ in true })
        let waiter = Task { try await monitor.next() }
        try await Task.sleep(for: .milliseconds(100))
        waiter.cancel()
        let start = ContinuousClock.now
        await #expect(throws: CancellationError.self) { try await waiter.value }
        #expect(ContinuousClock.now - start < .seconds(30), "a monitor with nothing to report waits for ever otherwise")
    }

    @Test("tty://PATH?wait=true waits for the node; without it the error says how to wait")
    func waitForPath() async throws {
        let link = Support.temporaryPath("ttyLATER")
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connect = Task { try await Transport.connect(to: "tty://\(link)?wait=true&timeout=60") }
        try await Task.sleep(for: .milliseconds(300))
        #expect(symlink(pty.path, link) == 0)
        defer { unlink(link) }
        let connection = try await connect.value
        try await connection.write("late")
        #expect(await pty.read(count: 4) == Array("late".utf8))
        try await connection.close()

        let timedOut = await expectTransportError(.timedOut) {
            try await Transport.connect(to: "tty://\(link)-never?wait=true&timeout=2")
        }
        #expect(timedOut?.message.contains("no device at \(link)-never was plugged in within the 2 s timeout: ") == true, "\(String(describing: timedOut))")
        #expect(timedOut?.message.contains("?timeout=") == true)
    }
}
