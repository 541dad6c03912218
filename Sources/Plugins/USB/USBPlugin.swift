// usb:// — USB devices: listing and hot-plug from sysfs and udev (TransportKitUdev); streams over a
// bulk (or interrupt) IN and OUT endpoint pair through libusb's asynchronous transfers
// (LibUSB.swift opens and claims, USBTransfers.swift moves the data).
//
// Grammar:
//   usb://VID:PID[?serial=S&location=BUS-PORT&interface=N&alt=N&in=EP&out=EP&detach=BOOL&transfers=N
//                 &transferSize=BYTES&zlp=BOOL&wait=BOOL&timeout=SECONDS]
//   usb://VID:PID?controlOnly=true[&serial=S&location=BUS-PORT&interface=N&alt=N&detach=BOOL&wait=BOOL]
//                                       control transfers only, for a device without data endpoints
//   usb://VID:PID/SERIAL[?OPTIONS]      the serial's other spelling, still read (USBSelector)
//     usb://1d50:6089?serial=0000000000000000a06063c8234e925f     a HackRF by serial number
//     usb://1d6b:0104?location=1-1                                  the device plugged into bus 1, port 1
// See Docs/Schemes.md.

@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

/// The `usb` scheme, USB device listing and hot-plug events.
///
/// ```swift
/// for device in try await USBPlugin().devices(includeAll: false) {
///     print(device.location ?? "?", device.vendorId ?? "", device.productId ?? "", device.product ?? "", device.url)
/// }
/// ```
public struct USBPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    static let interface = URLOption.integer("interface", in: 0...255,
                                             help: "The interface to claim (default: the first with a bulk IN and a bulk OUT endpoint, else the first with an interrupt pair)")
    static let alt = URLOption.integer("alt", in: 0...255, help: "The interface's alternate setting (default 0)")
    static let inEndpoint = URLOption.string("in", help: "The IN endpoint address, such as 0x81 (default: the interface's first bulk IN)")
    static let outEndpoint = URLOption.string("out", help: "The OUT endpoint address, such as 0x02 (default: the interface's first bulk OUT)")
    static let serial = URLOption.string("serial", help: "The device's serial number (also written usb://VID:PID/SERIAL)")
    static let location = URLOption.string("location", help: "The bus and port path, such as 1-1.4: tells identical devices apart")
    static let detach = URLOption.bool("detach", default: false,
                                       help: "Take the interface from a kernel driver bound to it, and give it back on close")
    static let transfers = URLOption.integer("transfers", in: 2...64, default: 4, help: "Bulk transfers kept in flight each way")
    static let transferSize = URLOption.integer("transferSize", in: 64...(1 << 20), default: 16384, help: "Bytes per bulk transfer")
    static let zlp = URLOption.bool("zlp", default: false,
                                    help: "End a write whose length is a multiple of the packet size with a zero-length packet")
    static let wait = URLOption.bool("wait", default: false, help: "Wait (up to timeout) for the device to be plugged in instead of failing at once")
    static let controlOnly = URLOption.bool("controlOnly", default: false,
                                            help: "Open the device for control transfers only (connection.usbDevice), with no data endpoints: "
                                                + "for devices that have none; reads and writes are refused")

    /// The options that choose the device: every mode takes them.
    static let identity: [any OptionDeclaration] = [serial, location, wait]

    /// The `usb` scheme.
    public var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(
            scheme: "usb",
            summary: "USB device by identity: a bulk (or interrupt) IN and OUT endpoint pair through libusb",
            grammar: "usb://VID:PID[?serial=S&location=BUS-PORT&interface=N&alt=N&in=EP&out=EP&detach=BOOL&transfers=N&transferSize=BYTES&zlp=BOOL&wait=BOOL]"
                + " | usb://VID:PID?controlOnly=true[&serial=S&location=BUS-PORT&interface=N&alt=N&detach=BOOL&wait=BOOL]"
                + " | usb://VID:PID/SERIAL[?OPTIONS]",
            examples: ["usb://1d50:6089?serial=0000000000000000a06063c8234e925f", "usb://1d6b:0104?location=1-1", "usb://0483:5740?interface=1&detach=true",
                       "usb://1209:0001?controlOnly=true"],
            authority: .usbDevice, host: .forbidden, port: .forbidden, path: .optional,
            options: [Self.interface, Self.alt, Self.inEndpoint, Self.outEndpoint, Self.serial, Self.location, Self.detach, Self.transfers,
                      Self.transferSize, Self.zlp, Self.wait, Self.controlOnly],
            modes: [SchemeMode("usb:// control-only connection", form: "usb://VID:PID?controlOnly=true", selectedBy: Self.controlOnly,
                               options: Self.identity + [Self.controlOnly, Self.interface, Self.alt, Self.detach]),
                    SchemeMode("usb:// connection", form: "usb://VID:PID",
                               options: Self.identity + [Self.interface, Self.alt, Self.inEndpoint, Self.outEndpoint, Self.detach, Self.transfers,
                                                         Self.transferSize, Self.zlp, Self.controlOnly])],
            exclusive: true, reachesDevice: true
        ), check: Self.check, connect: Self.connect)]
    }

    /// What a server checks before it listens: the device's identity and the endpoint addresses.
    @Sendable static func check(_ request: ConnectRequest) async throws {
        _ = try USBDiscovery.selector(request)
        if request[controlOnly] {
            try checkControlOnly(request)
            return
        }
        _ = try parseEndpoint(request[inEndpoint], option: "in", describing: request.url.description)
        _ = try parseEndpoint(request[outEndpoint], option: "out", describing: request.url.description)
    }

    /// `alt=` and `detach=` are about the interface claimed: without `interface=` there is none.
    static func checkControlOnly(_ request: ConnectRequest) throws {
        guard request[interface] == nil else { return }
        if request[alt] != nil {
            throw TransportError(.invalidURL, "\(request.url.shown): alt= sets the alternate setting of the interface a control-only connection "
                                 + "claims, and it claims one only with interface=; give interface= too, or leave alt= out. Grammar: \(request.scheme.grammar)")
        }
        if request[detach] {
            throw TransportError(.invalidURL, "\(request.url.shown): detach=true takes the claimed interface from its kernel driver, and a "
                                 + "control-only connection claims one only with interface=; give interface= too, or leave detach= out. "
                                 + "Grammar: \(request.scheme.grammar)")
        }
    }

    /// The URL's device (waiting for it with `wait=`) and its node below /dev/bus/usb.
    static func resolve(_ request: ConnectRequest, describing: String) async throws -> (USBDeviceInfo, String) {
        let selector = try USBDiscovery.selector(request)
        let device = try await USBDiscovery.resolve(selector, wait: request[wait], deadline: request.deadline, timeout: request.timeout)
        guard let node = device.devnode else {
            throw TransportError(.notFound, "\(describing): \(device.sysPath) has no device node below /dev/bus/usb (is devtmpfs mounted?)")
        }
        return (device, node)
    }

    /// Opens `node` and runs `setUp` with it, both on TransportKit's pool, not on the caller's
    /// thread: opening, the configuration walk and a claim are usbfs ioctls, and a detach unbinds
    /// a kernel driver. When `setUp` throws, the interface it recorded in its second argument as
    /// claimed is given back and the device closed.
    static func opened<Value: Sendable>(_ node: String, _ device: USBDeviceInfo, describing: String,
                                        _ setUp: @escaping @Sendable (LibUSBDevice, inout Int?) throws -> Value) async throws -> Value {
        try await Blocking.run {
            let usb = try LibUSBDevice(node: node, device: device, describing: describing)
            var claimed: Int?
            do {
                return try setUp(usb, &claimed)
            } catch {
                usb.close(releasing: claimed)
                throw error
            }
        }
    }

    /// A connection for control transfers only: the device opened, `interface=` claimed when given
    /// (for class or vendor requests to it; usbfs lets requests to the device through unclaimed),
    /// no data transfers.
    static func connectControlOnly(_ request: ConnectRequest) async throws -> Connection {
        let describing = request.url.description
        try checkControlOnly(request)
        let (device, node) = try await resolve(request, describing: describing)
        let (chosen, alternate, detaching) = (request[Self.interface], request[Self.alt] ?? 0, request[Self.detach])
        let (engine, claimed) = try await opened(node, device, describing: describing) { usb, claimed in
            if let number = chosen {
                _ = try matchingAlternates(try usb.alternates(describing: describing), interface: number, alternate: alternate, describing: describing)
                let driver = device.interfaces.first { $0.number == number }?.driver
                try usb.claim(number, alternate: alternate, detach: detaching, driver: driver, describing: describing)
                claimed = number
            }
            let engine = try USBTransferEngine(device: usb, choice: nil, claimed: claimed, transfers: 0, transferSize: 64, zlp: false,
                                               sysPath: device.sysPath, describing: describing)
            return (engine, claimed)
        }
        var described = Self.metadata(device, nil)
        described.extra["controlOnly"] = "true"
        if let claimed {
            described.extra["interface"] = String(claimed)
            described.extra["alt"] = String(alternate)
        }
        return Connection(url: request.url, backend: USBBackend(engine: engine), metadata: described)
    }

    static func connect(_ request: ConnectRequest) async throws -> Connection {
        if request[controlOnly] { return try await connectControlOnly(request) }
        let describing = request.url.description
        let input = try parseEndpoint(request[inEndpoint], option: "in", describing: describing)
        let output = try parseEndpoint(request[outEndpoint], option: "out", describing: describing)
        let (device, node) = try await resolve(request, describing: describing)
        let (number, alternate, detaching) = (request[Self.interface], request[Self.alt], request[Self.detach])
        let (count, size, zeroPacket) = (request[Self.transfers], request[Self.transferSize], request[Self.zlp])
        let (engine, choice) = try await opened(node, device, describing: describing) { usb, claimed in
            let choice = try chooseEndpoints(try usb.alternates(describing: describing), interface: number, alternate: alternate,
                                             input: input, output: output, describing: describing)
            let driver = device.interfaces.first { $0.number == choice.interface }?.driver
            try usb.claim(choice.interface, alternate: choice.alternate, detach: detaching, driver: driver, describing: describing)
            claimed = choice.interface
            let engine = try USBTransferEngine(device: usb, choice: choice, claimed: choice.interface, transfers: count,
                                               transferSize: size, zlp: zeroPacket, sysPath: device.sysPath, describing: describing)
            return (engine, choice)
        }
        // From here the engine owns the device and closes it.
        do {
            try engine.start()
        } catch {
            await engine.close(drain: false)
            throw error
        }
        return Connection(url: request.url, backend: USBBackend(engine: engine), metadata: metadata(device, choice))
    }

    /// CornucopiaStreams' CC_meta for USB: the device's strings, and the interface and endpoints in use.
    static func metadata(_ device: USBDeviceInfo, _ choice: USBEndpointChoice?) -> ConnectionMetadata {
        var metadata = ConnectionMetadata()
        metadata.name = device.product
        metadata.manufacturer = device.manufacturer
        metadata.model = device.product
        metadata.serialNumber = device.serialNumber
        metadata.remoteAddress = device.location
        metadata.extra = ["vendorId": device.vendorId, "productId": device.productId, "location": device.location]
        if let choice {
            metadata.extra.merge([
                "interface": String(choice.interface), "alt": String(choice.alternate),
                "in": choice.input.addressText, "out": choice.output.addressText,
                "inPacketSize": String(choice.input.maxPacketSize), "outPacketSize": String(choice.output.maxPacketSize),
                "inType": choice.input.typeName, "outType": choice.output.typeName,
            ]) { _, new in new }
        }
        if let speed = device.speed { metadata.extra["speed"] = "\(device.speedName ?? speed) (\(speed) Mbit/s)" }
        return metadata
    }

    /// The USB devices of this machine, each with an identity URL; hubs only with `includeAll`.
    public func devices(includeAll: Bool) async throws -> [DeviceRecord] {
        // The walk of sysfs runs on Blocking's pool, not on the caller's thread.
        try await Blocking.run { try USBDiscovery.list(includeAll: includeAll) }
    }

    /// Arrivals and removals of USB devices (each once, an arrival once the device is configured),
    /// subscribed before this returns (the walk of sysfs that subscribing makes runs on
    /// `Blocking`'s pool).
    public func deviceEvents(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error>? {
        await USBDiscovery.events(includeAll: includeAll)
    }
}
