import Foundation
import Glibc
import Synchronization
import TestSupport
import Testing
import TransportKit

/// Issue 25: what the tool writes and removes, options and inputs taken wrongly, and a server
/// strangers can reach. Each test drives the real binary where the finding was made through it.
@Suite("transportkit: files it writes, a server strangers can reach")
struct SecurityTests {
    static let asRoot = getuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/sbin/runuser")

    // MARK: - spy.file (items 1 to 4)

    @Test func aTraceFileThatIsASymbolicLinkIsNotFollowed() async throws {
        let victim = temporaryPath("victim")
        try "secret\n".write(toFile: victim, atomically: false, encoding: .utf8)
        let link = temporaryPath("trace.txt")
        #expect(symlink(victim, link) == 0)
        let result = try await CLI.run(["connect", "spy+loop://?spy.file=\(link)"], stdin: Array("password\n".utf8))
        #expect(result.status == 1, "\(result.stderr)")
        #expect(result.stderr.contains("is a symbolic link"), "\(result.stderr)")
        #expect(result.stderr.contains("ELOOP"), "\(result.stderr)")
        #expect(try String(contentsOfFile: victim, encoding: .utf8) == "secret\n", "the link's target is untouched")
        #expect(result.stdout.isEmpty, "nothing was relayed")
    }

    @Test(.enabled(if: asRoot, "needs root to plant a link as another user"))
    func aLinkAnotherUserPlantedInAStickyDirectoryIsRefused() async throws {
        // /tmp's setting: world-writable and sticky, as a shared directory is.
        let shared = temporaryPath("sticky")
        #expect(mkdir(shared, 0o1777) == 0 && chmod(shared, 0o1777) == 0)
        let victim = temporaryPath("root-only")
        try "root's\n".write(toFile: victim, atomically: false, encoding: .utf8)
        #expect(chmod(victim, 0o600) == 0)
        // nobody plants the link the docs' example names, and a directory link on the way.
        let plant = try CLI.Running(["-c", "ln -s \(victim) \(shared)/trace.txt && ln -s / \(shared)/logs"], launchAsShell: "nobody")
        #expect(await plant.wait(timeout: 15).status == 0)
        for trace in ["\(shared)/trace.txt", "\(shared)/logs\(victim)"] {
            let result = try await CLI.run(["connect", "spy+loop://?spy.file=\(trace)"], stdin: Array("password\n".utf8))
            #expect(result.status == 1, "\(trace): \(result.stderr)")
            #expect(result.stderr.contains("symbolic link"), "\(trace): \(result.stderr)")
            #expect(result.stderr.contains("nobody"), "the message names the link's owner: \(result.stderr)")
        }
        #expect(try String(contentsOfFile: victim, encoding: .utf8) == "root's\n", "the root-only file is untouched")
    }

    @Test(.enabled(if: asRoot, "needs root to plant a link as another user"))
    func anotherUsersLinkInsideOneOfOursIsRefusedToo() async throws {
        // Our own link points at a path that goes through nobody's link: the kernel would follow
        // both in one step; the walk reads our link's target and checks each link in it.
        let shared = temporaryPath("sticky")
        #expect(mkdir(shared, 0o1777) == 0 && chmod(shared, 0o1777) == 0)
        let victim = temporaryPath("root-only")
        try "root's\n".write(toFile: victim, atomically: false, encoding: .utf8)
        #expect(chmod(victim, 0o600) == 0)
        let plant = try CLI.Running(["-c", "ln -s / \(shared)/logs"], launchAsShell: "nobody")
        #expect(await plant.wait(timeout: 15).status == 0)
        let ours = temporaryPath("ours")
        #expect(symlink("\(shared)/logs", ours) == 0)
        let result = try await CLI.run(["connect", "spy+loop://?spy.file=\(ours)\(victim)"], stdin: Array("password\n".utf8))
        #expect(result.status == 1, "\(result.stderr)")
        #expect(result.stderr.contains("goes through the symbolic link 'logs', owned by nobody"), "\(result.stderr)")
        #expect(try String(contentsOfFile: victim, encoding: .utf8) == "root's\n", "the root-only file is untouched")
        // Our own links, one inside the other, are followed: the trace lands where they lead.
        let directory = temporaryPath("real")
        #expect(mkdir(directory, 0o700) == 0)
        let inner = temporaryPath("inner")
        #expect(symlink(directory, inner) == 0)
        let outer = temporaryPath("outer")
        #expect(symlink(inner, outer) == 0)
        let followed = try await CLI.run(["connect", "spy+loop://?spy.file=\(outer)/trace.txt"], stdin: Array("x".utf8))
        #expect(followed.status == 0, "\(followed.stderr)")
        #expect(FileManager.default.fileExists(atPath: "\(directory)/trace.txt"))
    }

