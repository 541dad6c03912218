// USBSelector.swift: which USB device a URL names, for both schemes that name one by identity,
// `usb://VID:PID…` (the USB plugin) and `tty://usb/VID:PID…` (the serial plugin): read once from the
// URL's parts, matched against devices, shown in messages, and written back as the identity URL a
// listing shows.
//
// The serial number has one canonical spelling, the option `?serial=`: it composes with
// `location=` and `interface=`, which are options in both schemes, and a serial with a '/' in it
// needs no %2F there. The one path segment after VID:PID (`usb://0403:6001/A5`) is the other
// spelling, still read; both at once must agree.

@_spi(Plugins) import TransportKitCore

/// Which USB device a URL names: its vendor and product id, and what tells identical devices apart
/// (serial number, interface, bus location).
///
/// ```swift
/// let selector = USBSelector.identity(vendorId: "0403", productId: "6001", serialNumber: "A5", location: "1-1.4")
/// selector.description               // "USB 0403:6001 serial A5"
/// selector.url(.usb).description     // "usb://0403:6001?serial=A5"
/// selector.url(.tty).description     // "tty://usb/0403:6001?serial=A5"
/// ```
public struct USBSelector: Sendable, Hashable, CustomStringConvertible {
    /// Where a scheme writes VID:PID: as the URL's authority (`usb://VID:PID`), or as the first
    /// path segment after a fixed host (`tty://usb/VID:PID`).
    public struct Form: Sendable, Hashable {
        /// The scheme: `usb`, `tty`.
        public var scheme: String
        /// The host before the path that carries VID:PID (`usb` in `tty://usb/VID:PID`); nil when
        /// VID:PID is the authority.
        public var host: String?

        /// A form: VID:PID in the authority without `host`, else in the path after it.
        public init(scheme: String, host: String? = nil) {
            self.scheme = scheme
            self.host = host
        }

        /// `usb://VID:PID[?serial=S&location=L]` (and `usb://VID:PID/SERIAL`).
        public static let usb = Form(scheme: "usb")
        /// `tty://usb/VID:PID[?serial=S&interface=N&location=L]` (and `tty://usb/VID:PID/SERIAL`).
        public static let tty = Form(scheme: "tty", host: "usb")

        /// How URLs of this form begin, up to VID:PID: `usb://`, `tty://usb/`.
        public var prefix: String { scheme + "://" + (host.map { $0 + "/" } ?? "") }
    }

    /// `idVendor`: four lower-case hexadecimal digits (`0403`).
    public var vendorId: String
    /// `idProduct`: four lower-case hexadecimal digits (`6001`).
    public var productId: String
    /// The serial number string descriptor; nil: any.
    public var serialNumber: String?
    /// The interface number (`bInterfaceNumber`); nil: any.
    public var interface: Int?
    /// The bus and port path (`1-1.4`); nil: anywhere.
    public var location: String?

    /// A selector from its values; the ids are stored in lower case.
    public init(vendorId: String, productId: String, serialNumber: String? = nil, interface: Int? = nil, location: String? = nil) {
        self.vendorId = vendorId.lowercased()
        self.productId = productId.lowercased()
        self.serialNumber = serialNumber
        self.interface = interface
        self.location = location
    }

    /// Reads a selector from a URL's parts: `id`, the `VID:PID` text (the authority of `usb://`,
    /// the first path segment of `tty://usb/`); `segments`, the path segments after it,
    /// percent-decoded each (none, or one: the serial number's other spelling, where a '/' inside
    /// it is written %2F); and the values of the `serial=`, `interface=` and `location=` options
    /// (nil when absent). `shown` (the URL as a message shows it) and `grammar` go into the errors,
    /// all `.invalidURL`.
    ///
    /// ```swift
    /// let url = try TransportURL("usb://0403:6001/A5?location=1-1.4")
    /// let selector = try USBSelector(.usb, id: "0403:6001", segments: Array(url.pathSegments.dropFirst()), serial: nil,
    ///                                interface: nil, location: "1-1.4", shown: url.shown, grammar: "usb://VID:PID…")
    /// selector.description   // "USB 0403:6001 serial A5 at 1-1.4"
    /// ```
    public init(_ form: Form, id: String, segments: [String], serial: String?, interface: Int?, location: String?,
                shown: String, grammar: String) throws {
        let parts = id.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 2, let vendor = Hex.value(parts[0], width: 4, as: UInt16.self),
              let product = Hex.value(parts[1], width: 4, as: UInt16.self) else {
            throw TransportError(.invalidURL, "\(shown): after \(form.prefix) comes VENDOR:PRODUCT as two 4-digit hex IDs, such as \(form.prefix)0403:6001 "
                                 + "(`transportkit list` shows them). Grammar: \(grammar)")
        }
        let vendorId = Hex.digits(vendor, width: 4)
        let productId = Hex.digits(product, width: 4)
        let canonical = "\(form.prefix)\(vendorId):\(productId)?serial=SERIAL"
        var pathSerial: String?
        if let text = segments.first {
            guard !text.isEmpty || segments.count > 1 else {
                throw TransportError(.invalidURL, "\(shown): the serial number after '/' is empty; give it (\(canonical)) or drop the '/'. Grammar: \(grammar)")
            }
            guard segments.count == 1 else {
                let written = TransportError.printable(segments.joined(separator: "/"), limit: 40)
                throw TransportError(.invalidURL, "\(shown): '\(written)' is not one serial number: the serial is the one path segment after VID:PID "
                                     + "(a '/' inside it is written %2F there; as ?serial= it needs no escaping). To tell devices apart by where "
                                     + "they are plugged in, use ?location=BUS-PORT. Grammar: \(grammar)")
            }
            pathSerial = text
        }
        let options: [(name: String, value: String?, wanted: String)] = [
            ("serial", serial, "the device's serial number"),
            ("location", location, "its bus and port path, such as location=1-1.4,"),
        ]
        for option in options where option.value?.isEmpty == true {
            throw TransportError(.invalidURL, "\(shown): \(option.name)= is empty; give \(option.wanted) or drop the option (`transportkit list` shows both)")
        }
        if let pathSerial, let serial, pathSerial != serial {
            throw TransportError(.invalidURL, "\(shown) gives two serial numbers, '\(TransportError.printable(pathSerial, limit: 80))' after the '/' "
                                 + "and serial=\(TransportError.printable(serial, limit: 80)); give one, as \(canonical). Grammar: \(grammar)")
        }
        self.init(vendorId: vendorId, productId: productId, serialNumber: serial ?? pathSerial, interface: interface, location: location)
    }

