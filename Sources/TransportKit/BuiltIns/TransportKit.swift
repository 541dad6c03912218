// The TransportKit module: the core plus every built-in scheme, registered.
// `import TransportKit` is all an application needs.

@_exported import TransportKitCore
@_exported import TransportKitLoop
@_exported import TransportKitSerial
@_exported import TransportKitSockets

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

/// The front door: connect, listen and list devices through ``TransportRegistry/standard``.
///
/// ```swift
/// import TransportKit
///
/// try await Transport.withConnection(to: "tcp://127.0.0.1:4000") { connection in
///     try await connection.write("hello\n")
///     print(try await connection.read() ?? [])
/// }
/// ```
public enum Transport {
    /// Fresh instances of every built-in plugin.
    public static var builtInPlugins: [any TransportPlugin] {
        [LoopPlugin(), SocketsPlugin(), SerialPlugin()]
    }

    /// The registry behind these functions.
    public static var registry: TransportRegistry { .standard }

    /// Connects to `url`; see ``TransportRegistry/connect(to:)-(String)``.
    public static func connect(to url: String) async throws -> Connection {
        try await registry.connect(to: url)
    }

    /// Connects, runs `body`, and always closes; see ``TransportRegistry/withConnection(to:_:)``.
    public static func withConnection<Result: Sendable>(
        to url: String, _ body: (Connection) async throws -> Result
    ) async throws -> Result {
        try await registry.withConnection(to: url, body)
    }

    /// Starts listening on `url`; see ``TransportRegistry/listen(on:)-(String)``.
    public static func listen(on url: String) async throws -> Listener {
        try await registry.listen(on: url)
    }

    /// Registers an application's plugin; see ``TransportRegistry/register(_:replacing:)``.
    public static func register(_ plugin: any TransportPlugin, replacing: Bool = false) throws {
        try registry.register(plugin, replacing: replacing)
    }
}
