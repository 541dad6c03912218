import Foundation
import Glibc
import NIOCore
import SystemPackage
import TestSupport
import Testing
@_spi(Plugins) @testable import TransportKit

/// Reads a trace file written by spy.
private func trace(_ path: String) -> String {
    (try? String(contentsOfFile: path, encoding: .utf8)) ?? ""
}

@Suite("spy+URL")
struct SpyTests {
    @Test func spyTcpTracesBothDirectionsAndKeepsTheBytesExact() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let file = Support.temporaryPath("spy-tcp") + ".txt"
        defer { unlink(file) }
        let connection = try await Transport.connect(to: "spy+tcp://127.0.0.1:\(raw.port)?noDelay=true&spy.file=\(file)")
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        let payload = Array("hello, spy\n".utf8) + [0x00, 0xFF]
        try await connection.write(payload)
        let echoed = await Support.readSome(peer)
        #expect(echoed == payload, "the peer got the bytes untouched")
        Support.writeAll(peer, Array("reply".utf8))
        #expect(try await connection.read(timeout: .seconds(5)) == Array("reply".utf8))
        _ = Glibc.shutdown(peer, Int32(SHUT_WR))
        #expect(try await connection.read(timeout: .seconds(5)) == nil)
        try await connection.close()
        let text = trace(file)
        #expect(text.contains("OPEN  tcp://127.0.0.1:\(raw.port)?noDelay=true"), "\(text)")
        #expect(text.contains("TX    0000  68 65 6c 6c 6f 2c 20 73  70 79 0a 00 ff"), "\(text)")
        #expect(text.contains("|hello, spy...|"), "\(text)")
        #expect(text.contains("RX    0000  72 65 70 6c 79"), "\(text)")
        #expect(text.contains(" EOF\n"), "\(text)")
        #expect(text.hasSuffix(" CLOSE\n"), "\(text)")
    }

    @Test func spyIsTransparent() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let file = Support.temporaryPath("spy-transparent") + ".txt"
        defer { unlink(file) }
        let spied = try await Transport.connect(to: "spy+tcp://127.0.0.1:\(raw.port)?spy.file=\(file)")
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        #expect(spied.url.scheme == "spy")
        #expect(spied.url.inner?.scheme == "tcp")
        #expect(spied.metadata.remoteAddress?.contains("127.0.0.1") == true, "metadata is the wrapped connection's")
        #expect(spied.supportsHalfClose)
        #expect(spied.preferredExecutor == nil, "the wrapped connection's executor: tcp:// has none")
        for round in 0..<20 {
            try await spied.write("ping \(round)\n")
            let line = await Support.readSome(peer)
            Support.writeAll(peer, line)
            #expect(try await spied.readLine(timeout: .seconds(5)) == "ping \(round)")
        }
        let unix = Support.temporaryPath("spy-executor") + ".sock"
        let listener = try await Transport.listen(on: "unix://\(unix)")
        let spiedUnix = try await Transport.connect(to: "spy+unix://\(unix)?spy.file=\(file)")
        let executor = try #require(spiedUnix.preferredExecutor, "the wrapped unix:// connection's event loop")
        let server = try #require(try await listener.accept())
        // A request/response loop on that executor, through the wrapper.
        try await withTaskExecutorPreference(executor) {
            for round in 0..<20 {
                try await spiedUnix.write("ping \(round)\n")
                let line = try #require(try await server.readLine(timeout: .seconds(5)))
                try await server.write(line + "\n")
                #expect(try await spiedUnix.readLine(timeout: .seconds(5)) == "ping \(round)")
            }
        }
        try await spiedUnix.close()
        try await server.close()
        try await listener.close()
        try await spied.close()
        #expect(await eventually { Support.openSockets(port: raw.port, excluding: [peer]) == 0 }, "closing the wrapper closed the wrapped socket")
    }

    @Test func serialControlCallsAreTracedThroughSpyPty() async throws {
        let file = Support.temporaryPath("spy-pty") + ".txt"
        defer { unlink(file) }
        let connection = try await Transport.connect(to: "spy+pty://?baud=9600&spy.file=\(file)")
        let port = try #require(connection.serialPort, "serialPort reaches through spy")
        try await port.apply(SerialSettings(baudRate: 19200))
        #expect(try await port.settings().baudRate == 19200)
        try await port.flush(.input)
        try await port.sendBreak(duration: .milliseconds(10))
        await expectTransportError(.unsupported) { try await port.setDTR(true) }
        try await connection.close()
        let text = trace(file)
        #expect(text.contains("CTRL  settings 19200 8N1\n"), "\(text)")
        #expect(text.contains("CTRL  settings 19200 8N1 → ok"), "\(text)")
        #expect(text.contains("CTRL  settings? → 19200 8N1"), "\(text)")
        #expect(text.contains("CTRL  flush input → ok"), "\(text)")
        // A timed break is the port's break on, a wait, break off: traced as the two calls.
        #expect(text.contains("CTRL  break on → ok") && text.contains("CTRL  break off → ok"), "\(text)")
        #expect(text.contains("CTRL  DTR on → failed: "), "\(text)")
    }

    @Test func aBreakCancelledDuringItsWaitIsStillReleased() async throws {
        let file = Support.temporaryPath("spy-break") + ".txt"
        defer { unlink(file) }
        let connection = try await Transport.connect(to: "spy+pty://?spy.file=\(file)")
        let port = try #require(connection.serialPort)
        let breaking = Task { try await port.sendBreak(duration: .seconds(30)) }
        #expect(await eventually(5) { trace(file).contains("CTRL  break on → ok") })
        breaking.cancel()
        let ended = await breaking.result
        #expect(throws: CancellationError.self) { try ended.get() }
        #expect(await eventually(5) { trace(file).contains("CTRL  break off → ok") }, "released although cancelled: \(trace(file))")
        try await connection.close()
    }

    @Test func rawModeWritesOnlyTheBytesOfOneDirection() async throws {
        let file = Support.temporaryPath("spy-raw") + ".bin"
        defer { unlink(file) }
        try await Transport.withConnection(to: "spy+loop://?spy.format=raw&spy.direction=rx&spy.file=\(file)") { loop in
            try await loop.write([0x01, 0x02, 0x0A])
            #expect(try await loop.read(timeout: .seconds(5)) == [0x01, 0x02, 0x0A])
            try await loop.write("abc")
            #expect(try await loop.read(timeout: .seconds(5)) == Array("abc".utf8))
        }
        let data = try #require(FileManager.default.contents(atPath: file))
        #expect(Array(data) == [0x01, 0x02, 0x0A] + Array("abc".utf8), "received bytes only, as they passed")
    }

    @Test func messagesStayMessagesThroughSpy() async throws {
        let file = Support.temporaryPath("spy-msg") + ".txt"
        defer { unlink(file) }
        try await Transport.withConnection(to: "spy+loop://?messages=true&maxWrite=8&spy.file=\(file)") { loop in
            #expect(loop.carriesMessages)
            #expect(loop.maximumWriteSize == 8)
            try await loop.write(Array("0123456789".utf8))   // chunked once, before spy sees it
            #expect(try await loop.readMessage(timeout: .seconds(5)) == Array("01234567".utf8))
            #expect(try await loop.readMessage(timeout: .seconds(5)) == Array("89".utf8))
        }
        let lines = trace(file).split(separator: "\n").filter { $0.contains(" TX ") }
        #expect(lines.count == 2, "two transfers traced: \(lines)")
    }

    @Test func aTraceFileThatCannotBeWrittenFailsBeforeAnyIO() async throws {
        let raw = try Support.RawListener()
        defer { raw.close() }
        let error = await expectTransportError(.notFound) {
            try await Transport.connect(to: "spy+tcp://127.0.0.1:\(raw.port)?spy.file=/nonexistent-dir/trace.txt")
        }
        #expect(error?.message.contains("spy.file=") == true)
        #expect(error?.syscall == "open")
        try await Task.sleep(for: .milliseconds(50))
        #expect(Support.openSockets(port: raw.port) == 0, "the wrapped URL was never connected")
    }
}

