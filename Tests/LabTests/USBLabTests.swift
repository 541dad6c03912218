import Foundation
import Glibc
import Synchronization
import Testing
import TestSupport
import TransportKit

/// usb:// listing and hot-plug on the lab's real kernel: the Loopback gadget (labctl usb-loopback,
/// 1d6b:0104, serial TKLOOP0001) on dummy_hcd. The kernel's own uevent order is what this checks:
/// a USB device's "add" comes before its configuration and interfaces, its "bind" after.
@Suite("lab: usb:// listing and hot-plug", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct USBLabTests {
    /// As the listing writes it (the canonical spelling, `?serial=`); further options join with `&`.
    static let url = "usb://1d6b:0104?serial=TKLOOP0001"

    static func isLoopback(_ event: DeviceEvent) -> Bool { event.device.url == url }

    @Test func theLoopbackGadgetIsListedWithItsEndpointsAndItsPlugAndUnplugReportedOnceEach() async throws {
        try await Lab.ctl("usb-loopback", "unplug")
        let collector = await EventCollector()
        defer { collector.stop() }
        for round in 1...3 {
            let start = collector.events.count
            try await Lab.ctl("usb-loopback", "plug")
            let arrival = await collector.waitFor(from: start, seconds: 10, Self.isLoopback)
            let added = try #require(arrival.map { collector.events[$0] }, "round \(round): no arrival in \(collector.events)")
            #expect(added.action == .added)
            // Reported once the device was configured: its interface and endpoints are in the record.
            let interface = try #require(added.device.properties["interface.0"], "\(added.device)")
            #expect(interface.hasPrefix("ff/"), "a vendor-class interface: \(interface)")
            #expect(interface.contains("bulk in 0x8") && interface.contains("bulk out 0x0"), "\(interface)")
            #expect(added.device.product == "Lab Loopback")
            #expect(added.device.devnode?.hasPrefix("/dev/bus/usb/") == true)

            let listed = try await USBPlugin().devices(includeAll: false)
            #expect(listed.contains { $0.url == Self.url && $0.properties["interface.0"] == interface }, "\(listed.map(\.url))")

            let beforeUnplug = collector.events.count
            try await Lab.ctl("usb-loopback", "unplug")
            let removal = await collector.waitFor(from: beforeUnplug, seconds: 10, Self.isLoopback)
            #expect(removal.map { collector.events[$0].action } == .removed, "round \(round): \(collector.events)")
            try await Task.sleep(for: .milliseconds(300))
            let ours = collector.events[start...].filter(Self.isLoopback).map(\.action)
            #expect(ours == [.added, .removed], "round \(round): each event once: \(ours)")
        }
        #expect(collector.failure == nil, "\(collector.failure ?? "")")
    }

    @Test func aHundredPlugUnplugCyclesWithAWatcherReportEachArrivalAndRemovalOnce() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        let events = await EventCollector()
        defer { events.stop() }
        let cycles = 100
        let started = ContinuousClock.now
        var next = 0
        for cycle in 1...cycles {
            // The host side finishes with the new device (udev's rules, the kernel's own probing)
            // before the cable comes out again: an unbind right after enumeration was seen to leave
            // the host side without a disconnect under emulation.
            _ = try await Lab.run("/usr/bin/udevadm", ["settle", "--timeout=10"])
            try Gadget.setBound(false, gadget: "tkloop", controller: "dummy_udc.1")
            guard let removal = await events.waitFor(from: next, seconds: 15, Self.isLoopback) else {
                let present = (try? await USBPlugin().devices(includeAll: false))?.contains { $0.url == Self.url }
                Issue.record("cycle \(cycle): no event after the unplug; the device is \(present == true ? "still listed" : "gone from sysfs")")
                break
            }
            #expect(events.events[removal].action == .removed, "cycle \(cycle): \(events.events[removal])")
            try Gadget.setBound(true, gadget: "tkloop", controller: "dummy_udc.1")
            let arrival = try #require(await events.waitFor(from: removal + 1, seconds: 15, Self.isLoopback), "cycle \(cycle): no event after the replug")
            #expect(events.events[arrival].action == .added, "cycle \(cycle): \(events.events[arrival])")
            #expect(events.events[arrival].device.properties["interface.0"] != nil, "cycle \(cycle): arrived configured")
            next = arrival + 1
        }
        let elapsed = ContinuousClock.now - started
        try await Task.sleep(for: .seconds(2))   // a late duplicate would arrive within this
        let ours = events.events.filter(Self.isLoopback)
        print("lab: usb \(cycles) replug cycles in \(elapsed), \(ours.count) events")
        #expect(ours.count == 2 * cycles, "every removal and arrival once: \(ours.count) events")
        #expect(events.failure == nil, "\(events.failure ?? "")")
    }

    /// The Loopback gadget plugged in, and a connection to it.
    static func connect(_ options: String = "") async throws -> Connection {
        try await Lab.ctl("usb-loopback", "plug")
        return try await Transport.connect(to: url + (options.isEmpty ? "" : "&" + options))
    }

    /// `count` bytes in 4 KiB blocks, each starting with its number (big-endian): built with block
    /// copies, since a per-byte loop over tens of MiB takes minutes in a debug build under emulation.
    static func pattern(_ count: Int) -> [UInt8] {
        let block = (0..<4092).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ $0 / 256) }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(count + 4096)
        var number: UInt32 = 0
        while bytes.count < count {
            withUnsafeBytes(of: number.bigEndian) { bytes.append(contentsOf: $0) }
            bytes.append(contentsOf: block)
            number += 1
        }
        bytes.removeLast(bytes.count - count)
        return bytes
    }

    static func threadCount() -> Int { (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task").count) ?? -1 }

    /// Writes `bytes` while reading as many back; returns what came back.
    static func echo(_ connection: Connection, _ bytes: [UInt8]) async throws -> [UInt8] {
        async let written: Void = connection.write(bytes)
        var received: [UInt8] = []
        received.reserveCapacity(bytes.count)
        while received.count < bytes.count, let chunk = try await connection.read() { received += chunk }
        try await written
        return received
    }

    @Test func fourMiBGoOutOnBulkOUTAndComeBackOnBulkINInOrderAndNothingIsLeftBehind() async throws {
        // One connection first: what the process sets up once (libusb's first init) is not a leak.
        try await Self.connect().close()
        let descriptorsBefore = Descriptors.targets()
        let threadsBefore = Self.threadCount()
        let connection = try await Self.connect()
        #expect(connection.metadata.extra["interface"] == "0")
        #expect(connection.metadata.extra["inType"] == "bulk" && connection.metadata.extra["outType"] == "bulk")
        #expect(connection.metadata.extra["in"]?.hasPrefix("0x8") == true, "\(connection.metadata.extra)")
        #expect(connection.metadata.extra["inPacketSize"] == "512", "high speed: \(connection.metadata.extra)")
        #expect(connection.metadata.extra["speed"] == "high (480 Mbit/s)", "\(connection.metadata.extra)")
        #expect(connection.metadata.name == "Lab Loopback" && connection.metadata.serialNumber == "TKLOOP0001")
        let bytes = Self.pattern(4 << 20)
        let started = ContinuousClock.now
        let received = try await Self.echo(connection, bytes)
        print("lab: usb loopback 4 MiB out and back in \(ContinuousClock.now - started)")
        #expect(received.count == bytes.count)
        #expect(received == bytes, "every byte back, in order")
        let closing = ContinuousClock.now
        try await connection.close()
        print("lab: usb close after 4 MiB took \(ContinuousClock.now - closing)")
        let settled = await eventually(5) { Descriptors.targets().count <= descriptorsBefore.count && Self.threadCount() <= threadsBefore }
        #expect(settled, "descriptors \(Descriptors.targets()) (before \(descriptorsBefore)), threads \(Self.threadCount()) (before \(threadsBefore))")
    }

    @Test func theSameFourMiBAtSuperSpeedWith1024BytePackets() async throws {
        // dummy_hcd reloaded with is_super_speed: the gadget enumerates on its USB 3 root hub.
        _ = try await Lab.ctl("usb-speed", "super")
        var failure: (any Error)?
        do {
            let connection = try await Self.connect()
            #expect(connection.metadata.extra["speed"] == "super (5000 Mbit/s)", "\(connection.metadata.extra)")
            #expect(connection.metadata.extra["inPacketSize"] == "1024" && connection.metadata.extra["outPacketSize"] == "1024",
                    "super speed bulk endpoints: \(connection.metadata.extra)")
            let bytes = Self.pattern(4 << 20)
            let received = try await Self.echo(connection, bytes)
            #expect(received.count == bytes.count)
            #expect(received == bytes, "every byte back, in order")
            try await connection.close()
        } catch {
            failure = error
        }
        // Back to high speed for the other tests, whatever happened above.
        _ = try await Lab.ctl("usb-speed", "high")
        if let failure { throw failure }
    }

    @Test func aSlowReaderSuspendsTheWriterAndLosesNothing() async throws {
        let connection = try await Self.connect("transfers=2&transferSize=4096")
        let bytes = Self.pattern(2 << 20)
        let progress = Atomic<Int>(0)
        let writer = Task {
            for start in stride(from: 0, to: bytes.count, by: 65536) {
                try await connection.write(Array(bytes[start..<min(start + 65536, bytes.count)]))
                progress.store(start + 65536, ordering: .relaxed)
            }
        }
        // Nobody reads: the gadget's queue, the OUT transfers and our read queue fill, then writes wait.
        var last = -1
        var stable = 0
        while stable < 10 {
            try await Task.sleep(for: .milliseconds(100))
            let now = progress.load(ordering: .relaxed)
            stable = now == last ? stable + 1 : 0
            last = now
        }
        #expect(last < bytes.count, "the writer is held back while nobody reads (it got \(last) bytes out)")
        var received: [UInt8] = []
        while received.count < bytes.count, let chunk = try await connection.read() { received += chunk }
        try await writer.value
        #expect(received == bytes, "every byte, in order, once the reader caught up")
        try await connection.close()
    }

    @Test func anUnplugMidTransferEndsWithDisconnectedAfterTheBytesAndWaitFindsItAgain() async throws {
        let descriptorsBefore = Descriptors.open().count
        let connection = try await Self.connect()
        let bytes = Self.pattern(64 << 20)
        let writer = Task { try await connection.write(bytes) }
        let started = ContinuousClock.now
        var received: [UInt8] = []
        var ending: TransportError?
        var unplugged: ContinuousClock.Instant?
        do {
            while let chunk = try await connection.read() {
                received += chunk
                if unplugged == nil && received.count >= 256 * 1024 {
                    try await Lab.ctl("usb-loopback", "unplug")
                    unplugged = .now
                }
            }
        } catch let error as TransportError {
            ending = error
        }
        if let unplugged { print("lab: usb read ended \(ContinuousClock.now - unplugged) after the unplug returned (\(unplugged - started) after the start)") }
        #expect(ending?.kind == .disconnected, "\(String(describing: ending))")
        #expect(ending?.message.contains("went away") == true, "\(String(describing: ending))")
        #expect(received.count >= 256 * 1024 && Array(bytes.prefix(received.count)) == received, "what came before, in order")
        do {
            try await writer.value
            Issue.record("the write of 64 MiB finished although the device was unplugged")
        } catch let error as TransportError {
            #expect(error.kind == .disconnected, "\(error)")
        }
        var phase = ContinuousClock.now
        try await connection.close()
        print("lab: usb close after the unplug took \(ContinuousClock.now - phase)")

        // wait=true across the replug.
        let waiting = Task { try await Transport.connect(to: Self.url + "&wait=true&timeout=30") }
        try await Task.sleep(for: .milliseconds(500))
        phase = .now
        try await Lab.ctl("usb-loopback", "plug")
        let again = try await waiting.value
        print("lab: usb wait=true connected \(ContinuousClock.now - phase) after the replug began")
        phase = .now
        #expect(try await Self.echo(again, Array("again".utf8)) == Array("again".utf8), "a short write comes back (a short packet ends the gadget's request)")
        print("lab: usb echo after the replug took \(ContinuousClock.now - phase)")
        phase = .now
        try await again.close()
        print("lab: usb close took \(ContinuousClock.now - phase)")
        let settled = await eventually(5) { Descriptors.open().count <= descriptorsBefore }
        #expect(settled, "descriptors: \(Descriptors.open())")
    }

    /// `reconnect+usb://` by identity: the Loopback gadget unplugged and plugged in again is found
    /// by its arrival (not the 30 s delay), claimed again, and echoes on the same Connection.
    @Test(.timeLimit(.minutes(2)))
    func reconnectClaimsTheDeviceAgainAfterAReplug() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        let connection = try await Transport.connect(to: "reconnect+\(Self.url)&reconnect.initialDelay=30&reconnect.jitter=0")
        let events = Gathered(connection.events())
        defer { events.stop() }
        #expect(try await Self.echo(connection, Array("before".utf8)) == Array("before".utf8))
        let reading = Task { try await connection.readFrame(.fixedLength(5), timeout: .seconds(60)) }   // a read finds the loss
        try await Lab.ctl("usb-loopback", "unplug")
        #expect(await events.wait(10) { $0.contains { if case .disconnected = $0 { true } else { false } } }, "\(events.elements)")
        let replugged = ContinuousClock.now
        try await Lab.ctl("usb-loopback", "plug")
        #expect(await events.wait(20) { $0.contains(.connected(generation: 2)) }, "\(events.elements)")
        let back = ContinuousClock.now - replugged
        print("lab: reconnect+usb:// connected again \(back) after the replug began")
        #expect(back < .seconds(15), "the arrival started the attempt, not the 30 s delay: \(back)")
        try await connection.write(Array("after".utf8))
        #expect(try await reading.value == Array("after".utf8), "the reader carried on with the new claim")
        try await connection.close()
    }

    /// The Loopback function queues OUT requests of 4096 bytes: 1024 bytes (two full high-speed
    /// packets) complete one only when a short or zero-length packet ends them. With zlp=true the
    /// write ends with one, and the bytes come back on their own.
    @Test func zlpEndsAWriteThatIsAMultipleOfThePacketSize() async throws {
        let connection = try await Self.connect("zlp=true")
        let bytes = Self.pattern(1024)
        let back = Task { () -> [UInt8] in
            var received: [UInt8] = []
            while received.count < bytes.count, let chunk = try await connection.read() { received += chunk }
            return received
        }
        try await connection.write(bytes)
        let watchdog = Task {
            try await Task.sleep(for: .seconds(10))
            back.cancel()
        }
        let received = try? await back.value
        watchdog.cancel()
        #expect(received == bytes, "1024 bytes ended by a zero-length packet came back: \(received?.count ?? -1) bytes")
        try await connection.close()
    }

    @Test func controlTransfersReadDescriptorsAndARefusedRequestIsAnErrorThatLeavesTheStreamUp() async throws {
        let connection = try await Self.connect()
        let usb = try #require(connection.usbDevice)
        // GET_DESCRIPTOR(DEVICE): 18 bytes, idVendor and idProduct little-endian at 8 and 10.
        let device = try await usb.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18)
        #expect(device.count == 18 && device.first == 18 && device.dropFirst().first == 1, "\(device)")
        #expect(Array(device.dropFirst(8).prefix(4)) == [0x6b, 0x1d, 0x04, 0x01], "\(device)")
        // GET_DESCRIPTOR(STRING, iProduct) in US English: UTF-16LE after a two-byte header.
        let product = try await usb.controlIn(requestType: 0x80, request: 6, value: 0x0300 | UInt16(device.count > 15 ? device[15] : 0),
                                              index: 0x0409, length: 255)
        let units = stride(from: 2, to: product.count - 1, by: 2).map { UInt16(product[$0]) | UInt16(product[$0 + 1]) << 8 }
        #expect(String(decoding: units, as: UTF16.self) == "Lab Loopback", "\(product)")
        // A vendor request the Loopback function does not handle: the device stalls it.
        do {
            _ = try await usb.controlIn(requestType: 0xc0, request: 0x77, value: 0, index: 0, length: 4)
            Issue.record("the gadget answered vendor request 0x77")
        } catch let error as TransportError {
            #expect(error.kind == .io && error.message.contains("refused control request 0x77"), "\(error)")
            #expect(error.errno == .brokenPipe)
        }
        let misuse = await #expect(throws: TransportError.self) { try await usb.controlIn(requestType: 0x40, request: 1, value: 0, index: 0, length: 1) }
        #expect(misuse?.kind == .misuse)
        #expect(try await Self.echo(connection, Array("after".utf8)) == Array("after".utf8), "the stream still works")
        try await connection.close()
        let closed = await #expect(throws: TransportError.self) { try await usb.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18) }
        #expect(closed?.message.contains("closed") == true, "\(String(describing: closed))")
    }

    /// usbserial's generic driver bound to the Loopback interface (as /dev/ttyUSB0): a connect is
    /// `.busy` naming it; `detach=true` takes the interface for the connection and close() gives
    /// it back (the tty reappears).
    @Test func aKernelDriverOnTheInterfaceIsBusyUntilDetachTakesItAndGetsItBackOnClose() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        _ = try await Lab.run("/sbin/modprobe", ["usbserial", "vendor=0x1d6b", "product=0x0104"])
        do {
            let tty = "/dev/ttyUSB0"
            #expect(await eventually(10) { access(tty, F_OK) == 0 }, "usbserial_generic made no \(tty)")
            let busy = await expectLabError(.busy) { try await Transport.connect(to: Self.url) }
            #expect(busy?.message.contains("kernel driver usbserial_generic") == true && busy?.message.contains("detach=true") == true,
                    "\(String(describing: busy))")
            let connection = try await Transport.connect(to: Self.url + "&detach=true")
            #expect(await eventually(5) { access(tty, F_OK) != 0 }, "the driver let go of the interface while detached")
            #expect(try await Self.echo(connection, Array("detached".utf8)) == Array("detached".utf8))
            try await connection.close()
            #expect(await eventually(10) { access(tty, F_OK) == 0 }, "the driver got the interface back on close")
        } catch {
            Issue.record(error)
        }
        _ = try await Lab.run("/sbin/rmmod", ["usbserial"])
    }

    /// Reads reports from the gadget's /dev/hidgN until `count` bytes came, or 10 s passed.
    static func gadgetRead(_ fd: Int32, count: Int) -> [UInt8] {
        var bytes: [UInt8] = []
        var report = [UInt8](repeating: 0, count: 64)
        let deadline = ContinuousClock.now + .seconds(10)
        while bytes.count < count, ContinuousClock.now < deadline {
            var ready = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            guard poll(&ready, 1, 100) > 0 else { continue }
            let got = read(fd, &report, report.count)
            if got > 0 { bytes += report[0..<got] } else if got < 0 && errno != EAGAIN && errno != EINTR { break }
        }
        return bytes
    }

    /// Writes `bytes` to the gadget's /dev/hidgN as 64-byte reports (each waits until the one
    /// before went out); `true` when all were written within 10 s.
    static func gadgetWrite(_ fd: Int32, _ bytes: [UInt8]) -> Bool {
        var offset = 0
        let deadline = ContinuousClock.now + .seconds(10)
        while offset < bytes.count, ContinuousClock.now < deadline {
            var ready = pollfd(fd: fd, events: Int16(POLLOUT), revents: 0)
            guard poll(&ready, 1, 100) > 0 else { continue }
            let wrote = bytes[offset..<min(offset + 64, bytes.count)].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            if wrote > 0 { offset += wrote } else if wrote < 0 && errno != EAGAIN && errno != EINTR { return false }
        }
        return offset == bytes.count
    }

    /// Interrupt endpoints, on the lab's HID gadget (labctl usb-hid: 64-byte vendor reports, usbhid
    /// bound on the host): reports both ways through usb://, each IN report delivered as it
    /// arrives, usbhid back on close.
    @Test func interruptEndpointsCarryReportsBothWaysThroughAHIDGadget() async throws {
        let plugged = try await Lab.ctl("usb-hid", "plug")
        let node = try #require(plugged.split(whereSeparator: \.isWhitespace).last.map(String.init), "labctl printed \(plugged)")
        let gadget = open(node, O_RDWR | O_NONBLOCK | O_CLOEXEC)
        try #require(gadget >= 0, "open \(node): errno \(errno)")
        defer {
            close(gadget)
        }
        let hidraw = { (try? FileManager.default.contentsOfDirectory(atPath: "/sys/class/hidraw")) ?? [] }
        #expect(await eventually(10) { !hidraw().isEmpty }, "usbhid did not bind the gadget's interface")
        do {
            // No in=/out=: a device without a bulk pair gets its interrupt pair. The serial in the
            // path, the other spelling, still connects.
            let connection = try await Transport.connect(to: "usb://1d6b:0105/TKHID0001?detach=true")
            #expect(connection.metadata.extra["inType"] == "interrupt" && connection.metadata.extra["outType"] == "interrupt", "\(connection.metadata.extra)")
            #expect(connection.metadata.extra["inPacketSize"] == "64" && connection.metadata.extra["outPacketSize"] == "64", "\(connection.metadata.extra)")
            #expect(await eventually(5) { hidraw().isEmpty }, "usbhid let go of the interface while detached")

            // Host to device: 32 reports in one write, each arriving whole at the gadget.
            let toDevice = Self.pattern(32 * 64)
            async let atGadget = Lab.onThread { Self.gadgetRead(gadget, count: toDevice.count) }
            try await connection.write(toDevice)
            #expect(await atGadget == toDevice, "every report, in order")

            // Device to host: one report first (delivered alone, not held for a fuller transfer), then 31 more.
            let toHost = Self.pattern(32 * 64 + 4096).suffix(32 * 64).map { $0 ^ 0x5a }
            #expect(await Lab.onThread { Self.gadgetWrite(gadget, Array(toHost.prefix(64))) })
            let first = try await connection.read()
            #expect(first == Array(toHost.prefix(64)), "one 64-byte report read as it came")
            async let written = Lab.onThread { Self.gadgetWrite(gadget, Array(toHost.dropFirst(64))) }
            var received = first ?? []
            while received.count < toHost.count, let chunk = try await connection.read() { received += chunk }
            #expect(await written)
            #expect(received == toHost, "every report, in order")
            try await connection.close()
            #expect(await eventually(10) { !hidraw().isEmpty }, "usbhid got the interface back on close")
        } catch {
            Issue.record(error)
        }
        try await Lab.ctl("usb-hid", "unplug")
    }

    @Test func errorsSayWhatToDo() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        let wrongInterface = await expectLabError(.notFound) { try await Transport.connect(to: Self.url + "&interface=5") }
        #expect(wrongInterface?.message.contains("the device offers interface 0 alt 0: bulk") == true, "\(String(describing: wrongInterface))")
        let backwards = await expectLabError(.invalidURL) { try await Transport.connect(to: Self.url + "&in=0x02") }
        #expect(backwards?.message.contains("is an OUT endpoint") == true, "\(String(describing: backwards))")
        let absent = await expectLabError(.notFound) { try await Transport.connect(to: "usb://1d6b:0104/NOSUCHSERIAL") }
        #expect(absent?.message.contains("wait=true") == true, "\(String(describing: absent))")

        // Another connection holds the interface.
        let first = try await Transport.connect(to: Self.url)
        let busy = await expectLabError(.busy) { try await Transport.connect(to: Self.url) }
        #expect(busy?.message.contains("claimed by another program") == true, "\(String(describing: busy))")
        try await first.close()

        // Permission denied, as an unprivileged user: the node, its owner and mode, a udev rule for this VID:PID.
        let denied = try await Lab.run("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", Lab.cli, "connect", Self.url])
        #expect(denied.status != 0)
        #expect(denied.stderr.contains("permission denied opening /dev/bus/usb/"), "\(denied.stderr)")
        #expect(denied.stderr.contains("owned by root:root"), "\(denied.stderr)")
        #expect(denied.stderr.contains(#"ATTR{idVendor}=="1d6b", ATTR{idProduct}=="0104""#), "\(denied.stderr)")
    }
}
