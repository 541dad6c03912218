import Foundation
import Glibc
import NIOCore
import TestSupport
import Testing
@_spi(Plugins) @testable import TransportKit

/// The WebSocket peers of Peers/ws_peer.py (python3-websockets, and raw sockets for the frames no
/// correct implementation sends) and Peers/ws_client.js (node ws).
enum WebSocketPeers {
    static let folder = URL(fileURLWithPath: #filePath).deletingLastPathComponent().appendingPathComponent("Peers").path

    /// python3-websockets serving the paths ws_peer.py describes; wss with a trustme certificate.
    static func server(secure: Bool = false) async throws -> (Peer, Int) {
        var arguments = ["/usr/bin/python3", "\(folder)/ws_peer.py", "serve", "0"]
        if secure { arguments += [await Certificates.path("cert.pem"), await Certificates.path("key.pem")] }
        return try await started(Peer(arguments))
    }

    /// A one-connection raw server that answers the upgrade and then sends `name`'s frames.
    static func raw(_ name: String) async throws -> (Peer, Int) {
        try await started(Peer(["/usr/bin/python3", "\(folder)/ws_peer.py", "raw", "0", name]))
    }

    /// The peer and the port it chose itself ("ready PORT"): no port freed by a test and taken by
    /// another in between.
    static func started(_ peer: Peer) async throws -> (Peer, Int) {
        let line = try await peer.waitForLine("ready")
        guard let port = line.split(separator: " ").last.flatMap({ Int($0) }) else {
            throw TransportError(.protocolError, "the peer said '\(line)', not 'ready PORT'")
        }
        return (peer, port)
    }
}

extension Peer {
    /// Waits until the peer's output has a whole line (its newline written) that starts with
    /// `prefix`; returns that line. A line still being written ("close" of "close 1002") is not
    /// taken: python may write one print in several pieces.
    @discardableResult
    func waitForLine(_ prefix: String, seconds: Double = 10) async throws -> String {
        let limit = ContinuousClock.now + .seconds(seconds)
        while ContinuousClock.now < limit {
            let complete = output.split(separator: "\n", omittingEmptySubsequences: false).dropLast()
            if let line = complete.first(where: { $0.hasPrefix(prefix) }) { return String(line) }
            if !process.isRunning, !output.contains(prefix) { break }
            try await Task.sleep(for: .milliseconds(20))
        }
        throw TransportError(.timedOut, "\(process.arguments ?? []) printed no line starting with '\(prefix)': \(output)")
    }
}

/// A server that speaks first, and not HTTP (an SSH server on the port), with the task that serves it.
func sshLikeServer() async throws -> (Listener, Task<Void, any Error>) {
    let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
    let serving = Task {
        while let client = try await listener.accept() {
            try? await client.write("SSH-2.0-OpenSSH_9.2\r\n")
            try? await Task.sleep(for: .seconds(1))
            try? await client.close()
        }
    }
    return (listener, serving)
}

/// The error `body` throws, as a TransportError.
func transportError(_ body: () async throws -> Void) async -> TransportError? {
    do {
        try await body()
        return nil
    } catch let error as TransportError {
        return error
    } catch {
        Issue.record("not a TransportError: \(error)")
        return nil
    }
}

@Suite("ws:// and wss:// clients against python websockets", .serialized)
struct WebSocketClientTests {

