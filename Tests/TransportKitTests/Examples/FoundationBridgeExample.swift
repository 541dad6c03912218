// The example in the documentation of Connection.makeStreamPair(bufferSize:)
// (Sources/TransportKit/Foundation/FoundationStreams.swift). FoundationStreamTests checks that the
// doc comment quotes this file verbatim between the markers, and runs it.
import Foundation
import TransportKit
import TransportKitFoundation

// BEGIN EXAMPLE
final class Exchange: NSObject, StreamDelegate {
    private(set) var received: [UInt8] = []
    private(set) var ended = false

    /// Call on the thread whose run loop delivers the events.
    func start(_ connection: Connection) {
        let (input, output) = connection.makeStreamPair()
        for stream in [input, output] as [Stream] {
            stream.delegate = self
            stream.schedule(in: .current, forMode: .default)
            stream.open()
        }
    }

    func stream(_ stream: Stream, handle event: Stream.Event) {
        switch event {
        case .hasSpaceAvailable:
            guard let output = stream as? OutputStream else { return }
            _ = output.write(Array("ping\n".utf8), maxLength: 5)
            output.close()
        case .hasBytesAvailable:
            guard let input = stream as? InputStream else { return }
            var buffer = [UInt8](repeating: 0, count: 1024)
            let count = input.read(&buffer, maxLength: buffer.count)
            if count > 0 { received += buffer[..<count] }
        case .endEncountered, .errorOccurred:
            ended = true
            stream.close()
        default:
            break
        }
    }
}

/// Runs an exchange on the calling thread's run loop until the input ends.
func exchange(over connection: Connection) -> [UInt8] {
    let exchange = Exchange()
    exchange.start(connection)
    // A scheduled stream adds no run-loop source on Linux: keep the run loop waiting with a timer.
    let keepAlive = Timer(timeInterval: 3600, repeats: true) { _ in }
    RunLoop.current.add(keepAlive, forMode: .default)
    defer { keepAlive.invalidate() }
    while !exchange.ended {
        _ = RunLoop.current.run(mode: .default, before: Date(timeIntervalSinceNow: 0.1))
    }
    return exchange.received
}
// END EXAMPLE
