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
    /// Plugin SDK names, one per line of the checked file.
    static let sdk = ["InboundQueue", "WriterGate", "AsyncCondition<Int>", "Locked<Int>", "ChannelBackend", "ConnectRequest",
                      "URLOption<Int>", "OptionValues", "ProtocolLayer", "Hex", "EventLoopTaskExecutor", "ChannelReady",
                      "any ConnectionBackend", "any WrappingBackend", "any ListenerBackend", "ControlOperation", "HangUp",
                      "SerialLineOptions", "TCPSocket"]
    /// What an app names: these must resolve with `import TransportKit` alone.
    static let app = ["Connection", "TransportError", "TransportURL", "Listener", "DeviceRecord", "Buffering",
                      "Buffering.Watermarks", "SchemeDescriptor", "OptionSpec", "ByteBuffer", "Errno", "SerialSettings",
                      "any TransportPlugin", "Scheme"]

    @Test("an app's import TransportKit resolves the app API and none of the plugin SDK; the SPI import resolves both")
    func sdkIsHiddenFromApps() async throws {
        let plain = try await typecheck(imports: ["import TransportKit"], names: Self.app + Self.sdk)
        for (index, name) in (Self.app + Self.sdk).enumerated() {
            let line = index + 2
            let failed = plain.contains("app.swift:\(line):")
            if Self.sdk.contains(name) {
                #expect(failed, "\(name) must not resolve in an app: it is plugin SDK (line \(line))\n\(plain)")
            } else {
                #expect(!failed, "\(name) must resolve with import TransportKit alone (line \(line))\n\(plain)")
            }
        }
        let plugin = try await typecheck(imports: ["import TransportKit", "@_spi(Plugins) import TransportKitCore",
                                                   "@_spi(Plugins) import TransportKitSockets"], names: Self.app + Self.sdk)
        #expect(!plugin.contains("error:"), "with the SPI imports every name resolves:\n\(plugin)")
    }

    /// Type-checks a file of `imports` and one `let` per name (the first name on line 2 with one
    /// import; the imports are joined on line 1) and returns swiftc's diagnostics.
    private func typecheck(imports: [String], names: [String]) async throws -> String {
        let source = imports.joined(separator: "; ") + "\n" + names.enumerated().map { "let value\($0.offset): (\($0.element))? = nil" }.joined(separator: "\n") + "\n"
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
