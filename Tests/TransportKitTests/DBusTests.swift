import Foundation
import Glibc
import Synchronization
import Testing
import TransportKit
import TransportKitDBus
@_spi(Plugins) import TransportKitCore

/// A private dbus-daemon (the real one, with the session configuration) for a test.
final class PrivateBus: Sendable {
    /// Guards the process: started in init, stopped once.
    private let process: Locked<Process?>
    let address: String
    /// The configuration and service files of a bus with `activatable` names; removed in stop().
    private let directory: URL?

    /// A session bus; with `activatable` (bus name to the program its activation file starts),
    /// one of its own whose service directory offers those names for D-Bus activation. Started on
    /// a thread of its own: waiting for the daemon's address line on the cooperative pool stalled
    /// every other test while ten buses started at once (the pool has one thread per core).
    static func start(activatable: [String: String] = [:]) async throws -> PrivateBus {
        try await Support.offPool { Result { try PrivateBus(activatable: activatable) } }.get()
    }

    private init(activatable: [String: String]) throws {
        let process = Process()
        let output = Pipe()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/dbus-daemon")
        process.arguments = ["--session", "--nofork", "--print-address=1"]
        var made: URL?
        if !activatable.isEmpty {
            let directory = FileManager.default.temporaryDirectory.appendingPathComponent("tk-bus-\(getpid())-\(UInt32.random(in: 0...UInt32.max))")
            try FileManager.default.createDirectory(at: directory, withIntermediateDirectories: true)
            made = directory
            for (name, program) in activatable {
                try "[D-BUS Service]\nName=\(name)\nExec=\(program)\n".write(to: directory.appendingPathComponent("\(name).service"), atomically: true, encoding: .utf8)
            }
            let config = directory.appendingPathComponent("bus.conf")
            try """
                <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
                 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
                <busconfig>
                  <type>session</type>
                  <listen>unix:tmpdir=/tmp</listen>
                  <servicedir>\(directory.path)</servicedir>
                  <policy context="default"><allow send_destination="*"/><allow receive_sender="*"/><allow own="*"/></policy>
                </busconfig>
                """.write(to: config, atomically: true, encoding: .utf8)
            // Through python3, which clears the signal mask before it execs dbus-daemon: Process
            // passes on the calling thread's mask, and a daemon with SIGCHLD blocked never learns
            // that the program it activated failed (the call then waits 25 s for the activation).
            process.executableURL = URL(fileURLWithPath: "/usr/bin/python3")
            process.arguments = ["-c", "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); os.execv(sys.argv[1], sys.argv[1:])",
                                 "/usr/bin/dbus-daemon", "--config-file=\(config.path)", "--nofork", "--print-address=1"]
        }
        process.standardOutput = output
        process.standardError = FileHandle.nullDevice
        try process.run()
        var line = Data()
        while !line.contains(UInt8(ascii: "\n")) {
            let chunk = output.fileHandleForReading.availableData
            if chunk.isEmpty { break }
            line.append(chunk)
        }
        address = String(decoding: line, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        self.process = Locked(process)
        directory = made
    }

    func stop() {
        guard let process = process.withLock({ process in defer { process = nil }; return process }) else { return }
        // dbus-daemon --session does not end on SIGTERM here: kill it, and reap it on a thread of
        // its own (the last reference often goes on the cooperative pool).
        kill(process.processIdentifier, SIGKILL)
        let directory = directory
        Thread {
            process.waitUntilExit()
            if let directory { try? FileManager.default.removeItem(at: directory) }
        }.start()
    }

    deinit { stop() }
}

@Suite("D-Bus client (sd-bus) against a private dbus-daemon",
       .enabled(if: FileManager.default.isExecutableFile(atPath: "/usr/bin/dbus-daemon"), "needs dbus-daemon (package dbus)"))
struct DBusTests {
    static let daemon = (name: "org.freedesktop.DBus", path: "/org/freedesktop/DBus")

