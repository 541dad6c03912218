// transportkit-bench: loopback tcp:// throughput and 32-byte round trips through TransportKit,
// beside the same work done by plain C read/write loops (CBenchLoops) built in the same run.
// Run: swift run -c release transportkit-bench [--bytes N] [--rounds N] [--passes N] [--nio-executor] [--case KEY]
//      transportkit-bench serial | serial-list (see SerialBench.swift) | costs (see UnitCosts.swift) | parse (URLParseBench.swift)
//      | usb (in the lab: USBBench.swift) | tls-handshakes | ws, ws-nio (WebSocketBench.swift) | reconnect (ReconnectBench.swift)
// Figures are printed, never asserted: see BENCHMARKS.md.

import CBenchLoops
import Foundation
import NIOCore
import NIOPosix
import TransportKit

func argument(_ name: String, default value: Int) -> Int {
    let arguments = CommandLine.arguments
    guard let index = arguments.firstIndex(of: name), index + 1 < arguments.count, let number = Int(arguments[index + 1]) else {
        return value
    }
    return number
}

// --nio-executor: run Swift concurrency's global executor on NIO's event loops (an application-wide
// opt-in), so a resumed reader continues on the thread that read the bytes.
let nioExecutor = CommandLine.arguments.contains("--nio-executor")
    && NIOSingletons.unsafeTryInstallSingletonPosixEventLoopGroupAsConcurrencyGlobalExecutor()

// Before the dispatch below: main.swift's globals are set in order, and a mode that runs first
// (reconnect) would read them unset.
let totalBytes = argument("--bytes", default: 1 << 30)
let rounds = argument("--rounds", default: 20_000)
let chunk = 64 * 1024

switch CommandLine.arguments.dropFirst().first {
case "serial": try await SerialBench.run(); exit(0)
case "serial-list": try await SerialBench.list(); exit(0)
case "costs": try await UnitCosts.run(); exit(0)
case "parse": try URLParseBench.run(); exit(0)
case "usb": try await USBBench.run(); exit(0)
case "tls-handshakes": try await tlsHandshakes(); exit(0)
case "ws": try await WebSocketBench.run(); exit(0)
case "ws-nio": try await WebSocketBench.runNIO(); exit(0)
case "reconnect": try await ReconnectBench.run(); exit(0)

default: break
}

/// `transportkit-bench tls-handshakes URL SECONDS`: full TLS handshakes (connect, verify, close)
/// one after another for SECONDS, as `openssl s_time -new` does; Scripts/tls-bench runs both.
func tlsHandshakes() async throws {
    let arguments = CommandLine.arguments
    guard arguments.count >= 4, let seconds = Double(arguments[3]) else {
        throw TransportError.misuse("usage: transportkit-bench tls-handshakes URL SECONDS")
    }
    let end = ContinuousClock.now + .seconds(seconds)
    let start = ContinuousClock.now
    var count = 0
    while ContinuousClock.now < end {
        let connection = try await Transport.connect(to: arguments[2])
        try await connection.close()
        count += 1
    }
    let elapsed = (ContinuousClock.now - start).seconds
    print("\(count) handshakes in \(String(format: "%.2f", elapsed)) s: \(String(format: "%.0f", Double(count) / elapsed)) per second")
}


/// Sends `totalBytes` through tcp:// from one TransportKit connection to another.
func transportKitThroughput() async throws -> Double {
    let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
    let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
    guard let server = try await listener.accept() else { throw TransportError(.io, "no connection") }
    let start = ContinuousClock.now
    let reader = Task {
        var received = 0
        while let buffer = try await server.readBuffer() { received += buffer.readableBytes }
        return received
    }
    let sent = try await sendAll(client)
    let received = try await reader.value
    let elapsed = ContinuousClock.now - start
    precondition(received == sent, "lost bytes: \(received) of \(sent)")
    try await server.close()
    try await listener.close()
    return elapsed.seconds
}

