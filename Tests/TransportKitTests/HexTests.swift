import Testing
import TransportKit

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

    @Test func anythingElseIsNil() {
        for bad in ["0", "0d0", "0 d", "0x0d", "zz", "0d,0a", "é1", "0d\n0a"] {
            #expect(Hex.bytes(bad) == nil, "\(bad)")
        }
    }
}
