import NIOCore
import Synchronization
import TestSupport
import Testing
@testable import TransportKit
@_spi(Plugins) import TransportKitCore

/// Tasks that prefer `connection.preferredExecutor`: they run on the connection's event loop, and a
/// parked reader is resumed inside the read that brought its bytes (EventLoopTaskExecutor.resumeInline).
/// On unix:// connections, which are SwiftNIO channels; tcp:// has no event loop of its own
/// (StreamSocketBackend: its reads and writes are system calls on the task's thread).
@Suite("preferredExecutor", .timeLimit(.minutes(1)))
struct PreferredExecutorTests {
    /// A listener, a client and the accepted server connection, over a Unix socket at a path of its own.
    private static func pair() async throws -> (Listener, Connection, Connection) {
        let path = Support.temporaryPath("executor") + ".sock"
        let listener = try await Transport.listen(on: "unix://\(path)")
        async let accepted = listener.accept()
        let client = try await Transport.connect(to: "unix://\(path)")
        let server = try #require(try await accepted)
        return (listener, client, server)
    }

    private static func loop(of connection: Connection) throws -> EventLoopTaskExecutor {
        try #require(connection.preferredExecutor as? EventLoopTaskExecutor)
    }

    @Test func requestResponseWithBothEndsOnTheirLoops() async throws {
        let (listener, client, server) = try await Self.pair()
        let path = listener.url.path
        let serverLoop = try Self.loop(of: server)
        let echo = Task {
            try await withTaskExecutorPreference(server.preferredExecutor) {
                var frames = 0
                var everyFrameOnTheLoop = true
                while let frame = try await server.readFrame(.fixedLength(32)) {
                    everyFrameOnTheLoop = everyFrameOnTheLoop && serverLoop.eventLoop.inEventLoop
                    try await server.write(frame.reversed())
                    frames += 1
                }
                try await server.close()
                return (frames, everyFrameOnTheLoop)
            }
        }
        let clientLoop = try Self.loop(of: client)
        let rounds = 500
        try await withTaskExecutorPreference(client.preferredExecutor) {
            for round in 0..<rounds {
                let request = (0..<32).map { UInt8(truncatingIfNeeded: round &+ $0) }
                try await client.write(request)
                let reply = try await client.readFrame(.fixedLength(32))
                #expect(reply == Array(request.reversed()), "round \(round)")
                #expect(clientLoop.eventLoop.inEventLoop)
            }
        }
        try await client.closeWrite()
        #expect(try await client.read() == nil)
        let (frames, onTheLoop) = try await echo.value
        #expect(frames == rounds)
        #expect(onTheLoop)
        try await client.close()
        try await listener.close()
        #expect(await eventually { Support.openUnixSockets(path: path) == 0 })
    }

    @Test func aParkedReadOnTheLoopIsCancellableAndLosesNoByte() async throws {
        let (listener, client, server) = try await Self.pair()
        let reader = Task {
            try await withTaskExecutorPreference(client.preferredExecutor) { try await client.read() }
        }
        try await Task.sleep(for: .milliseconds(100))
        reader.cancel()
        await #expect(throws: CancellationError.self) { try await reader.value }
        try await server.write("after")
        #expect(try await client.read(timeout: .seconds(5)) == Array("after".utf8))
        try await client.close()
        try await server.close()
        try await listener.close()
    }

    /// The runtime calls cancellation handlers under the task's status-record lock; the task must
    /// not run inside one, even when the cancel is issued on the loop's own thread.
    @Test func cancellingFromTheLoopThreadQueuesTheTaskInsteadOfRunningItThere() async throws {
        let (listener, client, server) = try await Self.pair()
        let resumed = Flag()
        let reader = Task {
            try await withTaskExecutorPreference(client.preferredExecutor) {
                defer { resumed.set() }
                return try await client.read()
            }
        }
        try await Task.sleep(for: .milliseconds(100))
        let resumedInsideCancel = try await Self.loop(of: client).eventLoop.submit {
            reader.cancel()
            return resumed.isSet
        }.get()
        #expect(!resumedInsideCancel)
        await #expect(throws: CancellationError.self) { try await reader.value }
        #expect(resumed.isSet)
        try await client.close()
        try await server.close()
        try await listener.close()
    }

    @Test func thePeerClosingEndsAParkedReadOnTheLoop() async throws {
        let (listener, client, server) = try await Self.pair()
        let reader = Task {
            try await withTaskExecutorPreference(client.preferredExecutor) { try await client.read() }
        }
        try await Task.sleep(for: .milliseconds(50))
        try await server.close()
        #expect(try await reader.value == nil)
        try await client.close()
        try await listener.close()
    }

    /// The resumed task runs inside the channel's read: closing the connection there, or suspending
    /// on something else, must work as it does anywhere.
    @Test func aTaskResumedInsideTheReadCanSuspendElsewhereAndClose() async throws {
        let (listener, client, server) = try await Self.pair()
        let path = listener.url.path
        let responder = Task {
            try await withTaskExecutorPreference(server.preferredExecutor) {
                let request = try await server.readFrame(.delimiter(Array("\n".utf8)))
                try await Task.sleep(for: .milliseconds(20))
                try await server.write((request ?? []) + Array(" ok\n".utf8))
                try await server.close()
            }
        }
        try await client.write("hello\n")
        #expect(try await client.readFrame(.delimiter(Array("\n".utf8)), timeout: .seconds(5)) == Array("hello ok".utf8))
        #expect(try await client.read(timeout: .seconds(5)) == nil)
        try await responder.value
        try await client.close()
        try await listener.close()
        #expect(await eventually { Support.openUnixSockets(path: path) == 0 })
    }

    @Test func aFailedWriteOnTheLoopCarriesErrno() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        Support.resetClose(await raw.accept())
        try await Task.sleep(for: .milliseconds(50))
        let error = await expectTransportError(.disconnected) {
            try await withTaskExecutorPreference(client.preferredExecutor) {
                for _ in 0..<100 {
                    try await client.write([UInt8](repeating: 0, count: 1024))
                    try await Task.sleep(for: .milliseconds(5))
                }
            }
        }
        #expect(error?.errno == .brokenPipe || error?.errno == .connectionReset, "\(String(describing: error))")
        try? await client.close()
        #expect(await eventually { Support.openSockets(port: raw.port) == 0 })
    }
}

/// A flag set from one task and read from another.
private final class Flag: Sendable {
    private let value = Locked(false)
    func set() { value.withLock { $0 = true } }
    var isSet: Bool { value.withLock { $0 } }
}
