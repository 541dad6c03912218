import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// `transportkit connect reconnect+URL` and `bridge … reconnect+URL` as a user runs them: a server
/// that drops the tool's connection, standard input left open, a status line per event, data from
/// the next connection, and a signal to end it.
@Suite("transportkit with reconnect+URL")
struct ReconnectCLITests {
    static let quick = "reconnect.initialDelay=0.05&reconnect.jitter=0"

    @Test func connectKeepsRunningAcrossALossWithAStatusLinePerEvent() async throws {
        let server = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let port = try #require(server.url.port)
        let running = try CLI.Running(["connect", "reconnect+tcp://127.0.0.1:\(port)?\(Self.quick)"])
        defer { running.signal(SIGKILL) }
        let first = try #require(try await server.accept())
        try await first.write("one\n")
        try await first.close()
        let second = try #require(try await server.accept())
        try await second.write("two\n")
        running.send(Array("typed after the loss\n".utf8))
        #expect(try await second.readLine(timeout: .seconds(10)) == "typed after the loss", "writes go to the next connection")
        #expect(await eventually(10) { running.stdoutText == "one\ntwo\n" }, "\(running.stdoutText)")
        #expect(await eventually(10) { running.stderrLines.contains { $0.contains("connected again (connection 2)") } }, "\(running.stderrLines)")
        #expect(running.stderrLines.contains { $0.hasPrefix("transportkit: disconnected: the stream ended (next attempt in 0.05 s)") },
                "\(running.stderrLines)")
        running.signal(SIGINT)
        let result = await running.wait(timeout: 15)
        #expect(result.status == 130, "\(result.stderr)")
        try await second.close()
        try await server.close()
    }

    @Test func theBridgesTargetReconnectsAndTheClientStays() async throws {
        let device = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let devicePort = try #require(device.url.port)
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0", "reconnect+tcp://127.0.0.1:\(devicePort)?\(Self.quick)"])
        defer { bridge.signal(SIGKILL) }
        let url = try #require(await HostileUseTests.listeningURL(of: bridge), "\(bridge.stderrLines)")
        let client = try await Transport.connect(to: url)
        let first = try #require(try await device.accept())
        try await first.write("one\n")
        #expect(try await client.readLine(timeout: .seconds(10)) == "one")
        try await first.close()   // the device goes; the bridge's target connects again
        let second = try #require(try await device.accept())
        try await second.write("two\n")
        #expect(try await client.readLine(timeout: .seconds(10)) == "two", "the client stayed connected")
        try await client.write("back\n")
        #expect(try await second.readLine(timeout: .seconds(10)) == "back")
        #expect(await eventually(10) {
            bridge.stderrLines.contains { line in
                let object = try? JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: String]
                return object?["event"] == "target" && object?["state"] == "connected again (connection 2)"
            }
        }, "\(bridge.stderrLines)")
        try await client.close()
        try await second.close()
        bridge.signal(SIGTERM)
        _ = await bridge.wait(timeout: 15)
        try await device.close()
    }
}
