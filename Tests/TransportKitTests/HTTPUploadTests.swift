import Foundation
import Glibc
import NIOCore
import TestSupport
import Testing
@_spi(Plugins) @testable import TransportKit

/// python3-aiohttp serving Peers/http_peer.py's paths; https with a trustme certificate.
func httpPeer(secure: Bool = false) async throws -> (Peer, Int) {
    var arguments = ["/usr/bin/python3", "\(WebSocketPeers.folder)/http_peer.py", "0"]
    if secure { arguments += [await Certificates.path("cert.pem"), await Certificates.path("key.pem")] }
    let (peer, port) = try await WebSocketPeers.started(Peer(arguments))
    try await peer.waitForPort(port)
    return (peer, port)
}

/// Reads `connection` to its end.
func readAll(_ connection: Connection, timeout: Duration = .seconds(20)) async throws -> [UInt8] {
    var received: [UInt8] = []
    while let chunk = try await connection.read(timeout: timeout) { received += chunk }
    return received
}

@Suite("http:// and https:// streamed requests against aiohttp", .serialized)
struct HTTPUploadTests {

    @Test func aBodyStreamsChunkedAndTheResponseIsReadAfterIt() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?method=PUT&contentType=text/plain&x=1&authorization=Bearer%20t")
        #expect(connection.supportsHalfClose)
        var random = SystemRandomNumberGenerator()
        let block = (0..<65536).map { _ in UInt8.random(in: 0...255, using: &random) }
        for _ in 0..<128 { try await connection.write(block) }   // 8 MiB, never gathered in memory
        try await connection.closeWrite()
        let answer = try await readAll(connection)
        let fields = try #require(try JSONSerialization.jsonObject(with: Data(answer)) as? [String: Any])
        #expect(fields["bytes"] as? Int == 128 * 65536)
        #expect(fields["method"] as? String == "PUT")
        #expect(fields["query"] as? String == "x=1", "the scheme's options stay here; the server's query goes")
        #expect(fields["contentType"] as? String == "text/plain")
        #expect(fields["chunked"] as? Bool == true)
        #expect(fields["authorization"] as? String == "Bearer t")
        #expect(connection.metadata.extra["http.status"] == "200")
        #expect(connection.metadata.extra["http.header.content-type"]?.hasPrefix("application/json") == true, "\(connection.metadata.extra)")
        try await connection.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func aKnownLengthIsSentAsContentLengthAndHeldTo() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?length=5")
        try await connection.write("hello")
        try await connection.closeWrite()
        let fields = try #require(try JSONSerialization.jsonObject(with: Data(try await readAll(connection))) as? [String: Any])
        #expect(fields["length"] as? String == "5")
        #expect(fields["chunked"] as? Bool == false)
        #expect(fields["bytes"] as? Int == 5)
        try await connection.close()

        // A byte too many fails that write, or (as every write failure after the hand-over) the next call.
        let over = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?length=5")
        try await over.write("hello")
        let tooMany = await transportError {
            try await over.write("!")
            try await over.closeWrite()
        }
        #expect(tooMany?.kind == .misuse)
        #expect(tooMany?.message.contains("length=5") == true, "\(String(describing: tooMany))")
        over.abort()

