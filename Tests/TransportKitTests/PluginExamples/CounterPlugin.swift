// Example 2 of Docs/Plugins.md: a plugin fed by callbacks through the inbound queue.
// PluginExampleTests checks that the document quotes this file verbatim between the markers, and
// runs the plugin.
// BEGIN EXAMPLE
import Glibc
import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitLinux

/// counter://?to=N delivers the lines "1\n" … "N\n" from a thread of its own, the way a C library
/// hands data to callbacks on its event thread (libusb, sd-bus): the thread sleeps in a blocking
/// call, wakes up, and appends what it has to an InboundQueue. When the application reads slowly,
/// the queue answers .pause, the thread stops producing and sleeps, and the queue's onResume wakes
/// it once the reader made room: memory stays bounded, nothing is dropped.
struct CounterPlugin: TransportPlugin {
    static let to = URLOption.integer("to", in: 1...1_000_000_000, default: 1000, help: "The last number")

    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(
            scheme: "counter",
            summary: "Counts to N on a worker thread (an example of a callback-fed plugin)",
            grammar: "counter://[?to=N]",
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [Self.to]
        )) { request in
            Connection(url: request.url, backend: try CounterBackend(to: request[Self.to]))
        }]
    }
}

final class CounterBackend: ConnectionBackend {
    let supportsHalfClose = false
    private let inbound: InboundQueue
    private let worker: WorkerThread
    /// The thread sleeps in read(2) on `wakeup.read`; a byte on `wakeup.write` wakes it.
    private let wakeup: (read: Int32, write: Int32)

    init(to last: Int) throws {
        var ends: [Int32] = [-1, -1]
        try Syscall.run("pipe", on: "counter://") { pipe(&ends) }
        for end in ends { _ = fcntl(end, F_SETFD, FD_CLOEXEC) }
        let wakeup = (read: ends[0], write: ends[1])
        let wake: @Sendable () -> Void = { var byte: UInt8 = 1; _ = Glibc.write(wakeup.write, &byte, 1) }
        // Small watermarks, so the example pauses often: resumed once less than 1 KiB waits.
        let inbound = InboundQueue(watermarks: .init(low: 1024, high: 4096), onResume: wake)
        let next = Mutex(1)
        do {
            worker = try WorkerThread(name: "counter") { isStopping in
                while !isStopping() {
                    // The "callbacks": append until the queue says pause or the count is done.
                    var demand = InboundQueue.Demand.more
                    while demand == .more, case let value = next.withLock({ $0 }), value <= last {
                        demand = inbound.append(ByteBuffer(string: "\(value)\n"))
                        next.withLock { $0 += 1 }
                    }
                    if next.withLock({ $0 }) > last {
                        inbound.finish()
                        return
                    }
                    // The blocking call a C library's event loop would make.
                    var byte: UInt8 = 0
                    _ = Glibc.read(wakeup.read, &byte, 1)
                }
            } interrupt: {
                wake()
            }
        } catch {
            _ = Glibc.close(ends[0])
            _ = Glibc.close(ends[1])
            throw error
        }
        self.inbound = inbound
        self.wakeup = wakeup
    }

    func read() async throws -> ByteBuffer? {
        try await inbound.next()
    }

    func write(_ buffer: ByteBuffer) async throws {
        throw TransportError(.unsupported, "counter:// only counts; it takes no input")
    }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "counter:// has no half-close")
    }

    func close() async throws {
        await Self.stop(worker, wakeup)
        inbound.finish()
    }

    /// The application let go of the connection without close(): stop the thread all the same.
    func connectionDropped() {
        Task { [worker, wakeup] in await Self.stop(worker, wakeup) }
    }

    /// Stops and joins the thread, then closes the pipe it slept on.
    private static func stop(_ worker: WorkerThread, _ wakeup: (read: Int32, write: Int32)) async {
        await worker.stop()
        _ = Glibc.close(wakeup.read)
        _ = Glibc.close(wakeup.write)
    }
}
// END EXAMPLE
