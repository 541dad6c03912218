// Serial benchmarks (issue 3), beside plain C loops built in the same run:
//   transportkit-bench serial         pty throughput and 32-byte round trip; hot-plug latency (root)
//   umockdev-wrapper transportkit-bench serial-list   listing 1,000 fake serial ports (also pyserial)

import CBenchLoops
import Foundation
import TransportKit

enum SerialBench {
    static func run() async throws {
        let rounds = argument("--rounds", default: 5_000)
        let total = argument("--bytes", default: 64 << 20)
        let chunk = 4096
        let cThroughput = try await best(of: 3) { tk_bench_c_pty_throughput(total, chunk) }
        let tkThroughput = try await best(of: 3) { try await ptyThroughput(total: total, chunk: chunk) }
        let cRTT = try await best(of: 3) { tk_bench_c_pty_round_trips(Int32(rounds)) } / Double(rounds)
        let tkRTT = try await best(of: 3) { try await ptyRoundTrips(rounds) } / Double(rounds)
        let mib = Double(total) / 1_048_576
        print("pty (tty:// on the slave, C thread on the master), \(Int(mib)) MiB in \(chunk) B writes, best of 3")
        printThroughput(mib: mib, c: cThroughput, tk: tkThroughput)
        print("32-byte request/response over a pty, \(rounds) rounds, best of 3")
        print(String(format: "  round trip  C loop        %8.1f µs", cRTT * 1e6))
        print(String(format: "  round trip  TransportKit  %8.1f µs  (%.2fx C)", tkRTT * 1e6, tkRTT / cRTT))

        var cCount: Int32 = 0
        let cList = try await best(of: 5) { tk_bench_c_udev_list(&cCount) }
        var listed = 0
        let tkList = try await best(of: 5) {
            let start = ContinuousClock.now
            listed = await Transport.registry.devices(includeAll: true).devices.count
            return (ContinuousClock.now - start).seconds
        }
        print("listing this machine's ttys (real sysfs, --all), best of 5")
        print(String(format: "  plain libudev enumeration (C)        %7.2f ms  (%d of them backed by hardware)", cList * 1e3, cCount))
        print(String(format: "  Transport.registry.devices()         %7.2f ms  (%d ttys)", tkList * 1e3, listed))

        let uevent = "/sys/class/tty/ptmx/uevent"
        guard access(uevent, W_OK) == 0 else {
            print("hot-plug latency: skipped (needs root to trigger uevents through \(uevent))")
            return
        }
        let events = 200
        let cLatency = tk_bench_c_uevent_latency(uevent, Int32(events))
        let tkLatency = try await hotPlugLatency(uevent: uevent, events: events)
        print("hot-plug latency, uevent written → event received, mean of \(events) (kernel netlink group)")
        print(String(format: "  libudev monitor (C, poll)                 %7.1f µs", cLatency * 1e6))
        print(String(format: "  Transport.registry.deviceEvents()         %7.1f µs  (%.2fx C)", tkLatency * 1e6, tkLatency / cLatency))
    }

    static func ptyRoundTrips(_ rounds: Int) async throws -> Double {
        let path = try peer(echo: true, sinkTotal: 0)
        let connection = try await Transport.connect(to: "tty://\(path)")
        let request = [UInt8](repeating: 7, count: 32)
        let start = ContinuousClock.now
        for _ in 0..<rounds {
            try await connection.write(request)
            guard try await connection.readFrame(.fixedLength(32)) != nil else { throw TransportError(.disconnected, "echo ended") }
        }
        let elapsed = ContinuousClock.now - start
        try await connection.close()
        return elapsed.seconds
    }

    static func ptyThroughput(total: Int, chunk: Int) async throws -> Double {
        let path = try peer(echo: false, sinkTotal: total)
        let connection = try await Transport.connect(to: "tty://\(path)")
        let payload = [UInt8](repeating: 0, count: chunk)
        let start = ContinuousClock.now
        var sent = 0
        while sent < total {
            try await connection.write(payload)
            sent += chunk
        }
        guard try await connection.readFrame(.fixedLength(1)) != nil else { throw TransportError(.disconnected, "sink ended") }
        let elapsed = ContinuousClock.now - start
        try await connection.close()
        return elapsed.seconds
    }

    private static func peer(echo: Bool, sinkTotal: Int) throws -> String {
        var path = [CChar](repeating: 0, count: 64)
        guard tk_bench_c_pty_peer(echo ? 1 : 0, sinkTotal, &path, path.count) == 0 else {
            throw TransportError(.io, "could not start the C pty peer")
        }
        return path.withUnsafeBufferPointer { $0.baseAddress.map { String(cString: $0) } ?? "" }
    }

    static func hotPlugLatency(uevent: String, events: Int) async throws -> Double {
        var iterator = await Transport.registry.deviceEvents(includeAll: true).makeAsyncIterator()
        var total = Duration.zero
        for _ in 0..<events {
            let start = ContinuousClock.now
            try "change".write(toFile: uevent, atomically: false, encoding: .utf8)
            guard try await iterator.next() != nil else { throw TransportError(.io, "event stream ended") }
            total += ContinuousClock.now - start
        }
        return total.seconds / Double(events)
    }

    // MARK: Listing 1,000 fake ports (run under umockdev-wrapper)

