// swift-tools-version:6.0
import PackageDescription

// Layers (Docs/Architecture.md):
//   TransportKitCore        URL model, options, registry, connection, errors, framing, and the plugin SDK
//                           (inbound queue, writer gate, ChannelBackend). No C module, no Foundation.
//   TransportKitLinux       shared Linux support for plugins: syscalls, fd readiness, fd adoption,
//                           worker threads, the readiness poller, stream sockets. The only importer of
//                           CLinux (epoll, accept4). Glibc,
//                           swift-system and NIOPosix only; never imported by the core.
//   TransportKitUdev        shared device discovery for plugins: sysfs records, USB ancestry, the udev
//                           monitor. The only importer of CUdev (it links libudev).
//   TransportKitDBus        a D-Bus client for plugins (sd-bus on a thread of its own: calls, signals,
//                           exported objects, descriptors). The only importer of CSDBus (links libsystemd).
//   Plugins/<Name>          one target per scheme family.
//   TransportKitFoundation  the InputStream/OutputStream bridge, its own product.
//   TransportKit            the umbrella product: re-exports the core and registers every built-in plugin.
let strict: [SwiftSetting] = [.enableUpcomingFeature("ExistentialAny")]
let nioCore: Target.Dependency = .product(name: "NIOCore", package: "swift-nio")
let nioPosix: Target.Dependency = .product(name: "NIOPosix", package: "swift-nio")
let system: Target.Dependency = .product(name: "SystemPackage", package: "swift-system")
let logging: Target.Dependency = .product(name: "Logging", package: "swift-log")

