// SerialDiscovery.swift: serial ports as DeviceRecords (with identity URLs), identity
// resolution for tty://usb/VID:PID…, waiting for a device to arrive, and hot-plug events.
// The kernel interfaces are shared (TransportKitUdev): Sysfs and USBAncestry read the records,
// UdevMonitor delivers the events; what makes a tty a real port is decided here.

import Glibc
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

/// What one tty device looks like to discovery (the same record for listings and events).
struct TTYDeviceInfo: SysfsRecord {
    var sysPath: String
    var sysName: String
    var devnode: String?
    /// `true` when the node is backed by hardware (has a parent device, and is not an 8250 slot
    /// with no UART behind it).
    var isReal: Bool
    var driver: String?
    var vendorId: String?
    var productId: String?
    var serialNumber: String?
    var manufacturer: String?
    var product: String?
    var interface: Int?
    /// `bNumInterfaces` of the USB device: more than one means the interface number matters.
    var usbInterfaceCount: Int?
    var location: String?
    var links: [String]
    var properties: [String: String]

    /// Fills what sysfs did not say from udev's properties, when udevd left any (and names from
    /// the USB ID database).
    static func complete(_ info: inout TTYDeviceInfo) {
        let properties = info.properties
        info.vendorId = info.vendorId ?? properties["ID_VENDOR_ID"]?.lowercased()
        info.productId = info.productId ?? properties["ID_MODEL_ID"]?.lowercased()
        info.serialNumber = info.serialNumber ?? properties["ID_SERIAL_SHORT"]
        info.manufacturer = info.manufacturer ?? properties["ID_VENDOR_FROM_DATABASE"] ?? properties["ID_VENDOR"]
        info.product = info.product ?? properties["ID_MODEL_FROM_DATABASE"] ?? properties["ID_MODEL"]
        info.interface = info.interface ?? properties["ID_USB_INTERFACE_NUM"].flatMap { Int($0, radix: 16) }
        info.driver = info.driver ?? properties["ID_USB_DRIVER"]
    }
}

extension TTYDeviceInfo {
    /// Every device of the tty class.
    static func all() throws -> [TTYDeviceInfo] {
        try Sysfs.devices(subsystem: "tty").map(TTYDeviceInfo.init)
    }

    /// One tty device by its name in /sys/class/tty, or nil if it vanished meanwhile.
    static func named(_ name: String) -> TTYDeviceInfo? {
        Sysfs.device(subsystem: "tty", name: name).map(TTYDeviceInfo.init)
    }

    /// The tty's record: the device, whether hardware backs it, its driver and its USB identity.
    init(_ device: SysfsDevice) {
        self.init(sysPath: device.sysPath, sysName: device.sysName, devnode: device.devnode, isReal: false,
                  links: device.links, properties: device.properties)
        let sysPath = device.sysPath
        let usb = USBAncestry(sysPath: sysPath)
        let underInterface = usb?.interfacePath != nil
        // The tty's parent device: absent for virtual terminals, the console and ptmx. Below a USB
        // interface it is the directory above ".../tty/NAME" (a usb-serial port or the interface),
        // found without probing; and there is no serial-core `type` attribute to read.
        let components = sysPath.split(separator: "/")
        let parent = underInterface && components.count > 2 && components[components.count - 2] == "tty"
            ? String(sysPath[..<components[components.count - 3].endIndex])
            : Sysfs.parentDevice(of: sysPath)
        isReal = parent != nil
        if let parent {
            driver = Self.driver(from: parent)
            if !underInterface, Sysfs.attribute(sysPath, "type") == "0" {
                // A serial-core slot (8250) the kernel reserved with no UART behind it (PORT_UNKNOWN).
                isReal = false
            }
        }
        if let usb {
            if underInterface {
                interface = usb.interfaceNumber
                if driver == nil { driver = usb.interfaceDriver }
            }
            vendorId = usb.vendorId
            productId = usb.productId
            serialNumber = usb.serialNumber
            manufacturer = usb.manufacturer
            product = usb.product
            usbInterfaceCount = usb.interfaceCount
            location = usb.location
        }
        Self.complete(&self)
    }

    /// The driver of a device or of its first ancestors ("port"/"ctrl", the serial-base bus of
    /// Linux 6.5+, are skipped for the UART's own driver).
    private static func driver(from device: String) -> String? {
        var current: String? = device
        var depth = 0
        while let path = current, depth < 3 {
            if let name = Sysfs.driverName(path), name != "port", name != "ctrl" { return name }
            current = Sysfs.parentDevice(of: path)
            depth += 1
        }
        return nil
    }
}

extension USBSelector {
    /// Whether a tty is on the selected adapter (and its interface, when the selector names one).
    func matches(_ device: TTYDeviceInfo) -> Bool {
        matches(vendorId: device.vendorId, productId: device.productId, serialNumber: device.serialNumber,
                interface: device.interface, location: device.location)
    }
}

