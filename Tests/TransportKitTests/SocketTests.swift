import Foundation
import Glibc
import TestSupport
import Testing
import NIOCore
import NIOPosix
@_spi(Plugins) @testable import TransportKit
@testable import TransportKitSockets
@_spi(Plugins) import TransportKitLinux

@Suite("tcp://")
struct TCPTests {
    @Test func listenAndConnectCarryBytesBothWays() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        #expect(port > 0)
        async let accepted = listener.accept()
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        let server = try #require(try await accepted)
        try await client.write("ping")
        #expect(try await server.read() == Array("ping".utf8))
        try await server.write("pong")
        #expect(try await client.read() == Array("pong".utf8))
        #expect(client.metadata.remoteAddress?.contains("\(port)") == true)
        #expect(server.url.scheme == "tcp")
        try await client.close()
        #expect(try await server.read() == nil)
        try await server.close()
        try await listener.close()
        #expect(await eventually { Support.openSockets(port: port) == 0 })
    }

    @Test func aConnectionThatArrivesBeforeAcceptIsKept() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
        try await client.write("early")
        try await Task.sleep(for: .milliseconds(300))
        let server = try #require(try await listener.accept())
        #expect(try await server.read(timeout: .seconds(5)) == Array("early".utf8))
        try await server.write("welcome")
        #expect(try await client.read(timeout: .seconds(5)) == Array("welcome".utf8))
        try await client.close()
        try await server.close()
        try await listener.close()
    }

    @Test func closingTheListenerRightAfterAcceptKeepsTheConnection() async throws {
        // NIO closes a child whose server channel closed before the child was passed on; the
        // listener must hand connections out only after that point.
        for round in 0..<20 {
            let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
            let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
            try await client.write("round \(round)")
            let server = try #require(try await listener.accept())
            try await listener.close()
            #expect(try await server.read(timeout: .seconds(5)) == Array("round \(round)".utf8))
            try await server.write("ok")
            #expect(try await client.read(timeout: .seconds(5)) == Array("ok".utf8))
            try await client.close()
            try await server.close()
        }
    }

    @Test func ipv6AndDNSNames() async throws {
        // IPv6 literal, and a name resolved through getaddrinfo (localhost: 127.0.0.1 here).
        let v6 = try await Transport.listen(on: "tcp://[::1]:0")
        let v4 = try await Transport.listen(on: "tcp://127.0.0.1:0")
        #expect(v6.url.description.hasPrefix("tcp://[::1]:"))
        for (url, listener) in [("tcp://[::1]:\(v6.url.port ?? 0)", v6), ("tcp://localhost:\(v4.url.port ?? 0)", v4)] {
            let client = try await Transport.connect(to: url)
            let server = try #require(try await listener.accept())
            try await client.write("6")
            #expect(try await server.read() == [0x36])
            try await client.close()
            try await server.close()
        }
        try await v6.close()
        try await v4.close()
    }

    /// RFC 8305 §4 and §5, on addresses given (this machine's localhost may have one family only):
    /// families alternate; a refused attempt starts the next at once; one that does not answer
    /// lets the next start after the attempt delay, and its socket is closed once another won.
    /// Only lower bounds and generous upper ones on time: the suite runs in parallel.
    @Test func happyEyeballsAlternatesFamiliesAndRacesAttempts() async throws {
        let v4 = { (port: Int) in try SocketAddress(ipAddress: "127.0.0.1", port: port) }
        let v6 = { (port: Int) in try SocketAddress(ipAddress: "::1", port: port) }
        #expect(HappyEyeballs.interleave([try v4(1), try v4(2), try v4(1), try v6(3), try v6(4)]).map(\.port) == [1, 3, 2, 4])
        #expect(HappyEyeballs.interleave([try v6(3), try v4(1), try v4(2)]).map(\.port) == [3, 1, 2])

        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let refusing = try Support.RawListener(listening: false)
        defer { refusing.close() }
        let never: @Sendable ([TransportError]) -> TransportError = { $0.first ?? TransportError(.io, "none") }
        // Refused first: the next address at once, not after the (here 60 s) attempt delay.
        var started = ContinuousClock.now
        let (first, _) = try await HappyEyeballs.connect(to: [try v4(refusing.port), try v4(port)], attemptDelay: .seconds(60),
                                                         configure: { _ in }, failure: never)
        #expect(ContinuousClock.now - started < .seconds(30), "a refusal starts the next attempt at once")
        first.closeOwned()
        // No answer first (a full backlog): the next starts after the attempt delay and wins.
        let hole = try await Support.blackHole()
        defer { hole.listener.close(); hole.fillers.forEach { _ = Glibc.close($0) } }
        started = ContinuousClock.now
        let (second, address) = try await HappyEyeballs.connect(to: [try v4(hole.listener.port), try v4(port)], attemptDelay: .milliseconds(300),
                                                                configure: { _ in }, failure: never)
        let elapsed = ContinuousClock.now - started
        #expect(address.port == port)
        #expect(elapsed >= .milliseconds(300), "the second attempt waited for the delay: \(elapsed)")
        second.closeOwned()
        #expect(await eventually { Support.openSockets(port: hole.listener.port, excluding: hole.fillers) == 0 }, "the losing attempt's socket is closed")
        // All refused: every failure, in order.
        let error = await expectTransportError(.refused) {
            _ = try await HappyEyeballs.connect(to: [try v4(refusing.port), try v6(refusing.port)], configure: { _ in }) { failures in
                TransportError(.refused, "\(failures.count) failures")
            }
        }
        #expect(error?.message == "2 failures")
        try await listener.close()
    }

    /// A write cancelled after the kernel took part of it still goes out whole: the stream never
    /// carries a torn write, and the next write follows it.
    @Test func aWriteCancelledHalfwayIsNotTorn() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        let size = 16 << 20
        let writer = Task { try await client.write([UInt8](repeating: 0x41, count: size)) }
        // The peer reads nothing: the kernel takes part, the rest waits.
        #expect(await eventually(10) { (client.unsentByteCount ?? 0) > 0 }, "the write stalled with part sent")
        writer.cancel()
        await #expect(throws: CancellationError.self) { try await writer.value }
        let after = Task { try await client.write("END") }
        var received = 0
        var tail: [UInt8] = []
        while received < size + 3 {
            let chunk = await Support.readSome(peer)
            guard !chunk.isEmpty else { break }
            received += chunk.count
            tail = Array((tail + chunk).suffix(3))
        }
        try await after.value
        #expect(received == size + 3, "every byte of the cancelled write, then the next: \(received)")
        #expect(tail == Array("END".utf8))
        try await client.close()
    }

    /// Two tasks writing at once: each write reaches the peer whole, never interleaved with the
    /// other, even when the kernel takes them in parts (the peer reads slowly).
    @Test func concurrentWritesDoNotInterleave() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        let size = 4 << 20
        let writers = (0..<2).map { index in
            Task { try await client.write([UInt8](repeating: UInt8(ascii: index == 0 ? "A" : "B"), count: size)) }
        }
        var received: [UInt8] = []
        received.reserveCapacity(2 * size)
        while received.count < 2 * size {
            let chunk = await Support.readSome(peer)
            guard !chunk.isEmpty else { break }
            received += chunk
        }
        for writer in writers { try await writer.value }
        #expect(received.count == 2 * size)
        let firstChange = received.firstIndex { $0 != received[0] }
        #expect(firstChange == size, "the first write's \(size) bytes came whole (changed at \(String(describing: firstChange)))")
        #expect(received[size...].allSatisfy { $0 == received[size] })
        try await client.close()
    }

    @Test func unresolvableHostIsNotFound() async {
        // timeout=30, not 5: under ThreadSanitizer, with the whole suite running at once on two
        // cores, a CI rehearsal saw the lookup's hops (its thread, the task it resumes) take
        // longer than 5 s; the refusal is what this test is about, not its speed.
        let error = await expectTransportError(.notFound) {
            try await Transport.connect(to: "tcp://no-such-host.invalid:80?timeout=30")
        }
        #expect(error?.message.contains("cannot resolve") == true)
    }

    @Test func refusedConnectionSaysSoAndLeaksNothing() async throws {
        // Bound, not listening: refused, and the port stays this test's meanwhile (a port merely
        // freed was once handed to another test's listener, and the connect succeeded).
        let raw = try Support.RawListener(listening: false)
        defer { raw.close() }
        let port = raw.port
        let error = await expectTransportError(.refused) { try await Transport.connect(to: "tcp://127.0.0.1:\(port)") }
        #expect(error?.errno == .connectionRefused)
        #expect(error?.syscall == "connect")
        #expect(error?.message.contains("is the server running") == true)
        #expect(Support.openSockets(port: port, excluding: [raw.fd]) == 0)
    }

    @Test func connectTimeoutFiresAndLeaksNothing() async throws {
        let hole = try await Support.blackHole()
        defer {
            for fd in hole.fillers { close(fd) }
            hole.listener.close()
        }
        let start = ContinuousClock.now
        let error = await expectTransportError(.timedOut) {
            try await Transport.connect(to: "tcp://127.0.0.1:\(hole.listener.port)?timeout=0.3")
        }
        // The black hole never answers: ending at all is the timeout's work.
        #expect(ContinuousClock.now - start < .seconds(30))
        // This URL's 0.3 s, not the 10 s default.
        #expect(error?.message.contains("took longer than 0.3 s") == true, "\(error?.message ?? "")")
        #expect(await eventually { Support.openSockets(port: hole.listener.port, excluding: hole.fillers) == 0 })
    }

    @Test func cancellingAConnectReturnsPromptlyAndLeaksNothing() async throws {
        let hole = try await Support.blackHole()
        defer {
            for fd in hole.fillers { close(fd) }
            hole.listener.close()
        }
        let task = Task { try await Transport.connect(to: "tcp://127.0.0.1:\(hole.listener.port)?timeout=0") }
        try await Task.sleep(for: .milliseconds(200))
        let start = ContinuousClock.now
        task.cancel()
        await #expect(throws: CancellationError.self) { try await task.value }
        // Without cancellation it would wait forever (timeout=0); 30 s leaves room for a loaded
        // 2-core machine (1.06 s was seen while the lab shut down; CI's pool was once 10 s late).
        #expect(ContinuousClock.now - start < .seconds(30))
        // The abandoned attempt's socket is closed once NIO gives up on it.
        #expect(await eventually(15) { Support.openSockets(port: hole.listener.port, excluding: hole.fillers) == 0 })
    }

    @Test func halfCloseLetsThePeerAnswerAfterTheEnd() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let serverTask = Task {
            let server = try #require(try await listener.accept())
            var request: [UInt8] = []
            while let chunk = try await server.read() { request += chunk }  // until the client's FIN
            try await server.write(request.reversed())
            try await server.close()
        }
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        try await client.write("stressed")
        try await client.closeWrite()
        var answer: [UInt8] = []
        while let chunk = try await client.read() { answer += chunk }
        #expect(String(decoding: answer, as: UTF8.self) == "desserts")
        try await serverTask.value
        try await client.close()
        try await listener.close()
    }

    @Test func aSlowReaderBoundsTheWritersBuffer() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        let server = try #require(try await listener.accept())
        let chunk = [UInt8](repeating: 0x55, count: 256 * 1024)
        let total = 64 * 1024 * 1024
        let writer = Task {
            var sent = 0
            while sent < total {
                try await client.write(chunk)
                sent += chunk.count
            }
        }
        // Nobody reads: the writer is held back by the kernel's buffers, NIO's watermark and the
        // reader's inbound limit, not queued without bound. It comes to a stop (no change over
        // 300 ms; on a loaded machine the kernel's buffers can take a while to fill), well short of
        // the total.
        var accepted = client.bytesWritten
        var stopped = false
        for _ in 0..<40 where !stopped {
            try await Task.sleep(for: .milliseconds(300))
            let now = client.bytesWritten
            stopped = now == accepted
            accepted = now
        }
        #expect(stopped, "the writer kept going without a reader: \(accepted) bytes")
        #expect(accepted < 24 * 1024 * 1024, "the writer got \(accepted) bytes ahead of a reader that reads nothing")
        // Now drain: every byte written arrives.
        var received = 0
        while received < total, let bytes = try await server.readBuffer() { received += bytes.readableBytes }
        try await writer.value
        #expect(received == total)
        try await client.close()
        try await server.close()
        try await listener.close()
    }

    @Test func aSlowApplicationReaderStopsReadingFromTheKernel() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        let server = try #require(try await listener.accept())
        let writer = Task {
            let chunk = [UInt8](repeating: 1, count: 64 * 1024)
            while !Task.isCancelled { try await server.write(chunk) }
        }
        try await Task.sleep(for: .milliseconds(500))
        let written = server.bytesWritten
        #expect(written < 24 * 1024 * 1024, "\(written) bytes sent to a client that reads nothing")
        writer.cancel()
        _ = try? await writer.value
        try await client.close()
        // The server's last writes may not have reached a client that closed: close may say so.
        try? await server.close()
        try await listener.close()
    }

    @Test func peerResetIsDisconnectedAfterTheBytesBeforeIt() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        let fd = await raw.accept()
        Support.writeAll(fd, Array("last words".utf8))
        try await Task.sleep(for: .milliseconds(50))
        Support.resetClose(fd)
        var received: [UInt8] = []
        do {
            while let chunk = try await client.read() { received += chunk }
            Issue.record("a reset ended like an orderly close")
        } catch let error as TransportError {
            #expect(error.kind == .disconnected)
            #expect(error.errno == .connectionReset)
        }
        #expect(received == Array("last words".utf8))
        try? await client.close()
        #expect(await eventually { Support.openSockets(port: raw.port) == 0 })
    }

    @Test func writingToAResetPeerFails() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        Support.resetClose(await raw.accept())
        try await Task.sleep(for: .milliseconds(50))
        await expectTransportError(.disconnected) {
            for _ in 0..<100 {
                try await client.write([UInt8](repeating: 0, count: 1024))
                try await Task.sleep(for: .milliseconds(5))
            }
            try await client.close()
        }
        try? await client.close()
    }

    @Test func droppedConnectionsAreClosed() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        do {
            _ = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        }
        let fd = await raw.accept()
        // The application never called close(): releasing the connection closed its socket.
        #expect(await Support.readAll(fd).isEmpty)
        close(fd)
        #expect(await eventually { Support.openSockets(port: raw.port) == 0 })
    }

    @Test func addressInUseIsBusy() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        await expectTransportError(.busy) { try await Transport.listen(on: "tcp://127.0.0.1:\(port)") }
        try await listener.close()
    }

    @Test func listenerCloseEndsAcceptAndTheSequence() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let waiting = Task { try await listener.accept() }
        try await Task.sleep(for: .milliseconds(50))
        try await listener.close()
        #expect(try await waiting.value == nil)
        var count = 0
        for try await _ in listener.connections { count += 1 }
        #expect(count == 0)
    }

    @Test func socketOptionsAreApplied() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        // keepAliveIdle implies keepAlive; both must be accepted by the kernel without error.
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)?noDelay=false&keepAliveIdle=30")
        let fd = await raw.accept()
        defer { close(fd) }
        try await client.write("k")
        try await client.close()
        #expect(await Support.readAll(fd) == Array("k".utf8))
    }
}