    @Test(.enabled(if: asRoot, "needs root to make a file as another user"))
    func anExistingTraceFileOfAnotherUserIsRefused() async throws {
        let shared = temporaryPath("sticky")
        #expect(mkdir(shared, 0o1777) == 0 && chmod(shared, 0o1777) == 0)
        let plant = try CLI.Running(["-c", "umask 000; printf 'mine\\n' > \(shared)/trace.txt"], launchAsShell: "nobody")
        #expect(await plant.wait(timeout: 15).status == 0)
        let result = try await CLI.run(["connect", "spy+loop://?spy.file=\(shared)/trace.txt"], stdin: Array("password\n".utf8))
        #expect(result.status == 1, "\(result.stderr)")
        #expect(result.stderr.contains("belongs to nobody"), "\(result.stderr)")
        #expect(try String(contentsOfFile: "\(shared)/trace.txt", encoding: .utf8) == "mine\n", "the planted file got no trace")
    }

    @Test func aTraceWithASecondHardLinkIsRefused() async throws {
        let original = temporaryPath("original")
        try "keep\n".write(toFile: original, atomically: false, encoding: .utf8)
        let second = temporaryPath("trace.txt")
        #expect(link(original, second) == 0)
        let result = try await CLI.run(["connect", "spy+loop://?spy.file=\(second)"], stdin: Array("x".utf8))
        #expect(result.status == 1)
        #expect(result.stderr.contains("2 hard links"), "\(result.stderr)")
        #expect(try String(contentsOfFile: original, encoding: .utf8) == "keep\n")
    }

    @Test func aNewTraceIsOwnerOnlyAndAnExistingOneIsAppendedTo() async throws {
        let trace = temporaryPath("trace.txt")
        let first = try CLI.Running(["connect", "spy+loop://?spy.file=\(trace)"], umask: "000")
        first.send(Array("password\n".utf8))
        first.endInput()
        let result = await first.wait(timeout: 15)
        #expect(result.status == 0, "\(result.stderr)")
        var info = stat()
        #expect(stat(trace, &info) == 0)
        #expect(info.st_mode & 0o777 == 0o600, "created owner-only even with umask 000: \(String(info.st_mode & 0o777, radix: 8))")
        let before = try String(contentsOfFile: trace, encoding: .utf8)
        #expect(before.contains("TX    0000  70 61 73 73"), "\(before)")
        let again = try await CLI.run(["connect", "spy+loop://?spy.file=\(trace)"], stdin: Array("second\n".utf8))
        #expect(again.status == 0)
        let after = try String(contentsOfFile: trace, encoding: .utf8)
        #expect(after.hasPrefix(before), "the first trace is kept")
        #expect(after.components(separatedBy: " OPEN  ").count == 3, "two traces, one after the other: \(after)")
    }

    @Test func aTraceAtAFIFONeverHangsAndABridgeRefusesItAtStart() async throws {
        let fifo = temporaryPath("fifo")
        #expect(mkfifo(fifo, 0o600) == 0)
        let started = ContinuousClock.now
        let result = try await CLI.run(["connect", "spy+loop://?timeout=0&spy.file=\(fifo)"], timeout: 30)
        #expect(result.status == 1, "\(result.stderr)")
        #expect(result.stderr.contains("is a FIFO (named pipe)"), "\(result.stderr)")
        #expect(ContinuousClock.now - started < .seconds(45), "open(2) did not wait for a reader (killed at 90 s otherwise)")
        let bridge = try await CLI.run(["bridge", "--listen", "tcp://127.0.0.1:0", "spy+loop://?spy.file=\(fifo)"], timeout: 30)
        #expect(bridge.status == 1, "\(bridge.stderr)")
        #expect(!bridge.stderr.split(separator: "\n").contains { $0.hasPrefix("listening ") }, "checked before anything listens: \(bridge.stderr)")
        #expect(bridge.stderr.contains("is a FIFO"))
    }