@Suite("wrapper grammar and composition")
struct CompositionTests {
    @Test("wrapped URLs are validated layer by layer before any I/O", arguments: [
        ("spy://", TransportError.Kind.invalidURL, "wraps another URL"),
        ("spy://host:1", .invalidURL, "wraps another URL"),
        ("tcp+loop://", .invalidURL, "does not wrap other URLs"),
        ("nope+loop://", .unsupportedScheme, "no plugin handles nope://"),
        ("spy+nope://x", .unsupportedScheme, "no plugin handles nope://"),
        ("spy+loop://?spy.bogus=1", .invalidURL, "unknown option 'spy.bogus' (spy accepts: spy.format, spy.direction, spy.file, spy.label, spy.record)"),
        ("spy+loop://?spy.format=hexadecimal", .invalidURL, "option 'spy.format=hexadecimal'"),
        ("spy+loop://?bogus=1", .invalidURL, "invalid loop URL"),
        ("spy+loop://?timeout=abc", .invalidURL, "invalid loop URL"),
        ("spy+loop://?spy.timeout=1", .invalidURL, "unknown option 'spy.timeout'"),
        ("spy+tcp://host", .invalidURL, "a port is required"),
    ])
    func rejected(_ url: String, kind: TransportError.Kind, reason: String) async {
        let error = await expectTransportError(kind) { try await Transport.connect(to: url) }
        #expect(error?.message.contains(reason) == true, "\(error?.message ?? "")")
    }