/// Writes `totalBytes` in `chunk`-sized writes, then closes; returns the bytes sent.
func sendAll(_ client: Connection) async throws -> Int {
    let payload = ByteBuffer(repeating: 0, count: chunk)
    var sent = 0
    while sent < totalBytes {
        try await client.write(payload)
        sent += chunk
    }
    try await client.close()
    return sent
}

/// Sends `totalBytes` from a TransportKit connection to the C sink thread: TransportKit's side
/// alone, on the same kind of peer the C loop writes to.
func transportKitThroughputToCSink(wrapper prefix: String = "") async throws -> Double {
    let port = tk_bench_c_sink_start()
    guard port > 0 else { throw TransportError(.io, "the C sink did not start") }
    let client = try await Transport.connect(to: "\(prefix)tcp://127.0.0.1:\(port)")
    let start = ContinuousClock.now
    let sent = try await sendAll(client)
    let received = tk_bench_c_sink_join()
    let elapsed = ContinuousClock.now - start
    precondition(received == sent, "lost bytes: \(received) of \(sent)")
    return elapsed.seconds
}

/// 32-byte request/response round trips against an echo peer. `peerInC` uses the C echo thread.
func transportKitRoundTrips(peerInC: Bool, onLoop: Bool, wrapper prefix: String = "") async throws -> Double {
    var echoTask: Task<Void, any Error>?
    var listener: Listener?
    let port: Int
    if peerInC {
        port = Int(tk_bench_c_echo_server())
    } else {
        let echo = try await Transport.listen(on: "tcp://127.0.0.1:0")
        listener = echo
        port = echo.url.port ?? 0
        echoTask = Task {
            guard let connection = try await echo.accept() else { return }
            try await withTaskExecutorPreference(onLoop ? connection.preferredExecutor : nil) {
            while let frame = try await connection.readFrame(.fixedLength(32)) { try await connection.write(frame) }
            }
            try await connection.close()
        }
    }
    let client = try await Transport.connect(to: "\(prefix)tcp://127.0.0.1:\(port)")
    let request = [UInt8](repeating: 7, count: 32)
    let elapsed = try await withTaskExecutorPreference(onLoop ? client.preferredExecutor : nil) {
        let start = ContinuousClock.now
        for _ in 0..<rounds {
            try await client.write(request)
            guard try await client.readFrame(.fixedLength(32)) != nil else { throw TransportError(.disconnected, "echo closed") }
        }
        return ContinuousClock.now - start
    }
    try await client.close()
    try await echoTask?.value
    try await listener?.close()
    return elapsed.seconds
}

/// Raw SwiftNIO ping-pong (handlers only, no tasks): the floor for an NIO-based design.
func rawNIORoundTrips() async throws -> Double {
    final class Echo: ChannelInboundHandler, Sendable {
        typealias InboundIn = ByteBuffer
        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            context.writeAndFlush(data, promise: nil)
        }
    }
    final class Pinger: ChannelInboundHandler, @unchecked Sendable {
        // Touched only on the channel's event loop.
        typealias InboundIn = ByteBuffer
        var left: Int
        var got = 0
        let done: EventLoopPromise<Void>
        init(rounds: Int, done: EventLoopPromise<Void>) { self.left = rounds; self.done = done }
        func channelActive(context: ChannelHandlerContext) {
            context.writeAndFlush(NIOAny(ByteBuffer(repeating: 7, count: 32)), promise: nil)
        }
        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            got += Self.unwrapInboundIn(data).readableBytes
            if got < 32 { return }
            got = 0
            left -= 1
            if left == 0 { done.succeed(()); return }
            context.writeAndFlush(NIOAny(ByteBuffer(repeating: 7, count: 32)), promise: nil)
        }
    }
    let group = MultiThreadedEventLoopGroup.singleton
    let server = try await ServerBootstrap(group: group)
        .childChannelOption(.socketOption(.tcp_nodelay), value: 1)
        .childChannelInitializer { $0.pipeline.addHandler(Echo()) }
        .bind(host: "127.0.0.1", port: 0).get()
    let done = group.next().makePromise(of: Void.self)
    let start = ContinuousClock.now
    let client = try await ClientBootstrap(group: group)
        .channelOption(.socketOption(.tcp_nodelay), value: 1)
        .channelInitializer { $0.pipeline.addHandler(Pinger(rounds: rounds, done: done)) }
        .connect(host: "127.0.0.1", port: server.localAddress?.port ?? 0).get()
    try await done.futureResult.get()
    let elapsed = ContinuousClock.now - start
    try await client.close()
    try await server.close()
    return elapsed.seconds
}

