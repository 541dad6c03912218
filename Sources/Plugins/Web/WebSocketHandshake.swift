// The WebSocket opening handshake (RFC 6455 section 4): an HTTP/1.1 GET with Upgrade: websocket
// and its 101 answer, on SwiftNIO's HTTP/1 codec. On success the HTTP handlers leave the pipeline
// and the frame codec takes their place in front of the WebSocketHandler; bytes that came after
// the handshake reach the frame decoder.

import Crypto
import FoundationEssentials
import NIOCore
import NIOHTTP1
import NIOWebSocket
@_spi(Plugins) import TransportKitCore
import TransportKitWebSocket

/// The value of Sec-WebSocket-Accept for `key` (section 4.2.2).
func webSocketAccept(for key: String) -> String {
    let digest = Insecure.SHA1.hash(data: Array((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").utf8))
    return Data(digest).base64EncodedString()
}

/// The comma-separated tokens of every `name` header, trimmed, lowercased when `lowercased`.
func headerTokens(_ headers: HTTPHeaders, _ name: String, lowercased: Bool = true) -> [String] {
    headers[name].flatMap { $0.split(separator: ",") }.map {
        let token = $0.trimmingCharacters(in: .whitespaces)
        return lowercased ? token.lowercased() : token
    }
}

/// Holds back the peer's end of input (a FIN) while the HTTP decoder leaves the pipeline: seen by
/// it, the end would make it drop the bytes that came after the handshake (a first message, a
/// close frame). Released once the frame decoder has them.
final class EndOfInputGate: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = NIOAny
    var holding = false
    private var held = false

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if holding, let end = event as? ChannelEvent, end == .inputClosed {
            held = true
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    /// Passes on a held end, and leaves the pipeline.
    func release(_ context: ChannelHandlerContext) {
        holding = false
        let pipeline = context.pipeline.syncOperations
        guard let own = try? pipeline.context(handler: self) else { return }
        if held { own.fireUserInboundEventTriggered(ChannelEvent.inputClosed) }
        pipeline.removeHandler(context: own, promise: nil)
    }
}

@available(*, unavailable)
extension EndOfInputGate: Sendable {}

/// What both halves of the handshake share: the ready step's promise, and once the answer is
/// settled, the bytes that follow it, kept until the frame decoder is in place.
final class HandshakeProgress {
    let promise: EventLoopPromise<Void>
    let gate = EndOfInputGate()
    private(set) var upgraded = false
    private var buffered: [NIOAny] = []

    init(on channel: any Channel) {
        promise = channel.eventLoop.makePromise()
    }

    /// Keeps `data` once the upgrade is under way; `false`: the handshake reads it.
    func keep(_ data: NIOAny) -> Bool {
        guard upgraded else { return false }
        buffered.append(data)
        return true
    }

    /// The handshake ended without an upgrade (the peer left, the handler was removed).
    func ended(_ reason: String) {
        guard !upgraded else { return }
        promise.fail(TransportError(.disconnected, reason))
    }

    /// Swaps the HTTP handlers for the frame codec, in front of `webSocket`, then completes the
    /// promise. Removing the HTTP decoder hands the bytes that followed the handshake on, later,
    /// on the event loop; the handshake handler keeps them (``keep(_:)``) until the frame decoder
    /// is in place and passes them to it, so a frame that came with the 101 is neither lost nor
    /// sent through the HTTP codec.
    func switchToFrames(_ context: ChannelHandlerContext, encoder: any RemovableChannelHandler,
                        decoder: any RemovableChannelHandler, webSocket: WebSocketHandler) {
        upgraded = true
        gate.holding = true
        let pipeline = context.pipeline.syncOperations
        pipeline.removeHandler(encoder, promise: nil)
        let bound = NIOLoopBound((context, webSocket, self), eventLoop: context.eventLoop)
        pipeline.removeHandler(decoder).whenComplete { _ in
            let (context, webSocket, progress) = bound.value
            do {
                let pipeline = context.pipeline.syncOperations
                try pipeline.addHandler(WebSocketFrameEncoder(), position: .before(webSocket))
                try pipeline.addHandler(ByteToMessageHandler(WebSocketFrameDecoder(maxFrameSize: min(webSocket.configuration.maxMessageSize, Int(UInt32.max)))),
                                        position: .before(webSocket))
                webSocket.start()
                progress.promise.succeed()
                let buffered = progress.buffered
                progress.buffered = []
                for data in buffered { context.fireChannelRead(data) }
                if !buffered.isEmpty {
                    context.fireChannelReadComplete()
                    // NIO's own read for this cycle went by before these bytes: ask again, through
                    // the backend, which holds it when its queue is full.
                    context.channel.read()
                }
                pipeline.removeHandler(context: context, promise: nil)
                progress.gate.release(context)
            } catch {
                progress.promise.fail(error)
                context.close(promise: nil)
            }
        }
    }
}

@available(*, unavailable)
extension HandshakeProgress: Sendable {}

/// The client's half: sends the upgrade request when the connection is up and checks the answer.
final class WebSocketClientHandshake: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPClientResponsePart
    typealias OutboundOut = HTTPClientRequestPart

    struct Request: Sendable {
        var target: String
        var host: String
        var subprotocols: [String]
        var headers: [(String, String)]
        /// Offer permessage-deflate.
        var compression: Bool
    }

    let request: Request
    let key = NIOWebSocketClientUpgrader.randomRequestKey()
    let progress: HandshakeProgress
    private let webSocket: WebSocketHandler
    private let encoder: HTTPRequestEncoder
    private let decoder: ByteToMessageHandler<HTTPResponseDecoder>
    private var sent = false
    private var response: HTTPResponseHead?
    private var body = ByteBuffer()

    /// Adds the HTTP codec, this handler and `webSocket` to `channel`; the returned handshake's
    /// promise is the ready step.
    static func install(on channel: any Channel, request: Request, webSocket: WebSocketHandler) throws -> WebSocketClientHandshake {
        let handshake = WebSocketClientHandshake(request: request, webSocket: webSocket, progress: HandshakeProgress(on: channel))
        try channel.pipeline.syncOperations.addHandlers([handshake.progress.gate, handshake.encoder, handshake.decoder, handshake, webSocket])
        return handshake
    }

    private init(request: Request, webSocket: WebSocketHandler, progress: HandshakeProgress) {
        self.request = request
        self.webSocket = webSocket
        self.progress = progress
        encoder = HTTPRequestEncoder()
        decoder = ByteToMessageHandler(HTTPResponseDecoder(leftOverBytesStrategy: .forwardBytes))
    }

    func handlerAdded(context: ChannelHandlerContext) {
        if context.channel.isActive { sendRequest(context) }
    }

    func channelActive(context: ChannelHandlerContext) {
        sendRequest(context)
        context.fireChannelActive()
    }

    private func sendRequest(_ context: ChannelHandlerContext) {
        guard !sent else { return }
        sent = true
        var headers = HTTPHeaders()
        headers.add(name: "Host", value: request.host)
        headers.add(name: "Upgrade", value: "websocket")
        headers.add(name: "Connection", value: "Upgrade")
        headers.add(name: "Sec-WebSocket-Key", value: key)
        headers.add(name: "Sec-WebSocket-Version", value: "13")
        if !request.subprotocols.isEmpty {
            headers.add(name: "Sec-WebSocket-Protocol", value: request.subprotocols.joined(separator: ", "))
        }
        if request.compression { headers.add(name: "Sec-WebSocket-Extensions", value: DeflateParameters.clientOffer) }
        headers.add(name: "User-Agent", value: "TransportKit")
        for (name, value) in request.headers { headers.add(name: name, value: value) }
        let head = HTTPRequestHead(version: .http1_1, method: .GET, uri: request.target, headers: headers)
        context.write(Self.wrapOutboundOut(.head(head)), promise: nil)
        context.writeAndFlush(Self.wrapOutboundOut(.end(nil)), promise: nil)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        // After the answer: bytes that followed it, kept for the frame decoder.
        if progress.keep(data) { return }
        switch Self.unwrapInboundIn(data) {
        case .head(let head):
            response = head
        case .body(var chunk):
            if body.readableBytes < 512, let slice = chunk.readSlice(length: min(chunk.readableBytes, 512 - body.readableBytes)) {
                var slice = slice
                body.writeBuffer(&slice)
            }
        case .end:
            guard let response else { return }
            do {
                try check(response)
            } catch {
                progress.promise.fail(error)
                context.close(promise: nil)
                return
            }
            progress.switchToFrames(context, encoder: encoder, decoder: decoder, webSocket: webSocket)
        }
    }

    /// A 101 with the right accept value, a subprotocol that was offered, no extension.
    private func check(_ response: HTTPResponseHead) throws {
        let target = webSocket.configuration.describing
        guard response.status == .switchingProtocols else { throw refusal(response) }
        guard headerTokens(response.headers, "Upgrade").contains("websocket"),
              headerTokens(response.headers, "Connection").contains("upgrade") else {
            throw TransportError(.protocolError, "\(target) answered 101 without Upgrade: websocket and Connection: Upgrade; it is not a WebSocket server")
        }
        guard response.headers.first(name: "Sec-WebSocket-Accept") == webSocketAccept(for: key) else {
            throw TransportError(.protocolError, "\(target) answered with a Sec-WebSocket-Accept that does not match the key sent: not a WebSocket server, or a proxy changed the answer")
        }
        let chosen = headerTokens(response.headers, "Sec-WebSocket-Protocol", lowercased: false)
        if let protocolName = chosen.first {
            guard chosen.count == 1, request.subprotocols.contains(protocolName) else {
                throw TransportError(.protocolError, "\(target) chose the subprotocol '\(TransportError.printable(chosen.joined(separator: ", ")))', which was not offered (offered: \(request.subprotocols.isEmpty ? "none" : request.subprotocols.joined(separator: ", ")))")
            }
            webSocket.facts["ws.subprotocol"] = protocolName
        }
        let extensions = headerTokens(response.headers, "Sec-WebSocket-Extensions", lowercased: false)
        guard !extensions.isEmpty else { return }
        guard request.compression else {
            throw TransportError(.protocolError, "\(target) turned on the extension '\(TransportError.printable(extensions.joined(separator: ", ")))', which was not offered")
        }
        do {
            if let parameters = try DeflateParameters.accepted(extensions) {
                try webSocket.useDeflate(parameters, role: .client)
                webSocket.facts["ws.extensions"] = extensions.joined(separator: ", ")
            }
        } catch {
            throw TransportError(.protocolError, "\(target) answered the permessage-deflate offer in a way a client must refuse: \(error)")
        }
    }

    private func refusal(_ response: HTTPResponseHead) -> TransportError {
        let target = webSocket.configuration.describing
        let text = String(decoding: body.readableBytesView, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        let said = text.isEmpty ? "" : " (\"\(TransportError.printable(text, limit: 200))\")"
        let status = "\(response.status.code) \(response.status.reasonPhrase)"
        switch response.status.code {
        case 401:
            return TransportError(.permissionDenied, "\(target) refused the WebSocket upgrade: \(status)\(said); give credentials with authorization= (or the server's query, such as ?token=)")
        case 403:
            return TransportError(.permissionDenied, "\(target) refused the WebSocket upgrade: \(status)\(said); the server does not let this client in (check origin=, authorization=, cookie=)")
        case 404:
            return TransportError(.notFound, "\(target) has no WebSocket at \(request.target): \(status)\(said); check the path")
        case 300...399:
            let location = response.headers.first(name: "Location").map { " to \(TransportError.printable($0))" } ?? ""
            return TransportError(.protocolError, "\(target) redirects\(location) (\(status)); a WebSocket upgrade does not follow redirects: connect to that URL")
        default:
            return TransportError(.protocolError, "\(target) answered \(status)\(said) instead of 101 Switching Protocols: is it a WebSocket endpoint?")
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        let target = webSocket.configuration.describing
        if error is HTTPParserError {
            progress.promise.fail(TransportError(.protocolError, "\(target) answered the WebSocket upgrade with something that is not HTTP (\(error)); is this port a WebSocket server, or does it want wss://?"))
        } else {
            progress.promise.fail(error)
        }
        context.fireErrorCaught(error)
    }

    func channelInactive(context: ChannelHandlerContext) {
        progress.ended("\(webSocket.configuration.describing) closed the connection during the WebSocket upgrade, before answering it")
        context.fireChannelInactive()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let end = event as? ChannelEvent, end == .inputClosed, !progress.upgraded {
            progress.ended("\(webSocket.configuration.describing) closed the connection during the WebSocket upgrade, before answering it")
            return context.close(promise: nil)
        }
        context.fireUserInboundEventTriggered(event)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        progress.ended("the WebSocket upgrade to \(webSocket.configuration.describing) ended before an answer")
    }
}

@available(*, unavailable)
extension WebSocketClientHandshake: Sendable {}

/// The server's half: takes one upgrade request for its path, answers 101 or refuses with the
/// status that says why (404 another path, 426 not a WebSocket request, 403 an origin not allowed).
final class WebSocketServerHandshake: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    struct Policy: Sendable {
        /// The path clients must ask for; empty: any.
        var path: String
        /// Subprotocols this server speaks, preferred first.
        var subprotocols: [String]
        /// Origins allowed; empty: any.
        var origins: [String]
        /// Accept permessage-deflate when a client offers it.
        var compression: Bool
    }

    let policy: Policy
    let progress: HandshakeProgress
    private let webSocket: WebSocketHandler
    private let encoder: HTTPResponseEncoder
    private let decoder: ByteToMessageHandler<HTTPRequestDecoder>
    private var request: HTTPRequestHead?
    private var answered = false

    static func install(on channel: any Channel, policy: Policy, webSocket: WebSocketHandler) throws -> WebSocketServerHandshake {
        let handshake = WebSocketServerHandshake(policy: policy, webSocket: webSocket, progress: HandshakeProgress(on: channel))
        try channel.pipeline.syncOperations.addHandlers([handshake.progress.gate, handshake.encoder, handshake.decoder, handshake, webSocket])
        return handshake
    }

    private init(policy: Policy, webSocket: WebSocketHandler, progress: HandshakeProgress) {
        self.policy = policy
        self.webSocket = webSocket
        self.progress = progress
        encoder = HTTPResponseEncoder()
        decoder = ByteToMessageHandler(HTTPRequestDecoder(leftOverBytesStrategy: .forwardBytes))
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        // After the answer: bytes that followed it, kept for the frame decoder.
        if progress.keep(data) { return }
        switch Self.unwrapInboundIn(data) {
        case .head(let head):
            request = head
        case .body:
            break
        case .end:
            guard let request, !answered else { return }
            answered = true
            answer(request, context: context)
        }
    }

    private func answer(_ request: HTTPRequestHead, context: ChannelHandlerContext) {
        let path = String(request.uri.prefix { $0 != "?" })
        let headers = request.headers
        guard request.method == .GET, request.version.major > 1 || (request.version.major == 1 && request.version.minor >= 1) else {
            return refuse(.methodNotAllowed, "a WebSocket upgrade is a GET over HTTP/1.1", context: context)
        }
        guard policy.path.isEmpty || policy.path == "/" || path == policy.path else {
            return refuse(.notFound, "no WebSocket at \(path); this server's is at \(policy.path)", context: context)
        }
        guard headerTokens(headers, "Upgrade").contains("websocket"), headerTokens(headers, "Connection").contains("upgrade") else {
            return refuse(.upgradeRequired, "this is a WebSocket endpoint: connect with a WebSocket client", context: context,
                          extra: [("Upgrade", "websocket"), ("Sec-WebSocket-Version", "13")])
        }
        guard headers.first(name: "Sec-WebSocket-Version") == "13" else {
            return refuse(.upgradeRequired, "only WebSocket version 13 is spoken here", context: context,
                          extra: [("Sec-WebSocket-Version", "13")])
        }
        guard let key = headers.first(name: "Sec-WebSocket-Key"), let decoded = Data(base64Encoded: key), decoded.count == 16 else {
            return refuse(.badRequest, "Sec-WebSocket-Key must be 16 bytes in base64", context: context)
        }
        // Browsers always send Origin, and a page cannot change it; a client without one is not a
        // browser, which origins= does not keep out (Docs/Security.md).
        let origin = headers.first(name: "Origin")
        if !policy.origins.isEmpty, let origin, !policy.origins.contains(where: { $0.lowercased() == origin.lowercased() }) {
            return refuse(.forbidden, "the origin \(origin) is not allowed here", context: context)
        }
        var answer = HTTPHeaders()
        answer.add(name: "Upgrade", value: "websocket")
        answer.add(name: "Connection", value: "Upgrade")
        answer.add(name: "Sec-WebSocket-Accept", value: webSocketAccept(for: key))
        let offered = headerTokens(headers, "Sec-WebSocket-Protocol", lowercased: false)
        if let chosen = policy.subprotocols.first(where: { offered.contains($0) }) {
            answer.add(name: "Sec-WebSocket-Protocol", value: chosen)
            webSocket.facts["ws.subprotocol"] = chosen
        }
        if policy.compression, let (parameters, header) = DeflateParameters.negotiate(headerTokens(headers, "Sec-WebSocket-Extensions", lowercased: false)),
           (try? webSocket.useDeflate(parameters, role: .server)) != nil {
            answer.add(name: "Sec-WebSocket-Extensions", value: header)
            webSocket.facts["ws.extensions"] = header
        }
        webSocket.facts["ws.target"] = request.uri
        if let origin { webSocket.facts["ws.origin"] = origin }
        context.writeAndFlush(Self.wrapOutboundOut(.head(HTTPResponseHead(version: .http1_1, status: .switchingProtocols, headers: answer))), promise: nil)
        progress.switchToFrames(context, encoder: encoder, decoder: decoder, webSocket: webSocket)
    }

    private func refuse(_ status: HTTPResponseStatus, _ why: String, context: ChannelHandlerContext, extra: [(String, String)] = []) {
        let body = ByteBuffer(string: why + "\n")
        var headers = HTTPHeaders()
        headers.add(name: "Content-Type", value: "text/plain; charset=utf-8")
        headers.add(name: "Content-Length", value: "\(body.readableBytes)")
        headers.add(name: "Connection", value: "close")
        for (name, value) in extra { headers.add(name: name, value: value) }
        context.write(Self.wrapOutboundOut(.head(HTTPResponseHead(version: .http1_1, status: status, headers: headers))), promise: nil)
        context.write(Self.wrapOutboundOut(.body(.byteBuffer(body))), promise: nil)
        context.writeAndFlush(Self.wrapOutboundOut(.end(nil))).whenComplete { [channel = context.channel] _ in
            channel.close(promise: nil)
        }
        progress.promise.fail(TransportError(.refused, "refused a WebSocket client with \(status.code) \(status.reasonPhrase): \(why)"))
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        progress.promise.fail(TransportError(.protocolError, "a client sent something that is not an HTTP upgrade request (\(error))"))
        context.close(promise: nil)
    }

    func channelInactive(context: ChannelHandlerContext) {
        progress.ended("the client left before finishing the WebSocket upgrade")
        context.fireChannelInactive()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let end = event as? ChannelEvent, end == .inputClosed, !progress.upgraded {
            progress.ended("the client left before finishing the WebSocket upgrade")
            return context.close(promise: nil)
        }
        context.fireUserInboundEventTriggered(event)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        progress.ended("the WebSocket upgrade ended before an answer")
    }
}

@available(*, unavailable)
extension WebSocketServerHandshake: Sendable {}