    @Test func textAndBinaryMessagesKeepTheirKindAndBytesAreBinaryMessages() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/echo")
        #expect(connection.carriesMessages)
        try await connection.writeMessage(.text("héllo"))
        let text = try await connection.nextMessage(timeout: .seconds(10))
        #expect(text?.kind == .text)
        #expect(text?.text == "héllo")
        try await connection.writeMessage(.binary([0, 1, 2]))
        let binary = try await connection.nextMessage(timeout: .seconds(10))
        #expect(binary?.kind == .binary)
        #expect(binary?.bytes == [0, 1, 2])
        try await connection.write("plain bytes")
        #expect(try await connection.readMessage(timeout: .seconds(10)) == Array("plain bytes".utf8))
        // The default limit takes a message of exactly 1 MiB, in whatever frames it came.
        let big = [UInt8](repeating: 0x5A, count: 1 << 20)
        try await connection.writeMessage(.binary(big))
        #expect(try await connection.readMessage(timeout: .seconds(10)) == big)
        // An empty message is a message.
        try await connection.writeMessage(.text(""))
        let empty = try await connection.nextMessage(timeout: .seconds(10))
        #expect(empty?.kind == .text && empty?.payload.readableBytes == 0)
        try await connection.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func theServersQueryGoesThroughAndTheSchemesOptionsDoNot() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let url = "ws://127.0.0.1:\(port)/headers?token=a%20b&subprotocols=chat.v1,chat.v0&origin=http://o.example"
            + "&authorization=Bearer%20t&cookie=s%3D1&server.origin=z&maxMessageSize=4096"
        let connection = try await Transport.connect(to: url)
        let reply = try #require(try await connection.nextMessage(timeout: .seconds(10))?.text)
        let fields = try #require(try JSONSerialization.jsonObject(with: Data(reply.utf8)) as? [String: Any])
        #expect(fields["path"] as? String == "/headers?token=a%20b&origin=z")
        #expect(fields["origin"] as? String == "http://o.example")
        #expect(fields["authorization"] as? String == "Bearer t")
        #expect(fields["cookie"] as? String == "s=1")
        #expect(fields["subprotocol"] as? String == "chat.v1")
        #expect(connection.metadata.extra["ws.subprotocol"] == "chat.v1")
        try await connection.close()
    }

