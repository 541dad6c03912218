import Foundation
import Glibc
import TestSupport
import Testing
import TransportKit

/// Runs the built `transportkit` binary (next to the test bundle) as a child process.
struct CLI {
    static var binary: String {
        URL(fileURLWithPath: ProcessInfo.processInfo.arguments[0]).deletingLastPathComponent()
            .appendingPathComponent("transportkit").path
    }

    struct Result {
        var status: Int32
        var stdout: [UInt8]
        var stderr: String
        var text: String { String(decoding: stdout, as: UTF8.self) }
    }

    /// A started process whose output is collected in the background.
    final class Running: @unchecked Sendable {
        // @unchecked Sendable: `process` and the pipes are used from the test task; the collected
        // output is appended by the reader threads and read, under `lock`, by the test task.
        let process = Process()
        let input = Pipe()
        let output = Pipe()
        let errors = Pipe()
        private let group = DispatchGroup()
        private var out = Data()
        private var err = Data()
        private let lock = NSLock()
        private var errLines: [String] = []
        /// The bytes of standard error after its last newline.
        private var errPartial = Data()

        /// - Parameters:
        ///   - closeStdoutAfter: close the reading end of standard output once this many bytes
        ///     arrived, as `| head -c N` does.
        ///   - stdinPath: standard input from this file (or directory) instead of a pipe.
        ///   - closeStderrAfter: likewise for standard error (`2>&1 | head`).
        ///   - wrapper: a program that runs the tool, such as `/usr/bin/nohup`.
        ///   - shell: shell words around the tool's start: `umask` runs first, `redirections`
        ///     (`>&-`, `2>&-`) apply to it, as `/bin/sh -c 'umask 000; exec transportkit … >&-'`.
        ///   - launchAsShell: run `/bin/sh` with `arguments` as this user instead of the tool.
        ///   - prefix: a command line the tool's is appended to, as `ip netns exec NS env VAR=… transportkit …`.
        ///   - program: run this command line instead of the tool (a peer, with the same collection of its output).
        init(_ arguments: [String], launchAs user: String? = nil, launchAsShell shellUser: String? = nil, closeStdoutAfter: Int? = nil,
             closeStderrAfter: Int? = nil, stdinPath: String? = nil, wrapper: String? = nil, umask: String? = nil, redirections: String = "",
             prefix: [String] = [], program: [String]? = nil) throws {
            if let program, let first = program.first {
                process.executableURL = URL(fileURLWithPath: first)
                process.arguments = Array(program.dropFirst())
            } else if let first = prefix.first {
                process.executableURL = URL(fileURLWithPath: first)
                process.arguments = Array(prefix.dropFirst()) + [CLI.binary] + arguments
            } else if let shellUser {
                process.executableURL = URL(fileURLWithPath: "/usr/sbin/runuser")
                process.arguments = ["-u", shellUser, "--", "/bin/sh"] + arguments
            } else if umask != nil || !redirections.isEmpty {
                process.executableURL = URL(fileURLWithPath: "/bin/sh")
                process.arguments = ["-c", "\(umask.map { "umask \($0); " } ?? "")exec \"$0\" \"$@\" \(redirections)", CLI.binary] + arguments
            } else if let user {
                process.executableURL = URL(fileURLWithPath: "/usr/sbin/runuser")
                process.arguments = ["-u", user, "--", CLI.binary] + arguments
            } else if let wrapper {
                process.executableURL = URL(fileURLWithPath: wrapper)
                process.arguments = [CLI.binary] + arguments
            } else {
                process.executableURL = URL(fileURLWithPath: CLI.binary)
                process.arguments = arguments
            }
            if let stdinPath, let handle = FileHandle(forReadingAtPath: stdinPath) {
                process.standardInput = handle
            } else {
                process.standardInput = input
            }
            process.standardOutput = output
            process.standardError = errors
            try process.run()
            // Blocking reads run on threads of their own, never on DispatchQueue.global(): on Linux
            // Swift's global executor shares that queue's two-thread width on this machine.
            group.enter()
            Thread { [self] in
                let handle = output.fileHandleForReading
                while true {
                    let chunk = handle.availableData
                    if chunk.isEmpty { break }
                    let total = lock.withLock {
                        out.append(chunk)
                        return out.count
                    }
                    if let limit = closeStdoutAfter, total >= limit {
                        try? handle.close()
                        break
                    }
                }
                group.leave()
            }.start()
            group.enter()
            Thread { [self] in
                let handle = errors.fileHandleForReading
                while true {
                    let chunk = handle.availableData
                    if chunk.isEmpty { break }
                    let total = lock.withLock {
                        err.append(chunk)
                        // Only the new complete lines are split off: a server prints thousands.
                        errPartial.append(chunk)
                        if let last = errPartial.lastIndex(of: UInt8(ascii: "\n")) {
                            errLines += String(decoding: errPartial[..<last], as: UTF8.self).split(separator: "\n").map(String.init)
                            errPartial = Data(errPartial[(last + 1)...])
                        }
                        return err.count
                    }
                    if let limit = closeStderrAfter, total >= limit {
                        try? handle.close()
                        break
                    }
                }
                group.leave()
            }.start()
        }

