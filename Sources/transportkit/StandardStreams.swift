// StandardStreams.swift: the tool's standard input and output — poll(2), read(2), write(2),
// pipe(2). Every wait can be abandoned: a task that is cancelled wakes the thread blocked in
// poll(2) through a pipe, so a relay never waits for a key press to end.

import Foundation
import Glibc
import SystemPackage
import NIOCore
import Synchronization
import TransportKit
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// Standard input, output and error as the tool was started with them.
enum StandardStreams {
    /// The standard descriptors (0, 1, 2) that were closed when the tool started (`>&-`). Each
    /// got /dev/null in its place at once: a socket or device opened later would otherwise take
    /// the number, and the relay's output (or the status lines) would go into it.
    /// Read first thing in `main`, before anything opens a descriptor (a static let is set once).
    static let closedAtStart: Set<Int32> = {
        var closed: Set<Int32> = []
        for fd in Int32(0)...2 where fcntl(fd, F_GETFD) == -1 && errno == EBADF {
            closed.insert(fd)
            // open(2) returns the lowest free number, which is this one.
            let opened = open("/dev/null", O_RDWR)
            if opened >= 0 && opened != fd { _ = Glibc.close(opened) }
        }
        return closed
    }()

    /// The error for `connect` when standard input or output was closed at start: the relay would
    /// have nothing to send, or nowhere to put what arrives.
    static func closedForRelay() -> StandardStreamError? {
        if closedAtStart.contains(1) { return .closedAtStart("output", "the bytes that arrive would have nowhere to go; give it a file, a pipe, or > /dev/null to discard them") }
        if closedAtStart.contains(0) { return .closedAtStart("input", "give it a file, a pipe, or < /dev/null to send nothing") }
        return nil
    }
}

/// Why a relay stopped reading or writing a standard stream.
enum StandardStreamError: Error, CustomStringConvertible {
    /// Whoever read standard output went away (`| head`): EPIPE, or poll(2) reported it.
    case outputClosed
    /// read(2) on standard input failed (a directory, an I/O error).
    case inputFailed(Errno)
    /// The tool was started with this standard stream closed (`>&-`); the advice what to give.
    case closedAtStart(String, String)

    var description: String {
        switch self {
        case .outputClosed: "standard output was closed"
        case .closedAtStart(let stream, let advice): "standard \(stream) is closed (the tool was started with it closed): \(advice)"
        case .inputFailed(let errno):
            "standard input cannot be read: read failed with \(errno.symbolicDescription)"
                + (errno == .isDirectory ? "; give the tool a file, a pipe or a terminal, not a directory" : "")
        }
    }
}

/// Waits in poll(2) for one descriptor, on one thread of its own for all its waits (started by the
/// first): a relay into a slow pipe waits once per piece, and a thread per wait was a `clone3`
/// each time. Cancelling the waiting task writes to a pipe that the same poll(2) watches, so the
/// wait returns at once; a cancelled waiter stays cancelled. One waiter serves one wait at a time.
/// The thread ends with the waiter (its deinit); after a cancel it answers every wait at once.
final class DescriptorWait: Sendable {
    /// What the waiting task and the thread share; the thread holds this, not the waiter, so that
    /// dropping the waiter ends the thread.
    private final class Shared: Sendable {
        let fd: Int32
        let events: Int16
        /// Cancels the poll(2); readable from the first cancel on.
        /// Nil when pipe(2) failed: then nothing can cancel a wait.
        let wake = try? WakePipe(what: "a wait's cancel pipe", blockingRead: true)
        /// Signalled once per wait asked for, and to stop the thread.
        let asked = DispatchSemaphore(value: 0)
        let waiting = Locked<CheckedContinuation<Int16?, Never>?>(nil)
        let stopping = Atomic(false)

        init(fd: Int32, events: Int16) {
            self.fd = fd
            self.events = events
        }

        func run() {
            while true {
                asked.wait()
                let result = stopping.load(ordering: .acquiring) ? nil : blockingPoll()
                waiting.withLock { $0.take() }?.resume(returning: result)
                if result == nil && stopping.load(ordering: .acquiring) { return }
            }
        }

        private func blockingPoll() -> Int16? {
            var fds = [pollfd(fd: fd, events: events, revents: 0), pollfd(fd: wake?.readEnd ?? -1, events: Int16(POLLIN), revents: 0)]
            while true {
                let ready = poll(&fds, 2, -1)
                if ready < 0 && errno == EINTR { continue }
                if ready < 0 || fds[1].revents != 0 { return nil }
                return fds[0].revents
            }
        }
    }

    private let shared: Shared
    private let started = Atomic(false)

