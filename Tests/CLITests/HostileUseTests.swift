import Foundation
import Glibc
import Synchronization
import TestSupport
import Testing
import TransportKit
@_spi(Plugins) import TransportKitCore

/// The tool under the use issue 13 describes: standard input left open while the peer goes away,
/// standard output closed early, signals, a bridge under load, and malformed input of every kind.
@Suite("transportkit under real and hostile use")
struct HostileUseTests {
    // MARK: - The peer goes away while standard input stays open

    @Test func connectEndsAfterThePeersFINWithStdinOpen() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let server = Task {
            let connection = try #require(try await listener.accept())
            try await connection.write("bye\n")
            try await connection.close()
        }
        let running = try CLI.Running(["connect", "tcp://127.0.0.1:\(listener.url.port ?? 0)"])   // stdin stays open
        let result = await running.wait(timeout: 15)
        #expect(result.status == 0, "the relay ends after the peer's close without a key press: \(result.stderr)")
        #expect(result.text == "bye\n")
        try await server.value
        try await listener.close()
    }

    @Test func connectEndsAfterAUnixPeersCloseWithStdinOpen() async throws {
        let path = temporaryPath("peer.sock")
        let listener = try await Transport.listen(on: "unix://\(path)")
        let server = Task {
            let connection = try #require(try await listener.accept())
            try await connection.write("bye\n")
            try await connection.close()
        }
        let running = try CLI.Running(["connect", "unix://\(path)"])
        let result = await running.wait(timeout: 15)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.text == "bye\n")
        try await server.value
        try await listener.close()
    }

    @Test func connectFailsAtOnceWhenTheSerialDeviceVanishes() async throws {
        let pty = try PTY()
        let running = try CLI.Running(["connect", "tty://\(pty.peerPath)"])
        #expect(await pty.waitUntilOpened(by: running.process.processIdentifier), "the tool opened \(pty.peerPath)")
        pty.writeMaster(Array("data\n".utf8))
        try await Task.sleep(for: .milliseconds(300))
        pty.closeMaster()   // the device goes away; standard input stays open
        let result = await running.wait(timeout: 15)
        #expect(result.status == 1, "\(result.stderr)")
        #expect(result.text == "data\n", "bytes that arrived before are delivered")
        #expect(result.stderr.contains("went away"), "\(result.stderr)")
    }

    // MARK: - Standard output closes

    @Test func connectStopsWhenStandardOutputCloses() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let server = Task { () -> Bool in
            let connection = try #require(try await listener.accept())
            try await connection.write(Array(repeating: UInt8(ascii: "x"), count: 100))
            // Then silent: the tool must notice its reader left without a write failing.
            let end = try await connection.read(timeout: .seconds(15))
            try await connection.close()
            return end == nil
        }
        let running = try CLI.Running(["connect", "tcp://127.0.0.1:\(listener.url.port ?? 0)"], closeStdoutAfter: 10)
        let result = await running.wait(timeout: 15)
        #expect(result.status == 0, "a closed standard output ends the relay quietly: \(result.stderr)")
        #expect(result.stderr.isEmpty, "\(result.stderr)")
        #expect(try await server.value, "the tool closed the connection")
        try await listener.close()
    }

    /// Issue 30, item 4: a relay into a pipe read slowly waits for room once per 4 KiB piece, all
    /// on one thread (it was a new thread per wait: a clone3 per piece).
    @Test func aSlowlyReadStandardOutputIsWaitedForWithoutAThreadPerWait() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let streaming = Task {
            guard let connection = try await listener.accept() else { return }
            let chunk = [UInt8](repeating: UInt8(ascii: "y"), count: 65536)
            while (try? await connection.write(chunk)) != nil {}
            try? await connection.close()
        }
        // 4 KiB every 10 ms: the tool's standard output is full nearly all the time.
        let script = "\"$0\" connect \"$1\" | python3 -c 'import os, time\nwhile os.read(0, 4096): time.sleep(0.01)'"
        let running = try CLI.Running([], program: ["/bin/bash", "-c", script, CLI.binary, "tcp://127.0.0.1:\(listener.url.port ?? 0)"])
        var tool: Int32?
        for _ in 0..<500 where tool == nil {
            tool = Self.child(of: running.process.processIdentifier, named: "transportkit")
            try await Task.sleep(for: .milliseconds(10))
        }
        let pid = try #require(tool, "bash started no transportkit")
        try await Task.sleep(for: .seconds(1))   // the relay's own threads are up by now
        let first = Self.threadIDs(of: pid)
        var seen = first
        for _ in 0..<30 {
            try await Task.sleep(for: .milliseconds(50))
            seen.formUnion(Self.threadIDs(of: pid))
        }
        #expect(!first.isEmpty)
        #expect(seen.subtracting(first).count < 10, "threads that came and went while standard output was read slowly: \(seen.subtracting(first).count)")
        kill(pid, SIGTERM)
        let result = await running.wait(timeout: 15)
        #expect(!running.isRunning, "the pipeline ended after the tool: \(result.stderr)")
        streaming.cancel()
        try await listener.close()
    }

    /// The process whose parent is `parent` and whose command is `name` (/proc/PID/stat).
    static func child(of parent: Int32, named name: String) -> Int32? {
        for entry in (try? FileManager.default.contentsOfDirectory(atPath: "/proc")) ?? [] {
            guard let pid = Int32(entry), let stat = try? String(contentsOfFile: "/proc/\(entry)/stat", encoding: .utf8),
                  let open = stat.firstIndex(of: "("), let close = stat.lastIndex(of: ")") else { continue }
            let fields = stat[stat.index(after: close)...].split(separator: " ")
            if fields.count > 1, Int32(fields[1]) == parent, stat[stat.index(after: open)..<close] == name { return pid }
        }
        return nil
    }

    /// The thread ids of `pid` now (/proc/PID/task).
    static func threadIDs(of pid: Int32) -> Set<String> {
        Set((try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/task")) ?? [])
    }

    @Test func anUnreadableStandardInputIsAnError() async throws {
        let running = try CLI.Running(["connect", "loop://"], stdinPath: "/tmp")
        let result = await running.wait(timeout: 15)
        #expect(result.status == 1)
        #expect(result.stdout.isEmpty)
        #expect(result.stderr.contains("standard input cannot be read"), "\(result.stderr)")
        #expect(result.stderr.contains("EISDIR"), "\(result.stderr)")
    }

    // MARK: - Signals

    @Test func sigtermRemovesThePtyLinkAndExits143() async throws {
        let link = temporaryPath("ttyFAKE")
        let running = try CLI.Running(["connect", "pty://?link=\(link)"])
        #expect(await eventually(10) { FileManager.default.destinationOfSymbolicLinkAtPathOrNil(link) != nil }, "the link appears")
        running.signal(SIGTERM)
        let result = await running.wait(timeout: 15)
        #expect(result.status == 143, "\(result.stderr)")
        #expect(FileManager.default.destinationOfSymbolicLinkAtPathOrNil(link) == nil, "the link is removed")
        // The same command works again at once.
        let again = try CLI.Running(["connect", "pty://?link=\(link)"])
        #expect(await eventually(10) { FileManager.default.destinationOfSymbolicLinkAtPathOrNil(link) != nil })
        again.signal(SIGINT)
        #expect(await again.wait(timeout: 15).status == 130)
    }

    @Test func aPtyWithoutALinkNamesItsNodeOnStderr() async throws {
        let running = try CLI.Running(["connect", "pty://"])
        #expect(await eventually(10) { running.stderrLines.contains { $0.hasPrefix("pty: /dev/pts/") } }, "\(running.stderrLines)")
        let node = running.stderrLines.first { $0.hasPrefix("pty: ") }.map { String($0.dropFirst(5)) } ?? ""
        #expect(FileManager.default.fileExists(atPath: node), "\(node)")
        running.signal(SIGINT)
        #expect(await running.wait(timeout: 15).status == 130)
    }

    @Test func sigintRestoresTheTtysSettings() async throws {
        let pty = try PTY()
        let before = try pty.peerSettings()
        let running = try CLI.Running(["connect", "tty://\(pty.peerPath)?baud=115200"])
        #expect(await pty.waitUntilOpened(by: running.process.processIdentifier))
        #expect(await eventually(10) { (try? pty.peerSettings()) != before }, "the tool changed the settings")
        running.signal(SIGINT)
        let result = await running.wait(timeout: 15)
        #expect(result.status == 130, "\(result.stderr)")
        #expect(try pty.peerSettings() == before, "the original settings are back")
    }

    @Test func aBusyPortNamesTheProcessHoldingIt() async throws {
        let pty = try PTY()
        let holder = try CLI.Running(["connect", "tty://\(pty.peerPath)"])
        #expect(await pty.waitUntilOpened(by: holder.process.processIdentifier))
        try await Task.sleep(for: .milliseconds(300))   // past the flock
        let second = try await CLI.run(["connect", "tty://\(pty.peerPath)"])
        #expect(second.status == 1)
        #expect(second.stderr.contains("is busy"), "\(second.stderr)")
        #expect(second.stderr.contains("process \(holder.process.processIdentifier) (transportkit)"), "\(second.stderr)")
        holder.signal(SIGTERM)
        #expect(await holder.wait(timeout: 15).status == 143)
    }

    @Test func sighupEndsABridgeAndRemovesItsSocketFile() async throws {
        let path = temporaryPath("hup.sock")
        let bridge = try CLI.Running(["bridge", "--listen", "unix://\(path)", "loop://"])
        #expect(await eventually(10) { bridge.stderrLines.contains { $0.hasPrefix("listening") } })
        #expect(FileManager.default.fileExists(atPath: path))
        bridge.signal(SIGHUP)
        let result = await bridge.wait(timeout: 15)
        #expect(result.status == 129, "\(result.stderr)")
        #expect(!FileManager.default.fileExists(atPath: path), "the socket file is removed")
    }

    @Test func aSignalIgnoredAtStartStaysIgnored() async throws {
        // nohup starts the tool with SIGHUP ignored: a logout must not end it.
        let path = temporaryPath("nohup.sock")
        let bridge = try CLI.Running(["bridge", "--listen", "unix://\(path)", "loop://"], wrapper: "/usr/bin/nohup")
        #expect(await eventually(10) { FileManager.default.fileExists(atPath: path) })
        bridge.signal(SIGHUP)
        try await Task.sleep(for: .milliseconds(500))
        #expect(bridge.isRunning, "SIGHUP stays ignored under nohup")
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
        #expect(!FileManager.default.fileExists(atPath: path))
    }

    @Test func aClosedStandardErrorDoesNotCrashTheBridge() async throws {
        let path = temporaryPath("noerr.sock")
        // Standard error is closed after the first status line ("listening …").
        let bridge = try CLI.Running(["bridge", "--listen", "unix://\(path)", "loop://"], closeStderrAfter: 1)
        #expect(await eventually(10) { FileManager.default.fileExists(atPath: path) })
        try await Task.sleep(for: .milliseconds(200))
        for _ in 0..<3 {   // each client prints status lines into the closed pipe
            let client = try await Transport.connect(to: "unix://\(path)")
            try await client.write("x")
            try await client.closeWrite()
            _ = try await client.read(timeout: .seconds(10))
            try await client.close()
        }
        #expect(bridge.isRunning)
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
        #expect(!FileManager.default.fileExists(atPath: path), "cleaned up, not crashed")
    }

    @Test func aTargetThatStopsReadingDoesNotHoldUpTheExit() async throws {
        // A target that accepts and never reads: the bridge's writes to it stall.
        let sink = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let held = Task { try await sink.accept() }
        let path = temporaryPath("stall.sock")
        let bridge = try CLI.Running(["bridge", "--listen", "unix://\(path)", "tcp://127.0.0.1:\(sink.url.port ?? 0)"])
        // The status line, not the file: the file exists from bind(2), a moment before listen(2)
        // (on CI the bridge was once preempted in between, and the connect below refused).
        #expect(await eventually(10) { bridge.stderrLines.contains { $0.hasPrefix("listening") } })
        let client = try await Transport.connect(to: "unix://\(path)")
        let feeding = Task { try await client.write([UInt8](repeating: 2, count: 64 << 20)) }
        try await Task.sleep(for: .milliseconds(500))
        bridge.signal(SIGTERM)
        let result = await bridge.wait(timeout: 15)
        #expect(result.status == 143)
        #expect(!FileManager.default.fileExists(atPath: path), "the exit closed up (not the 3-second emergency exit)")
        feeding.cancel()
        try? await client.close()
        if let connection = try? await held.value { connection.abort() }
        try await sink.close()
    }

    @Test(.enabled(if: getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/sbin/runuser"),
                   "needs root to run the CLI as an unprivileged user"))
    func aLinkWhereTheUserMayNotWriteSaysSo() async throws {
        let running = try CLI.Running(["connect", "pty://?link=/root/tk-link-\(getpid())"], launchAs: "nobody")
        running.endInput()
        let result = await running.wait(timeout: 15)
        #expect(result.status == 1)
        #expect(result.stderr.contains("this user may not create files in /root"), "\(result.stderr)")
        #expect(result.stderr.contains("EACCES"), "\(result.stderr)")
    }

    // MARK: - Unix listeners

    @Test func aUnixBridgeRelaysClientsThatSendAndCloseAtOnce() async throws {
        let (target, received) = try await Self.countingTarget()
        let path = temporaryPath("burst.sock")
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "unix://\(path)", "tcp://127.0.0.1:\(target.url.port ?? 0)"])
        #expect(await eventually(10) { bridge.stderrLines.contains { $0.contains("\"listening\"") } })
        let payload = Array(repeating: UInt8(7), count: 65536)
        for round in 1...20 {
            let client = try await Transport.connect(to: "unix://\(path)")
            try await client.write(payload)
            try await client.close()   // at once
            #expect(await eventually(10) { received.withLock { $0.count } == round }, "client \(round) was relayed")
        }
        #expect(received.withLock { $0 } == Array(repeating: 65536, count: 20), "every byte of every client arrived")
        bridge.signal(SIGTERM)
        let result = await bridge.wait(timeout: 15)
        #expect(result.status == 143)
        #expect(!result.stderr.contains("\"failed\""), "\(result.stderr)")
        try await target.close()
    }

    @Test func aOneShotUnixBridgeRelaysAClientThatClosesAtOnce() async throws {
        let (target, received) = try await Self.countingTarget()
        for round in 1...10 {
            let path = temporaryPath("once\(round).sock")
            let bridge = try CLI.Running(["bridge", "--once", "--json", "--listen", "unix://\(path)", "tcp://127.0.0.1:\(target.url.port ?? 0)"])
            #expect(await eventually(10) { bridge.stderrLines.contains { $0.contains("\"listening\"") } })
            let client = try await Transport.connect(to: "unix://\(path)")
            try await client.write(Array(repeating: UInt8(1), count: 65536))
            try await client.close()
            let result = await bridge.wait(timeout: 15)
            #expect(result.status == 0, "round \(round): \(result.stderr)")
        }
        #expect(await eventually(10) { received.withLock { $0.count } == 10 })
        #expect(received.withLock { $0 } == Array(repeating: 65536, count: 10))
        try await target.close()
    }

    @Test func aSecondUnixListenerFailsAndTheFirstKeepsServing() async throws {
        let path = temporaryPath("shared.sock")
        let first = try CLI.Running(["bridge", "--listen", "unix://\(path)", "loop://"])
        #expect(await eventually(10) { first.stderrLines.contains { $0.hasPrefix("listening") } })
        let second = try await CLI.run(["bridge", "--listen", "unix://\(path)", "loop://"])
        #expect(second.status == 1)
        #expect(second.stderr.contains("process \(first.process.processIdentifier) (transportkit) is listening on \(path)"), "\(second.stderr)")
        #expect(second.stderr.contains("EADDRINUSE"))
        #expect(!first.stderrLines.contains { $0.hasPrefix("accepted") }, "the second listener did not probe the first")
        // The first still serves: loop:// sends back what it gets.
        let client = try await Transport.connect(to: "unix://\(path)")
        try await client.write("ping")
        try await client.closeWrite()
        var echoed: [UInt8] = []
        while let chunk = try await client.read(timeout: .seconds(10)) { echoed += chunk }
        #expect(echoed == Array("ping".utf8))
        try await client.close()
        first.signal(SIGINT)
        #expect(await first.wait(timeout: 15).status == 130)
        #expect(!FileManager.default.fileExists(atPath: path))
    }

    // MARK: - A bridge that keeps listening

    @Test func aBridgeCarries200SequentialAnd50ConcurrentClients() async throws {
        let echo = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let echoTask = Task {
            try await withThrowingDiscardingTaskGroup { group in
                while let connection = try await echo.accept() {
                    group.addTask {
                        while let chunk = try await connection.readBuffer() { try await connection.write(chunk) }
                        try await connection.close()
                    }
                }
            }
        }
        // --linger 30: each client half-closes after its MiB; the echo of the rest must not be cut
        // short by the default 0.5 s on a slow machine (or under ThreadSanitizer).
        let bridge = try CLI.Running(["bridge", "--json", "--linger", "30", "--listen", "tcp://127.0.0.1:0", "tcp://127.0.0.1:\(echo.url.port ?? 0)"])
        let url = try #require(await Self.listeningURL(of: bridge))
        var payload = [UInt8](repeating: 0, count: 1 << 20)
        for index in payload.indices { payload[index] = UInt8(truncatingIfNeeded: index &* 2_654_435_761 >> 13) }
        let sent = payload
        @Sendable func client() async throws -> Bool {
            let connection = try await Transport.connect(to: url)
            async let echoed: [UInt8] = {
                var all: [UInt8] = []
                all.reserveCapacity(sent.count)
                while let chunk = try await connection.read(timeout: .seconds(30)) { all += chunk }
                return all
            }()
            try await connection.write(sent)
            try await connection.closeWrite()
            // memcmp: the generic == of a debug build spends seconds of the pool on 250 MiB.
            let got = try await echoed
            let ok = got.count == sent.count && got.withUnsafeBytes { a in
                sent.withUnsafeBytes { b in
                    guard let x = a.baseAddress, let y = b.baseAddress else { return a.count == 0 }
                    return memcmp(x, y, a.count) == 0
                }
            }
            try await connection.close()
            return ok
        }
        var sequential = 0
        for _ in 0..<200 where try await client() { sequential += 1 }
        #expect(sequential == 200)
        let concurrent = try await withThrowingTaskGroup(of: Bool.self) { group in
            for _ in 0..<50 { group.addTask { try await client() } }
            return try await group.reduce(0) { $0 + ($1 ? 1 : 0) }
        }
        #expect(concurrent == 50)
        #expect(bridge.isRunning, "the bridge keeps listening")
        bridge.signal(SIGTERM)
        let result = await bridge.wait(timeout: 30)
        #expect(result.status == 143)
        #expect(result.stderr.components(separatedBy: "\"accepted\"").count - 1 == 250)
        #expect(!result.stderr.contains("\"failed\""), "\(result.stderr.suffix(2000))")
        echoTask.cancel()
        try await echo.close()
    }

    @Test func anExclusiveTargetRefusesASecondClient() async throws {
        let pty = try PTY()
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0", "tty://\(pty.peerPath)"])
        let url = try #require(await Self.listeningURL(of: bridge))
        let first = try await Transport.connect(to: url)
        try await first.write("one")
        #expect(await pty.readMaster(count: 3) == Array("one".utf8))
        let second = try await Transport.connect(to: url)
        let refusal = try await second.readLine(timeout: .seconds(10))
        #expect(refusal?.contains("busy") == true, "\(String(describing: refusal))")
        #expect(try await second.read(timeout: .seconds(10)) == nil, "and is closed")
        try await second.close()
        try await first.write("two")
        #expect(await pty.readMaster(count: 3) == Array("two".utf8), "the first client is undisturbed")
        try await first.close()
        // Once the first is gone the device serves the next client.
        #expect(await eventually(10) { bridge.stderrLines.contains { $0.contains("\"closed\"") } })
        let third = try await Transport.connect(to: url)
        try await third.write("three")
        #expect(await pty.readMaster(count: 5) == Array("three".utf8))
        try await third.close()
        bridge.signal(SIGINT)
        let result = await bridge.wait(timeout: 15)
        #expect(result.status == 130)
        #expect(result.stderr.contains("\"refused\""))
    }

    @Test func anExclusiveTargetCanReplaceTheOldClient() async throws {
        let pty = try PTY()
        let bridge = try CLI.Running(["bridge", "--json", "--busy", "replace", "--listen", "tcp://127.0.0.1:0", "tty://\(pty.peerPath)"])
        let url = try #require(await Self.listeningURL(of: bridge))
        let first = try await Transport.connect(to: url)
        try await first.write("old")
        #expect(await pty.readMaster(count: 3) == Array("old".utf8))
        let second = try await Transport.connect(to: url)
        #expect(try await first.read(timeout: .seconds(10)) == nil, "the old client is closed")
        try await second.write("new")
        #expect(await pty.readMaster(count: 3) == Array("new".utf8))
        pty.writeMaster(Array("reply".utf8))
        #expect(try await second.read(timeout: .seconds(10)) == Array("reply".utf8))
        try await first.close()
        try await second.close()
        bridge.signal(SIGTERM)
        let result = await bridge.wait(timeout: 15)
        #expect(result.status == 143)
        #expect(result.stderr.contains("\"replaced\""))
    }

    // MARK: - Malformed input

    /// One row: the arguments, the exit status, and words the message must contain.
    struct BadInput: Sendable, CustomStringConvertible {
        var arguments: [String]
        var status: Int32
        var words: [String]
        /// A bridge that must fail before it listens: no "listening" status line.
        var neverListens = false
        var description: String { arguments.joined(separator: " ").prefix(120).description }
    }

    static func badInputs(fifo: String, socket: String) -> [BadInput] {
        func url(_ text: String, _ words: String...) -> BadInput { BadInput(arguments: ["connect", text], status: 1, words: words) }
        func usage(_ arguments: [String], _ words: String...) -> BadInput { BadInput(arguments: arguments, status: 64, words: words) }
        func bridge(_ arguments: [String], _ words: String...) -> BadInput { BadInput(arguments: ["bridge"] + arguments, status: 1, words: words) }
        let tcpGrammar = "Grammar: tcp://HOST:PORT"
        let longValue = String(repeating: "a", count: 100_000)
        let manyOptions = (0..<12_000).map { "o\($0)=1" }.joined(separator: "&")
        return [
            url("", "invalid URL ''", "expected scheme://"),
            url("tcp", "invalid URL 'tcp'", "expected scheme://"),
            url("tcp://", "a host is required", tcpGrammar),
            url("tcp://127.0.0.1", "a port is required"),
            url("tcp://127.0.0.1:", "must be a decimal number"),
            url("tcp://127.0.0.1:99999", "the port 99999 is outside 0…65535"),
            url("tcp://127.0.0.1:-1", "the port '-1' must be a decimal number"),
            url("tcp://127.0.0.1:abc", "the port 'abc' must be a decimal number"),
            url("tcp://127.0.0.1:80?noDelay=maybe", "option 'noDelay=maybe'", "expected true or false"),
            url("tcp://127.0.0.1:80?timeout=1e10", "option 'timeout=1e10'", "outside 0…31536000 seconds"),
            url("tcp://127.0.0.1:80?timeout=-1", "option 'timeout=-1'", "outside 0…31536000 seconds"),
            url("tcp://127.0.0.1:80?timeout=nan", "option 'timeout=nan'", "between 0 and 31536000"),
            url("tcp://127.0.0.1:80?timeout=inf", "option 'timeout=inf'", "between 0 and 31536000"),
            url("tcp://127.0.0.1:80?timeout=0x10", "option 'timeout=0x10'", "such as 2 or 0.5"),
            url("tcp://127.0.0.1:80?timeout=1e400", "option 'timeout=1e400'"),
            url("tcp://127.0.0.1:80?keepAliveIdle=3e9", "option 'keepAliveIdle=3e9'", "outside 1…32767 seconds"),
            url("tcp://127.0.0.1:80?keepAliveIdle=40000", "option 'keepAliveIdle=40000'", "outside 1…32767 seconds"),
            url("tcp://127.0.0.1:80?keepAliveIdle=0", "outside 1…32767 seconds"),
            url("tcp://127.0.0.1:80?keepAliveIdle=-inf", "option 'keepAliveIdle=-inf'"),
            url("tcp://127.0.0.1:80?backlog=0", "option 'backlog' is not used by this mode, tcp:// connection"),
            url("tcp://127.0.0.1:80?backlog=99999999999999999999", "option 'backlog' is not used by this mode, tcp:// connection"),
            url("tcp://127.0.0.1:80?speed=9", "unknown option 'speed'", "tcp accepts: noDelay"),
            url("tcp://127.0.0.1:80?timeout=1&timeout=2", "option 'timeout' is given twice"),
            url("tcp://127.0.0.1:80?TIMEOUT=1&timeout=2", "is given twice"),
            url("tcp://user@127.0.0.1:80", "user information ('name@') has no meaning"),
            url("tcp://127.0.0.1:80/path", "a path is not allowed here"),
            url("tcp://[::1:80", "'[' opens an IPv6 address that no ']' closes"),
            url("tcp://127.0.0.1:80?noDelay=%zz", "'%' must be followed by two hex digits"),
            url("tcp://127.0.0.1:80?%00=1", "control character"),
            url("tcp://127.0.0.1:80?noDelay=%0a", "control character"),
            url("tcp://127.0.0.1:80\n", "control character"),
            url("tcp://127.0.0.1:80\u{7f}", "control character"),
            url("tcp://12 7.0.0.1:80", "cannot resolve the host '12 7.0.0.1'"),
            url("tcp://nonexistent.invalid:80", "cannot resolve the host 'nonexistent.invalid'"),
            url("tcp://127.0.0.1:80?x=\(longValue)", "unknown option 'x'", "(100021 bytes)"),
            url("tcp://127.0.0.1:80?\(manyOptions)", "unknown option 'o0'"),
            url("gopher://x:70", "no plugin handles gopher://", "registered schemes: ble://, ea://, http://, https://, loop://",
                "spy+URL", "tls+URL"),
            url("usb://1546:01a7", "no USB device matches USB 1546:01a7", "wait=true"),
            url("usb://1546:01a7?transfers=1", "transfers"),
            url("rfcomm://00:11:22:33:44:55?uuid=serial", "uuid=serial is not a service UUID"),
            url("rfcomm://00:11:22:33:44:55:31", "31"),
            url("ble://FFF0:128/00:11:22:33:44", "is not a Bluetooth address"),
            url("ea://com.example", "External Accessory", "rfcomm://", "usb://"),
            url(":", "expected scheme://"),
            url("://x", "the scheme '' must start with a letter"),
            url("tcp:127.0.0.1:80", "expected scheme://"),
            url("1tcp://127.0.0.1:80", "must start with a letter"),
            url("unix://", "a path is required", "Grammar: unix:///PATH"),
            url("unix:///", "a path is required"),
            url("unix://relative/path", "a host is not allowed here"),
            url("unix:///tmp/nonexistent-dir-xyz/sock", "no socket at /tmp/nonexistent-dir-xyz/sock", "ENOENT"),
            url("unix:///tmp", "/tmp is a directory, not a socket", "ECONNREFUSED"),
            url("unix:///etc/hostname", "/etc/hostname is a regular file, not a socket"),
            url("unix://\(fifo)", "is a FIFO (named pipe), not a socket"),
            url("unix:///" + String(repeating: "s", count: 200), "is too long: Linux allows 107 bytes"),
            url("unix://\(socket)?timeout=x", "option 'timeout=x'"),
            url("loop://?buffer=0", "option 'buffer=0'", "outside 1…67108864"),
            url("loop://?buffer=-5", "option 'buffer=-5'"),
            url("loop://?buffer=abc", "expected an integer between 1 and 67108864"),
            url("loop://?buffer=1.5", "expected an integer"),
            url("loop://?messages=2", "option 'messages=2'", "expected true or false"),
            url("loop://?maxWrite=0", "option 'maxWrite=0'"),
            url("loop://host", "a host is not allowed here", "Grammar: loop://"),
            url("loop://:80", "a port is not allowed here"),
            url("loop:///path", "a path is not allowed here"),
            url("loop://?buffer", "option 'buffer='"),
            url("tty://", "a path is required", "Grammar: tty://"),
            url("tty:///dev/nonexistent-tty", "no device at /dev/nonexistent-tty", "transportkit list"),
            url("tty:///tmp", "/tmp is a directory, not a serial port", "EISDIR"),
            url("tty:///etc/hostname", "/etc/hostname is not a serial port or terminal", "ENOTTY"),
            url("tty://relative", "a path is required"),
            url("tty:///dev/null", "/dev/null is not a serial port or terminal"),
            url("tty://\(fifo)", "not a serial port or terminal"),
            url("tty://\(socket)", "is a unix socket, not a serial port", "unix://"),
            url("tty:///dev/ttyS0?baud=0", "option 'baud=0'", "outside 1…20000000"),
            url("tty:///dev/ttyS0?baud=abc", "option 'baud=abc'"),
            url("tty:///dev/ttyS0?baud=1e3", "option 'baud=1e3'"),
            url("tty:///dev/ttyS0?dataBits=9", "option 'dataBits=9'", "outside 5…8"),
            url("tty:///dev/ttyS0?parity=maybe", "expected one of none, even, odd, mark, space"),
            url("tty:///dev/ttyS0?stopBits=3", "option 'stopBits=3'"),
            url("tty:///dev/ttyS0?flowControl=x", "expected one of none, rtscts, xonxoff"),
            url("tty:///dev/ttyS0?restore=maybe", "option 'restore=maybe'"),
            url("tty:///dev/ttyS0?wait=2", "option 'wait=2'"),
            url("tty://adapter:19200/dev/ttyS0?baud=9600", "gives two bit rates"),
            url("tty://usb/zzzz:0001", "two 4-digit hex IDs"),
            url("tty://usb/0403", "two 4-digit hex IDs"),
            url("tty://usb/0403:6001?interface=300", "option 'interface=300'"),
            url("pty://?link=", "the option 'link' needs a path"),
            url("pty://?link=/nonexistent-dir-xyz/link", "the directory /nonexistent-dir-xyz does not exist", "ENOENT"),
            url("pty://?link=/etc/hostname", "something is already there", "EEXIST"),
            url("pty://?link=/etc/hostname/x", "is not a directory"),
            url("pty://host", "a host is not allowed here", "Grammar: pty://"),
            url("pty://?baud=0", "option 'baud=0'"),
            url("spy+", "expected scheme://"),
            url("spy+tcp://127.0.0.1:80?spy.format=weird", "option 'spy.format=weird'", "expected one of hex, raw"),
            url("spy://127.0.0.1:80", "spy wraps another URL"),
            url("tcp+tcp://127.0.0.1:80", "tcp:// does not wrap other URLs"),
            url("spy+gopher://x", "no plugin handles gopher://"),
            url("spy+tcp://127.0.0.1:80?spy.nope=1", "unknown option 'spy.nope'"),
            url("spy+spy+", "expected scheme://"),
            usage(["connect", "--linger", "inf", "loop://"], "--linger takes a number of seconds from 0 to 86400"),
            usage(["connect", "--linger", "1e16", "loop://"], "--linger takes a number of seconds from 0 to 86400"),
            usage(["connect", "--linger", "nan", "loop://"], "--linger takes a number of seconds from 0 to 86400"),
            usage(["connect", "--linger", "-1", "loop://"], "--linger takes a number of seconds from 0 to 86400"),
            usage(["connect", "--linger", "abc", "loop://"], "'abc' is invalid for '--linger"),
            usage(["connect", "--linger"], "Missing value for '--linger"),
            usage(["connect"], "Missing expected argument '<url>'"),
            usage(["connect", "loop://", "loop://"], "Unexpected argument"),
            usage(["connect", "--bogus", "loop://"], "Unknown option '--bogus'"),
            usage(["connect", "--log-level", "loud", "loop://"], "--log-level takes one of"),
            usage(["bridge", "loop://"], "a bridge has two endpoints"),
            usage(["bridge", "loop://", "loop://", "loop://"], "a bridge has two endpoints"),
            usage(["bridge", "--max-clients", "0", "--listen", "tcp://127.0.0.1:0", "loop://"], "--max-clients takes a number from 1 to 100000"),
            usage(["bridge", "--busy", "maybe", "--listen", "tcp://127.0.0.1:0", "loop://"], "'maybe' is invalid for '--busy"),
            usage(["bridge", "--linger", "inf", "--listen", "tcp://127.0.0.1:0", "loop://"], "--linger takes a number of seconds"),
            usage(["bridge", "--linger", "-5", "loop://", "loop://"], "--linger takes a number of seconds"),
            bridge(["--listen", "tcp://nonexistent.invalid:0", "loop://"], "cannot listen on 'nonexistent.invalid'", "0.0.0.0"),
            bridge(["--listen", "tcp://127.0.0.1:99999", "loop://"], "the port 99999 is outside 0…65535"),
            bridge(["--listen", "tcp://10.99.99.99:0", "loop://"], "10.99.99.99 is not an address of this machine", "EADDRNOTAVAIL"),
            bridge(["--listen", "loop://", "loop://"], "loop:// cannot listen", "tcp://, tls://, tls+URL, unix://"),
            bridge(["--listen", "unix:///tmp", "loop://"], "/tmp exists and is a directory, not a socket"),
            bridge(["--listen", "unix:///etc/hostname", "loop://"], "is a regular file, not a socket"),
            bridge(["--listen", "unix:///nonexistent-dir/x.sock", "loop://"], "its directory does not exist"),
            bridge(["--listen", "tcp://127.0.0.1:0", "gopher://x"], "no plugin handles gopher://"),
            bridge(["--listen", "tcp://127.0.0.1:0", "tcp://127.0.0.1:80?speed=1"], "unknown option 'speed'"),
            bridge(["--listen", "tcp://127.0.0.1:0", "tcp://"], "a host is required"),
            bridge(["tcp://127.0.0.1:1", "loop://"], "refused the connection"),
            usage(["list", "--bogus"], "Unknown option '--bogus'"),
            usage(["watch", "extra"], "Unexpected argument 'extra'"),
            usage(["schemes", "extra"], "Unexpected argument 'extra'"),
            usage(["frobnicate"], "Unexpected argument 'frobnicate'"),
        ]
    }

    /// Issue 25's rows: Bluetooth, USB, spy+ and the bridge's flags; options a mode does not use;
    /// inputs that passed validation before; values echoed in full.
    static func badInputsOfIssue25(fifo: String, socket: String, directory: String) -> [BadInput] {
        func url(_ text: String, _ words: String...) -> BadInput { BadInput(arguments: ["connect", text], status: 1, words: words) }
        func usage(_ arguments: [String], _ words: String...) -> BadInput { BadInput(arguments: arguments, status: 64, words: words) }
        func bridge(_ arguments: [String], _ words: String...) -> BadInput { BadInput(arguments: ["bridge"] + arguments, status: 1, words: words) }
        func target(_ text: String, _ words: String...) -> BadInput {
            BadInput(arguments: ["bridge", "--listen", "tcp://127.0.0.1:0", text], status: 1, words: words, neverListens: true)
        }
        func listener(_ text: String, _ words: String...) -> BadInput {
            BadInput(arguments: ["bridge", "--listen", text, "loop://"], status: 1, words: words, neverListens: true)
        }
        let mac = "00:11:22:33:44:55"
        let notUsed = "so it is refused rather than ignored"
        let long = String(repeating: "b", count: 5000)
        let huge = String(repeating: "h", count: 100_000)
        let listen = ["--listen", "tcp://127.0.0.1:0"]
        return [
            // rfcomm:// connections
            url("rfcomm://zz", "'zz' is not a Bluetooth address", "Grammar: rfcomm://"),
            url("rfcomm://[\(mac)]:3", "'\(mac)' is not an IPv6 address"),
            url("rfcomm://+0:+0:+0:+0:+0:+0", "has 5 colons"),
            url("rfcomm://00:11:22:33:44:GG", "has 5 colons"),
            url("rfcomm://\(mac)?uuid=1101-0000", "uuid=1101-0000 is not a service UUID"),
            url("rfcomm://\(mac)?uuid=", "uuid= is not a service UUID"),
            url("rfcomm://\(mac)?uuid=ZZZZ", "uuid=ZZZZ is not a service UUID"),
            url("rfcomm://\(mac)?uuid=6E400001-B5A3-F393-E0A9", "is not a service UUID"),
            url("rfcomm://\(mac)?uuid=6E400001B5A3F393E0A9E50E24DCCA9E0", "is not a service UUID"),
            url("rfcomm://\(mac)?uuid=%EF%BC%A6FFE", "is not a service UUID"),
            url("rfcomm://\(mac)?uuid=\(long)", "is not a service UUID", "(5000 bytes)"),
            url("rfcomm://\(mac)?adapter=", "adapter='' names no adapter", "hci0"),
            url("rfcomm://\(mac)?adapter=wlan0", "adapter='wlan0' names no adapter"),
            url("rfcomm://\(mac)?adapter=hci", "names no adapter"),
            url("rfcomm://\(mac)?adapter=hci0x", "names no adapter"),
            url("rfcomm://\(mac):3?uuid=1101", "option 'uuid' is not used by this mode, rfcomm:// connection to a channel (rfcomm://MAC:CHANNEL)", notUsed),
            url("rfcomm://\(mac)?backlog=3", "option 'backlog' is not used by this mode, rfcomm:// connection found through SDP", "rfcomm:// listener"),
            url("rfcomm://\(mac):3?backlog=3", "option 'backlog' is not used by this mode, rfcomm:// connection to a channel"),
            url("rfcomm://\(mac)?name=x", "option 'name' is not used by this mode, rfcomm:// connection found through SDP"),
            url("rfcomm://\(mac):3?name=x", "option 'name' is not used"),
            url("rfcomm://\(mac):0", "the port 0 is outside 1…30"),
            url("rfcomm://\(mac):abc", "the port 'abc' must be a decimal number"),
            url("rfcomm://\(mac):99999999999", "the port 99999999999 is outside 1…30"),
            url("rfcomm://\(mac)?security=max", "option 'security=max'", "expected one of low, medium, high"),
            url("rfcomm://\(mac)?timeout=-1", "option 'timeout=-1'"),
            url("rfcomm://\(mac)/path", "a path is not allowed here"),
            url("rfcomm://", "a host is required", "Grammar: rfcomm://"),
            url("rfcomm://\(mac)?rx=FFE1", "unknown option 'rx'", "rfcomm accepts: adapter, uuid, name, backlog, security"),
            url("rfcomm://\(mac)?mtu=100", "unknown option 'mtu'"),
            url("rfcomm://\(mac)?advertise=true", "unknown option 'advertise'"),
            // ble:// connections
            url("ble://nus/+0:+0:+0:+0:+0:+0", "'+0:+0:+0:+0:+0:+0' is not a Bluetooth address"),
            url("ble://nus/0:11:22:33:44:555", "is not a Bluetooth address"),
            url("ble://ZZZZ:128/\(mac)", "'ZZZZ' is neither a service UUID", "hm10, nus"),
            url("ble://\(String(repeating: "7", count: 200)):128/\(mac)", "is neither a service UUID", "(200 bytes)"),
            url("ble://6E400001-B5A3-F393-E0A9:128/\(mac)", "is neither a service UUID"),
            url("ble://1101-0000:128/\(mac)", "'1101-0000' is neither a service UUID"),
            url("ble://[::1]:128/\(mac)", "'::1' is neither a service UUID"),
            url("ble://nus/\(mac)?security=high", "security=high on a GATT serial connect", "then use security=medium"),
            url("ble://nus/\(mac)?mtu=100", "option 'mtu' is not used by this mode, ble:// GATT serial connection"),
            url("ble://nus/\(mac)?addressType=random", "option 'addressType' is not used by this mode, ble:// GATT serial connection"),
            url("ble://nus/\(mac)?backlog=3", "option 'backlog' is not used by this mode, ble:// GATT serial connection", "ble:// L2CAP listener"),
            url("ble://nus/\(mac)?advertise=false", "option 'advertise' is not used by this mode, ble:// GATT serial connection"),
            url("ble://nus?security=highest", "expected one of low, medium, high"),
            url("ble://FFF0:128/\(mac)?rx=FFE1", "option 'rx' is not used by this mode, ble:// L2CAP connection (ble://SERVICE:PSM[/MAC])"),
            url("ble://FFF0:128/\(mac)?tx=FFE1", "option 'tx' is not used by this mode, ble:// L2CAP connection"),
            url("ble://FFF0:128/\(mac)?acquire=never", "option 'acquire' is not used by this mode, ble:// L2CAP connection"),
            url("ble://FFF0:128/\(mac)?backlog=3", "option 'backlog' is not used by this mode, ble:// L2CAP connection"),
            url("ble://FFF0:128/\(mac)?advertise=false", "option 'advertise' is not used by this mode, ble:// L2CAP connection"),
            url("ble://FFF0:128?rx=FFE1", "option 'rx' is not used by this mode, ble:// L2CAP connection"),
            url("ble://nus/\(mac)?rx=GGGG", "rx='GGGG' is not a characteristic UUID"),
            url("ble://nus/\(mac)?tx=", "tx='' is not a characteristic UUID"),
            url("ble://nus/\(mac)?rx=\(long)", "is not a characteristic UUID", "(5000 bytes)"),
            url("ble://nus/\(mac)?acquire=sometimes", "expected one of auto, never"),
            url("ble://FFF0:128/\(mac)?addressType=x", "expected one of bluez, public, random"),
            url("ble://FFF0:128/\(mac)?mtu=22", "option 'mtu=22'", "outside 23…65535"),
            url("ble://FFF0:128/\(mac)?mtu=70000", "outside 23…65535"),
            url("ble://FFF0:128/\(mac)?security=max", "expected one of low, medium, high"),
            url("ble://FFF0:256/\(mac)", "the port 256 is outside 1…255"),
            url("ble://FFF0:0/\(mac)", "the port 0 is outside 1…255"),
            url("ble://FFF0:128/00:11:22:33:44", "'00:11:22:33:44' is not a Bluetooth address"),
            url("ble://FFF0:128/\(mac)/extra", "is not a Bluetooth address"),
            url("ble://nus/\(mac)?adapter=", "adapter='' names no adapter"),
            url("ble://nus/\(mac)?adapter=hci", "names no adapter"),
            url("ble://nus/\(mac)?adapter=\(long)", "names no adapter", "(5000 bytes)"),
            url("ble://FFF0:128/\(mac)?adapter=00:11:22:33:44", "names no adapter"),
            url("ble://nus/\(mac)?uuid=1101", "unknown option 'uuid'", "ble accepts: adapter"),
            url("ble://nus/\(mac)?name=x", "unknown option 'name'"),
            url("ble://", "a host is required", "Grammar: ble://"),
            url("ble://nus/\(mac)?timeout=abc", "option 'timeout=abc'"),
            // usb://
            url("usb://0403:6001/", "the serial number after '/' is empty"),
            url("usb://0403:6001/A/B", "'A/B' is not one serial number", "?location="),
            url("usb://0403:6001:1", "has 2 colons", "VID:PID", "a serial number goes after a '/'"),
            url("usb://0403", "expected VID:PID"),
            url("usb://403:6001", "expected VID:PID"),
            url("usb://0403:60011", "expected VID:PID"),
            url("usb://ZZZZ:6001", "expected VID:PID"),
            url("usb://[::1]", "expected VID:PID"),
            url("usb://", "expected VID:PID"),
            url("usb://0403:6001?location=", "location= is empty", "bus and port path"),
            url("usb://0403:6001?serial=", "serial= is empty"),
            url("usb://0403:6001/A?serial=B", "gives two serial numbers", "'A' after the '/' and serial=B", "usb://0403:6001?serial=SERIAL"),
            url("usb://0403:6001/A?serial=A", "no USB device matches USB 0403:6001 serial A"),
            url("usb://0403:6001/A%2FB", "no USB device matches USB 0403:6001 serial A/B"),
            url("usb://0403:6001?serial=A/B", "no USB device matches USB 0403:6001 serial A/B"),
            url("usb://0403:6001?location=\(long)", "no USB device matches", "(5000 bytes)"),
            url("usb://0403:6001?interface=256", "option 'interface=256'", "outside 0…255"),
            url("usb://0403:6001?alt=-1", "option 'alt=-1'"),
            url("usb://0403:6001?in=zz", "in=zz is not an endpoint address"),
            url("usb://0403:6001?in=0x+1", "in=0x+1 is not an endpoint address"),
            url("usb://0403:6001?in=0x02", "in=0x02 is an OUT endpoint"),
            url("usb://0403:6001?out=0x81", "out=0x81 is an IN endpoint"),
            url("usb://0403:6001?out=+2", "out=+2 is not an endpoint address"),
            url("usb://0403:6001?transfers=65", "option 'transfers=65'", "outside 2…64"),
            url("usb://0403:6001?transferSize=63", "option 'transferSize=63'"),
            url("usb://0403:6001?zlp=maybe", "expected true or false"),
            url("usb://0403:6001?detach=2", "option 'detach=2'"),
            url("usb://0403:6001?wait=x", "option 'wait=x'"),
            url("usb://0403:6001?serialNumber=A", "unknown option 'serialNumber'", "usb accepts: interface, alt, in, out, serial, location"),
            url("usb://0403:6001?baud=9600", "unknown option 'baud'"),
            url("usb://0403:6001/%0A", "control character"),
            url("usb://user@0403:6001", "user information"),
            url("usb://0403:6001#x", "fragments"),
            // spy+
            url("spy+loop://?spy.file=", "spy.file= needs a path"),
            url("spy+loop://?spy.file=\(directory)", "is a directory"),
            url("spy+loop://?SPY.FILE=\(directory)", "is a directory"),
            url("spy+loop://?spy.file=/nonexistent-dir-xyz/trace.txt", "the directory it would go in does not exist"),
            url("spy+loop://?spy.file=/tmp/\(long)", "the trace file (spy.file=)", "(5005 bytes)"),
            url("spy+loop://?spy.file=/etc/hostname/x", "'hostname' on the way is not a directory"),
            url("spy+loop://?spy.file=\(fifo)", "is a FIFO (named pipe)"),
            url("spy+loop://?spy.file=\(socket)", "is a unix socket"),
            url("spy+loop://?spy.format=raw&spy.label=x", "spy.label= begins the lines of the hex format"),
            url("spy+loop://?spy.direction=up", "expected one of both, rx, tx"),
            url("spy+loop://?spy.timeout=3", "unknown option 'spy.timeout'", "spy accepts: spy.format, spy.direction, spy.file, spy.label"),
            url("spy+spy+loop://", "the wrapper 'spy' is given twice"),
            url("spy+tcp://127.0.0.1:80?backlog=1", "option 'backlog' is not used by this mode, tcp:// connection"),
            url("spy+ble://nus/\(mac)?security=high", "security=high on a GATT serial connect"),
            url("spy+usb://0403:6001/", "the serial number after '/' is empty"),
            url("spy+rfcomm://zz", "'zz' is not a Bluetooth address"),
            url("spy+pty://?dataBits=7", "unknown option 'dataBits'"),
            url("spy+tty:///dev/ptmx", "the pseudo-terminal multiplexer"),
            url("spy+unix:///tmp/x.sock?mode=0600", "option 'mode' is not used by this mode, unix:// connection"),
            // tty:// and pty://
            url("tty:///dev/ptmx", "the pseudo-terminal multiplexer", "pty://"),
            url("tty:///dev/ttyS0?serial=x", "option 'serial' is not used by this mode, tty:// connection to a device node", "tty:// connection to a USB adapter"),
            url("tty:///dev/ttyS0?location=1-1", "option 'location' is not used by this mode, tty:// connection to a device node"),
            url("tty:///dev/ttyS0?interface=0", "option 'interface' is not used by this mode, tty:// connection to a device node"),
            url("tty://usb/0403:6001?serial=", "serial= is empty"),
            url("tty://usb/0403:6001?location=", "location= is empty"),
            url("tty://usb/0403:6001/", "the serial number after '/' is empty", "tty://usb/0403:6001?serial=SERIAL"),
            url("tty://usb/0403:6001/A/B", "'A/B' is not one serial number"),
            url("tty://usb/0403:6001/A?serial=B", "gives two serial numbers", "tty://usb/0403:6001?serial=SERIAL"),
            url("tty://usb/0403:6001/A?serial=A", "no serial port matches USB 0403:6001 serial A"),
            url("tty://usb/0403:6001?location=\(long)", "no serial port matches", "(5000 bytes)"),
            url("tty:///dev/ttyS0?link=/tmp/x", "unknown option 'link'"),
            url("tty:///dev/ttyS0?backlog=1", "unknown option 'backlog'"),
            url("pty://?dataBits=7", "unknown option 'dataBits'", "pty accepts: baud, stopBits, flowControl, link"),
            url("pty://?parity=even", "unknown option 'parity'"),
            url("pty://?exclusive=true", "unknown option 'exclusive'"),
            url("pty://?link=/tmp/\(long)", "cannot create the link", "(5005 bytes)", "ENAMETOOLONG"),
            // tcp://, unix://, loop://
            url("tcp://\(huge):80", "cannot resolve the host", "(100000 bytes)"),
            url("tcp://127.0.0.1:\(String(repeating: "9", count: 100_000))", "is outside 0…65535", "(100000 bytes)"),
            url("tcp://127.0.0.1:99999999999", "the port 99999999999 is outside 0…65535"),
            url("tcp://[\(mac)]:80", "is not an IPv6 address"),
            url("tcp://[1:2:3:4:5:6:7:8:9]:80", "is not an IPv6 address"),
            url("tcp://[::1::2]:80", "is not an IPv6 address"),
            url("tcp://[1.2.3.4]:80", "is not an IPv6 address"),
            url("tcp://[::ffff:1.2.3.400]:80", "is not an IPv6 address"),
            url("tcp://127.0.0.1:80?backlog=16", "option 'backlog' is not used by this mode, tcp:// connection (tcp://HOST:PORT)", "tcp:// listener"),
            url("unix:///tmp/x.sock?mode=0600", "option 'mode' is not used by this mode, unix:// connection"),
            url("unix:///tmp/x.sock?backlog=3", "option 'backlog' is not used by this mode, unix:// connection"),
            url("unix:///tmp/\(long)", "is too long: Linux allows 107 bytes", "(5005 bytes)"),
            url("loop://?backlog=1", "unknown option 'backlog'"),
            // What a bridge checks before it listens (item 9)
            target("rfcomm://zz", "'zz' is not a Bluetooth address"),
            target("ble://ZZZZ:128/\(mac)", "'ZZZZ' is neither a service UUID"),
            target("ble://nus/+0:+0:+0:+0:+0:+0", "is not a Bluetooth address"),
            target("spy+loop://?spy.file=", "spy.file= needs a path"),
            target("spy+loop://?spy.file=\(directory)", "is a directory"),
            target("spy+loop://?spy.file=\(fifo)", "is a FIFO"),
            target("tty:///etc/hostname", "is a regular file, not a serial port"),
            target("tty://\(directory)", "is a directory, not a serial port"),
            target("tty://\(socket)", "is a unix socket, not a serial port", "unix://"),
            target("tty:///dev/ptmx", "the pseudo-terminal multiplexer"),
            target("tty://usb/zzzz:0001", "two 4-digit hex IDs"),
            target("tty://usb/0403:6001?serial=", "serial= is empty"),
            target("unix:///etc/hostname", "is a regular file, not a socket"),
            target("usb://0403:6001/", "the serial number after '/' is empty"),
            target("usb://0403:6001/A?serial=B", "gives two serial numbers"),
            target("tty://usb/0403:6001/A?serial=B", "gives two serial numbers"),
            target("usb://0403:6001?in=0x02", "is an OUT endpoint"),
            target("tcp://127.0.0.1:80?backlog=3", "option 'backlog' is not used by this mode, tcp:// connection"),
            target("rfcomm://\(mac)?adapter=", "names no adapter"),
            // Listeners
            listener("tcp://127.0.0.1:0?timeout=3", "option 'timeout' is not used by this mode, tcp:// listener (tcp://ADDRESS:PORT)"),
            listener("unix:///tmp/tk-never.sock?mode=abc", "mode=abc is not a file mode", "0600"),
            listener("unix:///tmp/tk-never.sock?mode=1777", "mode=1777 is not a file mode"),
            listener("unix:///tmp/tk-never.sock?mode=6", "mode=6 is not a file mode"),
            listener("unix:///tmp/tk-never.sock?mode=", "is not a file mode"),
            listener("unix:///tmp/tk-never.sock?timeout=1", "option 'timeout' is not used by this mode, unix:// listener"),
            listener("ble://FFF0:128?addressType=public", "option 'addressType' is not used by this mode, ble:// L2CAP listener"),
            listener("ble://FFF0:128?rx=FFE1", "option 'rx' is not used by this mode, ble:// L2CAP listener"),
            listener("ble://FFF0:128?timeout=3", "option 'timeout' is not used by this mode, ble:// L2CAP listener"),
            listener("ble://FFF0:128/\(mac)", "a listener takes no device"),
            listener("ble://FFF0", "needs its characteristics named"),
            listener("ble://nus?mtu=100", "option 'mtu' is not used by this mode, ble:// GATT serial listener"),
            listener("ble://ZZZZ:128", "'ZZZZ' is neither a service UUID"),
            listener("ble://FFF0:128?adapter=", "names no adapter"),
            listener("rfcomm://zz", "to listen, give `any`"),
            listener("rfcomm://any?timeout=3", "option 'timeout' is not used by this mode, rfcomm:// listener"),
            listener("rfcomm://any?uuid=1101-0000", "is not a service UUID"),
            listener("rfcomm://any?adapter=", "names no adapter"),
            listener("rfcomm://any:31", "the port 31 is outside 1…30"),
            listener("rfcomm://any?security=x", "expected one of low, medium, high"),
            // The bridge's flags (item 7)
            usage(["bridge", "--once", "loop://", "loop://"], "--once serves one client of a listener"),
            usage(["bridge", "--once", "--listen", "tcp://127.0.0.1:0", "--listen", "tcp://127.0.0.1:0"], "--once serves one client of a listener"),
            usage(["bridge", "--keep-open", "loop://", "loop://"], "--keep-open applies to a bridge that serves clients"),
            usage(["bridge", "--busy", "replace", "loop://", "loop://"], "--busy applies to a bridge that serves clients"),
            usage(["bridge", "--max-clients", "3", "loop://", "loop://"], "--max-clients applies to a bridge that serves clients", "relays one pair"),
            usage(["bridge", "--once", "--max-clients", "3"] + listen + ["loop://"], "--max-clients applies", "--once serves a single client"),
            usage(["bridge", "--once", "--busy", "refuse"] + listen + ["loop://"], "--busy applies"),
            usage(["bridge", "--once", "--keep-open"] + listen + ["loop://"], "--keep-open applies"),
            usage(["bridge", "--keep-open"] + listen + ["loop://"], "--keep-open applies to an exclusive target", "loop:// gets a connection of its own", "bridge"),
            usage(["bridge", "--busy", "replace"] + listen + ["loop://"], "--busy applies to an exclusive target"),
            usage(["bridge", "--busy", "refuse"] + listen + ["tcp://127.0.0.1:9"], "--busy applies to an exclusive target"),
            usage(["bridge", "--max-clients", "3"] + listen + ["tty:///dev/ttyS0"], "--max-clients: tty:// is exclusive"),
            usage(["bridge", "--max-clients", "5", "--max-clients", "6"] + listen + ["loop://"], "--max-clients is given 2 times; give it once"),
            usage(["bridge", "--max-clients=5", "--max-clients", "6"] + listen + ["loop://"], "--max-clients is given 2 times"),
            usage(["bridge", "--linger", "1", "--linger", "2"] + listen + ["loop://"], "--linger is given 2 times"),
            usage(["bridge", "--busy", "refuse", "--busy", "replace"] + listen + ["tty:///dev/ttyS0"], "--busy is given 2 times"),
            usage(["bridge", "--json", "--json"] + listen + ["loop://"], "--json is given 2 times"),
            usage(["bridge", "--once", "--once"] + listen + ["loop://"], "--once is given 2 times"),
            usage(["bridge", "--max-clients", "-1"] + listen + ["loop://"], "--max-clients takes a number from 1 to 100000; got -1"),
            usage(["bridge", "--max-clients", "100001"] + listen + ["loop://"], "--max-clients takes a number from 1 to 100000"),
            usage(["bridge", "--max-clients", "abc"] + listen + ["loop://"], "'abc' is invalid for '--max-clients"),
            usage(["bridge", "--max-clients", "99999999999999999999999"] + listen + ["loop://"], "is invalid for '--max-clients"),
            usage(["bridge", "--max-clients", "1e3"] + listen + ["loop://"], "'1e3' is invalid for '--max-clients"),
            usage(["bridge", "--max-clients"], "Missing value for '--max-clients"),
            usage(["bridge", "--busy"], "Missing value for '--busy"),
            usage(["bridge", "--busy", "REFUSE"] + listen + ["tty:///dev/ttyS0"], "'REFUSE' is invalid for '--busy"),
            usage(["bridge", "--listen"], "Missing value for '--listen"),
            usage(["bridge", "--once", "--listen", "tcp://127.0.0.1:0"], "a bridge has two endpoints"),
            usage(["bridge"] + listen + listen + listen, "a bridge has two endpoints"),
            usage(["bridge", "--listen", "tcp://127.0.0.1:0", "spy+loop://?spy.format=raw&spy.file=\(directory)/raw"], "would mix their bytes"),
            usage(["connect", "--linger", "1", "--linger", "2", "loop://"], "--linger is given 2 times"),
            usage(["connect", "--log-level", "debug", "--log-level", "info", "loop://"], "--log-level is given 2 times"),
            usage(["list", "--json", "--json"], "--json is given 2 times"),
            usage(["watch", "--all", "--all"], "--all is given 2 times"),
            usage(["list", "--scan", "1", "--scan", "2"], "--scan is given 2 times"),
        ]
    }

    @Test func everyMalformedInputGetsASpecificErrorAndNoOutput() async throws {
        let fifo = temporaryPath("fifo")
        #expect(mkfifo(fifo, 0o600) == 0)
        let socketPath = temporaryPath("not-a-tty.sock")
        let listener = try await Transport.listen(on: "unix://\(socketPath)")
        let directory = temporaryPath("a-directory")
        #expect(mkdir(directory, 0o700) == 0)
        let added = Self.badInputsOfIssue25(fifo: fifo, socket: socketPath, directory: directory)
        #expect(added.count >= 150, "issue 25 asks for 150 new rows (\(added.count))")
        let table = Self.badInputs(fifo: fifo, socket: socketPath) + added
        #expect(table.count >= 250)
        let results = try await withThrowingTaskGroup(of: (BadInput, CLI.Result).self) { group in
            var rows = table.makeIterator()
            var results: [(BadInput, CLI.Result)] = []
            for _ in 0..<4 {
                if let row = rows.next() { group.addTask { (row, try await CLI.run(row.arguments, timeout: 30)) } }
            }
            while let result = try await group.next() {
                results.append(result)
                if let row = rows.next() { group.addTask { (row, try await CLI.run(row.arguments, timeout: 30)) } }
            }
            return results
        }
        for (row, result) in results {
            #expect(result.status == row.status, "\(row): status \(result.status): \(result.stderr.prefix(400))")
            #expect(result.stdout.isEmpty, "\(row): nothing on standard output")
            for word in row.words {
                #expect(result.stderr.contains(word), "\(row): '\(word)' missing from: \(result.stderr.prefix(400))")
            }
            #expect(!result.stderr.contains("Fatal error") && !result.stderr.contains("crashed"), "\(row)")
            if row.neverListens {
                #expect(!result.stderr.split(separator: "\n").contains { $0.hasPrefix("listening ") }, "\(row): checked before listening")
            }
            #expect(result.stderr.utf8.count < 2000, "\(row): a message, not a dump (\(result.stderr.utf8.count) bytes)")
        }
        try await listener.close()
        unlink(fifo)
    }

    // MARK: - Helpers

    /// The URL a bridge started with --json reports it listens on.
    @Test("--max-clients is held against the descriptors a client of that target needs")
    func maxClientsCountsTheTargetsDescriptors() async throws {
        // A 1,000-descriptor limit for the tool alone (lowering needs no privilege).
        let limited = ["/usr/bin/prlimit", "--nofile=1000:1000"]
        // tcp://: the client's socket, the target's and one to spare: 900 clients need 2,764.
        let refused = try CLI.Running(["bridge", "--max-clients", "900", "--listen", "tcp://127.0.0.1:0", "tcp://127.0.0.1:9"], prefix: limited)
        let result = await refused.wait(timeout: 20)
        #expect(result.status != 0 && result.status != 143)
        #expect(result.stderr.contains("--max-clients 900 needs about 2764 file descriptors, and this process may open 1000"), "\(result.stderr)")
        // loop://: memory only, the client's socket alone: 900 fit.
        let served = try CLI.Running(["bridge", "--json", "--max-clients", "900", "--listen", "tcp://127.0.0.1:0", "loop://"], prefix: limited)
        #expect(await Self.listeningURL(of: served) != nil, "\(served.stderrLines)")
        served.signal(SIGTERM)
        #expect(await served.wait(timeout: 20).status == 143)
    }

    static func listeningURL(of bridge: CLI.Running) async -> String? {
        for _ in 0..<500 {
            for line in bridge.stderrLines {
                if let object = try? JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: String],
                   object["event"] == "listening" {
                    return object["url"]
                }
            }
            try? await Task.sleep(for: .milliseconds(20))
        }
        return nil
    }

    /// A tcp listener that reads each connection to its end and records how many bytes it got.
    static func countingTarget() async throws -> (Listener, Locked<[Int]>) {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let counts = Locked<[Int]>([])
        Task {
            try await withThrowingDiscardingTaskGroup { group in
                while let connection = try await listener.accept() {
                    group.addTask {
                        var total = 0
                        while let chunk = try await connection.readBuffer() { total += chunk.readableBytes }
                        try await connection.close()
                        counts.withLock { $0.append(total) }
                    }
                }
            }
        }
        return (listener, counts)
    }
}