@Suite("Connection.abort()")
struct AbortTests {
    @Test func abortEndsACloseThatWaitsForAPeerThatDoesNotRead() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let connection = try await Transport.connect(to: "tcp://127.0.0.1:\(raw.port)")
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        #expect(connection.unsentByteCount == 0, "nothing written, nothing unsent")
        // The peer never reads: the kernel's buffers fill, then NIO's queue up to its bound.
        let writer = Task { try await connection.write([UInt8](repeating: 1, count: 32 << 20)) }
        try await Task.sleep(for: .milliseconds(300))
        let stalled = await eventually(10) { (connection.unsentByteCount ?? 0) > 0 }
        #expect(stalled, "bytes wait in NIO's queue for a peer that does not read: \(String(describing: connection.unsentByteCount))")
        let spied = try await Transport.connect(to: "spy+loop://")
        #expect(spied.unsentByteCount == 0, "a wrapper reports what the connection it wraps holds")
        try await spied.close()
        let closing = Task { try await connection.close() }
        try await Task.sleep(for: .milliseconds(300))
        connection.abort()
        // Ends now instead of when the peer reads (never): close reports the dropped bytes or
        // nothing, the parked writer fails.
        _ = try? await closing.value
        await #expect(throws: (any Error).self) { try await writer.value }
        #expect(connection.isClosed)
        connection.abort()   // again: nothing happens
    }

    @Test func abortWakesAParkedLoopReaderAndWriter() async throws {
        let connection = try await Transport.connect(to: "loop://?buffer=16")
        let reader = Task { try await connection.read(maxBytes: 1 << 20) }
        try await connection.write([UInt8](repeating: 1, count: 16))   // the buffer is full now
        let writer = Task { try await connection.write([UInt8](repeating: 2, count: 16)) }
        _ = try await reader.value   // took the first 16 bytes
        let second = Task { () -> [UInt8]? in
            try await Task.sleep(for: .milliseconds(200))
            return try await connection.read()
        }
        try await Task.sleep(for: .milliseconds(50))
        connection.abort()
        _ = try? await writer.value
        let after = try? await second.value
        #expect(after == nil || after == .some(nil), "a read after abort() ends instead of waiting")
        #expect(connection.isClosed)
    }
}