    init(fd: Int32, events: Int16) {
        shared = Shared(fd: fd, events: events)
    }

    deinit {
        shared.stopping.store(true, ordering: .releasing)
        shared.wake?.poke()
        shared.asked.signal()
    }

    /// The events poll(2) reported for the descriptor, or `nil` when the task was cancelled.
    func next() async -> Int16? {
        if !started.exchange(true, ordering: .acquiringAndReleasing) {
            let thread = Thread { [shared] in shared.run() }
            thread.name = "tk wait \(shared.fd)"   // Linux keeps 15 bytes of a thread's name
            thread.start()
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Int16?, Never>) in
                shared.waiting.withLock { waiting in
                    precondition(waiting == nil, "DescriptorWait serves one wait at a time")
                    waiting = continuation
                }
                shared.asked.signal()
            }
        } onCancel: {
            cancel()
        }
    }

    /// Makes the current and every later wait return `nil`.
    func cancel() {
        shared.wake?.poke()
    }
}

/// Standard input, read ahead by one thread of its own into a bounded ``InboundQueue``: the thread
/// waits in poll(2) (with the cancel pipe) and reads, while the relay writes the chunk before; it
/// stops reading once 1 MiB waits unread and goes on when the relay has taken it below 256 KiB.
/// One thread for the whole input, not one per chunk. A cancelled task stops the thread at once.
final class StandardInput: Sendable {
    /// Where the thread pauses and goes on, in bytes read and not yet taken.
    static let watermarks = InboundQueue.Watermarks(low: 256 * 1024, high: 1024 * 1024)
    /// The most one read(2) takes.
    static let chunkSize = 64 * 1024

    private let queue: InboundQueue
    /// Signalled when the relay has made room (the queue's `onResume`) and on cancel.
    private let room: DispatchSemaphore
    /// Cancels the thread's poll(2); closed after the thread ended (it holds this object).
    private let wake = try? WakePipe(what: "standard input's cancel pipe", blockingRead: true)
    private let started = Atomic(false)
    private let cancelled = Atomic(false)
    /// The errno a read(2) failed with; the queue then fails, and ``next()`` throws it.
    private let failure = Locked<Errno?>(nil)

    init() {
        let room = DispatchSemaphore(value: 0)
        self.room = room
        queue = InboundQueue(watermarks: Self.watermarks) { room.signal() }
    }

    /// The next chunk, or `nil` at the end of input or when the task was cancelled (the input then
    /// stays ended).
    func next() async throws -> ByteBuffer? {
        if !started.exchange(true, ordering: .acquiringAndReleasing) {
            let thread = Thread { [self] in readAhead() }
            thread.name = "transportkit stdin"
            thread.start()
        }
        do {
            return try await queue.next()
        } catch is CancellationError {
            cancel()
            return nil
        } catch {
            if let errno = failure.withLock({ $0 }) { throw StandardStreamError.inputFailed(errno) }
            throw error
        }
    }

    /// Stops the thread; the current and every later ``next()`` returns `nil` once what was read
    /// before is taken.
    func cancel() {
        cancelled.store(true, ordering: .releasing)
        wake?.poke()
        room.signal()
    }

    /// The thread: poll(2), read(2), append, until the end, an error or a cancel.
    private func readAhead() {
        var fds = [pollfd(fd: 0, events: Int16(POLLIN), revents: 0), pollfd(fd: wake?.readEnd ?? -1, events: Int16(POLLIN), revents: 0)]
        while true {
            while !queue.shouldProduce() && !cancelled.load(ordering: .acquiring) { room.wait() }
            if cancelled.load(ordering: .acquiring) { return queue.finish() }
            let ready = poll(&fds, 2, -1)
            if ready < 0 && errno == EINTR { continue }
            if ready < 0 || fds[1].revents != 0 { return queue.finish() }
            var buffer = ByteBufferAllocator().buffer(capacity: Self.chunkSize)
            var readErrno: Int32 = 0
            let count = buffer.writeWithUnsafeMutableBytes(minimumWritableBytes: Self.chunkSize) { space in
                let count = Glibc.read(0, space.baseAddress, min(space.count, Self.chunkSize))
                if count < 0 { readErrno = errno }
                return max(count, 0)
            }
            if count > 0 {
                queue.append(buffer)
                continue
            }
            if readErrno == 0 { return queue.finish() }
            let failed = Errno(rawValue: readErrno)
            // EAGAIN: standard input is non-blocking (a terminal shared with a shell that set it)
            // and poll(2) woke for nothing; wait again.
            if failed == .interrupted || failed == .wouldBlock { continue }
            failure.withLock { $0 = failed }
            return queue.fail(TransportError.posix("read", errno: failed, what: "standard input"))
        }
    }
}

