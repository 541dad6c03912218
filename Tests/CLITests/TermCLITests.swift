import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// `transportkit term` in a real terminal: a tmux server of its own runs a shell that saves
/// `stty -g`, runs term, saves its exit status and `stty -g` again. Keys go in with
/// `tmux send-keys`, the screen comes out with `capture-pane`; the device is a pty this test
/// holds the other side of.
@Suite("transportkit term in a terminal", .serialized)
struct TermCLITests {
    @Test func keysReachTheDeviceWithoutEnterAndTheMenuWorks() async throws {
        let device = try await Transport.connect(to: "pty://")
        let node = try #require(device.metadata.extra["peer"])
        let pane = try await TermPane(["term", "tty://\(node)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to reconnect+tty://\(node)"), "\(pane.screen())")
        await pane.type("ab")
        #expect(try await device.readFrame(.fixedLength(2), timeout: .seconds(10)) == Array("ab".utf8), "keys go without Enter")
        await pane.keys("C-c")
        #expect(try await device.readFrame(.fixedLength(1), timeout: .seconds(10)) == [0x03], "Ctrl-C is a byte for the device")
        await pane.keys("C-t", "C-t")
        #expect(try await device.readFrame(.fixedLength(1), timeout: .seconds(10)) == [0x14], "Ctrl-T Ctrl-T sends Ctrl-T")
        try await device.write("hello from the device\r\n")
        #expect(await pane.waitForScreen("hello from the device"), "\(pane.screen())")
        await pane.keys("C-t", "?")
        #expect(await pane.waitForScreen("Keys after Ctrl-T:"), "\(pane.screen())")
        #expect(pane.screen().contains("q  quit"))
        await pane.keys("C-t", "h")
        #expect(await pane.waitForScreen("Hex display on"), "\(pane.screen())")
        try await device.write("AB\n")
        #expect(await pane.waitForScreen("41 42 0a"), "\(pane.screen())")
        await pane.keys("C-t", "h", "C-t", "s")
        #expect(await pane.waitForScreen("Sent 4 bytes, received 26 bytes"), "\(pane.screen())")
        await pane.keys("C-t", "d")
        #expect(await pane.waitForScreen("DTR: \(node) has no modem control lines"), "a pty has none: \(pane.screen())")
        await pane.keys("C-t", "c")
        #expect(await pane.waitForScreen("Line: 9600 8N1"), "\(pane.screen())")
        await pane.keys("C-t", "x")
        #expect(await pane.waitForScreen("Ctrl-T x does nothing; Ctrl-T ? lists the keys"), "\(pane.screen())")
        await pane.keys("C-t", "q")
        #expect(await pane.exitStatus() == 0, "\(pane.screen()) \(pane.stderr)")
        #expect(pane.terminalRestored, "stty -g before: \(pane.before), after: \(pane.after)")
        try await device.close()
    }

    @Test func mapsTimestampsAndTheLogFile() async throws {
        let device = try await Transport.connect(to: "pty://")
        let node = try #require(device.metadata.extra["peer"])
        let log = temporaryPath("term.log")
        defer { unlink(log) }
        let pane = try await TermPane(["term", "--map", "OCRNL,INLCRNL", "--timestamps", "--log", log, "tty://\(node)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to"), "\(pane.screen())")
        await pane.keys("Enter")
        #expect(try await device.readFrame(.fixedLength(1), timeout: .seconds(10)) == [0x0A], "OCRNL: Enter is sent as LF")
        try await device.write("one\ntwo\n")
        #expect(await pane.waitForScreen("] two"), "\(pane.screen())")
        let lines = pane.screen().split(separator: "\n")
        #expect(lines.contains { $0.hasPrefix("[") && $0.hasSuffix("] one") }, "INLCRNL: each line starts at the left, with its time: \(lines)")
        await pane.keys("C-t", "f")
        #expect(await pane.waitForScreen("Logging to \(log) stopped"), "\(pane.screen())")
        try await device.write("not logged\n")
        #expect(await pane.waitForScreen("] not logged"), "\(pane.screen())")
        await pane.keys("C-t", "f")
        #expect(await pane.waitForScreen("Logging to \(log)\n"), "\(pane.screen())")
        try await device.write("three\n")
        #expect(await pane.waitForScreen("] three"), "\(pane.screen())")
        await pane.keys("C-t", "q")
        #expect(await pane.exitStatus() == 0, "\(pane.stderr)")
        let logged = try String(contentsOfFile: log, encoding: .utf8)
        #expect(logged.contains("] one\r\n") && logged.contains("] three\r\n"), "\(logged)")
        #expect(!logged.contains("not logged"), "\(logged)")
        #expect(pane.terminalRestored)
        try await device.close()
    }

