import Logging
import Synchronization

/// A scheme family: what a plugin implements to be reachable through a ``TransportRegistry``.
///
/// A plugin lists its ``Scheme``s, each a descriptor with its own connect (and listen) handler,
/// so no code switches on the scheme's name. The registry has already parsed the URL and validated
/// it against the scheme's ``SchemeDescriptor`` (so `request.options` holds typed values and
/// defaults) before a handler runs, and it enforces the connect deadline and task cancellation
/// around it. A handler should still stop promptly when its task is cancelled.
///
/// ```swift
/// struct EchoPlugin: TransportPlugin {
///     var schemes: [Scheme] {
///         [Scheme(SchemeDescriptor(scheme: "echo", summary: "Echoes what is written", grammar: "echo://",
///                                  host: .forbidden, port: .forbidden, path: .forbidden)) { request in
///             Connection(url: request.url, backend: EchoBackend())
///         }]
///     }
/// }
/// try Transport.register(EchoPlugin())
/// ```
public protocol TransportPlugin: Sendable {
    /// The schemes this plugin serves, with their grammar, options and handlers.
    var schemes: [Scheme] { get }

    /// The devices this plugin can reach now, each with a URL ready to connect.
    func devices(includeAll: Bool) async throws -> [DeviceRecord]

    /// Arrivals and removals of devices, or `nil` when the plugin has none to report. A plugin
    /// subscribes before it returns, so an event that happens after this call is not missed;
    /// `includeAll` as in ``devices(includeAll:)``. The stream should be driven by its consumer
    /// (pull), or buffer boundedly and repair an overflow itself (re-list, report the difference).
    /// Subscribing may have to list what is there (so a removal can say what went away): that
    /// listing belongs off the caller's thread (`Blocking.run` in TransportKitLinux), which is
    /// why this is `async`. A synchronous implementation satisfies it too.
    func deviceEvents(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error>?
}

extension TransportPlugin {
    /// None by default: a plugin without devices to list (`tcp`, `loop`) need not implement it.
    public func devices(includeAll: Bool) async throws -> [DeviceRecord] { [] }

    /// `nil` by default: the plugin reports no arrivals or removals.
    public func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? { nil }
}

/// One scheme: its descriptor and the handlers that connect (and listen) for its URLs.
///
/// ```swift
/// Scheme(descriptor, connect: { request in try await UnixSocket.connect(request) },
///                    listen: { request in try await UnixSocket.listen(request) })
/// Scheme.wrapper(spyDescriptor) { request in
///     let inner = try await request.connectInner()
///     return Connection(url: request.url, backend: SpyBackend(wrapping: inner))
/// }
/// ```
public struct Scheme: Sendable {
    /// Opens a connection for a validated request.
    @_spi(Plugins)
    public typealias ConnectHandler = @Sendable (ConnectRequest) async throws -> Connection
    /// Starts accepting connections for a validated request.
    @_spi(Plugins)
    public typealias ListenHandler = @Sendable (ConnectRequest) async throws -> Listener
    /// Checks a validated request without connecting: what a server can know before it listens
    /// (an address that cannot be one, a trace file that cannot be written). No connection, no
    /// waiting on a device; cheap local checks only.
    @_spi(Plugins)
    public typealias CheckHandler = @Sendable (ConnectRequest) async throws -> Void

    /// The grammar and options (``SchemeDescriptor/canListen`` and ``SchemeDescriptor/wraps``
    /// follow from how the scheme was made).
    public private(set) var descriptor: SchemeDescriptor
    let connect: ConnectHandler
    let listen: ListenHandler?
    let check: CheckHandler?

    /// A scheme that connects, and listens when `listen` is given. `check` runs at
    /// ``TransportRegistry/check(_:role:)``, after the URL was validated, for what can be known
    /// without connecting; the connect handler must still check the same things itself.
    @_spi(Plugins)
    public init(_ descriptor: SchemeDescriptor, check: CheckHandler? = nil, connect: @escaping ConnectHandler, listen: ListenHandler? = nil) {
        self.descriptor = descriptor
        self.descriptor.canListen = listen != nil
        self.connect = connect
        self.listen = listen
        self.check = check
    }