        let short = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?length=5")
        try await short.write("hi")
        let early = await transportError { try await short.closeWrite() }
        #expect(early?.kind == .misuse)
        #expect(early?.message.contains("after 2 bytes") == true, "\(String(describing: early))")
        short.abort()
    }

    @Test func anErrorStatusARedirectAndAResetSayWhatHappened() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        let unauthorized = try await Transport.connect(to: "http://127.0.0.1:\(port)/reject401")
        try? await unauthorized.write("data")
        try? await unauthorized.closeWrite()
        let denied = await transportError { _ = try await readAll(unauthorized) }
        #expect(denied?.kind == .permissionDenied)
        #expect(denied?.message.contains("401 Unauthorized") == true && denied?.message.contains("token required") == true, "\(String(describing: denied))")
        #expect(unauthorized.metadata.extra["http.status"] == "401")
        try? await unauthorized.close()

        let missing = try await Transport.connect(to: "http://127.0.0.1:\(port)/nothing-here")
        try await missing.closeWrite()
        let notFound = await transportError { _ = try await readAll(missing) }
        #expect(notFound?.kind == .notFound, "\(String(describing: notFound))")
        try? await missing.close()

        let redirected = try await Transport.connect(to: "http://127.0.0.1:\(port)/redirect")
        try await redirected.closeWrite()
        let redirect = await transportError { _ = try await readAll(redirected) }
        #expect(redirect?.kind == .protocolError)
        #expect(redirect?.message.contains("/ingest") == true && redirect?.message.contains("cannot be sent again") == true, "\(String(describing: redirect))")
        try? await redirected.close()

        // The server resets after 64 KiB: the writer or the reader learns it, with errno.
        let reset = try await Transport.connect(to: "http://127.0.0.1:\(port)/reset")
        let failure = await transportError {
            for _ in 0..<1024 { try await reset.write([UInt8](repeating: 7, count: 65536)) }
            try await reset.closeWrite()
            _ = try await readAll(reset)
        }
        #expect(failure?.kind == .disconnected, "\(String(describing: failure))")
        try? await reset.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func aServerThatStopsReadingHoldsTheWriterBack() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "http://127.0.0.1:\(port)/stall")
        let block = [UInt8](repeating: 1, count: 65536)
        let writer = Task {
            for _ in 0..<1024 { try await connection.write(block) }   // 64 MiB, if nothing held it back
        }
        try await Task.sleep(for: .seconds(2))
        #expect(connection.bytesWritten < 16 << 20, "the body waits for the server: \(connection.bytesWritten) bytes taken")
        #expect(connection.bytesWritten > 0)
        writer.cancel()
        connection.abort()
        _ = await writer.result
    }

    @Test func aPauseShorterThanTheIdleTimeoutIsFineAndALongerOneFails() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        let patient = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?idleTimeout=1")
        for _ in 0..<3 {
            try await patient.write("tick\n")
            try await Task.sleep(for: .milliseconds(400))
        }
        try await patient.closeWrite()
        let fields = try #require(try JSONSerialization.jsonObject(with: Data(try await readAll(patient))) as? [String: Any])
        #expect(fields["bytes"] as? Int == 15, "1.2 s in all, each pause under the 1 s idle timeout")
        try await patient.close()

        // A whole-request limit only when asked for: 0.8 s, with writes every 0.2 s (never idle).
        let limited = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?requestTimeout=0.8")
        let overall = await transportError {
            for _ in 0..<20 {
                try await limited.write("tick\n")
                try await Task.sleep(for: .milliseconds(200))
            }
        }
        #expect(overall?.kind == .timedOut)
        #expect(overall?.message.contains("requestTimeout=") == true, "\(String(describing: overall))")
        try? await limited.close()

        let stalled = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest?idleTimeout=0.3")
        try await stalled.write("start")
        let started = ContinuousClock.now
        let idle = await transportError { _ = try await stalled.read(timeout: .seconds(10)) }
        #expect(idle?.kind == .timedOut)
        #expect(idle?.message.contains("nothing moved for 0.3 s") == true, "\(String(describing: idle))")
        #expect(ContinuousClock.now - started < .seconds(5))
        try? await stalled.close()
    }

    @Test func anEarlyRefusalReachesTheWriterAndASlowReaderGetsTheWholeBody() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        // 4 MiB in one write to a server that reads 16 KiB at a time: it all arrives, in order.
        let slow = try await Transport.connect(to: "http://127.0.0.1:\(port)/slowread")
        try await slow.write([UInt8](repeating: 3, count: 4 << 20))
        try await slow.closeWrite()
        let fields = try #require(try JSONSerialization.jsonObject(with: Data(try await readAll(slow))) as? [String: Any])
        #expect(fields["bytes"] as? Int == 4 << 20)
        try await slow.close()

        // 413 before the body ended: the writer learns the status, not a closed connection.
        let refused = try await Transport.connect(to: "http://127.0.0.1:\(port)/early413")
        let writing = await transportError {
            for _ in 0..<4096 { try await refused.write([UInt8](repeating: 5, count: 65536)) }
            try await refused.closeWrite()
            _ = try await readAll(refused)
        }
        #expect(writing?.message.contains("413") == true, "\(String(describing: writing))")
        try? await refused.close()
    }

    @Test func aServerThatClosesWithoutAnsweringIsAnErrorNotAnEmptyAnswer() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(listener.url.port)
        let serving = Task {
            guard let client = try await listener.accept() else { return }
            // Takes the head and some body, then ends its side (a proxy's body timeout).
            _ = try await client.read(timeout: .seconds(10))
            try await client.closeWrite()
            while try await client.read(timeout: .seconds(10)) != nil {}
            try await client.close()
        }
        let connection = try await Transport.connect(to: "http://127.0.0.1:\(port)/ingest")
        // The writer or the reader hears it, whichever comes after the server's end.
        let ended = await transportError {
            try await connection.write("data")
            try await connection.closeWrite()
            _ = try await readAll(connection)
        }
        #expect(ended?.kind == .disconnected)
        #expect(ended?.message.contains("before answering") == true, "\(String(describing: ended))")
        #expect(connection.metadata.extra["http.status"] == nil)
        try? await connection.close()
        _ = await serving.result
        try await listener.close()
    }

    @Test func httpsChecksTheServerAndStreamsTheBody() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await httpPeer(secure: true)
        defer { server.kill() }
        let untrusted = await transportError { _ = try await Transport.connect(to: "https://localhost:\(port)/ingest") }
        #expect(untrusted?.message.contains("ca=") == true, "\(String(describing: untrusted))")
        let connection = try await Transport.connect(to: "https://localhost:\(port)/ingest?ca=\(ca)")
        try await connection.write([UInt8](repeating: 9, count: 1 << 20))
        try await connection.closeWrite()
        let fields = try #require(try JSONSerialization.jsonObject(with: Data(try await readAll(connection))) as? [String: Any])
        #expect(fields["bytes"] as? Int == 1 << 20)
        #expect(connection.metadata.extra["tls.version"] != nil)
        try await connection.close()
    }

    @Test func badRequestsAreRefusedBeforeAnyIO() async throws {
        let method = await transportError { _ = try await Transport.connect(to: "http://127.0.0.1:1/?method=post%20x") }
        #expect(method?.kind == .invalidURL)
        // The parser refuses control characters in a URL's text; a URL made from parts reaches the
        // plugin's own check.
        let parsed = await transportError { _ = try await Transport.connect(to: "http://127.0.0.1:1/?authorization=a%0D%0AX-Evil:%201") }
        #expect(parsed?.kind == .invalidURL)
        let made = TransportURL(scheme: "http", host: "127.0.0.1", port: 1, query: [("authorization", "a\r\nX-Evil: 1")])
        let injected = await transportError { _ = try await Transport.registry.connect(to: made) }
        #expect(injected?.kind == .invalidURL)
        #expect(injected?.message.contains("line break") == true, "\(String(describing: injected))")
        let wsMade = TransportURL(scheme: "ws", host: "127.0.0.1", port: 1, query: [("origin", "a\nb")])
        let wsInjected = await transportError { _ = try await Transport.registry.connect(to: wsMade) }
        #expect(wsInjected?.kind == .invalidURL)

        // Not an HTTP server: a program that speaks first, something else.
        let (talker, talking) = try await sshLikeServer()
        let talkerPort = try #require(talker.url.port)
        let connection = try await Transport.connect(to: "http://127.0.0.1:\(talkerPort)/")
        let notHTTP = await transportError { _ = try await readAll(connection) }
        #expect(notHTTP?.kind == .protocolError)
        #expect(notHTTP?.message.contains("not HTTP/1.1") == true, "\(String(describing: notHTTP))")
        try? await connection.close()
        talking.cancel()
        try await talker.close()
    }
}