    @Test func theLogFileCanBeNamedAtItsPrompt() async throws {
        let device = try await Transport.connect(to: "pty://")
        let node = try #require(device.metadata.extra["peer"])
        let log = temporaryPath("term-prompt-é.log")   // UTF-8 typed at the prompt
        defer { unlink(log) }
        let pane = try await TermPane(["term", "--no-reconnect", "tty://\(node)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to tty://"), "--no-reconnect: no reconnect+ layer: \(pane.screen())")
        await pane.keys("C-t", "f")
        #expect(await pane.waitForScreen("Log to which file?"), "\(pane.screen())")
        await pane.type(log + "ü")
        await pane.keys("BSpace", "Enter")
        #expect(await pane.waitForScreen("Logging to \(log)\n"), "Backspace took the ü back, both its bytes: \(pane.screen())")
        try await device.write("kept\r\n")
        #expect(await pane.waitForScreen("kept"))
        await pane.keys("C-t", "q")
        #expect(await pane.exitStatus() == 0)
        #expect((try? String(contentsOfFile: log, encoding: .utf8)) == "kept\r\n")
        #expect(pane.terminalRestored)
        try await device.close()
    }

    /// The device goes away (the pty's other side closes and its link goes), comes back as a new
    /// pty behind the same link, and term carries on; SIGTERM then ends it with the terminal as it was.
    @Test func aDeviceThatVanishesAndReturnsThenSIGTERM() async throws {
        let directory = temporaryPath("term-link")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let link = directory + "/ttyDEVICE"
        let before = try await Transport.connect(to: "pty://?link=\(link)")
        let pane = try await TermPane(["term", "tty://\(link)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to"), "\(pane.screen())")
        try await before.close()
        #expect(await pane.waitForScreen("Disconnected: serial port \(link) went away"), "\(pane.screen())")
        #expect(await pane.waitForScreen("Waiting for the device to be plugged in"), "\(pane.screen())")
        await pane.type("lost")
        #expect(await pane.waitForScreen("Not sent (disconnected): 4 bytes"), "\(pane.screen())")
        let after = try await Transport.connect(to: "pty://?link=\(link)")
        #expect(await pane.waitForScreen("Connected again (connection 2)", seconds: 20), "\(pane.screen())")
        await pane.type("back")
        #expect(try await after.readFrame(.fixedLength(4), timeout: .seconds(10)) == Array("back".utf8), "keys typed while down were dropped")
        try await after.write("from the new one\r\n")
        #expect(await pane.waitForScreen("from the new one"))
        pane.signal(SIGTERM)
        #expect(await pane.exitStatus() == 143, "\(pane.stderr)")
        #expect(pane.terminalRestored, "before: \(pane.before), after: \(pane.after)")
        try await after.close()
    }

    @Test func noReconnectEndsWhenTheDeviceGoes() async throws {
        let device = try await Transport.connect(to: "pty://")
        let node = try #require(device.metadata.extra["peer"])
        let pane = try await TermPane(["term", "--no-reconnect", "tty://\(node)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to"), "\(pane.screen())")
        try await device.close()
        #expect(await pane.exitStatus() == 1, "\(pane.screen())")
        #expect(await pane.capture().contains("Disconnected: serial port \(node) went away"), "\(pane.screen())")
        #expect(pane.stderr.contains("transportkit: serial port \(node) went away"), "\(pane.stderr)")
        #expect(pane.terminalRestored)
    }

    @Test func aDeviceNotThereYetIsWaitedFor() async throws {
        let directory = temporaryPath("term-wait")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let link = directory + "/ttyLATER"
        let pane = try await TermPane(["term", "tty://\(link)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Waiting for the device to be plugged in: no device at \(link)"), "\(pane.screen())")
        await pane.keys("C-t", "b")
        #expect(await pane.waitForScreen("Break: not connected yet"), "the menu works while waiting: \(pane.screen())")
        let device = try await Transport.connect(to: "pty://?link=\(link)")
        #expect(await pane.waitForScreen("Connected to", seconds: 15), "\(pane.screen())")
        await pane.type("hi")
        #expect(try await device.readFrame(.fixedLength(2), timeout: .seconds(10)) == Array("hi".utf8))
        await pane.keys("C-t", "q")
        #expect(await pane.exitStatus() == 0)
        #expect(pane.terminalRestored)
        try await device.close()
    }

    /// A crash after raw mode: the handler puts the terminal back before the process dies of the
    /// signal. (Swift's backtracer is off here: in a terminal it would wait for a key.)
    @Test func aCrashLeavesTheTerminalAsItWas() async throws {
        let device = try await Transport.connect(to: "pty://")
        let node = try #require(device.metadata.extra["peer"])
        let pane = try await TermPane(["term", "tty://\(node)"], environment: "SWIFT_BACKTRACE=enable=no")
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to"), "\(pane.screen())")
        pane.signal(SIGSEGV)
        #expect(await pane.exitStatus() == 128 + SIGSEGV)
        #expect(pane.terminalRestored, "before: \(pane.before), after: \(pane.after)")
        try await device.close()
    }

