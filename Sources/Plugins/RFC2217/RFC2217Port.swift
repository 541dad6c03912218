// RFC2217Port.swift: the SerialControl of an rfc2217:// connection, and the backend that carries
// it. Each call runs on the channel's event loop, where RFC2217ClientHandler keeps the protocol's
// state, and waits there for the server's answer (never blocking the loop).

import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore

/// The backend of an `rfc2217://` connection: the bytes are the TCP (or TLS) connection's, with
/// the Telnet layer in front; control goes to its handler.
final class RFC2217Backend: WrappingBackend, SerialControlling {
    let wrapped: Connection
    let channel: any Channel
    let handler: NIOLoopBound<RFC2217ClientHandler>
    let describing: String

    init(wrapping connection: Connection, channel: any Channel, handler: NIOLoopBound<RFC2217ClientHandler>, describing: String) {
        wrapped = connection
        self.channel = channel
        self.handler = handler
        self.describing = describing
    }

    func read() async throws -> ByteBuffer? { try await wrapped.readBuffer() }
    func write(_ buffer: ByteBuffer) async throws { try await wrapped.write(buffer) }
    func closeWrite() async throws { try await wrapped.closeWrite() }
    func close() async throws {
        // What waits on the port (a modem-line sequence) ends without an error: the app closed it.
        _ = try? await onLoop { handler, eventLoop in
            handler.closeLocally()
            return eventLoop.makeSucceededVoidFuture()
        }
        try await wrapped.close()
    }
    func connectionDropped() { wrapped.abort() }

    func serialControl(through connection: Connection) -> any SerialControl {
        RFC2217Port(backend: self, connection: connection)
    }

    /// Runs `body` with the handler on the event loop and waits for the future it returns.
    func onLoop<Value: Sendable>(_ body: @escaping @Sendable (RFC2217ClientHandler, any EventLoop) throws -> EventLoopFuture<Value>) async throws -> Value {
        let handler = handler
        let eventLoop = channel.eventLoop
        return try await eventLoop.flatSubmit { () -> EventLoopFuture<Value> in
            do {
                return try body(handler.value, eventLoop)
            } catch {
                return eventLoop.makeFailedFuture(error)
            }
        }.get()
    }
}

/// Control of a serial port served by an RFC 2217 server: ``SerialControl`` over the network.
struct RFC2217Port: SerialControl {
    let backend: RFC2217Backend
    let connection: Connection

    var port: String { backend.describing }

    func settings() async throws -> SerialSettings {
        try await connection.performControl(ControlOperation("settings?"), describe: { $0.summary }) {
            try await backend.onLoop { handler, eventLoop in eventLoop.makeSucceededFuture(handler.inForce) }
        }
    }

    func apply(_ settings: SerialSettings) async throws {
        let settings = try settings.validated()
        try await connection.performControl(ControlOperation("settings", settings.summary)) {
            try await backend.onLoop { handler, eventLoop in handler.apply(settings, eventLoop: eventLoop) }
        }
    }

    /// The input lines as the server last notified them (NOTIFY-MODEMSTATE, which servers send
    /// when a line changes; asked for with a poll only when none came yet, as some servers do not
    /// answer polls), and DTR and RTS as the server last answered for them.
    func modemLines() async throws -> ModemLines {
        try await connection.performControl(ControlOperation("modem lines?"), describe: { $0.description }) {
            try await backend.onLoop { handler, eventLoop in handler.modemLines(eventLoop: eventLoop) }
        }
    }

    func setLines(_ lines: ModemLines, _ on: Bool) async throws {
        guard !lines.isEmpty, lines.isSubset(of: [.dtr, .rts]) else {
            throw TransportError(.misuse, "only DTR and RTS can be set; \(lines.subtracting([.dtr, .rts])) are inputs")
        }
        try await connection.performControl(ControlOperation(lines.description, on ? "on" : "off")) {
            try await backend.onLoop { handler, eventLoop in handler.setLines(lines, on, eventLoop: eventLoop) }
        }
    }

    /// SET-CONTROL BREAK on or off, answered by the server.
    func setBreak(_ on: Bool) async throws {
        try await connection.performControl(ControlOperation("break", on ? "on" : "off")) {
            try await control(on ? ComPort.Control.breakOn : ComPort.Control.breakOff)
        }
    }

    private func control(_ value: UInt8) async throws {
        _ = try await backend.onLoop { handler, eventLoop in handler.requestControl(value, eventLoop: eventLoop) }
    }

    /// PURGE-DATA: the server's receive buffer (`.input`, with what this side holds unread), its
    /// transmit buffer (`.output`), or both.
    func flush(_ queue: FlushQueue) async throws {
        try await connection.performControl(ControlOperation("flush", queue.rawValue)) {
            let value: UInt8 = switch queue {
            case .input: 1
            case .output: 2
            case .both: 3
            }
            // The handler drops the data that arrives until the server's answer; what was
            // received before is dropped here.
            _ = try await backend.onLoop { handler, eventLoop in handler.request(ComPort.purgeData, [value], eventLoop: eventLoop) }
            if queue != .output {
                backend.wrapped.backend(as: ChannelBackend.self)?.discardBufferedInbound()
                connection.discardUnreadInput()
            }
        }
    }

    /// Waits until every byte written so far is on its way to the server (RFC 2217 has no way to
    /// ask the server whether its port has sent them).
    func drain() async throws {
        await connection.performControl(ControlOperation("drain")) {
            await backend.wrapped.backend(as: ChannelBackend.self)?.flushPendingWrites()
        }
    }

    /// The line errors the server notified since the connection opened (NOTIFY-LINESTATE: each
    /// notification counts one for each error it names, overrun, parity, framing, break). A server
    /// whose port counts nothing (a pty) notifies none, so these stay zero.
    func lineErrors() async throws -> LineErrorCounts {
        try await connection.performControl(ControlOperation("line errors?"), describe: { $0.description }) {
            try await backend.onLoop { handler, eventLoop in eventLoop.makeSucceededFuture(handler.lineErrors) }
        }
    }

    func modemLineChanges() async throws -> AsyncThrowingStream<ModemLines, any Error> {
        try await connection.performControl(ControlOperation("modem line changes")) {
            let first = try await modemLines().intersection(ModemLines.inputs)
            let (stream, continuation) = AsyncThrowingStream<ModemLines, any Error>.makeStream(bufferingPolicy: .bufferingNewest(64))
            continuation.yield(first)
            let upstream = try await backend.onLoop { handler, eventLoop in eventLoop.makeSucceededFuture(handler.watchModemLines()) }
            let relay = Task {
                var last = first
                do {
                    for try await lines in upstream where lines != last {
                        continuation.yield(lines)
                        last = lines
                    }
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }
            continuation.onTermination = { _ in relay.cancel() }
            return stream
        }
    }
}
