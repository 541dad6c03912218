// ReconnectBench.swift: what `reconnect+` costs a healthy connection: 32-byte round trips against
// the C echo server and throughput into the C sink, each with tcp:// and reconnect+tcp:// in
// alternating passes of the same run; medians and their ratio.
// Run: swift run -c release transportkit-bench reconnect [--rounds N] [--bytes N] [--passes N]

import TransportKit

enum ReconnectBench {
    static func run() async throws {
        let passes = argument("--passes", default: 5)
        var trips: (bare: [Double], wrapped: [Double]) = ([], [])
        var moves: (bare: [Double], wrapped: [Double]) = ([], [])
        for _ in 0..<passes {
            trips.bare.append(try await transportKitRoundTrips(peerInC: true, onLoop: false))
            trips.wrapped.append(try await transportKitRoundTrips(peerInC: true, onLoop: false, wrapper: "reconnect+"))
            moves.bare.append(try await transportKitThroughputToCSink())
            moves.wrapped.append(try await transportKitThroughputToCSink(wrapper: "reconnect+"))
        }
        let mib = Double(totalBytes) / 1_048_576
        let rtt = (bare: median(trips.bare) / Double(rounds) * 1e6, wrapped: median(trips.wrapped) / Double(rounds) * 1e6)
        let rate = (bare: mib / median(moves.bare), wrapped: mib / median(moves.wrapped))
        print("reconnect+ on a healthy tcp:// connection, medians of \(passes) alternating passes (C echo server, C sink)")
        print(String(format: "  32-byte round trip  tcp://            %7.1f µs", rtt.bare))
        print(String(format: "  32-byte round trip  reconnect+tcp://  %7.1f µs  (%.1f%% more)", rtt.wrapped, 100 * (rtt.wrapped / rtt.bare - 1)))
        print(String(format: "  throughput          tcp://            %7.0f MiB/s", rate.bare))
        print(String(format: "  throughput          reconnect+tcp://  %7.0f MiB/s  (%.1f%% of tcp://)", rate.wrapped, 100 * rate.wrapped / rate.bare))
    }

    static func median(_ values: [Double]) -> Double {
        let sorted = values.sorted()
        return sorted.isEmpty ? 0 : sorted[sorted.count / 2]
    }
}
