// USBDiscovery.swift: USB devices as DeviceRecords (with identity URLs), identity resolution for
// usb://VID:PID[/SERIAL][?location=…], waiting for a device to arrive, and hot-plug events. The
// kernel interfaces are shared (TransportKitUdev): USBDevices reads sysfs, UdevMonitor delivers the
// uevents of usb_device nodes.

import TransportKitCore
import TransportKitLinux
import TransportKitUdev

/// Which USB device a usb:// URL names.
struct USBDeviceSelector: Sendable, CustomStringConvertible {
    var vendorId: String
    var productId: String
    var serialNumber: String?
    var location: String?

    init(vendorId: String, productId: String, serialNumber: String? = nil, location: String? = nil) {
        self.vendorId = vendorId.lowercased()
        self.productId = productId.lowercased()
        self.serialNumber = serialNumber
        self.location = location
    }

    /// From `usb://VID:PID[/SERIAL]?location=…`: the one path segment after the "/" is the serial
    /// number, percent-decoded (a serial with a "/" in it is written %2F, as `transportkit list`
    /// writes it). An empty serial, or a second segment (`/A/B`), is refused.
    init(_ request: ConnectRequest) throws {
        let shown = request.url.shown
        guard let id = request.url.usbDeviceID else {
            throw TransportError(.invalidURL, "\(shown): expected usb://VID:PID with two 4-digit hex IDs (`transportkit list` shows them). Grammar: \(request.scheme.grammar)")
        }
        var serial: String?
        let segments = request.url.pathSegments.dropFirst()
        if let text = segments.first {
            guard !text.isEmpty || segments.count > 1 else {
                throw TransportError(.invalidURL, "\(shown): the serial number after '/' is empty; give it (usb://\(Hex.digits(id.vendor, width: 4)):\(Hex.digits(id.product, width: 4))/SERIAL) or drop the '/'. Grammar: \(request.scheme.grammar)")
            }
            guard segments.count == 1 else {
                let written = TransportError.printable(segments.joined(separator: "/"), limit: 40)
                throw TransportError(.invalidURL, "\(shown): '\(written)' is not one serial number: the serial is the one path segment after VID:PID "
                                     + "(a '/' inside it is written %2F). To tell devices apart by where they are plugged in, use ?location=BUS-PORT. Grammar: \(request.scheme.grammar)")
            }
            serial = text
        }
        let location = request[USBPlugin.location]
        if location?.isEmpty == true {
            throw TransportError(.invalidURL, "\(shown): location= needs a bus and port path, such as location=1-1.4 (`transportkit list` shows it)")
        }
        self.init(vendorId: Hex.digits(id.vendor, width: 4), productId: Hex.digits(id.product, width: 4), serialNumber: serial, location: location)
    }

    func matches(_ device: USBDeviceInfo) -> Bool {
        device.vendorId == vendorId && device.productId == productId
            && (serialNumber == nil || device.serialNumber == serialNumber)
            && (location == nil || device.location == location)
    }

    var description: String {
        var text = "USB \(vendorId):\(productId)"
        if let serialNumber { text += " serial \(TransportError.printable(serialNumber, limit: 80))" }
        if let location { text += " at \(TransportError.printable(location, limit: 80))" }
        return text
    }
}

/// Hot-plug events of USB devices.
typealias USBMonitor = UdevMonitor<USBDeviceInfo>

enum USBDiscovery {
    /// What a listing shows: without `includeAll`, devices one can open a stream to (no hubs).
    static func shown(_ device: USBDeviceInfo, includeAll: Bool) -> Bool {
        includeAll || !device.isHub
    }

    /// The USB devices of this machine, in bus and port order.
    static func list(includeAll: Bool) throws -> [DeviceRecord] {
        sorted(try USBDevices.all().filter { shown($0, includeAll: includeAll) }).map(record)
    }

    /// By bus number, then port path (1-1.2 before 1-1.10), root hubs first on their bus.
    static func sorted(_ devices: [USBDeviceInfo]) -> [USBDeviceInfo] {
        func key(_ device: USBDeviceInfo) -> [Int] {
            if USBDevices.isRootHubName(Substring(device.sysName)) { return [Int(device.sysName.dropFirst(3)) ?? 0, -1] }
            return device.sysName.split(whereSeparator: { $0 == "-" || $0 == "." }).map { Int($0) ?? 0 }
        }
        return devices.sorted { key($0).lexicographicallyPrecedes(key($1)) }
    }

