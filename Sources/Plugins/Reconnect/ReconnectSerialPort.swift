// ReconnectSerialPort.swift: SerialControl of a `reconnect+` connection around a serial line. Each
// call goes to the port of the connection up now (announced to the layers around the reconnect
// connection, and by that port to the layers beneath it); line settings, DTR and RTS are
// remembered and set again on each new connection.

@_spi(Plugins) import TransportKitCore

struct ReconnectSerialPort: SerialControl {
    let core: ReconnectCore
    /// The connection the application holds: control calls are announced to its layers.
    let connection: Connection

    var port: String { core.current?.serialPort?.port ?? core.describing }

    /// The port of the connection up now.
    private func now() throws -> any SerialControl {
        guard let current = core.current else {
            throw TransportError(.disconnected, "\(core.describing) is not connected (reconnecting); call again once it is back "
                                 + "(connection.events() says when). What was set before the loss is set again by itself")
        }
        guard let port = current.serialPort else {
            throw TransportError(.unsupported, "\(current.url.shown) has no serial line")
        }
        return port
    }

    func settings() async throws -> SerialSettings {
        try await connection.performControl(ControlOperation("settings?"), describe: { $0.summary }) { try await now().settings() }
    }

    func apply(_ settings: SerialSettings) async throws {
        try await connection.performControl(ControlOperation("settings", settings.summary)) {
            try await now().apply(settings)
            core.remember { $0.settings = settings }
        }
    }

    func modemLines() async throws -> ModemLines {
        try await connection.performControl(ControlOperation("modem lines?"), describe: { $0.description }) { try await now().modemLines() }
    }

    func setLines(_ lines: ModemLines, _ on: Bool) async throws {
        try await connection.performControl(ControlOperation(lines.description, on ? "on" : "off")) {
            try await now().setLines(lines, on)
            core.remember { control in
                if lines.contains(.dtr) { control.dtr = on }
                if lines.contains(.rts) { control.rts = on }
            }
        }
    }

    /// A break is not set again on a new connection: it belongs to the line it was sent on.
    func setBreak(_ on: Bool) async throws {
        try await connection.performControl(ControlOperation("break", on ? "on" : "off")) { try await now().setBreak(on) }
    }

    func flush(_ queue: FlushQueue) async throws {
        try await connection.performControl(ControlOperation("flush", queue.rawValue)) { try await now().flush(queue) }
    }

    func drain() async throws {
        try await connection.performControl(ControlOperation("drain")) { try await now().drain() }
    }

    /// The changes of the port up now: the sequence ends when that connection is lost (ask again
    /// after the next `.connected` event).
    func modemLineChanges() async throws -> AsyncThrowingStream<ModemLines, any Error> {
        try await connection.performControl(ControlOperation("modem line changes")) { try await now().modemLineChanges() }
    }

    /// The counts of the port up now (a new connection's driver may count from zero).
    func lineErrors() async throws -> LineErrorCounts {
        try await connection.performControl(ControlOperation("line errors?"), describe: { $0.description }) { try await now().lineErrors() }
    }
}
