import ArgumentParser
import Foundation
import TransportKit
@_spi(Plugins) import TransportKitCore

/// `transportkit gatt ADDRESS [read|write|notify …]`: a Bluetooth LE device's GATT services,
/// through BluetoothPeripheral (bluetoothd's GATT client).
struct Gatt: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        abstract: "List a Bluetooth LE device's GATT services, or read, write or follow a characteristic.",
        discussion: """
            transportkit gatt ADDRESS                   the services, characteristics and descriptors with their flags
            transportkit gatt ADDRESS read UUID         the value as hex (--raw: the bytes themselves)
            transportkit gatt ADDRESS write UUID HEX    writes the bytes (0d0a, "0D 0A" or 0d:0a) with a response (--without-response)
            transportkit gatt ADDRESS notify UUID       each value as a hex line, until Ctrl-C or --count values
            transportkit gatt ADDRESS pair              pairs (Just Works, through an agent this command registers for the pairing) and keeps the keys
            transportkit gatt ADDRESS forget            removes the device and its keys from bluetoothd (no connection needed)
            UUIDs are short (2a19) or 128-bit. The tool connects if the device is not connected, and disconnects after.
            """
    )

    enum Action: String, CaseIterable, ExpressibleByArgument {
        case list, read, write, notify, pair, forget
    }

    @Argument(help: "The device's address (E3:2E:44:66:A2:4A).")
    var address: String

    @Argument(help: "list (the default), read, write, notify, pair or forget.")
    var action: Action = .list

    @Argument(help: "The characteristic's UUID (read, write, notify).")
    var characteristic: String?

    @Argument(help: "The bytes to write, in hex (write).")
    var value: String?

    @Option(help: ArgumentHelp("The adapter (hci0, or its address); default: the first powered one.", valueName: "hciN"))
    var adapter: String?

    @Option(help: ArgumentHelp("The service's UUID, when two services have the characteristic.", valueName: "uuid"))
    var service: String?

    @Option(name: .customLong("timeout"), help: ArgumentHelp("Seconds to find and connect to the device (default 20).", valueName: "seconds"))
    var timeoutSeconds: Double = 20

    @Flag(help: "list: print the services as JSON.")
    var json = false

    @Flag(help: "read: write the value's bytes to standard output, not hex.")
    var raw = false

    @Flag(name: .customLong("without-response"), help: "write: a write without response (at most ATT MTU - 3 bytes).")
    var withoutResponse = false

    @Option(help: ArgumentHelp("notify: stop after this many values.", valueName: "n"))
    var count: Int?

    @OptionGroup var logging: LoggingOptions

    func validate() throws {
        try Arguments.refuseRepeated(["--adapter", "--service", "--timeout", "--count", "--log-level", "--json", "--raw", "--without-response"])
        guard timeoutSeconds.isFinite, timeoutSeconds > 0, timeoutSeconds <= 3600 else {
            throw ValidationError("--timeout takes seconds between 0 and 3600; got \(timeoutSeconds)")
        }
        // What an action does not use is refused, not ignored.
        let unused: [(given: Bool, name: String, action: Action)] = [
            (json, "--json", .list), (raw, "--raw", .read), (withoutResponse, "--without-response", .write), (count != nil, "--count", .notify),
        ]
        for option in unused where option.given && option.action != action {
            throw ValidationError("\(option.name) is for 'gatt ADDRESS \(option.action.rawValue)'; leave it out of '\(action.rawValue)'")
        }
        switch action {
        case .list:
            if characteristic != nil || value != nil { throw ValidationError("gatt ADDRESS lists the services and takes no UUID; to read one: gatt ADDRESS read UUID") }
            if service != nil { throw ValidationError("--service is for read, write and notify") }
        case .pair, .forget:
            if characteristic != nil || value != nil { throw ValidationError("gatt ADDRESS \(action.rawValue) takes no UUID or value") }
            if action == .forget, CommandLine.arguments.contains(where: { $0 == "--timeout" || $0.hasPrefix("--timeout=") }) {
                throw ValidationError("--timeout bounds a connect, and gatt ADDRESS forget connects to nothing; leave it out")
            }
            if service != nil { throw ValidationError("--service is for read, write and notify") }
        case .read, .notify:
            if characteristic == nil { throw ValidationError("gatt ADDRESS \(action.rawValue) UUID: give the characteristic's UUID") }
            if value != nil { throw ValidationError("gatt ADDRESS \(action.rawValue) takes no value; to write: gatt ADDRESS write UUID HEX") }
        case .write:
            guard characteristic != nil, let value else { throw ValidationError("gatt ADDRESS write UUID HEX: give the characteristic's UUID and the bytes in hex") }
            guard let bytes = Hex.bytes(value) else { throw ValidationError("'\(value)' is not hex bytes (two digits each: 0d0a, \"0D 0A\", 0d:0a)") }
            if bytes.isEmpty { throw ValidationError("gatt ADDRESS write UUID HEX: give at least one byte") }
        }
        if let count, count < 1 { throw ValidationError("--count takes a number of values from 1") }
    }

    func run() async throws {
        logging.bootstrap()
        let command = self
        do {
            try await Signals.run { try await command.perform() }
        } catch StandardStreamError.outputClosed {
            // `gatt … notify | head -n 3`: the reader has what it wanted.
        } catch let exit as ExitCode {
            throw exit
        } catch {
            throw fail(error)
        }
    }

    private func perform() async throws {
        if action == .forget {
            // Nothing to connect to: bluetoothd forgets what it knows.
            let known = try await BluetoothPeripheral.forget(address, adapter: adapter)
            let line = known ? "forgot \(address.uppercased())" : "bluetoothd did not know \(address.uppercased())"
            try await StandardOutput.writeAll(Array((line + "\n").utf8), waiting: DescriptorWait(fd: 1, events: Int16(POLLOUT)))
            return
        }
        let device = try await BluetoothPeripheral.connect(to: address, adapter: adapter, timeout: .milliseconds(Int64(timeoutSeconds * 1000)))
        do {
            try await perform(on: device)
        } catch {
            await device.disconnect()
            throw error
        }
        await device.disconnect()
    }

    private func perform(on device: BluetoothPeripheral) async throws {
        let uuid = characteristic ?? ""
        // Waits for room in standard output without blocking a thread (a slow `| less`).
        let writable = DescriptorWait(fd: 1, events: Int16(POLLOUT))
        func output(_ line: String) async throws { try await StandardOutput.writeAll(Array((line + "\n").utf8), waiting: writable) }
        switch action {
        case .list:
            let services = device.services
            if json {
                let encoder = JSONEncoder()
                encoder.outputFormatting = [.prettyPrinted, .sortedKeys]
                try await output(String(decoding: try encoder.encode(services), as: UTF8.self))
            } else {
                try await output(Self.render(services, device: device))
            }
        case .read:
            let bytes = try await device.read(uuid, service: service)
            if raw {
                try await StandardOutput.writeAll(bytes, waiting: writable)
            } else {
                try await output(Hex.text(bytes))
            }
        case .write:
            try await device.write(Hex.bytes(value ?? "") ?? [], to: uuid, service: service, type: withoutResponse ? .withoutResponse : .withResponse)
        case .pair:
            // Just Works through an agent of this process, for the time of the pairing.
            let agent = try await BluetoothPairingAgent.register(asDefault: false)
            do {
                try await device.pair()
            } catch {
                await agent.unregister()
                throw error
            }
            await agent.unregister()
            try await output("paired with \(device.address)")
        case .forget:
            break   // done in perform() without a connection
        case .notify:
            let values = try await device.notifications(of: uuid, service: service)
            let count = count
            // Until N values, or the reader of standard output went away (`| head -n 3`), whichever first.
            try await withThrowingTaskGroup(of: Void.self) { group in
                group.addTask {
                    var received = 0
                    for try await value in values {
                        try await StandardOutput.writeAll(Array((Hex.text(value) + "\n").utf8), waiting: writable)
                        received += 1
                        if let count, received >= count { return }
                    }
                }
                group.addTask { try await StandardOutput.waitUntilClosed() }
                defer { group.cancelAll() }
                try await group.next()
            }
        }
    }

    /// One line per service, characteristic and descriptor, indented.
    static func render(_ services: [GATTService], device: BluetoothPeripheral) -> String {
        var lines = ["\(device.address)\(device.name.map { " \($0)" } ?? "") on \(device.adapter)\(device.attMTU.map { ", ATT MTU \($0)" } ?? "")"]
        for service in services {
            lines.append("service \(service.uuid)\(service.isPrimary ? "" : " (secondary)")")
            for characteristic in service.characteristics {
                lines.append("  characteristic \(characteristic.uuid) [\(characteristic.flags.joined(separator: ","))]")
                for descriptor in characteristic.descriptors {
                    lines.append("    descriptor \(descriptor.uuid)\(descriptor.flags.isEmpty ? "" : " [\(descriptor.flags.joined(separator: ","))]")")
                }
            }
        }
        if services.isEmpty { lines.append("(no services)") }
        return lines.joined(separator: "\n")
    }
}
