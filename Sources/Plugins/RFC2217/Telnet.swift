// Telnet.swift: the part of Telnet (RFC 854) that RFC 2217 runs on: IAC escaping of data, option
// negotiation commands (RFC 855: WILL, WONT, DO, DONT) and subnegotiation (SB … IAC SE), with
// IAC doubled inside subnegotiation values too (RFC 855). No NVT translation: COM-PORT sessions
// negotiate BINARY both ways, and bytes pass as they are.
//
// The parser keeps its state between reads, so IAC at the end of one read and its command at the
// start of the next are one command. A subnegotiation is bounded (a peer that never sends IAC SE
// cannot make it grow without limit).

/// Telnet's command bytes and the options RFC 2217 sessions use.
enum Telnet {
    static let se: UInt8 = 240
    static let nop: UInt8 = 241
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

/// What the parser found in the bytes from the peer, in order.
enum TelnetEvent: Equatable {
    /// Data bytes (IACs undoubled).
    case data([UInt8])
    /// `IAC WILL/WONT/DO/DONT option`.
    case negotiation(verb: UInt8, option: UInt8)
    /// `IAC SB option payload IAC SE`, the payload undoubled.
    case subnegotiation(option: UInt8, payload: [UInt8])
    /// A subnegotiation longer than ``Telnet/maximumSubnegotiation``, or IAC followed by a byte
    /// that is no command inside one: the peer does not speak Telnet as RFC 854 says.
    case malformed(String)
}

/// Splits the bytes from a Telnet peer into data, negotiations and subnegotiations. Other commands
/// (NOP, GA, AYT, …) are dropped: they carry nothing for a COM-PORT session.
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
