// DBusValue.swift: D-Bus values and their conversion to and from sd-bus messages
// (sd_bus_message_append_basic(3), sd_bus_message_open_container(3), sd_bus_message_peek_type(3),
// sd_bus_message_read_basic(3)). Only sd-bus's non-variadic calls are usable from Swift.

import CSDBus
import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// A D-Bus value with its exact wire type, as read from a message or to be written into one.
///
/// Dictionaries are arrays of ``dictEntry(_:_:)``; ``dictionary(_:)`` builds the `a{sv}` that
/// BlueZ's option arguments take, and ``dictionary`` reads one back.
///
/// ```swift
/// let filter = DBusValue.dictionary(["Transport": .string("le"), "UUIDs": .array(element: "s", [.string("180d")])])
/// filter.signature                        // "a{sv}"
/// reply.first?.dictionary?["Powered"]     // .variant(.bool(true))
/// ```
public indirect enum DBusValue: Sendable, Hashable {
    /// An unsigned 8-bit integer (`y`).
    case byte(UInt8)
    /// A boolean (`b`).
    case bool(Bool)
    /// A signed 16-bit integer (`n`).
    case int16(Int16)
    /// An unsigned 16-bit integer (`q`).
    case uint16(UInt16)
    /// A signed 32-bit integer (`i`).
    case int32(Int32)
    /// An unsigned 32-bit integer (`u`).
    case uint32(UInt32)
    /// A signed 64-bit integer (`x`).
    case int64(Int64)
    /// An unsigned 64-bit integer (`t`).
    case uint64(UInt64)
    /// An IEEE 754 double (`d`).
    case double(Double)
    /// A UTF-8 string (`s`).
    case string(String)
    /// An object path (`o`: `/org/bluez/hci0`).
    case objectPath(String)
    /// A type signature (`g`: `a{sv}`).
    case signature(String)
    /// A file descriptor (`h`). Read from a message: a close-on-exec duplicate that the receiver
    /// owns and must close. Passed as a call's argument: borrowed (sd-bus sends a duplicate). In a
    /// handler's reply: taken (closed once sent).
    case unixFD(Int32)
    /// A byte array (`ay`: a characteristic's value, manufacturer data), carried as bytes. Messages
    /// read give every `ay` in this form; ``bytes(_:)`` builds one.
    case byteArray([UInt8])
    /// An array of values of the type `element` (a signature: `"s"`, `"{sv}"`, `"(oa{sv})"`).
    /// For bytes use ``byteArray(_:)``: one value per byte costs a boxed value each.
    case array(element: String, [DBusValue])
    /// One entry of a dictionary (an array whose element is `{KV}`).
    case dictEntry(DBusValue, DBusValue)
    /// A structure (`(…)`): its fields in order.
    case structure([DBusValue])
    /// A variant (`v`): a value that carries its own type.
    case variant(DBusValue)

    /// An `a{sv}` dictionary, keys sorted so that messages are reproducible.
    public static func dictionary(_ entries: [String: DBusValue]) -> DBusValue {
        .array(element: "{sv}", entries.sorted { $0.key < $1.key }.map { .dictEntry(.string($0.key), .variant($0.value)) })
    }

    /// A byte array (`ay`).
    public static func bytes(_ bytes: [UInt8]) -> DBusValue { .byteArray(bytes) }

    /// The value's type signature.
    public var signature: String {
        switch self {
        case .byte: "y"
        case .bool: "b"
        case .int16: "n"
        case .uint16: "q"
        case .int32: "i"
        case .uint32: "u"
        case .int64: "x"
        case .uint64: "t"
        case .double: "d"
        case .string: "s"
        case .objectPath: "o"
        case .signature: "g"
        case .unixFD: "h"
        case .byteArray: "ay"
        case .array(let element, _): "a" + element
        case .dictEntry(let key, let value): "{" + key.signature + value.signature + "}"
        case .structure(let fields): "(" + fields.map(\.signature).joined() + ")"
        case .variant: "v"
        }
    }

    /// The value inside any number of variants.
    public var unwrapped: DBusValue {
        if case .variant(let inner) = self { return inner.unwrapped }
        return self
    }

    /// The text of a string, object path or signature (inside variants too).
    public var text: String? {
        switch unwrapped {
        case .string(let value), .objectPath(let value), .signature(let value): value
        default: nil
        }
    }

    /// A boolean (inside variants too).
    public var boolValue: Bool? {
        if case .bool(let value) = unwrapped { return value }
        return nil
    }

    /// Any integer type, widened (inside variants too).
    public var integer: Int64? {
        switch unwrapped {
        case .byte(let value): Int64(value)
        case .int16(let value): Int64(value)
        case .uint16(let value): Int64(value)
        case .int32(let value): Int64(value)
        case .uint32(let value): Int64(value)
        case .int64(let value): value
        case .uint64(let value): value <= UInt64(Int64.max) ? Int64(value) : nil
        default: nil
        }
    }

    /// The elements of an array (inside variants too); a byte array's as ``byte(_:)`` values.
    public var elements: [DBusValue]? {
        switch unwrapped {
        case .array(_, let items): items
        case .byteArray(let bytes): bytes.map { .byte($0) }
        default: nil
        }
    }

    /// The bytes of an `ay` (inside variants too).
    public var bytes: [UInt8]? {
        switch unwrapped {
        case .byteArray(let bytes): bytes
        case .array(element: "y", let items): items.compactMap { if case .byte(let byte) = $0 { byte } else { nil } }
        default: nil
        }
    }

    /// The strings of an `as` or `ao` (inside variants too).
    public var strings: [String]? { elements?.compactMap(\.text) }

    /// A dictionary whose keys are strings or object paths (`a{sv}`, `a{oa{sa{sv}}}`, …), values as
    /// they are (variants kept). `nil` for anything else.
    public var dictionary: [String: DBusValue]? {
        guard let items = elements else { return nil }
        var result: [String: DBusValue] = [:]
        for item in items {
            guard case .dictEntry(let key, let value) = item, let name = key.text else { return nil }
            result[name] = value
        }
        return result
    }

    /// A dictionary with integer keys (`a{qv}`: manufacturer data), values as they are.
    public var integerKeyedDictionary: [Int64: DBusValue]? {
        guard let items = elements else { return nil }
        var result: [Int64: DBusValue] = [:]
        for item in items {
            guard case .dictEntry(let key, let value) = item, let number = key.integer else { return nil }
            result[number] = value
        }
        return result
    }
}

