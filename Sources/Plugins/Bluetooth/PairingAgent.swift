// PairingAgent.swift: pairing through bluetoothd (BlueZ doc/agent-api.txt and device-api.txt at
// 5.66): an org.bluez.Agent1 object this process exports and registers with AgentManager1, which
// bluetoothd asks to confirm a pairing, enter or show a passkey, or authorize a device; and
// Device1.Pair, CancelPairing, Adapter1.RemoveDevice for the central.
//
// Facts this follows:
// - Without any agent registered, bluetoothd refuses a pairing that needs user interaction and
//   Device1.Pair fails (org.bluez.Error.AuthenticationFailed, or AuthenticationRejected); the
//   kernel accepts BR/EDR Just Works on its own, LE's goes through the agent.
// - The agent's methods are called on bluetoothd's schedule and may take as long as a person does:
//   they are answered from a task (DBusConnection's asynchronous export), never on the bus thread.
//   bluetoothd gives up on an unanswered request after its own timeout and calls Cancel.
// - A rejection is the error org.bluez.Error.Rejected; an agent that gives up, org.bluez.Error.Canceled.

import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus

/// What bluetoothd asks a pairing agent.
public enum BluetoothPairingRequest: Sendable, Hashable {
    /// Numeric comparison: does the device show this passkey? (accept or reject)
    case confirm(device: String, passkey: UInt32)
    /// Passkey entry: the passkey the device shows (answer ``BluetoothPairingAnswer/passkey(_:)``).
    case enterPasskey(device: String)
    /// Show this passkey for the person to type on the device (answer accept).
    case displayPasskey(device: String, passkey: UInt32)
    /// A legacy PIN code (answer ``BluetoothPairingAnswer/pinCode(_:)``).
    case enterPinCode(device: String)
    /// Just Works, or an incoming pairing: may this device pair? (accept or reject)
    case authorize(device: String)
    /// May this device use the service with this UUID? (accept or reject)
    case authorizeService(device: String, uuid: String)
}

/// A pairing agent's answer.
public enum BluetoothPairingAnswer: Sendable, Hashable {
    /// Yes: the passkeys match, the device may pair or use the service, the passkey was shown.
    /// To an `enterPasskey` or `enterPinCode` request it is a rejection.
    case accept
    /// No: bluetoothd gets `org.bluez.Error.Rejected` and the pairing fails.
    case reject
    /// The passkey the person read off the device (0 to 999999), for ``BluetoothPairingRequest/enterPasskey(device:)``;
    /// to any other request it is a rejection.
    case passkey(UInt32)
    /// The PIN code (1 to 16 characters), for ``BluetoothPairingRequest/enterPinCode(device:)``;
    /// to any other request it is a rejection.
    case pinCode(String)
}

/// A pairing agent registered with bluetoothd for this process: it answers bluetoothd's questions
/// while a pairing runs (numeric comparison, passkey entry, Just Works authorization). Unregister
/// it when done; it also goes away when the process leaves the bus.
///
/// ```swift
/// // Just Works: accept every pairing and authorization.
/// let agent = try await BluetoothPairingAgent.register()
/// // Passkey entry, answered by the app:
/// let keypad = try await BluetoothPairingAgent.register(capability: .keyboardDisplay) { request in
///     if case .enterPasskey = request { return .passkey(askTheUser()) }
///     return .accept
/// }
/// try await device.pair()
/// await agent.unregister()
/// ```
public final class BluetoothPairingAgent: Sendable {
    /// What the agent can do, which decides the pairing method bluetoothd and the device choose.
    public enum Capability: String, Sendable, CaseIterable {
        /// Just Works only (no MITM protection: `security=high` is not reached).
        case noInputNoOutput = "NoInputNoOutput"
        /// Shows a passkey (``BluetoothPairingRequest/displayPasskey(device:passkey:)``) but takes no input.
        case displayOnly = "DisplayOnly"
        /// Numeric comparison.
        case displayYesNo = "DisplayYesNo"
        /// Passkey entry (``BluetoothPairingRequest/enterPasskey(device:)``), with nothing to show.
        case keyboardOnly = "KeyboardOnly"
        /// Passkey entry and numeric comparison.
        case keyboardDisplay = "KeyboardDisplay"
    }

