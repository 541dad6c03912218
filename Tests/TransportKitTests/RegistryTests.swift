import Logging
import NIOCore
import Synchronization
import Testing
@_spi(Plugins) @testable import TransportKit

/// A scheme an application might register: answers every write with its reverse.
struct ReversePlugin: TransportPlugin {
    var name = "reverse"
    static let suffix = URLOption.string("suffix", default: "", help: "Appended to each answer")

    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: name, summary: "Reverses each write", grammar: "\(name)://[?suffix=TEXT]",
                                 host: .forbidden, port: .forbidden, path: .forbidden, options: [Self.suffix])) { request in
            let loop = try await TransportRegistry(plugins: [LoopPlugin()]).connect(to: "loop://?buffer=65536")
            return Connection(url: request.url, backend: ReverseBackend(loop: loop, suffix: request[Self.suffix]))
        }]
    }
}

final class ReverseBackend: ConnectionBackend {
    let loop: Connection
    let suffix: String
    let supportsHalfClose = true
    init(loop: Connection, suffix: String) { self.loop = loop; self.suffix = suffix }
    func read() async throws -> ByteBuffer? { try await loop.readBuffer() }
    func write(_ buffer: ByteBuffer) async throws {
        try await loop.write(Array(buffer.readableBytesView.reversed()) + Array(suffix.utf8))
    }
    func closeWrite() async throws { try await loop.closeWrite() }
    func close() async throws { try await loop.close() }
}

/// A plugin whose connect never finishes on its own and ignores cancellation.
struct StuckPlugin: TransportPlugin {
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: "stuck", summary: "Never connects", grammar: "stuck://",
                                 host: .optional, port: .optional, path: .optional)) { _ in
            try? await Task.sleep(for: .seconds(3600))
            throw TransportError(.io, "unreachable")
        }]
    }
}

/// A plugin whose connect takes 300 ms whatever happens, then returns a loop connection and
/// records it.
struct SlowPlugin: TransportPlugin {
    final class Made: Sendable {
        /// Guards the connections the plugin made.
        let connections = Locked<[Connection]>([])
    }
    let made = Made()

    var schemes: [Scheme] {
        let made = made
        return [Scheme(SchemeDescriptor(scheme: "slow", summary: "Connects late", grammar: "slow://",
                                        host: .forbidden, port: .forbidden, path: .forbidden)) { _ in
            // Not cancellable: the work runs in a task of its own.
            try await Task {
                try? await Task.sleep(for: .milliseconds(300))
                let connection = try await Transport.connect(to: "loop://")
                made.connections.withLock { $0.append(connection) }
                return connection
            }.value
        }]
    }
}

@Suite("Registry")
struct RegistryTests {
    @Test func aProgramCanWaitForAnAbandonedConnectToCleanUp() async throws {
        let plugin = SlowPlugin()
        let registry = try TransportRegistry(plugins: [plugin])
        let task = Task { try await registry.connect(to: "slow://") }
        try await Task.sleep(for: .milliseconds(50))
        task.cancel()
        await #expect(throws: CancellationError.self) { try await task.value }
        #expect(plugin.made.connections.withLock { $0.isEmpty }, "the connect is still running")
        await registry.waitForAbandonedConnects()
        let made = plugin.made.connections.withLock { $0 }
        #expect(made.count == 1)
        #expect(made.first?.isClosed == true, "the late connection was closed before the wait returned")
    }

    @Test func builtInsAreRegisteredByImportingTransportKit() {
        let schemes = Transport.registry.schemes.map(\.scheme)
        #expect(schemes.contains("tcp"))
        #expect(schemes.contains("unix"))
        #expect(schemes.contains("loop"))
    }

