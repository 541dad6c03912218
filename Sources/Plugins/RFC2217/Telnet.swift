// Telnet.swift: the part of Telnet (RFC 854) that RFC 2217 runs on: IAC escaping of data, option
// negotiation commands (RFC 855: WILL, WONT, DO, DONT) and subnegotiation (SB … IAC SE), with
// IAC doubled inside subnegotiation values too (RFC 855). No NVT translation: COM-PORT sessions
// negotiate BINARY both ways, and bytes pass as they are.
//
// The parser keeps its state between reads, so IAC at the end of one read and its command at the
// start of the next are one command. A subnegotiation is bounded (a peer that never sends IAC SE
// cannot make it grow without limit).

import NIOCore

/// Telnet's command bytes and the options RFC 2217 sessions use.
enum Telnet {
    static let se: UInt8 = 240
    static let nop: UInt8 = 241
    /// BRK (RFC 854's "break or attention"): a serial server sends a break on its port for it.
    static let brk: UInt8 = 243
    static let sb: UInt8 = 250
    static let will: UInt8 = 251
    static let wont: UInt8 = 252
    static let `do`: UInt8 = 253
    static let dont: UInt8 = 254
    static let iac: UInt8 = 255

    /// Options (IANA Telnet option registry).
    static let binary: UInt8 = 0
    static let echo: UInt8 = 1
    static let suppressGoAhead: UInt8 = 3
    static let comPortOption: UInt8 = 44

    /// The longest subnegotiation kept: RFC 2217's longest is a signature; 4 KiB is plenty.
    static let maximumSubnegotiation = 4096

    /// `IAC verb option`.
    static func command(_ verb: UInt8, _ option: UInt8) -> [UInt8] { [iac, verb, option] }

    /// `IAC SB option payload IAC SE`, with every IAC in `payload` doubled.
    static func subnegotiation(_ option: UInt8, _ payload: [UInt8]) -> [UInt8] {
        var bytes: [UInt8] = [iac, sb, option]
        bytes.reserveCapacity(payload.count + 5)
        for byte in payload {
            bytes.append(byte)
            if byte == iac { bytes.append(iac) }
        }
        bytes += [iac, se]
        return bytes
    }

    /// `data` with every IAC doubled, as it goes on the wire; `nil` when it has none (the common
    /// case: no copy).
    static func escaped(_ data: some Collection<UInt8>) -> [UInt8]? {
        guard data.contains(iac) else { return nil }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(data.count + 16)
        for byte in data {
            bytes.append(byte)
            if byte == iac { bytes.append(iac) }
        }
        return bytes
    }

    static func verbName(_ verb: UInt8) -> String {
        switch verb {
        case will: "WILL"
        case wont: "WONT"
        case `do`: "DO"
        case dont: "DONT"
        default: "command \(verb)"
        }
    }
}

/// The state of Telnet options on both sides of one connection, and the answers to the peer's
/// negotiation (RFC 854): an option this side takes is agreed to once, one it does not is refused,
/// only a change of state is acknowledged, and the answer to this side's own request is taken
/// without a reply (so neither side loops).
struct TelnetOptions {
    /// The options this side takes, on either side.
    let wanted: Set<UInt8>
    /// In effect on this side (it said WILL and the peer DO, or the reverse).
    private(set) var local: Set<UInt8> = []
    /// In effect on the peer's side.
    private(set) var remote: Set<UInt8> = []
    /// Requests this side sent that are not answered yet.
    private var asked: Set<[UInt8]> = []

    init(wanted: Set<UInt8>) { self.wanted = wanted }

    /// This side's requests, recorded, as bytes to send.
    mutating func ask(_ requests: [(verb: UInt8, option: UInt8)]) -> [UInt8] {
        var bytes: [UInt8] = []
        for (verb, option) in requests {
            asked.insert([verb, option])
            bytes += Telnet.command(verb, option)
        }
        return bytes
    }

    /// The reply to the peer's `verb` for `option`, if one is due.
    mutating func answer(_ verb: UInt8, _ option: UInt8) -> [UInt8]? {
        let takes = wanted.contains(option)
        switch verb {
        case Telnet.will:
            let answering = asked.remove([Telnet.do, option]) != nil
            if takes { return remote.insert(option).inserted && !answering ? Telnet.command(Telnet.do, option) : nil }
            return answering ? nil : Telnet.command(Telnet.dont, option)
        case Telnet.wont:
            let answering = asked.remove([Telnet.do, option]) != nil
            return remote.remove(option) != nil && !answering ? Telnet.command(Telnet.dont, option) : nil
        case Telnet.do:
            let answering = asked.remove([Telnet.will, option]) != nil
            if takes { return local.insert(option).inserted && !answering ? Telnet.command(Telnet.will, option) : nil }
            return answering ? nil : Telnet.command(Telnet.wont, option)
        case Telnet.dont:
            let answering = asked.remove([Telnet.will, option]) != nil
            return local.remove(option) != nil && !answering ? Telnet.command(Telnet.wont, option) : nil
        default:
            return nil
        }
    }
}

/// The outbound half of a Telnet session, on its channel's event loop: data with its IACs
/// doubled, and held, with commands, while the peer has suspended this side (RFC 2217's
/// FLOWCONTROL-SUSPEND: no data and no commands until RESUME), in their order. It only decides:
/// the handler does the I/O after, because a write can close the channel and re-enter the handler
/// (channelInactive) while this state would still be being changed.
struct TelnetOutbound {
    /// What waits for the peer's RESUME: data with its write's promise, or a command and what to
    /// do once it went out (start its answer's timer).
    enum Held {
        case data(ByteBuffer, EventLoopPromise<Void>?)
        case command([UInt8], sent: () -> Void)
    }