    /// A serial port on another machine, served by pyserial's RFC 2217 PortManager in front of its
    /// loop:// port: DTR, RTS, a break and the line settings go through a server no one here wrote.
    @Test func modemLinesAndABreakThroughAnRFC2217Server() async throws {
        let script = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("TransportKitTests/Peers/rfc2217_server.py").path
        try await withPeer([script, "loop://"]) { port in
            let pane = try await TermPane(["term", "rfc2217://127.0.0.1:\(port)?baud=19200"])
            defer { pane.close() }
            #expect(await pane.waitForScreen("Connected to reconnect+rfc2217://"), "\(pane.screen())")
            // The client knows DTR only once it set it: the first toggle raises it, the second drops it.
            await pane.keys("C-t", "d")
            #expect(await pane.waitForScreen("DTR on"), "\(pane.screen())")
            await pane.keys("C-t", "d")
            #expect(await pane.waitForScreen("DTR off"), "\(pane.screen())")
            await pane.keys("C-t", "R")
            #expect(await pane.waitForScreen("RTS pulsed (on for 100 ms)"), "\(pane.screen())")
            await pane.keys("C-t", "b")
            #expect(await pane.waitForScreen("Break sent (250 ms)"), "\(pane.screen())")
            await pane.keys("C-t", "c")
            #expect(await pane.waitForScreen("Line: 19200 8N1"), "\(pane.screen())")
            await pane.type("echo")
            #expect(await pane.waitForScreen("echo"), "loop:// sends it back: \(pane.screen())")
            await pane.keys("C-t", "q")
            #expect(await pane.exitStatus() == 0, "\(pane.stderr)")
            #expect(pane.terminalRestored)
        }
    }

    /// spy+ in term: with standard error elsewhere the trace goes there and the session works; with
    /// standard error on the terminal term draws on, it is refused before anything is opened.
    @Test func spyTracesToStandardErrorElsewhereAndIsRefusedOnTheTerminal() async throws {
        let device = try await Transport.connect(to: "pty://")
        let node = try #require(device.metadata.extra["peer"])
        let pane = try await TermPane(["term", "spy+tty://\(node)"])
        defer { pane.close() }
        #expect(await pane.waitForScreen("Connected to reconnect+spy+tty://"), "\(pane.screen())")
        await pane.type("hi")
        #expect(try await device.readFrame(.fixedLength(2), timeout: .seconds(10)) == Array("hi".utf8))
        await pane.keys("C-t", "q")
        #expect(await pane.exitStatus() == 0)
        #expect(pane.stderr.contains("TX") && pane.stderr.contains(" 68 ") && pane.stderr.contains(" 69 "), "the trace went to standard error's file: \(pane.stderr)")
        #expect(pane.terminalRestored)

        let refused = try await TermPane(["term", "spy+tty://\(node)"], stderrToFile: false)
        defer { refused.close() }
        #expect(await refused.exitStatus() == 64)
        #expect(await refused.waitForScreen("spy+ writes its trace to standard error, which is the terminal term draws on"), "\(refused.screen())")
        #expect(refused.terminalRestored)
        try await device.close()
    }

    /// The log file is opened as spy+ traces are: a symbolic link as its name is refused, before
    /// anything is connected, and what it points at is left alone.
    @Test func aLogFileThatIsALinkIsRefused() async throws {
        let target = temporaryPath("term-log-target")
        let link = temporaryPath("term-log-link")
        _ = FileManager.default.createFile(atPath: target, contents: Data("kept\n".utf8))
        try FileManager.default.createSymbolicLink(atPath: link, withDestinationPath: target)
        defer { unlink(link); unlink(target) }
        let pane = try await TermPane(["term", "--log", link, "tcp://127.0.0.1:9"])
        defer { pane.close() }
        #expect(await pane.exitStatus() == 1)
        #expect(pane.stderr.contains("the log file (--log) \(link) is a symbolic link"), "\(pane.stderr)")
        #expect((try? String(contentsOfFile: target, encoding: .utf8)) == "kept\n")
        #expect(pane.terminalRestored)
    }

