import Foundation
import Glibc
import Synchronization
import SystemPackage
import TestSupport
import Testing
@_spi(Plugins) @testable import TransportKit
@_spi(Plugins) import TransportKitLinux

/// What `fd` refers to ("socket:[4711]", "pipe:[…]"); checking that no descriptor refers to it
/// later is exact where testing the number is not (numbers are reused at once by parallel tests).
private func target(of fd: Int32) -> String {
    (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(fd)")) ?? "?"
}

private func isOpen(_ target: String) -> Bool {
    Descriptors.open().contains { $0.target == target }
}

/// A connected pair of Unix sockets of `type`, close-on-exec.
private func socketPair(_ type: __socket_type = SOCK_STREAM) throws -> (Int32, Int32) {
    var fds: [Int32] = [-1, -1]
    guard socketpair(AF_UNIX, Int32(type.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &fds) == 0 else {
        throw TransportError.posix("socketpair", errno: Syscall.errno, what: "a test pair")
    }
    return (fds[0], fds[1])
}

@Suite("TransportKitLinux: the syscall funnel")
struct SyscallTests {
    @Test func aFailureNamesTheCallTheErrnoAndTheObject() {
        let error = #expect(throws: TransportError.self) {
            try Syscall.run("ioctl(TIOCMGET)", on: "/dev/null") { ioctl(-1, UInt(TIOCMGET)) }
        }
        #expect(error?.errno == .badFileDescriptor)
        #expect(error?.syscall == "ioctl(TIOCMGET)")
        #expect(error?.message.contains("/dev/null") == true)
        #expect(error?.description.contains("EBADF") == true, "\(String(describing: error))")
    }

    @Test func interruptedCallsAreRetriedAndErrnoIsReadAtOnce() throws {
        let attempts = Locked(0)
        let result = try Syscall.run("read", on: "a test") { () -> Int32 in
            let attempt = attempts.withLock { count in
                count += 1
                return count
            }
            if attempt < 3 {
                Glibc.errno = EINTR
                return -1
            }
            return 42
        }
        #expect(result == 42)
        #expect(attempts.withLock { $0 } == 3)
        #expect(Syscall.attempt { () -> Int32 in Glibc.errno = EACCES; return -1 } == .failure(.permissionDenied))
    }

    @Test func errnoKindsAndNamesComeFromThePlatform() {
        #expect(TransportError.Kind(errno: .connectionReset) == .disconnected)
        #expect(TransportError.Kind(errno: .addressInUse) == .busy)
        #expect(TransportError.Kind(errno: .inappropriateIOCTLForDevice) == .unsupported)
        #expect(Errno.connectionRefused.symbolicDescription.hasPrefix("ECONNREFUSED ("))
        #expect(Errno(rawValue: 4095).symbolicDescription.hasPrefix("errno 4095"))
    }
}

@Suite("TransportKitLinux: paths this process made")
struct OwnedPathTests {
    @Test func aLinkIsRecordedOnlyWhileItIsTheLinkMadeAndRemovedOnlyThen() throws {
        let link = temporaryPath("owned-link")
        #expect(symlink("/dev/null", link) == 0)
        defer { unlink(link) }
        #expect(OwnedPath(recording: link, kind: S_IFLNK, target: "/dev/zero") == nil, "a link to somewhere else is not the one made")
        #expect(OwnedPath(recording: link, kind: S_IFSOCK) == nil, "a link is not a socket file")
        let owned = try #require(OwnedPath(recording: link, kind: S_IFLNK, target: "/dev/null"))
        // Another program replaces it with a file of its own: that file stays.
        #expect(unlink(link) == 0)
        try "someone else's".write(toFile: link, atomically: false, encoding: .utf8)
        #expect(!owned.isStillOurs)
        #expect(!owned.remove())
        #expect(FileManager.default.fileExists(atPath: link))
        // Replaced before the record was taken (the race between symlink(2) and lstat(2)).
        #expect(OwnedPath(recording: link, kind: S_IFLNK, target: "/dev/null") == nil)
        #expect(OwnedPath(recording: link + ".none", kind: S_IFLNK) == nil, "nothing there")
        #expect(unlink(link) == 0)
        #expect(symlink("/dev/null", link) == 0)
        #expect(OwnedPath(recording: link, kind: S_IFLNK, target: "/dev/null")?.remove() == true)
        #expect(!FileManager.default.fileExists(atPath: link) && (try? FileManager.default.destinationOfSymbolicLink(atPath: link)) == nil)
    }
}

@Suite("TransportKitLinux: descriptors on the event loop")
struct DescriptorChannelTests {
    @Test func anAdoptedSocketCarriesBytesAndHalfClosesForReal() async throws {
        let (mine, peer) = try socketPair()
        defer { _ = Glibc.close(peer) }
        let socket = target(of: mine)
        let backend = try await DescriptorChannel.adoptSocket(FileDescriptor(rawValue: mine), describing: "a socketpair")
        let connection = Connection(url: try TransportURL("loop://"), backend: backend)
        #expect(connection.supportsHalfClose)
        #expect(connection.preferredExecutor != nil)
        try await connection.write("to the peer")
        try await connection.closeWrite()
        #expect(await Support.readAll(peer) == Array("to the peer".utf8), "shutdown(SHUT_WR) reached the peer as an end")
        Support.writeAll(peer, Array("back".utf8))
        _ = Glibc.shutdown(peer, Int32(SHUT_WR))
        var received: [UInt8] = []
        while let chunk = try await connection.read(timeout: .seconds(5)) { received += chunk }
        #expect(received == Array("back".utf8))
        try await connection.close()
        #expect(!isOpen(socket), "the channel closed the descriptor it owned")
    }

    @Test func whatIsNotAStreamSocketIsRefusedAndClosed() async throws {
        let path = Support.temporaryPath("not-a-socket")
        let file = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        defer { unlink(path) }
        let fileTarget = target(of: file)
        let notASocket = await expectTransportError(.io) {
            try await DescriptorChannel.adoptSocket(FileDescriptor(rawValue: file), describing: "a file")
        }
        #expect(notASocket?.errno == .notSocket)
        #expect(notASocket?.syscall == "getsockopt(SO_TYPE)")
        #expect(!isOpen(fileTarget), "refused descriptors are closed: they were handed over")

        let (records, other) = try socketPair(SOCK_SEQPACKET)
        defer { _ = Glibc.close(other) }
        let recordSocket = target(of: records)
        let seqpacket = await expectTransportError(.misuse) {
            try await DescriptorChannel.adoptSocket(FileDescriptor(rawValue: records), describing: "a SEQPACKET socket")
        }
        #expect(seqpacket?.message.contains("not a stream socket") == true)
        #expect(!isOpen(recordSocket))
    }

    @Test func aRegularFileIsNotPutOnTheEventLoop() async throws {
        let path = Support.temporaryPath("regular")
        let file = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        defer { _ = Glibc.close(file); unlink(path) }
        let before = Descriptors.open().filter { $0.target == path }.count
        let error = await expectTransportError(.misuse) {
            try await DescriptorChannel.adoptDuplicate(of: FileDescriptor(rawValue: file), describing: path)
        }
        #expect(error?.message.contains("regular file") == true)
        #expect(Descriptors.open().filter { $0.target == path }.count == before, "no duplicate left open")
    }

    @Test func aDescriptorWaitsForReadinessWithoutAThreadAndCancels() async throws {
        let (mine, peer) = try socketPair()
        defer { _ = Glibc.close(mine); _ = Glibc.close(peer) }
        let fd = FileDescriptor(rawValue: mine)
        try await fd.wait(until: .writable)  // an empty socket buffer: at once
        let waiter = Task { try await fd.wait(until: .readable) }
        try await Task.sleep(for: .milliseconds(50))
        waiter.cancel()
        await #expect(throws: CancellationError.self) { try await waiter.value }
        let reader = Task { try await fd.wait(until: .readable) }
        try await Task.sleep(for: .milliseconds(20))
        Support.writeAll(peer, [1])
        try await reader.value
    }
}

@Suite("TransportKitLinux: the readiness poller")
struct ReadinessPollerTests {
    /// Fills `fd`'s send buffer (non-blocking sends until EAGAIN); returns how many bytes it took.
    private func fill(_ fd: Int32) -> Int {
        let chunk = [UInt8](repeating: 7, count: 4096)
        var sent = 0
        while true {
            let count = chunk.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT | MSG_NOSIGNAL)) }
            guard count > 0 else { return sent }
            sent += count
        }
    }

    @Test func aReaderAndAWriterWaitOnOneDescriptorAndEachWakesForItsOwnEvent() async throws {
        let (mine, peer) = try socketPair()
        defer { _ = Glibc.close(mine); _ = Glibc.close(peer) }
        let fd = FileDescriptor(rawValue: mine)
        let filled = fill(mine)
        #expect(filled > 0)
        let writerWoke = Atomic(false)
        let writer = Task {
            try await fd.wait(until: .writable)
            writerWoke.store(true, ordering: .sequentiallyConsistent)
        }
        let reader = Task { try await fd.wait(until: .readable) }
        try await Task.sleep(for: .milliseconds(30))
        Support.writeAll(peer, [1])
        try await reader.value
        try await Task.sleep(for: .milliseconds(30))
        let wokeEarly = writerWoke.load(ordering: .sequentiallyConsistent)
        #expect(!wokeEarly, "the send buffer is still full: the writer must still wait")
        // Draining the peer frees the buffer: the writer, re-armed after the reader's event, wakes.
        var sink = [UInt8](repeating: 0, count: 65536)
        var drained = 0
        while drained < filled {
            let count = sink.withUnsafeMutableBytes { recv(peer, $0.baseAddress, $0.count, 0) }
            guard count > 0 else { break }
            drained += count
        }
        try await writer.value
        let woke = writerWoke.load(ordering: .sequentiallyConsistent)
        #expect(woke)
    }

    @Test func aNumberReusedForAnotherFileIsWatchedAgain() async throws {
        let (first, firstPeer) = try socketPair()
        defer { _ = Glibc.close(first) }
        let fd = FileDescriptor(rawValue: first)
        try await fd.wait(until: .writable)   // in the epoll set now
        _ = Glibc.close(firstPeer)
        let (second, secondPeer) = try socketPair()
        defer { _ = Glibc.close(secondPeer) }
        // The same number, another file: the old registration left with the old file.
        #expect(dup2(second, first) == first)
        _ = Glibc.close(second)
        let reader = Task { try await fd.wait(until: .readable) }
        try await Task.sleep(for: .milliseconds(20))
        Support.writeAll(secondPeer, [1])
        try await reader.value
    }

    @Test func aRegularFileIsReadyAtOnceAndABadDescriptorNamesEpollCtl() async throws {
        let path = Support.temporaryPath("readiness")
        let file = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        defer { _ = Glibc.close(file); unlink(path) }
        try await FileDescriptor(rawValue: file).wait(until: .readable)   // poll(2) calls files always ready
        let error = await expectTransportError(.io) { try await FileDescriptor(rawValue: 1_000_000).wait(until: .readable) }
        #expect(error?.syscall == "epoll_ctl")
        #expect(error?.errno == .badFileDescriptor)
    }

    @Test func aGateWakesItsWaitersWhenItClosesAndLaterWaitsReturnAtOnce() async throws {
        let (mine, peer) = try socketPair()
        defer { _ = Glibc.close(peer) }
        let gate = DescriptorGate(FileDescriptor(rawValue: mine))
        #expect(gate.enter())
        let waiter = Task {
            try await gate.wait(until: .readable)
            return gate.isClosed
        }
        try await Task.sleep(for: .milliseconds(30))
        let closing = Task { await gate.close() }
        #expect(try await waiter.value, "woken by the close, not by data")
        try await gate.wait(until: .readable)   // closed: at once
        gate.leave()
        #expect(await closing.value)
    }

    @Test func acceptGivesANonBlockingCloseOnExecSocketOrEAGAIN() async throws {
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        defer { _ = Glibc.close(listener) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = UInt32(0x7F00_0001).bigEndian
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                _ = bind(listener, $0, length)
                _ = getsockname(listener, $0, &length)
            }
        }
        #expect(Glibc.listen(listener, 4) == 0)
        let fd = FileDescriptor(rawValue: listener)
        #expect(throws: Errno.resourceTemporarilyUnavailable) { try Syscall.accept(fd).get() }
        let client = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        defer { _ = Glibc.close(client) }
        let connected = withUnsafePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(client, $0, length) } }
        #expect(connected == 0)
        try await fd.wait(until: .readable)
        let accepted = try Syscall.accept(fd).get()
        defer { accepted.closeOwned() }
        #expect(fcntl(accepted.rawValue, F_GETFL) & O_NONBLOCK != 0)
        #expect(fcntl(accepted.rawValue, F_GETFD) & FD_CLOEXEC != 0)
    }

    @Test func aGateWaitWithADeadlineEndsAtItAndLaterSeesReadiness() async throws {
        let (mine, peer) = try socketPair()
        defer { _ = Glibc.close(peer) }
        let gate = DescriptorGate(FileDescriptor(rawValue: mine))
        #expect(gate.enter())
        let started = ContinuousClock.now
        let ready = try await gate.wait(until: .readable, deadline: .now + .milliseconds(50))
        #expect(!ready, "nothing to read: the deadline ends the wait")
        #expect(ContinuousClock.now - started >= .milliseconds(50))
        #expect(try await gate.wait(until: .readable, deadline: .now - .seconds(1)) == false, "a deadline already past: at once")
        Support.writeAll(peer, [1])
        #expect(try await gate.wait(until: .readable, deadline: .now + .seconds(30)), "readable before the deadline")
        gate.leave()
        #expect(await gate.close())
    }

    @Test func manyWaitsShareOneThread() async throws {
        let (mine, peer) = try socketPair()
        defer { _ = Glibc.close(mine); _ = Glibc.close(peer) }
        let fd = FileDescriptor(rawValue: mine)
        var byte: UInt8 = 0
        for _ in 0..<200 {
            let reader = Task { try await fd.wait(until: .readable) }
            Support.writeAll(peer, [1])
            try await reader.value
            _ = Glibc.read(mine, &byte, 1)
        }
        #expect(PluginExampleTests.threads(named: "tk readiness") == 1)
    }
}

