// RFC2217Server.swift: the server side of RFC 2217, for `transportkit bridge --listen
// rfc2217://…`: a SwiftNIO handler on each accepted channel (Telnet negotiation, IAC escaping,
// the client's COM-PORT commands as requests) and RFC2217Session, which serves those requests
// with the target's SerialControl and answers each with what is in force.
//
// Line errors (NOTIFY-LINESTATE): no kernel call waits for them, so while the client's
// SET-LINESTATE-MASK asks for any, the session reads the port's counters (TIOCGICOUNT) four times a
// second and notifies the errors that grew, as the mask allows; a port that counts nothing (a pty)
// is read once. Over TLS it listens as tls+rfc2217:// (TLSPlugin.listenWrapped puts TLS beneath
// this handler).
//
// What clients expect, from pyserial 3.5 and the research notes: an answer to every command,
// PURGE-DATA included (pyserial waits for both purges at open, even with ign_set_control), with
// the value in force; pyserial rejects an answer that differs from its request, so on a port
// without modem lines (a pty) DTR and RTS are answered as asked and kept as a virtual state.

import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore

/// A COM-PORT command from an RFC 2217 client: the command (0…12) and its value; or Telnet's BRK
/// (command ``Telnet/brk``, no value).
struct RFC2217Request: Sendable, Equatable {
    var command: UInt8
    var value: [UInt8]
}

