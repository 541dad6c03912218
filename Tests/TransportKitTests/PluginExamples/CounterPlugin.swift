// Example 2 of Docs/Plugins.md: a plugin fed by callbacks through the inbound queue.
// PluginExampleTests checks that the document quotes this file verbatim between the markers, and
// runs the plugin.
// BEGIN EXAMPLE
import Glibc
import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

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
    private let wakeup: Wakeup

    init(to last: Int) throws {
        let wakeup = try Wakeup()
        // Small watermarks, so the example pauses often: resumed once less than 1 KiB waits.
        let inbound = InboundQueue(watermarks: .init(low: 1024, high: 4096)) { wakeup.wake() }
        let next = Locked(1)
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
                    wakeup.sleep()
                }
            } interrupt: {
                wakeup.wake()
            }
        } catch {
            wakeup.close()
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
        await worker.stop()
        wakeup.close()   // after the join: the thread no longer sleeps on it
        inbound.finish()
    }

    /// The application let go of the connection without close(): stop the thread all the same.
    func connectionDropped() {
        Task { [worker, wakeup] in
            await worker.stop()
            wakeup.close()
        }
    }
}

/// A socket pair the worker thread sleeps on (read(2) on one end) and is woken through (a byte on
/// the other). Close-on-exec from the start (SOCK_CLOEXEC), so a process forked meanwhile cannot
/// inherit it; closed once, under the lock, so a late wake-up never writes to a number that
/// another file has taken since.
final class Wakeup: Sendable {
    private let ends: Locked<(sleep: Int32, wake: Int32)?>
    private let sleepEnd: Int32

    init() throws {
        var pair: [Int32] = [-1, -1]
        try Syscall.run("socketpair", on: "counter://") {
            socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &pair)
        }
        sleepEnd = pair[0]
        ends = Locked((pair[0], pair[1]))
    }

    /// Blocks until woken. Only the worker thread calls it, and only before close().
    func sleep() {
        var byte: UInt8 = 0
        _ = Glibc.read(sleepEnd, &byte, 1)
    }

    func wake() {
        ends.withLock { ends in
            guard let ends else { return }
            var byte: UInt8 = 1
            _ = Glibc.write(ends.wake, &byte, 1)
        }
    }

    func close() {
        ends.withLock { ends in
            guard let open = ends else { return }
            _ = Glibc.close(open.sleep)
            _ = Glibc.close(open.wake)
            ends = nil
        }
    }
}
// END EXAMPLE
