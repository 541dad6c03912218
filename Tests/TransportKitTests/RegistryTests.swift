import NIOCore
import Testing
@testable import TransportKit

/// A scheme an application might register: answers every write with its reverse.
struct ReversePlugin: TransportPlugin {
    var name = "reverse"
    var schemes: [SchemeDescriptor] {
        [SchemeDescriptor(scheme: name, summary: "Reverses each write", grammar: "\(name)://[?suffix=TEXT]",
                          host: .forbidden, port: .forbidden, path: .forbidden,
                          options: [OptionSpec("suffix", .string, default: "", help: "Appended to each answer")])]
    }

    func connect(_ request: ConnectRequest) async throws -> Connection {
        let loop = try await TransportRegistry(plugins: [LoopPlugin()]).connect(to: "loop://?buffer=65536")
        let suffix = request.options.string("suffix") ?? ""
        return Connection(url: request.url, backend: ReverseBackend(loop: loop, suffix: suffix))
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
    let schemes = [SchemeDescriptor(scheme: "stuck", summary: "Never connects", grammar: "stuck://",
                                    host: .optional, port: .optional, path: .optional)]
    func connect(_ request: ConnectRequest) async throws -> Connection {
        try? await Task.sleep(for: .seconds(30))
        throw TransportError(.io, "unreachable")
    }
}

@Suite("Registry")
struct RegistryTests {
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
        #expect(ContinuousClock.now - start < .seconds(5))
        #expect(error?.message.contains("timeout") == true)
    }

    @Test func cancellationAbandonsAStuckConnect() async throws {
        let registry = try TransportRegistry(plugins: [StuckPlugin()])
        let task = Task { try await registry.connect(to: "stuck://?timeout=0") }
        try await Task.sleep(for: .milliseconds(100))
        let start = ContinuousClock.now
        task.cancel()
        await #expect(throws: CancellationError.self) { try await task.value }
        #expect(ContinuousClock.now - start < .seconds(2))
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
        #expect(request.options.bool("noDelay") == true)
        #expect(request.options.bool("keepAlive") == false)
        #expect(request.options.int("backlog") == 128)
        #expect(request.timeout == .seconds(10))
        #expect(request.options.double("keepAliveIdle") == nil)
    }

    @Test func valuesAreTyped() throws {
        let request = try Transport.registry.resolve("tcp://localhost:1?nodelay=off&keepAliveIdle=2.5&timeout=0")
        #expect(request.options.bool("noDelay") == false)
        #expect(request.options.double("keepAliveIdle") == 2.5)
        #expect(request.timeout == nil)
        #expect(try Transport.registry.resolve("loop://?buffer=7").options.int("buffer") == 7)
    }

    @Test("bad options fail before I/O with the grammar", arguments: [
        ("tcp://localhost:1?color=red", "unknown option 'color'"),
        ("tcp://localhost:1?noDelay=maybe", "expected true or false"),
        ("tcp://localhost:1?backlog=0", "between 1 and 65535"),
        ("tcp://localhost:1?backlog=x", "expected an integer"),
        ("tcp://localhost:1?timeout=-1", "number of seconds"),
        ("tcp://localhost:70000", "outside 0…65535"),
        ("tcp://localhost", "a port is required"),
        ("tcp://:80", "a host is required"),
        ("tcp://localhost:1/path", "a path is not allowed"),
        ("unix://", "a path is required"),
        ("unix://host/tmp/x", "a host is not allowed"),
        ("loop://?buffer=0", "between 1 and"),
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
    var schemes: [SchemeDescriptor] {
        [SchemeDescriptor(scheme: scheme, summary: "test", grammar: "\(scheme)://", host: .forbidden, port: .forbidden, path: .forbidden)]
    }

    func connect(_ request: ConnectRequest) async throws -> Connection {
        throw TransportError(.unsupported, "test plugin")
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
        #expect(try await registry.devices().map(\.url).sorted() == ["fa://one", "fb://one"])
        #expect(try await registry.devices(includeAll: true).count == 4)
        var events: [String] = []
        for try await event in registry.deviceEvents() { events.append("\(event.action.rawValue) \(event.device.url)") }
        #expect(events.sorted() == ["added fa://one", "added fb://one", "removed fa://one", "removed fb://one"])
        // Order within one plugin is kept.
        #expect(events.filter { $0.hasSuffix("fa://one") } == ["added fa://one", "removed fa://one"])
    }

    @Test("a single source is handed out as it is, and no source gives an empty stream")
    func singleAndNone() async throws {
        let one = try TransportRegistry(plugins: [FakeDevicePlugin(scheme: "fc")])
        var count = 0
        for try await _ in one.deviceEvents() { count += 1 }
        #expect(count == 2)
        let none = try TransportRegistry(plugins: [LoopPlugin()])
        var any = false
        for try await _ in none.deviceEvents() { any = true }
        #expect(!any)
    }
}