/// The server's protocol state, on the accepted channel's event loop.
final class RFC2217ServerHandler: ChannelDuplexHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer
    typealias OutboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private var parser = TelnetParser()
    private var context: ChannelHandlerContext?
    private var telnet = TelnetOptions(wanted: [Telnet.binary, Telnet.suppressGoAhead, Telnet.comPortOption])
    /// The client's requests, in order, for the session that serves them.
    let requests: AsyncStream<RFC2217Request>
    private let requestsIn: AsyncStream<RFC2217Request>.Continuation
    /// Data and answers for the client, held while it has suspended this side (FLOWCONTROL-SUSPEND).
    private var outbound = TelnetOutbound()
    /// Which modem-state bits the client wants notified (SET-MODEMSTATE-MASK; 255 at first).
    private(set) var modemStateMask: UInt8 = 255
    private(set) var lineStateMask: UInt8 = 0

    init() {
        (requests, requestsIn) = AsyncStream<RFC2217Request>.makeStream(bufferingPolicy: .bufferingNewest(256))
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
        // As ser2net opens: this side's BINARY and SGA offered, the client's asked for, and the
        // client's COM-PORT-OPTION invited.
        let bytes = telnet.ask([(Telnet.will, Telnet.binary), (Telnet.do, Telnet.binary), (Telnet.will, Telnet.suppressGoAhead),
                                (Telnet.do, Telnet.suppressGoAhead), (Telnet.do, Telnet.comPortOption)])
        send(context, bytes)
    }

    func channelInactive(context: ChannelHandlerContext) {
        RFC2217Session.forget(context.channel)
        requestsIn.finish()
        ChannelHandlerContext.fail(outbound.drop(), TransportError(.disconnected, "the RFC 2217 client left"))
        context.fireChannelInactive()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        // The client's FIN (accepted channels allow half-closure, so the channel stays active
        // until this side closes it): no request will follow, and serve() returns once the
        // ones before it are answered.
        if case .inputClosed = event as? ChannelEvent { requestsIn.finish() }
        context.fireUserInboundEventTriggered(event)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        requestsIn.finish()
        self.context = nil
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var buffer = unwrapInboundIn(data)
        guard let bytes = buffer.readBytes(length: buffer.readableBytes) else { return }
        for event in parser.parse(bytes) {
            switch event {
            case .data(let payload):
                let buffer = context.channel.allocator.buffer(bytes: payload)
                if breakPending { heldForBreak.append(buffer) } else { context.fireChannelRead(wrapInboundOut(buffer)) }
            case .negotiation(let verb, let option):
                negotiate(context, verb, option)
            case .subnegotiation(let option, let payload):
                guard option == Telnet.comPortOption, let command = payload.first, command < ComPort.serverOffset else { continue }
                request(context, RFC2217Request(command: command, value: Array(payload.dropFirst())))
            case .breakKey:
                // The bytes after it wait until the break was sent (SysRq: break, then the key);
                // a break key pressed again meanwhile is the same break.
                guard !breakPending else { continue }
                breakPending = true
                requestsIn.yield(RFC2217Request(command: Telnet.brk, value: []))
            case .malformed(let what):
                context.fireErrorCaught(TransportError(.protocolError, "an RFC 2217 client broke the Telnet protocol: \(what)"))
                context.close(promise: nil)
                return
            }
        }
    }

    /// Commands this handler answers itself (flow of data to the client, masks); the rest go to
    /// the session.
    private func request(_ context: ChannelHandlerContext, _ request: RFC2217Request) {
        switch request.command {
        case ComPort.flowControlSuspend:
            outbound.suspend()
        case ComPort.flowControlResume:
            context.send(outbound.resume())
        case ComPort.setModemStateMask:
            modemStateMask = request.value.first ?? modemStateMask
            answer(ComPort.setModemStateMask, [modemStateMask])
        case ComPort.setLineStateMask:
            lineStateMask = request.value.first ?? lineStateMask
            answer(ComPort.setLineStateMask, [lineStateMask])
        default:
            requestsIn.yield(request)
        }
    }

    private func negotiate(_ context: ChannelHandlerContext, _ verb: UInt8, _ option: UInt8) {
        if let reply = telnet.answer(verb, option) { send(context, reply) }
    }

    /// Sends the answer to `command` (as command + 100) with `value`.
    func answer(_ command: UInt8, _ value: [UInt8]) {
        guard let context else { return }
        let bytes = Telnet.subnegotiation(Telnet.comPortOption, [command + ComPort.serverOffset] + value)
        if outbound.command(bytes, sent: {}) { send(context, bytes) }
    }

    /// Notifies the client of the modem lines, as its mask asks (state and change bits).
    func notifyModemState(_ lines: ModemLines, changed: ModemLines) {
        var state = ComPort.modemState(lines)
        if changed.contains(.cts) { state |= 0x01 }
        if changed.contains(.dsr) { state |= 0x02 }
        if changed.contains(.ri) && !lines.contains(.ri) { state |= 0x04 }
        if changed.contains(.cd) { state |= 0x08 }
        let masked = state & modemStateMask
        if masked != 0 { answer(ComPort.notifyModemState, [masked]) }
    }

    /// Telnet's BRK is being sent: data after it is held (and no more is read) until ``breakSent()``.
    private var breakPending = false
    private var heldForBreak: [ByteBuffer] = []
    private var readHeld = false

    func read(context: ChannelHandlerContext) {
        if breakPending { readHeld = true } else { context.read() }
    }

    /// The break for the client's BRK was sent: the data after it goes on to the port.
    func breakSent() {
        guard breakPending, let context else { return }
        breakPending = false
        let held = heldForBreak
        heldForBreak.removeAll()
        for buffer in held { context.fireChannelRead(wrapInboundOut(buffer)) }
        if !held.isEmpty { context.fireChannelReadComplete() }
        if readHeld {
            readHeld = false
            context.read()
        }
    }

    /// Notifies the client of line errors (NOTIFY-LINESTATE), as its mask asks.
    func notifyLineState(_ state: UInt8) {
        let masked = state & lineStateMask
        if masked != 0 { answer(ComPort.notifyLineState, [masked]) }
    }

    func write(context: ChannelHandlerContext, data: NIOAny, promise: EventLoopPromise<Void>?) {
        if let buffer = outbound.data(unwrapOutboundIn(data), promise: promise, allocator: context.channel.allocator) {
            context.write(wrapOutboundOut(buffer), promise: promise)
        }
    }

    private func send(_ context: ChannelHandlerContext, _ bytes: [UInt8]) {
        context.writeAndFlush(wrapOutboundOut(context.channel.allocator.buffer(bytes: bytes)), promise: nil)
    }
}

/// One RFC 2217 client of a listener: its requests, served with a serial port's control.
///
/// ```swift
/// // In a bridge, once the target is open:
/// if let session = client.rfc2217Session, let port = target.serialPort { await session.serve(port) }
/// ```
public final class RFC2217Session: Sendable {
    let handler: NIOLoopBound<RFC2217ServerHandler>
    let eventLoop: any EventLoop
    /// Requests read once: the handler's stream, taken by the first serve().
    private let requests: Locked<AsyncStream<RFC2217Request>?>
    /// DTR and RTS as last asked, for a port without modem lines (answered as asked).
    private let virtualLines = Locked<ModemLines>([.dtr, .rts])
    /// Whether the client's BREAK is on: released when the client leaves.
    private let breakOn = Locked(false)
    /// The port's line-error counters as last reported to the client (nil before the first read).
    private let reportedLineErrors = Locked<LineErrorCounts?>(nil)
    private let signature: String