    @Test func callsTheBusAndDecodesItsReplies() async throws {
        let daemon = try await PrivateBus.start()
        let bus = try DBusConnection(.address(daemon.address))
        let id = try await bus.call(destination: Self.daemon.name, path: Self.daemon.path, interface: Self.daemon.name, member: "GetId")
        #expect(id.first?.text?.count == 32, "\(id)")
        let names = try await bus.call(destination: Self.daemon.name, path: Self.daemon.path, interface: Self.daemon.name, member: "ListNames")
        #expect(names.first?.strings?.contains("org.freedesktop.DBus") == true, "\(names)")
        let owner = try await bus.call(destination: Self.daemon.name, path: Self.daemon.path, interface: Self.daemon.name,
                                       member: "GetNameOwner", [.string("org.freedesktop.DBus")])
        #expect(owner == [.string("org.freedesktop.DBus")])
        let unique = try await bus.uniqueName()
        #expect(unique.hasPrefix(":1."), "\(unique)")
        await bus.close()
        await expectTransportError(.disconnected) { try await bus.call(destination: Self.daemon.name, path: Self.daemon.path, interface: Self.daemon.name, member: "GetId") }
    }

    @Test func aServiceThatIsNotRunningSaysStartBluetoothd() async throws {
        let daemon = try await PrivateBus.start()
        let bus = try DBusConnection(.address(daemon.address))
        let error = await expectTransportError(.notFound) {
            try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
        }
        #expect(error?.message.contains("org.freedesktop.DBus.Error.ServiceUnknown") == true, "\(String(describing: error))")
        #expect(error?.message.contains("start bluetoothd") == true)
        await bus.close()
    }