    @Test func characterDevicesTakeATraceAndAFullOneIsReportedOnce() async throws {
        let null = try await CLI.run(["connect", "spy+loop://?spy.file=/dev/null"], stdin: Array("abc".utf8))
        #expect(null.status == 0, "\(null.stderr)")
        #expect(null.stdout == Array("abc".utf8))
        #expect(null.stderr.isEmpty, "\(null.stderr)")
        let full = try await CLI.run(["connect", "spy+loop://?spy.file=/dev/full"], stdin: Array("abc".utf8))
        #expect(full.status == 0, "a trace that cannot be written does not break the connection: \(full.stderr)")
        #expect(full.stdout == Array("abc".utf8))
        #expect(full.stderr.contains("ENOSPC (No space left on device)"), "\(full.stderr)")
        #expect(full.stderr.components(separatedBy: "spy: writing the trace").count == 2, "reported once: \(full.stderr)")
    }

    @Test func aBridgeKeepsEveryClientsTraceRecordsWithItsNumber() async throws {
        let echo = try await Self.echoServer()
        let trace = temporaryPath("bridge-trace.txt")
        try "earlier trace\n".write(toFile: trace, atomically: false, encoding: .utf8)
        #expect(chmod(trace, 0o600) == 0)
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0",
                                      "spy+tcp://127.0.0.1:\(echo.url.port ?? 0)?spy.file=\(trace)"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        try await withThrowingTaskGroup(of: Void.self) { group in
            for index in 1...4 {
                group.addTask {
                    let client = try await Transport.connect(to: url)
                    for round in 0..<20 {
                        try await client.write("client\(index) round\(round)\n")
                        _ = try await client.readLine(timeout: .seconds(10))
                    }
                    try await client.close()
                }
            }
            try await group.waitForAll()
        }
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
        let bytes = try Array(Data(contentsOf: URL(fileURLWithPath: trace)))
        #expect(!bytes.contains(0), "no NUL holes")
        let text = String(decoding: bytes, as: UTF8.self)
        #expect(text.hasPrefix("earlier trace\n"), "the file was appended to, not truncated")
        for index in 1...4 {
            #expect(text.contains("#\(index)    "), "client \(index)'s lines carry its number")
            let opens = text.split(separator: "\n").filter { $0.hasPrefix("#\(index) ") && $0.contains(" OPEN ") }
            #expect(opens.count == 1, "client \(index) opened the target once")
            let sent = text.split(separator: "\n").filter { $0.hasPrefix("#\(index) ") && $0.contains(" TX ") }.count
            #expect(sent >= 20, "every record of client \(index) is kept (\(sent) TX lines)")
        }
        try await echo.close()
    }

    @Test func aRawTraceOfASharedTargetIsRefusedAtStart() async throws {
        let result = try await CLI.run(["bridge", "--listen", "tcp://127.0.0.1:0", "spy+loop://?spy.format=raw&spy.file=\(temporaryPath("raw"))"])
        #expect(result.status == 64, "\(result.stderr)")
        #expect(result.stderr.contains("would mix their bytes in one trace"), "\(result.stderr)")
    }

    // MARK: - What the tool removes (item 5)

