import Foundation
import Glibc
import Synchronization
import SystemPackage
import TestSupport
import Testing
import TransportKit
@_spi(Plugins) import TransportKitCore

/// The qemu lab (Scripts/lab): these suites need its real USB and Bluetooth drivers and run only
/// there. The guest's init sets TRANSPORTKIT_LAB; the lab's runner fails when they were skipped.
enum Lab {
    static let isActive = getenv("TRANSPORTKIT_LAB") != nil

    /// The project folder, from this file's path (the guest sees the host's file system).
    static let projectRoot = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent().path
    static var labctl: String { projectRoot + "/Scripts/lab.d/labctl" }
    /// The `transportkit` binary built next to the test bundle.
    static var cli: String {
        URL(fileURLWithPath: CommandLine.arguments[0]).deletingLastPathComponent().appendingPathComponent("transportkit").path
    }

    struct ProgramFailed: Error, CustomStringConvertible {
        var command: [String]
        var status: Int32
        var stderr: String
        var description: String { "\(command.joined(separator: " ")) exited with \(status): \(stderr)" }
    }

    struct Output: Sendable {
        var status: Int32
        var stdout: String
        var stderr: String
    }

    /// Runs a program to completion. posix_spawn and waitpid on a thread of its own, never on the
    /// cooperative pool; not Foundation's Process, whose waitUntilExit spun forever in the guest
    /// when the test bundle runs outside `swift test` (dispatch_main holds SIGCHLD there).
    static func run(_ executable: String, _ arguments: [String]) async throws -> Output {
        try await onThread { Result { try runBlocking(executable, arguments) } }.get()
    }

    /// Runs blocking work (a child process, a device node's reads) on a thread of its own, off the
    /// cooperative pool.
    static func onThread<Value: Sendable>(_ body: @escaping @Sendable () -> Value) async -> Value {
        await withCheckedContinuation { continuation in
            Thread { continuation.resume(returning: body()) }.start()
        }
    }

    private static func runBlocking(_ executable: String, _ arguments: [String]) throws -> Output {
        var outPipe: [Int32] = [-1, -1]
        var errPipe: [Int32] = [-1, -1]
        // pipe2 is not imported (a GNU extension); the lab suites run one test at a time, so no
        // other spawn can inherit these before FD_CLOEXEC is set.
        guard pipe(&outPipe) == 0 else { throw TransportError(.io, "pipe", errno: Errno(rawValue: errno), syscall: "pipe") }
        guard pipe(&errPipe) == 0 else {
            close(outPipe[0]); close(outPipe[1])
            throw TransportError(.io, "pipe", errno: Errno(rawValue: errno), syscall: "pipe")
        }
        for fd in outPipe + errPipe { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_adddup2(&actions, outPipe[1], 1)
        posix_spawn_file_actions_adddup2(&actions, errPipe[1], 2)
        let argv = ([executable] + arguments).map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let spawned = posix_spawn(&pid, executable, &actions, nil, argv, environ)
        close(outPipe[1])
        close(errPipe[1])
        guard spawned == 0 else {
            close(outPipe[0]); close(errPipe[0])
            throw TransportError(.io, "posix_spawn \(executable)", errno: Errno(rawValue: spawned), syscall: "posix_spawn")
        }
        let stderr = DataBox()
        let stderrDone = DispatchSemaphore(value: 0)
        let errRead = errPipe[0]
        Thread {
            stderr.set(readToEnd(errRead))
            stderrDone.signal()
        }.start()
        let stdout = readToEnd(outPipe[0])
        stderrDone.wait()
        close(outPipe[0])
        close(errPipe[0])
        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
        let exitStatus = (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f)
        return Output(status: exitStatus, stdout: String(decoding: stdout, as: UTF8.self),
                      stderr: String(decoding: stderr.get(), as: UTF8.self))
    }

    /// A peer program that runs beside a test (a python GATT server, bluez-tools' bt-agent):
    /// standard input from `input`, standard output and error into one file that `output` reads.
    /// posix_spawn, as `run`; `stop` ends it (SIGTERM, then SIGKILL) and reaps it off the pool.
    final class Background: Sendable {
        let pid: pid_t
        let log: String
        private let stopped = Locked(false)

        init(_ executable: String, _ arguments: [String], input: String = "", environment: [String: String] = [:]) throws {
            log = temporaryPath("peer.out")
            let inputPath = temporaryPath("peer.in")
            guard FileManager.default.createFile(atPath: inputPath, contents: Data(input.utf8)) else {
                throw TransportError(.io, "cannot write \(inputPath)")
            }
            var actions = posix_spawn_file_actions_t()
            posix_spawn_file_actions_init(&actions)
            defer { posix_spawn_file_actions_destroy(&actions) }
            posix_spawn_file_actions_addopen(&actions, 0, inputPath, O_RDONLY, 0)
            posix_spawn_file_actions_addopen(&actions, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0o600)
            posix_spawn_file_actions_adddup2(&actions, 1, 2)
            let argv = ([executable] + arguments).map { strdup($0) } + [nil]
            defer { argv.forEach { free($0) } }
            var environment = environment
            for (key, value) in ProcessInfo.processInfo.environment where environment[key] == nil { environment[key] = value }
            let envp = environment.map { strdup("\($0.key)=\($0.value)") } + [nil]
            defer { envp.forEach { free($0) } }
            var pid: pid_t = 0
            let spawned = posix_spawn(&pid, executable, &actions, nil, argv, envp)
            guard spawned == 0 else {
                throw TransportError(.io, "posix_spawn \(executable)", errno: Errno(rawValue: spawned), syscall: "posix_spawn")
            }
            self.pid = pid
        }

        /// What it printed so far.
        var output: String { (try? String(contentsOfFile: log, encoding: .utf8)) ?? "" }

        /// Ends it; once (a reaped pid may be another process's).
        func stop() async {
            guard !stopped.withLock({ stopped in defer { stopped = true }; return stopped }) else { return }
            let pid = pid
            _ = kill(pid, SIGTERM)
            await Lab.onThread {
                var status: Int32 = 0
                for _ in 0..<40 {
                    if waitpid(pid, &status, WNOHANG) != 0 { return }
                    usleep(50_000)
                }
                _ = kill(pid, SIGKILL)
                while waitpid(pid, &status, 0) < 0 && errno == EINTR {}
            }
        }
    }

    private static func readToEnd(_ fd: Int32) -> [UInt8] {
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while true {
            let count = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            if count < 0 && errno == EINTR { continue }
            guard count > 0 else { return bytes }
            bytes += buffer[..<count]
        }
    }

    private final class DataBox: Sendable {
        private let data = Locked<[UInt8]>([])
        func set(_ value: [UInt8]) { data.withLock { $0 = value } }
        func get() -> [UInt8] { data.withLock { $0 } }
    }

    /// Runs `Scripts/lab.d/labctl` and returns its standard output; throws when it fails.
    @discardableResult
    static func ctl(_ arguments: String...) async throws -> String {
        let result = try await run(labctl, arguments)
        guard result.status == 0 else { throw ProgramFailed(command: ["labctl"] + arguments, status: result.status, stderr: result.stderr) }
        return result.stdout
    }

    /// Reads until the connection ends: every byte delivered, and the error it ended with (nil
    /// for a clean end of stream).
    static func readToEnd(_ connection: Connection) async -> (bytes: [UInt8], ending: TransportError?) {
        var bytes: [UInt8] = []
        do {
            while let chunk = try await connection.read() { bytes += chunk }
            return (bytes, nil)
        } catch {
            return (bytes, error as? TransportError)
        }
    }
}

/// The lab's USB CDC-ACM gadget (configfs function "acm" on the dummy_hcd controller): the host side
/// is a real /dev/ttyACM* driven by cdc_acm, the gadget side is /dev/ttyGS*.
enum Gadget {
    static let vendorID = "0525"
    static let productID = "a4a7"
    static let serial = "TKLAB0001"
    static let byID = "/dev/serial/by-id/usb-TransportKit_Lab_Serial_TKLAB0001-if00"
    static let selector = "tty://usb/0525:a4a7?serial=TKLAB0001"

