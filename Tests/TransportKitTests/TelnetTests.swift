import Testing
@testable import TransportKitCore
@testable import TransportKitRFC2217

/// The Telnet codec under RFC 2217 (RFC 854/855): escaping, negotiation and subnegotiation parsing,
/// split reads, and peers that break the rules; RFC 2217's value encodings.
@Suite("Telnet and COM-PORT-OPTION encoding")
struct TelnetTests {
    @Test func dataWithIACIsDoubledAndUndoubled() {
        #expect(Telnet.escaped([1, 2, 3]) == nil, "no IAC: no copy")
        #expect(Telnet.escaped([0xff, 7, 0xff]) == [0xff, 0xff, 7, 0xff, 0xff])
        var parser = TelnetParser()
        #expect(parser.parse([0x41, 0xff, 0xff, 0x42]) == [.data([0x41, 0xff, 0x42])])
    }

    @Test func anIACAtTheEndOfOneReadJoinsTheNextRead() {
        var parser = TelnetParser()
        #expect(parser.parse([0x41, 0xff]) == [.data([0x41])])
        #expect(parser.parse([0xff, 0x42]) == [.data([0xff, 0x42])], "IAC IAC split across reads is one data byte")
        #expect(parser.parse([0xff]).isEmpty)
        #expect(parser.parse([Telnet.do]).isEmpty)
        #expect(parser.parse([44, 0x43]) == [.negotiation(verb: Telnet.do, option: 44), .data([0x43])])
    }

    @Test func subnegotiationsUndoubleIACAndEndAtIACSE() {
        var parser = TelnetParser()
        // SET-BAUDRATE's answer with 0x0000ff00: the 0xff doubled inside the subnegotiation.
        let wire: [UInt8] = [0x61, 0xff, Telnet.sb, 44, 101, 0, 0, 0xff, 0xff, 0, 0xff, Telnet.se, 0x62]
        #expect(parser.parse(wire) == [.data([0x61]), .subnegotiation(option: 44, payload: [101, 0, 0, 0xff, 0]), .data([0x62])])
        #expect(Telnet.subnegotiation(44, [1, 0, 0, 0xff, 0]) == [0xff, Telnet.sb, 44, 1, 0, 0, 0xff, 0xff, 0, 0xff, Telnet.se])
        // One byte at a time: the same events.
        var bytewise = TelnetParser()
        let events = wire.flatMap { bytewise.parse([$0]) }
        #expect(events == [.data([0x61]), .subnegotiation(option: 44, payload: [101, 0, 0, 0xff, 0]), .data([0x62])])
    }

    @Test func breakKeyKeepsItsPlaceBetweenDataAndOtherCommandsAreDropped() {
        var parser = TelnetParser()
        #expect(parser.parse([0x41, 0xff, Telnet.brk, 0x42, 0xff, Telnet.nop, 0x43]) == [.data([0x41]), .breakKey, .data([0x42, 0x43])])
    }

    @Test func aSubnegotiationWithoutItsEndIsBoundedAndReported() {
        var parser = TelnetParser()
        var events = parser.parse([0xff, Telnet.sb, 44] + [UInt8](repeating: 7, count: Telnet.maximumSubnegotiation))
        #expect(events.isEmpty, "up to the bound it is kept")
        events = parser.parse([7, 0x41])
        #expect(events.first.map { if case .malformed = $0 { true } else { false } } == true, "\(events)")
        #expect(events.last == .data([0x41]), "the bytes after it are data again: \(events)")
    }

    @Test func aCommandInsideASubnegotiationEndsIt() {
        var parser = TelnetParser()
        // A peer that forgot IAC SE before its next negotiation.
        #expect(parser.parse([0xff, Telnet.sb, 44, 107, 0x30, 0xff, Telnet.will, 1])
                == [.subnegotiation(option: 44, payload: [107, 0x30]), .negotiation(verb: Telnet.will, option: 1)])
        // Other commands (NOP) are dropped.
        #expect(parser.parse([0x41, 0xff, Telnet.nop, 0x42]) == [.data([0x41, 0x42])])
    }

    @Test func comPortValues() {
        #expect(ComPort.baudRateValue(115_200) == [0, 1, 0xc2, 0])
        #expect(ComPort.baudRate([0, 1, 0xc2, 0]) == 115_200)
        #expect(ComPort.baudRate([0, 0]) == nil)
        #expect(ComPort.baudRate([0, 0, 0x25, 0x80, 0, 0, 0, 0]) == 9600, "sredird's eight bytes")
        #expect(ComPort.baudRate([14]) == 115_200 && ComPort.baudRate([8]) == 9600, "Cisco IOS's one-byte codes")
        #expect(ComPort.baudRate([0]) == nil && ComPort.baudRate([9]) == nil)
        for parity in SerialSettings.Parity.allCases { #expect(ComPort.parity(ComPort.parityValue(parity)) == parity) }
        #expect(ComPort.parity(0) == nil && ComPort.parity(6) == nil)
        for flow in SerialSettings.FlowControl.allCases { #expect(ComPort.flowControl(ComPort.flowControlValue(flow)) == flow) }
        #expect(ComPort.stopBits(3) == nil, "1.5 stop bits has no SerialSettings value")
        #expect(ComPort.modemLines(0xb1) == [.cd, .dsr, .cts], "the upper four bits; the lower four are changes")
        #expect(ComPort.modemState([.cd, .ri]) == 0xc0)
        #expect(ComPort.controlGroup(8) == 7...9 && ComPort.controlGroup(12) == 10...12 && ComPort.controlGroup(20) == nil)
        #expect(ComPort.name(105) == "SET-CONTROL" && ComPort.name(12) == "PURGE-DATA")
        #expect(ComPort.lineErrors(0x8b) == LineErrorCounts(framing: 1, overrun: 1), "data ready (0) and timeout (7) are no errors")
        #expect(ComPort.lineErrors(0x14) == LineErrorCounts(parity: 1, breaks: 1))
        #expect(ComPort.lineState(LineErrorCounts(bufferOverrun: 3, breaks: 1)) == 0x12, "both overruns are bit 1")
        #expect(ComPort.lineState(LineErrorCounts()) == 0)
        let earlier = LineErrorCounts(framing: 2, parity: 1, breaks: 5)
        #expect(LineErrorCounts(framing: 3, parity: 1, breaks: 1).since(earlier) == LineErrorCounts(framing: 1, breaks: 1),
                "a counter that went back (a replugged adapter) counts from zero")
    }
}
