// USB benchmark (issue 15), inside the lab, against the Loopback gadget (labctl usb-loopback plug):
//   transportkit-bench usb [--url URL] [--bytes N] [--transfers N] [--size N] [--passes N] [--c-handover] [--only-c | --only-transportkit]
// Each pass echoes --bytes through the gadget twice: a plain libusb loop on libusb's own asynchronous
// API (CBenchLoops/usb_loops.c) and usb:// with the same transfer count and size, in alternating order.
// --c-handover gives the C loop usb://'s hand-over of the bytes to another thread (usb_loops.h), as
// a second reference; the issue's target is against the plain loop.
// dummy_hcd under emulation is no speed reference: only the ratio means something.

import CBenchLoops
import Foundation
import NIOCore
import TransportKit

enum USBBench {
    static func run() async throws {
        let arguments = CommandLine.arguments
        let url = arguments.firstIndex(of: "--url").flatMap { $0 + 1 < arguments.count ? arguments[$0 + 1] : nil }
            ?? "usb://1d6b:0104?serial=TKLOOP0001"
        let total = argument("--bytes", default: 64 << 20)
        let transfers = argument("--transfers", default: 4)
        let size = argument("--size", default: 16384)
        let passes = argument("--passes", default: 3)
        let handover = arguments.contains("--c-handover")

        guard let device = try await USBPlugin().devices(includeAll: false).first(where: { $0.url == url }), let node = device.devnode else {
            throw TransportError(.notFound, "usb bench: no device lists as \(url): plug the lab's Loopback gadget in (labctl usb-loopback plug)")
        }
        let probe = try await Transport.connect(to: url)
        let endpoints = (probe.metadata.extra["in"], probe.metadata.extra["out"], probe.metadata.extra["interface"])
        try await probe.close()
        guard let input = endpoints.0.flatMap({ UInt8($0.dropFirst(2), radix: 16) }),
              let output = endpoints.1.flatMap({ UInt8($0.dropFirst(2), radix: 16) }),
              let interface = endpoints.2.flatMap({ Int32($0) }) else {
            throw TransportError(.io, "usb bench: \(url) reported no endpoints in its metadata")
        }
        let speed = device.properties["speed"] ?? "?"
        let mib = Double(total) / 1_048_576
        print("usb echo through \(url) (\(speed)), \(Int(mib)) MiB out and back, \(transfers) transfers of \(size) bytes each way, \(passes) passes"
              + (handover ? "; the C loop hands its bytes to a consumer thread" : ""))
        // One echo each way: the plain C loop on a thread of its own, and usb:// with the same settings.
        func cLoop() async throws -> Double {
            let (c, received) = await onThread { () -> (Double, Int64) in
                var received: Int64 = 0
                let seconds = tk_bench_c_usb_echo(node, interface, output, input, Int32(transfers), Int32(size), Int64(total),
                                                  handover ? 1 : 0, &received)
                return (seconds, received)
            }
            guard c > 0, received >= Int64(total) else { throw TransportError(.io, "usb bench: the C loop failed (\(c), \(received) bytes)") }
            return c
        }
        // The listed URL already has a query (?serial=): the options join it.
        var tuned = try TransportURL(url)
        tuned.query += [(name: "transfers", value: String(transfers)), (name: "transferSize", value: String(size))]
        let transportKit = tuned.description
        // For a profiler: one side alone.
        if arguments.contains("--only-c") {
            print(String(format: "  C libusb loop %7.2f MiB/s", mib / (try await cLoop())))
            return
        }
        if arguments.contains("--only-transportkit") {
            print(String(format: "  TransportKit %7.2f MiB/s", mib / (try await echo(url: transportKit, total: total))))
            return
        }
        // The order alternates (C first in odd passes, TransportKit first in even ones), so that
        // neither side always runs on a bus and a guest the other has just warmed up or left busy.
        var ratios: [Double] = []
        var seconds = (c: 0.0, tk: 0.0)
        for pass in 1...passes {
            let c: Double
            let tk: Double
            if pass % 2 == 1 {
                c = try await cLoop()
                tk = try await echo(url: transportKit, total: total)
            } else {
                tk = try await echo(url: transportKit, total: total)
                c = try await cLoop()
            }
            ratios.append(c / tk)
            seconds.c += c
            seconds.tk += tk
            print(String(format: "  pass %2d  C libusb loop %7.2f MiB/s   TransportKit %7.2f MiB/s (%3.0f%% of C)%@",
                         pass, mib / c, mib / tk, 100 * c / tk, pass % 2 == 1 ? "" : "  TransportKit first"))
        }
        let sorted = ratios.sorted()
        let quartile = (sorted[sorted.count / 4], sorted[(3 * sorted.count) / 4])
        print(String(format: "  TransportKit / C: median %.2f (middle half %.2f-%.2f, min %.2f, max %.2f); all passes together %.2f (%.1f vs %.1f MiB/s)",
                     sorted[sorted.count / 2], quartile.0, quartile.1, sorted[0], sorted[sorted.count - 1], seconds.c / seconds.tk,
                     mib * Double(passes) / seconds.tk, mib * Double(passes) / seconds.c))
    }

    /// One echo of `total` bytes through usb://: 1 MiB writes while another task reads them back,
    /// as ByteBuffers (the C loop copies nothing either).
    static func echo(url: String, total: Int) async throws -> Double {
        let connection = try await Transport.connect(to: url)
        let piece = ByteBuffer(repeating: 0x5a, count: argument("--write", default: 1 << 20))
        let start = ContinuousClock.now
        async let written: Void = {
            var sent = 0
            while sent < total {
                let count = min(piece.readableBytes, total - sent)
                try await connection.write(piece.getSlice(at: piece.readerIndex, length: count) ?? piece)
                sent += count
            }
        }()
        var received = 0
        while received < total, let chunk = try await connection.readBuffer() { received += chunk.readableBytes }
        let elapsed = ContinuousClock.now - start
        try await written
        try await connection.close()
        guard received == total else { throw TransportError(.io, "usb bench: \(received) of \(total) bytes came back") }
        return elapsed.seconds
    }

    /// Runs a blocking C loop on a thread of its own, off the cooperative pool.
    static func onThread<Value: Sendable>(_ body: @escaping @Sendable () -> Value) async -> Value {
        await withCheckedContinuation { continuation in
            Thread.detachNewThread { continuation.resume(returning: body()) }
        }
    }
}
