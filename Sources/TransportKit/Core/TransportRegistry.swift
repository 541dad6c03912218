import Synchronization

/// Maps schemes to plugins and connects by URL.
///
/// Plugins register and unregister at run time; a scheme an application registers works exactly
/// like a built-in one. The `TransportKit` module provides `TransportRegistry.standard` with
/// every built-in scheme; a fresh `TransportRegistry()` starts empty.
///
/// ```swift
/// let registry = TransportRegistry()
/// try registry.register(MyPlugin())                   // throws .busy if the scheme is taken
/// try registry.register(BetterPlugin(), replacing: true)
/// let connection = try await registry.connect(to: "my://device")
/// ```
public final class TransportRegistry: Sendable {
    private let plugins: Mutex<[String: Entry]>

    private struct Entry: Sendable {
        var descriptor: SchemeDescriptor
        var plugin: any TransportPlugin
    }

    public init(plugins: [any TransportPlugin] = []) throws {
        self.plugins = Mutex([:])
        for plugin in plugins { try register(plugin) }
    }

    // MARK: Registration

    /// Registers every scheme of `plugin`. Refuses (kind `.busy`) when a scheme already has a
    /// handler, unless `replacing` is `true`. Nothing is registered when any scheme is refused.
    public func register(_ plugin: any TransportPlugin, replacing: Bool = false) throws {
        let descriptors = plugin.schemes
        guard !descriptors.isEmpty else {
            throw TransportError(.invalidURL, "\(type(of: plugin)) declares no scheme")
        }
        try plugins.withLock { table in
            for descriptor in descriptors {
                guard descriptor.scheme.first?.isLetter == true,
                      descriptor.scheme.allSatisfy({ $0.isASCII && ($0.isLetter || $0.isNumber || "+-.".contains($0)) })
                else {
                    throw TransportError(.invalidURL, "'\(descriptor.scheme)' is not a valid scheme name")
                }
                if !replacing, table[descriptor.scheme] != nil {
                    throw TransportError(.busy, "the scheme \(descriptor.scheme):// is already registered; pass replacing: true to replace its handler")
                }
            }
            for descriptor in descriptors {
                table[descriptor.scheme] = Entry(descriptor: descriptor, plugin: plugin)
            }
        }
    }

    /// Removes the handler of `scheme`. Returns `false` when none was registered.
    @discardableResult
    public func unregister(scheme: String) -> Bool {
        plugins.withLock { $0.removeValue(forKey: scheme.lowercased()) != nil }
    }

    /// Every registered scheme, sorted by name.
    public var schemes: [SchemeDescriptor] {
        plugins.withLock { table in table.values.map(\.descriptor) }.sorted { $0.scheme < $1.scheme }
    }

    /// The descriptor of `scheme`, if registered.
    public func descriptor(for scheme: String) -> SchemeDescriptor? {
        plugins.withLock { $0[scheme.lowercased()]?.descriptor }
    }

    // MARK: Resolving

    /// Parses and validates `url` without any I/O.
    public func resolve(_ url: String) throws -> ConnectRequest {
        try resolve(TransportURL(url))
    }

    /// Validates `url` against its scheme without any I/O.
    public func resolve(_ url: TransportURL) throws -> ConnectRequest {
        try resolveEntry(url).request
    }

    private func resolveEntry(_ url: TransportURL) throws -> (request: ConnectRequest, plugin: any TransportPlugin) {
        guard let entry = plugins.withLock({ $0[url.scheme] }) else {
            let known = schemes.map { $0.scheme + "://" }.joined(separator: ", ")
            throw TransportError(.unsupportedScheme, "no plugin handles \(url.scheme)://; registered schemes: \(known.isEmpty ? "none" : known)")
        }
        let options = try entry.descriptor.validate(url)
        return (ConnectRequest(url: url, scheme: entry.descriptor, options: options), entry.plugin)
    }

    // MARK: Connecting

    /// Connects to `url`, such as `"tcp://127.0.0.1:4000"` or `"loop://"`.
    ///
    /// Fails before any I/O when the URL is malformed or its scheme unknown. Honours the
    /// `timeout` option (default 10 s) and task cancellation; a connection that completes after
    /// either is closed, never leaked.
    public func connect(to url: String) async throws -> Connection {
        try await connect(to: TransportURL(url))
    }

