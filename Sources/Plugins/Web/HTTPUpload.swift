// A streamed HTTP/1.1 request (RFC 9112) as a connection: the writes are the request body, sent as
// they come (chunked unless the length was given), closeWrite() ends it, and the reads are the
// response body. The head goes out when the connection is up; the response's status and headers
// become metadata when they arrive. SwiftNIO's HTTP/1 codec reads and writes the messages.

import NIOCore
import NIOHTTP1
import Synchronization
@_spi(Plugins) import TransportKitCore

/// What the request is, from the URL.
struct HTTPRequestPlan: Sendable {
    var method: HTTPMethod
    var target: String
    /// The Host header.
    var host: String
    var headers: [(String, String)]
    /// A body of known length (Content-Length), or `nil`: chunked.
    var length: Int?
    /// No byte either way for this long fails the request; `nil`: none.
    var idleTimeout: Duration?
    /// Names the request in messages: `POST http://host/ingest`.
    var describing: String
}

/// Where the response's facts go once they arrive: the connection, when it exists.
final class ResponseFacts: Sendable {
    private struct State {
        var facts: [String: String] = [:]
        weak var connection: Connection?
    }
    private let state = Mutex(State())

    /// The facts so far (the ready step's metadata), and the connection later ones go to.
    func attach(_ connection: Connection) {
        let facts = state.withLock { state in
            state.connection = connection
            return state.facts
        }
        connection.updateMetadata { $0.extra.merge(facts) { _, new in new } }
    }

    func record(_ facts: [String: String]) {
        let connection = state.withLock { state in
            state.facts.merge(facts) { _, new in new }
            return state.connection
        }
        connection?.updateMetadata { $0.extra.merge(facts) { _, new in new } }
    }
}