    @Test func customSchemeWorksLikeABuiltIn() async throws {
        let registry = try TransportRegistry(plugins: Transport.builtInPlugins)
        try registry.register(ReversePlugin())
        #expect(registry.descriptor(for: "reverse")?.grammar == "reverse://[?suffix=TEXT]")
        let reply = try await registry.withConnection(to: "reverse://?suffix=!") { connection in
            try await connection.write("abc")
            return try await connection.read()
        }
        #expect(reply == Array("cba!".utf8))
        // Its options are validated by the core like any built-in's.
        await expectTransportError(.invalidURL) { try await registry.connect(to: "reverse://?speed=1") }
        await expectTransportError(.invalidURL) { try await registry.connect(to: "reverse://host") }
    }

    @Test func secondHandlerIsRefusedUnlessReplacing() throws {
        let registry = try TransportRegistry(plugins: [LoopPlugin()])
        try registry.register(ReversePlugin())
        do {
            try registry.register(ReversePlugin())
            Issue.record("a second handler was accepted")
        } catch let error as TransportError {
            #expect(error.kind == .busy)
            #expect(error.message.contains("replacing: true"))
        }
        var replacement = ReversePlugin()
        replacement.name = "loop"
        #expect(throws: TransportError.self) { try registry.register(replacement) }
        try registry.register(replacement, replacing: true)
        #expect(registry.descriptor(for: "loop")?.summary == "Reverses each write")
    }

    @Test func unregisterRemovesTheScheme() async throws {
        let registry = try TransportRegistry(plugins: [LoopPlugin()])
        try registry.register(ReversePlugin())
        #expect(registry.unregister(scheme: "REVERSE"))
        #expect(!registry.unregister(scheme: "reverse"))
        let error = await expectTransportError(.unsupportedScheme) { try await registry.connect(to: "reverse://") }
        #expect(error?.message.contains("loop://") == true)
    }

    @Test func invalidSchemeNamesAreRefused() throws {
        var plugin = ReversePlugin()
        plugin.name = "bad scheme"
        #expect(throws: TransportError.self) { try TransportRegistry().register(plugin) }
    }

    @Test func unknownSchemeFailsBeforeIO() async {
        let error = await expectTransportError(.unsupportedScheme) { try await Transport.connect(to: "gopher://host:70") }
        #expect(error?.message.contains("tcp://") == true)
    }

    @Test func listenOnAClientOnlySchemeIsUnsupported() async throws {
        let error = await expectTransportError(.unsupported) { try await Transport.listen(on: "loop://") }
        #expect(error?.message.contains("tcp://") == true)
    }

    @Test func connectTimeoutAppliesToEveryPlugin() async throws {
        let registry = try TransportRegistry(plugins: [StuckPlugin()])
        let start = ContinuousClock.now
        let error = await expectTransportError(.timedOut) { try await registry.connect(to: "stuck://?timeout=0.2") }
        // The plugin never returns: ending at all is the deadline's work. The bound is loose, as
        // the suite runs in parallel and under ThreadSanitizer on two cores.
        #expect(ContinuousClock.now - start < .seconds(30))
        // This URL's 0.2 s, not the 10 s default.
        #expect(error?.message.contains("took longer than 0.2 s") == true, "\(error?.message ?? "")")
    }

    @Test func cancellationAbandonsAStuckConnect() async throws {
        let registry = try TransportRegistry(plugins: [StuckPlugin()])
        let task = Task { try await registry.connect(to: "stuck://?timeout=0") }
        try await Task.sleep(for: .milliseconds(100))
        let start = ContinuousClock.now
        task.cancel()
        await #expect(throws: CancellationError.self) { try await task.value }
        // The stuck connect itself never returns: anything short of that is prompt; 30 s leaves room
        // for a loaded machine (2.4 s was seen in CI beside the CLI tests, and a pool 10 s late).
        #expect(ContinuousClock.now - start < .seconds(30))
    }

    @Test func schemeListIsSortedAndComplete() throws {
        let registry = try TransportRegistry(plugins: Transport.builtInPlugins + [ReversePlugin()])
        let names = registry.schemes.map(\.scheme)
        #expect(names == names.sorted())
        #expect(names.contains("reverse"))
    }
}

