// The TransportKit module: the core plus every built-in scheme, registered.
// `import TransportKit` is all an application needs (`import TransportKitFoundation` adds the
// InputStream/OutputStream bridge).

@_exported import TransportKitCore
@_exported import TransportKitLoop
@_exported import TransportKitSerial
@_exported import TransportKitSockets
@_exported import TransportKitSpy
@_exported import TransportKitBluetooth
@_exported import TransportKitUSB
@_exported import TransportKitTLS
@_exported import TransportKitWeb
@_exported import TransportKitRFC2217
@_exported import TransportKitReconnect

extension TransportRegistry {
    /// A registry with every built-in plugin registered. `Transport` uses it; applications add
    /// their own schemes to it with `register(_:replacing:)`.
    public static let standard: TransportRegistry = {
        let registry: TransportRegistry
        do {
            registry = try TransportRegistry(plugins: Transport.builtInPlugins)
        } catch {
            // The built-in plugins declare distinct, valid schemes; a clash is a bug in this file.
            preconditionFailure("built-in plugins clash: \(error)")
        }
        return registry
    }()
}

/// The front door: connect, listen, list devices, watch them, and register schemes, all through
/// `TransportRegistry.standard`.
///
/// ```swift
/// import TransportKit
///
/// try await Transport.withConnection(to: "tcp://127.0.0.1:4000") { connection in
///     try await connection.write("hello\n")
///     print(try await connection.read() ?? [])
/// }
/// for device in await Transport.devices().devices { print(device.url) }
/// ```
public enum Transport {
    /// Fresh instances of every built-in plugin.
    public static var builtInPlugins: [any TransportPlugin] {
        [LoopPlugin(), SocketsPlugin(), TLSPlugin(), WebPlugin(), SerialPlugin(), RFC2217Plugin(), SpyPlugin(), ReplayPlugin(), ReconnectPlugin(), BluetoothPlugin(), USBPlugin()]
    }

    /// The registry behind these functions.
    public static var registry: TransportRegistry { .standard }

    /// Connects to `url`; see `TransportRegistry.connect`.
    public static func connect(to url: String) async throws -> Connection {
        try await registry.connect(to: url)
    }

    /// Connects to a parsed `url`; see `TransportRegistry.connect`. The same call as
    /// `connect(to:)` with a `String`, for a URL built or parsed before (a device record's `url`).
    ///
    /// ```swift
    /// let url = try TransportURL("tcp://127.0.0.1:4000")
    /// let connection = try await Transport.connect(to: url)
    /// ```
    public static func connect(to url: TransportURL) async throws -> Connection {
        try await registry.connect(to: url)
    }

    /// Connects, runs `body` (on the caller's actor), and always closes; see
    /// `TransportRegistry.withConnection`.
    public static func withConnection<Result>(
        to url: String,
        isolation: isolated (any Actor)? = #isolation,
        _ body: (Connection) async throws -> sending Result
    ) async throws -> sending Result {
        try await registry.withConnection(to: url, isolation: isolation, body)
    }

    /// Starts listening on `url`; see `TransportRegistry.listen`.
    public static func listen(on url: String) async throws -> Listener {
        try await registry.listen(on: url)
    }

    /// Starts listening on a parsed `url`; see `TransportRegistry.listen`.
    ///
    /// ```swift
    /// let listener = try await Transport.listen(on: TransportURL("tcp://127.0.0.1:0"))
    /// ```
    public static func listen(on url: TransportURL) async throws -> Listener {
        try await registry.listen(on: url)
    }

    /// The devices every plugin can reach; see `TransportRegistry.devices`.
    public static func devices(includeAll: Bool = false) async -> DeviceListing {
        await registry.devices(includeAll: includeAll)
    }

    /// Hot-plug events of every plugin, subscribed when this returns; see `TransportRegistry.deviceEvents`.
    ///
    /// ```swift
    /// for try await event in await Transport.deviceEvents() { print(event.action, event.device.url) }
    /// ```
    public static func deviceEvents(includeAll: Bool = false) async -> AsyncThrowingStream<DeviceEvent, any Error> {
        await registry.deviceEvents(includeAll: includeAll)
    }

    /// Registers an application's plugin; see `TransportRegistry.register`.
    public static func register(_ plugin: any TransportPlugin, replacing: Bool = false) throws {
        try registry.register(plugin, replacing: replacing)
    }

    /// Removes a scheme; see `TransportRegistry.unregister`.
    @discardableResult
    public static func unregister(scheme: String) -> Bool {
        registry.unregister(scheme: scheme)
    }

    /// Every registered scheme with its grammar and options.
    public static var schemes: [SchemeDescriptor] { registry.schemes }
}