    @Test func aPtyLinkReplacedByAFileIsNotRemoved() async throws {
        let link = temporaryPath("ttyFAKE")
        let running = try CLI.Running(["connect", "pty://?link=\(link)"])
        #expect(await eventually(10) { FileManager.default.destinationOfSymbolicLinkAtPathOrNil(link) != nil })
        #expect(unlink(link) == 0)
        try "someone else's\n".write(toFile: link, atomically: false, encoding: .utf8)
        running.signal(SIGTERM)
        // The replacement may come before the tool's record of its link: it then ends at once,
        // busy, and leaves the file too.
        let ended = await running.wait(timeout: 15)
        #expect(ended.status == 143 || (ended.status == 1 && ended.stderr.contains("was removed or replaced right after it was made")),
                "\(ended.status) \(ended.stderr)")
        #expect(try String(contentsOfFile: link, encoding: .utf8) == "someone else's\n", "the file put in the link's place stays")
    }

    @Test func anotherProcesssSocketAtTheListenersPathIsNotRemoved() async throws {
        let path = temporaryPath("shared.sock")
        let bridge = try CLI.Running(["bridge", "--listen", "unix://\(path)", "loop://"])
        #expect(await eventually(10) { bridge.stderrLines.contains { $0.hasPrefix("listening") } })
        // The socket file goes, and another program binds its own at the same path.
        #expect(unlink(path) == 0)
        let other = try await Transport.listen(on: "unix://\(path)")
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
        #expect(FileManager.default.fileExists(atPath: path), "the other program's socket stays")
        let client = try await Transport.connect(to: "unix://\(path)")
        let accepted = try #require(try await other.accept())
        try await client.close()
        try await accepted.close()
        try await other.close()
    }

    // MARK: - A unix listener's mode (item 6)

    @Test func aUnixListenerIsOwnerOnlyByDefaultAndTakesExactlyTheModeAskedFor() async throws {
        for (mode, umask, expected) in [(nil, "000", 0o600), ("0660", "077", 0o660), ("0600", "022", 0o600)] as [(String?, String, mode_t)] {
            let path = temporaryPath("mode.sock")
            let url = "unix://\(path)" + (mode.map { "?mode=\($0)" } ?? "")
            let bridge = try CLI.Running(["bridge", "--listen", url, "loop://"], umask: umask)
            #expect(await eventually(10) { bridge.stderrLines.contains { $0.hasPrefix("listening") } }, "\(bridge.stderrLines)")
            var info = stat()
            #expect(lstat(path, &info) == 0)
            #expect(info.st_mode & 0o7777 == expected, "\(url) under umask \(umask): \(String(info.st_mode & 0o7777, radix: 8))")
            bridge.signal(SIGTERM)
            #expect(await bridge.wait(timeout: 15).status == 143)
        }
    }

    // MARK: - Checked before listening; a client told why (item 9)

    @Test func aTargetThatCanNeverWorkFailsBeforeAnythingListens() async throws {
        let directory = temporaryPath("a-directory")
        #expect(mkdir(directory, 0o700) == 0)
        for target in ["rfcomm://zz", "ble://ZZZZ:128/00:11:22:33:44:55", "spy+loop://?spy.file=\(directory)", "ble://nus/+0:+0:+0:+0:+0:+0",
                       "tty:///etc/hostname", "unix:///etc/hostname", "tty://usb/0403:6001?serial="] {
            let result = try await CLI.run(["bridge", "--listen", "tcp://127.0.0.1:0", target])
            #expect(result.status == 1, "\(target): \(result.stderr)")
            #expect(!result.stderr.split(separator: "\n").contains { $0.hasPrefix("listening ") }, "\(target): \(result.stderr)")
        }
    }

    @Test func aClientTheTargetFailsIsToldInOneLineWithoutTheTarget() async throws {
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0", "tcp://127.0.0.1:1"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        let client = try await Transport.connect(to: url)
        let line = try await client.readLine(timeout: .seconds(10))
        #expect(line == "transportkit: error: the bridge cannot open its target now (refused); try again later", "\(String(describing: line))")
        #expect(try await client.read(timeout: .seconds(10)) == nil, "then closed")
        try await client.close()
        bridge.signal(SIGINT)
        let result = await bridge.wait(timeout: 15)
        #expect(result.status == 130)
        #expect(result.stderr.contains("\"failed\""), "the operator sees the error: \(result.stderr)")
    }

    // MARK: - Standard streams closed at start (item 11)

    @Test func aClosedStandardOutputOrInputIsAnError() async throws {
        let noOutput = try CLI.Running(["connect", "loop://"], redirections: ">&-")
        noOutput.send(Array("dropped?\n".utf8))
        noOutput.endInput()
        let result = await noOutput.wait(timeout: 15)
        #expect(result.status == 1, "\(result.stderr)")
        #expect(result.stderr.contains("standard output is closed"), "\(result.stderr)")
        let noInput = try await CLI.Running(["connect", "loop://"], redirections: "<&-").wait(timeout: 15)
        #expect(noInput.status == 1, "\(noInput.stderr)")
        #expect(noInput.stderr.contains("standard input is closed"), "\(noInput.stderr)")
    }

    @Test func statusLinesNeverGoIntoASocketWhenStandardErrorIsClosed() async throws {
        let path = temporaryPath("noerr.sock")
        let bridge = try CLI.Running(["bridge", "--listen", "unix://\(path)", "loop://"], redirections: "2>&-")
        // No status line to wait for: connect until the socket listens (bind comes just before listen).
        var connected: Connection?
        for _ in 0..<500 where connected == nil {
            connected = try? await Transport.connect(to: "unix://\(path)")
            if connected == nil { try await Task.sleep(for: .milliseconds(20)) }
        }
        let client = try #require(connected)
        try await client.write("ping")
        try await client.closeWrite()
        var echoed: [UInt8] = []
        while let chunk = try await client.read(timeout: .seconds(10)) { echoed += chunk }
        #expect(echoed == Array("ping".utf8), "only the relayed bytes: \(String(decoding: echoed, as: UTF8.self))")
        try await client.close()
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
    }

    // MARK: - Strangers (items 12 to 15)

    @Test func clientsBeyondTheLimitAreToldAndClosed() async throws {
        let bridge = try CLI.Running(["bridge", "--json", "--max-clients", "2", "--listen", "tcp://127.0.0.1:0", "loop://"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        let first = try await Transport.connect(to: url)
        let second = try await Transport.connect(to: url)
        #expect(await eventually(10) { bridge.stderrLines.filter { $0.contains("\"accepted\"") }.count == 2 })
        let third = try await Transport.connect(to: url)
        #expect(try await third.readLine(timeout: .seconds(10)) == "transportkit: busy: the bridge serves as many clients as it may; try again later")
        #expect(try await third.read(timeout: .seconds(10)) == nil)
        try await first.write("still served")
        #expect(try await first.read(timeout: .seconds(10)) == Array("still served".utf8))
        for client in [first, second, third] { try await client.close() }
        // Once one leaves, the next is served.
        #expect(await eventually(10) { bridge.stderrLines.filter { $0.contains("\"closed\"") }.count >= 2 })
        let fourth = try await Transport.connect(to: url)
        try await fourth.write("x")
        #expect(try await fourth.read(timeout: .seconds(10)) == Array("x".utf8))
        try await fourth.close()
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
    }

    @Test func listeningBeyondLoopbackSaysThereIsNoAuthentication() async throws {
        let open = try CLI.Running(["bridge", "--listen", "tcp://0.0.0.0:0", "loop://"])
        #expect(await eventually(10) { open.stderrLines.contains { $0.hasPrefix("warning") } }, "\(open.stderrLines)")
        let warning = open.stderrLines.first { $0.hasPrefix("warning") } ?? ""
        #expect(warning.contains("does not authenticate clients"), "\(warning)")
        #expect(warning.contains("any machine that can reach 0.0.0.0"), "\(warning)")
        #expect(warning.contains("use loop://"), "\(warning)")
        open.signal(SIGTERM)
        #expect(await open.wait(timeout: 15).status == 143)
        #expect(open.stderrLines.filter { $0.hasPrefix("warning") }.count == 1, "said once")

        let json = try CLI.Running(["bridge", "--json", "--listen", "tcp://[::]:0", "loop://"])
        #expect(await eventually(10) { json.stderrLines.contains { $0.contains("\"event\":\"warning\"") } }, "\(json.stderrLines)")
        json.signal(SIGTERM)
        #expect(await json.wait(timeout: 15).status == 143)

        let local = try CLI.Running(["bridge", "--listen", "tcp://127.0.0.1:0", "loop://"])
        #expect(await eventually(10) { local.stderrLines.contains { $0.hasPrefix("listening") } })
        try await Task.sleep(for: .milliseconds(200))
        local.signal(SIGTERM)
        let result = await local.wait(timeout: 15)
        #expect(!result.stderr.contains("warning"), "loopback: no warning: \(result.stderr)")
    }

    @Test func aTargetKeptOpenAcrossClientsIsTracedAsKept() async throws {
        let pty = try PTY()
        let trace = temporaryPath("kept-trace.txt")
        let bridge = try CLI.Running(["bridge", "--json", "--keep-open", "--listen", "tcp://127.0.0.1:0", "spy+tty://\(pty.peerPath)?spy.file=\(trace)"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        for (number, word) in ["one", "two"].enumerated() {
            let client = try await Transport.connect(to: url)
            try await client.write(word)
            #expect(await pty.readMaster(count: 3) == Array(word.utf8))
            try await client.close()
            #expect(await eventually(10) { bridge.stderrLines.filter { $0.contains("\"closed\"") }.count == number + 1 }, "one session after the other")
        }
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
        let lines = try String(contentsOfFile: trace, encoding: .utf8).split(separator: "\n")
        #expect(!lines.isEmpty && lines.allSatisfy { $0.hasPrefix("kept ") }, "no client's number is given to a connection they all used: \(lines)")
        #expect(lines.filter { $0.contains(" OPEN ") }.count == 1, "opened once: \(lines)")
        #expect(lines.filter { $0.contains(" TX ") }.count == 2, "both clients' bytes: \(lines)")
    }

    @Test func aBusyRefusalDoesNotNameTheDevice() async throws {
        let pty = try PTY()
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0", "tty://\(pty.peerPath)"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        let first = try await Transport.connect(to: url)
        try await first.write("one")
        #expect(await pty.readMaster(count: 3) == Array("one".utf8))
        let second = try await Transport.connect(to: url)
        let refusal = try #require(try await second.readLine(timeout: .seconds(10)))
        #expect(refusal == "transportkit: busy: the device serves another client; try again later")
        #expect(!refusal.contains(pty.peerPath) && !refusal.contains("tty"), "\(refusal)")
        try await second.close()
        try await first.close()
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 15).status == 143)
    }

    @Test func ctrlCDuringAWaitThatOpenedNothingEndsAtOnce() async throws {
        let running = try CLI.Running(["connect", "tty:///dev/tk-never-\(getpid())?wait=true&timeout=60"])
        try await Task.sleep(for: .milliseconds(700))
        #expect(running.isRunning, "it waits for the device")
        let signalled = ContinuousClock.now
        running.signal(SIGINT)
        let result = await running.wait(timeout: 15)
        let took = ContinuousClock.now - signalled
        #expect(result.status == 130, "\(result.stderr)")
        // The emergency exit after the 3-second cleanup limit says so: its absence is the check,
        // not the time taken (a ThreadSanitizer build took 2.7 s to start and end).
        #expect(!result.stderr.contains("took longer than 3 s"), "ended in \(took) by the emergency exit: \(result.stderr)")
    }

    // MARK: - Helpers

    /// A tcp echo server in this process.
    static func echoServer() async throws -> Listener {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0?backlog=4096")
        Task {
            try await withThrowingDiscardingTaskGroup { group in
                while let connection = try await listener.accept() {
                    group.addTask {
                        while let chunk = try await connection.readBuffer() { try await connection.write(chunk) }
                        try await connection.close()
                    }
                }
            }
        }
        return listener
    }

    /// A plain blocking TCP client socket to 127.0.0.1:`port`: cheaper than a Connection for
    /// thousands of clients that say nothing.
    static func rawConnect(port: UInt16, receiveBuffer: Int32? = nil) throws -> Int32 {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw POSIXError(.EMFILE) }
        if var size = receiveBuffer {
            _ = setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = port.bigEndian
        address.sin_addr.s_addr = UInt32(0x7F00_0001).bigEndian
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard connected == 0 else {
            Glibc.close(fd)
            throw POSIXError(.ECONNREFUSED)
        }
        return fd
    }

    static func raiseDescriptorLimit() {
        var limit = rlimit()
        guard getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return }
        limit.rlim_cur = limit.rlim_max
        _ = setrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit)
    }

    /// VmRSS of a process in KB.
    static func residentKB(_ pid: Int32) -> Int {
        let status = (try? String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8)) ?? ""
        let line = status.split(separator: "\n").first { $0.hasPrefix("VmRSS:") } ?? ""
        return Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "") ?? 0
    }
}