@Suite("unix://")
struct UnixTests {
    @Test func listenAndConnect() async throws {
        let path = Support.temporaryPath("basic")
        let listener = try await Transport.listen(on: "unix://\(path)")
        async let accepted = listener.accept()
        let client = try await Transport.connect(to: "unix://\(path)")
        let server = try #require(try await accepted)
        try await client.write("over unix")
        #expect(try await server.read() == Array("over unix".utf8))
        try await client.closeWrite()
        #expect(try await server.read() == nil)
        try await server.write("reply")
        #expect(try await client.read() == Array("reply".utf8))
        try await client.close()
        try await server.close()
        try await listener.close()
        #expect(!FileManager.default.fileExists(atPath: path), "the listener removes its socket file")
        #expect(Support.openUnixSockets(path: path) == 0)
    }

    /// A client that waits for the socket file to appear and then connects (what scripts do) is
    /// queued, not refused: the file is listened on as soon as bind(2) makes it. bind(2) and
    /// listen(2) are two calls, so a poller can still land in the microseconds between them (one
    /// that polled every 20 µs did, in CI); polling every 500 µs still catches a listen that comes
    /// a whole event-loop hop later (the bug this guards against failed at round 0).
    @Test func aClientThatConnectsAsSoonAsTheFileAppearsIsNotRefused() async throws {
        var refused = 0
        for round in 0..<30 {
            let path = Support.temporaryPath("appears-\(round)")
            // On a thread of its own: polls for the file every few microseconds, then connects once.
            let poller = Task { await Support.offPool { () -> Int32 in
                let until = ContinuousClock.now + .seconds(10)
                var info = stat()
                while lstat(path, &info) != 0 {
                    guard ContinuousClock.now < until else { return ETIMEDOUT }
                    usleep(500)
                }
                let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
                defer { close(fd) }
                var address = sockaddr_un()
                address.sun_family = sa_family_t(AF_UNIX)
                withUnsafeMutableBytes(of: &address.sun_path) { raw in path.utf8CString.withUnsafeBytes { raw.copyMemory(from: $0) } }
                let result = withUnsafePointer(to: &address) {
                    $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
                }
                return result == 0 ? 0 : errno
            } }
            let listener = try await Transport.listen(on: "unix://\(path)")
            let outcome = await poller.value
            #expect(outcome == 0 || outcome == ECONNREFUSED, "round \(round): errno \(outcome)")
            if outcome == ECONNREFUSED { refused += 1 }
            try await listener.close()
        }
        // A thread preempted between bind(2) and listen(2) widens the window on a loaded machine:
        // a rare refusal is the kernel's two-call interface, most rounds refused is the bug.
        #expect(refused <= 3, "\(refused) of 30 clients that connected as the file appeared were refused")
    }