    private(set) var suspended = false
    /// Bounded without a limit of its own: a held write's promise stays pending, and the
    /// connection's writer stops at ChannelBackend's in-flight cap; commands are few per call.
    private var held: [Held] = []

    /// `buffer` with its IACs doubled to write now, or nil when it is held.
    mutating func data(_ buffer: ByteBuffer, promise: EventLoopPromise<Void>?, allocator: ByteBufferAllocator) -> ByteBuffer? {
        var buffer = buffer
        if let escaped = Telnet.escaped(buffer.readableBytesView) {
            buffer = allocator.buffer(bytes: escaped)
        }
        guard !suspended else {
            held.append(.data(buffer, promise))
            return nil
        }
        return buffer
    }

    /// `true` when a command goes out now; else it is held with `sent`.
    mutating func command(_ bytes: [UInt8], sent: @escaping () -> Void) -> Bool {
        guard !suspended else {
            held.append(.command(bytes, sent: sent))
            return false
        }
        return true
    }

    mutating func suspend() { suspended = true }

    /// What was held, to send in order.
    mutating func resume() -> [Held] {
        suspended = false
        defer { held.removeAll() }
        return held
    }

    /// What was held, to fail (the connection ended).
    mutating func drop() -> [Held] {
        defer { held.removeAll() }
        return held
    }
}

extension ChannelHandlerContext {
    /// Sends what a TelnetOutbound held, in order.
    func send(_ items: [TelnetOutbound.Held]) {
        for item in items {
            switch item {
            case .data(let buffer, let promise):
                write(NIOAny(buffer), promise: promise)
            case .command(let bytes, let sent):
                write(NIOAny(channel.allocator.buffer(bytes: bytes)), promise: nil)
                sent()
            }
        }
        if !items.isEmpty { flush() }
    }

    /// Fails the writes among what a TelnetOutbound held.
    static func fail(_ items: [TelnetOutbound.Held], _ error: any Error) {
        for case .data(_, let promise) in items { promise?.fail(error) }
    }
}

/// What the parser found in the bytes from the peer, in order.
enum TelnetEvent: Equatable {
    /// Data bytes (IACs undoubled).
    case data([UInt8])
    /// `IAC WILL/WONT/DO/DONT option`.
    case negotiation(verb: UInt8, option: UInt8)
    /// `IAC SB option payload IAC SE`, the payload undoubled.
    case subnegotiation(option: UInt8, payload: [UInt8])
    /// `IAC BRK`: the peer's break key (gensiot's escape `b`, telnet's `send brk`).
    case breakKey
    /// A subnegotiation longer than ``Telnet/maximumSubnegotiation``, or IAC followed by a byte
    /// that is no command inside one: the peer does not speak Telnet as RFC 854 says.
    case malformed(String)
}

/// Splits the bytes from a Telnet peer into data, negotiations, subnegotiations and BRK. Other
/// commands (NOP, GA, AYT, …) are dropped: they carry nothing for a COM-PORT session.
struct TelnetParser {
    private enum State {
        case data
        case iac
        case verb(UInt8)
        case sbOption
        case sbData(option: UInt8)
        case sbIAC(option: UInt8)
    }

    private var state = State.data
    private var payload: [UInt8] = []

    /// Parses `bytes`, continuing from what earlier calls left unfinished.
    mutating func parse(_ bytes: some Collection<UInt8>) -> [TelnetEvent] {
        var events: [TelnetEvent] = []
        var data: [UInt8] = []
        func flushData() {
            if !data.isEmpty {
                events.append(.data(data))
                data.removeAll(keepingCapacity: true)
            }
        }
        for byte in bytes {
            switch state {
            case .data:
                if byte == Telnet.iac { state = .iac } else { data.append(byte) }
            case .iac:
                switch byte {
                case Telnet.iac:
                    data.append(Telnet.iac)
                    state = .data
                case Telnet.will, Telnet.wont, Telnet.do, Telnet.dont:
                    state = .verb(byte)
                case Telnet.sb:
                    state = .sbOption
                case Telnet.brk:
                    flushData()
                    events.append(.breakKey)
                    state = .data
                default:
                    state = .data   // NOP, GA, AYT, …: nothing for this session
                }
            case .verb(let verb):
                flushData()
                events.append(.negotiation(verb: verb, option: byte))
                state = .data
            case .sbOption:
                payload.removeAll(keepingCapacity: true)
                state = .sbData(option: byte)
            case .sbData(let option):
                if byte == Telnet.iac {
                    state = .sbIAC(option: option)
                } else if payload.count < Telnet.maximumSubnegotiation {
                    payload.append(byte)
                } else {
                    flushData()
                    events.append(.malformed("a subnegotiation of option \(option) longer than \(Telnet.maximumSubnegotiation) bytes without IAC SE"))
                    payload.removeAll()
                    state = .data
                }
            case .sbIAC(let option):
                switch byte {
                case Telnet.iac:
                    payload.append(Telnet.iac)
                    state = .sbData(option: option)
                case Telnet.se:
                    flushData()
                    events.append(.subnegotiation(option: option, payload: payload))
                    payload.removeAll(keepingCapacity: true)
                    state = .data
                default:
                    // RFC 855 allows no other command inside a subnegotiation; some peers forget
                    // IAC SE before their next command. Take what came as the subnegotiation, and
                    // the byte as the command it starts.
                    flushData()
                    events.append(.subnegotiation(option: option, payload: payload))
                    payload.removeAll(keepingCapacity: true)
                    switch byte {
                    case Telnet.will, Telnet.wont, Telnet.do, Telnet.dont: state = .verb(byte)
                    case Telnet.sb: state = .sbOption
                    default: state = .data
                    }
                }
            }
        }
        flushData()
        return events
    }
}
