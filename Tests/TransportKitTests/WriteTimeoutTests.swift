import Foundation
import Glibc
import Testing
import TestSupport
import TransportKit

/// `write(_:timeout:)`: a write that the peer does not take in time fails with `.timedOut`, and on
/// the event-loop transports it sent nothing, so what the peer finally reads is exactly what the
/// writes that returned accepted.
@Suite("write with a timeout")
struct WriteTimeoutTests {
    /// Writes 64 KiB blocks with a short timeout until one times out; the bytes accepted before it.
    static func fill(_ connection: Connection, block: Int = 65536) async throws -> (accepted: Int, error: TransportError?) {
        var accepted = 0
        for index in 0..<4096 {
            do {
                try await connection.write([UInt8](repeating: UInt8(truncatingIfNeeded: index), count: block), timeout: .milliseconds(300))
                accepted += block
            } catch let error as TransportError {
                return (accepted, error)
            }
        }
        return (accepted, nil)
    }

    @Test func aPeerThatDoesNotReadTimesTheWriteOutAndGetsExactlyWhatWasAccepted() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
        let server = try #require(try await listener.accept())
        let (accepted, error) = try await Self.fill(client)
        let timedOut = try #require(error, "256 MiB were accepted by a peer that reads nothing")
        #expect(timedOut.kind == .timedOut)
        #expect(timedOut.message.contains("took longer than 0.3 s") && timedOut.message.contains("nothing of it was sent"), "\(timedOut.message)")
        #expect(accepted > 0)
        // The peer reads now (while the half-close waits for the bytes in flight to go out).
        let reading = Task {
            var received = 0
            while let chunk = try await server.read(timeout: .seconds(10)) { received += chunk.count }
            return received
        }
        try await client.closeWrite()
        let received = try await reading.value
        #expect(received == accepted, "the peer got exactly the accepted writes: \(received) of \(accepted)")
        try await server.close()
        try await client.close()
        try await listener.close()
    }

    @Test func aWriteThatFitsReturnsAtOnceAndIsCounted() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
        let server = try #require(try await listener.accept())
        try await client.write("hello\n", timeout: .seconds(5))
        try await client.write([], timeout: .seconds(5))
        #expect(try await server.readLine(timeout: .seconds(5)) == "hello")
        #expect(client.bytesWritten == 6)
        try await client.close()
        await expectTransportError(.misuse) { try await client.write("late", timeout: .seconds(1)) }
        try await server.close()
        try await listener.close()
    }

    @Test func aSerialPortWhoseOtherSideDoesNotReadTimesOut() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let (accepted, error) = try await Self.fill(connection, block: 4096)
        let timedOut = try #require(error)
        #expect(timedOut.kind == .timedOut && timedOut.message.contains("nothing of it was sent"), "\(timedOut.message)")
        #expect((connection.unsentByteCount ?? 0) > 0, "what waits for the other side counts as unsent: \(String(describing: connection.unsentByteCount))")
        #expect(await pty.read(count: accepted, seconds: 10).count == accepted, "every accepted byte reaches the other side")
        #expect(await eventually { connection.unsentByteCount == 0 }, "\(String(describing: connection.unsentByteCount))")
        try await connection.write("after", timeout: .seconds(5))
        #expect(await pty.read(count: 5) == Array("after".utf8))
        try await connection.close()
    }

    @Test func aWriterHeldUpByAnotherOnAnMTUTransportTimesOutHavingSentNothing() async throws {
        // maxWrite= makes writes chunked, one writer at a time; the first is stuck on a full buffer.
        let loop = try await Transport.connect(to: "loop://?buffer=1024&maxWrite=256")
        let stuck = Task { try await loop.write([UInt8](repeating: 1, count: 8192)) }
        #expect(await eventually { loop.unreadByteCount == 1024 }, "the first writer filled the buffer")
        let started = ContinuousClock.now
        let error = await expectTransportError(.timedOut) { try await loop.write([2, 2], timeout: .milliseconds(300)) }
        #expect(error?.message.contains("nothing of it was sent") == true, "\(error?.message ?? "")")
        #expect(ContinuousClock.now - started < .seconds(30), "the turn's wait ended at the deadline")
        loop.abort()
        _ = await stuck.result
    }

    @Test func aTransportWithoutItsOwnWaitSaysPartMayHaveGone() async throws {
        // loop:// has its own backend: the default race, which cannot promise all or nothing.
        let loop = try await Transport.connect(to: "loop://?buffer=1024")
        let (_, error) = try await Self.fill(loop, block: 4096)
        let timedOut = try #require(error)
        #expect(timedOut.kind == .timedOut, "\(timedOut)")
        #expect(timedOut.message.contains("part of it may have been sent"), "\(timedOut.message)")
        try await loop.close()
    }
}
