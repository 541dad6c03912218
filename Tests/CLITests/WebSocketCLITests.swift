import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// The tool over WebSocket and HTTP, against python websockets and aiohttp
/// (Tests/TransportKitTests/Peers/ws_peer.py, http_peer.py).
@Suite("transportkit connect and bridge with ws:// and http://", .serialized)
struct WebSocketCLITests {
    static let peer = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
        .appendingPathComponent("../TransportKitTests/Peers/ws_peer.py").standardized.path

    /// Runs `body` with the port of a python peer started with `arguments` and port 0; the peer
    /// prints "ready PORT" once it listens on the port it chose.
    static func withPeer(_ arguments: [String], _ body: (Int) async throws -> Void) async throws {
        try await TestSupport.withPeer(arguments, body)
    }

    /// Runs `body` with the port of a python websockets server (ws_peer.py serve).
    func withServer(_ body: (Int) async throws -> Void) async throws {
        try await Self.withPeer([Self.peer, "serve", "0"], body)
    }

    @Test func connectSendsLinesAsTextMessagesAndPrintsEachMessageOnALine() async throws {
        try await withServer { port in
            let text = try await CLI.run(["connect", "--text", "ws://127.0.0.1:\(port)/echo"], stdin: Array("one\nzwei über\r\nlast".utf8))
            #expect(text.status == 0, "\(text.stderr)")
            #expect(text.text == "one\nzwei über\nlast\n")
            #expect(text.stderr.isEmpty, "\(text.stderr)")

            // Without --text each chunk is a binary message, and payloads pass untouched.
            let bytes = try await CLI.run(["connect", "ws://127.0.0.1:\(port)/echo"], stdin: [0, 1, 2, 0xFF])
            #expect(bytes.status == 0, "\(bytes.stderr)")
            #expect(bytes.stdout == [0, 1, 2, 0xFF])

            // A close with a code other than 1000 is an error that names it.
            let closed = try await CLI.run(["connect", "ws://127.0.0.1:\(port)/close4000"], stdin: [])
            #expect(closed.status == 1)
            #expect(closed.stderr.contains("4000") && closed.stderr.contains("custom reason"), "\(closed.stderr)")
        }
    }

    @Test func connectStreamsStandardInputAsARequestBodyAndPrintsTheResponse() async throws {
        try await Self.withPeer([Self.peer.replacingOccurrences(of: "ws_peer.py", with: "http_peer.py"), "0"]) { port in
            try await upload(port)
        }
    }

    func upload(_ port: Int) async throws {
        let body = [UInt8](repeating: 0x41, count: 300_000)
        let upload = try await CLI.run(["connect", "http://127.0.0.1:\(port)/ingest?contentType=text/plain"], stdin: body)
        #expect(upload.status == 0, "\(upload.stderr)")
        #expect(upload.text.contains("\"bytes\": 300000") && upload.text.contains("\"chunked\": true"), "\(upload.text)")
        let refused = try await CLI.run(["connect", "http://127.0.0.1:\(port)/reject401"], stdin: Array("x".utf8))
        #expect(refused.status == 1)
        #expect(refused.stderr.contains("401 Unauthorized") && refused.stderr.contains("authorization="), "\(refused.stderr)")
    }

    @Test func aBridgeFrontsAWebSocketServiceForAPlainTCPClient() async throws {
        try await withServer { port in
            let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0", "ws://127.0.0.1:\(port)/echo"])
            defer { bridge.signal(SIGTERM) }
            let url = try #require(await HostileUseTests.listeningURL(of: bridge))
            let client = try await Transport.connect(to: url)
            try await client.write("bytes in, bytes out\n")
            let echoed = try await client.readFrame(.delimiter("\n"), timeout: .seconds(10))
            #expect(echoed.map { String(decoding: $0, as: UTF8.self) } == "bytes in, bytes out")
            try await client.close()
        }
    }

    @Test func textOnAByteStreamIsRefused() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = listener.url.port ?? 0
        let accepting = Task { try await listener.accept() }
        let refused = try await CLI.run(["connect", "--text", "tcp://127.0.0.1:\(port)"], stdin: Array("hi\n".utf8))
        #expect(refused.status != 0)
        #expect(refused.stderr.contains("--text") && refused.stderr.contains("byte stream"), "\(refused.stderr)")
        accepting.cancel()
        try await listener.close()
    }

    @Test func aBridgeSharesATargetWithWebSocketClientsAndCautionsAboutBrowsers() async throws {
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "ws://127.0.0.1:0/tty", "loop://"])
        defer { bridge.signal(SIGTERM) }
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        #expect(bridge.stderrLines.contains { $0.contains("\"warning\"") && $0.contains("any web page") && $0.contains("origins=") },
                "\(bridge.stderrLines)")
        let client = try await Transport.connect(to: url)
        try await client.writeMessage(.text("through the bridge"))
        let echoed = try await client.nextMessage(timeout: .seconds(10))
        #expect(echoed?.bytes == Array("through the bridge".utf8), "loop:// returns the bytes, as binary messages")
        try await client.close()

        let restricted = try CLI.Running(["bridge", "--json", "--listen", "ws://127.0.0.1:0/tty?origins=http://localhost:8000", "loop://"])
        defer { restricted.signal(SIGTERM) }
        _ = try #require(await HostileUseTests.listeningURL(of: restricted))
        #expect(!restricted.stderrLines.contains { $0.contains("any web page") }, "\(restricted.stderrLines)")
    }
}