    @Test func missingSocketIsNotFound() async {
        let error = await expectTransportError(.notFound) { try await Transport.connect(to: "unix:///nonexistent/dir/x.sock") }
        #expect(error?.errno == .noSuchFileOrDirectory)
        #expect(error?.syscall == "connect")
    }

    @Test func staleSocketFileIsReplacedButALiveOneIsBusy() async throws {
        let path = Support.temporaryPath("stale")
        // A socket file left by a process that died: bound, never listening, closed.
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            path.utf8CString.withUnsafeBytes { raw.copyMemory(from: $0) }
        }
        _ = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        close(fd)
        #expect(FileManager.default.fileExists(atPath: path))
        await expectTransportError(.refused) { try await Transport.connect(to: "unix://\(path)") }

        let listener = try await Transport.listen(on: "unix://\(path)")
        let error = await expectTransportError(.busy) { try await Transport.listen(on: "unix://\(path)") }
        #expect(error?.message.contains("another process") == true)
        try await listener.close()
    }

    @Test func aRegularFileIsNotReplaced() async throws {
        let path = Support.temporaryPath("file")
        #expect(FileManager.default.createFile(atPath: path, contents: Data("keep".utf8)))
        defer { try? FileManager.default.removeItem(atPath: path) }
        await expectTransportError(.busy) { try await Transport.listen(on: "unix://\(path)") }
        #expect(FileManager.default.contents(atPath: path) == Data("keep".utf8))
    }

    @Test func overlongPathIsInvalid() async {
        let long = "/tmp/" + String(repeating: "x", count: 200)
        await expectTransportError(.invalidURL) { try await Transport.connect(to: "unix://\(long)") }
    }
}