    /// A device record: identity URL, ids, strings, location, speed, class, and each interface
    /// (class, endpoints, driver) in `properties` (`interface.N`), as the listing and events show it.
    static func record(_ device: USBDeviceInfo) -> DeviceRecord {
        var properties = device.properties
        if let speed = device.speed { properties["speed"] = "\(device.speedName ?? speed) (\(speed) Mbit/s)" }
        properties["class"] = Hex.digits(device.deviceClass)
        for interface in device.interfaces {
            properties["interface.\(interface.number)"] = describe(interface)
        }
        let drivers = Set(device.interfaces.compactMap(\.driver)).sorted()
        return DeviceRecord(url: USBDevices.identityURL(device), scheme: "usb", devnode: device.devnode, name: device.sysName,
                            vendorId: device.vendorId, productId: device.productId, serialNumber: device.serialNumber,
                            manufacturer: device.manufacturer, product: device.product,
                            driver: drivers.isEmpty ? nil : drivers.joined(separator: ","), links: device.links,
                            location: device.location, sysPath: device.sysPath, properties: properties)
    }

    /// "ff/ff/ff, bulk in 0x81 512, bulk out 0x02 512, driver -".
    static func describe(_ interface: USBInterfaceInfo) -> String {
        let endpoints = interface.endpoints.map { "\($0.transferType) \($0.isIn ? "in" : "out") \($0.addressText) \($0.maxPacketSize)" }
        return ([interface.classTriple] + endpoints + ["driver \(interface.driver ?? "-")"]).joined(separator: ", ")
    }

    /// Finds the one device a selector names; with `wait`, waits for it to arrive, until a little
    /// before `deadline` (then a timeout that names what did not arrive).
    static func resolve(_ selector: USBDeviceSelector, wait: Bool, deadline: ContinuousClock.Instant? = nil,
                        timeout: Duration? = nil) async throws -> USBDeviceInfo {
        // Subscribe first when waiting, so an arrival between listing and waiting is not missed.
        // Either way every USB device is read: on Blocking's pool, not on the caller's thread.
        let (monitor, present) = try await Blocking.run { () throws -> (USBMonitor?, [USBDeviceInfo]) in
            let subscribed = wait ? try Self.monitor(includeAll: false) : nil
            return (subscribed, try subscribed?.knownDevices ?? USBDevices.all())
        }
        if let found = try choose(selector, among: present) { return found }
        guard let monitor else {
            throw TransportError(.notFound, "no USB device matches \(selector): is it plugged in? `transportkit list` shows what is there; add ?wait=true to wait for it")
        }
        return try await monitor.arrival(of: "no USB device matching \(selector)", until: ConnectRequest.searchLimit(before: deadline, from: .now),
                                           timeout: timeout) { device in
            selector.matches(device) ? try choose(selector, among: monitor.knownDevices) : nil
        }
    }

    /// The single match, nil for none, or an error that lists several with what tells them apart.
    static func choose(_ selector: USBDeviceSelector, among devices: [USBDeviceInfo]) throws -> USBDeviceInfo? {
        let matches = sorted(devices.filter(selector.matches))
        guard matches.count <= 1 else {
            let list = matches.map { "serial \($0.serialNumber ?? "none") at \($0.location) (\(USBDevices.identityURL($0)))" }.joined(separator: "; ")
            throw TransportError(.invalidURL, "ambiguous: \(matches.count) USB devices match \(selector): \(list). Give the serial number "
                                 + "(usb://\(selector.vendorId):\(selector.productId)/SERIAL) or ?location= to choose one")
        }
        return matches.first
    }

    /// A monitor of usb_device uevents reporting configured devices the listing would show.
    /// `receiveBufferSize`: tests make it tiny to force ENOBUFS.
    static func monitor(includeAll: Bool, receiveBufferSize: Int32 = 8 << 20) throws -> USBMonitor {
        try UdevMonitor(subsystem: "usb", devtype: "usb_device", receiveBufferSize: receiveBufferSize,
                        list: { try USBDevices.all().filter { shown($0, includeAll: includeAll) } },
                        read: { name, _ in USBDevices.named(name).flatMap { shown($0, includeAll: includeAll) ? $0 : nil } })
    }

    /// Hot-plug events for USB devices, subscribed at once.
    static func events(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error> {
        USBMonitor.deviceEvents({ try monitor(includeAll: includeAll) }, record: record)
    }
}
