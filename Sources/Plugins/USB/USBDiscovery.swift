// USBDiscovery.swift: USB devices as DeviceRecords (with identity URLs), identity resolution for
// usb://VID:PID[?serial=…&location=…] (and usb://VID:PID/SERIAL), waiting for a device to arrive,
// and hot-plug events. The kernel interfaces are shared (TransportKitUdev): USBDevices reads sysfs,
// UdevMonitor delivers the uevents of usb_device nodes, USBSelector reads and matches the identity.

@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

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

    /// The selector of `usb://VID:PID[/SERIAL][?serial=…&location=…]`. Its `interface=` is the
    /// interface to claim, not part of the device's identity.
    static func selector(_ request: ConnectRequest) throws -> USBSelector {
        let url = request.url
        // The path after VID:PID: "", or "/SERIAL" (the serial's other spelling).
        var segments = url.pathSegments[...]
        if segments.first == "" { segments = segments.dropFirst() }
        return try USBSelector(.usb, id: (url.host ?? "") + ":" + (url.portText ?? ""), segments: Array(segments),
                               serial: request[USBPlugin.serial], interface: nil, location: request[USBPlugin.location],
                               shown: url.shown, grammar: request.scheme.grammar)
    }

    /// Finds the one device a selector names; with `wait`, waits for it to arrive, until a little
    /// before `deadline` (then a timeout that names what did not arrive).
    static func resolve(_ selector: USBSelector, wait: Bool, deadline: ContinuousClock.Instant? = nil,
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
    static func choose(_ selector: USBSelector, among devices: [USBDeviceInfo]) throws -> USBDeviceInfo? {
        let matches = sorted(devices.filter { selector.matches($0) })
        guard matches.count <= 1 else {
            let list = matches.map { "serial \($0.serialNumber ?? "none") at \($0.location) (\(USBDevices.identityURL($0)))" }.joined(separator: "; ")
            throw TransportError(.invalidURL, "ambiguous: \(matches.count) USB devices match \(selector): \(list). Add ?serial= "
                                 + "(usb://\(selector.vendorId):\(selector.productId)?serial=SERIAL) or ?location= to choose one")
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

    /// Hot-plug events for USB devices, subscribed (and every USB device listed, on `Blocking`'s
    /// pool) when this returns.
    static func events(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error> {
        await USBMonitor.deviceEvents({ try monitor(includeAll: includeAll) }, record: record)
    }
}
