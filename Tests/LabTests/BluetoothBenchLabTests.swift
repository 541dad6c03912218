import CBlueZ
import Foundation
import Glibc
import Synchronization
import Testing
import TestSupport
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// Throughput through the emulated link, TransportKit beside a plain socket loop (the system calls
/// in a loop, no event loop) over the same link in the same run: RFCOMM, LE L2CAP CoC and GATT
/// serial. It prints figures (lines starting `lab: bench`) and asserts only that every byte
/// arrived: emulated controllers make the ratios the meaningful part, never the absolute rates.
///
/// Not in the lab's default run (Scripts/lab.d/run-lab-tests skips it):
/// `Scripts/lab --no-build --filter BluetoothBench`. BENCHMARKS.md has the figures.
@Suite("lab: Bluetooth throughput beside a plain socket loop", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct BluetoothBenchLabTests {
    static let size = 256 * 1024

    /// A kernel socket on hci1 that takes one connection and reads `expecting` bytes; returns when
    /// they arrived (the clock stops there) and how many did.
    static func sink(_ listener: Int32, expecting: Int) -> Task<(count: Int, done: ContinuousClock.Instant), Never> {
        // On a thread of its own: accept(2) and recv(2) block.
        Task { await Lab.onThread {
            let server = accept(listener, nil, nil)
            guard server >= 0 else { return (0, .now) }
            defer { close(server) }
            var limit = timeval(tv_sec: 20, tv_usec: 0)
            setsockopt(server, SOL_SOCKET, SO_RCVTIMEO, &limit, socklen_t(MemoryLayout<timeval>.size))
            var count = 0
            var buffer = [UInt8](repeating: 0, count: 65536)
            while count < expecting {
                let got = recv(server, &buffer, buffer.count, 0)
                guard got > 0 else { break }
                count += got
            }
            return (count, .now)
        } }
    }

    static func rate(_ bytes: Int, _ elapsed: Duration) -> Double {
        Double(bytes) / (Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) * 1e-18)
    }

    static func report(_ what: String, plain: Double, ours: Double) {
        print(String(format: "lab: bench %@: plain loop %.1f KiB/s, TransportKit %.1f KiB/s, ratio %.2f", what, plain / 1024, ours / 1024, ours / plain))
    }

    /// Passes of the socket transfers: the emulated link's rate swings by a third from one
    /// transfer to the next, so one pass each says little.
    static let passes = 3

    /// `passes` alternating transfers (the plain loop, then TransportKit), each printed, then the
    /// medians and their ratio.
    static func alternate(_ what: String, plain: () throws -> Double, ours: () async throws -> Double) async throws {
        var plainRates: [Double] = []
        var ourRates: [Double] = []
        for pass in 1...passes {
            plainRates.append(try plain())
            ourRates.append(try await ours())
            report("\(what) pass \(pass)", plain: plainRates[pass - 1], ours: ourRates[pass - 1])
        }
        func median(_ rates: [Double]) -> Double { rates.sorted()[rates.count / 2] }
        report("\(what), median of \(passes) passes", plain: median(plainRates), ours: median(ourRates))
    }

    /// One transfer of `size` bytes to a fresh sink: the plain loop writes `piece` bytes per send(2).
    static func plainTransfer(_ kind: BluetoothLabTests.SocketKind, _ controllers: BluetoothLabTests.Controllers, piece: (Int32) -> Int) throws -> Double {
        let listener = kind.socket(boundTo: controllers.peripheral, listening: true)
        try #require(listener >= 0 && listen(listener, 1) == 0, "listener: \(errno)")
        defer { close(listener) }
        let sink = Self.sink(listener, expecting: size)
        let client = kind.socket(boundTo: controllers.central, listening: false)
        try #require(client >= 0, "socket: \(errno)")
        defer { close(client) }
        try #require(kind.connect(client, to: controllers.peripheral) == 0, "connect: \(errno)")
        let chunk = piece(client)
        let data = BlueZLabTests.pattern(size)
        let started = ContinuousClock.now
        var offset = 0
        while offset < data.count {
            let end = min(offset + chunk, data.count)
            let sent = data[offset..<end].withUnsafeBytes { send(client, $0.baseAddress, $0.count, 0) }
            try #require(sent > 0, "send: \(errno)")
            offset += sent
        }
        let (count, done) = awaitBlocking(sink)
        try #require(count == size, "the sink got \(count) of \(size) bytes")
        return rate(size, done - started)
    }

    /// The same transfer through a TransportKit connection, written in 4 KiB writes.
    static func ourTransfer(_ kind: BluetoothLabTests.SocketKind, url: String, _ controllers: BluetoothLabTests.Controllers) async throws -> Double {
        let listener = kind.socket(boundTo: controllers.peripheral, listening: true)
        try #require(listener >= 0 && listen(listener, 1) == 0, "listener: \(errno)")
        defer { close(listener) }
        let sink = Self.sink(listener, expecting: size)
        let connection = try await BlueZLabTests.connect(url)
        let data = BlueZLabTests.pattern(size)
        let started = ContinuousClock.now
        var offset = 0
        while offset < data.count {
            let end = min(offset + 4096, data.count)
            try await connection.write(Array(data[offset..<end]))
            offset = end
        }
        let (count, done) = await sink.value
        try? await connection.close()
        try #require(count == size, "the sink got \(count) of \(size) bytes")
        return rate(size, done - started)
    }

    /// Waits for a detached task from synchronous code (the plain loop stays free of async).
    static func awaitBlocking<T: Sendable>(_ task: Task<T, Never>) -> T {
        let result = Locked<T?>(nil)
        let done = DispatchSemaphore(value: 0)
        Task.detached {
            let value = await task.value
            result.withLock { $0 = value }
            done.signal()
        }
        done.wait()
        return result.withLock { $0! }
    }

    @Test func rfcommThroughput() async throws {
        let controllers = try await BlueZLabTests.setUp()
        let kind = BluetoothLabTests.SocketKind.rfcomm(channel: 11)
        try await Self.alternate("RFCOMM \(Self.size / 1024) KiB") {
            try Self.plainTransfer(kind, controllers) { _ in 4096 }
        } ours: {
            try await Self.ourTransfer(kind, url: "rfcomm://\(controllers.peripheralText):11?adapter=hci0", controllers)
        }
    }

    @Test func leL2CAPThroughput() async throws {
        let controllers = try await BlueZLabTests.setUp()
        let kind = BluetoothLabTests.SocketKind.l2capLE(psm: 145)
        try await Self.alternate("LE L2CAP CoC \(Self.size / 1024) KiB") {
            try Self.plainTransfer(kind, controllers) { fd in
                var mtu: UInt16 = 0
                var length = socklen_t(MemoryLayout<UInt16>.size)
                getsockopt(fd, SOL_BLUETOOTH, BT_SNDMTU, &mtu, &length)
                return Int(mtu)
            }
        } ours: {
            try await Self.ourTransfer(kind, url: "ble://FFF0:145/\(controllers.peripheralText)?adapter=hci0", controllers)
        }
    }

    /// GATT serial to the tests' peripheral: TransportKit's ble:// (acquired descriptors, and the
    /// D-Bus fallback) beside a plain send(2) loop on a write descriptor the test acquires itself
    /// from bluetoothd (AcquireWrite) on the same connected device.
    @Test func gattSerialThroughput() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp(echo: false)
        let size = 32 * 1024
        let data = BlueZLabTests.pattern(size)
        func waitForPeripheral(_ expected: Int, from started: ContinuousClock.Instant) async throws -> Double {
            let until = ContinuousClock.now + .seconds(60)
            while peripheral.log.bytes.withLock({ $0.count }) < expected && ContinuousClock.now < until {
                try await Task.sleep(for: .milliseconds(2))
            }
            let got = peripheral.log.bytes.withLock { $0.count }
            try #require(got >= expected, "the peripheral got \(got) of \(expected) bytes")
            return Self.rate(size, ContinuousClock.now - started)
        }

        // TransportKit, acquired descriptors (the default).
        var rates: [String: Double] = [:]
        for (label, url) in [("AcquireWrite", "ble://nus/\(controllers.peripheralText)?adapter=hci0"),
                             ("WriteValue", "ble://nus/\(controllers.peripheralText)?adapter=hci0&acquire=never")] {
            let connection = try await Transport.connect(to: url)
            let before = peripheral.log.bytes.withLock { $0.count }
            let started = ContinuousClock.now
            try await connection.write(data)
            rates[label] = try await waitForPeripheral(before + size, from: started)
            if label == "WriteValue" {
                // The plain loop, while this connection keeps the device connected and leaves the
                // write characteristic unacquired.
                let bus = try DBusConnection(.system)
                let reply = try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
                let device = "/org/bluez/hci0/dev_" + controllers.peripheralText.replacingOccurrences(of: ":", with: "_")
                let path = (reply.first?.dictionary ?? [:]).first { path, interfaces in
                    path.hasPrefix(device + "/")
                        && interfaces.dictionary?["org.bluez.GattCharacteristic1"]?.dictionary?["UUID"]?.text == "6e400002-b5a3-f393-e0a9-e50e24dcca9e"
                }?.key
                let characteristic = try #require(path)
                let acquired = try await bus.call(destination: "org.bluez", path: characteristic, interface: "org.bluez.GattCharacteristic1",
                                                  member: "AcquireWrite", [.dictionary([:])])
                defer { Task { await bus.close() } }
                guard case .unixFD(let fd)? = acquired.first, case .uint16(let mtu)? = acquired.dropFirst().first else {
                    Issue.record("AcquireWrite answered \(acquired)")
                    return
                }
                defer { close(fd) }
                let piece = min(Int(mtu) - 3, 510)
                let plainBefore = peripheral.log.bytes.withLock { $0.count }
                let plainStarted = ContinuousClock.now
                var offset = 0
                while offset < data.count {
                    let end = min(offset + piece, data.count)
                    let sent = data[offset..<end].withUnsafeBytes { send(fd, $0.baseAddress, $0.count, 0) }
                    if sent < 0 && (errno == EAGAIN || errno == EINTR) {
                        usleep(200)
                        continue
                    }
                    try #require(sent > 0, "send: \(errno)")
                    offset = end
                }
                rates["plain"] = try await waitForPeripheral(plainBefore + size, from: plainStarted)
            }
            try? await connection.close()
        }
        let plain = try #require(rates["plain"])
        Self.report("GATT serial \(size / 1024) KiB, AcquireWrite", plain: plain, ours: rates["AcquireWrite"] ?? 0)
        Self.report("GATT serial \(size / 1024) KiB, WriteValue fallback", plain: plain, ours: rates["WriteValue"] ?? 0)
    }
    /// The GATT central (BluetoothPeripheral) beside a plain client of BlueZ's D-Bus API (calls and
    /// a signal subscription on a DBusConnection, nothing else) on the same link in the same run:
    /// notifications received per second, writes with response per second, and a connect's time
    /// in its steps.
    @Test func gattCentralBesideAPlainDBusClient() async throws {
        let (controllers, peripheral) = try await GattLabTests.setUp(echo: false)
        let count = 400
        // TransportKit's peripheral role beside the lab's plain D-Bus peripheral (LabPeripheral,
        // which emits PropertiesChanged and answers WriteValue itself), on the same hci1: a
        // notifying characteristic and one written with response.
        let benchService = "a0c1b000-7b2d-4a0e-9d4c-5e7a1b2c3d40", benchNotify = "a0c1b001-7b2d-4a0e-9d4c-5e7a1b2c3d40"
        let benchWrite = "a0c1b002-7b2d-4a0e-9d4c-5e7a1b2c3d40", benchAcknowledged = "a0c1b003-7b2d-4a0e-9d4c-5e7a1b2c3d40"
        let server = try await GATTServer.publish([GATTServer.Service(uuid: benchService, characteristics: [
            GATTServer.Characteristic(uuid: benchNotify, properties: .notify),
            // LabPeripheral's stored characteristic's flags: bluetoothd acknowledges the central's
            // write before the application has it (GattApplication.swift's header).
            GATTServer.Characteristic(uuid: benchWrite, properties: [.read, .write, .writeWithoutResponse]),
            // Without write-without-response: the central's write waits for the application's answer.
            GATTServer.Characteristic(uuid: benchAcknowledged, properties: [.read, .write]),
        ])], advertising: nil, adapter: "hci1")
        // The connect, step by step, the way GattSession does it, timed from outside.
        let started = ContinuousClock.now
        let device = try await BluetoothPeripheral.connect(to: controllers.peripheralText, adapter: "hci0", timeout: .seconds(30))
        let connectTook = ContinuousClock.now - started
        let devicePath = "/org/bluez/hci0/dev_" + controllers.peripheralText.replacingOccurrences(of: ":", with: "_")
        let levelPath = try #require(try await Self.characteristicPath("00002a19-0000-1000-8000-00805f9b34fb", under: devicePath))
        let storedPath = try #require(try await Self.characteristicPath(LabPeripheral.stored, under: devicePath))
        print("lab: bench GATT central connect (discovery, Connect, services resolved, one tree read): \(connectTook)")
        print("lab: bench GATT central connect steps: " + device.connectSteps.map { "\($0.name) \(Int(Self.seconds($0.duration) * 1000)) ms" }.joined(separator: ", "))

        // Notifications: the central's sequence, ended (StopNotify) before the plain client's turn.
        func oursReceive() async throws -> Double {
            let values = try await device.notifications(of: "2a19")
            var iterator = values.makeAsyncIterator()
            let clock = ContinuousClock.now
            for index in 0..<count { try await peripheral.notifyBatteryLevel(UInt8(truncatingIfNeeded: index)) }
            var received = 0
            while received < count, try await iterator.next() != nil { received += 1 }
            #expect(received == count)
            return Double(count) / Self.seconds(ContinuousClock.now - clock)
        }
        let ours = try await oursReceive()
        try await Task.sleep(for: .milliseconds(500))   // StopNotify goes out from a task of its own
        var clock = ContinuousClock.now

        // The plain client: its own bus connection, a match on the characteristic, StartNotify
        // (bluetoothd already notifies this process; a second client's StartNotify adds it).
        let bus = try DBusConnection(.system)
        let plainValues = try await bus.signals(DBusMatch(sender: "org.bluez", path: levelPath, interface: "org.freedesktop.DBus.Properties",
                                                          member: "PropertiesChanged"), buffering: .all(limit: 100_000))
        _ = try await bus.call(destination: "org.bluez", path: levelPath, interface: "org.bluez.GattCharacteristic1", member: "StartNotify")
        var plainIterator = plainValues.makeAsyncIterator()
        clock = ContinuousClock.now
        for index in 0..<count { try await peripheral.notifyBatteryLevel(UInt8(truncatingIfNeeded: index)) }
        var plainReceived = 0
        while plainReceived < count, let signal = try await plainIterator.next() {
            if signal.values.dropFirst().first?.dictionary?["Value"] != nil { plainReceived += 1 }
        }
        let plain = Double(count) / Self.seconds(ContinuousClock.now - clock)
        #expect(plainReceived == count)
        print(String(format: "lab: bench GATT central notifications (%d of 1 byte): plain D-Bus client %.0f/s, BluetoothPeripheral %.0f/s, ratio %.2f",
                     count, plain, ours, ours / plain))

        // Writes with response, one after the other.
        let writes = 200
        clock = ContinuousClock.now
        for index in 0..<writes { try await device.write([UInt8(truncatingIfNeeded: index)], to: LabPeripheral.stored) }
        let oursWrites = Double(writes) / Self.seconds(ContinuousClock.now - clock)
        clock = ContinuousClock.now
        for index in 0..<writes {
            _ = try await bus.call(destination: "org.bluez", path: storedPath, interface: "org.bluez.GattCharacteristic1", member: "WriteValue",
                                   [.bytes([UInt8(truncatingIfNeeded: index)]), .dictionary(["type": .string("request")])])
        }
        let plainWrites = Double(writes) / Self.seconds(ContinuousClock.now - clock)
        print(String(format: "lab: bench GATT central writes with response (%d of 1 byte): plain D-Bus client %.0f/s, BluetoothPeripheral %.0f/s, ratio %.2f",
                     writes, plainWrites, oursWrites, oursWrites / plainWrites))
        _ = try? await bus.call(destination: "org.bluez", path: levelPath, interface: "org.bluez.GattCharacteristic1", member: "StopNotify")
        await bus.close()

        // The peripheral side: GATTServer's notify and write handling beside LabPeripheral's, the
        // same central receiving and writing.
        let serverEvents = Gathered(server.events())
        let served = Gathered(try await device.notifications(of: benchNotify))
        #expect(await serverEvents.wait(10) { $0.contains(.subscribed(characteristic: benchNotify)) }, "StartNotify reached the server")
        clock = ContinuousClock.now
        for index in 0..<count { try await server.notify([UInt8(truncatingIfNeeded: index)], to: benchNotify) }
        #expect(await served.wait(60) { $0.count >= count }, "\(served.elements.count) of \(count) notifications")
        let serverNotifications = Double(count) / Self.seconds(ContinuousClock.now - clock)
        print(String(format: "lab: bench GATT peripheral notifications (%d of 1 byte, received by BluetoothPeripheral): LabPeripheral (plain D-Bus) %.0f/s, "
                     + "GATTServer %.0f/s, ratio %.2f", count, ours, serverNotifications, serverNotifications / ours))
        clock = ContinuousClock.now
        for index in 0..<writes { try await device.write([UInt8(truncatingIfNeeded: index)], to: benchWrite) }
        let serverWrites = Double(writes) / Self.seconds(ContinuousClock.now - clock)
        #expect(await eventually(5) { (try? server.value(of: benchWrite)) == [UInt8(truncatingIfNeeded: writes - 1)] })
        clock = ContinuousClock.now
        for index in 0..<writes { try await device.write([UInt8(truncatingIfNeeded: index)], to: benchAcknowledged) }
        let acknowledgedWrites = Double(writes) / Self.seconds(ContinuousClock.now - clock)
        #expect(try server.value(of: benchAcknowledged) == [UInt8(truncatingIfNeeded: writes - 1)])
        print(String(format: "lab: bench GATT peripheral writes with response (%d of 1 byte, from BluetoothPeripheral, same flags as LabPeripheral's): "
                     + "LabPeripheral (plain D-Bus) %.0f/s, GATTServer %.0f/s, ratio %.2f; GATTServer answering each write itself "
                     + "(no write-without-response) %.0f/s", writes, oursWrites, serverWrites, serverWrites / oursWrites, acknowledgedWrites))
        await device.disconnect()
        await server.close()
    }

    /// The object path bluetoothd gives the characteristic `uuid` of the device at `devicePath`.
    static func characteristicPath(_ uuid: String, under devicePath: String) async throws -> String? {
        let bus = try DBusConnection(.system)
        let reply = try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
        await bus.close()
        return (reply.first?.dictionary ?? [:]).first { path, interfaces in
            path.hasPrefix(devicePath + "/") && interfaces.dictionary?["org.bluez.GattCharacteristic1"]?.dictionary?["UUID"]?.text == uuid
        }?.key
    }

    static func seconds(_ duration: Duration) -> Double {
        Double(duration.components.seconds) + Double(duration.components.attoseconds) * 1e-18
    }
}