    /// An activation file whose program is missing (bluez removed, its service file left): the
    /// daemon answers Spawn.*, which reads as "not running", with what to install.
    @Test func aServiceThatActivationCannotStartSaysInstallBluez() async throws {
        let daemon = try await PrivateBus.start(activatable: ["org.bluez": "/nonexistent/bluetoothd"])
        let bus = try DBusConnection(.address(daemon.address))
        let error = await expectTransportError(.notFound) {
            try await bus.call(destination: "org.bluez", path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
        }
        #expect(error?.code?.hasPrefix("org.freedesktop.DBus.Error.Spawn.") == true, "\(String(describing: error))")
        #expect(error?.message.contains("install bluez") == true, "\(String(describing: error))")
        await bus.close()
    }

    @Test func aBusThatIsNotThereIsNotFound() async throws {
        let error = await expectTransportError(.notFound) { try DBusConnection(.address("unix:path=/tmp/no-such-bus-\(getpid())")) }
        #expect(error?.message.contains("is dbus-daemon running?") == true, "\(String(describing: error))")
        #expect(error?.errno == .noSuchFileOrDirectory, "\(String(describing: error))")
    }

    @Test func valuesOfEveryKindSurviveARoundTripThroughAnExportedObject() async throws {
        let daemon = try await PrivateBus.start()
        let server = try DBusConnection(.address(daemon.address))
        let client = try DBusConnection(.address(daemon.address))
        let export = try await server.export(path: "/org/transportkit/Test") { call in
            switch call.member {
            case "Echo": return .reply(call.arguments)
            case "Refuse": return .error(name: "org.transportkit.Error.Refused", message: "no, thanks")
            default: return .notHandled
            }
        }
        let name = try await server.uniqueName()
        let values: [DBusValue] = [
            .byte(7), .bool(true), .int16(-2), .uint16(0xFFF0), .int32(-70000), .uint32(4_000_000_000), .int64(-1), .uint64(.max),
            .double(0.25), .string("grüße"), .objectPath("/org/bluez/hci0"), .signature("a{sv}"),
            .bytes([0, 1, 2, 255]), .array(element: "s", []), .array(element: "o", [.objectPath("/a"), .objectPath("/b")]),
            .dictionary(["Transport": .string("le"), "RSSI": .int16(-60), "UUIDs": .array(element: "s", [.string("6e400001-b5a3-f393-e0a9-e50e24dcca9e")])]),
            .structure([.objectPath("/x"), .dictionary([:])]),
            .variant(.variant(.uint32(3))),
        ]
        let echoed = try await client.call(destination: name, path: "/org/transportkit/Test", interface: "org.transportkit.Test", member: "Echo", values)
        #expect(echoed == values)
        #expect(echoed[15].dictionary?["RSSI"]?.integer == -60)
        #expect(echoed[12].bytes == [0, 1, 2, 255])
        #expect(echoed[12] == .byteArray([0, 1, 2, 255]), "an ay comes back as bytes, not one value per byte: \(echoed[12])")
        let large = (0..<65_536).map { UInt8(truncatingIfNeeded: $0 &* 7) }
        let big = try await client.call(destination: name, path: "/org/transportkit/Test", interface: "org.transportkit.Test", member: "Echo", [.bytes(large)])
        #expect(big.first?.bytes == large)
        #expect(big.first?.elements?.count == large.count, "elements still lists a byte array's bytes")

        let refused = await expectTransportError(.io) {
            try await client.call(destination: name, path: "/org/transportkit/Test", interface: "org.transportkit.Test", member: "Refuse")
        }
        #expect(refused?.message.contains("org.transportkit.Error.Refused: no, thanks") == true, "\(String(describing: refused))")
        let unknown = await expectTransportError(.io) {
            try await client.call(destination: name, path: "/org/transportkit/Test", interface: "org.transportkit.Test", member: "Nope")
        }
        #expect(unknown?.message.contains("UnknownMethod") == true, "\(String(describing: unknown))")

        await export.remove()
        let gone = await expectTransportError(.io) {
            try await client.call(destination: name, path: "/org/transportkit/Test", interface: "org.transportkit.Test", member: "Echo")
        }
        #expect(gone?.message.contains("UnknownObject") == true || gone?.message.contains("UnknownMethod") == true, "\(String(describing: gone))")
        await client.close()
        await server.close()
    }

    @Test func descriptorsTravelBothWaysAndTheReceiverOwnsItsCopy() async throws {
        let daemon = try await PrivateBus.start()
        let server = try DBusConnection(.address(daemon.address))
        let client = try DBusConnection(.address(daemon.address))
        // The server hands out the read end of a pipe that already holds bytes (as BlueZ's
        // AcquireNotify hands out a socket), and reads from a descriptor it is given.
        let received = Locked<[UInt8]>([])
        let export = try await server.export(path: "/org/transportkit/Pipe") { call in
            switch call.member {
            case "Acquire":
                var ends: [Int32] = [-1, -1]
                guard pipe(&ends) == 0 else { return .error(name: "org.transportkit.Error.Failed", message: "pipe") }
                _ = write(ends[1], "hello", 5)
                close(ends[1])
                return .reply([.unixFD(ends[0]), .uint16(517)])
            case "Give":
                guard case .unixFD(let fd)? = call.arguments.first else { return .error(name: "org.transportkit.Error.Failed", message: "no fd") }
                var buffer = [UInt8](repeating: 0, count: 16)
                let count = read(fd, &buffer, buffer.count)
                close(fd)
                received.withLock { $0 = Array(buffer.prefix(max(count, 0))) }
                return .reply([])
            default: return .notHandled
            }
        }
        let name = try await server.uniqueName()
        let reply = try await client.call(destination: name, path: "/org/transportkit/Pipe", interface: "org.transportkit.Pipe", member: "Acquire")
        guard case .unixFD(let fd)? = reply.first else { Issue.record("no descriptor in \(reply)"); return }
        #expect(reply.last == .uint16(517))
        #expect(fcntl(fd, F_GETFD) & FD_CLOEXEC != 0, "the received descriptor is close-on-exec")
        var buffer = [UInt8](repeating: 0, count: 16)
        #expect(read(fd, &buffer, buffer.count) == 5)
        #expect(Array(buffer.prefix(5)) == Array("hello".utf8))
        #expect(close(fd) == 0)

        var ends: [Int32] = [-1, -1]
        #expect(pipe(&ends) == 0)
        _ = write(ends[1], "world", 5)
        close(ends[1])
        _ = try await client.call(destination: name, path: "/org/transportkit/Pipe", interface: "org.transportkit.Pipe", member: "Give", [.unixFD(ends[0])])
        #expect(fcntl(ends[0], F_GETFD) >= 0, "a descriptor passed as an argument stays the caller's")
        close(ends[0])
        #expect(received.withLock { $0 } == Array("world".utf8))
        await export.remove()
        await client.close()
        await server.close()
    }

    @Test func signalsArriveOnceTheMatchIsInstalledAndEndWithTheConnection() async throws {
        let daemon = try await PrivateBus.start()
        let sender = try DBusConnection(.address(daemon.address))
        let listener = try DBusConnection(.address(daemon.address))
        let name = try await sender.uniqueName()
        let signals = try await listener.signals(DBusMatch(sender: name, interface: "org.freedesktop.DBus.ObjectManager"), buffering: .all(limit: 16))
        try await sender.emitSignal(path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "InterfacesAdded",
                                    [.objectPath("/org/bluez/hci0/dev_00_AA_01_01_00_01"), .array(element: "{sa{sv}}", [])])
        try await sender.emitSignal(path: "/", interface: "org.freedesktop.DBus.Unrelated", member: "Ignored")
        try await sender.emitSignal(path: "/", interface: "org.freedesktop.DBus.ObjectManager", member: "InterfacesRemoved",
                                    [.objectPath("/org/bluez/hci0/dev_00_AA_01_01_00_01"), .array(element: "s", [.string("org.bluez.Device1")])])
        var iterator = signals.makeAsyncIterator()
        let first = try await iterator.next()
        #expect(first?.member == "InterfacesAdded")
        #expect(first?.values.first == .objectPath("/org/bluez/hci0/dev_00_AA_01_01_00_01"))
        #expect(first?.sender == name)
        let second = try await iterator.next()
        #expect(second?.member == "InterfacesRemoved", "the unrelated interface's signal does not match")
        #expect(second?.values.last?.strings == ["org.bluez.Device1"])

        // The bus goes away: the stream ends with an error that says so, and calls fail.
        daemon.stop()
        do {
            while try await iterator.next() != nil {}
            Issue.record("the signal stream ended without an error")
        } catch let error as TransportError {
            #expect(error.kind == .disconnected, "\(error)")
            #expect(error.message.contains("lost"), "\(error)")
        }
        await expectTransportError(.disconnected) { try await listener.uniqueName() }
        await listener.close()
        await sender.close()
    }

    /// Each subscription says what happens when its reader falls behind: `.all` keeps every signal
    /// up to its limit and then ends with an error that says so; `.newest` keeps the last few.
    @Test func aSubscriptionWhoseReaderFallsBehindEndsWithAnErrorOrKeepsTheNewest() async throws {
        let daemon = try await PrivateBus.start()
        let sender = try DBusConnection(.address(daemon.address))
        let listener = try DBusConnection(.address(daemon.address))
        let name = try await sender.uniqueName()
        let rule = DBusMatch(sender: name, interface: "org.transportkit.Count")
        let all = try await listener.signals(rule, buffering: .all(limit: 3))
        let newest = try await listener.signals(rule, buffering: .newest(2))
        let roomy = try await listener.signals(rule, buffering: .all(limit: 16))
        for number in 0..<5 {
            try await sender.emitSignal(path: "/", interface: "org.transportkit.Count", member: "Tick", [.uint32(UInt32(number))])
        }
        // Nothing else is read until all five have reached the listener: its bus thread hands each
        // signal to every matching subscription at once, so once `roomy` has five, so has each.
        var seen = 0
        for try await _ in roomy {
            seen += 1
            if seen == 5 { break }
        }
        var received: [UInt32] = []
        do {
            for try await signal in all { if case .uint32(let number)? = signal.values.first { received.append(number) } }
            Issue.record("an .all subscription past its limit ended without an error")
        } catch let error as TransportError {
            #expect(error.kind == .io, "\(error)")
            #expect(error.message.contains("more than 3 D-Bus signals") && error.message.contains("fell behind"), "\(error)")
        }
        #expect(received == [0, 1, 2], "the signals before the limit are delivered first, in order")
        var iterator = newest.makeAsyncIterator()
        let kept = [try await iterator.next(), try await iterator.next()].compactMap { $0?.values.first }
        #expect(kept == [.uint32(3), .uint32(4)], "\(kept)")
        await listener.close()
        await sender.close()
    }

    /// Several rules feed one stream in the bus's order, and a signal that matches two rules comes once.
    @Test func severalRulesFeedOneStreamInOrderAndASignalMatchingTwoComesOnce() async throws {
        let daemon = try await PrivateBus.start()
        let sender = try DBusConnection(.address(daemon.address))
        let listener = try DBusConnection(.address(daemon.address))
        let name = try await sender.uniqueName()
        let events = try await listener.signals(matchingAnyOf: [
            DBusMatch(sender: name, interface: "org.transportkit.A"),
            DBusMatch(sender: name, interface: "org.transportkit.B", member: "Changed"),
            DBusMatch(sender: name, member: "Added"),
        ], buffering: .all(limit: 16))
        let emitted: [(String, String)] = [("org.transportkit.A", "Added"), ("org.transportkit.C", "Other"), ("org.transportkit.B", "Changed"),
                                           ("org.transportkit.B", "Ignored"), ("org.transportkit.C", "Added"), ("org.transportkit.A", "Removed")]
        for (index, (interface, member)) in emitted.enumerated() {
            try await sender.emitSignal(path: "/", interface: interface, member: member, [.uint32(UInt32(index))])
        }
        var iterator = events.makeAsyncIterator()
        var received: [UInt32] = []
        for _ in 0..<4 {
            if case .uint32(let number)? = try await iterator.next()?.values.first { received.append(number) }
        }
        #expect(received == [0, 2, 4, 5], "A.Added once (it matches two rules), B.Changed, C.Added, A.Removed: \(received)")
        await #expect(throws: TransportError.self) { try await listener.signals(matchingAnyOf: [], buffering: .all(limit: 1)) }
        await listener.close()
        await sender.close()
    }

    /// An exported object whose handler awaits: its reply goes out when it returns, while the bus
    /// goes on serving other calls; a call it does not handle gets UnknownMethod.
    @Test func anAsynchronousHandlerAnswersLaterWithoutHoldingUpTheBus() async throws {
        let daemon = try await PrivateBus.start()
        let server = try DBusConnection(.address(daemon.address))
        let client = try DBusConnection(.address(daemon.address))
        // "Slow" waits until the test opens `slowGate`; "Owed" until `owedGate`, opened only after
        // the server's connection has closed.
        let slowGate = AsyncCondition(false)
        let owedGate = AsyncCondition(false)
        let export = try await server.export(path: "/org/transportkit/Later", answering: { call in
            switch call.member {
            case "Slow":
                try? await slowGate.wait { $0 ? () : nil }
                return .reply([.string("slow"), .bytes([1, 2, 3])])
            case "Owed":
                try? await owedGate.wait { $0 ? () : nil }
                return .reply([.bytes([9])])
            case "Fast": return .reply([.string("fast")])
            case "Refuse": return .error(name: "org.transportkit.Error.Refused", message: "not now")
            default: return .notHandled
            }
        })
        let name = try await server.uniqueName()
        let call = { @Sendable (member: String) in
            try await client.call(destination: name, path: "/org/transportkit/Later", interface: "org.transportkit.Later", member: member,
                                  timeout: .seconds(20))
        }
        async let slow = call("Slow")
        try await Task.sleep(for: .milliseconds(100))
        // Answered while "Slow" still waits: a handler that held the bus thread would time this out.
        #expect(try await call("Fast") == [.string("fast")])
        slowGate.update { $0 = true }
        #expect(try await slow == [.string("slow"), .byteArray([1, 2, 3])])
        let refused = await expectTransportError(.io) { try await call("Refuse") }
        #expect(refused?.code == "org.transportkit.Error.Refused", "\(String(describing: refused))")
        let unknown = await expectTransportError(.io) { try await call("Nope") }
        #expect(unknown?.code == "org.freedesktop.DBus.Error.UnknownMethod", "\(String(describing: unknown))")
        // A reply still owed when the server's connection closes: the caller gets an error, not a
        // hang, and the handler that answers after the close finds nobody to answer.
        let owed = Task { try await call("Owed") }
        try await Task.sleep(for: .milliseconds(100))
        await server.close()
        do {
            _ = try await owed.value
            Issue.record("a call whose server closed returned")
        } catch let error as TransportError {
            #expect(error.code != nil, "\(error)")
        }
        owedGate.update { $0 = true }
        await export.remove()
        await client.close()
    }

    /// An in-order export (a GATT server's) answers its calls one at a time in the order they
    /// came: a quick call behind a slow one waits for it, and after remove() calls are refused.
    @Test func anInOrderExportAnswersOneCallAtATimeInOrder() async throws {
        let daemon = try await PrivateBus.start()
        let server = try DBusConnection(.address(daemon.address))
        let client = try DBusConnection(.address(daemon.address))
        let gate = AsyncCondition(false)
        let handled = Locked<[String]>([])
        let export = try await server.export(path: "/org/transportkit/Ordered", inOrder: true, answering: { call in
            if call.member == "Slow" { try? await gate.wait { $0 ? () : nil } }
            handled.withLock { $0.append(call.member) }
            return .reply([.string(call.member)])
        })
        let name = try await server.uniqueName()
        let call = { @Sendable (member: String) in
            try await client.call(destination: name, path: "/org/transportkit/Ordered", interface: "org.transportkit.Ordered", member: member,
                                  timeout: .seconds(20))
        }
        let slow = Task { try await call("Slow") }
        try await Task.sleep(for: .milliseconds(100))
        let fast = Task { try await call("Fast") }
        try await Task.sleep(for: .milliseconds(200))
        #expect(handled.withLock { $0 }.isEmpty, "the quick call waits behind the slow one")
        gate.update { $0 = true }
        #expect(try await slow.value == [.string("Slow")])
        #expect(try await fast.value == [.string("Fast")])
        #expect(handled.withLock { $0 } == ["Slow", "Fast"])
        await export.remove()
        let gone = await expectTransportError(.io) { try await call("Late") }
        #expect(gone?.code?.hasPrefix("org.freedesktop.DBus.Error.Unknown") == true, "\(String(describing: gone))")
        await server.close()
        await client.close()
    }

    @Test func slowRepliesTimeOutAndCancellationAndCloseEndWaitingCalls() async throws {
        let daemon = try await PrivateBus.start()
        let server = try DBusConnection(.address(daemon.address))
        let client = try DBusConnection(.address(daemon.address))
        // A handler that blocks its own bus thread for a while (test only: handlers must not block).
        let export = try await server.export(path: "/slow") { _ in
            usleep(800_000)
            return .reply([.string("late")])
        }
        let name = try await server.uniqueName()
        let call = { @Sendable (timeout: Duration?) in
            try await client.call(destination: name, path: "/slow", interface: "org.transportkit.Slow", member: "Wait", timeout: timeout)
        }
        let timedOut = await expectTransportError(.timedOut) { try await call(.milliseconds(200)) }
        #expect(timedOut?.message.contains("NoReply") == true || timedOut?.message.contains("Timeout") == true, "\(String(describing: timedOut))")

        let cancelled = Task { try await call(nil) }
        try await Task.sleep(for: .milliseconds(100))
        cancelled.cancel()
        await #expect(throws: CancellationError.self) { try await cancelled.value }

        let pending = Task { try await call(nil) }
        try await Task.sleep(for: .milliseconds(100))
        await client.close()
        do {
            _ = try await pending.value
            Issue.record("a call still waiting when the connection closed returned")
        } catch let error as TransportError {
            #expect(error.kind == .disconnected, "\(error)")
        }
        await export.remove()
        await server.close()
    }
}