@Suite("Options")
struct OptionTests {
    @Test func defaultsAreFilledIn() throws {
        let request = try Transport.registry.resolve("tcp://localhost:1")
        #expect(request[SocketsPlugin.noDelay] == true)
        #expect(request[SocketsPlugin.keepAlive] == false)
        #expect(request[SocketsPlugin.backlog] == 128)
        #expect(request.timeout == .seconds(10))
        #expect(request[SocketsPlugin.keepAliveIdle] == nil)
    }

    @Test func valuesAreTyped() throws {
        let request = try Transport.registry.resolve("tcp://localhost:1?nodelay=off&keepAliveIdle=2.5&timeout=0")
        #expect(request[SocketsPlugin.noDelay] == false)
        #expect(request[SocketsPlugin.keepAliveIdle] == .milliseconds(2500))
        #expect(request.timeout == nil)
        #expect(try Transport.registry.resolve("loop://?buffer=7")[LoopPlugin.buffer] == 7)
    }

    @Test("bad options fail before I/O with the grammar", arguments: [
        ("tcp://localhost:1?color=red", "unknown option 'color' (tcp accepts:"),
        // A Swift property's spelling, or a typo, is answered with the option it meant.
        ("tty:///dev/ttyS0?baudRate=9600", "unknown option 'baudRate'; did you mean 'baud'?"),
        ("tcp://localhost:1?nodelay2=on", "unknown option 'nodelay2'; did you mean 'noDelay'?"),
        ("tcp://localhost:1?noDelay=maybe", "expected true or false"),
        ("tcp://localhost:1?keepAliveIdle=0", "0 is outside 1…32767"),
        ("tcp://localhost:1?keepAliveIdle=x", "expected a number"),
        ("tcp://localhost:1?backlog=16", "option 'backlog' is not used by this mode, tcp:// connection (tcp://HOST:PORT)"),
        ("tcp://localhost:1?timeout=-1", "outside 0…31536000 seconds"),
        ("tcp://localhost:70000", "outside 0…65535"),
        ("tcp://localhost", "a port is required"),
        ("tcp://:80", "a host is required"),
        ("tcp://localhost:1/path", "a path is not allowed"),
        ("unix://", "a path is required"),
        ("unix://host/tmp/x", "a host is not allowed"),
        ("loop://?buffer=0", "0 is outside 1…67108864"),
        // Ports are decimal for host:port schemes (the URL model keeps the text; the scheme decides).
        ("tcp://host:port", "the port 'port' must be a decimal number"),
        ("tcp://host:", "the port '' must be a decimal number"),
        ("tcp://host:99999999999", "the port 99999999999 is outside 0…65535"),
        ("tcp://host:01a7", "must be a decimal number"),
    ])
    func rejects(_ url: String, reason: String) async {
        let error = await expectTransportError(.invalidURL) { try await Transport.connect(to: url) }
        #expect(error?.message.contains(reason) == true, "\(error?.message ?? "")")
        #expect(error?.message.contains("Grammar: ") == true)
    }
}

/// A plugin that reports fixed devices and events, to test how the registry merges them.
private struct FakeDevicePlugin: TransportPlugin {
    let scheme: String
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: scheme, summary: "test", grammar: "\(scheme)://", host: .forbidden, port: .forbidden, path: .forbidden)) { _ in
            throw TransportError(.unsupported, "test plugin")
        }]
    }

    func devices(includeAll: Bool) async throws -> [DeviceRecord] {
        [DeviceRecord(url: "\(scheme)://one", scheme: scheme)] + (includeAll ? [DeviceRecord(url: "\(scheme)://hidden", scheme: scheme)] : [])
    }

    func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? {
        let scheme = self.scheme
        return AsyncThrowingStream { continuation in
            continuation.yield(DeviceEvent(.added, DeviceRecord(url: "\(scheme)://one", scheme: scheme)))
            continuation.yield(DeviceEvent(.removed, DeviceRecord(url: "\(scheme)://one", scheme: scheme)))
            continuation.finish()
        }
    }
}