enum StandardOutput {
    /// Copies the connection's inbound bytes to standard output until the end of the stream.
    /// With `lines`, each message is written whole with a newline after it (`connect --text`).
    static func copy(from connection: Connection, lines: Bool = false) async throws {
        let writable = DescriptorWait(fd: 1, events: Int16(POLLOUT))
        if lines {
            while let message = try await connection.nextMessage() {
                try await writeAll(message.bytes + [UInt8(ascii: "\n")], waiting: writable)
            }
            return
        }
        while let chunk = try await connection.read() {
            try await writeAll(chunk, waiting: writable)
        }
    }

    /// A page for pipes and files (a pipe reports POLLOUT when a page is free); 256 bytes for a
    /// terminal, which reports POLLOUT with less room than a page (n_tty wakes writers below 256
    /// queued characters).
    static let pieceSize = isatty(1) == 1 ? 256 : 4096

    /// Writes `bytes` in pieces, each after poll(2) says the descriptor has room for it, so a
    /// reader that stopped reading (a pager, a stopped job) blocks a cancellable wait rather than
    /// a write(2) a signal cannot end. On a terminal that is held (Ctrl-S) a piece can still block
    /// inside write(2); the tool's 3-second exit after a signal covers that case.
    static func writeAll(_ bytes: [UInt8], waiting writable: DescriptorWait) async throws {
        var offset = 0
        while offset < bytes.count {
            var ready = pollfd(fd: 1, events: Int16(POLLOUT), revents: 0)
            if poll(&ready, 1, 0) == 0 {
                guard await writable.next() != nil else { throw CancellationError() }
            }
            let end = min(bytes.count, offset + pieceSize)
            let written = bytes[offset..<end].withUnsafeBytes { Glibc.write(1, $0.baseAddress, $0.count) }
            if written < 0 {
                if errno == EINTR { continue }
                if errno == EAGAIN {
                    // Standard output is non-blocking (shared with a shell that set it) and poll(2)
                    // said there was room for less than this piece: wait a moment, not a spin.
                    try await Task.sleep(for: .milliseconds(1))
                    continue
                }
                throw outputError(Errno(rawValue: errno))
            }
            offset += written
        }
    }

    /// Writes a line (`watch`), blocking; EPIPE throws `StandardStreamError.outputClosed`.
    static func writeLine(_ line: String) throws {
        if let failure = writeFully(1, Array((line + "\n").utf8)[...]) { throw outputError(failure) }
    }

    /// What a failed write to standard output means: its reader left (EPIPE), or an I/O error.
    static func outputError(_ failure: Errno) -> any Error {
        failure == .brokenPipe
            ? StandardStreamError.outputClosed
            : TransportError.posix("write", errno: failure, what: "standard output")
    }

    /// Returns when the reader of standard output goes away (poll(2) reports POLLERR on a pipe
    /// whose reading end closed, POLLHUP on a hung-up terminal), or when the task is cancelled.
    /// Output to a file never ends this way.
    static func waitUntilClosed() async throws {
        let wait = DescriptorWait(fd: 1, events: 0)
        while let events = await wait.next() {
            if events & Int16(POLLERR | POLLHUP) != 0 { throw StandardStreamError.outputClosed }
            if events & Int16(POLLNVAL) != 0 { return await sleepUntilCancelled() }
        }
    }

    private static func sleepUntilCancelled() async {
        while !Task.isCancelled { try? await Task.sleep(for: .seconds(3600)) }
    }
}

/// Standard error for messages and status lines. write(2) directly: FileHandle's write traps when
/// the reader of standard error went away (`2>&1 | head`), and a message that cannot be shown is
/// not worth a crash that skips the cleanup.
enum StandardError {
    static func write(_ text: String) {
        _ = writeFully(2, Array(text.utf8)[...])
    }
}

/// write(2) until every byte of `bytes` went to `fd` (blocking), retrying EINTR; the errno that
/// stopped it, or nil (also when write(2) took nothing, which only a closed end can cause).
func writeFully(_ fd: Int32, _ bytes: ArraySlice<UInt8>) -> Errno? {
    var rest = bytes
    while !rest.isEmpty {
        let written = rest.withUnsafeBytes { Glibc.write(fd, $0.baseAddress, $0.count) }
        if written < 0 {
            if errno == EINTR { continue }
            return Errno(rawValue: errno)
        }
        guard written > 0 else { return nil }
        rest = rest.dropFirst(written)
    }
    return nil
}
