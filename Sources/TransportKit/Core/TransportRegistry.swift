import Logging
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
///
/// Logging goes through swift-log at `debug` level (connects, listens, closes, failures, with the
/// URL and scheme as metadata), so it is silent unless the application's logging backend asks for
/// `debug`.
public final class TransportRegistry: Sendable {
    private let table: Locked<Table>
    /// The logger connections and plugins log through.
    public let logger: Logger

    private struct Table {
        var schemes: [String: Entry] = [:]
        var nextPluginID = 0
    }

    private struct Entry: Sendable {
        var scheme: Scheme
        /// Which registration the scheme came with: a plugin's schemes share it.
        var pluginID: Int
        var plugin: any TransportPlugin
    }

    /// A registry with `plugins` registered.
    ///
    /// ```swift
    /// let registry = try TransportRegistry(plugins: Transport.builtInPlugins, logger: Logger(label: "myapp.transport"))
    /// ```
    public init(plugins: [any TransportPlugin] = [], logger: Logger = Logger(label: "TransportKit")) throws {
        self.table = Locked(Table())
        self.logger = logger
        for plugin in plugins { try register(plugin) }
    }

    // MARK: Registration

    /// Registers every scheme of `plugin`. Refuses with ``TransportError/Kind/busy`` when a scheme
    /// already has a handler, unless `replacing` is `true`, and with ``TransportError/Kind/misuse``
    /// when a descriptor is malformed (a bad name, an option declared twice, a default outside its
    /// range). Nothing is registered when any scheme is refused.
    public func register(_ plugin: any TransportPlugin, replacing: Bool = false) throws {
        let schemes = plugin.schemes
        guard !schemes.isEmpty else {
            throw TransportError.misuse("\(type(of: plugin)) declares no scheme")
        }
        let problems = schemes.flatMap { $0.descriptor.declarationProblems() }
        guard problems.isEmpty else {
            throw TransportError.misuse("\(type(of: plugin)) cannot be registered: " + problems.joined(separator: "; "))
        }
        // A wrapper and a plain scheme may share a name (tls+unix://… and tls://HOST:PORT): the
        // wrapper is keyed "NAME+", the one a URL with an inner layer reaches first.
        let names = schemes.map(\.descriptor.tableKey)
        if let twice = names.first(where: { name in names.filter { $0 == name }.count > 1 }) {
            throw TransportError.misuse("\(type(of: plugin)) declares \(twice.hasSuffix("+") ? "the wrapper " + twice.dropLast() + "+" : twice + "://") twice")
        }
        try table.withLock { table in
            if !replacing, let taken = names.first(where: { table.schemes[$0] != nil }) {
                throw TransportError(.busy, "the scheme \(taken.hasSuffix("+") ? taken : taken + "://") is already registered; pass replacing: true to replace its handler")
            }
            table.nextPluginID += 1
            for scheme in schemes {
                table.schemes[scheme.descriptor.tableKey] = Entry(scheme: scheme, pluginID: table.nextPluginID, plugin: plugin)
            }
        }
    }

    /// Removes the handler of `scheme`. Returns `false` when none was registered.
    @discardableResult
    public func unregister(scheme: String) -> Bool {
        table.withLock { table in
            let plain = table.schemes.removeValue(forKey: scheme.lowercased()) != nil
            let wrapper = table.schemes.removeValue(forKey: scheme.lowercased() + "+") != nil
            return plain || wrapper
        }
    }

    /// Every registered scheme, sorted by name.
    public var schemes: [SchemeDescriptor] {
        // A wrapper after the plain scheme of its name (tls://, then tls+URL), in a stable order.
        table.withLock { table in table.schemes.values.map(\.scheme.descriptor) }.sorted { ($0.scheme, $0.wraps ? 1 : 0) < ($1.scheme, $1.wraps ? 1 : 0) }
    }

    /// The descriptor of `scheme`, if registered.
    public func descriptor(for scheme: String) -> SchemeDescriptor? {
        table.withLock { $0.schemes[scheme.lowercased()]?.scheme.descriptor ?? $0.schemes[scheme.lowercased() + "+"]?.scheme.descriptor }
    }

    // MARK: Resolving

    /// Parses and validates `url` without any I/O.
    ///
    /// ```swift
    /// let request = try registry.resolve("tcp://localhost:4000?noDelay=false")
    /// ```
    @_spi(Plugins)
    public func resolve(_ url: String) throws -> ConnectRequest {
        try resolve(TransportURL(url))
    }

    /// Validates `url` (every layer of a wrapped URL) against its scheme without any I/O.
    @_spi(Plugins)
    public func resolve(_ url: TransportURL) throws -> ConnectRequest {
        try resolveEntry(url, deadline: nil).request
    }

    /// Validates `url` for `role` (every layer; the layers under a wrapper for connecting) without
    /// any I/O: a listen URL with an option only connects use is refused.
    ///
    /// ```swift
    /// let request = try registry.resolve("tcp://0.0.0.0:2000?backlog=16", role: .listen)
    /// ```
    @_spi(Plugins)
    public func resolve(_ url: String, role: SchemeMode.Role) throws -> ConnectRequest {
        try resolveEntry(TransportURL(url), role: role, deadline: nil).request
    }

    private func entry(for url: TransportURL) throws -> Entry {
        // A URL with an inner layer reaches the wrapper of its name first, one without the plain
        // scheme; the other is the fallback, whose validation then explains the mistake.
        let keys = url.inner != nil ? [url.scheme + "+", url.scheme] : [url.scheme, url.scheme + "+"]
        guard let entry = table.withLock({ table in keys.compactMap { table.schemes[$0] }.first }) else {
            let known = schemes.map { $0.wraps ? $0.scheme + "+URL" : $0.scheme + "://" }.joined(separator: ", ")
            throw TransportError(.unsupportedScheme, "no plugin handles \(URLParser.printable(url.scheme, limit: 40))://; registered schemes: \(known.isEmpty ? "none" : known)")
        }
        return entry
    }

    /// Validates every layer and returns this layer's request; `deadline` nil means "from the
    /// bottom URL's timeout, starting now". The layers a wrapper wraps are always connected to.
    private func resolveEntry(_ url: TransportURL, role: SchemeMode.Role = .connect, deadline: ContinuousClock.Instant?, fromNow: Bool = false,
                              buffering: Buffering = .standard, beneath: [ProtocolLayer] = []) throws -> (request: ConnectRequest, entry: Entry) {
        let entry = try entry(for: url)
        if !beneath.isEmpty, !entry.scheme.descriptor.layersBeneath {
            throw TransportError.misuse("\(url.scheme):// takes no protocol layers beneath its own; wrap its connection instead")
        }
        if role == .listen, entry.scheme.listen == nil {
            let able = schemes.filter(\.canListen).map { $0.wraps ? $0.scheme + "+URL" : $0.scheme + "://" }.joined(separator: ", ")
            throw TransportError(.unsupported, "\(url.scheme):// cannot listen for connections; schemes that can: \(able)")
        }
        let options = try entry.scheme.descriptor.validate(url, role: role)
        let timeout: Duration?
        if let inner = url.inner {
            // The URL a listening wrapper wraps listens too (tls+rfc2217://0.0.0.0:4001).
            timeout = try resolveEntry(inner, role: role, deadline: nil).request.timeout
        } else if role == .connect {
            timeout = options[OptionSpec.timeout]
        } else {
            timeout = nil
        }
        var logger = self.logger
        logger[metadataKey: "url"] = "\(url)"
        logger[metadataKey: "scheme"] = "\(url.scheme)"
        let deadline = deadline ?? (fromNow ? timeout.map { ContinuousClock.now + $0 } : nil)
        let request = ConnectRequest(url: url, scheme: entry.scheme.descriptor, mode: entry.scheme.descriptor.mode(for: url, role: role),
                                     options: options, timeout: timeout, deadline: deadline, logger: logger, buffering: buffering,
                                     layersBeneath: beneath, registry: self)
        return (request, entry)
    }

    /// The descriptor of the scheme that serves `url`, if one is registered.
    func descriptor(of url: TransportURL) -> SchemeDescriptor? {
        (try? entry(for: url))?.scheme.descriptor
    }

    /// The options `request`'s URL gave that its plugin never read: a plugin that declares an
    /// option for a mode and then ignores it. The registry refuses such a connect or listen
    /// rather than let the option be silently ignored (a `security=` that asks for nothing).
    private static func unread(by request: ConnectRequest) -> TransportError? {
        let read = request.options.use.keys
        let declared = request.scheme.allOptions
        let unread = request.url.query.map(\.name).filter { name in
            // A former name is read under the option's current one. A server's own query items
            // (ws://, http://) are the plugin's to pass on, not to read.
            guard let spec = declared.first(where: { $0.isNamed(name) }) else { return !request.scheme.serverQuery && !read.contains(name.lowercased()) }
            return !read.contains(spec.key)
        }
        guard !unread.isEmpty else { return nil }
        let prefix = request.scheme.wraps ? request.scheme.scheme + "." : ""
        let names = unread.map { "'\(prefix)\(URLParser.printable($0, limit: 40))'" }.joined(separator: ", ")
        return TransportError.misuse("\(URLParser.printable(request.url.description)): the \(request.scheme.scheme):// plugin accepted \(names) but never used "
                                     + "\(unread.count == 1 ? "it" : "them"), so the connection was closed rather than run without "
                                     + "\(unread.count == 1 ? "it" : "them"). This is a bug in the plugin: its descriptor declares the option for this mode")
    }

    /// Checks everything about `url` that can be known without connecting or listening: every
    /// layer's grammar and options for `role` (the layers a wrapper wraps for connecting), then
    /// each layer's plugin check (``Scheme/CheckHandler``), such as a trace file that cannot be
    /// written or a device address that cannot be one. A server calls it for its target before it
    /// listens, so a target that can never work fails at start rather than at every client.
    ///
    /// ```swift
    /// try await registry.check("spy+tcp://127.0.0.1:4000?spy.file=/home/me/trace.txt")
    /// let listener = try await registry.listen(on: "tcp://127.0.0.1:2000")
    /// ```
    public func check(_ url: String, role: SchemeMode.Role = .connect) async throws {
        var layer: TransportURL? = try TransportURL(url)
        var layerRole = role
        while let current = layer {
            let (request, entry) = try resolveEntry(current, role: layerRole, deadline: nil)
            try await entry.scheme.check?(request)
            layer = current.inner
            // Under a listening wrapper the wrapped URL listens; under a connecting one, it connects.
            layerRole = entry.scheme.descriptor.wraps && layerRole == .listen ? .listen : .connect
        }
    }

    // MARK: Connecting

    /// Connects to `url`, such as `"tcp://127.0.0.1:4000"`, `"loop://"` or `"spy+tcp://127.0.0.1:4000"`.
    ///
    /// Fails before any I/O when the URL is malformed or its scheme unknown. Honours the
    /// `timeout` option (default 10 s) and task cancellation; a connection that completes after
    /// either is closed, never leaked.
    ///
    /// ```swift
    /// let connection = try await registry.connect(to: "tcp://127.0.0.1:4000?timeout=2")
    /// ```
    public func connect(to url: String, buffering: Buffering = .standard) async throws -> Connection {
        try await connect(to: TransportURL(url), buffering: buffering)
    }

    /// Connects to a parsed URL. `buffering` says how much of the connection's data may wait in
    /// memory (``Buffering/compact`` for a server with many connections).
    public func connect(to url: TransportURL, buffering: Buffering = .standard) async throws -> Connection {
        let (request, entry) = try resolveEntry(url, deadline: nil, fromNow: true, buffering: buffering)
        let logger = request.logger
        logger.debug("connecting")
        let timeoutText = request.timeout?.secondsText ?? "the limit"
        do {
            let connection = try await Deadline.run(
                until: request.deadline,
                timeoutError: TransportError(.timedOut, "connecting to \(url.shown) took longer than \(timeoutText); check that the device or peer is there, or raise ?timeout="),
                discard: { connection in try? await connection.close() }
            ) {
                try await Self.connect(request, with: entry)
            }
            connection.setLogger(logger)
            logger.debug("connected")
            return connection
        } catch {
            logger.debug("connect failed", metadata: ["error": "\(error)"])
            throw error
        }
    }

    /// Waits until every connect that was abandoned, by its timeout or by cancelling the task
    /// that waited for it, has finished and closed what it made late, and until every cleanup
    /// started in the background (`startCleanup`: a dropped connection's close, a watch thread's
    /// stop, a Bluetooth service's withdrawal) has finished. Covers the connects of every
    /// registry. A program that exits right after cancelling a connect or dropping a connection
    /// (on a signal) calls this first, so nothing the connect created, such as a pty's `link=`
    /// symlink, outlives it.
    ///
    /// ```swift
    /// connecting.cancel()
    /// await registry.waitForAbandonedConnects()
    /// ```
    public func waitForAbandonedConnects() async {
        await Deadline.waitForAbandoned()
    }

    /// Connects `url` for a plugin's request: same deadline, in the calling task, no timer of its
    /// own (the outer connect's timer cancels this task, and reports the one timeout).
    func connectWithin(_ url: TransportURL, deadline: ContinuousClock.Instant?, buffering: Buffering, beneath: [ProtocolLayer] = []) async throws -> Connection {
        let (request, entry) = try resolveEntry(url, deadline: deadline, buffering: buffering, beneath: beneath)
        let connection = try await Self.connect(request, with: entry)
        connection.setLogger(request.logger)
        return connection
    }

    /// Runs the scheme's connect handler and holds it to the options it was given.
    private static func connect(_ request: ConnectRequest, with entry: Entry) async throws -> Connection {
        let connection = try await entry.scheme.connect(request)
        if let unread = unread(by: request) {
            try? await connection.close()
            throw unread
        }
        return connection
    }

    /// Connects, runs `body`, and closes the connection however `body` ends. Callable from any
    /// isolation: `body` runs on the caller's actor.
    ///
    /// ```swift
    /// actor Poller {
    ///     var last: [UInt8]?
    ///     func poll(_ registry: TransportRegistry) async throws {
    ///         last = try await registry.withConnection(to: "tcp://127.0.0.1:7") { connection in
    ///             try await connection.write("ping")
    ///             return try await connection.read()
    ///         }
    ///     }
    /// }
    /// ```
    public func withConnection<Result>(
        to url: String,
        isolation: isolated (any Actor)? = #isolation,
        _ body: (Connection) async throws -> sending Result
    ) async throws -> sending Result {
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
    ///
    /// ```swift
    /// let listener = try await registry.listen(on: "tcp://127.0.0.1:0")
    /// ```
    public func listen(on url: String, buffering: Buffering = .standard) async throws -> Listener {
        try await listen(on: TransportURL(url), buffering: buffering)
    }

    /// Listens on `url` for a wrapper's listen handler, with `beneath` under its scheme's own
    /// protocol.
    func listenWithin(_ url: TransportURL, buffering: Buffering, beneath: [ProtocolLayer]) async throws -> Listener {
        try await startListening(url, buffering: buffering, beneath: beneath)
    }

    /// Starts listening on a parsed URL. `buffering` applies to every connection it accepts.
    public func listen(on url: TransportURL, buffering: Buffering = .standard) async throws -> Listener {
        let listener = try await startListening(url, buffering: buffering, beneath: [])
        logger.debug("listening", metadata: ["url": "\(url)", "bound": "\(listener.url)"])
        return listener
    }

    /// Runs the scheme's listen handler and holds it to the options it was given.
    private func startListening(_ url: TransportURL, buffering: Buffering, beneath: [ProtocolLayer]) async throws -> Listener {
        let (request, entry) = try resolveEntry(url, role: .listen, deadline: nil, buffering: buffering, beneath: beneath)
        guard let listen = entry.scheme.listen else {
            throw TransportError.misuse("\(url.scheme):// has no listen handler")   // resolveEntry refused it already
        }
        let listener = try await listen(request)
        if let unread = Self.unread(by: request) {
            try? await listener.close()
            throw unread
        }
        listener.setLogger(request.logger)
        return listener
    }

    // MARK: Devices

    /// The devices every plugin can reach, merged; a plugin that fails is reported in
    /// ``DeviceListing/failures`` and the others are still listed.
    ///
    /// ```swift
    /// let listing = await registry.devices()
    /// ```
    public func devices(includeAll: Bool = false) async -> DeviceListing {
        var listing = DeviceListing(devices: [], failures: [])
        for (plugin, schemes) in uniquePlugins() {
            do {
                listing.devices += try await plugin.devices(includeAll: includeAll)
            } catch {
                let failure = TransportError.from(error, context: "listing the devices of \(schemes.map { $0 + "://" }.joined(separator: ", "))")
                logger.debug("device listing failed", metadata: ["schemes": "\(schemes)", "error": "\(failure)"])
                listing.failures.append(.init(schemes: schemes, error: failure))
            }
        }
        return listing
    }

    /// Hot-plug events of every plugin that reports them, merged into one stream.
    ///
    /// Returns once every plugin has subscribed (the plugins subscribe concurrently): a device
    /// that arrives or goes away after the call is reported. Subscribing lists what is there, so
    /// that a removal can say what went away; plugins do that off the caller's thread, which is
    /// why the call is `async`.
    ///
    /// Nothing is dropped: a plugin's stream is read only as fast as the merged stream is, so a
    /// slow consumer holds the sources back (the kernel's buffers, and a plugin's resync, take the
    /// rest) instead of filling a buffer that would overflow. The stream ends with an error when a
    /// source fails; with several sources the error names the plugin (a single source's stream is
    /// handed out as it is, with its own errors).
    ///
    /// ```swift
    /// for try await event in await registry.deviceEvents() { print(event.action, event.device.url) }
    /// ```
    public func deviceEvents(includeAll: Bool = false) async -> AsyncThrowingStream<DeviceEvent, any Error> {
        let plugins = uniquePlugins()
        let subscribed = await withTaskGroup(of: (Int, AsyncThrowingStream<DeviceEvent, any Error>?).self) { group in
            for (index, entry) in plugins.enumerated() {
                let plugin = entry.plugin
                group.addTask { (index, await plugin.deviceEvents(includeAll: includeAll)) }
            }
            var streams = [AsyncThrowingStream<DeviceEvent, any Error>?](repeating: nil, count: plugins.count)
            for await (index, stream) in group { streams[index] = stream }
            return streams
        }
        // Cancelled while the plugins subscribed: a source may have ended with the cancellation,
        // which the merge would report as that plugin's failure.
        if Task.isCancelled { return AsyncThrowingStream { $0.finish(throwing: CancellationError()) } }
        // In scheme order, whichever plugin subscribed first.
        let sources = zip(plugins, subscribed).compactMap { entry, stream in stream.map { (entry.schemes, $0) } }
        // One source (the usual case): hand it out as it is, pull-driven, with no extra hop.
        if sources.count == 1, let only = sources.first { return only.1 }
        return EventMerge.merge(sources)
    }

    /// Arrivals and removals reported by the plugin that serves `scheme`, or nil when it reports
    /// none (or no plugin serves it).
    func deviceEvents(servingScheme scheme: String) async -> AsyncThrowingStream<DeviceEvent, any Error>? {
        guard let plugin = table.withLock({ $0.schemes[scheme.lowercased()]?.plugin }) else { return nil }
        return await plugin.deviceEvents(includeAll: false)
    }

    /// Each registered plugin once, with its schemes, in scheme order.
    private func uniquePlugins() -> [(plugin: any TransportPlugin, schemes: [String])] {
        let entries = table.withLock { table in table.schemes.values.sorted { $0.scheme.descriptor.scheme < $1.scheme.descriptor.scheme } }
        var order: [Int] = []
        var byID: [Int: (plugin: any TransportPlugin, schemes: [String])] = [:]
        for entry in entries {
            if byID[entry.pluginID] == nil {
                order.append(entry.pluginID)
                byID[entry.pluginID] = (entry.plugin, [])
            }
            byID[entry.pluginID]?.schemes.append(entry.scheme.descriptor.scheme)
        }
        return order.compactMap { byID[$0] }
    }
}

/// Merges event streams with backpressure: each source has one slot, and a source task waits
/// until its slot was taken before it asks its source for the next event.
enum EventMerge {
    private struct Slots: Sendable {
        var events: [Int: DeviceEvent] = [:]
        var order: [Int] = []
        var running: Int
        var failure: (any Error)?
    }

    static func merge(_ sources: [(schemes: [String], events: AsyncThrowingStream<DeviceEvent, any Error>)])
        -> AsyncThrowingStream<DeviceEvent, any Error> {
        let slots = AsyncCondition(Slots(running: sources.count))
        let tasks = sources.enumerated().map { index, source in
            Task {
                do {
                    for try await event in source.events {
                        slots.update { $0.events[index] = event; $0.order.append(index) }
                        // Backpressure: the next event is read only once this one was taken.
                        try await slots.wait { $0.events[index] == nil ? () : nil }
                    }
                    slots.update { $0.running -= 1 }
                } catch is CancellationError where Task.isCancelled {
                    // The consumer went away.
                } catch {
                    let failure = TransportError.from(error, context: "watching the devices of \(source.schemes.map { $0 + "://" }.joined(separator: ", "))")
                    slots.update { $0.failure = $0.failure ?? failure }
                }
            }
        }
        let owner = TaskOwner(tasks)
        return AsyncThrowingStream {
            _ = owner  // kept while the stream is; released (and its tasks cancelled) with it
            return try await slots.wait { slots -> DeviceEvent?? in
                if !slots.order.isEmpty {
                    let index = slots.order.removeFirst()
                    return .some(slots.events.removeValue(forKey: index))
                }
                if let failure = slots.failure { throw failure }
                return slots.running == 0 ? .some(nil) : nil
            }
        }
    }

    /// Cancels its tasks when released.
    private final class TaskOwner: Sendable {
        let tasks: [Task<Void, Never>]
        init(_ tasks: [Task<Void, Never>]) { self.tasks = tasks }
        deinit { for task in tasks { task.cancel() } }
    }
}