    @Test func theWrappedURLsTimeoutIsTheOneDeadline() async throws {
        let registry = try TransportRegistry(plugins: Transport.builtInPlugins + [StuckPlugin()])
        let request = try registry.resolve("spy+stuck://?timeout=0.2")
        #expect(request.timeout == .milliseconds(200), "the wrapper takes the wrapped URL's timeout")
        let start = ContinuousClock.now
        let error = await expectTransportError(.timedOut) { try await registry.connect(to: "spy+stuck://?timeout=0.2") }
        // The plugin never returns: ending at all is the deadline's work. The bound is loose, as
        // the suite runs in parallel and under ThreadSanitizer on two cores.
        #expect(ContinuousClock.now - start < .seconds(30))
        #expect(error?.message.contains("took longer than 0.2 s") == true, "\(error?.message ?? "")")
    }

    @Test func aTCPConnectTimesOutOnTheRegistrysDeadlineWithOneMessage() async throws {
        let (listener, fillers) = try await Support.blackHole()
        defer {
            listener.close()
            fillers.forEach { _ = Glibc.close($0) }
        }
        for url in ["tcp://127.0.0.1:\(listener.port)?timeout=0.3", "spy+tcp://127.0.0.1:\(listener.port)?timeout=0.3"] {
            let error = await expectTransportError(.timedOut) { try await Transport.connect(to: url) }
            #expect(error?.message.hasPrefix("connecting to \(url) took longer than 0.3 s") == true, "\(error?.message ?? "")")
        }
        #expect(await eventually { Support.openSockets(port: listener.port, excluding: fillers) == 0 }, "the attempt's socket was closed")
    }

    @Test func withConnectionRunsTheBodyOnTheCallersActor() async throws {
        actor Poller {
            var replies: [[UInt8]] = []
            func poll() async throws {
                // `self` is used inside the body: it runs isolated to this actor.
                let reply = try await Transport.withConnection(to: "loop://") { connection in
                    try await connection.write("status")
                    let reply = try await connection.read() ?? []
                    replies.append(reply)
                    return reply
                }
                #expect(reply == Array("status".utf8))
            }
        }
        let poller = Poller()
        try await poller.poll()
        #expect(await poller.replies == [Array("status".utf8)])
    }
}

/// A length-prefixed message protocol over TCP: its handlers sit in front of the byte handler.
struct LengthPrefixedPlugin: TransportPlugin {
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: "lenmsg", summary: "Messages with a 2-byte length over TCP", grammar: "lenmsg://HOST:PORT",
                                 host: .required, port: .required, portRange: 1...65535, path: .forbidden,
                                 options: [SocketsPlugin.noDelay])) { request in
            try await TCPSocket.connect(request, host: request.host, port: request.port, messages: true) { channel in
                try channel.pipeline.syncOperations.addHandler(ByteToMessageHandler(LengthPrefixDecoder()))
                try channel.pipeline.syncOperations.addHandler(LengthPrefixEncoder())
            }
        }]
    }
}

struct LengthPrefixDecoder: ByteToMessageDecoder {
    typealias InboundOut = ByteBuffer
    mutating func decode(context: ChannelHandlerContext, buffer: inout ByteBuffer) throws -> DecodingState {
        guard let length = buffer.getInteger(at: buffer.readerIndex, as: UInt16.self),
              buffer.readableBytes >= 2 + Int(length) else { return .needMoreData }
        buffer.moveReaderIndex(forwardBy: 2)
        context.fireChannelRead(Self.wrapInboundOut(buffer.readSlice(length: Int(length)) ?? ByteBuffer()))
        return .continue
    }
}

final class LengthPrefixEncoder: ChannelOutboundHandler, Sendable {
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer
    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        var message = Self.unwrapOutboundIn(data)
        var framed = context.channel.allocator.buffer(capacity: message.readableBytes + 2)
        framed.writeInteger(UInt16(message.readableBytes))
        framed.writeBuffer(&message)
        context.write(Self.wrapOutboundOut(framed), promise: promise)
    }
}

@Suite("channel handlers in front of the byte handler")
struct FrontHandlerTests {
    @Test func aPluginsCodecTurnsTCPIntoMessages() async throws {
        let registry = try TransportRegistry(plugins: [LengthPrefixedPlugin()])
        let raw = try Support.RawListener()
        defer { raw.close() }
        let connection = try await registry.connect(to: "lenmsg://127.0.0.1:\(raw.port)")
        let peer = await raw.accept()
        defer { _ = Glibc.close(peer) }
        #expect(connection.carriesMessages)
        // Two messages in one TCP segment, and one split over two: the codec cuts them.
        Support.writeAll(peer, [0, 5] + Array("hello".utf8) + [0, 0] + [0, 3, 0x61])
        #expect(try await connection.readMessage(timeout: .seconds(5)) == Array("hello".utf8))
        #expect(try await connection.readMessage(timeout: .seconds(5)) == [])
        try await Task.sleep(for: .milliseconds(20))
        Support.writeAll(peer, [0x62, 0x63])
        #expect(try await connection.readMessage(timeout: .seconds(5)) == Array("abc".utf8))
        try await connection.writeMessage(Array("xyz".utf8))
        try await connection.closeWrite()
        #expect(await Support.readAll(peer) == [0, 3] + Array("xyz".utf8))
        try await connection.close()
    }
}