    @Test func refusals() async throws {
        let piped = try await CLI.run(["term", "tcp://127.0.0.1:9"], stdin: Array("x".utf8))
        #expect(piped.status == 1)
        #expect(piped.stderr.contains("term needs a terminal on standard input"), "\(piped.stderr)")
        let map = try await CLI.run(["term", "--map", "ICRNL,NOPE", "tcp://127.0.0.1:9"])
        #expect(map.status == 64 && map.stderr.contains("--map has no map named NOPE"), "\(map.stderr)")
        let both = try await CLI.run(["term", "--no-reconnect", "reconnect+tcp://127.0.0.1:9"])
        #expect(both.status == 64 && both.stderr.contains("--no-reconnect and a reconnect+ URL say opposite things"), "\(both.stderr)")
    }
}

/// A tmux server of its own running `transportkit term` in a shell, with `stty -g` saved
/// before and after and term's exit status.
final class TermPane: Sendable {
    let directory: String
    private var socket: String { directory + "/tmux" }

    /// - Parameter stderrToFile: standard error to a file (`stderr`); otherwise the terminal.
    init(_ arguments: [String], environment: String = "", stderrToFile: Bool = true) async throws {
        directory = temporaryPath("term-pane")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let command = ([CLI.binary] + arguments).map(Self.quoted).joined(separator: " ")
        let script = "stty -g > \(directory)/before; echo $$ > \(directory)/shell; \(environment) \(command)\(stderrToFile ? " 2> \(directory)/stderr" : ""); "
            + "code=$?; stty -g > \(directory)/after; echo $code > \(directory)/status; exec sleep 600"
        let status = await runToEnd("/usr/bin/env", ["TERM=xterm", Self.tmux, "-S", socket, "-f", "/dev/null", "new-session", "-d", "-s", "t",
                                                      "-x", "160", "-y", "60", "/bin/sh", "-c", script])
        guard status == 0 else { throw TermPaneError(description: "tmux new-session exited with \(status)") }
    }

    static let tmux = "/usr/bin/tmux"

    static func quoted(_ word: String) -> String { "'" + word.replacingOccurrences(of: "'", with: "'\\''") + "'" }

    /// tmux key names (`C-t`, `Enter`, `q`), each one key.
    func keys(_ names: String...) async {
        let status = await runToEnd(Self.tmux, ["-S", socket, "send-keys", "-t", "t"] + names)
        #expect(status == 0, "tmux send-keys \(names) exited with \(status)")
    }

    /// Types `text` as it is.
    func type(_ text: String) async {
        let status = await runToEnd(Self.tmux, ["-S", socket, "send-keys", "-t", "t", "-l", text])
        #expect(status == 0, "tmux send-keys -l exited with \(status)")
    }

    /// The screen and its history as last captured, lines joined with `\n`.
    func screen() -> String { (try? String(contentsOfFile: directory + "/screen", encoding: .utf8)) ?? "" }

    /// Captures the screen (on a thread of runToEnd's, not the test's) and returns it.
    func capture() async -> String {
        let command = "\(Self.tmux) -S \(socket) capture-pane -p -J -S -500 -t t > \(directory)/screen.new && mv \(directory)/screen.new \(directory)/screen"
        guard await runToEnd("/bin/sh", ["-c", command]) == 0 else { return "" }
        return screen()
    }

    func waitForScreen(_ text: String, seconds: Double = 10) async -> Bool {
        let deadline = ContinuousClock.now + .seconds(seconds)
        while ContinuousClock.now < deadline {
            if await capture().contains(text) { return true }
            try? await Task.sleep(for: .milliseconds(50))
        }
        return false
    }

    private func read(_ name: String) -> String {
        ((try? String(contentsOfFile: directory + "/" + name, encoding: .utf8)) ?? "").trimmingCharacters(in: .newlines)
    }

    /// term's exit status, once the shell wrote it.
    func exitStatus(seconds: Double = 15) async -> Int32? {
        _ = await eventually(seconds, every: .milliseconds(50)) { !read("status").isEmpty }
        return Int32(read("status"))
    }

    var before: String { read("before") }
    var after: String { read("after") }
    var stderr: String { read("stderr") }
    var terminalRestored: Bool { !before.isEmpty && before == after }

    /// Sends `number` to term (the shell's child).
    func signal(_ number: Int32) {
        guard let shell = Int32(read("shell")) else { return }
        for entry in (try? FileManager.default.contentsOfDirectory(atPath: "/proc")) ?? [] {
            guard let pid = Int32(entry),
                  let stat = try? String(contentsOfFile: "/proc/\(entry)/stat", encoding: .utf8),
                  let close = stat.lastIndex(of: ")") else { continue }
            let fields = stat[stat.index(after: close)...].split(separator: " ")
            if fields.count > 1, Int32(fields[1]) == shell { kill(pid, number) }
        }
    }

    func close() {
        _ = "\(Self.tmux) -S \(socket) kill-server 2>/dev/null".withCString { system($0) }
        try? FileManager.default.removeItem(atPath: directory)
    }
}

struct TermPaneError: Error, CustomStringConvertible {
    var description: String
}