    /// The selector that finds a device again after a replug: its serial number when it has one a
    /// URL can carry, else its location; and `interface` as given (a caller gives it only when the
    /// device has several).
    ///
    /// ```swift
    /// USBSelector.identity(vendorId: "1a86", productId: "7523", serialNumber: nil, location: "1-3").url(.tty).description
    /// // "tty://usb/1a86:7523?location=1-3"
    /// ```
    public static func identity(vendorId: String, productId: String, serialNumber: String?, interface: Int? = nil,
                                location: String?) -> USBSelector {
        // A serial a URL could not carry (a control character, which the parser refuses even
        // percent-encoded) gives way to the location.
        if let serialNumber, !serialNumber.isEmpty, !serialNumber.unicodeScalars.contains(where: { $0.value < 0x20 || $0.value == 0x7F }) {
            return USBSelector(vendorId: vendorId, productId: productId, serialNumber: serialNumber, interface: interface)
        }
        return USBSelector(vendorId: vendorId, productId: productId, interface: interface, location: location)
    }

    /// Whether a device with these properties is the one selected: the same ids (lower case, as
    /// sysfs writes them), and the serial number, interface and location where the selector names
    /// them. Nil for what the device does not say (a tty with no USB device above it).
    public func matches(vendorId: String?, productId: String?, serialNumber: String?, interface: Int?, location: String?) -> Bool {
        vendorId == self.vendorId && productId == self.productId
            && (self.serialNumber == nil || serialNumber == self.serialNumber)
            && (self.interface == nil || interface == self.interface)
            && (self.location == nil || location == self.location)
    }

    /// Whether `device` is the one selected; a selector's interface matches a device that has an
    /// interface of that number.
    public func matches(_ device: USBDeviceInfo) -> Bool {
        let present = interface.flatMap { number in device.interfaces.contains(where: { $0.number == number }) ? number : nil }
        return matches(vendorId: device.vendorId, productId: device.productId, serialNumber: device.serialNumber,
                       interface: present, location: device.location)
    }

    /// "USB 0403:6001 serial A5 interface 1 at 1-1.4": what messages call the device.
    public var description: String {
        var text = "USB \(vendorId):\(productId)"
        if let serialNumber { text += " serial \(TransportError.printable(serialNumber, limit: 80))" }
        if let interface { text += " interface \(interface)" }
        if let location { text += " at \(TransportError.printable(location, limit: 80))" }
        return text
    }

    /// The selector as a URL of `form`, in the canonical spelling: the ids, then `serial=`,
    /// `location=` and `interface=` for what it names (the serial percent-encoded where it is not
    /// URL-safe; a '/' in it stays a '/').
    ///
    /// ```swift
    /// USBSelector(vendorId: "2341", productId: "0043", serialNumber: "7573", interface: 0).url(.tty).description
    /// // "tty://usb/2341:0043?serial=7573&interface=0"
    /// ```
    public func url(_ form: Form) -> TransportURL {
        var query: [(name: String, value: String)] = []
        if let serialNumber { query.append((name: "serial", value: serialNumber)) }
        if let location { query.append((name: "location", value: location)) }
        if let interface { query.append((name: "interface", value: String(interface))) }
        guard let host = form.host else {
            return TransportURL(scheme: form.scheme, host: vendorId, portText: productId, segments: [], query: query)
        }
        return TransportURL(scheme: form.scheme, host: host, path: "/\(vendorId):\(productId)", query: query)
    }
}
