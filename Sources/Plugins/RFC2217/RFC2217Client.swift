// RFC2217Client.swift: the client side of RFC 2217, as a SwiftNIO handler in front of the
// connection's byte handler (a ProtocolLayer, so it runs over TCP or over TLS over TCP), and the
// SerialControl that drives it.
//
// At connect (the layer's ready step, inside the connect's deadline): WILL and DO BINARY, DO SGA,
// WILL COM-PORT-OPTION; once the server says DO COM-PORT-OPTION, the URL's line settings go out
// (SET-BAUDRATE, -DATASIZE, -PARITY, -STOPSIZE, SET-CONTROL flow control, then DTR/RTS if asked),
// each answered by the server with the value in force. A server that refuses COM-PORT-OPTION
// (DONT) fails the connect: it serves raw bytes, which tcp:// reaches.
//
// Every SET waits for its answer (3 s by default, as pyserial); one that does not come is a
// `.timedOut` naming the command, except SET-CONTROL in the tolerant mode (`ignoreSetControl`,
// pyserial's ign_set_control) for servers known not to answer it. Answers are matched to requests
// by command (and for SET-CONTROL by what they are about: flow control, BREAK, DTR, RTS), in order.
// Answers and notifications no request waits for update what is known (the modem lines, a value
// the server changed, the line errors: SET-LINESTATE-MASK asks for overrun, parity, framing and
// break at connect, and each NOTIFY-LINESTATE is counted).
//
// FLOWCONTROL-SUSPEND from the server holds every write and every command in this handler, in
// order (a write's promise with it, so the connection's writers wait at their cap; a command's
// answer timer starts when it goes out) until FLOWCONTROL-RESUME.
//
// Answers come in the same byte stream as the port's data: an application that stops reading
// until the connection's inbound buffer is full stops the answers too (its SETs then time out).

import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore

/// What an RFC 2217 client does at connect and how it waits.
struct RFC2217ClientOptions: Sendable {
    var settings: SerialSettings
    var dtr: Bool?
    var rts: Bool?
    /// How long the negotiation and each SET wait for the server's answer.
    var answerTimeout: TimeAmount
    /// The same, for messages: "3 s".
    var answerTimeoutText: String
    /// pyserial's ign_set_control: SET-CONTROL is sent and not waited for.
    var ignoreSetControl: Bool
    /// The server, for messages: `rfc2217://host:port`.
    var describing: String
}

