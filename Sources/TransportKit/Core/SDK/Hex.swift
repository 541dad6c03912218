/// Bytes as hexadecimal text and back, as the tool prints and reads them (`gatt … read`,
/// `gatt … write UUID HEX`) and as error messages show them.
///
/// ```swift
/// Hex.text([0x0d, 0x0a])                  // "0D 0A"
/// Hex.text([0x0d, 0x0a], separator: "")   // "0D0A"
/// Hex.bytes("0d 0a")                      // [0x0d, 0x0a]
/// Hex.bytes("0d0")                        // nil: two digits per byte
/// ```
public enum Hex {
    private static let digits = Array("0123456789ABCDEF".utf8)

    /// Two upper-case digits per byte, `separator` between bytes.
    public static func text(_ bytes: some Sequence<UInt8>, separator: String = " ") -> String {
        var result = ""
        for (index, byte) in bytes.enumerated() {
            if index > 0 { result += separator }
            result.unicodeScalars.append(Unicode.Scalar(digits[Int(byte >> 4)]))
            result.unicodeScalars.append(Unicode.Scalar(digits[Int(byte & 0x0f)]))
        }
        return result
    }

    /// The bytes of hexadecimal text: two digits per byte, either case, with spaces, colons or
    /// dashes between bytes or none; `nil` for anything else (an odd digit, another character).
    public static func bytes(_ text: String) -> [UInt8]? {
        var bytes: [UInt8] = []
        var high: UInt8?
        for unit in text.utf8 {
            let value: UInt8
            switch unit {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): value = unit - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): value = unit - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): value = unit - UInt8(ascii: "A") + 10
            case UInt8(ascii: " "), UInt8(ascii: ":"), UInt8(ascii: "-"):
                guard high == nil else { return nil }   // a separator inside a byte
                continue
            default:
                return nil
            }
            if let first = high {
                bytes.append(first << 4 | value)
                high = nil
            } else {
                high = value
            }
        }
        return high == nil ? bytes : nil
    }
}