/// Writes values into an sd-bus message (on the bus thread).
struct DBusWriter {
    let message: OpaquePointer
    let what: String

    func append(_ values: [DBusValue]) throws {
        for value in values { try append(value) }
    }

    func append(_ value: DBusValue) throws {
        switch value {
        case .byte(var byte): try basic("y", &byte)
        case .bool(let flag):
            var number: Int32 = flag ? 1 : 0
            try basic("b", &number)
        case .int16(var number): try basic("n", &number)
        case .uint16(var number): try basic("q", &number)
        case .int32(var number): try basic("i", &number)
        case .uint32(var number): try basic("u", &number)
        case .int64(var number): try basic("x", &number)
        case .uint64(var number): try basic("t", &number)
        case .double(var number): try basic("d", &number)
        case .unixFD(var fd): try basic("h", &fd)
        case .string(let text), .objectPath(let text), .signature(let text):
            // For string types sd-bus takes the string itself, not a pointer to it.
            let type: UInt8 = switch value { case .objectPath: UInt8(ascii: "o"); case .signature: UInt8(ascii: "g"); default: UInt8(ascii: "s") }
            try check("sd_bus_message_append_basic") { text.withCString { sd_bus_message_append_basic(message, CChar(bitPattern: type), $0) } }
        case .byteArray(let bytes):
            try appendBytes(bytes)
        case .array(element: "y", let items):
            try appendBytes(items.compactMap { if case .byte(let byte) = $0 { byte } else { nil } })
        case .array(let element, let items):
            try container("a", element) { try append(items) }
        case .dictEntry(let key, let entryValue):
            try container("e", key.signature + entryValue.signature) { try append([key, entryValue]) }
        case .structure(let fields):
            try container("r", fields.map(\.signature).joined()) { try append(fields) }
        case .variant(let inner):
            try container("v", inner.signature) { try append(inner) }
        }
    }

    /// An `ay` in one copy (sd_bus_message_append_array).
    private func appendBytes(_ bytes: [UInt8]) throws {
        try check("sd_bus_message_append_array") {
            bytes.withUnsafeBytes { sd_bus_message_append_array(message, CChar(UInt8(ascii: "y")), $0.baseAddress, $0.count) }
        }
    }

    private func basic<T>(_ type: Character, _ value: inout T) throws {
        let code = CChar(bitPattern: type.asciiValue ?? 0)
        try check("sd_bus_message_append_basic") { withUnsafePointer(to: &value) { sd_bus_message_append_basic(message, code, $0) } }
    }

    private func container(_ type: Character, _ contents: String, _ body: () throws -> Void) throws {
        let code = CChar(bitPattern: type.asciiValue ?? 0)
        try check("sd_bus_message_open_container") { sd_bus_message_open_container(message, code, contents) }
        try body()
        try check("sd_bus_message_close_container") { sd_bus_message_close_container(message) }
    }

    private func check(_ function: String, _ body: () -> Int32) throws {
        try SDBus.check(body(), function, what)
    }
}

/// Reads a message's values without knowing its signature in advance (on the bus thread).
/// Descriptors (`h`) are duplicated: the message owns the ones it carries.
struct DBusReader {
    let message: OpaquePointer
    let what: String

    /// Every remaining value at the current level. On failure, descriptors already duplicated are closed.
    func readAll() throws -> [DBusValue] {
        var values: [DBusValue] = []
        do {
            while let value = try next() { values.append(value) }
        } catch {
            DBusValue.closeDescriptors(in: values)
            throw error
        }
        return values
    }