@Suite("registry device listing and events")
struct RegistryDeviceTests {
    @Test("devices and events of every plugin are merged; includeAll is passed on")
    func merged() async throws {
        let registry = try TransportRegistry(plugins: [FakeDevicePlugin(scheme: "fa"), FakeDevicePlugin(scheme: "fb"), LoopPlugin()])
        #expect(await registry.devices().devices.map(\.url).sorted() == ["fa://one", "fb://one"])
        #expect(await registry.devices(includeAll: true).devices.count == 4)
        var events: [String] = []
        for try await event in await registry.deviceEvents() { events.append("\(event.action.rawValue) \(event.device.url)") }
        #expect(events.sorted() == ["added fa://one", "added fb://one", "removed fa://one", "removed fb://one"])
        // Order within one plugin is kept.
        #expect(events.filter { $0.hasSuffix("fa://one") } == ["added fa://one", "removed fa://one"])
    }

    @Test("a single source is handed out as it is, and no source gives an empty stream")
    func singleAndNone() async throws {
        let one = try TransportRegistry(plugins: [FakeDevicePlugin(scheme: "fc")])
        var count = 0
        for try await _ in await one.deviceEvents() { count += 1 }
        #expect(count == 2)
        let none = try TransportRegistry(plugins: [LoopPlugin()])
        var any = false
        for try await _ in await none.deviceEvents() { any = true }
        #expect(!any)
    }
}

/// A plugin whose one scheme is declared by the test.
private struct DeclaredPlugin: TransportPlugin {
    let descriptors: [SchemeDescriptor]
    init(_ descriptors: SchemeDescriptor...) { self.descriptors = descriptors }
    var schemes: [Scheme] {
        descriptors.map { Scheme($0) { _ in throw TransportError(.unsupported, "never connects") } }
    }
}

private func descriptor(_ scheme: String = "decl", options: [any OptionDeclaration]) -> SchemeDescriptor {
    SchemeDescriptor(scheme: scheme, summary: "test", grammar: "\(scheme)://", host: .forbidden, port: .forbidden, path: .forbidden,
                     options: options)
}

@Suite("Option declarations")
struct OptionDeclarationTests {
    @Test("malformed declarations are refused when the plugin is registered", arguments: [
        (descriptor(options: [URLOption.integer("buffer", in: 1...100, default: 0, help: "")]), "has the default '0', which it refuses: 0 is outside 1…100"),
        (descriptor(options: [OptionSpec("count", .integer(min: 5, max: 1), help: "")]), "the empty range 5…1"),
        (descriptor(options: [URLOption.bool("fast", default: true, help: ""), URLOption.bool("FAST", default: false, help: "")]), "declared twice"),
        (descriptor(options: [URLOption.integer("timeout", in: 1...2, help: "")]), "'timeout' is declared twice"),
        (descriptor(options: [URLOption.string("spy.file", help: "")]), "must start with a letter and contain only letters and digits"),
        (descriptor(options: [URLOption.string("2fast", help: "")]), "must start with a letter"),
        (descriptor(options: [URLOption.duration("wait", seconds: 0...1e300, help: "")]), "durations must lie within"),
        (descriptor(options: [URLOption.duration("wait", seconds: 0...Double.infinity, help: "")]), "finite range"),
        (descriptor(options: [OptionSpec("mode", .choice([]), help: "")]), "offers no choice"),
        (descriptor(options: [OptionSpec("mode", .choice(["a", "b"]), default: "c", help: "")]), "expected one of a, b"),
        (descriptor("a+b", options: []), "'a+b' is not a valid scheme name"),
        (descriptor(options: [OptionSpec("n", .number(min: 1, max: 2), default: "3", help: "")]), "3 is outside 1…2"),
    ])
    func refused(_ declared: SchemeDescriptor, problem: String) throws {
        let registry = try TransportRegistry()
        let error = #expect(throws: TransportError.self) { try registry.register(DeclaredPlugin(declared)) }
        #expect(error?.kind == .misuse)
        #expect(error?.message.contains(problem) == true, "\(error?.message ?? "")")
        #expect(registry.schemes.isEmpty, "nothing was registered")
    }