    /// A wrapper layer: its URLs are `SCHEME+URL` (`spy+tcp://…`); `connect` opens the wrapped URL
    /// with ``ConnectRequest/connectInner()`` and puts a ``WrappingBackend`` around it. The
    /// descriptor's host, port and path are forbidden and its options are written `SCHEME.NAME`.
    @_spi(Plugins)
    public static func wrapper(_ descriptor: SchemeDescriptor, check: CheckHandler? = nil, connect: @escaping ConnectHandler,
                               listen: ListenHandler? = nil) -> Scheme {
        var descriptor = descriptor
        descriptor.host = .forbidden
        descriptor.port = .forbidden
        descriptor.path = .forbidden
        descriptor.wraps = true
        return Scheme(descriptor, check: check, connect: connect, listen: listen)
    }
}

/// One validated connect or listen request, as a scheme's handler receives it.
@_spi(Plugins)
public struct ConnectRequest: Sendable {
    /// The URL of this layer: for `spy+tcp://…` the spy layer, whose ``TransportURL/inner`` is the
    /// tcp URL.
    public let url: TransportURL
    /// The descriptor the URL was validated against.
    public let scheme: SchemeDescriptor
    /// The mode the URL was validated in (``SchemeDescriptor/mode(for:role:)``); `nil` when none
    /// of the scheme's modes serves it, which the handler refuses in its own words.
    public let mode: SchemeMode?
    /// The URL's options, typed and completed with defaults; read them with the ``URLOption``
    /// constants the descriptor lists.
    public let options: OptionValues
    /// When the whole connect must be done (``timeout`` after it began), shared by every URL the
    /// handler opens through this request; `nil`: no limit.
    public let deadline: ContinuousClock.Instant?
    /// The connect time limit: the `timeout` option of the URL at the bottom of the wrapper layers;
    /// `nil` means no limit.
    public let timeout: Duration?
    /// The registry's logger, with the URL and scheme as metadata.
    public let logger: Logger
    /// How much of the connection's data may be held in memory (a listener: of each connection it
    /// accepts); plugins whose backends buffer pass it on (``ChannelBackend``, ``InboundQueue``).
    public let buffering: Buffering
    /// Protocol layers a wrapper asked to run beneath this scheme's own, nearest the wire first
    /// (TLS, for `tls+rfc2217://`); empty unless the descriptor says ``SchemeDescriptor/layersBeneath``.
    @_spi(Plugins) public let layersBeneath: [ProtocolLayer]
    let registry: TransportRegistry

    init(url: TransportURL, scheme: SchemeDescriptor, mode: SchemeMode?, options: OptionValues, timeout: Duration?, deadline: ContinuousClock.Instant?,
         logger: Logger, buffering: Buffering, layersBeneath: [ProtocolLayer] = [], registry: TransportRegistry) {
        self.buffering = buffering
        self.layersBeneath = layersBeneath
        self.url = url
        self.scheme = scheme
        self.mode = mode
        self.options = options
        self.timeout = timeout
        self.deadline = deadline
        self.logger = logger
        self.registry = registry
    }

    /// The value of `option` for this URL.
    ///
    /// ```swift
    /// let noDelay: Bool = request[SocketsPlugin.noDelay]
    /// ```
    public subscript<Value>(_ option: URLOption<Value>) -> Value {
        options[option]
    }

    /// The query items that belong to the server, for a scheme whose URL names a resource on one
    /// (``SchemeDescriptor/serverQuery``): the items the scheme does not declare, in order, values
    /// decoded. The scheme's own options are never among them.
    ///
    /// ```swift
    /// // wss://example.com/feed?token=x&timeout=5: token=x goes to the server, timeout is the scheme's.
    /// let items = request.serverQuery   // [("token", "x")]
    /// ```
    public var serverQuery: [(name: String, value: String)] {
        scheme.serverQueryItems(of: url)
    }

    /// The host, for a scheme whose descriptor requires one (the registry checked it is there).
    public var host: String {
        guard let host = url.host else { preconditionFailure("\(scheme.scheme):// declares no required host; read url.host instead") }
        return host
    }

    /// The port, for a scheme whose descriptor requires one (the registry checked it is there and
    /// in range).
    public var port: Int {
        guard let port = url.port else { preconditionFailure("\(scheme.scheme):// declares no required port; read url.port instead") }
        return port
    }

    /// Opens another URL through the registry that is connecting this one, within this request's
    /// deadline and cancellation: a plugin built on another transport (a protocol over tcp://, an
    /// echo over loop://). The returned connection is the caller's to close.
    ///
    /// ```swift
    /// let carrier = try await request.connect(to: TransportURL("loop://?buffer=65536"))
    /// ```
    public func connect(to url: TransportURL) async throws -> Connection {
        try await registry.connectWithin(url, deadline: deadline, buffering: buffering)
    }

    /// `connect(to:)` with the URL as text, as `Transport.connect(to:)` takes it;
    /// throws ``TransportError/Kind/invalidURL`` when it does not parse.
    ///
    /// ```swift
    /// let carrier = try await request.connect(to: "loop://?buffer=65536")
    /// ```
    public func connect(to url: String) async throws -> Connection {
        try await connect(to: TransportURL(url))
    }