    /// The session of each accepted channel, until it closes.
    private static let sessions = Locked<[ObjectIdentifier: RFC2217Session]>([:])

    static func register(_ session: RFC2217Session, for channel: any Channel) {
        sessions.withLock { $0[ObjectIdentifier(channel)] = session }
    }

    static func forget(_ channel: any Channel) {
        _ = sessions.withLock { $0.removeValue(forKey: ObjectIdentifier(channel)) }
    }

    static func session(of channel: any Channel) -> RFC2217Session? {
        sessions.withLock { $0[ObjectIdentifier(channel)] }
    }

    init(handler: RFC2217ServerHandler, eventLoop: any EventLoop, signature: String) {
        self.handler = NIOLoopBound(handler, eventLoop: eventLoop)
        self.eventLoop = eventLoop
        requests = Locked(handler.requests)
        self.signature = signature
    }

    private func answer(_ command: UInt8, _ value: [UInt8]) {
        let handler = handler
        eventLoop.execute { handler.value.answer(command, value) }
    }

    /// Serves the client's requests with `port` until the client leaves: each SET applied and
    /// answered with what is in force, queries answered, PURGE-DATA flushed, and the modem lines'
    /// changes notified as the client's mask asks. A BREAK the client turned on is held until it
    /// turns it off, and released when it leaves.
    public func serve(_ port: any SerialControl) async {
        guard let requests = self.requests.withLock({ stream in defer { stream = nil }; return stream }) else { return }
        let notifier = Task {
            guard let changes = try? await port.modemLineChanges() else { return }
            var last: ModemLines?
            do {
                for try await lines in changes {
                    let changed = last.map { lines.symmetricDifference($0) } ?? []
                    last = lines
                    let handler = handler
                    eventLoop.execute { handler.value.notifyModemState(lines, changed: changed) }
                }
            } catch {}
        }
        let lineWatch = Task { await watchLineErrors(port) }
        for await request in requests {
            let value = await serve(request, with: port)
            if let value { answer(request.command, value) }
        }
        // Both watches end before serve returns, so none starts on a port its caller then closes.
        notifier.cancel()
        lineWatch.cancel()
        await notifier.value
        await lineWatch.value
        // A client that leaves with BREAK on does not leave the line in break.
        if breakOn.withLock({ state in defer { state = false }; return state }) { try? await port.setBreak(false) }
    }

    /// Reads the port's counters once at the start (so errors between the client's
    /// SET-LINESTATE-MASK and the next round are not taken as the starting point), then, while
    /// the client's mask asks for line errors, four times a second, notifying what grew; ends at
    /// once on a port that counts none.
    private func watchLineErrors(_ port: any SerialControl) async {
        guard await grownLineErrors(port) != nil else { return }
        let handler = handler
        while !Task.isCancelled {
            try? await Task.sleep(for: .milliseconds(250))
            let mask = try? await eventLoop.submit { handler.value.lineStateMask }.get()
            if let mask, mask & ComPort.lineErrorBits != 0 {
                guard let state = await grownLineErrors(port) else { return }
                if state != 0 { eventLoop.execute { handler.value.notifyLineState(state) } }
            }
        }
    }

    /// The NOTIFY-LINESTATE bits of the errors counted since the last report (0 at the first
    /// read), or nil when the port counts none. The watch and a client's poll may read at once:
    /// a reading older than the one kept (any counter lower: one port's counters never go back
    /// while it is open) reports nothing and is not kept, so no error is reported twice.
    private func grownLineErrors(_ port: any SerialControl) async -> UInt8? {
        guard let now = try? await ControlOperation.$polling.withValue(true, operation: { try await port.lineErrors() }) else { return nil }
        return reportedLineErrors.withLock { reported -> UInt8 in
            guard let before = reported else {
                reported = now
                return 0
            }
            guard now.framing >= before.framing, now.parity >= before.parity, now.overrun >= before.overrun,
                  now.bufferOverrun >= before.bufferOverrun, now.breaks >= before.breaks else { return 0 }
            reported = now
            return ComPort.lineState(now.since(before))
        }
    }