/// The client's protocol state, on the channel's event loop.
final class RFC2217ClientHandler: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    let options: RFC2217ClientOptions
    private var parser = TelnetParser()
    private var context: ChannelHandlerContext?
    /// Completed once COM-PORT-OPTION is agreed and the URL's settings are in force.
    private var ready: EventLoopPromise<Void>?
    private var negotiationTimeout: Scheduled<Void>?
    private var comPortAgreed = false
    /// BINARY and SGA both ways, COM-PORT-OPTION on this side (TelnetOptions answers the rest).
    private var telnet = TelnetOptions(wanted: [Telnet.binary, Telnet.suppressGoAhead, Telnet.comPortOption])

    private struct Pending {
        var command: UInt8
        var group: ClosedRange<UInt8>?
        var promise: EventLoopPromise<[UInt8]>
        var timeout: Scheduled<Void>?
    }
    private var pending: [Pending] = []

    /// What the server said is in force, from its answers (before any: the defaults).
    private(set) var inForce = SerialSettings()
    private(set) var outputLines: ModemLines = []
    private(set) var inputLines: ModemLines?
    private(set) var signature: String?
    /// The line errors the server notified (NOTIFY-LINESTATE), one for each error each names.
    private(set) var lineErrors = LineErrorCounts()
    private var modemWatchers: [Int: AsyncThrowingStream<ModemLines, any Error>.Continuation] = [:]
    private var nextWatcher = 0
    /// PURGE-DATA of the server's receive buffer sent and not answered: data until the answer is
    /// what the purge was meant to drop.
    private var purgingInput = 0
    /// The application closed the connection: sequences end without an error.
    private var closingLocally = false

    /// Data and commands, held while the server has suspended this side (FLOWCONTROL-SUSPEND).
    private var outbound = TelnetOutbound()

    init(options: RFC2217ClientOptions) {
        self.options = options
    }

    /// The ready step's future (installed with the handler).
    func readyFuture(on eventLoop: any EventLoop) -> EventLoopFuture<Void> {
        let promise = ready ?? eventLoop.makePromise(of: Void.self)
        ready = promise
        return promise.futureResult
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        if context.channel.isActive { start(context) }
    }

    func channelActive(context: ChannelHandlerContext) {
        start(context)
        context.fireChannelActive()
    }

    private var started = false
    private func start(_ context: ChannelHandlerContext) {
        guard !started else { return }
        started = true
        let bytes = telnet.ask([(Telnet.will, Telnet.binary), (Telnet.do, Telnet.binary), (Telnet.do, Telnet.suppressGoAhead),
                                (Telnet.will, Telnet.comPortOption)])
        send(context, bytes)
        let describing = options.describing
        let seconds = options.answerTimeoutText
        negotiationTimeout = context.eventLoop.assumeIsolated().scheduleTask(in: options.answerTimeout) { [self] in
            guard !comPortAgreed else { return }
            failReady(TransportError(.timedOut, "\(describing) did not agree to COM-PORT-OPTION within \(seconds): is it an RFC 2217 server "
                                     + "(ser2net: accepter telnet(rfc2217),tcp,…)? A port that serves raw bytes takes tcp://"))
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        end(TransportError(.disconnected, "\(options.describing) is closed"))
        self.context = nil
    }

    func channelInactive(context: ChannelHandlerContext) {
        end(TransportError(.disconnected, "\(options.describing) closed the connection"))
        context.fireChannelInactive()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        // The server's FIN (the channel allows half-closure): no answer will come.
        if case .inputClosed = event as? ChannelEvent {
            end(TransportError(.disconnected, "\(options.describing) closed the connection"))
        }
        context.fireUserInboundEventTriggered(event)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        end(TransportError.from(error, context: options.describing), failingSequences: true)
        context.fireErrorCaught(error)
    }

    /// The application is closing the connection: what waits ends without an error.
    func closeLocally() { closingLocally = true }

    private func failReady(_ error: TransportError) {
        negotiationTimeout?.cancel()
        if let ready {
            self.ready = nil
            ready.fail(error)
            context?.close(promise: nil)
        }
    }

    /// Fails what waits with `error`; modem-line sequences end with it only when the connection
    /// broke (`failingSequences`) or ended under the application, not when it closed it.
    private func end(_ error: TransportError, failingSequences: Bool = false) {
        failReady(error)
        failPending(error)
        let watchers = modemWatchers
        modemWatchers.removeAll()
        for (_, continuation) in watchers {
            if closingLocally && !failingSequences { continuation.finish() } else { continuation.finish(throwing: error) }
        }
        ChannelHandlerContext.fail(outbound.drop(), error)
    }

    /// Fails every request that waits for an answer.
    private func failPending(_ error: TransportError) {
        let waiting = pending
        pending.removeAll()
        for request in waiting {
            request.timeout?.cancel()
            request.promise.fail(error)
        }
    }

    // MARK: Inbound

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var buffer = unwrapInboundIn(data)
        guard let bytes = buffer.readBytes(length: buffer.readableBytes) else { return }
        for event in parser.parse(bytes) {
            switch event {
            case .data(let payload):
                if purgingInput == 0 { context.fireChannelRead(wrapInboundOut(context.channel.allocator.buffer(bytes: payload))) }
            case .negotiation(let verb, let option):
                negotiate(context, verb, option)
            case .subnegotiation(let option, let payload):
                if option == Telnet.comPortOption { answer(context, payload) }
            case .breakKey:
                break   // a server's break key means nothing to a client
            case .malformed(let what):
                broken(context, "broke the Telnet protocol: \(what)")
                return
            }
        }
    }

    private func broken(_ context: ChannelHandlerContext, _ what: String) {
        let error = TransportError(.protocolError, "\(options.describing) \(what)")
        end(error, failingSequences: true)
        context.fireErrorCaught(error)
        context.close(promise: nil)
    }

    /// Answers the server's negotiation (RFC 854): an option this side takes is agreed to once,
    /// one it does not is refused, and a request's answer is taken without a reply.
    private func negotiate(_ context: ChannelHandlerContext, _ verb: UInt8, _ option: UInt8) {
        if let reply = telnet.answer(verb, option) { send(context, reply) }
        guard option == Telnet.comPortOption else { return }
        if verb == Telnet.do {
            agreed(context)
        } else if verb == Telnet.dont {
            let error = TransportError(.unsupported, comPortAgreed
                ? "\(options.describing) withdrew COM-PORT-OPTION (DONT 44): it no longer takes RFC 2217 control"
                : "\(options.describing) refused COM-PORT-OPTION (DONT 44): it serves bytes without RFC 2217 control; connect with tcp:// for "
                    + "the bytes alone, or turn rfc2217 on in the server (ser2net: accepter telnet(rfc2217),tcp,…)")
            if comPortAgreed {
                failPending(error)
            } else {
                failReady(error)
            }
        }
    }

    /// COM-PORT-OPTION is agreed: the URL's settings go out, and the connection is ready once
    /// every one is answered.
    private func agreed(_ context: ChannelHandlerContext) {
        guard !comPortAgreed else { return }
        comPortAgreed = true
        negotiationTimeout?.cancel()
        let eventLoop = context.eventLoop
        var answers = applyRequests(options.settings, eventLoop: eventLoop)
        // The line errors are notified once asked for (servers start with a mask of 0, as
        // ser2net does); not waited for: the answer only repeats the mask.
        _ = request(ComPort.setLineStateMask, [ComPort.lineErrorBits], waits: false, eventLoop: eventLoop)
        if let dtr = options.dtr { answers.append(requestControl(dtr ? ComPort.Control.dtrOn : ComPort.Control.dtrOff, eventLoop: eventLoop)) }
        if let rts = options.rts { answers.append(requestControl(rts ? ComPort.Control.rtsOn : ComPort.Control.rtsOff, eventLoop: eventLoop)) }
        let settings = options.settings
        let dtr = options.dtr
        let rts = options.rts
        EventLoopFuture.whenAllSucceed(answers, on: eventLoop).assumeIsolated().whenComplete { [self] result in
            guard let ready else { return }
            self.ready = nil
            switch result {
            case .success:
                if let mismatch = mismatch(settings, dtr: dtr, rts: rts) {
                    ready.fail(mismatch)
                    context.close(promise: nil)
                } else {
                    ready.succeed(())
                }
            case .failure(let error):
                ready.fail(error)
                context.close(promise: nil)
            }
        }
    }

    /// A value the server answered differently from what was asked, as an error.
    func mismatch(_ settings: SerialSettings, dtr: Bool?, rts: Bool?) -> TransportError? {
        var kept = inForce
        kept.baudRate = settings.baudRate   // servers round rates to what their port makes, as drivers do
        if kept != settings {
            return TransportError(.unsupported, "\(options.describing) does not do \(settings.summary); its port kept \(inForce.summary)")
        }
        if !options.ignoreSetControl {
            if let dtr, outputLines.contains(.dtr) != dtr {
                return TransportError(.unsupported, "\(options.describing) kept DTR \(dtr ? "off" : "on") (its port may have no modem lines, as a pty; ignoreSetControl=true stops asking for answers)")
            }
            if let rts, outputLines.contains(.rts) != rts {
                return TransportError(.unsupported, "\(options.describing) kept RTS \(rts ? "off" : "on") (its port may have no modem lines, as a pty; ignoreSetControl=true stops asking for answers)")
            }
        }
        return nil
    }

    /// The server's answer or notification (command + 100).
    private func answer(_ context: ChannelHandlerContext, _ payload: [UInt8]) {
        guard let first = payload.first, first >= ComPort.serverOffset else { return }
        let command = first - ComPort.serverOffset
        let value = Array(payload.dropFirst())
        switch command {
        case ComPort.flowControlSuspend:
            outbound.suspend()
            return
        case ComPort.flowControlResume:
            context.send(outbound.resume())
            return
        case ComPort.notifyModemState:
            if let state = value.first { modemStateChanged(ComPort.modemLines(state)) }
        case ComPort.notifyLineState:
            if let state = value.first {
                let errors = ComPort.lineErrors(state)
                lineErrors.framing += errors.framing
                lineErrors.parity += errors.parity
                lineErrors.overrun += errors.overrun
                lineErrors.breaks += errors.breaks
            }
        case ComPort.purgeData:
            if value.first == 1 || value.first == 3 { purgingInput = max(purgingInput - 1, 0) }
        default:
            break
        }
        if let problem = record(command, value) {
            // An answer that means nothing: the request it answers fails with it.
            if let index = pending.firstIndex(where: { $0.command == command }) {
                let request = pending.remove(at: index)
                request.timeout?.cancel()
                request.promise.fail(TransportError(.protocolError, "\(options.describing) answered \(ComPort.name(command)) with \(problem)"))
            }
            return
        }
        let group = command == ComPort.setControl ? value.first.flatMap(ComPort.controlGroup) : nil
        guard let index = pending.firstIndex(where: { $0.command == command && (command != ComPort.setControl || $0.group == group) }) else { return }
        let request = pending.remove(at: index)
        request.timeout?.cancel()
        request.promise.succeed(value)
    }

    /// Keeps what an answer says is in force; a description of the value when it means nothing.
    private func record(_ command: UInt8, _ value: [UInt8]) -> String? {
        func shown() -> String { value.isEmpty ? "no value" : value.map { String($0) }.joined(separator: " ") }
        switch command {
        case ComPort.signature:
            signature = String(decoding: value, as: UTF8.self)
        case ComPort.setBaudRate:
            guard let rate = ComPort.baudRate(value) else { return "\(shown()), which is no bit rate" }
            if rate > 0 { inForce.baudRate = rate }
        case ComPort.setDataSize:
            guard let bits = value.first, bits == 0 || (5...8).contains(bits) else { return "\(shown()), which is no data size" }
            if bits > 0 { inForce.dataBits = Int(bits) }
        case ComPort.setParity:
            guard let code = value.first else { return "no value" }
            if let parity = ComPort.parity(code) { inForce.parity = parity } else if code != 0 { return "\(code), which is no parity" }
        case ComPort.setStopSize:
            guard let code = value.first else { return "no value" }
            if let bits = ComPort.stopBits(code) { inForce.stopBits = bits } else if code != 0 && code != 3 { return "\(code), which is no stop size" }
        case ComPort.setControl:
            guard let control = value.first else { return "no value" }
            if let flow = ComPort.flowControl(control) { inForce.flowControl = flow }
            switch control {
            case ComPort.Control.dtrOn: outputLines.insert(.dtr)
            case ComPort.Control.dtrOff: outputLines.remove(.dtr)
            case ComPort.Control.rtsOn: outputLines.insert(.rts)
            case ComPort.Control.rtsOff: outputLines.remove(.rts)
            default: break
            }
        default:
            break
        }
        return nil
    }

    private func modemStateChanged(_ lines: ModemLines) {
        let changed = inputLines != lines
        inputLines = lines
        guard changed else { return }
        for continuation in modemWatchers.values { continuation.yield(lines) }
    }

    // MARK: Requests

    /// Sends COM-PORT command `command` with `value`; the future is the server's answer's value.
    /// `waits: false` sends and succeeds at once. The answer's timer starts when the command goes
    /// out (it waits while the server has suspended this side).
    func request(_ command: UInt8, _ value: [UInt8], waits: Bool = true, eventLoop: any EventLoop) -> EventLoopFuture<[UInt8]> {
        guard let context else {
            return eventLoop.makeFailedFuture(TransportError(.disconnected, "\(options.describing) is closed"))
        }
        let promise = eventLoop.makePromise(of: [UInt8].self)
        var sent: () -> Void = {}
        if waits {
            let group = command == ComPort.setControl ? value.first.flatMap(ComPort.controlGroup) : nil
            pending.append(Pending(command: command, group: group, promise: promise, timeout: nil))
            let describing = options.describing
            let seconds = options.answerTimeoutText
            let tolerant = command == ComPort.setControl ? "; ignoreSetControl=true stops waiting for SET-CONTROL answers" : ""
            let limit = options.answerTimeout
            sent = { [self] in
                let timeout = eventLoop.assumeIsolated().scheduleTask(in: limit) { [self] in
                    guard let index = pending.firstIndex(where: { $0.promise.futureResult === promise.futureResult }) else { return }
                    pending.remove(at: index)
                    promise.fail(TransportError(.timedOut, "\(describing) did not answer \(ComPort.name(command)) within \(seconds)\(tolerant)"))
                }
                if let index = pending.firstIndex(where: { $0.promise.futureResult === promise.futureResult }) { pending[index].timeout = timeout }
            }
        } else {
            promise.succeed(value)
        }
        if command == ComPort.purgeData && (value.first == 1 || value.first == 3) { purgingInput += 1 }
        let bytes = Telnet.subnegotiation(Telnet.comPortOption, [command] + value)
        if outbound.command(bytes, sent: sent) {
            send(context, bytes)
            sent()
        }
        return promise.futureResult
    }

    func requestControl(_ value: UInt8, eventLoop: any EventLoop) -> EventLoopFuture<[UInt8]> {
        if options.ignoreSetControl, let flow = ComPort.flowControl(value) {
            inForce.flowControl = flow   // not answered: taken as asked
        }
        return request(ComPort.setControl, [value], waits: !options.ignoreSetControl, eventLoop: eventLoop)
    }

    /// The five SETs of `settings`, sent at once; each future is its answer.
    func applyRequests(_ settings: SerialSettings, eventLoop: any EventLoop) -> [EventLoopFuture<[UInt8]>] {
        [request(ComPort.setBaudRate, ComPort.baudRateValue(settings.baudRate), eventLoop: eventLoop),
         request(ComPort.setDataSize, [UInt8(settings.dataBits)], eventLoop: eventLoop),
         request(ComPort.setParity, [ComPort.parityValue(settings.parity)], eventLoop: eventLoop),
         request(ComPort.setStopSize, [UInt8(settings.stopBits)], eventLoop: eventLoop),
         requestControl(ComPort.flowControlValue(settings.flowControl), eventLoop: eventLoop)]
    }

    /// Sends the five SETs of `settings` and checks the answers against them.
    func apply(_ settings: SerialSettings, eventLoop: any EventLoop) -> EventLoopFuture<Void> {
        EventLoopFuture.whenAllSucceed(applyRequests(settings, eventLoop: eventLoop), on: eventLoop).assumeIsolated().flatMapThrowing { [self] _ in
            if let mismatch = mismatch(settings, dtr: nil, rts: nil) { throw mismatch }
        }.nonisolated()
    }

    /// Raises or lowers DTR and RTS (SET-CONTROL) and checks the answers.
    func setLines(_ lines: ModemLines, _ on: Bool, eventLoop: any EventLoop) -> EventLoopFuture<Void> {
        var values: [UInt8] = []
        if lines.contains(.dtr) { values.append(on ? ComPort.Control.dtrOn : ComPort.Control.dtrOff) }
        if lines.contains(.rts) { values.append(on ? ComPort.Control.rtsOn : ComPort.Control.rtsOff) }
        let answers = values.map { requestControl($0, eventLoop: eventLoop) }
        let dtr: Bool? = lines.contains(.dtr) ? on : nil
        let rts: Bool? = lines.contains(.rts) ? on : nil
        return EventLoopFuture.whenAllSucceed(answers, on: eventLoop).assumeIsolated().flatMapThrowing { [self] _ in
            if let mismatch = mismatch(inForce, dtr: dtr, rts: rts) { throw mismatch }
        }.nonisolated()
    }

    /// The input lines as last notified (a poll when none came yet), with DTR and RTS as last
    /// answered.
    func modemLines(eventLoop: any EventLoop) -> EventLoopFuture<ModemLines> {
        if let inputLines { return eventLoop.makeSucceededFuture(inputLines.union(outputLines)) }
        let describing = options.describing
        return request(ComPort.notifyModemState, [], eventLoop: eventLoop).assumeIsolated().map { [self] value in
            ComPort.modemLines(value.first ?? 0).union(outputLines)
        }.flatMapErrorThrowing { error in
            guard let error = error as? TransportError, error.kind == .timedOut else { throw error }
            throw TransportError(.unsupported, "\(describing) reports no modem lines: it sent no NOTIFY-MODEMSTATE and did not answer a poll")
        }.nonisolated()
    }

    /// A sequence of the input lines: the ones known now (if any), then each change.
    func watchModemLines() -> AsyncThrowingStream<ModemLines, any Error> {
        let (stream, continuation) = AsyncThrowingStream<ModemLines, any Error>.makeStream(bufferingPolicy: .bufferingNewest(64))
        guard let context else {
            continuation.finish(throwing: TransportError(.disconnected, "\(options.describing) is closed"))
            return stream
        }
        if let inputLines { continuation.yield(inputLines) }
        let key = nextWatcher
        nextWatcher += 1
        modemWatchers[key] = continuation
        let eventLoop = context.eventLoop
        let bound = NIOLoopBound(self, eventLoop: eventLoop)
        continuation.onTermination = { _ in eventLoop.execute { bound.value.stopWatching(key) } }
        return stream
    }

    func stopWatching(_ key: Int) { modemWatchers.removeValue(forKey: key) }

    // MARK: Outbound

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        if let buffer = outbound.data(unwrapOutboundIn(data), promise: promise, allocator: context.channel.allocator) {
            context.write(wrapOutboundOut(buffer), promise: promise)
        }
    }

    /// Telnet negotiation goes out from this handler, past the escaping of data (and is not held:
    /// RFC 2217's suspension is of its own option's traffic and the data).
    private func send(_ context: ChannelHandlerContext, _ bytes: [UInt8]) {
        context.writeAndFlush(wrapOutboundOut(context.channel.allocator.buffer(bytes: bytes)), promise: nil)
    }

    /// What is known, for the connection's metadata.
    var facts: [String: String] {
        var facts = ["rfc2217": "COM-PORT-OPTION", "rfc2217.settings": inForce.summary]
        if let signature { facts["rfc2217.signature"] = signature }
        if options.ignoreSetControl { facts["rfc2217.setControl"] = "not answered (ignoreSetControl)" }
        return facts
    }
}

/// The handler of each channel the layer was installed on (Happy Eyeballs may try several), so
/// the connect finds it without a pipeline lookup that a quick close would make fail.
final class RFC2217Handlers: Sendable {
    private let handlers = Locked<[ObjectIdentifier: NIOLoopBound<RFC2217ClientHandler>]>([:])

    func add(_ handler: RFC2217ClientHandler, on channel: any Channel) {
        let bound = NIOLoopBound(handler, eventLoop: channel.eventLoop)
        handlers.withLock { $0[ObjectIdentifier(channel)] = bound }
    }

    func take(for channel: any Channel) -> NIOLoopBound<RFC2217ClientHandler>? {
        handlers.withLock { handlers in
            defer { handlers = [:] }
            return handlers[ObjectIdentifier(channel)]
        }
    }
}
