import Testing
import TransportKit
@_spi(Plugins) import TransportKitCore

@Suite("Hex: bytes as text and back")
struct HexTests {
    @Test func textIsTwoUpperCaseDigitsPerByteWithTheSeparatorBetween() {
        #expect(Hex.text([0x0d, 0x0a, 0xff, 0x00]) == "0D 0A FF 00")
        #expect(Hex.text([0x0d, 0x0a], separator: "") == "0D0A")
        #expect(Hex.text([]) == "")
        #expect(Hex.text(0...255).count == 256 * 3 - 1)
    }

    @Test func bytesTakeEitherCaseAndSpacesColonsOrDashesBetweenBytes() {
        #expect(Hex.bytes("0d0a") == [0x0d, 0x0a])
        #expect(Hex.bytes("0D 0A") == [0x0d, 0x0a])
        #expect(Hex.bytes("0d:0a:FF") == [0x0d, 0x0a, 0xff])
        #expect(Hex.bytes("de-ad-be-ef") == [0xde, 0xad, 0xbe, 0xef])
        #expect(Hex.bytes("") == [])
        let all = Array(0...255).map(UInt8.init)
        #expect(Hex.bytes(Hex.text(all)) == all, "a round trip")
    }

    @Test func digitsArePaddedToTheWidthInEitherCase() {
        #expect(Hex.digits(0x0a as UInt8) == "0a")
        #expect(Hex.digits(0x0a as UInt8, uppercase: true) == "0A")
        #expect(Hex.digits(0xff as UInt8) == "ff")
        #expect(Hex.digits(0x1d50 as UInt16, width: 4) == "1d50")
        #expect(Hex.digits(0x01a7 as UInt16, width: 4) == "01a7")
        #expect(Hex.digits(0x12345, width: 4) == "12345", "wider when the value needs it")
    }

    @Test func valueTakesDigitsOnly() {
        #expect(Hex.digitValue(UInt8(ascii: "b")) == 11)
        #expect(Hex.digitValue(UInt8(ascii: "F")) == 15)
        #expect(Hex.digitValue(UInt8(ascii: "g")) == nil)
        #expect(Hex.value("ff", as: UInt8.self) == 255)
        #expect(Hex.value("1D50", width: 4, as: UInt16.self) == 0x1d50)
        for bad in ["", "+f", "-1", "0x1", "1ff", "é"] {
            #expect(Hex.value(bad, as: UInt8.self) == nil, "\(bad)")
        }
        #expect(Hex.value("d50", width: 4, as: UInt16.self) == nil)
    }

    @Test func anythingElseIsNil() {
        for bad in ["0", "0d0", "0 d", "0x0d", "zz", "0d,0a", "é1", "0d\n0a"] {
            #expect(Hex.bytes(bad) == nil, "\(bad)")
        }
    }
}