/// Hot-plug events of tty devices, read as the listing reads them.
typealias TTYMonitor = UdevMonitor<TTYDeviceInfo>

enum SerialDiscovery {
    /// The serial ports of this machine. Without `includeAll`, only ports backed by hardware.
    /// Walks every tty in sysfs: async callers run it through `Blocking.run`.
    static func list(includeAll: Bool) throws -> [DeviceRecord] {
        sortedNaturally(try TTYDeviceInfo.all().filter { includeAll || $0.isReal }).map(record)
    }

    /// Devices in the natural order of their names (``naturalKey(_:)``), each key computed once.
    static func sortedNaturally(_ devices: [TTYDeviceInfo]) -> [TTYDeviceInfo] {
        let keys = devices.map { naturalKey($0.sysName) }
        return devices.indices.sorted { keys[$0] < keys[$1] }.map { devices[$0] }
    }

    /// The record of the device behind a node or link, if discovery finds it. Only that device's
    /// entry is read, never every tty's (a connect to one port must not walk a thousand): the tty
    /// named as the node is (/sys/class/tty/NAME, after resolving links), else the device sysfs
    /// lists under the node's numbers (/sys/dev/char/MAJOR:MINOR). A few short reads, on the
    /// caller's thread. Nil for a node sysfs does not know (a pty's /dev/pts/N).
    static func record(forNode path: String) -> DeviceRecord? {
        let resolved = resolvingLinks(path)
        func found(_ name: Substring?) -> TTYDeviceInfo? {
            guard let name, !name.isEmpty, let info = TTYDeviceInfo.named(String(name)),
                  info.devnode == resolved || info.devnode == path || info.links.contains(path) else { return nil }
            return info
        }
        if let info = found(resolved.split(separator: "/").last) ?? found(path.split(separator: "/").last) {
            return record(info)
        }
        var node = stat()
        guard stat(resolved, &node) == 0, node.st_mode & S_IFMT == S_IFCHR else { return nil }
        let (major, minor) = DeviceNode.numbers(of: node.st_rdev)
        return found(Sysfs.readLink("/sys/dev/char/\(major):\(minor)")?.split(separator: "/").last).map(record)
    }

    /// `path` with its symbolic links resolved (realpath(3)), or as given when it cannot be.
    private static func resolvingLinks(_ path: String) -> String {
        guard let resolved = realpath(path, nil) else { return path }
        defer { free(resolved) }
        return String(cString: resolved)
    }

    /// A device record with a URL that reaches the same device after a replug: the USB identity
    /// (serial number when the adapter has one, else the bus location; the interface when the
    /// device has several), else a by-id link, else a by-path link, else the node.
    /// A port on a USB adapter links to its USB device's record (`properties["usbDevice"]`: the
    /// usb:// identity URL that `transportkit list` shows for the device).
    static func record(_ info: TTYDeviceInfo) -> DeviceRecord {
        var properties = info.properties
        if let vendor = info.vendorId, let product = info.productId, let location = info.location {
            properties["usbDevice"] = USBDevices.identityURL(vendorId: vendor, productId: product, serialNumber: info.serialNumber, location: location)
        }
        return DeviceRecord(url: identityURL(info), scheme: "tty", devnode: info.devnode, name: info.sysName,
                            vendorId: info.vendorId, productId: info.productId, serialNumber: info.serialNumber,
                            manufacturer: info.manufacturer, product: info.product, interface: info.interface,
                            driver: info.driver, links: info.links, location: info.location, sysPath: info.sysPath,
                            properties: properties)
    }

    static func identityURL(_ info: TTYDeviceInfo) -> String {
        if let vendor = info.vendorId, let product = info.productId {
            let interface = (info.usbInterfaceCount ?? 2) > 1 ? info.interface : nil
            return USBSelector.identity(vendorId: vendor, productId: product, serialNumber: info.serialNumber, interface: interface,
                                        location: info.location).url(.tty).description
        }
        let link = info.links.first(where: { $0.hasPrefix("/dev/serial/by-id/") }) ?? info.links.first(where: { $0.hasPrefix("/dev/serial/by-path/") })
        let path: String = link ?? info.devnode ?? "/dev/" + info.sysName
        return TransportURL(scheme: "tty", path: path).description
    }

    /// The sort key that puts ttyS2 before ttyS10: the name without its trailing digits, then
    /// their value (-1 for none).
    struct NaturalKey: Comparable {
        var stem: Substring
        var number: Int
        static func < (a: NaturalKey, b: NaturalKey) -> Bool {
            a.stem != b.stem ? a.stem < b.stem : a.number < b.number
        }
    }

    static func naturalKey(_ name: String) -> NaturalKey {
        let utf8 = name.utf8
        var stemEnd = utf8.endIndex
        while stemEnd > utf8.startIndex, case let byte = utf8[utf8.index(before: stemEnd)], byte >= 0x30 && byte <= 0x39 {
            stemEnd = utf8.index(before: stemEnd)
        }
        return NaturalKey(stem: name[..<stemEnd], number: Int(name[stemEnd...]) ?? -1)
    }

