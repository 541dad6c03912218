// ComPortOption.swift: RFC 2217's COM-PORT-OPTION (Telnet option 44): the subnegotiation
// commands, their value encodings, and the line and modem state bits. A client sends command N
// (0…12); the server answers and notifies with N + 100. A value of 0 in a SET is a query: the
// server answers with the value in force.
//
//   SIGNATURE 0 (text), SET-BAUDRATE 1 (4 bytes, network order), SET-DATASIZE 2 (5…8),
//   SET-PARITY 3 (1 none, 2 odd, 3 even, 4 mark, 5 space), SET-STOPSIZE 4 (1, 2, 3 = 1.5),
//   SET-CONTROL 5 (below), NOTIFY-LINESTATE 6, NOTIFY-MODEMSTATE 7, FLOWCONTROL-SUSPEND 8,
//   FLOWCONTROL-RESUME 9, SET-LINESTATE-MASK 10, SET-MODEMSTATE-MASK 11, PURGE-DATA 12 (1 the
//   server's receive buffer, 2 its transmit buffer, 3 both).
//
// SET-CONTROL values: 0 ask the outbound flow control, 1 none, 2 XON/XOFF, 3 hardware; 4 ask BREAK,
// 5 BREAK on, 6 off; 7 ask DTR, 8 on, 9 off; 10 ask RTS, 11 on, 12 off; 13 ask the inbound flow
// control, 14 none, 15 XON/XOFF, 16 hardware; 17 DCD, 18 DTR, 19 DSR flow control.

@_spi(Plugins) import TransportKitCore

/// RFC 2217's subnegotiation commands, as the client sends them (the server's are + 100).
enum ComPort {
    static let signature: UInt8 = 0
    static let setBaudRate: UInt8 = 1
    static let setDataSize: UInt8 = 2
    static let setParity: UInt8 = 3
    static let setStopSize: UInt8 = 4
    static let setControl: UInt8 = 5
    static let notifyLineState: UInt8 = 6
    static let notifyModemState: UInt8 = 7
    static let flowControlSuspend: UInt8 = 8
    static let flowControlResume: UInt8 = 9
    static let setLineStateMask: UInt8 = 10
    static let setModemStateMask: UInt8 = 11
    static let purgeData: UInt8 = 12
    /// What the server adds to a command's number in its answers and notifications.
    static let serverOffset: UInt8 = 100

    static func name(_ command: UInt8) -> String {
        let names = ["SIGNATURE", "SET-BAUDRATE", "SET-DATASIZE", "SET-PARITY", "SET-STOPSIZE", "SET-CONTROL", "NOTIFY-LINESTATE",
                     "NOTIFY-MODEMSTATE", "FLOWCONTROL-SUSPEND", "FLOWCONTROL-RESUME", "SET-LINESTATE-MASK", "SET-MODEMSTATE-MASK", "PURGE-DATA"]
        let base = command >= serverOffset ? command - serverOffset : command
        return Int(base) < names.count ? names[Int(base)] : "command \(command)"
    }

    // MARK: SET-CONTROL values

    enum Control {
        static let askFlowControl: UInt8 = 0
        static let noFlowControl: UInt8 = 1
        static let xonXoff: UInt8 = 2
        static let hardware: UInt8 = 3
        static let askBreak: UInt8 = 4
        static let breakOn: UInt8 = 5
        static let breakOff: UInt8 = 6
        static let askDTR: UInt8 = 7
        static let dtrOn: UInt8 = 8
        static let dtrOff: UInt8 = 9
        static let askRTS: UInt8 = 10
        static let rtsOn: UInt8 = 11
        static let rtsOff: UInt8 = 12
        static let askInboundFlowControl: UInt8 = 13
        static let inboundNone: UInt8 = 14
        static let inboundXonXoff: UInt8 = 15
        static let inboundHardware: UInt8 = 16
    }

    /// The three SET-CONTROL values that ask, set on and set off one thing: an answer to any of
    /// them answers a request for any other (a server answers `DTR on` with 8, or with 9 when it
    /// could not).
    static func controlGroup(_ value: UInt8) -> ClosedRange<UInt8>? {
        switch value {
        case 0...3: 0...3
        case 4...6: 4...6
        case 7...9: 7...9
        case 10...12: 10...12
        case 13...16: 13...16
        default: nil
        }
    }

    static func flowControlValue(_ flow: SerialSettings.FlowControl) -> UInt8 {
        switch flow {
        case .none: Control.noFlowControl
        case .xonxoff: Control.xonXoff
        case .rtscts: Control.hardware
        }
    }

