import CBenchLoops
import Foundation
import Testing
import TestSupport
import TransportKit

/// Throughput through the Loopback gadget (bulk OUT, then back on bulk IN), TransportKit's usb://
/// beside a plain C loop on libusb's own asynchronous API (Sources/Benchmarks/CBenchLoops/usb_loops.c)
/// with the same transfer count and size, in the same run. dummy_hcd under emulation is no speed
/// reference: only the ratio means something. Prints `lab: bench` lines; asserts only that every
/// byte came back.
///
/// Not in the lab's default run (Scripts/lab.d/run-lab-tests skips it):
/// `Scripts/lab --no-build --filter USBBench`. BENCHMARKS.md has the figures.
@Suite("lab: usb:// throughput beside a plain libusb loop", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab: run Scripts/lab"))
struct USBBenchLabTests {
    static let total = 16 << 20
    static let transfers = 4
    static let size = 16384

    /// Runs a blocking C loop on a thread of its own, off the cooperative pool.
    static func onThread<Value: Sendable>(_ body: @escaping @Sendable () -> Value) async -> Value {
        await withCheckedContinuation { continuation in
            Thread.detachNewThread { continuation.resume(returning: body()) }
        }
    }

    static func seconds(_ elapsed: Duration) -> Double {
        Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) * 1e-18
    }

    /// One echo of `total` bytes through usb://: written in 1 MiB writes while read back.
    static func ours() async throws -> Double {
        let connection = try await Transport.connect(to: USBLabTests.url + "?transfers=\(transfers)&transferSize=\(size)")
        let piece = [UInt8](repeating: 0x5a, count: 1 << 20)
        let started = ContinuousClock.now
        async let written: Void = {
            for _ in 0..<(total / piece.count) { try await connection.write(piece) }
        }()
        var received = 0
        while received < total, let chunk = try await connection.read() { received += chunk.count }
        let elapsed = ContinuousClock.now - started
        try await written
        try await connection.close()
        #expect(received == total)
        return seconds(elapsed)
    }

    @Test func echoThroughTheLoopbackGadgetBesideAPlainLibusbLoop() async throws {
        try await Lab.ctl("usb-loopback", "plug")
        let device = try #require(try await USBPlugin().devices(includeAll: false).first { $0.url == USBLabTests.url })
        let node = try #require(device.devnode)
        let probe = try await Transport.connect(to: USBLabTests.url)
        let input = try #require(probe.metadata.extra["in"].flatMap { UInt8($0.dropFirst(2), radix: 16) })
        let output = try #require(probe.metadata.extra["out"].flatMap { UInt8($0.dropFirst(2), radix: 16) })
        try await probe.close()
        var results: [(plain: Double, ours: Double)] = []
        for _ in 1...2 {
            let (plain, received) = await Self.onThread { () -> (Double, Int64) in
                var received: Int64 = 0
                let seconds = tk_bench_c_usb_echo(node, 0, output, input, Int32(Self.transfers), Int32(Self.size), Int64(Self.total), &received)
                return (seconds, received)
            }
            #expect(plain > 0 && received >= Int64(Self.total), "plain loop: \(plain), \(received) bytes")
            let ours = try await Self.ours()
            results.append((plain, ours))
            let mib = Double(Self.total) / 1048576
            print(String(format: "lab: bench usb echo %d MiB, %d transfers of %d bytes: plain libusb loop %.2f MiB/s, TransportKit %.2f MiB/s, ratio %.2f",
                         Self.total >> 20, Self.transfers, Self.size, mib / plain, mib / ours, plain / ours))
        }
    }
}