    /// The next value in the current container, or nil at its end.
    func next() throws -> DBusValue? {
        var type: CChar = 0
        var contents: UnsafePointer<CChar>?
        let peeked = sd_bus_message_peek_type(message, &type, &contents)
        if peeked < 0 { throw TransportError.posix("sd_bus_message_peek_type", errno: Errno(rawValue: -peeked), what: what) }
        guard peeked > 0 else { return nil }
        let inner = SDBus.string(contents)
        switch UInt8(bitPattern: type) {
        case UInt8(ascii: "a") where inner == "y":
            var pointer: UnsafeRawPointer?
            var size = 0
            try check("sd_bus_message_read_array") { sd_bus_message_read_array(message, CChar(UInt8(ascii: "y")), &pointer, &size) }
            let bytes = pointer.map { Array(UnsafeRawBufferPointer(start: $0, count: size)) } ?? []
            return .bytes(bytes)
        case UInt8(ascii: "a"):
            return .array(element: inner, try container(type, contents))
        case UInt8(ascii: "e"):
            let pair = try container(type, contents)
            guard pair.count == 2 else {
                DBusValue.closeDescriptors(in: pair)
                throw TransportError(.io, "\(what): a dictionary entry with \(pair.count) values")
            }
            return .dictEntry(pair[0], pair[1])
        case UInt8(ascii: "r"):
            return .structure(try container(type, contents))
        case UInt8(ascii: "v"):
            let values = try container(type, contents)
            guard values.count == 1 else {
                DBusValue.closeDescriptors(in: values)
                throw TransportError(.io, "\(what): a variant with \(values.count) values")
            }
            return .variant(values[0])
        default:
            return try basic(type)
        }
    }

    private func container(_ type: CChar, _ contents: UnsafePointer<CChar>?) throws -> [DBusValue] {
        try check("sd_bus_message_enter_container") { sd_bus_message_enter_container(message, type, contents) }
        let values = try readAll()
        do {
            try check("sd_bus_message_exit_container") { sd_bus_message_exit_container(message) }
        } catch {
            DBusValue.closeDescriptors(in: values)
            throw error
        }
        return values
    }

    private func basic(_ type: CChar) throws -> DBusValue {
        var storage = (UInt64(0), UInt64(0))   // room for any basic value or a pointer
        try check("sd_bus_message_read_basic") {
            withUnsafeMutableBytes(of: &storage) { sd_bus_message_read_basic(message, type, $0.baseAddress) }
        }
        let text = { (raw: UnsafeRawBufferPointer) in SDBus.string(raw.load(as: UnsafePointer<CChar>?.self)) }
        return try withUnsafeBytes(of: &storage) { raw -> DBusValue in
            switch UInt8(bitPattern: type) {
            case UInt8(ascii: "s"): return .string(text(raw))
            case UInt8(ascii: "o"): return .objectPath(text(raw))
            case UInt8(ascii: "g"): return .signature(text(raw))
            case UInt8(ascii: "b"): return .bool(raw.load(as: Int32.self) != 0)
            case UInt8(ascii: "y"): return .byte(raw.load(as: UInt8.self))
            case UInt8(ascii: "n"): return .int16(raw.load(as: Int16.self))
            case UInt8(ascii: "q"): return .uint16(raw.load(as: UInt16.self))
            case UInt8(ascii: "i"): return .int32(raw.load(as: Int32.self))
            case UInt8(ascii: "u"): return .uint32(raw.load(as: UInt32.self))
            case UInt8(ascii: "x"): return .int64(raw.load(as: Int64.self))
            case UInt8(ascii: "t"): return .uint64(raw.load(as: UInt64.self))
            case UInt8(ascii: "d"): return .double(raw.load(as: Double.self))
            case UInt8(ascii: "h"):
                // The message owns its descriptor: keep a duplicate of our own.
                let fd = fcntl(raw.load(as: Int32.self), F_DUPFD_CLOEXEC, 3)
                guard fd >= 0 else { throw TransportError.posix("fcntl(F_DUPFD_CLOEXEC)", errno: Errno(rawValue: Glibc.errno), what: what) }
                return .unixFD(fd)
            default:
                throw TransportError(.io, "\(what): unknown D-Bus type '\(Character(Unicode.Scalar(UInt8(bitPattern: type))))'")
            }
        }
    }

    private func check(_ function: String, _ body: () -> Int32) throws {
        try SDBus.check(body(), function, what)
    }
}

extension DBusValue {
    /// Closes every descriptor inside `values` (a reply nobody will take).
    public static func closeDescriptors(in values: [DBusValue]) {
        for value in values {
            switch value {
            case .unixFD(let fd): Glibc.close(fd)
            case .array(_, let items), .structure(let items): closeDescriptors(in: items)
            case .dictEntry(let key, let value): closeDescriptors(in: [key, value])
            case .variant(let inner): closeDescriptors(in: [inner])
            default: break
            }
        }
    }
}
