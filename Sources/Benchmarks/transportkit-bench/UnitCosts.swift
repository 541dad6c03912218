// transportkit-bench costs: what the building blocks of one message cost on this machine, each
// timed in a tight loop (warm caches, so these are lower bounds; in a real round trip the kernel's
// work in between evicts them and each costs several times more).
//
// It explains the round-trip figures: per message TransportKit pays, on top of SwiftNIO, one task
// resumption through the connection's executor (run inline when the reader prefers it), one
// cancellation handler around the parked read, one write promise, the framing layer, and two small
// copies ([UInt8] in and out).

import NIOCore
import NIOPosix
import Synchronization
import TransportKit
@_spi(Plugins) import TransportKitCore

enum UnitCosts {
    static func run() async throws {
        let loop = MultiThreadedEventLoopGroup.singleton.next()
        let n = 1_000_000
        print("building blocks of one message, warm caches, ns per operation (lower bounds)")

        let mutex = Mutex(0)
        report("Mutex.withLock (uncontended)", n, measure { for _ in 0..<n { mutex.withLock { $0 += 1 } } })

        let bytes = [UInt8](repeating: 7, count: 32)
        report("ByteBuffer(bytes:) from 32 bytes", n, measure { for _ in 0..<n { keep(ByteBuffer(bytes: bytes)) } })
        let buffer = ByteBuffer(bytes: bytes)
        report("[UInt8] from a 32-byte ByteBuffer", n, measure { for _ in 0..<n { keep(Array(buffer.readableBytesView)) } })

        // On the loop, as ChannelBackend.write runs with the preferred executor.
        let promiseCost = try await loop.submit {
            measure {
                for _ in 0..<n {
                    let promise = loop.makePromise(of: Void.self)
                    promise.futureResult.whenFailure { _ in }
                    promise.succeed(())
                }
            }
        }.get()
        report("write promise: make, whenFailure, succeed", n, promiseCost)
        let executeCost = try await loop.submit {
            measure { for _ in 0..<100_000 { loop.execute {} } }
        }.get()
        report("EventLoop.execute from the loop (enqueue only)", 100_000, executeCost)

        let start = ContinuousClock.now
        for _ in 0..<n { await withTaskCancellationHandler { keep(1) } onCancel: {} }
        report("withTaskCancellationHandler around a read", n, ContinuousClock.now - start)

        let rounds = 200_000
        let executor = EventLoopTaskExecutor(loop)
        /// Parks a task that prefers `executor` and resumes it from the loop, `rounds` times: queued
        /// on the loop, or (`inline`) run inside the resuming call, as ChannelBackend resumes a
        /// reader that prefers the connection's executor.
        func hops(inline: Bool) async -> Duration {
            await withTaskExecutorPreference(executor) {
                let start = ContinuousClock.now
                for _ in 0..<rounds {
                    await withUnsafeContinuation { (continuation: UnsafeContinuation<Void, Never>) in
                        loop.execute {
                            if inline { executor.resumeInline { continuation.resume() } } else { continuation.resume() }
                        }
                    }
                }
                return ContinuousClock.now - start
            }
        }
        report("park a task, resume it from the loop (with execute)", rounds, await hops(inline: false))
        report("the same, resumed inline (resumeInline)", rounds, await hops(inline: true))

        // The framing layers alone: frames cut from bytes already received, so no read suspends.
        let frames = 1000
        let connection = try await Transport.connect(to: "loop://?buffer=\(32 * frames)")
        var framing = Duration.zero
        for _ in 0..<100 {
            try await connection.write([UInt8](repeating: 1, count: 32 * frames))
            let start = ContinuousClock.now
            for _ in 0..<frames { keep(try await connection.readFrame(.fixedLength(32))) }
            framing += ContinuousClock.now - start
        }
        try await connection.close()
        report("readFrame(.fixedLength(32)), bytes already there", 100 * frames, framing)
    }

    private static func measure(_ body: () -> Void) -> Duration {
        let start = ContinuousClock.now
        body()
        return ContinuousClock.now - start
    }

    private static func report(_ label: String, _ count: Int, _ elapsed: Duration) {
        print("  " + label.padding(toLength: 52, withPad: " ", startingAt: 0) + String(format: "%7.1f ns", elapsed.seconds * 1e9 / Double(count)))
    }

    /// Keeps the optimizer from deleting the work being timed.
    @inline(never)
    private static func keep<T>(_ value: T) {
        withExtendedLifetime(value) {}
    }
}