    /// The answer's value for `request`, or nil for none (a client's own signature).
    private func serve(_ request: RFC2217Request, with port: any SerialControl) async -> [UInt8]? {
        let first = request.value.first ?? 0
        func settings(_ change: (inout SerialSettings) -> Void) async -> SerialSettings? {
            guard var settings = try? await port.settings() else { return nil }
            change(&settings)
            try? await port.apply(settings)
            return try? await port.settings()
        }
        switch request.command {
        case ComPort.signature:
            return request.value.isEmpty ? Array(signature.utf8) : nil
        case ComPort.setBaudRate:
            let rate = ComPort.baudRate(request.value) ?? 0
            let now = rate == 0 ? try? await port.settings() : await settings { $0.baudRate = rate }
            return ComPort.baudRateValue(now?.baudRate ?? 0)
        case ComPort.setDataSize:
            let now = first == 0 ? try? await port.settings() : await settings { $0.dataBits = Int(first) }
            return [UInt8(now?.dataBits ?? 0)]
        case ComPort.setParity:
            let parity = ComPort.parity(first)
            let now = parity == nil ? try? await port.settings() : await settings { $0.parity = parity ?? .none }
            return [now.map { ComPort.parityValue($0.parity) } ?? 0]
        case ComPort.setStopSize:
            let bits = ComPort.stopBits(first)
            let now = bits == nil ? try? await port.settings() : await settings { $0.stopBits = bits ?? 1 }
            return [UInt8(now?.stopBits ?? 0)]
        case ComPort.setControl:
            return [await control(first, port)]
        case ComPort.notifyModemState:
            let lines = (try? await port.modemLines()) ?? []
            return [ComPort.modemState(lines)]
        case Telnet.brk:
            // Telnet's break key (not a COM-PORT command, so never answered): a break of 250 ms,
            // as ser2net sends for it (the kernel sends what was written before it first), unless
            // the client holds a break on already; then the data after it goes on.
            if !breakOn.withLock({ $0 }) { try? await port.sendBreak() }
            let handler = handler
            eventLoop.execute { handler.value.breakSent() }
            return nil
        case ComPort.notifyLineState:
            // A poll: the errors counted since the last report.
            return [await grownLineErrors(port) ?? 0]
        case ComPort.purgeData:
            let queue: FlushQueue? = switch first {
            case 1: .input
            case 2: .output
            case 3: .both
            default: nil
            }
            if let queue { try? await port.flush(queue) }
            return [first]
        default:
            return nil
        }
    }

    /// SET-CONTROL: applied where asked, answered with the state in force.
    private func control(_ value: UInt8, _ port: any SerialControl) async -> UInt8 {
        switch value {
        case ComPort.Control.askFlowControl...ComPort.Control.hardware:
            if let flow = ComPort.flowControl(value), var settings = try? await port.settings() {
                settings.flowControl = flow
                try? await port.apply(settings)
            }
            let now = (try? await port.settings())?.flowControl ?? .none
            return ComPort.flowControlValue(now)
        case ComPort.Control.askBreak:
            return breakOn.withLock { $0 } ? ComPort.Control.breakOn : ComPort.Control.breakOff
        case ComPort.Control.breakOn, ComPort.Control.breakOff:
            // Held until the client says BREAK off (or leaves); answered with the state in force.
            let on = value == ComPort.Control.breakOn
            if (try? await port.setBreak(on)) != nil { breakOn.withLock { $0 = on } }
            return breakOn.withLock { $0 } ? ComPort.Control.breakOn : ComPort.Control.breakOff
        case ComPort.Control.askDTR...ComPort.Control.rtsOff:
            let isDTR = value <= ComPort.Control.dtrOff
            let line: ModemLines = isDTR ? .dtr : .rts
            let asked: Bool? = switch value {
            case ComPort.Control.dtrOn, ComPort.Control.rtsOn: true
            case ComPort.Control.dtrOff, ComPort.Control.rtsOff: false
            default: nil
            }
            if let asked {
                do {
                    try await port.setLines(line, asked)
                } catch {
                    // No modem lines (a pty): kept as asked, and answered so.
                    virtualLines.withLock { if asked { $0.insert(line) } else { $0.remove(line) } }
                }
            }
            let lines = (try? await port.modemLines()) ?? virtualLines.withLock { $0 }
            let on = lines.contains(line)
            return isDTR ? (on ? ComPort.Control.dtrOn : ComPort.Control.dtrOff) : (on ? ComPort.Control.rtsOn : ComPort.Control.rtsOff)
        case ComPort.Control.askInboundFlowControl...ComPort.Control.inboundHardware:
            return ComPort.Control.inboundNone
        default:
            return value
        }
    }
}

extension Connection {
    /// On a connection an `rfc2217://` listener accepted: the client's COM-PORT requests, to be
    /// served with a serial port (``RFC2217Session/serve(_:)``); `nil` on any other connection.
    public var rfc2217Session: RFC2217Session? {
        backend(as: ChannelBackend.self).flatMap { RFC2217Session.session(of: $0.channel) }
    }
}
