// transportkit-bench parse: what parsing and validating a URL costs as its options grow. Linear
// parsing keeps 12,000 options in milliseconds (duplicates were found by comparing every pair
// before issue 12, and 12,000 options took 2 s).

import TransportKit
@_spi(Plugins) import TransportKitCore

enum URLParseBench {
    static func run() throws {
        print("URL parsing (TransportURL) and validation (registry.resolve), median of 5")
        for count in [10, 1_000, 12_000, 100_000] {
            let text = "loop://?buffer=4096&" + (0..<count).map { "o\($0)=\($0)" }.joined(separator: "&")
            var parse: [Double] = []
            var resolve: [Double] = []
            for _ in 0..<5 {
                let start = ContinuousClock.now
                let url = try TransportURL(text)
                parse.append((ContinuousClock.now - start).seconds)
                let validation = ContinuousClock.now
                _ = try? Transport.registry.resolve(url)   // refused at its first unknown option
                resolve.append((ContinuousClock.now - validation).seconds)
            }
            let median = { (values: [Double]) in values.sorted()[values.count / 2] * 1e3 }
            print("  \(String(count).padding(toLength: 7, withPad: " ", startingAt: 0)) options  parse \(String(format: "%9.3f", median(parse))) ms   resolve \(String(format: "%7.3f", median(resolve))) ms")
        }
    }
}
