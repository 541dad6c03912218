// WebSocket (RFC 6455) after the opening handshake: frames to messages and back, control frames,
// the keepalive ping, the closing handshake, and the checks the RFC requires of an endpoint
// (masking, reserved bits, opcodes, fragmentation, sizes, UTF-8), each failing with its close code.
// SwiftNIO's WebSocketFrameDecoder and WebSocketFrameEncoder read and write the frames.

import NIOCore
import NIOWebSocket
@_spi(Plugins) import TransportKitCore

/// How a WebSocket endpoint behaves once upgraded.
package struct WebSocketConfiguration: Sendable {
    package enum Role: Sendable { case client, server }
    package var role: Role
    /// The largest message taken from the peer (assembled, after decompression).
    package var maxMessageSize: Int
    /// Send a ping this often; `nil`: never.
    package var pingInterval: Duration?
    /// A ping unanswered this long means the peer is gone; `nil`: wait forever.
    package var pingTimeout: Duration?
    /// How long a close waits for the peer's close frame.
    package var closeTimeout: Duration
    /// Names the peer in messages: `ws://host:port/path`.
    package var describing: String

    package init(role: Role, maxMessageSize: Int, pingInterval: Duration?, pingTimeout: Duration?, closeTimeout: Duration, describing: String) {
        self.role = role
        self.maxMessageSize = maxMessageSize
        self.pingInterval = pingInterval
        self.pingTimeout = pingTimeout
        self.closeTimeout = closeTimeout
        self.describing = describing
    }
}

/// RFC 6455's close codes that this side sends or explains.
package enum CloseCode {
    package static let normal: UInt16 = 1000
    package static let goingAway: UInt16 = 1001
    package static let protocolError: UInt16 = 1002
    package static let invalidData: UInt16 = 1007
    package static let policy: UInt16 = 1008
    package static let tooBig: UInt16 = 1009
    package static let internalError: UInt16 = 1011

    /// Codes a peer may send in a close frame (section 7.4; 1012–1014 are IANA-registered).
    package static func isValidReceived(_ code: UInt16) -> Bool {
        switch code {
        case 1000...1003, 1007...1014, 3000...4999: true
        default: false
        }
    }

    package static func name(_ code: UInt16) -> String {
        switch code {
        case 1000: "normal closure"
        case 1001: "going away"
        case 1002: "protocol error"
        case 1003: "unsupported data"
        case 1007: "invalid data"
        case 1008: "policy violation"
        case 1009: "message too big"
        case 1010: "mandatory extension"
        case 1011: "internal error"
        case 1012: "service restart"
        case 1013: "try again later"
        case 1014: "bad gateway"
        default: "application code"
        }
    }
}