let package = Package(
    name: "TransportKit",
    // Linux only: no `platforms` entry, as no Apple platform can build it (the transports are
    // Linux kernel interfaces: termios2, AF_BLUETOOTH, usbfs, udev).
    products: [
        // Applications: every built-in scheme.
        .library(name: "TransportKit", targets: ["TransportKit"]),
        // Third-party plugin packages: the core and the plugin SDK, without libudev, libusb or libbluetooth.
        .library(name: "TransportKitCore", targets: ["TransportKitCore", "TransportKitLinux"]),
        // Plugins layered on TCP (TLS, WebSocket): TCPSocket.connect(…handlers:). No libudev either.
        .library(name: "TransportKitSockets", targets: ["TransportKitSockets"]),
        // Plugins that list devices and report hot-plug: Sysfs, USBAncestry, UdevMonitor. Links libudev.
        .library(name: "TransportKitUdev", targets: ["TransportKitUdev"]),
        // Plugins that talk to system services over D-Bus (BlueZ, ModemManager). Links libsystemd.
        .library(name: "TransportKitDBus", targets: ["TransportKitDBus"]),
        // Code written for Foundation streams (CornucopiaStreams' stream pairs).
        .library(name: "TransportKitFoundation", targets: ["TransportKitFoundation"]),
        .executable(name: "transportkit", targets: ["transportkit"]),
        .executable(name: "transportkit-bench", targets: ["transportkit-bench"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-nio-ssl.git", from: "2.37.6"),
        .package(url: "https://github.com/apple/swift-crypto.git", from: "3.12.3"),
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.8.2"),
        .package(url: "https://github.com/apple/swift-system.git", from: "1.8.1"),
        .package(url: "https://github.com/apple/swift-log.git", from: "1.16.2"),
    ],
    targets: [
        // Thin C targets: a module map and one shim header each. Providers only print a hint; Scripts/setup installs them.
        .systemLibrary(name: "CBlueZ", path: "Sources/CBlueZ", pkgConfig: "bluez", providers: [.apt(["libbluetooth-dev"])]),
        .systemLibrary(name: "CUdev", path: "Sources/CUdev", pkgConfig: "libudev", providers: [.apt(["libudev-dev"])]),
        .systemLibrary(name: "CSDBus", path: "Sources/CSDBus", pkgConfig: "libsystemd", providers: [.apt(["libsystemd-dev"])]),
        .systemLibrary(name: "CLinux", path: "Sources/CLinux"),
        .systemLibrary(name: "CZlib", path: "Sources/CZlib", providers: [.apt(["zlib1g-dev"])]),
        .systemLibrary(name: "CLibUSB", path: "Sources/CLibUSB", pkgConfig: "libusb-1.0", providers: [.apt(["libusb-1.0-0-dev"])]),

        .target(
            name: "TransportKitCore",
            dependencies: [nioCore, .product(name: "NIOConcurrencyHelpers", package: "swift-nio"), system, logging],
            path: "Sources/TransportKit/Core",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitLinux",
            dependencies: ["TransportKitCore", "CLinux", nioCore, nioPosix, system],
            path: "Sources/Plugins/Support/Linux",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitUdev",
            dependencies: ["TransportKitCore", "TransportKitLinux", "CUdev", system],
            path: "Sources/Plugins/Support/Udev",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitDBus",
            dependencies: ["TransportKitCore", "TransportKitLinux", "CSDBus", system],
            path: "Sources/Plugins/Support/DBus",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitSockets",
            dependencies: ["TransportKitCore", "TransportKitLinux", nioCore, nioPosix, system, logging],
            path: "Sources/Plugins/Sockets",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitTLS",
            dependencies: ["TransportKitCore", "TransportKitLinux", "TransportKitSockets", nioCore, nioPosix,
                           .product(name: "NIOSSL", package: "swift-nio-ssl"), .product(name: "NIOTLS", package: "swift-nio"),
                           .product(name: "Crypto", package: "swift-crypto")],
            path: "Sources/Plugins/TLS",
            swiftSettings: strict
        ),
        .target(
            // The WebSocket session after the handshake (frames, control, keepalive, closing); no
            // TLS, so the fuzz target can take it without BoringSSL.
            name: "TransportKitWebSocket",
            dependencies: ["TransportKitCore", "CZlib", nioCore, .product(name: "NIOWebSocket", package: "swift-nio")],
            path: "Sources/Plugins/Support/WebSocket",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitWeb",
            dependencies: ["TransportKitCore", "TransportKitLinux", "TransportKitSockets", "TransportKitTLS", "TransportKitWebSocket", nioCore,
                           .product(name: "NIOHTTP1", package: "swift-nio"), .product(name: "NIOWebSocket", package: "swift-nio"),
                           .product(name: "Crypto", package: "swift-crypto")],
            path: "Sources/Plugins/Web",
            swiftSettings: strict
        ),
        .target(
            // rfc2217:// (Telnet COM-PORT-OPTION): client and server over TCP or TLS; ports on the network through avahi (D-Bus); no C.
            name: "TransportKitRFC2217",
            dependencies: ["TransportKitCore", "TransportKitSockets", "TransportKitDBus", nioCore],
            path: "Sources/Plugins/RFC2217",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitLoop",
            dependencies: ["TransportKitCore", nioCore],
            path: "Sources/Plugins/Loop",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitSerial",
            dependencies: ["TransportKitCore", "TransportKitLinux", "TransportKitUdev", nioCore, nioPosix, system],
            path: "Sources/Plugins/Serial",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitBluetooth",
            dependencies: ["TransportKitCore", "TransportKitLinux", "TransportKitDBus", "CBlueZ", nioCore, system],
            path: "Sources/Plugins/Bluetooth",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitUSB",
            dependencies: ["TransportKitCore", "TransportKitLinux", "TransportKitUdev", "CLibUSB", nioCore, system],
            path: "Sources/Plugins/USB",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitSpy",
            dependencies: ["TransportKitCore", "TransportKitLinux", nioCore, system],
            path: "Sources/Plugins/Spy",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitReconnect",
            dependencies: ["TransportKitCore", nioCore],
            path: "Sources/Plugins/Reconnect",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitFoundation",
            dependencies: ["TransportKitCore", "TransportKitLoop"],
            path: "Sources/TransportKit/Foundation",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKit",
            dependencies: ["TransportKitCore", "TransportKitSockets", "TransportKitLoop", "TransportKitSerial", "TransportKitSpy", "TransportKitBluetooth",
                           "TransportKitUSB", "TransportKitTLS", "TransportKitWeb", "TransportKitRFC2217", "TransportKitReconnect"],
            path: "Sources/TransportKit/BuiltIns",
            swiftSettings: strict
        ),
        .executableTarget(
            name: "transportkit",
            dependencies: ["TransportKit", "TransportKitLinux", logging, nioCore, .product(name: "ArgumentParser", package: "swift-argument-parser")],
            path: "Sources/transportkit",
            swiftSettings: strict
        ),

        .target(name: "CBenchLoops", path: "Sources/Benchmarks/CBenchLoops", linkerSettings: [.linkedLibrary("udev"), .linkedLibrary("usb-1.0")]),
        .executableTarget(
            name: "transportkit-bench",
            dependencies: ["TransportKit", "TransportKitLinux", "CBenchLoops", nioCore, nioPosix, system, .product(name: "NIOHTTP1", package: "swift-nio"),
                           .product(name: "NIOWebSocket", package: "swift-nio")],
            path: "Sources/Benchmarks/transportkit-bench",
            swiftSettings: strict
        ),

        // libFuzzer targets (Scripts/fuzz builds them with --sanitize=fuzzer -DFUZZING); a plain build replays inputs.
        .executableTarget(
            name: "transportkit-fuzz",
            // Not the TransportKit umbrella: its TLS plugin would put BoringSSL in the instrumented build (Fuzz.swift).
            dependencies: ["TransportKitCore", "TransportKitLoop", "TransportKitSockets", "TransportKitSerial", "TransportKitSpy",
                           "TransportKitBluetooth", "TransportKitUSB", "TransportKitWebSocket", nioCore,
                           .product(name: "NIOEmbedded", package: "swift-nio"), .product(name: "NIOWebSocket", package: "swift-nio")],
            path: "Sources/Fuzz",
            swiftSettings: strict
        ),

        // Helpers every test target shares (polling, open descriptors); built only for the tests.
        .target(name: "TestSupport", dependencies: ["TransportKitCore"], path: "Tests/TestSupport", swiftSettings: strict),
        .testTarget(
            name: "TransportKitTests",
            // CUdev: the libudev reference enumeration the sysfs listing is checked against.
            dependencies: ["TransportKit", "TransportKitFoundation", "TransportKitLinux", "TransportKitUdev", "TransportKitSerial", "TransportKitDBus",
                           "TransportKitUSB", "TransportKitBluetooth", "TransportKitRFC2217",
                           "CUdev", "TestSupport", nioPosix, system, logging],
            exclude: ["Peers"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "CLITests",
            dependencies: ["TransportKit", "TestSupport", system],
            exclude: ["Peers"],
            swiftSettings: strict
        ),
        .testTarget(
            // Runs inside the qemu lab (Scripts/lab) against real USB and Bluetooth drivers; every
            // suite is disabled elsewhere. CBlueZ: the Bluetooth smoke test's raw sockets.
            name: "LabTests",
            dependencies: ["TransportKit", "TransportKitSerial", "CBlueZ", "TestSupport", system],
            exclude: ["Peers"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "CShimTests",
            // Every C module (Sources/C*); DocsDriftTests checks it.
            dependencies: ["CBlueZ", "CLinux", "CUdev", "CLibUSB", "CSDBus", "CZlib"],
            swiftSettings: strict
        ),
    ],
    swiftLanguageModes: [.v6]
)
