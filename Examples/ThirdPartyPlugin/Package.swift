// swift-tools-version:6.0
// A plugin package of its own, as a third party would write one: it depends on the
// TransportKitCore product only (the core and the plugin SDK), so its binaries link no libudev,
// libusb or libbluetooth. Scripts/test builds it, runs reverse-demo and checks the libraries.
import PackageDescription

let package = Package(
    name: "ThirdPartyPlugin",
    products: [
        .library(name: "ReverseScheme", targets: ["ReverseScheme"]),
        .executable(name: "reverse-demo", targets: ["reverse-demo"]),
    ],
    dependencies: [
        // A published plugin would write .package(url: "https://…/TransportKit.git", from: "…").
        .package(name: "TransportKit", path: "../.."),
        .package(url: "https://github.com/apple/swift-nio.git", from: "2.101.2"),
    ],
    targets: [
        .target(
            name: "ReverseScheme",
            dependencies: [
                .product(name: "TransportKitCore", package: "TransportKit"),
                .product(name: "NIOCore", package: "swift-nio"),
            ]
        ),
        .executableTarget(
            name: "reverse-demo",
            dependencies: ["ReverseScheme", .product(name: "TransportKitCore", package: "TransportKit")]
        ),
    ],
    swiftLanguageModes: [.v6]
)