    /// The agent's object path.
    public let path: String
    private let bluez: BlueZ
    private let export: DBusExport
    private let unregistered = Atomic(false)

    /// How many agents this process has registered: with one, a failed pairing is the device's
    /// refusal, not a missing agent here (bluetoothd asks the agent of the client that called Pair).
    static let registered = Atomic(0)

    private init(path: String, bluez: BlueZ, export: DBusExport) {
        self.path = path
        self.bluez = bluez
        self.export = export
    }

    /// Registers an agent with bluetoothd, as the default agent when `asDefault` (the one bluetoothd
    /// asks for pairings it did not start from a client's Pair, such as incoming ones).
    ///
    /// - Parameters:
    ///   - capability: what the agent can show and take; `.noInputNoOutput` (Just Works) by default.
    ///   - asDefault: also the default agent (RequestDefaultAgent).
    ///   - bus: the bus bluetoothd is on.
    ///   - answer: how each request is answered; by default every request is accepted (Just Works,
    ///     and authorizations). Requests for a passkey or a PIN code that it answers with `.accept`
    ///     are rejected.
    /// - Throws: `.notFound` when bluetoothd is not running, `.busy` when bluetoothd already has an
    ///   agent at this path, and BlueZ's errors.
    public static func register(capability: Capability = .noInputNoOutput, asDefault: Bool = true, bus: DBusConnection.Bus = .system,
                                answer: @escaping @Sendable (BluetoothPairingRequest) async -> BluetoothPairingAnswer = { _ in .accept })
        async throws -> BluetoothPairingAgent {
        let bluez = try await BlueZ.shared(bus)
        let path = BlueZ.exportPath("agent")
        let export = try await bluez.bus.export(path: path, answering: { call in
            guard call.interface == "org.bluez.Agent1" else { return .notHandled }
            return await handle(call, answer: answer)
        })
        do {
            _ = try await bluez.call("/org/bluez", "org.bluez.AgentManager1", "RegisterAgent", [.objectPath(path), .string(capability.rawValue)],
                                     about: "registering a pairing agent")
            if asDefault {
                _ = try await bluez.call("/org/bluez", "org.bluez.AgentManager1", "RequestDefaultAgent", [.objectPath(path)],
                                         about: "making the pairing agent the default one")
            }
        } catch {
            _ = try? await bluez.call("/org/bluez", "org.bluez.AgentManager1", "UnregisterAgent", [.objectPath(path)], about: "unregistering a pairing agent")
            await export.remove()
            throw error
        }
        registered.add(1, ordering: .relaxed)
        return BluetoothPairingAgent(path: path, bluez: bluez, export: export)
    }

    /// Unregisters the agent; bluetoothd asks it nothing more.
    public func unregister() async {
        guard !unregistered.exchange(true, ordering: .relaxed) else { return }
        Self.registered.subtract(1, ordering: .relaxed)
        _ = try? await bluez.call("/org/bluez", "org.bluez.AgentManager1", "UnregisterAgent", [.objectPath(path)], about: "unregistering a pairing agent")
        await export.remove()
    }

    /// One Agent1 call, answered.
    static func handle(_ call: DBusMethodCall, answer: @Sendable (BluetoothPairingRequest) async -> BluetoothPairingAnswer) async -> DBusMethodResult {
        let arguments = call.arguments
        let device = arguments.first?.text.map(BlueZ.address(inDevicePath:)) ?? "?"
        let request: BluetoothPairingRequest
        switch call.member {
        case "Release", "Cancel":
            return .reply([])
        case "RequestConfirmation":
            request = .confirm(device: device, passkey: UInt32(clamping: arguments.dropFirst().first?.integer ?? 0))
        case "RequestPasskey":
            request = .enterPasskey(device: device)
        case "DisplayPasskey":
            request = .displayPasskey(device: device, passkey: UInt32(clamping: arguments.dropFirst().first?.integer ?? 0))
        case "RequestPinCode":
            request = .enterPinCode(device: device)
        case "DisplayPinCode":
            return .reply([])
        case "RequestAuthorization":
            request = .authorize(device: device)
        case "AuthorizeService":
            request = .authorizeService(device: device, uuid: arguments.dropFirst().first?.text?.lowercased() ?? "")
        default:
            return .notHandled
        }
        let rejected = DBusMethodResult.error(name: "org.bluez.Error.Rejected", message: "rejected by the application's pairing agent")
        switch (request, await answer(request)) {
        case (.enterPasskey, .passkey(let passkey)):
            return .reply([.uint32(passkey)])
        case (.enterPinCode, .pinCode(let code)):
            return .reply([.string(code)])
        case (.enterPasskey, _), (.enterPinCode, _), (_, .reject), (_, .passkey), (_, .pinCode):
            return rejected
        case (_, .accept):
            return .reply([])
        }
    }
}