/// Loads that keep both cores busy for seconds: Scripts/test runs this suite on its own, after the
/// others, so that their timing-sensitive tests are not starved.
@Suite("a bridge under strangers' load")
struct StrangerLoadTests {
    @Test func twoThousandSilentClientsDoNotLockOutARealOne() async throws {
        SecurityTests.raiseDescriptorLimit()
        let echo = try await SecurityTests.echoServer()
        // A backlog that holds the burst: the connects below are made as fast as one thread can.
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0?backlog=4096", "tcp://127.0.0.1:\(echo.url.port ?? 0)"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        let port = try #require(try TransportURL(url).port)
        let silent = try (0..<2000).map { _ in try SecurityTests.rawConnect(port: UInt16(port)) }
        #expect(await eventually(60) { bridge.stderrLines.filter { $0.contains("\"accepted\"") }.count >= 2000 }, "every silent client was accepted")
        let asked = ContinuousClock.now
        let real = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        try await real.write("ping\n")
        #expect(try await real.readLine(timeout: .seconds(10)) == "ping", "the real client is served")
        // At once: 2 ms in the benchmark, under 1 s when this suite runs alone (as Scripts/test
        // runs it); 3.5 s was seen beside the other suites and a build, hence 5 s.
        #expect(ContinuousClock.now - asked < .seconds(5), "served in \(ContinuousClock.now - asked)")
        try await real.close()
        for fd in silent { Glibc.close(fd) }
        bridge.signal(SIGTERM)
        let result = await bridge.wait(timeout: 60)
        #expect(result.status == 143)
        #expect(!result.stderr.contains("\"refused\""), "nobody was turned away")
        try await echo.close()
    }