/// Sends the request head when the connection is up, each `ByteBuffer` written as body, the end
/// on `close(mode: .output)`; hands on the response body, and fails the reader when the status is
/// 400 or more (with the start of the body), on a redirect, or when the server ends early.
final class HTTPUploadHandler: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = HTTPClientResponsePart
    typealias InboundOut = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = HTTPClientRequestPart

    let plan: HTTPRequestPlan
    let facts: ResponseFacts
    let sent: EventLoopPromise<Void>
    private var context: ChannelHandlerContext?
    private var headSent = false
    private var bodyEnded = false
    private var bodyBytes = 0
    private var response: HTTPResponseHead?
    /// The start of an error response's body, for the message.
    private var errorBody: ByteBuffer?
    private var responseEnded = false
    private var failed = false
    private var idleTimer: Scheduled<Void>?

    init(plan: HTTPRequestPlan, facts: ResponseFacts, sent: EventLoopPromise<Void>) {
        self.plan = plan
        self.facts = facts
        self.sent = sent
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        if context.channel.isActive { sendHead(context) }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        idleTimer?.cancel()
        self.context = nil
        sent.fail(TransportError(.disconnected, "\(plan.describing): the request ended before its head was sent"))
    }

    func channelActive(context: ChannelHandlerContext) {
        sendHead(context)
        context.fireChannelActive()
    }

    private func sendHead(_ context: ChannelHandlerContext) {
        guard !headSent else { return }
        headSent = true
        var headers = HTTPHeaders()
        headers.add(name: "Host", value: plan.host)
        headers.add(name: "User-Agent", value: "TransportKit")
        if let length = plan.length {
            headers.add(name: "Content-Length", value: "\(length)")
        } else {
            headers.add(name: "Transfer-Encoding", value: "chunked")
        }
        headers.add(name: "Connection", value: "close")
        for (name, value) in plan.headers { headers.add(name: name, value: value) }
        let head = HTTPRequestHead(version: .http1_1, method: plan.method, uri: plan.target, headers: headers)
        context.writeAndFlush(Self.wrapOutboundOut(.head(head))).cascade(to: sent)
        armIdleTimer(context)
    }

    // MARK: The body going out

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        let chunk = Self.unwrapOutboundIn(data)
        if bodyEnded || failed {
            promise?.fail(TransportError.misuse("\(plan.describing): the request body has ended; nothing more can be sent"))
            return
        }
        if let length = plan.length, bodyBytes + chunk.readableBytes > length {
            promise?.fail(TransportError.misuse("\(plan.describing): length=\(length) was given and \(bodyBytes + chunk.readableBytes) bytes were written; write exactly that many, or leave length= out (chunked)"))
            return
        }
        bodyBytes += chunk.readableBytes
        armIdleTimer(context)
        context.write(Self.wrapOutboundOut(.body(.byteBuffer(chunk))), promise: promise)
    }

    /// `.output` (the connection's closeWrite) ends the body; the response is read on.
    func close(context: ChannelHandlerContext, mode: CloseMode, promise: EventLoopPromise<Void>?) {
        guard mode == .output else { return context.close(mode: mode, promise: promise) }
        guard !bodyEnded else {
            promise?.succeed()
            return
        }
        if let length = plan.length, bodyBytes != length {
            promise?.fail(TransportError.misuse("\(plan.describing): length=\(length) was given and the body ended after \(bodyBytes) bytes; the server would wait for the rest"))
            return
        }
        bodyEnded = true
        armIdleTimer(context)
        context.writeAndFlush(Self.wrapOutboundOut(.end(nil)), promise: promise)
    }

    // MARK: The response coming in

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        armIdleTimer(context)
        switch Self.unwrapInboundIn(data) {
        case .head(let head):
            // 1xx answers (100 Continue) come before the real one.
            guard head.status.code >= 200 else { return }
            response = head
            var found = ["http.status": "\(head.status.code)", "http.reason": head.status.reasonPhrase]
            for (name, value) in head.headers {
                let key = "http.header.\(name.lowercased())"
                found[key] = found[key].map { "\($0), \(value)" } ?? value
            }
            facts.record(found)
            if head.status.code >= 300 { errorBody = context.channel.allocator.buffer(capacity: 256) }
        case .body(var chunk):
            if var kept = errorBody {
                if kept.readableBytes < 300, let slice = chunk.readSlice(length: min(chunk.readableBytes, 300 - kept.readableBytes)) {
                    var slice = slice
                    kept.writeBuffer(&slice)
                    errorBody = kept
                }
            } else {
                context.fireChannelRead(Self.wrapInboundOut(chunk))
            }
        case .end:
            responseEnded = true
            idleTimer?.cancel()
            if let response, response.status.code >= 300 {
                fail(refusal(response), context: context)
            } else {
                context.fireUserInboundEventTriggered(ChannelEvent.inputClosed)
            }
        }
    }

    private func refusal(_ response: HTTPResponseHead) -> TransportError {
        let text = errorBody.map { String(decoding: $0.readableBytesView, as: UTF8.self) }?
            .split(whereSeparator: \.isNewline).joined(separator: " ") ?? ""
        let said = text.isEmpty ? "" : ": \"\(TransportError.printable(text, limit: 200))\""
        let status = "\(response.status.code) \(response.status.reasonPhrase)"
        let sentNote = bodyEnded ? "" : " while the body was being sent (\(bodyBytes) bytes went out)"
        switch response.status.code {
        case 300...399:
            let location = response.headers.first(name: "Location").map { " to \(TransportError.printable($0))" } ?? ""
            return TransportError(.protocolError, "\(plan.describing) redirects\(location) (\(status)); a streamed body cannot be sent again, so the redirect is not followed: use that URL")
        case 401, 403:
            return TransportError(.permissionDenied, "\(plan.describing) answered \(status)\(sentNote)\(said); give credentials with authorization=")
        case 404, 410:
            return TransportError(.notFound, "\(plan.describing) answered \(status)\(said); check the path")
        case 408, 504:
            return TransportError(.timedOut, "\(plan.describing) answered \(status)\(said)")
        default:
            return TransportError(.protocolError, "\(plan.describing) answered \(status)\(sentNote)\(said)")
        }
    }

    private func fail(_ error: TransportError, context: ChannelHandlerContext) {
        guard !failed else { return }
        failed = true
        idleTimer?.cancel()
        sent.fail(error)
        context.fireErrorCaught(error)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        if error is HTTPParserError {
            return fail(TransportError(.protocolError, "\(plan.describing): the server's answer is not HTTP/1.1 (\(error)); is it an HTTPS port (https://), or not a web server?"), context: context)
        }
        failed = true
        context.fireErrorCaught(error)
    }

    func channelInactive(context: ChannelHandlerContext) {
        idleTimer?.cancel()
        if !responseEnded && !failed && headSent {
            let when = response == nil ? "before answering" : "before the end of its answer"
            fail(TransportError(.disconnected, "\(plan.describing): the server closed the connection \(when) (\(bodyBytes) bytes of the body went out\(bodyEnded ? ", all of it" : ""))"), context: context)
        }
        context.fireChannelInactive()
    }

    // MARK: Idle timeout

    /// Restarted by every byte either way: a device that pauses for less than the idle timeout
    /// keeps the request alive however long it runs.
    private func armIdleTimer(_ context: ChannelHandlerContext) {
        guard let limit = plan.idleTimeout, !responseEnded, !failed else { return }
        idleTimer?.cancel()
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        idleTimer = context.eventLoop.scheduleTask(in: TimeAmount(limit)) {
            let handler = bound.value
            guard let context = handler.context else { return }
            let waiting = handler.bodyEnded ? "the server's answer" : "the next byte of the body"
            handler.fail(TransportError(.timedOut, "\(handler.plan.describing): nothing moved for \(limit.secondsText) while waiting for \(waiting) (idleTimeout= changes the wait)"), context: context)
            context.close(promise: nil)
        }
    }
}

@available(*, unavailable)
extension HTTPUploadHandler: Sendable {}