extension BluetoothPeripheral {
    /// `true` when bluetoothd has keys for the device (paired or bonded).
    public var isPaired: Bool { deviceSnapshot.paired }

    /// Pairs with the device (Device1.Pair), which needs an agent registered
    /// (``BluetoothPairingAgent``) unless the kernel can do Just Works by itself; bluetoothd keeps
    /// the keys (a bond), so the device is paired on later connections too. Pairing a device that
    /// is paired already does nothing.
    ///
    /// - Throws: `.permissionDenied` when the pairing failed or was rejected (the message says
    ///   whether an agent is needed), `.timedOut`, `.disconnected`.
    public func pair() async throws {
        if isPaired { return }
        do {
            _ = try await callDevice("Pair", about: "pairing")
        } catch let error as TransportError {
            if let failure = BluetoothPairingAgent.pairingFailure(error) { throw failure }
        }
        updateDevice { $0.paired = true }
    }

    /// Forgets the device at `address` without connecting to it: bluetoothd removes it and its keys
    /// (Adapter1.RemoveDevice). Returns `false` when bluetoothd did not know it.
    ///
    /// ```swift
    /// try await BluetoothPeripheral.forget("E3:2E:44:66:A2:4A", adapter: "hci0")
    /// ```
    @discardableResult
    public static func forget(_ address: String, adapter: String? = nil, bus: DBusConnection.Bus = .system) async throws -> Bool {
        guard let parsed = BluetoothAddress(address) else {
            throw TransportError(.invalidURL, "'\(TransportError.printable(address, limit: 40))' is not a Bluetooth address (six hex pairs: E3:2E:44:66:A2:4A)")
        }
        let bluez = try await BlueZ.shared(bus)
        let chosen = try BlueZ.adapter(named: adapter, among: try await bluez.adapters())
        do {
            _ = try await bluez.call(chosen.path, BlueZ.adapterInterface, "RemoveDevice", [.objectPath(BlueZ.devicePath(on: chosen, address: parsed.description))],
                                     about: "forgetting \(parsed)")
            return true
        } catch let error as TransportError where error.code == "org.bluez.Error.DoesNotExist" {
            return false
        }
    }

    /// Forgets the device: bluetoothd removes it and its keys (Adapter1.RemoveDevice), which also
    /// disconnects it. This object is disconnected after.
    public func forget() async throws {
        let snapshot = deviceSnapshot
        await disconnect()
        do {
            _ = try await bluez.call(snapshot.adapterPath, BlueZ.adapterInterface, "RemoveDevice", [.objectPath(snapshot.path)],
                                            about: "forgetting \(address)")
        } catch let error as TransportError where error.code == "org.bluez.Error.DoesNotExist" {
            // Already gone.
        }
    }
}

extension BluetoothPairingAgent {
    /// Pairs with the device at `path` (Device1.Pair), as ``BluetoothPeripheral/pair()`` does:
    /// for `security=medium` on a GATT URL.
    static func pair(_ bluez: BlueZ, device path: String, timeout: Duration = .seconds(60), about what: String) async throws {
        do {
            _ = try await bluez.call(path, BlueZ.deviceInterface, "Pair", timeout: timeout, about: what)
        } catch let error as TransportError {
            if let failure = pairingFailure(error) { throw failure }
        }
    }

    /// Device1.Pair's error (explained by `BlueZ.explain`); nil when the device was paired already.
    static func pairingFailure(_ error: TransportError) -> TransportError? {
        error.code == "org.bluez.Error.AlreadyExists" ? nil : error
    }
}