    @Test func aRefusedUpgradeSaysWhatTheServerSaidAndWhatToDo() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let unauthorized = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(port)/reject401") }
        #expect(unauthorized?.kind == .permissionDenied)
        #expect(unauthorized?.message.contains("401 Unauthorized") == true && unauthorized?.message.contains("token required") == true
                && unauthorized?.message.contains("authorization=") == true, "\(String(describing: unauthorized))")
        let forbidden = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(port)/reject403") }
        #expect(forbidden?.kind == .permissionDenied)
        #expect(forbidden?.message.contains("403 Forbidden") == true, "\(String(describing: forbidden))")
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func aServerThatIsNotAWebSocketServerIsNamedAsSuch() async throws {
        let (talker, talking) = try await sshLikeServer()
        let talkerPort = try #require(talker.url.port)
        let notHTTP = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(talkerPort)/") }
        #expect(notHTTP?.kind == .protocolError)
        #expect(notHTTP?.message.contains("not HTTP") == true, "\(String(describing: notHTTP))")
        talking.cancel()
        try await talker.close()

        // Accepts and never answers: the connect's one deadline covers the upgrade.
        let silent = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let silentPort = try #require(silent.url.port)
        let holding = Task { () -> [Connection] in
            var held: [Connection] = []
            while let client = try await silent.accept() { held.append(client) }
            return held
        }
        let started = ContinuousClock.now
        let timedOut = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(silentPort)/?timeout=0.5") }
        #expect(timedOut?.kind == .timedOut, "\(String(describing: timedOut))")
        #expect(ContinuousClock.now - started < .seconds(5))
        #expect(await eventually(5) { Support.openSockets(port: silentPort) <= 1 }, "the client's socket is closed; the server's may linger")
        holding.cancel()
        try await silent.close()

        // An HTTP server without WebSocket: our own listener on another path answers 404. (A
        // listener takes a connection, and answers its upgrade, when accept() is waiting.)
        let listener = try await Transport.listen(on: "ws://127.0.0.1:0/tty")
        let port = try #require(listener.url.port)
        let accepting = WebSocketListenerTests.echo(listener)
        defer { accepting.cancel() }
        let notFound = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(port)/other") }
        #expect(notFound?.kind == .notFound)
        #expect(notFound?.message.contains("404") == true && notFound?.message.contains("/tty") == true, "\(String(describing: notFound))")
        try await listener.close()
    }

    @Test func theServersCloseCodeAndReasonAreTheReadersError() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/close4000")
        let closed = await transportError { _ = try await connection.nextMessage(timeout: .seconds(10)) }
        #expect(closed?.kind == .disconnected)
        #expect(closed?.message.contains("4000") == true && closed?.message.contains("custom reason") == true, "\(String(describing: closed))")
        try? await connection.close()

        let normal = try await Transport.connect(to: "ws://127.0.0.1:\(port)/bye")
        #expect(try await normal.nextMessage(timeout: .seconds(10))?.text == "bye")
        #expect(try await normal.nextMessage(timeout: .seconds(10)) == nil, "a 1000 close is the end of the stream")
        try await normal.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    /// RFC 6455's cases, each from a raw server: what the client must answer with.
    static let violations: [(name: String, code: Int, words: String)] = [
        ("masked", 1002, "masked frame"),
        ("rsv1", 1002, "reserved bits"),
        ("opcode3", 1002, "reserved opcode 3"),
        ("badutf8", 1007, "not valid UTF-8"),
        ("fragmentedping", 1002, "fragmented control frame"),
        ("longping", 1002, "longer than 125"),
        ("orphancontinuation", 1002, "continuation frame"),
        ("newduringfragment", 1002, "before finishing"),
        ("toobig", 1009, "over the limit of 1024"),
        ("toobigfragments", 1009, "over the limit of 1024"),
        ("closecode999", 1002, "code 999"),
        ("close1byte", 1002, "1-byte payload"),
    ]

    @Test(arguments: violations.indices)
    func aProtocolViolationClosesWithTheCodeTheRFCRequires(_ index: Int) async throws {
        let violation = Self.violations[index]
        let (server, port) = try await WebSocketPeers.raw(violation.name)
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/?maxMessageSize=1024")
        let failure = await transportError {
            while try await connection.nextMessage(timeout: .seconds(10)) != nil {}
        }
        #expect(failure?.kind == .protocolError, "\(violation.name): \(String(describing: failure))")
        #expect(failure?.message.contains(violation.words) == true, "\(violation.name): \(String(describing: failure))")
        #expect(failure?.message.contains("\(violation.code)") == true)
        #expect(try await server.waitForLine("close") == "close \(violation.code)", "\(violation.name): \(server.output)")
        try? await connection.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func fragmentsWithAPingBetweenThemMakeOneMessageAndThePingIsAnswered() async throws {
        let (server, port) = try await WebSocketPeers.raw("fragmented")
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/")
        let first = try await connection.nextMessage(timeout: .seconds(10))
        #expect(first?.kind == .text && first?.text == "Héllo", "a UTF-8 character split across frames is fine")
        let empty = try await connection.nextMessage(timeout: .seconds(10))
        #expect(empty?.kind == .binary && empty?.payload.readableBytes == 0)
        #expect(try await connection.nextMessage(timeout: .seconds(10)) == nil)
        #expect(try await server.waitForLine("pong") == "pong")
        #expect(try await server.waitForLine("close") == "close 1000", "the client answers the close with its code")
        try await connection.close()
    }

    @Test func whatCameWithThe101IsReadEvenWhenTheServerEndsAtOnce() async throws {
        // 101, a message and a close frame, then FIN, in one write: nothing is lost to the swap of
        // the HTTP decoder for the frame decoder.
        let (burst, burstPort) = try await WebSocketPeers.raw("burst")
        defer { burst.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(burstPort)/")
        #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == "first")
        #expect(try await connection.nextMessage(timeout: .seconds(10)) == nil, "a 1000 close, then the end")
        try await connection.close()

        // The same without the close frame: the message, then the abnormal end (1006), not a clean one.
        let (fin, finPort) = try await WebSocketPeers.raw("finwithoutclose")
        defer { fin.kill() }
        let abrupt = try await Transport.connect(to: "ws://127.0.0.1:\(finPort)/")
        #expect(try await abrupt.nextMessage(timeout: .seconds(10))?.text == "first")
        let ended = await transportError { _ = try await abrupt.nextMessage(timeout: .seconds(10)) }
        #expect(ended?.kind == .disconnected)
        #expect(ended?.message.contains("1006") == true, "\(String(describing: ended))")
        try? await abrupt.close()

        // A server that ends its side without answering the upgrade fails the connect at once.
        let (silent, silentPort) = try await WebSocketPeers.raw("silentfin")
        defer { silent.kill() }
        let started = ContinuousClock.now
        let unanswered = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(silentPort)/?timeout=20") }
        #expect(unanswered?.kind == .disconnected, "\(String(describing: unanswered))")
        #expect(ContinuousClock.now - started < .seconds(5))
    }

    @Test func compressedMessagesThatEachEndTheDeflateStreamAllArriveWhole() async throws {
        let (server, port) = try await WebSocketPeers.raw("bfinal")
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/")
        #expect(connection.metadata.extra["ws.extensions"] == "permessage-deflate")
        #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == String(repeating: "one ", count: 50))
        #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == String(repeating: "two ", count: 50))
        #expect(try await connection.nextMessage(timeout: .seconds(10)) == nil)
        try await connection.close()
    }

    @Test func aPeerThatStopsAnsweringPingsIsFoundDead() async throws {
        let (server, port) = try await WebSocketPeers.raw("nopong")
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/?pingInterval=0.2&pingTimeout=0.4")
        let started = ContinuousClock.now
        let failure = await transportError { _ = try await connection.nextMessage(timeout: .seconds(10)) }
        #expect(failure?.kind == .timedOut)
        #expect(failure?.message.contains("keepalive ping") == true, "\(String(describing: failure))")
        #expect(ContinuousClock.now - started < .seconds(5))
        let closeLine = try? await server.waitForLine("close")
        #expect(closeLine == "close 1011", "the peer saw: \(server.output)")
        try? await connection.close()
    }

    @Test func aPeerThatAnswersPingsStaysUpAcrossManyPings() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/echo?pingInterval=0.05&pingTimeout=0.5")
        try await Task.sleep(for: .seconds(1))
        try await connection.writeMessage(.text("still here"))
        #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == "still here")
        try await connection.close()
    }

    @Test func closeWaitsForThePeersCloseFrameOnlyAsLongAsCloseTimeout() async throws {
        let (server, port) = try await WebSocketPeers.raw("noclose")
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/?closeTimeout=0.3")
        let started = ContinuousClock.now
        try? await connection.close()
        let took = ContinuousClock.now - started
        #expect(took >= .milliseconds(250) && took < .seconds(3), "\(took)")
        #expect(try await server.waitForLine("eof") == "eof")
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func thereIsNoHalfCloseAndCloseEndsBothWays() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/echo")
        #expect(!connection.supportsHalfClose)
        let half = await transportError { try await connection.closeWrite() }
        #expect(half?.kind == .unsupported)
        try await connection.writeMessage(.text("still open"))
        #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == "still open")
        try await connection.close()
        let late = await transportError { try await connection.writeMessage(.text("after")) }
        #expect(late?.kind == .misuse)
    }

    @Test func wssVerifiesTheServerAndCarriesMessages() async throws {
        let ca = await Certificates.path("ca.pem")
        let (server, port) = try await WebSocketPeers.server(secure: true)
        defer { server.kill() }
        let untrusted = await transportError { _ = try await Transport.connect(to: "wss://localhost:\(port)/echo") }
        #expect(untrusted?.message.contains("ca=") == true, "\(String(describing: untrusted))")
        let connection = try await Transport.connect(to: "wss://localhost:\(port)/echo?ca=\(ca)")
        try await connection.writeMessage(.text("über TLS"))
        #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == "über TLS")
        #expect(connection.metadata.extra["tls.version"] != nil)
        #expect(connection.metadata.extra["tls.alpn"] == nil || connection.metadata.extra["tls.alpn"] == "http/1.1")
        try await connection.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func permessageDeflateIsNegotiatedAndABombFailsCleanly() async throws {
        let (server, port) = try await WebSocketPeers.server()
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/echo")
        #expect(connection.metadata.extra["ws.extensions"]?.hasPrefix("permessage-deflate") == true, "\(connection.metadata.extra)")
        // Compressible and not: both come back whole, in either direction, message after message
        // (the compressors keep their context between messages).
        let text = String(repeating: "TransportKit ", count: 20_000)
        var random = SystemRandomNumberGenerator()
        let noise = (0..<100_000).map { _ in UInt8.random(in: 0...255, using: &random) }
        for _ in 0..<3 {
            try await connection.writeMessage(.text(text))
            #expect(try await connection.nextMessage(timeout: .seconds(10))?.text == text)
            try await connection.writeMessage(.binary(noise))
            #expect(try await connection.readMessage(timeout: .seconds(10)) == noise)
        }
        try await connection.close()

        let plain = try await Transport.connect(to: "ws://127.0.0.1:\(port)/echo?compression=false")
        #expect(plain.metadata.extra["ws.extensions"] == nil)
        try await plain.writeMessage(.text("uncompressed"))
        #expect(try await plain.nextMessage(timeout: .seconds(10))?.text == "uncompressed")
        try await plain.close()

        // 8 MiB of one letter is a few kilobytes on the wire; the 1 MiB limit applies to what it inflates to.
        let bomb = try await Transport.connect(to: "ws://127.0.0.1:\(port)/big=8388608")
        let failure = await transportError { _ = try await bomb.nextMessage(timeout: .seconds(10)) }
        #expect(failure?.kind == .protocolError)
        #expect(failure?.message.contains("inflates past the limit of 1048576") == true, "\(String(describing: failure))")
        try? await bomb.close()
        #expect(await eventually(5) { Support.openSockets(port: port) == 0 })
    }

    @Test func aNodeWsServerEchoesBothKindsCompressed() async throws {
        let (server, port) = try await WebSocketPeers.started(
            Peer(["node", "\(WebSocketPeers.folder)/ws_server.js", "0"], environment: ["NODE_PATH": "/usr/share/nodejs"]))
        defer { server.kill() }
        let connection = try await Transport.connect(to: "ws://127.0.0.1:\(port)/node?k=v")
        #expect(connection.metadata.extra["ws.extensions"]?.contains("server_no_context_takeover") == true, "\(connection.metadata.extra)")
        for round in 0..<3 {
            try await connection.writeMessage(.text("round \(round) ü"))
            let text = try await connection.nextMessage(timeout: .seconds(10))
            #expect(text?.kind == .text && text?.text == "round \(round) ü")
            try await connection.writeMessage(.binary([UInt8](repeating: UInt8(round), count: 5000)))
            let binary = try await connection.nextMessage(timeout: .seconds(10))
            #expect(binary?.kind == .binary && binary?.bytes == [UInt8](repeating: UInt8(round), count: 5000))
        }
        try await connection.close()
        #expect(try await server.waitForLine("closed") == "closed 1000")
        #expect(server.output.contains("path /node?k=v extensions permessage-deflate"), "\(server.output)")
    }

    @Test func optionsThatAModeDoesNotUseAreRefused() async throws {
        let listenWithClientOption = await transportError { _ = try await Transport.listen(on: "ws://127.0.0.1:0/?origin=http://x") }
        #expect(listenWithClientOption?.kind == .invalidURL)
        let listenWithQuery = await transportError { _ = try await Transport.listen(on: "ws://127.0.0.1:0/?token=1") }
        #expect(listenWithQuery?.kind == .invalidURL)
        #expect(listenWithQuery?.message.contains("token") == true, "\(String(describing: listenWithQuery))")
        let connectWithListenerOption = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:1/?origins=http://x") }
        #expect(connectWithListenerOption?.kind == .invalidURL)
        let tooSmall = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:1/?maxMessageSize=10") }
        #expect(tooSmall?.kind == .invalidURL)
    }
}

@Suite("ws:// and wss:// listeners against python websockets and node ws", .serialized)
struct WebSocketListenerTests {

    /// Echoes every message of every client with its kind, until the listener closes.
    static func echo(_ listener: Listener) -> Task<Void, any Error> {
        Task {
            try await withThrowingTaskGroup(of: Void.self) { group in
                while let client = try await listener.accept() {
                    group.addTask {
                        while let message = try? await client.nextMessage() { try? await client.writeMessage(message) }
                        try? await client.close()
                    }
                }
                group.cancelAll()
            }
        }
    }

    @Test func pythonAndNodeClientsTalkToAListenerAndKeepTheirKinds() async throws {
        let listener = try await Transport.listen(on: "ws://127.0.0.1:0/tty?subprotocols=chat.v1")
        let port = try #require(listener.url.port)
        let echoing = Self.echo(listener)
        defer { echoing.cancel() }

        let python = try Peer(["/usr/bin/python3", "\(WebSocketPeers.folder)/ws_peer.py", "client", "ws://127.0.0.1:\(port)/tty?x=1"])
        #expect(try await python.waitForLine("closed") == "closed 1000", "\(python.output)")
        #expect(python.output.contains("subprotocol chat.v1"))
        #expect(python.output.contains("extensions permessage-deflate"), "the listener accepts python's offer: \(python.output)")
        #expect(python.output.contains("reply str text é"), "\(python.output)")
        #expect(python.output.contains("reply bytes 000102"), "\(python.output)")

        let node = try Peer(["node", "\(WebSocketPeers.folder)/ws_client.js", "ws://127.0.0.1:\(port)/tty"], environment: ["NODE_PATH": "/usr/share/nodejs"])
        #expect(try await node.waitForLine("closed") == "closed 1000", "\(node.output)")
        #expect(node.output.contains("text from node false"), "\(node.output)")
        #expect(node.output.contains("binary 0a0b true"), "\(node.output)")

        let wrongPath = try Peer(["/usr/bin/python3", "\(WebSocketPeers.folder)/ws_peer.py", "client", "ws://127.0.0.1:\(port)/other"])
        Peer.waitForExit(wrongPath.process)
        #expect(wrongPath.output.contains("HTTP 404"), "\(wrongPath.output)")
        try await listener.close()
    }

    @Test func aPlainHTTPRequestGets426AndAForeignOriginGets403() async throws {
        let listener = try await Transport.listen(on: "ws://127.0.0.1:0/?origins=http://good.example")
        let port = try #require(listener.url.port)
        // A listener takes a connection, and answers its upgrade, when accept() is waiting.
        let accepting = Task { try await listener.accept() }
        let plain = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        try await plain.write("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        let status = try await plain.readFrame(.delimiter("\r\n"), timeout: .seconds(10))
        #expect(status.map { String(decoding: $0, as: UTF8.self) } == "HTTP/1.1 426 Upgrade Required")
        try await plain.close()

        let foreign = await transportError { _ = try await Transport.connect(to: "ws://127.0.0.1:\(port)/?origin=http://evil.example") }
        #expect(foreign?.kind == .permissionDenied)
        #expect(foreign?.message.contains("403") == true, "\(String(describing: foreign))")
        let good = try await Transport.connect(to: "ws://127.0.0.1:\(port)/?origin=http://good.example")
        let accepted = try #require(try await accepting.value)
        #expect(accepted.metadata.extra["ws.origin"] == "http://good.example")
        try await good.close()
        try await accepted.close()
        try await listener.close()
    }

    static let violations: [(name: String, code: Int)] = [("unmasked", 1002), ("toobig", 1009), ("badutf8", 1007), ("rsv2", 1002)]

    @Test(arguments: violations.indices)
    func aClientsProtocolViolationGetsTheCodeTheRFCRequires(_ index: Int) async throws {
        let violation = Self.violations[index]
        let listener = try await Transport.listen(on: "ws://127.0.0.1:0/?maxMessageSize=1024")
        let port = try #require(listener.url.port)
        let client = try Peer(["/usr/bin/python3", "\(WebSocketPeers.folder)/ws_peer.py", "rawclient", "\(port)", "/", violation.name])
        let accepted = try #require(try await listener.accept())
        let failure = await transportError { while try await accepted.nextMessage(timeout: .seconds(10)) != nil {} }
        #expect(failure?.kind == .protocolError, "\(violation.name): \(String(describing: failure))")
        #expect(try await client.waitForLine("close") == "close \(violation.code)", "\(violation.name): \(client.output)")
        try? await accepted.close()
        try await listener.close()
    }

    @Test func aWssListenerServesAPythonClientThatVerifiesIt() async throws {
        let cert = await Certificates.path("cert.pem")
        let key = await Certificates.path("key.pem")
        let ca = await Certificates.path("ca.pem")
        let listener = try await Transport.listen(on: "wss://127.0.0.1:0/?cert=\(cert)&key=\(key)&subprotocols=chat.v1")
        #expect(listener.exposure?.reach == .thisMachine)
        let port = try #require(listener.url.port)
        let echoing = Self.echo(listener)
        defer { echoing.cancel() }
        let python = try Peer(["/usr/bin/python3", "\(WebSocketPeers.folder)/ws_peer.py", "client", "wss://localhost:\(port)/", ca])
        #expect(try await python.waitForLine("closed") == "closed 1000", "\(python.output)")
        #expect(python.output.contains("reply str text é"), "\(python.output)")
        try await listener.close()
    }
}
