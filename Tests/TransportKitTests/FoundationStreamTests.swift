import Foundation
import TestSupport
import Testing
@testable import TransportKit
@testable import TransportKitFoundation

/// Runs a run loop on its own thread and records the delegate events of a stream pair, the way a
/// CornucopiaStreams client drives its streams: it writes on hasSpaceAvailable and reads on
/// hasBytesAvailable.
final class StreamDriver: NSObject, StreamDelegate, @unchecked Sendable {
    // @unchecked Sendable: every field is touched on the driver's run-loop thread only, except
    // `lock`-protected `log`/`received`/`finished`, read by the test thread.
    private let lock = NSLock()
    private var log: [(String, Stream.Event)] = []
    private var received: [UInt8] = []
    private var finished = false
    private var toSend: [UInt8]
    private let closeOutputWhenSent: Bool
    private var input: InputStream?
    private var output: OutputStream?
    private var thread: Thread?

    init(send: [UInt8], closeOutputWhenSent: Bool) {
        self.toSend = send
        self.closeOutputWhenSent = closeOutputWhenSent
    }

    func start(_ input: InputStream, _ output: OutputStream) {
        self.input = input
        self.output = output
        let thread = Thread { [self] in
            guard let input = self.input, let output = self.output else { return }
            for stream in [input, output] as [Stream] {
                stream.delegate = self
                stream.schedule(in: .current, forMode: .default)
                stream.open()
            }
            let keepAlive = Timer(timeInterval: 3600, repeats: true) { _ in }
            RunLoop.current.add(keepAlive, forMode: .default)
            while !isFinished {
                _ = RunLoop.current.run(mode: .default, before: Date(timeIntervalSinceNow: 0.05))
            }
            input.close()
            output.close()
        }
        self.thread = thread
        thread.start()
    }

    func stream(_ aStream: Stream, handle eventCode: Stream.Event) {
        let name = aStream === input ? "in" : "out"
        lock.withLock { log.append((name, eventCode)) }
        switch eventCode {
        case .hasBytesAvailable:
            var buffer = [UInt8](repeating: 0, count: 4096)
            let count = input?.read(&buffer, maxLength: buffer.count) ?? 0
            if count > 0 { lock.withLock { received += buffer[..<count] } }
        case .hasSpaceAvailable:
            guard !toSend.isEmpty, let output else { return }
            let count = toSend.withUnsafeBufferPointer { output.write($0.baseAddress!, maxLength: $0.count) }
            if count > 0 { toSend.removeFirst(count) }
            if toSend.isEmpty && closeOutputWhenSent { output.close() }
        case .endEncountered, .errorOccurred:
            if name == "in" { finish() }
        default:
            break
        }
    }

    func finish() { lock.withLock { finished = true } }
    var isFinished: Bool { lock.withLock { finished } }
    var bytes: [UInt8] { lock.withLock { received } }
    func events(_ name: String) -> [Stream.Event] { lock.withLock { log.filter { $0.0 == name }.map(\.1) } }

    func waitUntilFinished(seconds: Double = 10) async -> Bool {
        await eventually(seconds) { isFinished }
    }
}

@Suite("Foundation stream bridge")
struct FoundationStreamTests {
    @Test func eventsDriveAnEchoOverLoop() async throws {
        let connection = try await Transport.connect(to: "loop://?buffer=1024")
        let payload = (0..<100_000).map { UInt8(truncatingIfNeeded: $0 * 7) }
        let (input, output) = connection.makeStreamPair(bufferSize: 4096)
        let driver = StreamDriver(send: payload, closeOutputWhenSent: true)
        driver.start(input, output)
        #expect(await driver.waitUntilFinished())
        #expect(driver.bytes.count == payload.count)
        let identical = driver.bytes == payload
        #expect(identical, "the bytes differ")
        let inbound = driver.events("in")
        let outbound = driver.events("out")
        #expect(inbound.first == .openCompleted)
        #expect(inbound.contains(.hasBytesAvailable))
        #expect(inbound.last == .endEncountered)
        #expect(inbound.filter { $0 == .endEncountered }.count == 1)
        #expect(outbound.first == .openCompleted)
        #expect(outbound.filter { $0 == .hasSpaceAvailable }.count > 1, "space events keep a big write going")
        #expect(input.streamStatus == .closed || input.streamStatus == .atEnd)
        #expect(await eventually { connection.isClosed }, "closing both streams closes the connection")
    }