extension FileManager {
    func destinationOfSymbolicLinkAtPathOrNil(_ path: String) -> String? {
        try? destinationOfSymbolicLink(atPath: path)
    }
}

/// A pseudo-terminal made by the test: the tool opens the peer node as its "device"; the test
/// plays the device on the master side.
final class PTY: Sendable {
    let master: Int32
    let peerPath: String
    /// Kept open so the peer's settings can be read; closed with the object.
    private let peer: Int32
    private let masterClosed = Locked<Bool>(false)

    init() throws {
        var master: Int32 = -1
        var peer: Int32 = -1
        guard openpty(&master, &peer, nil, nil, nil) == 0 else { throw POSIXError(.EIO) }
        self.master = master
        self.peer = peer
        peerPath = (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(peer)")) ?? "/dev/pts/?"
        _ = fcntl(master, F_SETFL, fcntl(master, F_GETFL) | O_NONBLOCK)
    }

    deinit {
        closeMaster()
        Glibc.close(peer)
    }

    func closeMaster() {
        let first = masterClosed.withLock { closed in
            defer { closed = true }
            return !closed
        }
        if first { Glibc.close(master) }
    }

    func writeMaster(_ bytes: [UInt8]) {
        _ = bytes.withUnsafeBytes { Glibc.write(master, $0.baseAddress, $0.count) }
    }

    /// Reads `count` bytes from the master side, waiting up to 10 s.
    func readMaster(count: Int) async -> [UInt8] {
        var bytes: [UInt8] = []
        let deadline = Date().addingTimeInterval(10)
        var buffer = [UInt8](repeating: 0, count: 4096)
        while bytes.count < count && Date() < deadline {
            let got = buffer.withUnsafeMutableBytes { Glibc.read(master, $0.baseAddress, min($0.count, count - bytes.count)) }
            if got > 0 { bytes += buffer[..<got] } else { try? await Task.sleep(for: .milliseconds(10)) }
        }
        return bytes
    }

    /// The peer's termios, compared field by field.
    func peerSettings() throws -> [UInt32] {
        var tio = termios()
        guard tcgetattr(peer, &tio) == 0 else { throw POSIXError(.EIO) }
        return [tio.c_iflag, tio.c_oflag, tio.c_cflag, tio.c_lflag, cfgetispeed(&tio), cfgetospeed(&tio)]
    }

    /// Waits until process `pid` has the peer node open.
    func waitUntilOpened(by pid: Int32) async -> Bool {
        await eventually(10) {
            let fds = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/fd")) ?? []
            return fds.contains { (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/\(pid)/fd/\($0)")) == peerPath }
        }
    }
}
