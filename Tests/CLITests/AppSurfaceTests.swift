import Foundation
import Glibc
import TestSupport
import Testing

/// What an application sees through `import TransportKit`: the plugin SDK is `@_spi(Plugins)`
/// (Docs/Plugins.md, "The SDK is SPI"), so these names must not resolve there, and must resolve
/// with the SPI import. Type-checks small files with `swiftc` against the modules this build made,
/// so removing an `@_spi` (or re-exporting a module that exposes the SDK) fails here.
@Suite("the app API surface")
struct AppSurfaceTests {
    /// Plugin SDK, one statement per line of the checked file: each must fail in an app.
    static let sdk = ["InboundQueue", "WriterGate", "AsyncCondition<Int>", "Locked<Int>", "ChannelBackend", "ConnectRequest",
                      "URLOption<Int>", "OptionValues", "ProtocolLayer", "Hex", "EventLoopTaskExecutor", "ChannelReady",
                      "any ConnectionBackend", "any WrappingBackend", "any ListenerBackend", "ControlOperation", "HangUp",
                      "SerialLineOptions", "TCPSocket"].map(declaring)
        + ["let _ = LoopPlugin.maxWrite",
           "let _ = { (registry: TransportRegistry) in try registry.resolve(\"loop://\") }",
           "let _ = { (connection: Connection) in connection.updateMetadata { _ in } }"]
    /// What an app writes: each must type-check with `import TransportKit` alone.
    static let app = ["Connection", "TransportError", "TransportURL", "Listener", "DeviceRecord", "Buffering",
                      "Buffering.Watermarks", "SchemeDescriptor", "OptionSpec", "ByteBuffer", "Errno", "SerialSettings",
                      "any TransportPlugin", "Scheme"].map(declaring)
        + ["let _ = Transport.schemes",
           "let _ = { (plugin: any TransportPlugin) in try Transport.register(plugin) }",
           "let _ = { (registry: TransportRegistry) async throws in try await registry.check(\"loop://\") }",
           "let _ = { (url: String) async throws in try await Transport.connect(to: url) }",
           "let _ = { (url: String) async throws in try await Transport.listen(on: url) }",
           "let _ = { () async in await Transport.devices() }",
           "let _ = { (connection: Connection) in connection.serialPort }",
           "let _ = { (connection: Connection) async throws in try await connection.readFrame(.delimiter(\"\\n\")) }",
           "let _ = { (connection: Connection) async throws in try await connection.write(ByteBuffer(string: \"x\")) }"]

    static func declaring(_ type: String) -> String { "let _: (\(type))? = nil" }

    @Test("an app's import TransportKit reaches the app API and none of the plugin SDK; the SPI imports reach both")
    func sdkIsHiddenFromApps() async throws {
        let lines = Self.app + Self.sdk
        let plain = try await typecheck(imports: ["import TransportKit"], lines: lines)
        let failing = Set(plain.split(separator: "\n").compactMap { line -> Int? in
            // app.swift:LINE:COLUMN: error: …
            let parts = line.split(separator: ":", maxSplits: 4)
            guard parts.count == 5, parts[0].hasSuffix("app.swift"), parts[3].trimmingCharacters(in: .whitespaces) == "error" else { return nil }
            return Int(parts[1])
        })
        #expect(!failing.isEmpty, "swiftc reported no error at all:\n\(plain)")
        for (index, statement) in lines.enumerated() {
            let line = index + 2
            if Self.sdk.contains(statement) {
                #expect(failing.contains(line), "must not compile in an app (plugin SDK): \(statement)\n\(plain)")
            } else {
                #expect(!failing.contains(line), "must compile with import TransportKit alone: \(statement)\n\(plain)")
            }
        }
        let plugin = try await typecheck(imports: ["import TransportKit", "@_spi(Plugins) import TransportKitCore",
                                                   "@_spi(Plugins) import TransportKitSockets", "@_spi(Plugins) import TransportKitLoop"],
                                         lines: lines)
        #expect(!plugin.contains("error:"), "with the SPI imports every line compiles:\n\(plugin)")
    }

    /// Type-checks a file of `imports` (joined on line 1) and `lines` (from line 2 on) and
    /// returns swiftc's diagnostics.
    private func typecheck(imports: [String], lines: [String]) async throws -> String {
        let source = imports.joined(separator: "; ") + "\n" + lines.joined(separator: "\n") + "\n"
        let directory = temporaryPath("app-surface")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try source.write(toFile: directory + "/app.swift", atomically: true, encoding: .utf8)
        // The build directory holds Modules/ and each C target's module map; the dependencies'
        // C headers are in the checkouts two levels up (.build[/tsan]/checkouts).
        let binDirectory = URL(fileURLWithPath: ProcessInfo.processInfo.arguments[0]).resolvingSymlinksInPath().deletingLastPathComponent().path
        let checkouts = URL(fileURLWithPath: binDirectory).deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("checkouts").path
        let packageRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().path
        let script = """
            set -e
            args="-I '\(binDirectory)/Modules'"
            for map in '\(binDirectory)'/*.build/module.modulemap; do args="$args -Xcc -fmodule-map-file=$map"; done
            for include in $(find '\(checkouts)' -path '*/Sources/*/include' -type d); do args="$args -I $include"; done
            for shim in '\(packageRoot)'/Sources/C*; do args="$args -I $shim"; done
            for flag in $(pkg-config --cflags-only-I libusb-1.0 libsystemd bluez libudev); do args="$args -Xcc $flag"; done
            cd '\(directory)'
            eval swiftc -typecheck $args app.swift > diagnostics.txt 2>&1 || true
            """
        let status = await runToEnd("/bin/sh", ["-c", script])
        #expect(status == 0, "the type-check script could not run")
        return (try? String(contentsOfFile: directory + "/diagnostics.txt", encoding: .utf8)) ?? ""
    }
}