    /// Connects to a parsed URL.
    public func connect(to url: TransportURL) async throws -> Connection {
        let (request, plugin) = try resolveEntry(url)
        return try await Deadline.run(
            timeout: request.timeout,
            timeoutError: TransportError(.timedOut, "connecting to \(url) took longer than \(request.timeout?.secondsText ?? "the limit"); check that the device or peer is there, or raise ?timeout="),
            discard: { connection in try? await connection.close() }
        ) {
            try await plugin.connect(request)
        }
    }

    /// Connects, runs `body`, and closes the connection however `body` ends.
    ///
    /// ```swift
    /// let reply = try await registry.withConnection(to: "tcp://127.0.0.1:7") { connection in
    ///     try await connection.write("ping")
    ///     return try await connection.read()
    /// }
    /// ```
    public func withConnection<Result: Sendable>(
        to url: String, _ body: (Connection) async throws -> Result
    ) async throws -> Result {
        let connection = try await connect(to: url)
        let result: Result
        do {
            result = try await body(connection)
        } catch {
            try? await connection.close()
            throw error
        }
        try await connection.close()
        return result
    }

    /// Starts listening on `url`, such as `"tcp://127.0.0.1:0"` or `"unix:///tmp/app.sock"`.
    public func listen(on url: String) async throws -> Listener {
        try await listen(on: TransportURL(url))
    }

    /// Starts listening on a parsed URL.
    public func listen(on url: TransportURL) async throws -> Listener {
        let (request, plugin) = try resolveEntry(url)
        guard request.scheme.canListen else {
            throw TransportError(.unsupported, "\(url.scheme):// cannot listen for connections; schemes that can: \(schemes.filter(\.canListen).map { $0.scheme + "://" }.joined(separator: ", "))")
        }
        return try await plugin.listen(request)
    }

    // MARK: Devices

    /// The devices every plugin can reach, merged.
    public func devices(includeAll: Bool = false) async throws -> [DeviceRecord] {
        var seen = Set<ObjectIdentifierBox>()
        var result: [DeviceRecord] = []
        for plugin in uniquePlugins(&seen) {
            result += try await plugin.devices(includeAll: includeAll)
        }
        return result
    }

    /// Hot-plug events of every plugin that reports them, merged into one stream.
    public func deviceEvents(includeAll: Bool = false) -> AsyncThrowingStream<DeviceEvent, any Error> {
        var seen = Set<ObjectIdentifierBox>()
        let sources = uniquePlugins(&seen).compactMap { $0.deviceEvents(includeAll: includeAll) }
        // One source (the usual case): hand it out as it is, pull-driven, with no extra hop.
        if sources.count == 1, let only = sources.first { return only }
        let (stream, continuation) = AsyncThrowingStream<DeviceEvent, any Error>.makeStream(bufferingPolicy: .bufferingOldest(4096))
        let task = Task {
            await withThrowingTaskGroup(of: Void.self) { group in
                for source in sources {
                    group.addTask {
                        for try await event in source { continuation.yield(event) }
                    }
                }
                do {
                    try await group.waitForAll()
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }
        }
        continuation.onTermination = { _ in task.cancel() }
        return stream
    }

    private func uniquePlugins(_ seen: inout Set<ObjectIdentifierBox>) -> [any TransportPlugin] {
        let entries = plugins.withLock { table in table.values.sorted { $0.descriptor.scheme < $1.descriptor.scheme } }
        var result: [any TransportPlugin] = []
        for entry in entries where seen.insert(ObjectIdentifierBox(entry.plugin)).inserted {
            result.append(entry.plugin)
        }
        return result
    }
}

/// Identity of a plugin registered under several schemes: by the type and its schemes.
private struct ObjectIdentifierBox: Hashable {
    let type: ObjectIdentifier
    let schemes: [String]
    init(_ plugin: any TransportPlugin) {
        type = ObjectIdentifier(Swift.type(of: plugin))
        schemes = plugin.schemes.map(\.scheme)
    }
}