    /// Opens the URL this wrapper layer wraps (``TransportURL/inner``), with its own options.
    public func connectInner() async throws -> Connection {
        guard let inner = url.inner else {
            throw TransportError.misuse("\(url.shown) wraps no URL; only a wrapper scheme's handler may call connectInner()")
        }
        return try await connect(to: inner)
    }

    /// Opens the wrapped URL again, later, as a new connect of its own (its own `timeout` from
    /// now, not this request's deadline): for a wrapper that replaces a connection it lost
    /// (`reconnect+`). The plugin resolves the URL again, so an identity (a by-id link, a USB
    /// serial number) finds the device wherever it came back.
    ///
    /// ```swift
    /// let fresh = try await request.connectInnerAgain()
    /// ```
    @_spi(Plugins) public func connectInnerAgain() async throws -> Connection {
        guard let inner = url.inner else {
            throw TransportError.misuse("\(url.shown) wraps no URL; only a wrapper scheme's handler may call connectInnerAgain()")
        }
        return try await registry.connect(to: inner, buffering: buffering)
    }

    /// Hot-plug events of the plugin that serves the wrapped URL's innermost scheme (`tty` for
    /// `reconnect+spy+tty://…`), or nil when it reports none (`tcp`): for a wrapper that waits
    /// for a device to come back.
    @_spi(Plugins) public func innerDeviceEvents() async -> AsyncThrowingStream<DeviceEvent, any Error>? {
        guard let inner = url.inner else { return nil }
        return await registry.deviceEvents(servingScheme: inner.innermost.scheme)
    }

    /// `true` when the wrapped URL's scheme takes layers beneath its protocol
    /// (``SchemeDescriptor/layersBeneath``).
    @_spi(Plugins) public var innerTakesLayersBeneath: Bool {
        guard let inner = url.inner else { return false }
        return registry.descriptor(of: inner)?.layersBeneath ?? false
    }

    /// Opens the wrapped URL with `layers` beneath its scheme's protocol, for a scheme whose
    /// descriptor says ``SchemeDescriptor/layersBeneath`` (check ``innerTakesLayersBeneath``).
    ///
    /// ```swift
    /// // tls+rfc2217://…: RFC 2217 over TLS over TCP.
    /// if request.innerTakesLayersBeneath { return try await request.connectInner(beneath: [tlsLayer]) }
    /// ```
    @_spi(Plugins) public func connectInner(beneath layers: [ProtocolLayer]) async throws -> Connection {
        guard let inner = url.inner else {
            throw TransportError.misuse("\(url.shown) wraps no URL; only a wrapper scheme's handler may call connectInner(beneath:)")
        }
        return try await registry.connectWithin(inner, deadline: deadline, buffering: buffering, beneath: layers)
    }

    /// Listens on the wrapped URL with `layers` beneath its scheme's protocol, for a wrapper's
    /// listen handler around a scheme whose descriptor says ``SchemeDescriptor/layersBeneath``
    /// (check ``innerTakesLayersBeneath``). The listener is the caller's to close.
    ///
    /// ```swift
    /// // tls+rfc2217:// listening: every accepted connection runs TLS, then RFC 2217.
    /// let inner = try await request.listenInner(beneath: [tlsServerLayer])
    /// ```
    @_spi(Plugins) public func listenInner(beneath layers: [ProtocolLayer]) async throws -> Listener {
        guard let inner = url.inner else {
            throw TransportError.misuse("\(url.shown) wraps no URL; only a wrapper scheme's handler may call listenInner(beneath:)")
        }
        return try await registry.listenWithin(inner, buffering: buffering, beneath: layers)
    }
}

/// What a plugin implements to accept connections. ``Listener`` wraps it.
@_spi(Plugins)
public protocol ListenerBackend: AnyObject, Sendable {
    /// The next incoming connection; `nil` once the listener is closed. Must honour cancellation.
    func accept() async throws -> Connection?
    /// Stops accepting; a waiting ``accept()`` returns `nil`. Connections accepted before stay open.
    func close() async throws
}

/// Accepts incoming connections for a URL such as `tcp://127.0.0.1:4000`.
///
/// ```swift
/// let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
/// print("listening on", listener.url)            // the bound port is filled in
/// for try await connection in listener.connections {
///     Task { try await connection.write("hello\n"); try await connection.close() }
/// }
/// ```
public final class Listener: Sendable {
    /// The address actually bound (port 0 replaced by the port the kernel chose).
    public let url: TransportURL
    /// Who can reach this listener, and whether they must prove who they are; `nil` when the
    /// plugin does not say. A server tells its operator when strangers can connect.
    public let exposure: ListenerExposure?
    private let backend: any ListenerBackend
    /// The registry's logger, set when the registry hands the listener out; accepted connections
    /// log through it.
    private let logger = Locked<Logger?>(nil)

