// USBDevices.swift: USB devices, their interfaces and endpoints as sysfs shows them
// (Documentation/ABI/stable/sysfs-bus-usb, Documentation/ABI/testing/sysfs-bus-usb; the kernel
// writes them in drivers/usb/core/sysfs.c and endpoint.c). A device is "BUS-PORT[.PORT…]" (1-1.4)
// or a root hub "usbN"; an interface "DEVICE:CONFIG.INTERFACE" (1-1.4:1.0) below it; an endpoint
// directory "ep_XX" below the interface, for the interface's current alternate setting only.
//
// Shared by the usb:// plugin (listing, identity, hot-plug) and by the serial plugin, which links a
// USB serial adapter's tty to its USB device. No libusb here: listing never opens a device.

import Glibc
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// One endpoint of an interface's current alternate setting.
public struct USBEndpointInfo: Sendable, Equatable {
    /// `bEndpointAddress`: the number, with bit 7 set for IN (device to host).
    public var address: UInt8
    /// `bmAttributes`: the transfer type in bits 0–1.
    public var attributes: UInt8
    /// `wMaxPacketSize`, bits 0–10 (the packet size, without the high-bandwidth multiplier).
    public var maxPacketSize: Int

    /// `true` for an IN endpoint.
    public var isIn: Bool { address & 0x80 != 0 }
    /// `control`, `isochronous`, `bulk` or `interrupt`.
    public var transferType: String { ["control", "isochronous", "bulk", "interrupt"][Int(attributes & 3)] }
    /// The address as USB tools write it: `0x81`.
    public var addressText: String { "0x" + Hex.digits(address) }
}

/// One interface of a configured USB device.
public struct USBInterfaceInfo: Sendable, Equatable {
    /// The interface's sysfs directory.
    public var sysPath: String
    /// `bInterfaceNumber`.
    public var number: Int
    /// `bAlternateSetting`: the one the endpoints below belong to.
    public var alternateSetting: Int
    /// `bInterfaceClass` (2: CDC communications, 0x0a: CDC data, 0xff: vendor-specific).
    public var interfaceClass: UInt8
    /// `bInterfaceSubClass`, whose meaning depends on the class.
    public var interfaceSubclass: UInt8
    /// `bInterfaceProtocol`, whose meaning depends on the class and subclass.
    public var interfaceProtocol: UInt8
    /// The interface's string descriptor (`interface`), when it has one.
    public var name: String?
    /// The kernel driver bound to it (`usbfs` while a libusb program holds it).
    public var driver: String?
    /// The endpoints of the current alternate setting, by address.
    public var endpoints: [USBEndpointInfo]

    /// "ff/00/00": class, subclass and protocol in hexadecimal.
    public var classTriple: String { "\(Hex.digits(interfaceClass))/\(Hex.digits(interfaceSubclass))/\(Hex.digits(interfaceProtocol))" }
}

/// A USB device (a sysfs `usb_device`) with what a listing, an identity match and a hot-plug event need.
///
/// ```swift
/// for device in try USBDevices.all() where !device.isHub {
///     print(device.location, device.vendorId, device.productId, device.product ?? "", USBDevices.identityURL(device))
/// }
/// ```
public struct USBDeviceInfo: Sendable, Equatable {
    /// The device's sysfs directory (`/sys/devices/pci0000:00/…/usb1/1-1/1-1.4`).
    public var sysPath: String
    /// The kernel's name: the location (`1-1.4`), or `usbN` for a root hub.
    public var sysName: String
    /// `/dev/bus/usb/BBB/DDD`.
    public var devnode: String?
    /// `idVendor`: four lower-case hexadecimal digits (`0403`).
    public var vendorId: String
    /// `idProduct`: four lower-case hexadecimal digits (`6001`).
    public var productId: String
    /// The serial number string descriptor (`serial`); nil when the device has none.
    public var serialNumber: String?
    /// The manufacturer string descriptor (`manufacturer`); nil when the device has none.
    public var manufacturer: String?
    /// The product string descriptor (`product`); nil when the device has none.
    public var product: String?
    /// `bDeviceClass` (0: per interface, 9: hub, 0xef: miscellaneous/composite, 0xff: vendor).
    public var deviceClass: UInt8
    /// `speed` in Mbit/s as sysfs writes it: 1.5, 12, 480, 5000, 10000, 20000.
    public var speed: String?
    /// `busnum`: the bus (`BBB` in the node's path); nil when sysfs does not say.
    public var busNumber: Int?
    /// `devnum`: the address on the bus (`DDD` in the node's path), new at every plug-in; nil when sysfs does not say.
    public var deviceNumber: Int?
    /// `bConfigurationValue` is set: the interfaces exist and the device can be used.
    public var isConfigured: Bool
    /// `bNumInterfaces` of the active configuration.
    public var interfaceCount: Int?
    /// The interfaces of the active configuration, sorted by number.
    public var interfaces: [USBInterfaceInfo]
    /// Links udev made to the node, sorted.
    public var links: [String]
    /// The uevent's and udev's properties.
    public var properties: [String: String]

    /// Where it is plugged in: bus and port path (`1-1.4`); a root hub's is `usbN`.
    public var location: String { sysName }
    /// A hub (class 9), root hubs included: nothing to open a stream to.
    public var isHub: Bool { deviceClass == 9 }
    /// The speed's name: `low` (1.5), `full` (12), `high` (480), `super` (5000), `super+` (10000, 20000).
    public var speedName: String? {
        switch speed {
        case "1.5": "low"
        case "12": "full"
        case "480": "high"
        case "5000": "super"
        case "10000", "20000": "super+"
        default: speed
        }
    }
}

extension USBDeviceInfo: SysfsRecord {}

