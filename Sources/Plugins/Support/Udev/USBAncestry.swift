// USBAncestry.swift: the USB device and interface above any sysfs device (a tty of a USB serial
// adapter, a Bluetooth controller on USB, the USB device itself), found by the kernel's names for
// them (drivers/usb/core/usb.c, message.c): a device is "BUS-PORT[.PORT…]" (1-1.4), an interface
// "BUS-PORT…:CONFIG.INTERFACE" (1-1.4:1.0). Attributes from Documentation/ABI/stable/sysfs-bus-usb.

/// What the USB device (and interface) above a sysfs path say about themselves.
///
/// ```swift
/// if let usb = USBAncestry(sysPath: "/sys/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/ttyUSB0/tty/ttyUSB0") {
///     print(usb.vendorId ?? "?", usb.productId ?? "?", usb.location, usb.interfaceNumber ?? -1)   // 0403 6001 1-1 0
/// }
/// ```
public struct USBAncestry: Sendable, Equatable {
    /// The USB device's sysfs directory.
    public var devicePath: String
    /// Bus and port path, such as `1-1.4`: where it is plugged in.
    public var location: String
    /// `idVendor` and `idProduct`, lower-case hex.
    public var vendorId: String?
    /// `idProduct`, lower-case hex.
    public var productId: String?
    /// `serial`, when the device has one.
    public var serialNumber: String?
    /// `manufacturer`, as the device reports it.
    public var manufacturer: String?
    /// `product`, as the device reports it.
    public var product: String?
    /// `bNumInterfaces`: more than one means the interface number matters.
    public var interfaceCount: Int?
    /// The interface's sysfs directory, when the path goes through one.
    public var interfacePath: String?
    /// `bInterfaceNumber` (the name's last number, decimal).
    public var interfaceNumber: Int?
    /// The driver bound to the interface (read when asked: one readlink(2)).
    public var interfaceDriver: String? { interfacePath.flatMap(Sysfs.driverName) }

    /// Reads the nearest USB device above (or at) `sysPath`; nil when there is none.
    public init?(sysPath: String) {
        let components = sysPath.split(separator: "/")
        // Components are slices of sysPath, so a directory is the prefix up to one's end.
        func directory(through index: Int) -> String { String(sysPath[..<components[index].endIndex]) }
        guard let deviceIndex = components.lastIndex(where: Self.isDeviceName) else { return nil }
        devicePath = directory(through: deviceIndex)
        location = String(components[deviceIndex])
        vendorId = Sysfs.attribute(devicePath, "idVendor")?.lowercased()
        productId = Sysfs.attribute(devicePath, "idProduct")?.lowercased()
        serialNumber = Sysfs.attribute(devicePath, "serial")
        manufacturer = Sysfs.attribute(devicePath, "manufacturer")
        product = Sysfs.attribute(devicePath, "product")
        interfaceCount = Sysfs.attribute(devicePath, "bNumInterfaces").flatMap { Int($0) }
        if let interfaceIndex = components.lastIndex(where: Self.isInterfaceName), interfaceIndex > deviceIndex {
            let name = components[interfaceIndex]
            interfacePath = directory(through: interfaceIndex)
            // The name ends in ".bInterfaceNumber" (decimal; usb_set_configuration names interfaces
            // "%d-%s:%d.%d"): no file to read.
            interfaceNumber = name.lastIndex(of: ".").flatMap { Int(name[name.index(after: $0)...]) }
        }
    }

    /// "1-1.4": bus, dash, port path of digits and dots.
    public static func isDeviceName(_ name: Substring) -> Bool {
        guard let dash = name.firstIndex(of: "-"), dash > name.startIndex else { return false }
        let ports = name[name.index(after: dash)...]
        return name[..<dash].allSatisfy(\.isNumber) && !ports.isEmpty && ports.allSatisfy { $0.isNumber || $0 == "." }
    }

    /// "1-1.4:1.0": a device name, colon, configuration.interface.
    public static func isInterfaceName(_ name: Substring) -> Bool {
        guard let colon = name.firstIndex(of: ":") else { return false }
        let suffix = name[name.index(after: colon)...]
        return isDeviceName(name[..<colon]) && suffix.contains(".") && suffix.allSatisfy { $0.isNumber || $0 == "." }
    }
}
