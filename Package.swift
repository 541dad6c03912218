// swift-tools-version:6.0
import PackageDescription

// Layers (Docs/Architecture.md):
//   TransportKitCore  URL model, options, registry, connection, errors, framing, Foundation bridge.
//                     Imports no C module of this package.
//   Plugins/<Name>    one target per scheme family; the only place a C shim target is imported.
//   TransportKit      the product: re-exports the core and registers every built-in plugin.
let strict: [SwiftSetting] = [.enableUpcomingFeature("ExistentialAny")]

let package = Package(
    name: "TransportKit",
    platforms: [.macOS(.v15)],
    products: [
        .library(name: "TransportKit", targets: ["TransportKit"]),
        .executable(name: "transportkit", targets: ["transportkit"]),
        .executable(name: "transportkit-bench", targets: ["transportkit-bench"]),
    ],
    dependencies: [
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
        .package(url: "https://github.com/apple/swift-argument-parser.git", from: "1.8.2"),
    ],
    targets: [
        // Thin C targets: a module map and one shim header each. Providers only print a hint; Scripts/setup installs them.
        .systemLibrary(name: "CBlueZ", path: "Sources/CBlueZ", pkgConfig: "bluez", providers: [.apt(["libbluetooth-dev"])]),
        .systemLibrary(name: "CUdev", path: "Sources/CUdev", pkgConfig: "libudev", providers: [.apt(["libudev-dev"])]),
        .systemLibrary(name: "CLibUSB", path: "Sources/CLibUSB", pkgConfig: "libusb-1.0", providers: [.apt(["libusb-1.0-0-dev"])]),

        .target(
            name: "TransportKitCore",
            dependencies: [.product(name: "NIOCore", package: "swift-nio")],
            path: "Sources/TransportKit/Core",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitSockets",
            dependencies: [
                "TransportKitCore",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/Plugins/Sockets",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitLoop",
            dependencies: ["TransportKitCore", .product(name: "NIOCore", package: "swift-nio")],
            path: "Sources/Plugins/Loop",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKitSerial",
            dependencies: [
                "TransportKitCore", "CUdev",
                .product(name: "NIOCore", package: "swift-nio"),
                .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/Plugins/Serial",
            swiftSettings: strict
        ),
        .target(
            name: "TransportKit",
            dependencies: ["TransportKitCore", "TransportKitSockets", "TransportKitLoop", "TransportKitSerial"],
            path: "Sources/TransportKit/BuiltIns",
            swiftSettings: strict
        ),
        .executableTarget(
            name: "transportkit",
            dependencies: ["TransportKit", .product(name: "ArgumentParser", package: "swift-argument-parser")],
            path: "Sources/transportkit",
            swiftSettings: strict
        ),

        .target(name: "CBenchLoops", path: "Sources/Benchmarks/CBenchLoops", linkerSettings: [.linkedLibrary("udev")]),
        .executableTarget(
            name: "transportkit-bench",
            dependencies: [
                "TransportKit", "CBenchLoops",
                .product(name: "NIOCore", package: "swift-nio"), .product(name: "NIOPosix", package: "swift-nio"),
            ],
            path: "Sources/Benchmarks/transportkit-bench",
            swiftSettings: strict
        ),

        // Helpers every test target shares (polling, open descriptors); built only for the tests.
        .target(name: "TestSupport", path: "Tests/TestSupport", swiftSettings: strict),
        .testTarget(
            name: "TransportKitTests",
            // CUdev: the libudev reference enumeration the sysfs listing is checked against.
            dependencies: ["TransportKit", "TransportKitSerial", "CUdev", "TestSupport"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "CLITests",
            dependencies: ["TransportKit"],
            swiftSettings: strict
        ),
        .testTarget(
            // Runs inside the qemu lab (Scripts/lab) against real USB and Bluetooth drivers; every
            // suite is disabled elsewhere. CBlueZ: the Bluetooth smoke test's raw sockets.
            name: "LabTests",
            dependencies: ["TransportKit", "TransportKitSerial", "CBlueZ", "TestSupport"],
            swiftSettings: strict
        ),
        .testTarget(
            name: "CShimTests",
            dependencies: ["CBlueZ", "CUdev", "CLibUSB"],
            swiftSettings: strict
        ),
    ],
    swiftLanguageModes: [.v6]
)