/// Turns frames into ``TransportMessage``s for the connection's backend and messages into frames,
/// answers pings, sends keepalive pings, and runs the closing handshake when the connection closes
/// (a close speaks the protocol: the close frame, then the peer's, within ``WebSocketConfiguration/closeTimeout``).
/// It sits in the pipeline from the start and acts once the handshake calls ``start()``.
package final class WebSocketHandler: ChannelDuplexHandler, RemovableChannelHandler {
    package typealias InboundIn = WebSocketFrame
    package typealias InboundOut = TransportMessage
    package typealias OutboundIn = TransportMessage
    package typealias OutboundOut = WebSocketFrame

    package let configuration: WebSocketConfiguration
    /// What the handshake settled, for the connection's metadata.
    package var facts: [String: String] = [:]
    /// permessage-deflate, when the handshake turned it on: this side's compressor and the
    /// decompressor for the peer's messages.
    package var deflate: (compressor: DeflateStream, decompressor: DeflateStream)?

    private var context: ChannelHandlerContext?
    private var started = false
    private var assembling: (kind: TransportMessage.Kind, data: ByteBuffer, compressed: Bool)?
    private var closeSent = false
    private var closeReceived = false
    private var failed = false
    /// The channel's close was passed on.
    private var closing = false
    /// A close() waiting for the peer's close frame.
    private var pendingClose: EventLoopPromise<Void>?
    private var closeTimer: Scheduled<Void>?
    private var pinger: RepeatedTask?
    private var pongTimer: Scheduled<Void>?
    private var pingPayload: ByteBuffer?
    /// The payload of the latest ping not answered yet because the channel was not writable.
    private var pendingPong: ByteBuffer?
    /// `false` between a read's end and the next read the backend asks for: the application is
    /// not taking what arrives, so a pong may sit unread in the kernel.
    private var reading = true
    /// The keepalive ping went out to the kernel; until then it may be queued behind messages.
    private var pingSent = false
    /// The channel drained below its low watermark since the pong deadline was set: bytes move.
    private var drained = false

    package init(_ configuration: WebSocketConfiguration) {
        self.configuration = configuration
    }

    package func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
    }

    package func handlerRemoved(context: ChannelHandlerContext) {
        stopTimers()
        self.context = nil
    }

    /// Turns permessage-deflate on with what the handshake agreed.
    package func useDeflate(_ parameters: DeflateParameters, role: WebSocketConfiguration.Role) throws {
        let ours = role == .client
            ? (bits: parameters.clientMaxWindowBits, reset: parameters.clientNoContextTakeover)
            : (bits: parameters.serverMaxWindowBits, reset: parameters.serverNoContextTakeover)
        let theirsReset = role == .client ? parameters.serverNoContextTakeover : parameters.clientNoContextTakeover
        // The decompressor takes the largest window, which reads any smaller one.
        guard let compressor = DeflateStream.compressor(windowBits: max(9, ours.bits), resetEachMessage: ours.reset),
              let decompressor = DeflateStream.decompressor(windowBits: 15, resetEachMessage: theirsReset) else {
            throw TransportError(.io, "zlib could not set up permessage-deflate (out of memory?)")
        }
        deflate = (compressor, decompressor)
    }

    /// The handshake is done: frames flow from now on, and the keepalive starts.
    package func start() {
        guard let context, !started else { return }
        started = true
        guard let interval = configuration.pingInterval else { return }
        let handler = NIOLoopBound(self, eventLoop: context.eventLoop)
        pinger = context.eventLoop.scheduleRepeatedTask(initialDelay: TimeAmount(interval), delay: TimeAmount(interval)) { _ in
            handler.value.sendKeepalivePing()
        }
    }

    // MARK: Inbound

    package func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = Self.unwrapInboundIn(data)
        guard !closeReceived, !failed else { return }
        // Anything from the peer shows it is alive: the keepalive's deadline is met.
        if pingPayload != nil {
            pingPayload = nil
            pongTimer?.cancel()
            pongTimer = nil
        }
        switch configuration.role {
        case .server where frame.maskKey == nil:
            return fail(CloseCode.protocolError, "sent an unmasked frame, which a client must never do")
        case .client where frame.maskKey != nil:
            return fail(CloseCode.protocolError, "sent a masked frame, which a server must never do")
        default:
            break
        }
        // RSV1 marks a compressed message, on its first frame, once permessage-deflate is on.
        let compressedStart = frame.rsv1 && deflate != nil && (frame.opcode == .text || frame.opcode == .binary)
        if frame.rsv2 || frame.rsv3 || (frame.rsv1 && !compressedStart) {
            return fail(CloseCode.protocolError, "set reserved bits (RSV) that no negotiated extension defines there")
        }
        switch frame.opcode {
        case .text, .binary:
            if assembling != nil {
                return fail(CloseCode.protocolError, "began a new message before finishing the fragmented one")
            }
            let kind: TransportMessage.Kind = frame.opcode == .text ? .text : .binary
            let data = frame.unmaskedData
            guard data.readableBytes <= configuration.maxMessageSize else { return failTooBig(data.readableBytes) }
            if frame.fin {
                deliver(kind, data, compressed: compressedStart)
            } else {
                assembling = (kind, data, compressedStart)
            }
        case .continuation:
            guard var message = assembling else {
                return fail(CloseCode.protocolError, "sent a continuation frame with no fragmented message to continue")
            }
            let more = frame.unmaskedData
            let size = message.data.readableBytes + more.readableBytes
            guard size <= configuration.maxMessageSize else { return failTooBig(size) }
            assembling = nil
            var more2 = more
            message.data.writeBuffer(&more2)
            if frame.fin {
                deliver(message.kind, message.data, compressed: message.compressed)
            } else {
                assembling = message
            }
        case .ping:
            guard !closeSent else { return }
            // A peer that pings faster than it reads gets an answer to its latest ping only
            // (RFC 6455 section 5.5.3), so unsent pongs cannot pile up.
            guard context.channel.isWritable else {
                pendingPong = frame.unmaskedData
                return
            }
            send(WebSocketFrame(fin: true, opcode: .pong, maskKey: mask(), data: frame.unmaskedData), context: context)
        case .pong:
            break   // any frame met the keepalive's deadline, above
        case .connectionClose:
            receivedClose(frame.unmaskedData, context: context)
        default:
            fail(CloseCode.protocolError, "sent a frame with the reserved opcode \(UInt8(webSocketOpcode: frame.opcode))")
        }
    }

    private func deliver(_ kind: TransportMessage.Kind, _ received: ByteBuffer, compressed: Bool) {
        guard let context else { return }
        var data = received
        if compressed, let deflate {
            do {
                data = try deflate.decompressor.decompress(received, limit: configuration.maxMessageSize, allocator: context.channel.allocator)
            } catch {
                switch error {
                case .tooBig:
                    return fail(CloseCode.tooBig, "sent a compressed message that inflates past the limit of \(configuration.maxMessageSize) bytes (maxMessageSize= raises it)")
                case .corrupt(let reason):
                    return fail(CloseCode.invalidData, "sent a compressed message that does not inflate (\(reason))")
                }
            }
        }
        if kind == .text, !Self.isValidUTF8(data) {
            return fail(CloseCode.invalidData, "sent a text message that is not valid UTF-8")
        }
        context.fireChannelRead(Self.wrapInboundOut(TransportMessage(kind, data)))
    }

    /// `size`: what was seen so far; `nil` when the frame decoder refused a frame by its header.
    private func failTooBig(_ size: Int?) {
        let seen = size.map { "a message of at least \($0) bytes" } ?? "a frame"
        fail(CloseCode.tooBig, "sent \(seen), over the limit of \(configuration.maxMessageSize) bytes (maxMessageSize= raises it)")
    }

    package static func isValidUTF8(_ data: ByteBuffer) -> Bool {
        data.readableBytesView.withContiguousStorageIfAvailable { String(validating: $0, as: UTF8.self) != nil }
            ?? (String(validating: Array(data.readableBytesView), as: UTF8.self) != nil)
    }

    /// The peer's close frame: answered with one of ours (the same code), then the TCP connection
    /// ends. A normal close (1000, 1001, none) ends the inbound stream; any other code is an error.
    private func receivedClose(_ payload: ByteBuffer, context: ChannelHandlerContext) {
        var payload = payload
        var code: UInt16?
        var reason = ""
        if payload.readableBytes == 1 {
            return fail(CloseCode.protocolError, "sent a close frame with a 1-byte payload (a code takes 2)")
        }
        if let value = payload.readInteger(as: UInt16.self) {
            guard CloseCode.isValidReceived(value) else {
                return fail(CloseCode.protocolError, "sent a close frame with the code \(value), which RFC 6455 does not allow on the wire")
            }
            code = value
            guard Self.isValidUTF8(payload) else {
                return fail(CloseCode.invalidData, "sent a close frame whose reason is not valid UTF-8")
            }
            reason = String(decoding: payload.readableBytesView, as: UTF8.self)
        }
        closeReceived = true
        assembling = nil
        stopKeepalive()
        if closeSent {
            // Ours went first: the handshake is complete.
            finishClosing(context: context)
            return
        }
        var answer = context.channel.allocator.buffer(capacity: 2)
        if let code { answer.writeInteger(code) }
        closeSent = true
        // The answer goes out before the reader hears of the close: an error makes the backend
        // close the channel.
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        send(WebSocketFrame(fin: true, opcode: .connectionClose, maskKey: mask(), data: answer), context: context).whenComplete { _ in
            bound.value.afterCloseExchanged()
        }
        let normal = code == nil || code == CloseCode.normal || code == CloseCode.goingAway
        if normal {
            context.fireUserInboundEventTriggered(ChannelEvent.inputClosed)
        } else if let code {
            let said = reason.isEmpty ? "" : ": \"\(TransportError.printable(reason))\""
            context.fireErrorCaught(TransportError(.disconnected, "\(configuration.describing) closed the WebSocket with code \(code) (\(CloseCode.name(code)))\(said)"))
        }
    }

    /// Both close frames are out: a server closes the TCP connection now; a client gives the
    /// server the close timeout to do so first (RFC 6455 section 7.1.1).
    private func afterCloseExchanged() {
        guard let context else { return }
        if configuration.role == .server {
            finishClosing(context: context)
        } else {
            armCloseTimer(context: context)
        }
    }

    /// Closes the channel once; a close asked for after that completes with it.
    private func finishClosing(context: ChannelHandlerContext) {
        closeTimer?.cancel()
        closeTimer = nil
        let promise = pendingClose
        pendingClose = nil
        guard !closing else {
            if let promise { context.channel.closeFuture.cascade(to: promise) }
            return
        }
        closing = true
        context.close(mode: .all, promise: promise)
    }

    private func armCloseTimer(context: ChannelHandlerContext) {
        stopKeepalive()
        guard closeTimer == nil else { return }
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        closeTimer = context.eventLoop.scheduleTask(in: TimeAmount(configuration.closeTimeout)) {
            let handler = bound.value
            guard let context = handler.context else { return }
            handler.closeTimer = nil
            if !handler.closeReceived && !handler.failed {
                handler.failed = true
                context.fireErrorCaught(TransportError(.timedOut, "\(handler.configuration.describing) did not answer the WebSocket close frame within \(handler.configuration.closeTimeout.secondsText); the connection was closed without it (closeTimeout= changes the wait)"))
            }
            handler.finishClosing(context: context)
        }
    }

    /// A protocol violation by the peer: the close frame with `code`, the error to the reader, and
    /// the connection closed without waiting for an answer (RFC 6455 section 7.1.7).
    private func fail(_ code: UInt16, _ what: String) {
        guard let context, !failed else { return }
        failed = true
        assembling = nil
        stopKeepalive()
        let error = TransportError(.protocolError, "\(configuration.describing) \(what); closed with \(code) (\(CloseCode.name(code)))")
        failWith(error, code: code, context: context)
    }

    /// Sends the close frame with `code` (unless one went out), tells the reader `error`, and
    /// closes without waiting for an answer. The frame is written before the error travels on, as
    /// the backend closes the channel when it sees an error.
    private func failWith(_ error: TransportError, code: UInt16, context: ChannelHandlerContext) {
        if !closeSent {
            closeSent = true
            sendClose(code, context: context)
        }
        context.fireErrorCaught(error)
        finishClosing(context: context)
    }

    package func errorCaught(context: ChannelHandlerContext, error: any Error) {
        if let error = error as? NIOWebSocketError, started, !failed {
            switch error {
            case .invalidFrameLength:
                failTooBig(nil)
            case .fragmentedControlFrame:
                fail(CloseCode.protocolError, "sent a fragmented control frame")
            case .multiByteControlFrameLength:
                fail(CloseCode.protocolError, "sent a control frame longer than 125 bytes")
            }
            return
        }
        // Anything else (the connection reset, TLS failed): no closing handshake to wait for.
        if started { failed = true }
        context.fireErrorCaught(error)
    }

    package func channelInactive(context: ChannelHandlerContext) {
        stopTimers()
        if started && !closeReceived && !failed && !closeSent {
            failed = true
            context.fireErrorCaught(TransportError(.disconnected, "\(configuration.describing) closed the TCP connection without a WebSocket close frame (1006, abnormal closure); messages it meant to send may be missing"))
        } else if started && closeSent && !closeReceived && !failed {
            failed = true
            context.fireErrorCaught(TransportError(.disconnected, "\(configuration.describing) closed the TCP connection without answering the WebSocket close frame (1006)"))
        }
        if let promise = pendingClose {
            pendingClose = nil
            promise.succeed()
        }
        context.fireChannelInactive()
    }

    package func read(context: ChannelHandlerContext) {
        reading = true
        context.read()
    }

    package func channelReadComplete(context: ChannelHandlerContext) {
        reading = false
        context.fireChannelReadComplete()
    }

    package func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable { drained = true }
        if context.channel.isWritable, let payload = pendingPong, !closeSent {
            pendingPong = nil
            send(WebSocketFrame(fin: true, opcode: .pong, maskKey: mask(), data: payload), context: context)
        }
        context.fireChannelWritabilityChanged()
    }

    /// The peer's end of input (a FIN: sockets allow half-closure). After its close frame, the
    /// closing handshake is over; before it, the connection ended abnormally (1006). Either way it
    /// ends here: the backend hears the end from this handler (the inputClosed it sent on a normal
    /// close, or the error).
    package func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        guard started, let end = event as? ChannelEvent, end == .inputClosed else {
            return context.fireUserInboundEventTriggered(event)
        }
        if closeReceived || failed { return finishClosing(context: context) }
        failed = true
        closeSent = true   // the peer reads nothing more: no close frame
        stopKeepalive()
        context.fireErrorCaught(TransportError(.disconnected, "\(configuration.describing) closed the TCP connection without a WebSocket close frame (1006, abnormal closure); messages it meant to send may be missing"))
        finishClosing(context: context)
    }

    // MARK: Outbound

    package func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let message = Self.unwrapOutboundIn(data)
        guard started, !closeSent, !failed else {
            promise?.fail(TransportError(.disconnected, "the WebSocket to \(configuration.describing) is closing: nothing can be sent after the close frame"))
            return
        }
        if message.kind == .text, !Self.isValidUTF8(message.payload) {
            promise?.fail(TransportError.misuse("a text message to \(configuration.describing) must be valid UTF-8; send the bytes as a binary message"))
            return
        }
        var frame = WebSocketFrame(fin: true, opcode: message.kind == .text ? .text : .binary, maskKey: mask(), data: message.payload)
        if let deflate {
            frame.data = deflate.compressor.compress(message.payload, allocator: context.channel.allocator)
            frame.rsv1 = true
        }
        context.write(Self.wrapOutboundOut(frame), promise: promise)
    }

    /// `close(mode: .all)` sends the close frame and waits for the peer's, at most the close
    /// timeout, then closes. There is no half-close (`close(mode: .output)` fails).
    package func close(context: ChannelHandlerContext, mode: CloseMode, promise: EventLoopPromise<Void>?) {
        guard mode != .input, started else {
            return context.close(mode: mode, promise: promise)
        }
        if failed {
            // The failure's close frame is out (or going); nothing to wait for.
            if let promise {
                if let pending = pendingClose { pending.futureResult.cascade(to: promise) } else { pendingClose = promise }
            }
            return finishClosing(context: context)
        }
        if mode == .output {
            // WebSocket has no half-close (the layer says so; Connection.closeWrite() refuses).
            promise?.fail(TransportError(.unsupported, "a WebSocket has no half-close; close() runs its closing handshake"))
            return
        }
        if let promise {
            if let pending = pendingClose { pending.futureResult.cascade(to: promise) } else { pendingClose = promise }
        }
        if closeReceived {
            // The peer closed first and was answered (or is answered now): nothing more to wait for.
            guard !closeSent else { return finishClosing(context: context) }
            closeSent = true
            let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
            sendClose(CloseCode.normal, context: context).whenComplete { _ in
                guard let context = bound.value.context else { return }
                bound.value.finishClosing(context: context)
            }
            return
        }
        if !closeSent {
            closeSent = true
            sendClose(CloseCode.normal, context: context)
        }
        armCloseTimer(context: context)
    }

    @discardableResult
    private func sendClose(_ code: UInt16, context: ChannelHandlerContext) -> EventLoopFuture<Void> {
        var payload = context.channel.allocator.buffer(capacity: 2)
        payload.writeInteger(code)
        return send(WebSocketFrame(fin: true, opcode: .connectionClose, maskKey: mask(), data: payload), context: context)
    }

    @discardableResult
    private func send(_ frame: WebSocketFrame, context: ChannelHandlerContext) -> EventLoopFuture<Void> {
        let promise = context.eventLoop.makePromise(of: Void.self)
        context.writeAndFlush(Self.wrapOutboundOut(frame), promise: promise)
        return promise.futureResult
    }

    private func mask() -> WebSocketMaskingKey? {
        configuration.role == .client ? .random() : nil
    }

    // MARK: Keepalive

    private func sendKeepalivePing() {
        guard let context, started, !closeSent, !failed, pingPayload == nil else { return }
        var payload = context.channel.allocator.buffer(capacity: 4)
        payload.writeInteger(UInt32.random(in: .min ... .max))
        pingPayload = payload
        pingSent = false
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        send(WebSocketFrame(fin: true, opcode: .ping, maskKey: mask(), data: payload), context: context).whenSuccess {
            bound.value.pingSent = true
        }
        armPongTimer()
    }

    private func armPongTimer() {
        guard let context, let timeout = configuration.pingTimeout, pingPayload != nil, !failed, !closeSent else { return }
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        pongTimer?.cancel()
        drained = false
        pongTimer = context.eventLoop.scheduleTask(in: TimeAmount(timeout)) {
            bound.value.keepaliveFailed()
        }
    }

    private func keepaliveFailed() {
        guard let context, !failed else { return }
        // The ping still queued behind messages that are moving, or an application that holds its
        // reads (the answer may be waiting in the kernel): not a dead peer yet. Wait again.
        if (!pingSent && drained) || !reading { return armPongTimer() }
        failed = true
        pongTimer = nil
        let error = TransportError(.timedOut, "\(configuration.describing) did not answer a keepalive ping within \(configuration.pingTimeout?.secondsText ?? "?"): the peer or the path to it is gone (pingInterval= and pingTimeout= change the keepalive)")
        failWith(error, code: CloseCode.internalError, context: context)
    }

    /// The keepalive ends when the closing handshake starts: a ping then could only turn an
    /// orderly close into a timeout.
    private func stopKeepalive() {
        pinger?.cancel()
        pinger = nil
        pongTimer?.cancel()
        pongTimer = nil
        pingPayload = nil
    }

    private func stopTimers() {
        pinger?.cancel()
        pinger = nil
        pongTimer?.cancel()
        pongTimer = nil
        closeTimer?.cancel()
        closeTimer = nil
    }
}

@available(*, unavailable)
extension WebSocketHandler: Sendable {}
