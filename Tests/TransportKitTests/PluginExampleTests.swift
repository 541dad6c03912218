import Foundation
import Glibc
import TestSupport
import Testing
@testable import TransportKit

/// The three plugins Docs/Plugins.md walks through, compiled (they are files of this target) and
/// run here against real kernel objects, and the document checked to quote them verbatim.
@Suite("Docs/Plugins.md examples", .serialized)
struct PluginExampleTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    @Test("the document quotes each example verbatim", arguments: ["AbstractSocketPlugin", "CounterPlugin", "CRLFPlugin"])
    func quoted(_ name: String) throws {
        let source = try String(contentsOf: Self.root.appendingPathComponent("Tests/TransportKitTests/PluginExamples/\(name).swift"), encoding: .utf8)
        let document = try String(contentsOf: Self.root.appendingPathComponent("Docs/Plugins.md"), encoding: .utf8)
        let start = try #require(source.range(of: "// BEGIN EXAMPLE\n"))
        let end = try #require(source.range(of: "// END EXAMPLE"))
        let example = String(source[start.upperBound..<end.lowerBound])
        #expect(document.contains("```swift\n" + example + "```"), "Docs/Plugins.md must quote PluginExamples/\(name).swift between its markers")
    }

    @Test("over an fd: abstract:// reaches an abstract-namespace socket, both ways, with half-close")
    func abstractSocket() async throws {
        let registry = try TransportRegistry(plugins: [AbstractSocketPlugin()])
        let name = "tk-test-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        let listener = try AbstractListener(name: name)
        defer { listener.close() }
        let connection = try await registry.connect(to: "abstract://\(name)")
        let peer = await listener.accept()
        #expect(peer >= 0)
        defer { _ = Glibc.close(peer) }
        #expect(connection.metadata.name == "@" + name)
        try await connection.write("ping")
        try await connection.closeWrite()
        #expect(await Support.readAll(peer) == Array("ping".utf8), "the half-close reached the peer as an end")
        Support.writeAll(peer, Array("pong".utf8))
        _ = Glibc.shutdown(peer, Int32(SHUT_WR))
        var received: [UInt8] = []
        while let chunk = try await connection.read(timeout: .seconds(5)) { received += chunk }
        #expect(received == Array("pong".utf8))
        try await connection.close()
    }

    @Test("over an fd: nobody listening is .refused with errno and the call, before any channel exists")
    func abstractSocketRefused() async throws {
        let registry = try TransportRegistry(plugins: [AbstractSocketPlugin()])
        let error = await expectTransportError(.refused) { try await registry.connect(to: "abstract://tk-nobody-\(getpid())") }
        #expect(error?.errno == .connectionRefused)
        #expect(error?.syscall == "connect")
    }

    @Test("fed by callbacks: every line arrives in order, and a slow reader keeps the queue bounded")
    func counter() async throws {
        let registry = try TransportRegistry(plugins: [CounterPlugin()])
        let connection = try await registry.connect(to: "counter://?to=5000")
        #expect(await eventually { Self.threads(named: "counter") == 1 }, "the worker runs, named")
        // Read nothing for a while: the worker must pause at the high watermark, not run ahead.
        try await Task.sleep(for: .milliseconds(200))
        var text = ""
        while let line = try await connection.readLine(timeout: .seconds(5)) {
            text += line + "\n"
            if text.count < 4096 { try await Task.sleep(for: .microseconds(50)) }
        }
        let expected = (1...5000).map { "\($0)\n" }.joined()
        #expect(text == expected)
        try await connection.close()
        #expect(Self.threads(named: "counter") == 0, "the worker thread was joined")
    }

    @Test("fed by callbacks: closing mid-stream stops the worker thread")
    func counterClosedEarly() async throws {
        let registry = try TransportRegistry(plugins: [CounterPlugin()])
        let connection = try await registry.connect(to: "counter://?to=1000000000")
        #expect(try await connection.readLine(timeout: .seconds(5)) == "1")
        try await connection.close()
        #expect(Self.threads(named: "counter") == 0, "close() stopped and joined the worker")
    }

    @Test("a wrapper: crlf+ converts what is written and is transparent for the wrapped transport")
    func crlf() async throws {
        let registry = try TransportRegistry(plugins: Transport.builtInPlugins + [CRLFPlugin()])
        try await registry.withConnection(to: "crlf+loop://?buffer=64") { connection in
            try await connection.write("AT\nATZ\n")
            #expect(try await connection.read(timeout: .seconds(5)) == Array("AT\r\nATZ\r\n".utf8))
            #expect(connection.metadata.name == "loopback", "metadata is the wrapped connection's")
        }
        let pty = try await registry.connect(to: "crlf+pty://?baud=19200")
        #expect(try await pty.serialPort?.settings().baudRate == 19200, "serialPort reaches through the wrapper")
        #expect(pty.preferredExecutor != nil, "so does the wrapped transport's executor")
        try await pty.close()
        await expectTransportError(.invalidURL) { try await registry.connect(to: "crlf+loop://?crlf.mode=1") }
    }

    /// Threads of this process with this name (/proc/self/task/*/comm).
    static func threads(named name: String) -> Int {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task")) ?? []
        return tasks.filter { task in
            (try? String(contentsOfFile: "/proc/self/task/\(task)/comm", encoding: .utf8)) == name + "\n"
        }.count
    }
}

/// A listening Unix stream socket in the abstract namespace, made with plain system calls.
struct AbstractListener {
    let fd: Int32

    init(name: String) throws {
        fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(name.utf8)
        withUnsafeMutableBytes(of: &address.sun_path) { path in path[1...bytes.count].copyBytes(from: bytes) }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + 1 + bytes.count)
        let socketFD = fd
        let bound = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(socketFD, $0, length) }
        }
        guard bound == 0, Glibc.listen(fd, 4) == 0 else {
            throw TransportError(.io, "cannot listen on @\(name)")
        }
    }

    func accept() async -> Int32 {
        await Support.accept(on: fd)
    }

    func close() { _ = Glibc.close(fd) }
}