    @Test func aWrapperWithADotInItsNameIsRefused() throws {
        struct DottedWrapper: TransportPlugin {
            var schemes: [Scheme] {
                [Scheme.wrapper(SchemeDescriptor(scheme: "a.b", summary: "test", grammar: "a.b+URL", host: .forbidden, port: .forbidden, path: .forbidden)) { request in
                    try await request.connectInner()
                }]
            }
        }
        let error = #expect(throws: TransportError.self) { try TransportRegistry().register(DottedWrapper()) }
        #expect(error?.kind == .misuse)
        #expect(error?.message.contains("its options (a.b.NAME) would be ambiguous") == true, "\(error?.message ?? "")")
    }

    @Test func defaultsKeepTheirPrecision() throws {
        let settle = URLOption.duration("settle", seconds: 0...1, default: 0.0005, help: "")
        let ratio = URLOption.number("ratio", in: 0...1, default: 0.125, help: "")
        let registry = try TransportRegistry(plugins: [DeclaredPlugin(descriptor(options: [settle, ratio]))])
        let request = try registry.resolve("decl://")
        #expect(request[settle] == .microseconds(500))
        #expect(request[ratio] == 0.125)
        #expect(try registry.resolve("decl://?ratio=2e-1")[ratio] == 0.2)
        #expect(request.scheme.options.first?.defaultValue == "0.0005")
    }

    @Test func aSchemeDeclaredTwiceByOnePluginIsRefused() throws {
        let registry = try TransportRegistry()
        let error = #expect(throws: TransportError.self) {
            try registry.register(DeclaredPlugin(descriptor(options: []), descriptor(options: [])))
        }
        #expect(error?.kind == .misuse)
        #expect(error?.message.contains("decl:// twice") == true)
    }

    @Test func typedLookupsReadTheValueOrTheDeclaredDefault() throws {
        let speed = URLOption.integer("speed", in: 1...100, default: 42, help: "")
        let label = URLOption.string("label", help: "")
        let idle = URLOption.duration("idle", seconds: 0.5...10, help: "")
        let limit = URLOption.timeLimit("limit", seconds: 0...10, default: 3, help: "")
        let plugin = DeclaredPlugin(descriptor(options: [speed, label, idle, limit]))
        let registry = try TransportRegistry(plugins: [plugin])
        let defaults = try registry.resolve("decl://")
        #expect(defaults[speed] == 42)
        #expect(defaults[label] == nil)
        #expect(defaults[idle] == nil)
        #expect(defaults[limit] == .seconds(3))
        let given = try registry.resolve("decl://?SPEED=7&label=a%20b&idle=0.75&limit=0")
        #expect(given[speed] == 7, "names are case-insensitive")
        #expect(given[label] == "a b")
        #expect(given[idle] == .milliseconds(750))
        #expect(given[limit] == nil, "0 means no limit")
    }
}