@Suite("TransportKitLinux: threads")
struct WorkerThreadTests {
    @Test func aWorkerRunsUntilInterruptedAndIsJoined() async throws {
        var ends: [Int32] = [-1, -1]
        #expect(pipe(&ends) == 0)
        defer { _ = Glibc.close(ends[0]); _ = Glibc.close(ends[1]) }
        let (readEnd, writeEnd) = (ends[0], ends[1])
        let loops = Atomic(0)
        let worker = try WorkerThread(name: "test worker") { isStopping in
            while !isStopping() {
                loops.add(1, ordering: .relaxed)
                var byte: UInt8 = 0
                _ = Glibc.read(readEnd, &byte, 1)  // blocks, as a C library's event loop would
            }
        } interrupt: {
            var byte: UInt8 = 1
            _ = Glibc.write(writeEnd, &byte, 1)
        }
        #expect(await eventually { loops.load(ordering: .relaxed) == 1 })
        #expect(worker.isRunning)
        #expect(PluginExampleTests.threads(named: "test worker") == 1, "the thread runs, and carries its name")
        await worker.stop()
        #expect(!worker.isRunning)
        #expect(PluginExampleTests.threads(named: "test worker") == 0, "joined, not left behind")
        await worker.stop()  // a second stop returns at once
    }