    static func list() async throws {
        guard let testbed = FakeTestbed() else {
            print("serial-list: run under umockdev-wrapper (umockdev package) so that 1,000 fake ports can be created")
            return
        }
        let count = argument("--devices", default: 1000)
        var text = ""
        for index in 0..<count { text += FakeTestbed.ftdi(index) }
        let setupStart = ContinuousClock.now
        guard testbed.add(text) else { throw TransportError(.io, "umockdev rejected the fake devices") }
        print("created \(count) fake FTDI ports in \(String(format: "%.1f", (ContinuousClock.now - setupStart).seconds)) s (umockdev setup, not measured below)")

        var cCount: Int32 = 0
        let c = try await best(of: 5) { tk_bench_c_udev_list(&cCount) }
        var listed = 0
        let tk = try await best(of: 5) {
            let start = ContinuousClock.now
            listed = await Transport.registry.devices().devices.count
            return (ContinuousClock.now - start).seconds
        }
        let python = pyserial()
        print("listing \(count) serial ports (umockdev), best of 5")
        print(String(format: "  plain libudev enumeration (C)        %7.1f ms  (%d ports)", c * 1e3, cCount))
        print(String(format: "  Transport.registry.devices()         %7.1f ms  (%d ports, %.1fx C)", tk * 1e3, listed, tk / c))
        if let python {
            print(String(format: "  pyserial list_ports.comports()       %7.1f ms  (%d ports, %d with USB IDs, best of 3)", python.seconds * 1e3, python.count, python.withIDs))
        } else {
            print("  pyserial list_ports.comports()       not run (python3-serial is not installed)")
        }
    }

    /// Runs pyserial's listing in a child that shares the testbed; best of 3, timed inside Python.
    private static func pyserial() -> (seconds: Double, count: Int, withIDs: Int)? {
        let script = """
            import time, serial.tools.list_ports as lp
            best = None
            for _ in range(3):
                t = time.perf_counter(); ports = lp.comports(); e = time.perf_counter() - t
                best = e if best is None else min(best, e)
            print(len(ports), sum(1 for p in ports if p.vid is not None), best)
            """
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
        process.arguments = ["-c", script]
        var environment = ProcessInfo.processInfo.environment
        environment["UMOCKDEV_DIR"] = getenv("UMOCKDEV_DIR").map { String(cString: $0) }
        process.environment = environment
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = FileHandle.nullDevice
        guard (try? process.run()) != nil else { return nil }
        let output = String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        let fields = output.split(whereSeparator: \.isWhitespace)
        guard process.terminationStatus == 0, fields.count == 3, let count = Int(fields[0]), let withIDs = Int(fields[1]),
              let seconds = Double(fields[2]) else { return nil }
        return (seconds, count, withIDs)
    }
}

/// A umockdev testbed through dlopen (the benchmark has no C module for umockdev).
final class FakeTestbed {
    private let pointer: OpaquePointer
    private let addFromString: @convention(c) (OpaquePointer, UnsafePointer<CChar>, UnsafeMutableRawPointer?) -> Int32

    init?() {
        guard ProcessInfo.processInfo.environment["LD_PRELOAD"]?.contains("umockdev") == true,
              let library = dlopen("libumockdev.so.0", RTLD_NOW),
              let new = dlsym(library, "umockdev_testbed_new"), let add = dlsym(library, "umockdev_testbed_add_from_string") else { return nil }
        let make = unsafeBitCast(new, to: (@convention(c) () -> OpaquePointer?).self)
        guard let pointer = make() else { return nil }
        self.pointer = pointer
        self.addFromString = unsafeBitCast(add, to: (@convention(c) (OpaquePointer, UnsafePointer<CChar>, UnsafeMutableRawPointer?) -> Int32).self)
    }

    func add(_ text: String) -> Bool { addFromString(pointer, text, nil) != 0 }

    /// One FTDI FT232R (tty, usb-serial port, interface, device), child first, as umockdev-record prints it.
    static func ftdi(_ index: Int) -> String {
        let device = "/devices/pci0000:00/0000:00:14.0/usb\(1 + index / 100)/\(1 + index / 100)-\(index % 100 + 1)"
        let interface = device + "/\(1 + index / 100)-\(index % 100 + 1):1.0"
        let tty = "ttyUSB\(index)"
        return """
            P: \(interface)/\(tty)/tty/\(tty)
            N: \(tty)
            E: DEVNAME=/dev/\(tty)
            E: SUBSYSTEM=tty

            P: \(interface)/\(tty)
            E: DRIVER=ftdi_sio
            E: SUBSYSTEM=usb-serial
            L: driver=../../../../../../../bus/usb-serial/drivers/ftdi_sio

            P: \(interface)
            E: DEVTYPE=usb_interface
            E: DRIVER=ftdi_sio
            E: SUBSYSTEM=usb
            A: bInterfaceNumber=00

            P: \(device)
            E: DEVTYPE=usb_device
            E: SUBSYSTEM=usb
            A: idVendor=0403
            A: idProduct=6001
            A: serial=\(String(format: "S%05d", index))
            A: manufacturer=FTDI
            A: product=FT232R USB UART
            A: bNumInterfaces= 1


            """
    }
}