@Suite("huge and odd numeric values")
struct HugeValueTests {
    @Test("every numeric option refuses what would overflow, naming the option and its limits", arguments: [
        ("loop://?timeout=1e10", "option 'timeout=1e10': 1e10 is outside 0…31536000 seconds"),
        ("loop://?timeout=inf", "option 'timeout=inf': expected a number of seconds between 0 and 31536000"),
        ("loop://?timeout=nan", "option 'timeout=nan': expected a number"),
        ("loop://?timeout=0x10", "option 'timeout=0x10': expected a number"),
        ("loop://?timeout=1e309", "expected a number"),
        ("loop://?timeout=-0.5", "outside 0…31536000 seconds"),
        ("tcp://h:1?keepAliveIdle=3e9", "option 'keepAliveIdle=3e9': 3e9 is outside 1…32767 seconds"),
        ("loop://?buffer=99999999999999999999999", "option 'buffer=99999999999999999999999': expected an integer between 1 and 67108864"),
        ("loop://?buffer=+5", "expected an integer"),
        ("loop://?buffer=1.5", "expected an integer"),
        ("tty:///dev/ttyS0?baud=-1", "-1 is outside 1…20000000"),
        ("tcp://h:99999999999999999999", "the port 99999999999999999999 is outside 0…65535"),
        ("tty://a:0/dev/ttyS0", "the port 0 is outside 1…20000000"),
    ])
    func refused(_ url: String, reason: String) async {
        let error = await expectTransportError(.invalidURL) { try await Transport.connect(to: url) }
        #expect(error?.message.contains(reason) == true, "\(error?.message ?? "")")
    }

    @Test func theLargestAcceptedValuesWork() throws {
        let request = try Transport.registry.resolve("tcp://h:65535?timeout=31536000&keepAliveIdle=32767")
        #expect(request.timeout == .seconds(31_536_000))
        #expect(request[SocketsPlugin.keepAliveIdle] == .seconds(32767))
        #expect(try Transport.registry.resolve("loop://?buffer=67108864")[LoopPlugin.buffer] == 64 << 20)
    }
}

/// A plugin whose device listing fails, as one without its hardware or service would.
private struct FailingDevicePlugin: TransportPlugin {
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: "broken", summary: "test", grammar: "broken://", host: .forbidden, port: .forbidden, path: .forbidden)) { _ in
            throw TransportError(.unsupported, "test plugin")
        }]
    }

    func devices(includeAll: Bool) async throws -> [DeviceRecord] {
        throw TransportError(.notFound, "no adapter: plug one in")
    }
}

/// A plugin whose events come all at once, far more than a buffer of the old 4096 would hold.
private struct BurstPlugin: TransportPlugin {
    let scheme: String
    let count: Int
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: scheme, summary: "test", grammar: "\(scheme)://", host: .forbidden, port: .forbidden, path: .forbidden)) { _ in
            throw TransportError(.unsupported, "test plugin")
        }]
    }

    func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? {
        let (stream, continuation) = AsyncThrowingStream<DeviceEvent, any Error>.makeStream()
        for index in 0..<count {
            continuation.yield(DeviceEvent(.added, DeviceRecord(url: "\(scheme)://\(index)", scheme: scheme)))
        }
        continuation.finish()
        return stream
    }
}

/// A pull-driven source that counts how far it was read ahead of its consumer.
private final class PulledSource: Sendable {
    let produced = Atomic(0)
    func stream(_ scheme: String) -> AsyncThrowingStream<DeviceEvent, any Error> {
        AsyncThrowingStream { [self] in
            let index = produced.add(1, ordering: .relaxed).newValue
            return index > 1000 ? nil : DeviceEvent(.changed, DeviceRecord(url: "\(scheme)://\(index)", scheme: scheme))
        }
    }
}

private struct PulledPlugin: TransportPlugin {
    let scheme: String
    let source: PulledSource
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: scheme, summary: "test", grammar: "\(scheme)://", host: .forbidden, port: .forbidden, path: .forbidden)) { _ in
            throw TransportError(.unsupported, "test plugin")
        }]
    }
    func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? { source.stream(scheme) }
}