    /// Wraps a plugin's listener backend; plugins call this from their listen handler.
    ///
    /// ```swift
    /// return Listener(url: boundURL, backend: socketListener)
    /// ```
    @_spi(Plugins)
    public init(url: TransportURL, backend: any ListenerBackend, exposure: ListenerExposure? = nil) {
        self.url = url
        self.backend = backend
        self.exposure = exposure
    }

    /// Waits for the next connection; `nil` after ``close()``.
    public func accept() async throws -> Connection? {
        let connection = try await backend.accept()
        if let connection, var logger = logger.withLock({ $0 }) {
            logger[metadataKey: "url"] = "\(connection.url)"
            logger[metadataKey: "listener"] = "\(url)"
            connection.setLogger(logger)
            logger.debug("accepted")
        }
        return connection
    }

    func setLogger(_ logger: Logger) {
        self.logger.withLock { $0 = logger }
    }

    /// Stops listening. Connections already accepted stay open.
    public func close() async throws {
        try await backend.close()
    }

    /// Incoming connections as an `AsyncSequence`; it ends when the listener is closed.
    public var connections: Connections { Connections(listener: self) }

    /// The incoming connections of a ``Listener``.
    public struct Connections: AsyncSequence, Sendable {
        /// Each accepted connection.
        public typealias Element = Connection
        let listener: Listener

        /// Accepts the next connection on each call.
        public struct AsyncIterator: AsyncIteratorProtocol {
            let listener: Listener
            /// The next connection, or `nil` once the listener is closed.
            public mutating func next() async throws -> Connection? { try await listener.accept() }
        }

        /// An iterator that accepts connections.
        public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(listener: listener) }
    }
}

/// Who can reach a listener, and whether a peer must prove who it is before it is accepted:
/// what a server built on the listener says to its operator.
///
/// ```swift
/// let exposure = ListenerExposure(reach: .network, authenticated: false,
///                                 who: "any machine that can reach 0.0.0.0 port 2000")
/// return Listener(url: bound, backend: backend, exposure: exposure)
/// ```
public struct ListenerExposure: Sendable, Equatable {
    /// How far the listener reaches.
    public enum Reach: String, Sendable, Codable {
        /// Only this user (a unix socket of mode 0600).
        case thisUser
        /// Processes of this machine (a loopback address, a unix socket other users may open).
        case thisMachine
        /// Other machines (an address other than loopback).
        case network
        /// Devices in radio range (Bluetooth).
        case radio
    }

    /// How far the listener reaches.
    public var reach: Reach
    /// `true` when a peer must prove who it is (Bluetooth pairing, a TLS client certificate).
    public var authenticated: Bool
    /// Who can connect, in words: "any machine that can reach 0.0.0.0 port 2000".
    public var who: String
    /// Something else the operator should hear, whatever the reach: a WebSocket listener that any
    /// web page in a browser can reach. `nil` when there is nothing.
    public var caution: String?

    /// An exposure; see the properties.
    public init(reach: Reach, authenticated: Bool, who: String, caution: String? = nil) {
        self.reach = reach
        self.authenticated = authenticated
        self.who = who
        self.caution = caution
    }

    /// `true` when strangers can connect: beyond this machine, with no proof of who they are.
    public var admitsStrangers: Bool { (reach == .network || reach == .radio) && !authenticated }
}

/// A device a plugin can reach, with a URL that connects to it.
public struct DeviceRecord: Sendable, Equatable, Hashable, Codable {
    /// A URL that connects to this device by identity (survives replugs where the transport allows).
    public var url: String
    /// The scheme family, such as `"tty"`.
    public var scheme: String
    /// The device node, such as `/dev/ttyUSB0`.
    public var devnode: String?
    /// A name for people: the product, the node's name.
    public var name: String?
    /// The USB vendor id, four lower-case hex digits, when the device is on USB.
    public var vendorId: String?
    /// The USB product id, four lower-case hex digits.
    public var productId: String?
    /// The device's serial number, as it reports it.
    public var serialNumber: String?
    /// The manufacturer's name, as the device reports it.
    public var manufacturer: String?
    /// The product's name, as the device reports it.
    public var product: String?
    /// The USB interface number, on a device with several.
    public var interface: Int?
    /// The kernel driver bound to the device, such as `ftdi_sio`.
    public var driver: String?
    /// Stable symlinks to the node (`/dev/serial/by-id/…`, `/dev/serial/by-path/…`).
    public var links: [String]
    /// Bus and port, such as `1-1.4`.
    public var location: String?
    /// The device's directory in sysfs, such as `/sys/devices/…/ttyUSB0`.
    public var sysPath: String?
    /// Anything else the plugin knows.
    public var properties: [String: String]