        /// Standard input is written on a serial queue: a blocking pipe write on a cooperative thread
        /// could deadlock a test whose server task (in this process) must run for the child to read.
        private let writer = DispatchQueue(label: "cli-test-stdin")

        func send(_ bytes: [UInt8]) {
            let handle = input.fileHandleForWriting
            writer.async { try? handle.write(contentsOf: Data(bytes)) }
        }

        func endInput() {
            let handle = input.fileHandleForWriting
            writer.async { try? handle.close() }
        }

        /// Sends `number` (SIGINT, SIGTERM, SIGHUP) to the process.
        func signal(_ number: Int32) {
            kill(process.processIdentifier, number)
        }

        /// Whether the process has exited.
        var isRunning: Bool { process.isRunning }

        /// Standard output so far, as text.
        var stdoutText: String { lock.withLock { String(decoding: out, as: UTF8.self) } }

        /// The standard-error lines so far.
        var stderrLines: [String] {
            lock.withLock { errPartial.isEmpty ? errLines : errLines + [String(decoding: errPartial, as: UTF8.self)] }
        }

        /// Waits for the process to exit (killing it after `timeout` seconds times `testPatience`:
        /// only a process that hangs waits the longer time).
        func wait(timeout: Double = 20) async -> Result {
            let deadline = Date().addingTimeInterval(timeout * testPatience)
            while process.isRunning && Date() < deadline { try? await Task.sleep(for: .milliseconds(20)) }
            if process.isRunning { process.terminate() }
            await withCheckedContinuation { continuation in
                Thread { [self] in
                    process.waitUntilExit()
                    group.wait()
                    continuation.resume()
                }.start()
            }
            return lock.withLock { Result(status: process.terminationStatus, stdout: Array(out), stderr: String(decoding: err, as: UTF8.self)) }
        }
    }

    static func run(_ arguments: [String], stdin: [UInt8] = [], timeout: Double = 20) async throws -> Result {
        let running = try Running(arguments)
        running.send(stdin)
        running.endInput()
        return await running.wait(timeout: timeout)
    }
}

@Suite("transportkit CLI")
struct CLITests {
    @Test func schemesText() async throws {
        let result = try await CLI.run(["schemes"])
        #expect(result.status == 0)
        #expect(result.text.contains("tcp://HOST:PORT[?OPTIONS]"))
        #expect(result.text.contains("unix:///PATH"))
        #expect(result.text.contains("loop://[?buffer=BYTES&messages=BOOL&maxWrite=BYTES]"))
        #expect(result.text.contains("maxWrite (integer 1…67108864; formerly mtu)"), "a renamed option shows its former name")
        #expect(result.text.contains("spy.format (hex|raw, default hex)"), "a wrapper's options are shown with their prefix")
        #expect(result.text.contains("noDelay (bool, default true)"))
    }