extension Duration {
    var seconds: Double { Double(components.seconds) + Double(components.attoseconds) / 1e18 }
}

/// The two throughput lines of a section: `mib` moved in `c` and `tk` seconds.
func printThroughput(mib: Double, c: Double, tk: Double) {
    print(String(format: "  throughput  C loop        %8.0f MiB/s", mib / c))
    print(String(format: "  throughput  TransportKit  %8.0f MiB/s  (%.0f%% of C)", mib / tk, 100 * c / tk))
}

func best(of runs: Int, _ body: () async throws -> Double) async throws -> Double {
    var result = Double.infinity
    for _ in 0..<runs { result = min(result, try await body()) }
    return result
}

/// The round-trip variants measured beside the C loop; `key` names one for `--case`, `heading`
/// is printed above it.
struct RoundTripVariant {
    let key: String
    let heading: String?
    let label: String
    let run: () async throws -> Double
}

let variants = [
    RoundTripVariant(key: "rtt-cpeer", heading: nil, label: "TransportKit client, C echo peer") {
        try await transportKitRoundTrips(peerInC: true, onLoop: false)
    },
    RoundTripVariant(key: "rtt", heading: nil, label: "TransportKit at both ends") {
        try await transportKitRoundTrips(peerInC: false, onLoop: false)
    },
    RoundTripVariant(key: "rtt-cpeer-loop", heading: "with connection.preferredExecutor (nil on tcp://, which has no event loop: the path above again)",
                     label: "TransportKit client, C echo peer") {
        try await transportKitRoundTrips(peerInC: true, onLoop: true)
    },
    RoundTripVariant(key: "rtt-loop", heading: nil, label: "TransportKit at both ends") {
        try await transportKitRoundTrips(peerInC: false, onLoop: true)
    },
    RoundTripVariant(key: "poller-cpeer", heading: "reference: raw sockets, tasks parked on TransportKitLinux's readiness poller (the floor under a backend owning its descriptors)",
                     label: "task client, C echo peer") {
        try await PollerBench.roundTrips(peerInC: true)
    },
    RoundTripVariant(key: "poller", heading: nil, label: "tasks at both ends") {
        try await PollerBench.roundTrips(peerInC: false)
    },
    RoundTripVariant(key: "nio", heading: "reference: plain SwiftNIO channel handlers, no tasks (the floor under TransportKit's engine)",
                     label: "SwiftNIO handlers at both ends") {
        try await rawNIORoundTrips()
    },
]

/// The throughput cases of `--case`: seconds to move `totalBytes` (`--bytes`).
let throughputCases: [String: () async throws -> Double] = [
    "tput-c": { tk_bench_c_tcp_throughput(totalBytes, chunk) },
    "tput": { try await transportKitThroughput() },
    "tput-csink": { try await transportKitThroughputToCSink() },
]