@Suite("registry listing failures and event backpressure")
struct RegistryRobustnessTests {
    @Test func aFailingPluginIsReportedWithoutLosingTheOthers() async throws {
        let registry = try TransportRegistry(plugins: [FakeDevicePlugin(scheme: "fa"), FailingDevicePlugin(), LoopPlugin()])
        let listing = await registry.devices()
        #expect(listing.devices.map(\.url) == ["fa://one"])
        #expect(listing.failures.count == 1)
        #expect(listing.failures.first?.schemes == ["broken"])
        #expect(listing.failures.first?.error.kind == .notFound)
        #expect(listing.failures.first?.error.message == "no adapter: plug one in")
    }

    @Test func aMergedEventStreamDropsNothingPastTheOldLimit() async throws {
        let registry = try TransportRegistry(plugins: [BurstPlugin(scheme: "ba", count: 10_000), BurstPlugin(scheme: "bb", count: 10_000)])
        var seen: [String: Int] = ["ba": 0, "bb": 0]
        var inOrder = true
        for try await event in await registry.deviceEvents() {
            let index = Int(event.device.url.split(separator: "/").last ?? "") ?? -1
            inOrder = inOrder && index == seen[event.device.scheme]
            seen[event.device.scheme, default: 0] += 1
            if seen.values.reduce(0, +) < 100 { try await Task.sleep(for: .milliseconds(1)) }  // a slow start
        }
        #expect(seen == ["ba": 10_000, "bb": 10_000], "every event of both sources, none dropped")
        #expect(inOrder, "each source's order is kept")
    }

    @Test func aSourceEndingWithItsOwnCancellationEndsTheMergedStream() async throws {
        struct CancellingPlugin: TransportPlugin {
            let scheme: String
            var schemes: [Scheme] {
                [Scheme(SchemeDescriptor(scheme: scheme, summary: "test", grammar: "\(scheme)://", host: .forbidden, port: .forbidden, path: .forbidden)) { _ in
                    throw TransportError(.unsupported, "test plugin")
                }]
            }
            func deviceEvents(includeAll: Bool) -> AsyncThrowingStream<DeviceEvent, any Error>? {
                AsyncThrowingStream { $0.finish(throwing: CancellationError()) }
            }
        }
        let registry = try TransportRegistry(plugins: [CancellingPlugin(scheme: "ca"), CancellingPlugin(scheme: "cb")])
        let error = await #expect(throws: TransportError.self) {
            for try await _ in await registry.deviceEvents() {}
        }
        #expect(error?.message.contains("watching the devices of ca://") == true || error?.message.contains("watching the devices of cb://") == true,
                "\(String(describing: error))")
    }

    @Test func sourcesAreReadOnlyAsFastAsTheMergedStream() async throws {
        let first = PulledSource()
        let second = PulledSource()
        let registry = try TransportRegistry(plugins: [PulledPlugin(scheme: "pa", source: first), PulledPlugin(scheme: "pb", source: second)])
        var iterator = await registry.deviceEvents().makeAsyncIterator()
        for _ in 0..<10 { _ = try await iterator.next() }
        try await Task.sleep(for: .milliseconds(100))
        let ahead = first.produced.load(ordering: .relaxed) + second.produced.load(ordering: .relaxed) - 10
        #expect(ahead <= 4, "each source is at most a slot and one pending read ahead (\(ahead))")
    }
}

/// A scheme whose authority is a USB device, as usb:// will declare it.
private struct USBLikePlugin: TransportPlugin {
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(scheme: "usbtest", summary: "test", grammar: "usbtest://VID:PID[/SERIAL]", authority: .usbDevice,
                                 host: .forbidden, port: .forbidden, path: .optional)) { _ in
            throw TransportError(.unsupported, "test plugin")
        }]
    }
}