    static func flowControl(_ value: UInt8) -> SerialSettings.FlowControl? {
        switch value {
        case Control.noFlowControl: SerialSettings.FlowControl.none
        case Control.xonXoff: .xonxoff
        case Control.hardware: .rtscts
        default: nil
        }
    }

    // MARK: Values of the line settings

    static func parityValue(_ parity: SerialSettings.Parity) -> UInt8 {
        switch parity {
        case .none: 1
        case .odd: 2
        case .even: 3
        case .mark: 4
        case .space: 5
        }
    }

    static func parity(_ value: UInt8) -> SerialSettings.Parity? {
        switch value {
        case 1: SerialSettings.Parity.none
        case 2: .odd
        case 3: .even
        case 4: .mark
        case 5: .space
        default: nil
        }
    }

    /// SET-STOPSIZE: 1 and 2 (3, one and a half, has no `SerialSettings` value).
    static func stopBits(_ value: UInt8) -> Int? { value == 1 || value == 2 ? Int(value) : nil }

    /// SET-BAUDRATE's value: four bytes, network order.
    static func baudRateValue(_ rate: Int) -> [UInt8] {
        let value = UInt32(clamping: rate)
        return [UInt8(value >> 24), UInt8(truncatingIfNeeded: value >> 16), UInt8(truncatingIfNeeded: value >> 8), UInt8(truncatingIfNeeded: value)]
    }

    /// A SET-BAUDRATE answer: four bytes in network order (sredird sends four zero bytes more:
    /// the first four are taken), or one byte, Cisco IOS's rate code, which ser2net and gensio
    /// also answer with once a client asked in that form (gensio's `cisco_baud_rates`).
    static func baudRate(_ value: [UInt8]) -> Int? {
        if value.count >= 4 {
            return value.prefix(4).reduce(0) { $0 << 8 | Int($1) }
        }
        if value.count == 1 {
            let cisco: [UInt8: Int] = [3: 300, 4: 600, 5: 1200, 6: 2400, 7: 4800, 8: 9600, 10: 19_200, 12: 38_400, 13: 57_600,
                                       14: 115_200, 15: 230_400]
            return cisco[value[0]]
        }
        return nil
    }

    // MARK: Modem and line state

    /// NOTIFY-MODEMSTATE's bits (the upper four; the lower four are their changes).
    static func modemLines(_ state: UInt8) -> ModemLines {
        var lines: ModemLines = []
        if state & 0x80 != 0 { lines.insert(.cd) }
        if state & 0x40 != 0 { lines.insert(.ri) }
        if state & 0x20 != 0 { lines.insert(.dsr) }
        if state & 0x10 != 0 { lines.insert(.cts) }
        return lines
    }

    /// ModemLines as NOTIFY-MODEMSTATE's upper four bits.
    static func modemState(_ lines: ModemLines) -> UInt8 {
        var state: UInt8 = 0
        if lines.contains(.cd) { state |= 0x80 }
        if lines.contains(.ri) { state |= 0x40 }
        if lines.contains(.dsr) { state |= 0x20 }
        if lines.contains(.cts) { state |= 0x10 }
        return state
    }

    /// NOTIFY-LINESTATE's error bits: overrun (bit 1), parity (2), framing (3), break (4). The
    /// others are states, not errors (data ready 0, the transmitter's registers empty 5 and 6,
    /// timeout 7): a client asks for these four with SET-LINESTATE-MASK.
    static let lineErrorBits: UInt8 = 0x1E

    /// A NOTIFY-LINESTATE value as counts: one for each error it names.
    static func lineErrors(_ state: UInt8) -> LineErrorCounts {
        LineErrorCounts(framing: state & 0x08 != 0 ? 1 : 0, parity: state & 0x04 != 0 ? 1 : 0, overrun: state & 0x02 != 0 ? 1 : 0,
                        breaks: state & 0x10 != 0 ? 1 : 0)
    }

    /// The NOTIFY-LINESTATE bits of the errors in `counts` (both kinds of overrun are bit 1).
    static func lineState(_ counts: LineErrorCounts) -> UInt8 {
        var state: UInt8 = 0
        if counts.overrun + counts.bufferOverrun > 0 { state |= 0x02 }
        if counts.parity > 0 { state |= 0x04 }
        if counts.framing > 0 { state |= 0x08 }
        if counts.breaks > 0 { state |= 0x10 }
        return state
    }
}
