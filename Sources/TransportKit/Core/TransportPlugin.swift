/// A scheme family: what a plugin implements to be reachable through a ``TransportRegistry``.
///
/// Only ``schemes`` and ``connect(_:)`` are required. The registry has already parsed the URL and
/// validated it against the scheme's ``SchemeDescriptor`` (so `request.options` holds typed
/// values and defaults), and it enforces the `timeout` option and task cancellation around
/// `connect`. A plugin should still stop promptly when its task is cancelled.
///
/// ```swift
/// struct EchoPlugin: TransportPlugin {
///     let schemes = [SchemeDescriptor(scheme: "echo", summary: "Echoes what is written",
///                                     grammar: "echo://", host: .forbidden, port: .forbidden, path: .forbidden)]
///
///     func connect(_ request: ConnectRequest) async throws -> Connection {
///         Connection(url: request.url, backend: MyEchoBackend())
///     }
/// }
/// try Transport.registry.register(EchoPlugin())
/// ```
public protocol TransportPlugin: Sendable {
    /// The schemes this plugin serves, with their grammar and options.
    var schemes: [SchemeDescriptor] { get }

    /// Opens a connection.
    func connect(_ request: ConnectRequest) async throws -> Connection

    /// Starts accepting connections; only for schemes whose descriptor says `canListen`.
    func listen(_ request: ConnectRequest) async throws -> Listener

    /// The devices this plugin can reach now, each with a URL ready to connect.
    func devices(includeAll: Bool) async throws -> [DeviceRecord]

    /// Arrivals and removals of devices, or `nil` when the plugin has none to report. A plugin
    /// subscribes before it returns, so an event that happens after this call is not missed;
    /// `includeAll` as in ``devices(includeAll:)``.
    func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>?
}

extension TransportPlugin {
    public func listen(_ request: ConnectRequest) async throws -> Listener {
        throw TransportError(.unsupported, "\(request.url.scheme):// cannot listen for connections")
    }

    public func devices(includeAll: Bool) async throws -> [DeviceRecord] { [] }

    public func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? { nil }
}

/// One validated connect or listen request, as a plugin receives it.
public struct ConnectRequest: Sendable {
    public var url: TransportURL
    public var scheme: SchemeDescriptor
    /// The URL's options, typed and completed with defaults.
    public var options: OptionValues

    public init(url: TransportURL, scheme: SchemeDescriptor, options: OptionValues) {
        self.url = url
        self.scheme = scheme
        self.options = options
    }

    /// The `timeout` option; `nil` means no limit.
    public var timeout: Duration? { options.duration("timeout") }
}

/// What a plugin implements to accept connections. ``Listener`` wraps it.
public protocol ListenerBackend: AnyObject, Sendable {
    /// The next incoming connection; `nil` once the listener is closed. Must honour cancellation.
    func accept() async throws -> Connection?
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
    private let backend: any ListenerBackend

    public init(url: TransportURL, backend: any ListenerBackend) {
        self.url = url
        self.backend = backend
    }

    /// Waits for the next connection; `nil` after ``close()``.
    public func accept() async throws -> Connection? {
        try await backend.accept()
    }

    /// Stops listening. Connections already accepted stay open.
    public func close() async throws {
        try await backend.close()
    }

    /// Incoming connections as an `AsyncSequence`; it ends when the listener is closed.
    public var connections: Connections { Connections(listener: self) }

    public struct Connections: AsyncSequence, Sendable {
        public typealias Element = Connection
        let listener: Listener

        public struct AsyncIterator: AsyncIteratorProtocol {
            let listener: Listener
            public mutating func next() async throws -> Connection? { try await listener.accept() }
        }

        public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(listener: listener) }
    }
}

/// A device a plugin can reach, with a URL that connects to it.
public struct DeviceRecord: Sendable, Equatable, Hashable, Codable {
    /// A URL that connects to this device by identity (survives replugs where the transport allows).
    public var url: String
    /// The scheme family, such as `"tty"`.
    public var scheme: String
    /// The device node, such as `/dev/ttyUSB0`.
    public var devnode: String?
    public var name: String?
    public var vendorId: String?
    public var productId: String?
    public var serialNumber: String?
    public var manufacturer: String?
    public var product: String?
    public var interface: Int?
    public var driver: String?
    /// Stable symlinks to the node (`/dev/serial/by-id/…`, `/dev/serial/by-path/…`).
    public var links: [String]
    /// Bus and port, such as `1-1.4`.
    public var location: String?
    public var sysPath: String?
    /// Anything else the plugin knows.
    public var properties: [String: String]

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

/// A hot-plug event.
public struct DeviceEvent: Sendable, Equatable, Codable {
    public enum Action: String, Sendable, Codable { case added, removed, changed }
    public var action: Action
    public var device: DeviceRecord

    public init(_ action: Action, _ device: DeviceRecord) {
        self.action = action
        self.device = device
    }
}