@Suite("ChannelBackend's write bound")
struct WriteBoundTests {
    /// A writer off the event loop sees the channel writable until the loop has processed its
    /// writes; with the loop held up it used to queue without limit (the whole transfer, in a
    /// benchmark). The bytes in flight are capped: here the loop is blocked on purpose.
    @Test func aWriterOffAStarvedLoopStopsAtTheCap() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let backend = try await ClientBootstrap(group: group).connect(host: "127.0.0.1", port: raw.port) { channel in
            channel.eventLoop.makeCompletedFuture {
                try ChannelBackend.install(on: channel, describing: "the test peer", supportsHalfClose: true)
            }
        }
        let connection = Connection(url: try TransportURL("tcp://127.0.0.1:\(raw.port)"), backend: backend)
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        let total = 16 << 20
        let chunk = 64 << 10
        // The loop's only thread is held until the test has looked: nothing handed over is
        // written meanwhile, however slowly this machine runs (no time window to miss).
        let release = DispatchSemaphore(value: 0)
        group.next().execute { release.wait() }
        let writer = Task {
            for index in 0..<(total / chunk) {
                try await connection.write(ByteBuffer(repeating: UInt8(index & 0xFF), count: chunk))
            }
            try await connection.closeWrite()
        }
        // The writer goes on until it parks: wait until the count stays put for 200 ms.
        var accepted = -1
        while accepted != connection.bytesWritten {
            accepted = connection.bytesWritten
            try await Task.sleep(for: .milliseconds(200))
        }
        release.signal()
        #expect(accepted < total, "the writer was held while the loop was blocked")
        #expect(accepted <= Buffering.standard.inFlight.high + chunk, "\(accepted) bytes accepted while the loop was blocked")
        #expect(accepted >= Buffering.standard.inFlight.high - chunk, "the writer went on up to the cap (\(accepted))")
        // Once the loop runs again, everything arrives, in order.
        let received = await Support.readAll(peer)
        try await writer.value
        #expect(received.count == total)
        #expect(stride(from: 0, to: total, by: chunk).allSatisfy { received[$0] == UInt8(($0 / chunk) & 0xFF) })
        try await connection.close()
        try await group.shutdownGracefully()
    }
}