    @Test func clientsThatNeverReadCostABoundedAmountOfMemory() async throws {
        // The target streams as fast as it can; fifty clients never read. Before issue 25 each cost
        // 2 to 4 MB (the writer's 4 MiB in-flight cap); the bridge's compact buffering bounds it
        // near 300 KB. The bound checked here, 1 MB a client, leaves room for allocator slack.
        let streamer = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let feeding = Task {
            try await withThrowingDiscardingTaskGroup { group in
                while let connection = try await streamer.accept() {
                    group.addTask {
                        let chunk = [UInt8](repeating: 0x55, count: 65536)
                        while true { try await connection.write(chunk) }
                    }
                }
            }
        }
        let bridge = try CLI.Running(["bridge", "--json", "--listen", "tcp://127.0.0.1:0", "tcp://127.0.0.1:\(streamer.url.port ?? 0)"])
        let url = try #require(await HostileUseTests.listeningURL(of: bridge))
        let port = try #require(try TransportURL(url).port)
        let before = SecurityTests.residentKB(bridge.process.processIdentifier)
        let clients = try (0..<50).map { _ in try SecurityTests.rawConnect(port: UInt16(port), receiveBuffer: 4096) }
        // Until the bridge's memory stops growing (it fills what it may hold, then waits).
        var last = 0
        for _ in 0..<40 {
            try await Task.sleep(for: .milliseconds(500))
            let now = SecurityTests.residentKB(bridge.process.processIdentifier)
            if now - last < 256 && last > 0 { break }
            last = now
        }
        let grown = SecurityTests.residentKB(bridge.process.processIdentifier) - before
        #expect(grown < 50 * 1024, "50 clients that never read grew the bridge by \(grown) KB")
        for fd in clients { Glibc.close(fd) }
        bridge.signal(SIGTERM)
        #expect(await bridge.wait(timeout: 30).status == 143)
        feeding.cancel()
        try await streamer.close()
    }
}
