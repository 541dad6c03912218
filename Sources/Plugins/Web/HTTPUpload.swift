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
    /// The whole request (from its head to the answer's end) may take this long; `nil`: no limit.
    var requestTimeout: Duration?
    /// Names the request in messages: `POST http://host/ingest`.
    var describing: String
}

/// Where the response's facts go once they arrive: the connection, when it exists.
final class ResponseFacts: Sendable {
    private struct State {
        var facts: [String: String] = [:]
        weak var connection: Connection?
    }
    private let state = Locked(State())

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
    /// The error the request failed with, for the writes that come after it.
    private var failure: TransportError?
    /// Why writes fail from now on: the server's refusal, or its complete answer before the body ended.
    private var writeRefusal: TransportError?
    private var idleTimer: Scheduled<Void>?
    /// When a byte last moved either way (or the application last wrote).
    private var lastProgress = NIODeadline.now()
    private var requestTimer: Scheduled<Void>?
    /// `false` between a read's end and the next read the backend asks for: the application holds
    /// its reads, which is not the server's idleness.
    private var reading = true
    /// Body parts go to NIO in pieces of at most this many bytes; each one written is progress.
    static let piece = 64 * 1024

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
        requestTimer?.cancel()
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
        if let limit = plan.requestTimeout {
            let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
            requestTimer = context.eventLoop.scheduleTask(in: TimeAmount(limit)) {
                let handler = bound.value
                guard let context = handler.context, !handler.responseEnded else { return }
                handler.fail(TransportError(.timedOut, "\(handler.plan.describing): the request took longer than \(limit.secondsText) in all (requestTimeout=); \(handler.bodyBytes) bytes of the body went out"), context: context)
                context.close(promise: nil)
            }
        }
    }

    // MARK: The body going out

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        var chunk = Self.unwrapOutboundIn(data)
        // The application's mistakes first: a server that answered as soon as the promised
        // length arrived (as aiohttp does) must not turn a byte too many into a disconnect.
        if bodyEnded {
            promise?.fail(TransportError.misuse("\(plan.describing): the request body has ended; nothing more can be sent"))
            return
        }
        if let length = plan.length, bodyBytes + chunk.readableBytes > length {
            promise?.fail(TransportError.misuse("\(plan.describing): length=\(length) was given and \(bodyBytes + chunk.readableBytes) bytes were written; write exactly that many, or leave length= out (chunked)"))
            return
        }
        if let writeRefusal {
            promise?.fail(writeRefusal)
            return
        }
        if let failure {
            promise?.fail(failure)
            return
        }
        bodyBytes += chunk.readableBytes
        armIdleTimer(context)
        // In pieces, each restarting the idle timer once the kernel took it: over a slow link a
        // large write is progress long before it is all out.
        guard chunk.readableBytes > Self.piece else {
            // One piece: the write itself was progress, and the channel draining will be.
            context.write(Self.wrapOutboundOut(.body(.byteBuffer(chunk))), promise: promise)
            return
        }
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        while let piece = chunk.readSlice(length: min(Self.piece, chunk.readableBytes)), piece.readableBytes > 0 {
            let written = context.eventLoop.makePromise(of: Void.self)
            written.futureResult.whenSuccess {
                guard let context = bound.value.context else { return }
                bound.value.armIdleTimer(context)
            }
            if chunk.readableBytes == 0 { written.futureResult.cascade(to: promise) }
            context.write(Self.wrapOutboundOut(.body(.byteBuffer(piece))), promise: written)
            if chunk.readableBytes == 0 { return }
        }
        promise?.succeed()
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        armIdleTimer(context)
        context.fireChannelWritabilityChanged()
    }

    func read(context: ChannelHandlerContext) {
        reading = true
        context.read()
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        reading = false
        context.fireChannelReadComplete()
    }

    /// `.output` (the connection's closeWrite) ends the body; the response is read on.
    func close(context: ChannelHandlerContext, mode: CloseMode, promise: EventLoopPromise<Void>?) {
        guard mode == .output else { return context.close(mode: mode, promise: promise) }
        guard !bodyEnded, writeRefusal == nil || responseEnded else {
            promise?.succeed()
            return
        }
        if responseEnded {
            // The server answered before the body ended; there is nothing to end.
            bodyEnded = true
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
            if head.status.code >= 300 {
                errorBody = context.channel.allocator.buffer(capacity: 256)
                // The server refuses: the body's writer hears why at once (the status; the body's
                // start follows with the reader's error).
                writeRefusal = refusal(head)
            }
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
            requestTimer?.cancel()
            if let response, response.status.code >= 300 {
                fail(refusal(response), context: context)
            } else {
                if !bodyEnded, let response {
                    // A complete answer before the body ended (RFC 9112 section 9.6): stop sending.
                    writeRefusal = TransportError(.disconnected, "\(plan.describing) answered \(response.status.code) \(response.status.reasonPhrase) before the body ended, after \(bodyBytes) bytes, and takes no more; read its answer")
                }
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
        failure = error
        idleTimer?.cancel()
        requestTimer?.cancel()
        sent.fail(error)
        context.fireErrorCaught(error)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        if let response, response.status.code >= 300, !failed {
            // A refusal was on its way (a reset after a 413's head): it says more than the reset.
            return fail(refusal(response), context: context)
        }
        if let parser = error as? HTTPParserError {
            if parser == .invalidEOFState { return endedEarly(context) }
            return fail(TransportError(.protocolError, "\(plan.describing): the server's answer is not HTTP/1.1 (\(error)); is it an HTTPS port (https://), or not a web server?"), context: context)
        }
        failed = true
        context.fireErrorCaught(error)
    }

    /// The server's end of input (a FIN: sockets allow half-closure). The handler tells the
    /// backend of the end itself (at the answer's end), so this one goes no further; before the
    /// end of the answer it is an error.
    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        guard let end = event as? ChannelEvent, end == .inputClosed else {
            return context.fireUserInboundEventTriggered(event)
        }
        if !responseEnded && !failed && headSent { endedEarly(context) }
    }

    func channelInactive(context: ChannelHandlerContext) {
        idleTimer?.cancel()
        requestTimer?.cancel()
        if !responseEnded && !failed && headSent { endedEarly(context) }
        context.fireChannelInactive()
    }

    /// The server closed before its answer was complete.
    private func endedEarly(_ context: ChannelHandlerContext) {
        if let response, response.status.code >= 300 { return fail(refusal(response), context: context) }
        let when = response == nil ? "before answering" : "before the end of its answer"
        fail(TransportError(.disconnected, "\(plan.describing): the server closed the connection \(when) (\(bodyBytes) bytes of the body went out\(bodyEnded ? ", all of it" : "")); the upload may not have been taken"), context: context)
    }

    // MARK: Idle timeout

    /// Restarted by every byte either way: a device that pauses for less than the idle timeout
    /// keeps the request alive however long it runs.
    /// Notes progress. Cheap, as it runs for every piece written: it only records the time; the
    /// one timer, when it fires, looks at how long ago that was and sleeps again for the rest.
    private func armIdleTimer(_ context: ChannelHandlerContext) {
        guard plan.idleTimeout != nil, !responseEnded, !failed else { return }
        lastProgress = .now()
        if idleTimer == nil { scheduleIdleCheck(context, in: plan.idleTimeout.map(TimeAmount.init) ?? .zero) }
    }

    private func scheduleIdleCheck(_ context: ChannelHandlerContext, in delay: TimeAmount) {
        guard let limit = plan.idleTimeout else { return }
        let bound = NIOLoopBound(self, eventLoop: context.eventLoop)
        idleTimer = context.eventLoop.scheduleTask(in: delay) {
            let handler = bound.value
            handler.idleTimer = nil
            guard let context = handler.context, !handler.responseEnded, !handler.failed else { return }
            let quiet = NIODeadline.now() - handler.lastProgress
            if quiet < TimeAmount(limit) { return handler.scheduleIdleCheck(context, in: TimeAmount(limit) - quiet) }
            // The application holds its reads: the answer may be waiting unread. Wait again.
            guard handler.reading else { return handler.scheduleIdleCheck(context, in: TimeAmount(limit)) }
            let waiting = handler.bodyEnded ? "the server's answer" : "the next byte of the body"
            handler.fail(TransportError(.timedOut, "\(handler.plan.describing): nothing moved for \(limit.secondsText) while waiting for \(waiting) (idleTimeout= changes the wait)"), context: context)
            context.close(promise: nil)
        }
    }
}

@available(*, unavailable)
extension HTTPUploadHandler: Sendable {}
