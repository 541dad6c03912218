/// Hexadecimal text: bytes as the tool prints and reads them (`gatt … read`, `gatt … write UUID
/// HEX`) and as error messages show them, numbers at a fixed width (`0x0a`, `1d50`), and back.
///
/// ```swift
/// Hex.text([0x0d, 0x0a])                  // "0D 0A"
/// Hex.text([0x0d, 0x0a], separator: "")   // "0D0A"
/// Hex.bytes("0d 0a")                      // [0x0d, 0x0a]
/// Hex.bytes("0d0")                        // nil: two digits per byte
/// Hex.digits(0x1d50 as UInt16, width: 4)  // "1d50"
/// Hex.value("01a7", width: 4, as: UInt16.self)   // 0x01a7
/// ```
@_spi(Plugins)
public enum Hex {
    private static let upperCase = Array("0123456789ABCDEF".utf8)

    /// Two upper-case digits per byte, `separator` between bytes.
    public static func text(_ bytes: some Sequence<UInt8>, separator: String = " ") -> String {
        var result = ""
        for (index, byte) in bytes.enumerated() {
            if index > 0 { result += separator }
            result.unicodeScalars.append(Unicode.Scalar(upperCase[Int(byte >> 4)]))
            result.unicodeScalars.append(Unicode.Scalar(upperCase[Int(byte & 0x0f)]))
        }
        return result
    }

    /// `value` in hexadecimal, lower case unless `uppercase`, with zeros in front to at least
    /// `width` digits (more when the value needs them); no `0x`.
    ///
    /// ```swift
    /// Hex.digits(0x0a as UInt8)                     // "0a"
    /// Hex.digits(0x0a as UInt8, uppercase: true)    // "0A"
    /// Hex.digits(0x1d50 as UInt16, width: 4)        // "1d50"
    /// Hex.digits(0x12345, width: 4)                 // "12345"
    /// ```
    public static func digits(_ value: some BinaryInteger, width: Int = 2, uppercase: Bool = false) -> String {
        let text = String(value, radix: 16, uppercase: uppercase)
        let missing = width - text.utf8.count
        return missing > 0 ? String(repeating: "0", count: missing) + text : text
    }

    /// The value of one hexadecimal digit (an ASCII code unit, either case); `nil` for any other.
    ///
    /// ```swift
    /// Hex.digitValue(UInt8(ascii: "b"))   // 11
    /// Hex.digitValue(UInt8(ascii: "g"))   // nil
    /// ```
    public static func digitValue(_ unit: UInt8) -> UInt8? {
        switch unit {
        case UInt8(ascii: "0")...UInt8(ascii: "9"): unit - UInt8(ascii: "0")
        case UInt8(ascii: "a")...UInt8(ascii: "f"): unit - UInt8(ascii: "a") + 10
        case UInt8(ascii: "A")...UInt8(ascii: "F"): unit - UInt8(ascii: "A") + 10
        default: nil
        }
    }

    /// The number hexadecimal `text` writes: digits only, either case (no sign, no `0x`, unlike
    /// `Int(_:radix:)`), exactly `width` of them when given; `nil` for anything else and for a
    /// value `T` cannot hold.
    ///
    /// ```swift
    /// Hex.value("ff", as: UInt8.self)               // 255
    /// Hex.value("+f", as: UInt8.self)               // nil
    /// Hex.value("1d50", width: 4, as: UInt16.self)  // 0x1d50
    /// Hex.value("d50", width: 4, as: UInt16.self)   // nil
    /// ```
    public static func value<T: FixedWidthInteger>(_ text: some StringProtocol, width: Int? = nil, as type: T.Type = T.self) -> T? {
        let units = text.utf8
        guard !units.isEmpty, width == nil || units.count == width else { return nil }
        var result: T = 0
        for unit in units {
            guard let digit = digitValue(unit) else { return nil }
            let (shifted, overflow) = result.multipliedReportingOverflow(by: 16)
            guard !overflow else { return nil }
            let (sum, carry) = shifted.addingReportingOverflow(T(digit))
            guard !carry else { return nil }
            result = sum
        }
        return result
    }

    /// The bytes of hexadecimal text: two digits per byte, either case, with spaces, colons or
    /// dashes between bytes or none; `nil` for anything else (an odd digit, another character).
    public static func bytes(_ text: String) -> [UInt8]? {
        var bytes: [UInt8] = []
        var high: UInt8?
        for unit in text.utf8 {
            switch unit {
            case UInt8(ascii: " "), UInt8(ascii: ":"), UInt8(ascii: "-"):
                guard high == nil else { return nil }   // a separator inside a byte
                continue
            default:
                break
            }
            guard let value = digitValue(unit) else { return nil }
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
