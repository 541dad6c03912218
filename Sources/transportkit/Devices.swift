import ArgumentParser
import Foundation
import TransportKit

struct List: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "List the devices TransportKit can reach, each with a URL that connects to it.",
        discussion: """
            Serial ports and USB devices come from sysfs and udev's database; a USB device's interfaces \
            (class, endpoints, driver) are listed under it. Bluetooth adapters come from bluetoothd.
            """
    )

    @Flag(help: "Print a JSON array of device objects (camelCase keys).")
    var json = false

    @Flag(help: "Include ports that are not backed by hardware (console, ptmx, unused 8250 slots), and USB hubs.")
    var all = false

    @Option(name: .customLong("scan"), help: ArgumentHelp("Also scan for nearby Bluetooth devices (LE and classic) for this long.", valueName: "seconds"))
    var scanSeconds: Double?

    @Flag(help: "Also list serial ports shared on the local network (mDNS through avahi-daemon: RFC 2217 servers, ser2net), each with its rfc2217:// URL.")
    var network = false

    @OptionGroup var logging: LoggingOptions

    func validate() throws {
        try Arguments.refuseRepeated(["--scan", "--log-level", "--json", "--all", "--network"])
        if let scanSeconds, !(scanSeconds > 0 && scanSeconds <= 3600) { throw ValidationError("--scan takes seconds between 0 and 3600") }
    }

    func run() async throws {
        logging.bootstrap()
        let listing = await Transport.devices(includeAll: all)
        // A plugin that cannot list (no udev, no adapter) is reported; the others' devices still are.
        for failure in listing.failures {
            StandardError.write("transportkit: warning: \(failure.error)\n")
        }
        var devices = listing.devices
        if let scanSeconds {
            var found: [String: DeviceRecord] = [:]
            do {
                let scan = BluetoothScan(bearer: .both, end: .after(.milliseconds(Int(scanSeconds * 1000))), expiry: nil)
                for try await case .discovered(let device) in BluetoothPlugin().scan(scan) { found[device.address] = device.record }
            } catch {
                StandardError.write("transportkit: warning: Bluetooth scan: \(error)\n")
            }
            devices += found.values.sorted { $0.url < $1.url }
        }
        if network {
            do {
                let ports = try await RFC2217Plugin().networkPorts()
                devices += ports.devices
                if !ports.complete {
                    StandardError.write("transportkit: warning: network ports: avahi-daemon had not reported everything in time "
                                        + "(a host that does not answer holds the listing up); there may be more\n")
                }
            } catch {
                // A warning only: the local devices still are listed.
                StandardError.write("transportkit: warning: network ports: \(error)\n")
            }
        }
        let failed = !listing.failures.isEmpty
        do {
            if json {
                print(try DeviceJSON.encode(devices, pretty: true))
            } else if devices.isEmpty && !failed {
                StandardError.write("no devices found\(all ? "" : " (--all also shows virtual and unused ports)")\n")
            } else if !devices.isEmpty {
                print(DeviceTable.render(devices))
            }
        } catch {
            throw fail(error)
        }
        if devices.isEmpty && failed { throw ExitCode.failure }
    }
}