// --case KEY (a variant's key, or c for the C loop): run one round-trip variant alone (for perf or
// strace) and print µs per round; tput-c, tput, tput-csink: one throughput transfer, printed in MiB/s
// (Scripts/rtt-bench --throughput runs them in fresh processes).
if let index = CommandLine.arguments.firstIndex(of: "--case"), index + 1 < CommandLine.arguments.count {
    let key = CommandLine.arguments[index + 1]
    if let transfer = throughputCases[key] {
        let seconds = try await transfer()
        print(String(format: "%.1f MiB/s", Double(totalBytes) / 1_048_576 / seconds))
        exit(0)
    }
    let seconds: Double
    if let variant = variants.first(where: { $0.key == key }) {
        seconds = try await variant.run()
    } else if key == "c" {
        seconds = tk_bench_c_tcp_round_trips(Int32(rounds))
    } else {
        print("--case: one of c, " + variants.map(\.key).joined(separator: ", ") + ", " + throughputCases.keys.sorted().joined(separator: ", "))
        exit(2)
    }
    print(String(format: "%.1f µs", seconds / Double(rounds) * 1e6))
    exit(0)
}

let mib = Double(totalBytes) / 1_048_576
// Throughput: C and TransportKit take turns, five passes; the ratio is the median of per-pass ratios.
var cThroughputs: [Double] = []
var tkThroughputs: [Double] = []
var tkToCThroughputs: [Double] = []
for _ in 0..<5 {
    cThroughputs.append(tk_bench_c_tcp_throughput(totalBytes, chunk))
    tkThroughputs.append(try await transportKitThroughput())
    tkToCThroughputs.append(try await transportKitThroughputToCSink())
}
let cThroughput = cThroughputs.min() ?? 0
let tkThroughput = tkThroughputs.min() ?? 0
let throughputRatios = zip(cThroughputs, tkThroughputs).map { 100 * $0 / $1 }
let toCSinkRatios = zip(cThroughputs, tkToCThroughputs).map { 100 * $0 / $1 }

// Round trips: the variants take turns, `passes` times, so that the VM's drifting speed hits all of
// them alike; each figure is the median of its passes, each ratio the median of per-pass ratios.
let passes = argument("--passes", default: 7)
var cTimes: [Double] = []
var times = Array(repeating: [Double](), count: variants.count)
for _ in 0..<passes {
    cTimes.append(tk_bench_c_tcp_round_trips(Int32(rounds)) / Double(rounds))
    for (index, variant) in variants.enumerated() {
        times[index].append(try await variant.run() / Double(rounds))
    }
}

func median(_ values: [Double]) -> Double {
    let sorted = values.sorted()
    return sorted.count % 2 == 1 ? sorted[sorted.count / 2] : (sorted[sorted.count / 2 - 1] + sorted[sorted.count / 2]) / 2
}

print("executor: \(nioExecutor ? "NIO event loops (--nio-executor)" : "Swift's default global executor")")
print("tcp:// loopback, \(Int(mib)) MiB in \(chunk / 1024) KiB writes, 5 interleaved passes: best (per-pass % of C: median, range)")
printThroughput(mib: mib, c: cThroughput, tk: tkThroughput)
for (label, ratios) in [("TransportKit at both ends", throughputRatios), ("TransportKit to C sink", toCSinkRatios)] {
    print("  per pass    " + label.padding(toLength: 26, withPad: " ", startingAt: 0)
        + String(format: " %4.0f%% of C (median), %.0f–%.0f%%;", median(ratios), ratios.min() ?? 0, ratios.max() ?? 0)
        + " passes: " + ratios.map { String(format: "%.0f", $0) }.joined(separator: " "))
}
print("32-byte request/response, \(rounds) rounds, \(passes) interleaved passes: median (ratio to C: median, range)")
print(String(format: "  round trip  C loop (both ends C)                  %7.1f µs", median(cTimes) * 1e6))
for (index, variant) in variants.enumerated() {
    if let heading = variant.heading { print("  " + heading) }
    let ratios = zip(times[index], cTimes).map { $0 / $1 }
    print("  round trip  " + variant.label.padding(toLength: 37, withPad: " ", startingAt: 0)
        + String(format: " %7.1f µs  (%.2fx C, %.2f–%.2f)", median(times[index]) * 1e6, median(ratios), ratios.min() ?? 0, ratios.max() ?? 0))
}