@Suite("the usb:// authority through a registry")
struct USBAuthorityTests {
    @Test("VID:PID in hexadecimal is accepted, anything else refused before any I/O", arguments: [
        ("usbtest://1546:01a7", true, ""),
        ("usbtest://0403:6001/A50285BI", true, ""),
        ("usbtest://ABCD:ef01", true, ""),
        ("usbtest://1546", false, "expected VID:PID"),
        ("usbtest://1546:1a7", false, "expected VID:PID"),
        ("usbtest://zzzz:0001", false, "expected VID:PID"),
        ("usbtest://", false, "expected VID:PID"),
        ("usbtest://localhost:80", false, "expected VID:PID"),
    ])
    func authority(_ url: String, accepted: Bool, reason: String) throws {
        let registry = try TransportRegistry(plugins: [USBLikePlugin()])
        if accepted {
            let request = try registry.resolve(url)
            #expect(request.url.usbDeviceID != nil)
        } else {
            let error = #expect(throws: TransportError.self) { try registry.resolve(url) }
            #expect(error?.kind == .invalidURL)
            #expect(error?.message.contains(reason) == true, "\(error?.message ?? "")")
        }
    }
}

/// Collects what is logged, to check what the registry says and with which metadata.
private final class LogCollector: Sendable {
    let lines = Locked<[String]>([])
}

private struct CollectingHandler: LogHandler {
    let collector: LogCollector
    var metadata: Logger.Metadata = [:]
    var logLevel: Logger.Level = .trace
    subscript(metadataKey key: String) -> Logger.Metadata.Value? {
        get { metadata[key] }
        set { metadata[key] = newValue }
    }
    func log(event: LogEvent) {
        let all = metadata.merging(event.metadata ?? [:]) { $1 }
        let text = all.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: " ")
        collector.lines.withLock { $0.append("\(event.level) \(event.message) \(text)") }
    }
}

@Suite("logging")
struct LoggingTests {
    @Test func connectsClosesAndFailuresAreLoggedAtDebugWithTheURL() async throws {
        let collector = LogCollector()
        let logger = Logger(label: "test") { _ in CollectingHandler(collector: collector) }
        let registry = try TransportRegistry(plugins: [LoopPlugin(), StuckPlugin()], logger: logger)
        try await registry.withConnection(to: "loop://?buffer=8") { connection in
            try await connection.write("hi")
            _ = try await connection.read()
        }
        await expectTransportError(.timedOut) { try await registry.connect(to: "stuck://?timeout=0.1") }
        let lines = collector.lines.withLock { $0 }
        #expect(lines.contains("debug connecting scheme=loop url=loop://?buffer=8"), "\(lines)")
        #expect(lines.contains("debug connected scheme=loop url=loop://?buffer=8"), "\(lines)")
        #expect(lines.contains("debug closed read=2 scheme=loop url=loop://?buffer=8 written=2"), "\(lines)")
        #expect(lines.contains { $0.hasPrefix("debug connect failed error=connecting to stuck://?timeout=0.1 took longer than 0.1 s") }, "\(lines)")
        #expect(lines.allSatisfy { $0.hasPrefix("debug ") }, "nothing above debug: quiet by default")
    }

    @Test func acceptedConnectionsLogThroughTheRegistry() async throws {
        let collector = LogCollector()
        let logger = Logger(label: "test") { _ in CollectingHandler(collector: collector) }
        let registry = try TransportRegistry(plugins: [SocketsPlugin()], logger: logger)
        let listener = try await registry.listen(on: "tcp://127.0.0.1:0")
        let client = try await registry.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
        let server = try #require(try await listener.accept())
        try await server.close()
        try await client.close()
        try await listener.close()
        let lines = collector.lines.withLock { $0 }
        #expect(lines.contains { $0.hasPrefix("debug listening bound=tcp://127.0.0.1:") }, "\(lines)")
        #expect(lines.contains { $0.hasPrefix("debug accepted listener=tcp://127.0.0.1:") }, "\(lines)")
        #expect(lines.filter { $0.hasPrefix("debug closed ") }.count == 2, "both ends' close is logged: \(lines)")
    }
}