struct Watch: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "Print one line per device arrival, removal or change, as it happens.",
        discussion: """
            With --json each line is an object: {"event":"added","device":{…}}. Once subscribed, \
            "watching" is printed on standard error, so a script knows no event after it is missed.
            """
    )

    @Flag(help: "Print one JSON object per line.")
    var json = false

    @Flag(help: "Include ports that are not backed by hardware, and USB hubs.")
    var all = false

    @Option(name: .customLong("scan"), help: ArgumentHelp("Also report nearby Bluetooth devices appearing and expiring, scanning for this long.", valueName: "seconds"))
    var scanSeconds: Double?

    @Flag(help: "Also report serial ports shared on the local network appearing and leaving (mDNS through avahi-daemon).")
    var network = false

    @OptionGroup var logging: LoggingOptions

    func validate() throws {
        try Arguments.refuseRepeated(["--scan", "--log-level", "--json", "--all", "--network"])
        if let scanSeconds, !(scanSeconds > 0 && scanSeconds <= 86400) { throw ValidationError("--scan takes seconds between 0 and 86400") }
    }

    /// The registry's device events; with --scan the Bluetooth devices seen (added) and expired
    /// (removed); with --network the serial ports on the network appearing and leaving. Returns
    /// once every source is subscribed.
    func events() async throws -> AsyncThrowingStream<DeviceEvent, any Error> {
        let registry = await Transport.deviceEvents(includeAll: all)
        guard scanSeconds != nil || network else { return registry }
        var subscribed: AsyncThrowingStream<DeviceEvent, any Error>?
        if network {
            do {
                subscribed = try await RFC2217Plugin().networkPortEvents()
            } catch {
                // A warning only: the local events still are reported.
                StandardError.write("transportkit: warning: network ports: \(error)\n")
            }
        }
        let networkPorts = subscribed
        let scanSeconds = scanSeconds
        let (merged, continuation) = AsyncThrowingStream<DeviceEvent, any Error>.makeStream()
        let task = Task {
            await withTaskGroup(of: Void.self) { group in
                group.addTask {
                    do {
                        for try await event in registry { continuation.yield(event) }
                        continuation.finish()
                    } catch {
                        continuation.finish(throwing: error)
                    }
                }
                if let scanSeconds {
                    group.addTask {
                        let scan = BluetoothScan(bearer: .both, end: .after(.milliseconds(Int(scanSeconds * 1000))), expiry: .seconds(15))
                        do {
                            for try await event in BluetoothPlugin().scan(scan) {
                                switch event {
                                case .discovered(let device): continuation.yield(DeviceEvent(.added, device.record))
                                case .expired(let device): continuation.yield(DeviceEvent(.removed, device.record))
                                case .updated: continue
                                }
                            }
                        } catch {
                            StandardError.write("transportkit: warning: Bluetooth scan: \(error)\n")
                        }
                    }
                }
                if let networkPorts {
                    group.addTask {
                        do {
                            for try await event in networkPorts { continuation.yield(event) }
                        } catch {
                            StandardError.write("transportkit: warning: network ports: \(error)\n")
                        }
                    }
                }
            }
        }
        continuation.onTermination = { _ in task.cancel() }
        return merged
    }

    func run() async throws {
        logging.bootstrap()
        do {
            let events = try await events()
            StandardError.write("watching\n")
            for try await event in events {
                let line = json ? try DeviceJSON.encode(event) : DeviceTable.line(event)
                try StandardOutput.writeLine(line)
            }
        } catch StandardStreamError.outputClosed {
            // `watch | head -n 3`: the reader has what it wanted.
        } catch {
            throw fail(error)
        }
    }
}

enum DeviceJSON {
    static func encode<T: Encodable>(_ value: T, pretty: Bool = false) throws -> String {
        let encoder = JSONEncoder()
        encoder.outputFormatting = pretty ? [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes] : [.sortedKeys, .withoutEscapingSlashes]
        return String(decoding: try encoder.encode(value), as: UTF8.self)
    }

    static func encode(_ event: DeviceEvent) throws -> String {
        struct Line: Encodable {
            let event: String
            let device: DeviceRecord
        }
        return try encode(Line(event: event.action.rawValue, device: event.device))
    }
}

enum DeviceTable {
    static func render(_ devices: [DeviceRecord]) -> String {
        let header = ["DEVICE", "ID", "SERIAL", "DRIVER", "PRODUCT", "URL"]
        let rows = devices.map { device in
            [device.devnode ?? device.name ?? "?", id(device), device.serialNumber ?? "-", device.driver ?? "-",
             device.product ?? "-", device.url]
        }
        let widths = header.indices.map { column in ([header] + rows).map { $0[column].count }.max() ?? 0 }
        func line(_ row: [String]) -> String {
            row.enumerated().map { index, cell in
                index == row.count - 1 ? cell : cell.padding(toLength: widths[index], withPad: " ", startingAt: 0)
            }.joined(separator: "  ")
        }
        var lines = [line(header)]
        for (device, row) in zip(devices, rows) {
            lines.append(line(row))
            // A USB device's interfaces, one line each under its row (properties "interface.N").
            let interfaces = device.properties.keys.filter { $0.hasPrefix("interface.") }
                .compactMap { key in Int(key.dropFirst("interface.".count)).map { ($0, key) } }.sorted { $0.0 < $1.0 }
            for (number, key) in interfaces {
                lines.append("    interface \(number): \(device.properties[key] ?? "")")
            }
        }
        return lines.joined(separator: "\n")
    }

    static func line(_ event: DeviceEvent) -> String {
        let device = event.device
        var text = "\(event.action.rawValue.padding(toLength: 7, withPad: " ", startingAt: 0)) \(device.devnode ?? device.name ?? "?")"
        if device.vendorId != nil { text += "  \(id(device))" }
        if let product = device.product { text += "  \(product)" }
        return text + "  \(device.url)"
    }

    private static func id(_ device: DeviceRecord) -> String {
        guard let vendor = device.vendorId, let product = device.productId else { return "-" }
        return "\(vendor):\(product)"
    }
}