/// Reads USB devices from sysfs, and writes the URL that finds one again after a replug.
public enum USBDevices {
    /// Every configured USB device (root hubs and hubs included; callers filter).
    public static func all() throws -> [USBDeviceInfo] {
        try Sysfs.devices(subsystem: "usb").compactMap(info)
    }

    /// One device by its sysfs name (`1-1.4`, `usb1`); nil when it is gone, is an interface, or is
    /// not configured yet (its interfaces are still being made).
    public static func named(_ name: String) -> USBDeviceInfo? {
        Sysfs.device(subsystem: "usb", name: name).flatMap(info)
    }

    /// The record of a sysfs `usb_device`, nil for interfaces and for devices not configured yet.
    public static func info(_ device: SysfsDevice) -> USBDeviceInfo? {
        let name = Substring(device.sysName)
        guard device.properties["DEVTYPE"] == "usb_device" || USBAncestry.isDeviceName(name) || isRootHubName(name),
              !USBAncestry.isInterfaceName(name) else { return nil }
        let path = device.sysPath
        guard let vendor = Sysfs.attribute(path, "idVendor")?.lowercased(), let product = Sysfs.attribute(path, "idProduct")?.lowercased(),
              let configuration = Sysfs.attribute(path, "bConfigurationValue"), !configuration.isEmpty else { return nil }
        // A root hub usbN names its interfaces N-0:1.0 (drivers/usb/core/message.c).
        let stem = isRootHubName(name) ? "\(name.dropFirst(3))-0:" : device.sysName + ":"
        let interfaces = Sysfs.entries(of: path)
            .filter { $0.hasPrefix(stem) && USBAncestry.isInterfaceName(Substring($0)) }
            .compactMap { interface(path + "/" + $0) }
            .sorted { $0.number < $1.number }
        var info = USBDeviceInfo(
            sysPath: path, sysName: device.sysName, devnode: device.devnode, vendorId: vendor, productId: product,
            serialNumber: Sysfs.attribute(path, "serial"), manufacturer: Sysfs.attribute(path, "manufacturer"),
            product: Sysfs.attribute(path, "product"), deviceClass: hexAttribute(path, "bDeviceClass") ?? 0,
            speed: Sysfs.attribute(path, "speed"), busNumber: Sysfs.attribute(path, "busnum").flatMap { Int($0) },
            deviceNumber: Sysfs.attribute(path, "devnum").flatMap { Int($0) }, isConfigured: true,
            interfaceCount: Sysfs.attribute(path, "bNumInterfaces").flatMap { Int($0) }, interfaces: interfaces,
            links: device.links, properties: device.properties)
        if info.devnode == nil, let bus = info.busNumber, let number = info.deviceNumber {
            info.devnode = "/dev/bus/usb/" + pad3(bus) + "/" + pad3(number)
        }
        return info
    }

    /// An interface directory's record.
    static func interface(_ path: String) -> USBInterfaceInfo? {
        guard let number = hexAttribute(path, "bInterfaceNumber") else { return nil }
        let endpoints = Sysfs.entries(of: path).filter { $0.hasPrefix("ep_") }.compactMap { name -> USBEndpointInfo? in
            let directory = path + "/" + name
            guard let address = hexAttribute(directory, "bEndpointAddress"),
                  let attributes = hexAttribute(directory, "bmAttributes"),
                  let size = Sysfs.attribute(directory, "wMaxPacketSize").flatMap({ Hex.value($0, as: Int.self) }) else { return nil }
            return USBEndpointInfo(address: address, attributes: attributes, maxPacketSize: size & 0x7ff)
        }
        return USBInterfaceInfo(
            sysPath: path, number: Int(number), alternateSetting: Sysfs.attribute(path, "bAlternateSetting").flatMap { Int($0) } ?? 0,
            interfaceClass: hexAttribute(path, "bInterfaceClass") ?? 0,
            interfaceSubclass: hexAttribute(path, "bInterfaceSubClass") ?? 0,
            interfaceProtocol: hexAttribute(path, "bInterfaceProtocol") ?? 0,
            name: Sysfs.attribute(path, "interface"), driver: Sysfs.driverName(path),
            endpoints: endpoints.sorted { $0.address < $1.address })
    }

    /// `usb://VID:PID?serial=SERIAL` when the device has a serial number (percent-encoded where it
    /// is not URL-safe), else `usb://VID:PID?location=BUS-PORT`: the URL that reaches this device
    /// after a replug (``USBSelector/identity(vendorId:productId:serialNumber:interface:location:)``).
    public static func identityURL(_ device: USBDeviceInfo) -> String {
        identityURL(vendorId: device.vendorId, productId: device.productId, serialNumber: device.serialNumber, location: device.location)
    }

    /// The same from the parts (a tty's USB ancestry names them too).
    public static func identityURL(vendorId: String, productId: String, serialNumber: String?, location: String) -> String {
        USBSelector.identity(vendorId: vendorId, productId: productId, serialNumber: serialNumber, location: location).url(.usb).description
    }

    /// "usbN": a root hub (the host controller's own, virtual, device).
    public static func isRootHubName(_ name: Substring) -> Bool {
        name.hasPrefix("usb") && name.count > 3 && name.dropFirst(3).allSatisfy(\.isNumber)
    }

    /// A sysfs attribute that holds a byte in hexadecimal (`bInterfaceClass`: "ff").
    private static func hexAttribute(_ path: String, _ name: String) -> UInt8? {
        Sysfs.attribute(path, name).flatMap { Hex.value($0, as: UInt8.self) }
    }
    private static func pad3(_ value: Int) -> String { String(repeating: "0", count: max(0, 3 - String(value).count)) + String(value) }
}
