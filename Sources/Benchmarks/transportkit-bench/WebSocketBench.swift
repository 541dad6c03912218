// WebSocket figures (Scripts/ws-bench runs them beside python websockets' client against one echo
// server): 32-byte text messages, one round trip at a time, and 1 MiB binary messages echoed one
// at a time. `ws` goes through TransportKit (ws://, connect, writeMessage, nextMessage); `ws-nio`
// is a plain SwiftNIO client (NIOWebSocket's upgrader and NIOAsyncChannel, no TransportKit), the
// floor this library's layers add to.
//
//   transportkit-bench ws URL ROUNDS MESSAGES
//   transportkit-bench ws-nio HOST PORT ROUNDS MESSAGES

import Foundation
import NIOCore
import NIOHTTP1
import NIOPosix
import NIOWebSocket
import TransportKit

enum WebSocketBench {
    static let small = ByteBuffer(string: String(repeating: "x", count: 32))
    static let large = ByteBuffer(repeating: 0x5A, count: 1 << 20)

    static func report(_ client: String, rounds: Int, roundTrips: Duration, messages: Int, bulk: Duration) {
        let perTrip = roundTrips.seconds / Double(rounds) * 1e6
        let mib = Double(messages) / bulk.seconds
        print(String(format: "%@: 32-byte round trip %.1f µs (%d rounds); 1 MiB messages echoed %.1f MiB/s (%d messages)",
                     client, perTrip, rounds, mib, messages))
    }

    /// TransportKit's client.
    static func run() async throws {
        let arguments = CommandLine.arguments
        guard arguments.count >= 5, let rounds = Int(arguments[3]), let messages = Int(arguments[4]) else {
            throw TransportError.misuse("usage: transportkit-bench ws URL ROUNDS MESSAGES")
        }
        let connection = try await Transport.connect(to: arguments[2])
        let start = ContinuousClock.now
        for _ in 0..<rounds {
            try await connection.writeMessage(TransportMessage(.text, small))
            guard try await connection.nextMessage() != nil else { throw TransportError(.disconnected, "the server closed") }
        }
        let roundTrips = ContinuousClock.now - start
        let bulkStart = ContinuousClock.now
        for _ in 0..<messages {
            try await connection.writeMessage(TransportMessage(.binary, large))
            guard let echo = try await connection.nextMessage(), echo.payload.readableBytes == large.readableBytes else {
                throw TransportError(.disconnected, "the echo did not come back whole")
            }
        }
        let bulk = ContinuousClock.now - bulkStart
        try await connection.close()
        report("transportkit ws://", rounds: rounds, roundTrips: roundTrips, messages: messages, bulk: bulk)
    }

    enum Upgrade: Sendable {
        case webSocket(NIOAsyncChannel<WebSocketFrame, WebSocketFrame>)
        case refused
    }

    /// A plain SwiftNIO client: the upgrade through NIOTypedWebSocketClientUpgrader, then frames.
    static func runNIO() async throws {
        let arguments = CommandLine.arguments
        guard arguments.count >= 6, let port = Int(arguments[3]), let rounds = Int(arguments[4]), let messages = Int(arguments[5]) else {
            throw TransportError.misuse("usage: transportkit-bench ws-nio HOST PORT ROUNDS MESSAGES")
        }
        let host = arguments[2]
        let upgrade: EventLoopFuture<Upgrade> = try await ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
            .connect(host: host, port: port) { channel in
                channel.eventLoop.makeCompletedFuture {
                    let upgrader = NIOTypedWebSocketClientUpgrader<Upgrade>(maxFrameSize: 1 << 21) { channel, _ in
                        channel.eventLoop.makeCompletedFuture {
                            Upgrade.webSocket(try NIOAsyncChannel<WebSocketFrame, WebSocketFrame>(wrappingChannelSynchronously: channel))
                        }
                    }
                    var headers = HTTPHeaders()
                    headers.add(name: "Host", value: "\(host):\(port)")
                    let configuration = NIOTypedHTTPClientUpgradeConfiguration(
                        upgradeRequestHead: HTTPRequestHead(version: .http1_1, method: .GET, uri: "/", headers: headers),
                        upgraders: [upgrader],
                        notUpgradingCompletionHandler: { channel in channel.eventLoop.makeCompletedFuture { Upgrade.refused } })
                    return try channel.pipeline.syncOperations.configureUpgradableHTTPClientPipeline(
                        configuration: .init(upgradeConfiguration: configuration))
                }
            }
        guard case .webSocket(let channel) = try await upgrade.get() else {
            throw TransportError(.protocolError, "the server refused the upgrade")
        }
        try await channel.executeThenClose { inbound, outbound in
            var frames = inbound.makeAsyncIterator()
            /// The next data message, reassembled (a server may fragment), answering pings.
            func nextMessage() async throws -> Int {
                var size = 0
                while let frame = try await frames.next() {
                    switch frame.opcode {
                    case .ping:
                        try await outbound.write(WebSocketFrame(fin: true, opcode: .pong, maskKey: .random(), data: frame.unmaskedData))
                    case .text, .binary, .continuation:
                        size += frame.length
                        if frame.fin { return size }
                    default:
                        throw TransportError(.disconnected, "the server closed")
                    }
                }
                throw TransportError(.disconnected, "the server closed")
            }
            let start = ContinuousClock.now
            for _ in 0..<rounds {
                try await outbound.write(WebSocketFrame(fin: true, opcode: .text, maskKey: .random(), data: small))
                _ = try await nextMessage()
            }
            let roundTrips = ContinuousClock.now - start
            let bulkStart = ContinuousClock.now
            for _ in 0..<messages {
                try await outbound.write(WebSocketFrame(fin: true, opcode: .binary, maskKey: .random(), data: large))
                guard try await nextMessage() == large.readableBytes else { throw TransportError(.io, "the echo did not come back whole") }
            }
            let bulk = ContinuousClock.now - bulkStart
            var close = ByteBuffer()
            close.writeInteger(UInt16(1000))
            try await outbound.write(WebSocketFrame(fin: true, opcode: .connectionClose, maskKey: .random(), data: close))
            report("plain NIOWebSocket", rounds: rounds, roundTrips: roundTrips, messages: messages, bulk: bulk)
        }
    }
}