    @Test func blockingCallsRunOffTheCooperativePool() async throws {
        let value = try await Blocking.run { () -> Int in
            usleep(20_000)
            return 7
        }
        #expect(value == 7)
        await #expect(throws: TransportError.self) {
            try await Blocking.run { throw TransportError(.io, "from the pool") }
        }
    }
}

/// PacketSocketBackend on an AF_UNIX SOCK_SEQPACKET pair whose send buffer is the kernel's
/// minimum, so that a write of many records finds it full after a few.
@Suite("TransportKitLinux: SEQPACKET records", .serialized)
struct PacketSocketTests {
    static let mtu = 100

    /// Threads of this process named as the record sender is (ps shows 15 bytes).
    static func senderThreads() -> Int {
        let tasks = (try? FileManager.default.contentsOfDirectory(atPath: "/proc/self/task")) ?? []
        return tasks.filter { task in
            (try? String(contentsOfFile: "/proc/self/task/\(task)/comm", encoding: .utf8))?.hasPrefix("tk record send") == true
        }.count
    }

    static func connection(_ fd: Int32) throws -> Connection {
        var size: Int32 = 1   // rounded up to the kernel's minimum
        _ = setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        let backend = PacketSocketBackend(adopting: FileDescriptor(rawValue: fd), describing: "a seqpacket pair",
                                          receiveSize: 2048, maximumWriteSize: mtu) { errno, call in
            TransportError(.disconnected, "the peer went away", errno: errno, syscall: call)
        }
        return Connection(url: try TransportURL("loop://"), backend: backend)
    }