    /// Plugs the gadget in and waits for both tty nodes; returns (host node, gadget node).
    static func plug() async throws -> (host: String, gadget: String) {
        let words = try await Lab.ctl("usb-serial", "plug", serial).split(whereSeparator: \.isWhitespace).map(String.init)
        guard words.count == 2 else { throw Lab.ProgramFailed(command: ["labctl", "usb-serial", "plug"], status: 0, stderr: "unexpected output \(words)") }
        return (words[0], words[1])
    }

    /// Unplugs it and waits until the host side is gone.
    static func unplug() async throws { try await Lab.ctl("usb-serial", "unplug") }

    /// Binds the configured gadget to the controller or unbinds it, as labctl does, without a
    /// child process: one write to configfs (for the replug cycles). The defaults are the CDC-ACM
    /// gadget; the Loopback gadget is `tkloop` on `dummy_udc.1`.
    static func setBound(_ bound: Bool, gadget: String = "tkacm", controller: String = "dummy_udc.0") throws {
        let udc = "/sys/kernel/config/usb_gadget/\(gadget)/UDC"
        let fd = open(udc, O_WRONLY | O_CLOEXEC)
        guard fd >= 0 else { throw TransportError(.io, "open \(udc)", errno: Errno(rawValue: errno), syscall: "open") }
        defer { close(fd) }
        let text = Array((bound ? controller + "\n" : "\n").utf8)
        let written = text.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        guard written == text.count else { throw TransportError(.io, "write \(udc)", errno: Errno(rawValue: errno), syscall: "write") }
    }

    /// Whether an event is about the gadget's host-side tty (the USB device's own events, usb://,
    /// carry the same ids).
    static func isOurs(_ event: DeviceEvent) -> Bool {
        event.device.scheme == "tty" && event.device.serialNumber == serial && event.device.vendorId == vendorID && event.device.productId == productID
    }
}

/// Collects hot-plug events from the registry in a task of its own.
final class EventCollector: Sendable {
    private let state = Locked<(events: [DeviceEvent], error: String?)>(([], nil))
    private let task: Locked<Task<Void, Never>?> = Locked(nil)

    /// Subscribes before returning, so nothing that happens afterwards is missed.
    init(includeAll: Bool = false) async {
        let stream = await Transport.registry.deviceEvents(includeAll: includeAll)
        let consumer = Task { [self] in
            do {
                for try await event in stream { state.withLock { $0.events.append(event) } }
            } catch {
                state.withLock { $0.error = "\(error)" }
            }
        }
        task.withLock { $0 = consumer }
    }

    var events: [DeviceEvent] { state.withLock { $0.events } }
    var failure: String? { state.withLock { $0.error } }

    /// Waits up to `seconds` for an event at index `from` or later that matches; returns its index.
    func waitFor(from: Int, seconds: Double, _ matching: (DeviceEvent) -> Bool) async -> Int? {
        var found: Int?
        _ = await eventually(seconds) {
            let events = self.events
            found = events.indices.first { $0 >= from && matching(events[$0]) }
            return found != nil
        }
        return found
    }

    func stop() { task.withLock { $0?.cancel() } }
}
