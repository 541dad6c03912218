import Glibc
import Testing
@testable import TransportKit

@Suite("loop://")
struct LoopTests {
    @Test func whatIsWrittenIsReadBack() async throws {
        try await Transport.withConnection(to: "loop://") { loop in
            try await loop.write("hello")
            #expect(try await loop.read() == Array("hello".utf8))
            #expect(loop.bytesRead == 5)
            #expect(loop.bytesWritten == 5)
            #expect(loop.metadata.extra["buffer"] == "4096")
        }
    }

    @Test func aFullBufferSuspendsTheWriterUntilTheReaderMakesRoom() async throws {
        let loop = try await Transport.connect(to: "loop://?buffer=16")
        let payload = (0..<100).map { UInt8($0) }
        let writer = Task { try await loop.write(payload) }
        try await Task.sleep(for: .milliseconds(100))
        // Only the buffer's worth is accepted while nobody reads.
        #expect(loop.bytesWritten == 0)
        var received: [UInt8] = []
        while received.count < payload.count, let chunk = try await loop.read(maxBytes: 7) {
            #expect(chunk.count <= 16)
            received += chunk
        }
        try await writer.value
        #expect(received == payload)
        try await loop.close()
    }

    @Test func concurrentWritesStayWhole() async throws {
        let loop = try await Transport.connect(to: "loop://?buffer=8")
        let a = [UInt8](repeating: 0x61, count: 50)
        let b = [UInt8](repeating: 0x62, count: 50)
        async let first: Void = loop.write(a)
        async let second: Void = loop.write(b)
        var received: [UInt8] = []
        while received.count < 100, let chunk = try await loop.read() { received += chunk }
        _ = try await (first, second)
        #expect(received == a + b || received == b + a)
        try await loop.close()
    }

    @Test func halfCloseEndsTheReaderAfterTheBufferedBytes() async throws {
        let loop = try await Transport.connect(to: "loop://")
        #expect(loop.supportsHalfClose)
        try await loop.write("last")
        try await loop.closeWrite()
        #expect(try await loop.read() == Array("last".utf8))
        #expect(try await loop.read() == nil)
        await expectTransportError(.misuse) { try await loop.write("more") }
        try await loop.close()
    }

    @Test func readTimeoutLosesNothing() async throws {
        let loop = try await Transport.connect(to: "loop://")
        await expectTransportError(.timedOut) { try await loop.read(timeout: .milliseconds(50)) }
        try await loop.write("late")
        #expect(try await loop.read(timeout: .seconds(5)) == Array("late".utf8))
        try await loop.close()
    }

    /// spy+ has no deadline read of its own: the SDK's default (a task group) serves it, with the
    /// same promise.
    @Test func readTimeoutThroughAWrapperLosesNothing() async throws {
        let trace = "/tmp/tk-timeout-\(getpid())-\(UInt32.random(in: 0...UInt32.max)).trace"
        defer { unlink(trace) }
        let loop = try await Transport.connect(to: "spy+loop://?spy.file=\(trace)")
        let error = await expectTransportError(.timedOut) { try await loop.read(timeout: .milliseconds(50)) }
        #expect(error?.message.contains("within") == true, "\(String(describing: error))")
        try await loop.write("late")
        #expect(try await loop.read(timeout: .seconds(5)) == Array("late".utf8))
        try await loop.close()
    }

    @Test func cancellingAReaderThrowsCancellation() async throws {
        let loop = try await Transport.connect(to: "loop://")
        let reader = Task { try await loop.read() }
        try await Task.sleep(for: .milliseconds(50))
        reader.cancel()
        await #expect(throws: CancellationError.self) { try await reader.value }
        // The connection is still usable afterwards.
        try await loop.write("x")
        #expect(try await loop.read() == [0x78])
        try await loop.close()
    }

    @Test func cancellingAWriterBlockedOnAFullBuffer() async throws {
        let loop = try await Transport.connect(to: "loop://?buffer=4")
        let writer = Task { try await loop.write(Array(repeating: 1, count: 64)) }
        try await Task.sleep(for: .milliseconds(50))
        writer.cancel()
        await #expect(throws: CancellationError.self) { try await writer.value }
        try await loop.close()
    }

    @Test func twoConcurrentReadersAreRefused() async throws {
        let loop = try await Transport.connect(to: "loop://")
        let first = Task { try await loop.read() }
        try await Task.sleep(for: .milliseconds(50))
        let error = await expectTransportError(.misuse) { try await loop.read() }
        #expect(error?.message.contains("one task") == true)
        try await loop.write("z")
        #expect(try await first.value == [0x7A])
        try await loop.close()
    }

    @Test func closeEndsAParkedReaderAndLaterCallsFail() async throws {
        let loop = try await Transport.connect(to: "loop://")
        let reader = Task { try await loop.read() }
        try await Task.sleep(for: .milliseconds(50))
        try await loop.close()
        #expect(try await reader.value == nil)
        await expectTransportError(.misuse) { try await loop.read() }
        await expectTransportError(.misuse) { try await loop.write("x") }
        try await loop.close()  // a second close does nothing
        #expect(loop.isClosed)
    }

    @Test func inboundSequenceEndsWithTheStream() async throws {
        let loop = try await Transport.connect(to: "loop://")
        try await loop.write("ab")
        try await loop.closeWrite()
        var all: [UInt8] = []
        for try await chunk in loop.inbound { all += chunk }
        #expect(all == Array("ab".utf8))
    }
}