    /// The records waiting on `fd`, without waiting for more.
    static func queuedRecords(_ fd: Int32) -> [[UInt8]] {
        var records: [[UInt8]] = []
        var buffer = [UInt8](repeating: 0, count: 2048)
        while case let count = recv(fd, &buffer, buffer.count, Int32(MSG_DONTWAIT)), count > 0 {
            records.append(Array(buffer.prefix(count)))
        }
        return records
    }

    /// Reads records from `fd` on a thread of its own until `total` bytes came (or the end),
    /// pausing 1 ms every `pauseEvery` records when given.
    static func reader(_ fd: Int32, total: Int, pauseEvery: Int? = nil) -> Task<[[UInt8]], any Error> {
        Task {
            try await Blocking.runOnThread("tk test reader") { () -> [[UInt8]] in
                var records: [[UInt8]] = []
                var buffer = [UInt8](repeating: 0, count: 2048)
                var received = 0
                while received < total {
                    let count = recv(fd, &buffer, buffer.count, 0)
                    guard count > 0 else { break }
                    records.append(Array(buffer.prefix(count)))
                    received += count
                    if let pauseEvery, records.count % pauseEvery == 0 { usleep(1000) }
                }
                return records
            }
        }
    }

    static func pattern(_ count: Int) -> [UInt8] { (0..<count).map { UInt8(truncatingIfNeeded: $0 &* 7 &+ $0 >> 8) } }