    @Test func errorsAreReportedAsErrorOccurred() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let connection = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        let (input, output) = connection.makeStreamPair()
        let driver = StreamDriver(send: [], closeOutputWhenSent: false)
        driver.start(input, output)
        let fd = await raw.accept()
        Support.writeAll(fd, [1, 2, 3])
        // The bytes are delivered before the reset, whose arrival ends the socket: waited for,
        // not slept on (100 ms was too little once under ThreadSanitizer, and the bytes were lost).
        #expect(await eventually(10) { driver.bytes == [1, 2, 3] }, "the bytes before the reset")
        Support.resetClose(fd)
        #expect(await driver.waitUntilFinished())
        #expect(driver.bytes == [1, 2, 3])
        #expect(driver.events("in").contains(.errorOccurred))
        let error = try #require(input.streamError as? TransportError)
        #expect(error.kind == .disconnected)
    }

    @Test func metadataIsAProperty() async throws {
        let connection = try await Transport.connect(to: "loop://")
        let (input, output) = connection.makeStreamPair()
        let metadata = input.property(forKey: Connection.metadataPropertyKey) as? ConnectionMetadata
        #expect(metadata?.name == "loopback")
        #expect(output.property(forKey: Connection.metadataPropertyKey) as? ConnectionMetadata == metadata)
        input.close()
        output.close()
        #expect(await eventually { connection.isClosed })
    }

    @Test func blockingReadAndWriteWithoutARunLoop() async throws {
        let connection = try await Transport.connect(to: "loop://")
        let (input, output) = connection.makeStreamPair()
        input.open()
        output.open()
        let streams = UncheckedStreams(input: input, output: output)
        let result = await Support.offPool {
            let (input, output) = (streams.input, streams.output)
            let bytes: [UInt8] = Array("plain".utf8)
            _ = bytes.withUnsafeBufferPointer { output.write($0.baseAddress!, maxLength: $0.count) }
            var buffer = [UInt8](repeating: 0, count: 16)
            let count = input.read(&buffer, maxLength: 16)
            output.close()
            let end = input.read(&buffer, maxLength: 16)
            return (Array(buffer[..<max(0, count)]), end)
        }
        #expect(result.0 == Array("plain".utf8))
        #expect(result.1 == 0, "read returns 0 at the end")
        input.close()
    }
}

@Suite("Foundation stream bridge: its documented example and its tasks")
struct FoundationBridgeLifecycleTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    @Test func theDocCommentQuotesTheExampleVerbatim() throws {
        let example = try String(contentsOf: Self.root.appendingPathComponent("Tests/TransportKitTests/Examples/FoundationBridgeExample.swift"), encoding: .utf8)
        let start = try #require(example.range(of: "// BEGIN EXAMPLE\n"))
        let end = try #require(example.range(of: "// END EXAMPLE"))
        let quoted = String(example[start.upperBound..<end.lowerBound])
        let source = try String(contentsOf: Self.root.appendingPathComponent("Sources/TransportKit/Foundation/FoundationStreams.swift"), encoding: .utf8)
        // The doc comment's lines without their "    /// " prefix.
        let comment = source.split(separator: "\n", omittingEmptySubsequences: false)
            .filter { $0.hasPrefix("    ///") }
            .map { line in line.dropFirst("    ///".count).drop { $0 == " " }.isEmpty ? "" : String(line.dropFirst("    /// ".count)) }
            .joined(separator: "\n")
        #expect(comment.contains(quoted), "makeStreamPair's doc comment must quote Examples/FoundationBridgeExample.swift")
    }

    @Test func theDocumentedExampleRuns() async throws {
        let connection = try await Transport.connect(to: "loop://")
        // The example runs on a thread with a run loop, as its documentation says.
        let received = await Support.offPool { exchange(over: connection) }
        #expect(received == Array("ping\n".utf8))
        #expect(await eventually { connection.isClosed }, "closing both streams closed the connection")
    }

    @Test("closing the streams, or releasing them open, ends their tasks and closes the connection", arguments: [true, false])
    func tasksEnd(closing: Bool) async throws {
        let connection = try await Transport.connect(to: "loop://")
        weak var inbound: InboundCore?
        weak var outbound: OutboundCore?
        do {
            let (input, output) = connection.makeStreamPair()
            let streams = UncheckedStreams(input: input, output: output)
            inbound = (input as? ConnectionInputStream)?.core
            outbound = (output as? ConnectionOutputStream)?.core
            await Support.offPool {
                streams.input.open()
                streams.output.open()
                if closing {
                    streams.input.close()
                    streams.output.close()
                }
            }
            // Released here; unless closed, open, with both tasks waiting.
        }
        #expect(await eventually(5) { inbound == nil && outbound == nil }, "both tasks ended and let go of their sides")
        #expect(await eventually { connection.isClosed })
    }
}

/// Hands a stream pair to a detached task in a test that uses them from one thread at a time.
// @unchecked Sendable: the test touches the streams only from the detached task until it ends.
struct UncheckedStreams: @unchecked Sendable {
    let input: InputStream
    let output: OutputStream
}