    /// The selector of `tty://usb[:BAUD]/VID:PID[/SERIAL][?serial=…&interface=…&location=…]`.
    static func selector(_ request: ConnectRequest) throws -> USBSelector {
        // The path after the host `usb`: "/VID:PID", or "/VID:PID/SERIAL" (the serial's other spelling).
        var segments = request.url.pathSegments[...]
        if segments.first == "" { segments = segments.dropFirst() }
        return try USBSelector(.tty, id: segments.first ?? "", segments: Array(segments.dropFirst()),
                               serial: request[SerialPlugin.serial], interface: request[SerialPlugin.interface],
                               location: request[SerialPlugin.location], shown: request.url.shown, grammar: request.scheme.grammar)
    }

    /// Finds the one device a selector names; with `wait`, waits for it to arrive, until a little
    /// before `deadline` (then a timeout that names what did not arrive).
    static func resolve(_ selector: USBSelector, wait: Bool, deadline: ContinuousClock.Instant? = nil,
                        timeout: Duration? = nil) async throws -> DeviceRecord {
        // Subscribe first when waiting, so an arrival between listing and waiting is not missed.
        // Either way every tty is read: on Blocking's pool, not on the caller's thread.
        let (monitor, present) = try await Blocking.run { () throws -> (TTYMonitor?, [TTYDeviceInfo]) in
            let subscribed = wait ? try Self.monitor(include: { $0.isReal }) : nil
            return (subscribed, try subscribed?.knownDevices ?? TTYDeviceInfo.all())
        }
        if let found = try choose(selector, among: present) { return record(found) }
        guard let monitor else {
            throw TransportError(.notFound, "no serial port matches \(selector): is it plugged in? `transportkit list` shows what is there; add ?wait=true to wait for it")
        }
        return try await monitor.arrival(of: "no serial port matching \(selector)", until: ConnectRequest.searchLimit(before: deadline, from: .now),
                                         timeout: timeout) { device in
            selector.matches(device) ? try choose(selector, among: monitor.knownDevices).map(record) : nil
        }
    }

    /// The single match, nil for none, or an error that lists several.
    static func choose(_ selector: USBSelector, among devices: [TTYDeviceInfo]) throws -> TTYDeviceInfo? {
        let matches = sortedNaturally(devices.filter { selector.matches($0) })
        guard matches.count <= 1 else {
            let list = matches.map { device in
                "\(device.devnode ?? device.sysName) (serial \(device.serialNumber ?? "none"), interface \(device.interface.map(String.init) ?? "?"), at \(device.location ?? "?"))"
            }.joined(separator: "; ")
            throw TransportError(.invalidURL, "ambiguous: \(matches.count) serial ports match \(selector): \(list). Add ?serial=, ?interface= or ?location= to choose one")
        }
        return matches.first
    }

    /// Waits until a device node (or a link to one) exists: woken by tty uevents, and re-checked
    /// every 250 ms for paths no uevent announces (a pty's link, a node made by hand).
    static func waitForNode(_ path: String, deadline: ContinuousClock.Instant? = nil, timeout: Duration? = nil) async throws {
        // Subscribing lists every tty: on Blocking's pool.
        let monitor = try await Blocking.run { try Self.monitor(include: { _ in true }) }
        let started = ContinuousClock.now
        let limit = ConnectRequest.searchLimit(before: deadline, from: started)
        while access(path, F_OK) != 0 {
            if let limit, ContinuousClock.now >= limit { throw TTYMonitor.notPluggedIn("no device at \(path)", since: started, timeout: timeout) }
            // A uevent, or 250 ms (at most until the limit) to look again.
            let poll = ContinuousClock.now + .milliseconds(250)
            let wake: ContinuousClock.Instant = limit.map { min($0, poll) } ?? poll
            _ = try await withDeadline(wake) { _ = try await monitor.next() }
        }
    }

    /// A monitor of tty uevents that reports the devices `include` accepts, read as the listing
    /// reads them. `receiveBufferSize`: tests make it tiny to force ENOBUFS.
    static func monitor(include: @escaping @Sendable (TTYDeviceInfo) -> Bool,
                        receiveBufferSize: Int32 = 8 << 20) throws -> TTYMonitor {
        try UdevMonitor(subsystem: "tty", receiveBufferSize: receiveBufferSize,
                        list: { try TTYDeviceInfo.all().filter(include) },
                        read: { name, _ in TTYDeviceInfo.named(name).flatMap { include($0) ? $0 : nil } })
    }

    /// Hot-plug events for serial ports, subscribed (and every tty listed, on `Blocking`'s pool)
    /// when this returns.
    static func events(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error> {
        await TTYMonitor.deviceEvents({ try monitor(include: { includeAll || $0.isReal }) }, record: record)
    }
}