    /// A record; only the URL and the scheme are required.
    ///
    /// ```swift
    /// DeviceRecord(url: "tty://usb/0403:6001?serial=A5", scheme: "tty", devnode: "/dev/ttyUSB0")
    /// ```
    public init(url: String, scheme: String, devnode: String? = nil, name: String? = nil, vendorId: String? = nil,
                productId: String? = nil, serialNumber: String? = nil, manufacturer: String? = nil,
                product: String? = nil, interface: Int? = nil, driver: String? = nil, links: [String] = [],
                location: String? = nil, sysPath: String? = nil, properties: [String: String] = [:]) {
        self.url = url
        self.scheme = scheme
        self.devnode = devnode
        self.name = name
        self.vendorId = vendorId
        self.productId = productId
        self.serialNumber = serialNumber
        self.manufacturer = manufacturer
        self.product = product
        self.interface = interface
        self.driver = driver
        self.links = links
        self.location = location
        self.sysPath = sysPath
        self.properties = properties
    }
}

extension DeviceRecord: CustomStringConvertible {
    /// The URL, then what `transportkit list` shows of the device in its columns (DEVICE,
    /// PRODUCT, ID, SERIAL, DRIVER), each where known and not already in the URL:
    /// `tty://usb/0403:6001?serial=A50285BI (/dev/ttyUSB0, FTDI FT232R USB UART, serial A50285BI, driver ftdi_sio)`.
    ///
    /// ```swift
    /// for device in await Transport.devices().devices { print(device) }
    /// ```
    public var description: String {
        var facts: [String] = []
        if let devnode {
            if url != "\(scheme)://\(devnode)" { facts.append(devnode) }
        } else if let name, !url.contains(name) {
            facts.append(name)
        }
        let maker = manufacturer.flatMap { $0.isEmpty ? nil : $0 }
        switch (maker, product) {
        case let (maker?, product?) where !product.lowercased().hasPrefix(maker.lowercased()): facts.append("\(maker) \(product)")
        case let (_, product?): facts.append(product)
        case let (maker?, nil): facts.append(maker)
        case (nil, nil): break
        }
        if let vendorId, let productId, !url.contains("\(vendorId):\(productId)") { facts.append("\(vendorId):\(productId)") }
        if let interface, !url.contains("interface=") { facts.append("interface \(interface)") }
        if let serialNumber, !serialNumber.isEmpty { facts.append("serial \(serialNumber)") }
        if let driver { facts.append("driver \(driver)") }
        return facts.isEmpty ? url : "\(url) (\(facts.joined(separator: ", ")))"
    }
}

/// A hot-plug event.
public struct DeviceEvent: Sendable, Equatable, Codable {
    /// What happened to the device: it arrived, went away, or changed (a listing caught it half-made).
    public enum Action: String, Sendable, Codable {
        /// The device arrived.
        case added
        /// The device went away.
        case removed
        /// The device is still there and says something new about itself.
        case changed
    }
    /// What happened.
    public var action: Action
    /// The device it happened to (for a removal: the record known while it was there).
    public var device: DeviceRecord

    /// An event about `device`.
    ///
    /// ```swift
    /// DeviceEvent(.added, record)
    /// ```
    public init(_ action: Action, _ device: DeviceRecord) {
        self.action = action
        self.device = device
    }
}

/// What ``TransportRegistry/devices(includeAll:)`` found: the devices of every plugin that could
/// list them, and why the others could not. One failing plugin (no Bluetooth adapter, no udev)
/// never hides the devices of the rest.
///
/// ```swift
/// let listing = await Transport.devices()
/// for device in listing.devices { print(device.url) }
/// for failure in listing.failures { print("\(failure.schemes): \(failure.error)") }
/// ```
public struct DeviceListing: Sendable {
    /// A plugin whose listing failed.
    public struct Failure: Sendable {
        /// The schemes of the plugin, such as `["tty", "pty"]`.
        public var schemes: [String]
        /// Why its listing failed.
        public var error: TransportError
    }

    /// The devices of every plugin that could list them.
    public var devices: [DeviceRecord]
    /// The plugins that could not list their devices, and why.
    public var failures: [Failure]
}