    @Test func aWriteOfManyRecordsGoesOutWholeAndInOrderThroughAFullSocket() async throws {
        let (mine, peer) = try socketPair(SOCK_SEQPACKET)
        defer { _ = Glibc.close(peer) }
        let connection = try Self.connection(mine)
        let data = Self.pattern(100_000)
        // A slow reader: it pauses every 50 records, so the socket fills again and again.
        let reader = Self.reader(peer, total: data.count, pauseEvery: 50)
        try await connection.write(data)
        let records = try await reader.value
        #expect(records.count == 1000 && records.allSatisfy { $0.count == Self.mtu }, "\(records.count) records")
        #expect(records.flatMap { $0 } == data)
        #expect(connection.bytesWritten == data.count)
        #expect(Self.senderThreads() == 1, "the records beyond the full socket went out from the connection's sender thread")
        try await connection.close()
        #expect(await eventually { Self.senderThreads() == 0 }, "closing ended the sender thread")
    }

    @Test func aCancelledWriteStopsBetweenRecordsAndCountsWhatWent() async throws {
        let (mine, peer) = try socketPair(SOCK_SEQPACKET)
        defer { _ = Glibc.close(peer) }
        let connection = try Self.connection(mine)
        let data = Self.pattern(100_000)
        let writer = Task { try await connection.write(data) }
        // Nobody reads: the socket is full and the sender thread waits in poll(2).
        #expect(await eventually { Self.senderThreads() == 1 })
        writer.cancel()
        await #expect(throws: CancellationError.self) { try await writer.value }
        let written = connection.bytesWritten
        #expect(written > 0 && written < data.count && written % Self.mtu == 0, "\(written) bytes counted as written")
        // What was counted is there, as whole records, and nothing more.
        let records = Self.queuedRecords(peer)
        #expect(records.flatMap { $0 } == Array(data.prefix(written)))
        // The connection writes on after a cancelled write, through the same sender thread.
        let reader = Self.reader(peer, total: 20_000)
        try await connection.write(Self.pattern(20_000))
        #expect(try await reader.value.flatMap { $0 } == Self.pattern(20_000))
        try await connection.close()
        #expect(await eventually { Self.senderThreads() == 0 }, "closing ended the sender thread")
    }

    @Test func closingDuringABlockedWriteEndsItPromptly() async throws {
        let (mine, peer) = try socketPair(SOCK_SEQPACKET)
        defer { _ = Glibc.close(peer) }
        let connection = try Self.connection(mine)
        let writer = Task { try await connection.write(Self.pattern(100_000)) }
        #expect(await eventually { Self.senderThreads() == 1 })
        let started = ContinuousClock.now
        try await connection.close()
        let error = await #expect(throws: TransportError.self) { try await writer.value }
        #expect(error?.kind == .misuse && error?.message.contains("closed during a write") == true, "\(String(describing: error))")
        // Otherwise the write waits for ever; the bound leaves room for a loaded machine.
        #expect(ContinuousClock.now - started < .seconds(30))
        #expect(await eventually { Self.senderThreads() == 0 }, "closing ended the sender thread")
    }

    @Test func aPeerThatGoesAwayDuringABlockedWriteIsAHangUp() async throws {
        let (mine, peer) = try socketPair(SOCK_SEQPACKET)
        let connection = try Self.connection(mine)
        let writer = Task { try await connection.write(Self.pattern(100_000)) }
        #expect(await eventually { Self.senderThreads() == 1 })
        _ = Glibc.close(peer)
        let error = await #expect(throws: TransportError.self) { try await writer.value }
        #expect(error?.kind == .disconnected && error?.syscall == "send", "\(String(describing: error))")
        #expect([Errno.brokenPipe, .connectionReset].contains(error?.errno ?? .badFileDescriptor), "\(String(describing: error))")
        try await connection.close()
        #expect(await eventually { Self.senderThreads() == 0 }, "closing ended the sender thread")
    }
}
