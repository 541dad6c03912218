// transportkit-bench: loopback tcp:// throughput and 32-byte round trips through TransportKit,
// beside the same work done by plain C read/write loops (CBenchLoops) built in the same run.
// Run: swift run -c release transportkit-bench [--bytes N] [--rounds N] [--nio-executor]
//      transportkit-bench serial | serial-list (see SerialBench.swift)
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

if CommandLine.arguments.dropFirst().first == "serial" {
    try await SerialBench.run()
    exit(0)
}
if CommandLine.arguments.dropFirst().first == "serial-list" {
    try await SerialBench.list()
    exit(0)
}

let totalBytes = argument("--bytes", default: 1 << 30)
let rounds = argument("--rounds", default: 20_000)
let chunk = 64 * 1024

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
    let payload = ByteBuffer(repeating: 0, count: chunk)
    var sent = 0
    while sent < totalBytes {
        try await client.write(payload)
        sent += chunk
    }
    try await client.close()
    let received = try await reader.value
    let elapsed = ContinuousClock.now - start
    precondition(received == sent, "lost bytes: \(received) of \(sent)")
    try await server.close()
    try await listener.close()
    return elapsed.seconds
}

/// 32-byte request/response round trips against an echo peer. `peerInC` uses the C echo thread.
func transportKitRoundTrips(peerInC: Bool, onLoop: Bool) async throws -> Double {
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
    let client = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
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

extension Duration {
    var seconds: Double { Double(components.seconds) + Double(components.attoseconds) / 1e18 }
}

func best(of runs: Int, _ body: () async throws -> Double) async throws -> Double {
    var result = Double.infinity
    for _ in 0..<runs { result = min(result, try await body()) }
    return result
}

let mib = Double(totalBytes) / 1_048_576
let cThroughput = try await best(of: 3) { tk_bench_c_tcp_throughput(totalBytes, chunk) }
let tkThroughput = try await best(of: 3) { try await transportKitThroughput() }
let cRTT = try await best(of: 3) { tk_bench_c_tcp_round_trips(Int32(rounds)) } / Double(rounds)
let tkRTTCPeer = try await best(of: 3) { try await transportKitRoundTrips(peerInC: true, onLoop: false) } / Double(rounds)
let tkRTT = try await best(of: 3) { try await transportKitRoundTrips(peerInC: false, onLoop: false) } / Double(rounds)
let tkRTTCPeerLoop = try await best(of: 3) { try await transportKitRoundTrips(peerInC: true, onLoop: true) } / Double(rounds)
let tkRTTLoop = try await best(of: 3) { try await transportKitRoundTrips(peerInC: false, onLoop: true) } / Double(rounds)

print("executor: \(nioExecutor ? "NIO event loops (--nio-executor)" : "Swift's default global executor")")
print("tcp:// loopback, \(Int(mib)) MiB in \(chunk / 1024) KiB writes, best of 3")
print(String(format: "  throughput  C loop        %8.0f MiB/s", mib / cThroughput))
print(String(format: "  throughput  TransportKit  %8.0f MiB/s  (%.0f%% of C)", mib / tkThroughput, 100 * cThroughput / tkThroughput))
print("32-byte request/response, \(rounds) rounds, best of 3")
print(String(format: "  round trip  C loop (both ends C)                  %7.1f µs", cRTT * 1e6))
print(String(format: "  round trip  TransportKit client, C echo peer      %7.1f µs  (%.2fx C)", tkRTTCPeer * 1e6, tkRTTCPeer / cRTT))
print(String(format: "  round trip  TransportKit at both ends             %7.1f µs  (%.2fx C)", tkRTT * 1e6, tkRTT / cRTT))
print("  with connection.preferredExecutor (tasks on the connection's event loop)")
print(String(format: "  round trip  TransportKit client, C echo peer      %7.1f µs  (%.2fx C)", tkRTTCPeerLoop * 1e6, tkRTTCPeerLoop / cRTT))
print(String(format: "  round trip  TransportKit at both ends             %7.1f µs  (%.2fx C)", tkRTTLoop * 1e6, tkRTTLoop / cRTT))