    @Test func schemesJSONIsParseable() async throws {
        let result = try await CLI.run(["schemes", "--json"])
        #expect(result.status == 0)
        let array = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout)) as? [[String: Any]])
        // A wrapper may share its name with a scheme (tls:// and tls+URL): "wraps" tells them apart.
        let byName = Dictionary(uniqueKeysWithValues: array.compactMap { item in
            (item["scheme"] as? String).map { ($0 + (item["wraps"] as? Bool == true ? "+" : ""), item) }
        })
        #expect(Set(byName.keys).isSuperset(of: ["tcp", "unix", "loop", "tls", "tls+", "spy+"]))
        #expect(byName["tls"]?["canListen"] as? Bool == true)
        #expect((byName["tls+"]?["options"] as? [[String: Any]])?.contains { $0["name"] as? String == "tls.ca" } == true)
        let tcp = try #require(byName["tcp"])
        #expect(tcp["grammar"] as? String == "tcp://HOST:PORT[?OPTIONS]")
        #expect(tcp["canListen"] as? Bool == true)
        #expect(tcp["portRange"] as? [Int] == [0, 65535])
        #expect(tcp["exclusive"] as? Bool == false)
        #expect(byName["tty"]?["exclusive"] as? Bool == true, "a serial port serves one connection at a time")
        #expect(byName["tty"]?["device"] as? Bool == true && byName["rfc2217"]?["device"] as? Bool == true, "term reconnects to these by default")
        #expect(tcp["device"] as? Bool == false && byName["pty"]?["device"] as? Bool == false)
        let options = try #require(tcp["options"] as? [[String: Any]])
        let noDelay = try #require(options.first { $0["name"] as? String == "noDelay" })
        #expect(noDelay["type"] as? String == "bool")
        #expect(noDelay["default"] as? String == "true")
        #expect(options.contains { $0["name"] as? String == "timeout" })
        let bleOptions = try #require(byName["ble"]?["options"] as? [[String: Any]])
        #expect(bleOptions.first { $0["name"] as? String == "receiveMTU" }?["formerly"] as? [String] == ["mtu"])
        #expect(noDelay["formerly"] == nil, "only a renamed option has former names")
        let modes = try #require(byName["ble"]?["modes"] as? [[String: Any]])
        let gatt = try #require(modes.first { $0["name"] as? String == "ble:// GATT serial connection" })
        #expect(gatt["role"] as? String == "connect")
        #expect(gatt["options"] as? [String] == ["adapter", "rx", "tx", "acquire", "security", "timeout"], "mtu and addressType are not GATT options")
        let tcpModes = try #require(tcp["modes"] as? [[String: Any]])
        #expect(tcpModes.first { $0["role"] as? String == "listen" }?["options"] as? [String] == ["noDelay", "keepAlive", "keepAliveIdle", "backlog"])
    }

    @Test func connectRelaysBytesUntouched() async throws {
        let payload: [UInt8] = Array(0...255) + Array("line\r\n".utf8) + [0, 0xFF]
        let result = try await CLI.run(["connect", "loop://?buffer=65536"], stdin: payload)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stdout == payload)
    }

    @Test func connectThroughSpyKeepsStdoutExactAndTracesOnStderr() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let server = Task {
            let connection = try #require(try await listener.accept())
            var request: [UInt8] = []
            while let chunk = try await connection.read() { request += chunk }
            try await connection.write(request)   // echo, after the CLI's half-close
            try await connection.close()
        }
        let payload: [UInt8] = Array(0...255) + Array("hello\n".utf8)
        let result = try await CLI.run(["connect", "--linger", "10", "spy+tcp://127.0.0.1:\(listener.url.port ?? 0)"], stdin: payload, timeout: 30)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stdout == payload, "standard output carries the peer's bytes only")
        #expect(result.stderr.contains(" OPEN  tcp://127.0.0.1:"), "\(result.stderr)")
        #expect(result.stderr.contains(" TX    0000  00 01 02 03 04 05 06 07  08 09 0a 0b 0c 0d 0e 0f  |................|"), "\(result.stderr)")
        #expect(result.stderr.contains(" RX    0100  68 65 6c 6c 6f 0a") || result.stderr.contains(" RX    0000  68 65 6c 6c 6f 0a"), "\(result.stderr)")
        #expect(result.stderr.contains(" SHUT  "), "\(result.stderr)")
        try await server.value
        try await listener.close()
    }

    @Test func logLevelShowsWhatAConnectionDoesOnStderr() async throws {
        let quiet = try await CLI.run(["connect", "loop://"], stdin: Array("x".utf8))
        #expect(quiet.status == 0)
        #expect(quiet.stderr.isEmpty, "quiet by default: \(quiet.stderr)")
        let verbose = try await CLI.run(["connect", "--log-level", "debug", "loop://"], stdin: Array("x".utf8))
        #expect(verbose.status == 0, "\(verbose.stderr)")
        #expect(verbose.stdout == Array("x".utf8))
        #expect(verbose.stderr.contains("connected"), "\(verbose.stderr)")
        #expect(verbose.stderr.contains("url=loop://"), "\(verbose.stderr)")
        #expect(verbose.stderr.contains("closed"), "\(verbose.stderr)")
        let bad = try await CLI.run(["connect", "--log-level", "loud", "loop://"])
        #expect(bad.status != 0)
        #expect(bad.stderr.contains("--log-level takes one of: trace, debug"), "\(bad.stderr)")
    }

    @Test func connectHalfClosesAndReadsTheAnswer() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let server = Task {
            let connection = try #require(try await listener.accept())
            var request: [UInt8] = []
            while let chunk = try await connection.read() { request += chunk }   // until the CLI's FIN
            try await connection.write(Array(String(decoding: request, as: UTF8.self).uppercased().utf8))
            try await connection.close()
        }
        let big = Array(String(repeating: "abcdefgh", count: 200_000).utf8)  // 1.6 MB through a pipe
        // The peer answers only after reading everything: give it longer than the default linger.
        let result = try await CLI.run(["connect", "--linger", "20", "tcp://127.0.0.1:\(listener.url.port ?? 0)"], stdin: big, timeout: 60)
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stdout.count == big.count)
        #expect(result.stdout.prefix(8) == ArraySlice("ABCDEFGH".utf8))
        try await server.value
        try await listener.close()
    }

    @Test func connectLingersThenExitsWhenThePeerStaysOpen() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let (greeted, greeting) = AsyncStream<Void>.makeStream()
        let server = Task {
            let connection = try #require(try await listener.accept())
            try await connection.write("greeting\n")
            greeting.yield()
            // Never closes; read until the CLI goes away.
            while try await connection.read() != nil {}
            try await connection.close()
        }
        let start = Date()
        let running = try CLI.Running(["connect", "--linger", "0.3", "tcp://127.0.0.1:\(listener.url.port ?? 0)"])
        // Input ends once the greeting is on its way (not after a fixed time, which a loaded
        // machine's slow start would overrun), then the tool lingers 0.3 s and exits.
        for await _ in greeted { break }
        try await Task.sleep(for: .milliseconds(300))
        running.endInput()
        let result = await running.wait()
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.text == "greeting\n")
        // The exit itself is what is checked (a tool still running at wait's 60 s is terminated,
        // and its status is then not 0). Under ThreadSanitizer, with the whole suite on two cores,
        // starting the tool alone has taken seconds: one run took 10.1 s here, against 1.4 s alone.
        #expect(Date().timeIntervalSince(start) < 40)
        try await server.value
        try await listener.close()
    }

    @Test func connectFailuresPrintTheErrorAndExitNonZero() async throws {
        let refused = try await CLI.run(["connect", "tcp://127.0.0.1:1"])
        #expect(refused.status != 0)
        #expect(refused.stderr.contains("refused the connection"))
        #expect(refused.stderr.contains("ECONNREFUSED"))

        let invalid = try await CLI.run(["connect", "tcp://127.0.0.1:1?speed=9"])
        #expect(invalid.status != 0)
        #expect(invalid.stderr.contains("unknown option 'speed'"))
        #expect(invalid.stderr.contains("Grammar: tcp://HOST:PORT"))

        let unknown = try await CLI.run(["connect", "gopher://x:70"])
        #expect(unknown.status != 0)
        #expect(unknown.stderr.contains("no plugin handles gopher://"))
    }

    @Test(.enabled(if: getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/sbin/runuser"),
                   "needs root to run the CLI as an unprivileged user"))
    func permissionDeniedIsExplained() async throws {
        let directory = "/tmp/tk-cli-perm-\(getpid())"
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true,
                                                attributes: [.posixPermissions: 0o755])
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/private.sock"
        let listener = try await Transport.listen(on: "unix://\(path)")
        try FileManager.default.setAttributes([.posixPermissions: 0o600], ofItemAtPath: path)
        let running = try CLI.Running(["connect", "unix://\(path)"], launchAs: "nobody")
        running.endInput()
        let result = await running.wait()
        #expect(result.status != 0)
        #expect(result.stderr.contains("no permission to use \(path)"), "\(result.stderr)")
        #expect(result.stderr.contains("EACCES"))
        try await listener.close()
    }

    @Test func aOneShotBridgeRelaysBetweenAListenerAndAConnection() async throws {
        // An echo server stands in for a device.
        let echo = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let echoTask = Task {
            let connection = try #require(try await echo.accept())
            while let chunk = try await connection.read() { try await connection.write(chunk) }
            try await connection.close()
        }
        let bridge = try CLI.Running(["bridge", "--once", "--json", "--listen", "tcp://127.0.0.1:0", "tcp://127.0.0.1:\(echo.url.port ?? 0)"])
        var listening: String?
        for _ in 0..<500 where listening == nil {
            for line in bridge.stderrLines {
                if let object = try? JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: String],
                   object["event"] == "listening" {
                    listening = object["url"]
                }
            }
            try await Task.sleep(for: .milliseconds(20))
        }
        let url = try #require(listening, "the bridge did not report its listening address: \(bridge.stderrLines)")
        let client = try await Transport.connect(to: url)
        for index in 0..<50 {
            try await client.write("frame \(index)\n")
            #expect(try await client.readLine(timeout: .seconds(10)) == "frame \(index)")
        }
        try await client.closeWrite()
        #expect(try await client.read(timeout: .seconds(10)) == nil, "the bridge passes the end of stream on")
        try await client.close()
        let result = await bridge.wait()
        #expect(result.status == 0, "\(result.stderr)")
        #expect(result.stderr.contains("\"event\":\"accepted\""))
        try await echoTask.value
        try await echo.close()
    }

    @Test func bridgeNeedsTwoEndpoints() async throws {
        let result = try await CLI.run(["bridge", "loop://"])
        #expect(result.status != 0)
        #expect(result.stderr.contains("two endpoints"))
    }
}
