import Foundation
import Glibc
import SystemPackage
import Testing
import TransportKit

/// `list`, `watch` and serial `connect` through the real binary. Events come from the real kernel:
/// as root, writing "change" to a device's uevent file makes the kernel announce it.
@Suite("transportkit list / watch / connect tty://")
struct DeviceCLITests {
    static let ptmxUevent = "/sys/class/tty/ptmx/uevent"

    @Test func listJSONHasCamelCaseDeviceObjects() async throws {
        let result = try await CLI.run(["list", "--json", "--all"])
        #expect(result.status == 0, "\(result.stderr)")
        let objects = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout)) as? [[String: Any]])
        let ptmx = try #require(objects.first { $0["devnode"] as? String == "/dev/ptmx" }, "ptmx is listed with --all")
        #expect(ptmx["url"] as? String == "tty:///dev/ptmx")
        #expect(ptmx["scheme"] as? String == "tty")
        #expect((ptmx["sysPath"] as? String)?.hasPrefix("/sys/devices/") == true)
        #expect(ptmx["links"] is [Any])
        // Without --all, virtual devices such as ptmx are left out.
        let real = try await CLI.run(["list", "--json"])
        let realObjects = try #require(try JSONSerialization.jsonObject(with: Data(real.stdout)) as? [[String: Any]])
        #expect(!realObjects.contains { $0["devnode"] as? String == "/dev/ptmx" })
    }

    @Test func listTextIsATable() async throws {
        let result = try await CLI.run(["list", "--all"])
        #expect(result.status == 0)
        let lines = result.text.split(separator: "\n")
        #expect(lines.first?.hasPrefix("DEVICE") == true && lines.first?.contains("URL") == true)
        #expect(lines.contains { $0.hasPrefix("/dev/ptmx ") && $0.hasSuffix("tty:///dev/ptmx") })
    }

    @Test("watch --json prints one object per event", .enabled(if: access(ptmxUevent, W_OK) == 0, "needs root to trigger a uevent"))
    func watchJSON() async throws {
        let output = try await watch(["watch", "--json", "--all"])
        let line = try #require(output.split(separator: "\n").first { $0.contains("/dev/ptmx") })
        let object = try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
        #expect(object["event"] as? String == "changed")
        let device = try #require(object["device"] as? [String: Any])
        #expect(device["devnode"] as? String == "/dev/ptmx" && device["url"] as? String == "tty:///dev/ptmx")
    }

    @Test("watch prints a readable line per event", .enabled(if: access(ptmxUevent, W_OK) == 0, "needs root to trigger a uevent"))
    func watchText() async throws {
        let output = try await watch(["watch", "--all"])
        #expect(output.split(separator: "\n").contains { $0.hasPrefix("changed /dev/ptmx") && $0.hasSuffix("tty:///dev/ptmx") }, "\(output)")
    }

    /// Starts `watch`, waits until it is subscribed, triggers a change uevent on ptmx, collects output.
    private func watch(_ arguments: [String]) async throws -> String {
        let running = try CLI.Running(arguments)
        let deadline = Date().addingTimeInterval(10)
        while !running.stderrLines.contains("watching"), Date() < deadline { try await Task.sleep(for: .milliseconds(20)) }
        #expect(running.stderrLines.contains("watching"))
        try "change".write(toFile: Self.ptmxUevent, atomically: false, encoding: .utf8)
        try await Task.sleep(for: .milliseconds(500))
        running.process.terminate()
        return (await running.wait()).text
    }

    @Test func connectTTYWithLineOptionsRelaysBothWays() async throws {
        let pty = try RawPTY()
        defer { pty.close() }
        let running = try CLI.Running(["connect", "--linger", "1", "tty://\(pty.path)?baud=57600&stopBits=2&flowControl=xonxoff&exclusive=true"])
        running.send(Array("hello".utf8))
        #expect(await pty.read(count: 5) == Array("hello".utf8))
        pty.write("world")
        try await Task.sleep(for: .milliseconds(200))
        running.endInput()
        let result = await running.wait()
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.text == "world")
    }

    @Test(.enabled(if: getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/sbin/runuser"),
                   "needs root to run the CLI as an unprivileged user"))
    func permissionDeniedOnATTYNamesGroupModeAndFix() async throws {
        let pty = try RawPTY()
        defer { pty.close() }
        // Give the node the usual shape of a serial port: root:tty (or dialout), mode 0660.
        let tty = try #require(getgrnam("tty")?.pointee.gr_gid)
        #expect(chown(pty.path, 0, tty) == 0 && chmod(pty.path, 0o660) == 0)
        let running = try CLI.Running(["connect", "tty://\(pty.path)"], launchAs: "nobody")
        running.endInput()
        let result = await running.wait()
        #expect(result.status != 0)
        #expect(result.stderr.contains("permission denied opening \(pty.path)"), "\(result.stderr)")
        #expect(result.stderr.contains("owned by root:tty, mode crw-rw----"), "\(result.stderr)")
        #expect(result.stderr.contains("is not in group tty"), "\(result.stderr)")
        #expect(result.stderr.contains("usermod -aG tty"))
        #expect(result.stderr.contains("EACCES"))
    }
}

/// A pty pair from openpty(3); the test keeps the master and plays the device.
struct RawPTY {
    let master: Int32
    let path: String

    init() throws {
        var master: Int32 = -1
        var slave: Int32 = -1
        guard openpty(&master, &slave, nil, nil, nil) == 0 else { throw TransportError.posix("openpty", errno: Errno(rawValue: errno), what: "test pty") }
        _ = fcntl(master, F_SETFD, FD_CLOEXEC)
        var raw = termios()
        tcgetattr(master, &raw)
        cfmakeraw(&raw)
        tcsetattr(master, TCSANOW, &raw)
        path = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(slave)")) ?? ""
        Glibc.close(slave)
        self.master = master
    }

    func write(_ text: String) {
        let bytes = Array(text.utf8)
        _ = bytes.withUnsafeBytes { Glibc.write(master, $0.baseAddress, $0.count) }
    }

    func read(count: Int) async -> [UInt8] {
        let fd = master
        return await withCheckedContinuation { continuation in
            Thread {
                var result: [UInt8] = []
                var buffer = [UInt8](repeating: 0, count: 256)
                let deadline = Date().addingTimeInterval(5)
                while result.count < count, Date() < deadline {
                    var poller = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
                    guard poll(&poller, 1, 50) > 0 else { continue }
                    let got = buffer.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
                    if got < 0 && errno == EIO {
                        // Nobody has the slave open yet (the CLI is still starting): a master reads EIO.
                        usleep(20_000)
                        continue
                    }
                    if got <= 0 { break }
                    result += buffer[..<got]
                }
                continuation.resume(returning: result)
            }.start()
        }
    }

    func close() { Glibc.close(master) }
}
