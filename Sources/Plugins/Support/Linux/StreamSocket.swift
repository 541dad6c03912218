// StreamSocket.swift: a connected SOCK_STREAM socket (tcp(7), unix(7)) as a ConnectionBackend whose
// reads and writes are system calls made on the calling task's own thread: recv(2) and send(2)
// with MSG_DONTWAIT, and a wait on the readiness poller (Readiness.swift) only when the kernel has
// nothing to give or no room to take. A round trip then costs the two system calls and, when the
// answer is not there yet, one wake-up from the poller's thread; a SwiftNIO channel costs a hop to
// its event loop for every write and another back for every read (BENCHMARKS.md, issue 30).
//
// The kernel's buffers are the queues: nothing is read ahead, so a reader that stops leaves the
// bytes in the socket's receive buffer and TCP's window holds the peer back; a write returns once
// the kernel took every byte. Closing marks the descriptor gate closed (readers and writers
// waiting for readiness wake and leave), then closes the descriptor once no call is using it.

import Glibc
import NIOCore
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// A connected stream socket as a connection: reads and writes straight to the kernel.
///
/// ```swift
/// // In a plugin's connect handler, after a non-blocking connect(2) completed:
/// let backend = StreamSocketBackend(adopting: fd, describing: "tcp://192.0.2.1:4000")
/// return Connection(url: request.url, backend: backend, metadata: StreamSocketBackend.metadata(of: fd, name: "192.0.2.1"))
/// ```
@_spi(Plugins)
public final class StreamSocketBackend: ConnectionBackend {
    /// `true`: ``closeWrite()`` sends the peer an end of stream (shutdown(2), SHUT_WR).
    public let supportsHalfClose = true
    private let fd: SystemPackage.FileDescriptor
    private let describing: String
    /// Reads and writes inside a readiness wait or a system call on `fd`; closes it once they left.
    private let gate: DescriptorGate
    /// One write at a time: a write the kernel takes in parts must not interleave with another.
    private let writes = AsyncCondition(WriteState())
    /// How much the next read asks for: doubled when a read fills it, halved when one uses less
    /// than a quarter of it (SwiftNIO's adaptive allocator does the same), 512 bytes to `largestRead`.
    private let readSize: Locked<Int>
    /// The largest read, from the request's `Buffering/readSize` (64 KiB by default).
    private let largestRead: Int

    private struct WriteState: Sendable {
        /// A write (or the rest of one, sent by a task of its own) is under way.
        var busy = false
        /// Bytes of the write under way the kernel has not taken yet.
        var unsent = 0
        /// The rest of an accepted write failed; the next write, half-close or close reports it.
        var failure: TransportError?
    }

    static let smallestRead = 512

    /// Takes ownership of a connected stream socket; makes it non-blocking.
    ///
    /// - Parameters:
    ///   - fd: the connected socket; the backend owns it and closes it.
    ///   - describing: the URL or name the errors use.
    ///   - largestRead: the most one read takes from the kernel (a request's `buffering.readSize`).
    public init(adopting fd: SystemPackage.FileDescriptor, describing: String, largestRead: Int = 65536) {
        self.fd = fd
        self.describing = describing
        self.largestRead = max(largestRead, Self.smallestRead)
        readSize = Locked(min(2048, max(largestRead, Self.smallestRead)))
        gate = DescriptorGate(fd)
        let flags = fcntl(fd.rawValue, F_GETFL)
        if flags >= 0 && flags & O_NONBLOCK == 0 { _ = fcntl(fd.rawValue, F_SETFL, flags | O_NONBLOCK) }
    }

    /// The connection's local and remote addresses (getsockname(2), getpeername(2)), as SwiftNIO
    /// writes them (`[IPv4]127.0.0.1/127.0.0.1:4000`).
    public static func metadata(of fd: SystemPackage.FileDescriptor, name: String) -> ConnectionMetadata {
        ConnectionMetadata(name: name, localAddress: address(of: fd, peer: false)?.description,
                           remoteAddress: address(of: fd, peer: true)?.description)
    }

    /// A socket's own address (getsockname(2)) or its peer's (getpeername(2)); nil for a family
    /// other than IPv4, IPv6 and Unix, or when the call fails (a peer already gone).
    public static func address(of fd: SystemPackage.FileDescriptor, peer: Bool) -> SocketAddress? {
        var storage = sockaddr_storage()
        var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
        let result = withUnsafeMutablePointer(to: &storage) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { peer ? getpeername(fd.rawValue, $0, &length) : getsockname(fd.rawValue, $0, &length) }
        }
        guard result == 0 else { return nil }
        let family = Int32(storage.ss_family)
        return withUnsafePointer(to: &storage) { pointer -> SocketAddress? in
            switch family {
            case AF_INET: pointer.withMemoryRebound(to: sockaddr_in.self, capacity: 1) { SocketAddress($0.pointee) }
            case AF_INET6: pointer.withMemoryRebound(to: sockaddr_in6.self, capacity: 1) { SocketAddress($0.pointee) }
            case AF_UNIX: pointer.withMemoryRebound(to: sockaddr_un.self, capacity: 1) { SocketAddress($0.pointee) }
            default: nil
            }
        }
    }

    /// An integer socket option (getsockopt(2)): `SOL_SOCKET`/`SO_KEEPALIVE`,
    /// `IPPROTO_TCP`/`TCP_NODELAY`, …. Throws `.misuse` once closed.
    ///
    /// ```swift
    /// let noDelay = try backend.integerOption(level: Int32(IPPROTO_TCP), name: TCP_NODELAY)
    /// ```
    public func integerOption(level: Int32, name: Int32) throws -> Int32 {
        guard gate.enter() else { throw TransportError(.misuse, "\(describing) is closed") }
        defer { gate.leave() }
        var value: Int32 = 0
        var length = socklen_t(MemoryLayout<Int32>.size)
        _ = try Syscall.run("getsockopt", on: describing) { getsockopt(fd.rawValue, level, name, &value, &length) }
        return value
    }

    /// The next bytes the kernel has, waiting for some when it has none; `nil` at the end of the
    /// stream or once the backend is closed. Throws a `TransportError` naming recv(2) (a reset:
    /// `TransportError/Kind/disconnected`). Cancelling the task ends a wait with `CancellationError`.
    public func read() async throws -> ByteBuffer? {
        try await receive(deadline: nil)
    }

    /// ``read()``, waiting at most until `deadline` (then `ReadDeadlinePassed`, nothing consumed).
    public func readMessage(deadline: ContinuousClock.Instant) async throws -> TransportMessage? {
        try await receive(deadline: deadline).map { TransportMessage(.binary, $0) }
    }

    private func receive(deadline: ContinuousClock.Instant?) async throws -> ByteBuffer? {
        guard gate.enter() else { return nil }
        defer { gate.leave() }
        let size = readSize.withLock { $0 }
        while true {
            if gate.isClosed { return nil }
            // Made for each attempt, not held across a wait: a connection whose peer is silent
            // holds no buffer (a server with thousands of idle clients).
            var buffer = ByteBufferAllocator().buffer(capacity: size)
            var result = Result<Int, Errno>.success(0)
            buffer.writeWithUnsafeMutableBytes(minimumWritableBytes: size) { bytes in
                result = Syscall.attempt { recv(fd.rawValue, bytes.baseAddress, min(bytes.count, size), Int32(MSG_DONTWAIT)) }
                return (try? result.get()) ?? 0
            }
            switch result {
            case .success(0):
                return nil
            case .success(let count):
                readSize.withLock { next in
                    if count == size { next = min(size * 2, largestRead) } else if count < size / 4 { next = max(size / 2, Self.smallestRead) }
                }
                return buffer
            case .failure(.resourceTemporarilyUnavailable):
                try await waitFor(.readable, deadline: deadline) { ReadDeadlinePassed() }
            case .failure(let errno):
                if gate.isClosed { return nil }
                throw Self.failure(errno, "recv", context: "reading from \(describing)")
            }
        }
    }

    /// Sends every byte of `buffer`, waiting for room while the kernel's send buffer is full; one
    /// write at a time. Throws `.misuse` once closed, and a `TransportError` naming send(2) when the
    /// peer is gone (EPIPE, ECONNRESET: `TransportError/Kind/disconnected`).
    public func write(_ buffer: ByteBuffer) async throws {
        try await transmit(buffer, deadline: nil)
    }

    /// ``write(_:)``, all or nothing by `deadline`: it waits for room (the write before it done,
    /// the kernel taking bytes) until the deadline, and throws `WriteDeadlinePassed` with nothing
    /// sent when it passes first. Once the kernel took part of `buffer`, the write is accepted:
    /// the rest is sent by a task of its own (counted in ``unsentByteCount``; the next write,
    /// ``closeWrite()`` and ``close()`` come after it), so what the peer gets is exactly what the
    /// writes that returned accepted.
    public func write(_ buffer: ByteBuffer, deadline: ContinuousClock.Instant) async throws {
        try await transmit(buffer, deadline: deadline)
    }

    private func transmit(_ buffer: ByteBuffer, deadline: ContinuousClock.Instant?) async throws {
        guard gate.enter() else { throw TransportError(.misuse, "\(describing) is closed") }
        defer { gate.leave() }
        try await takeTurn(deadline: deadline)
        var handedOver = false
        defer { if !handedOver { endTurn(unsent: 0) } }
        if let failure = takeUnreportedFailure() { throw failure }
        var rest = buffer
        var sentAny = false
        while rest.readableBytes > 0 {
            if gate.isClosed { throw TransportError(.misuse, "\(describing) was closed during a write") }
            switch sendSome(&rest) {
            case .success:
                sentAny = true
            case .failure(.resourceTemporarilyUnavailable):
                if deadline != nil && sentAny {
                    handedOver = true
                    sendRest(rest)
                    return
                }
                writes.update { $0.unsent = rest.readableBytes }
                do {
                    try await waitFor(.writable, deadline: deadline) { WriteDeadlinePassed(nothingSent: true) }
                } catch is CancellationError where sentAny {
                    // Part is in the kernel already: the rest follows, so the stream never
                    // carries a torn write (SwiftNIO's channel, which takes a write whole, did
                    // the same). The cancellation is still this call's outcome.
                    handedOver = true
                    sendRest(rest)
                    throw CancellationError()
                }
            case .failure(let errno):
                throw Self.failure(errno, "send", context: "writing to \(describing)")
            }
        }
    }

    /// One send(2) of what `rest` holds, without waiting; moves past what the kernel took.
    private func sendSome(_ rest: inout ByteBuffer) -> Result<Void, Errno> {
        let result = Syscall.attempt {
            rest.withUnsafeReadableBytes { send(fd.rawValue, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL | MSG_DONTWAIT)) }
        }
        return result.map { rest.moveReaderIndex(forwardBy: $0) }
    }

    /// Waits until no write is under way (nor the rest of one), then marks one under way; until
    /// `deadline` if there is one (then `WriteDeadlinePassed`, nothing sent).
    private func takeTurn(deadline: ContinuousClock.Instant?) async throws {
        let writes = writes
        let take: @Sendable () async throws -> Void = {
            try await writes.wait { state -> Void? in
                if state.busy { return nil }
                state.busy = true
                return ()
            }
        }
        guard let deadline else { return try await take() }
        // resultWins: a turn taken as the deadline passed is kept, and used.
        guard try await withDeadline(deadline, resultWins: true, take) != nil else { throw WriteDeadlinePassed(nothingSent: true) }
    }

    private func endTurn(unsent: Int) {
        writes.update { state in
            state.busy = false
            state.unsent = unsent
        }
    }

    /// Sends the rest of an accepted write from a task of its own, keeping the turn until it is
    /// gone, the socket fails or the backend closes. A failure is reported by the next write,
    /// ``closeWrite()`` or ``close()``. Not a cleanup task (`startCleanup`): it belongs to a
    /// connection still open, whose ``close()`` waits for it and whose ``connectionDropped()``
    /// ends it; counted as cleanup, a peer that stopped reading would hold up
    /// `waitForAbandonedConnects()` for as long as the connection lives.
    private func sendRest(_ rest: ByteBuffer) {
        writes.update { $0.unsent = rest.readableBytes }
        Task { [self] in
            guard gate.enter() else { return endTurn(unsent: 0) }
            defer { gate.leave() }
            var rest = rest
            sending: while rest.readableBytes > 0 && !gate.isClosed {
                switch sendSome(&rest) {
                case .success:
                    writes.update { $0.unsent = rest.readableBytes }
                case .failure(.resourceTemporarilyUnavailable):
                    // Nobody cancels this task; the gate's close wakes it.
                    do {
                        try await gate.wait(until: .writable)
                    } catch {
                        // Not a cancellation (nobody holds this task): epoll_ctl refused (ENOSPC, ENOMEM).
                        if !gate.isClosed {
                            writes.update { $0.failure = error as? TransportError ?? TransportError(.io, "writing to \(describing) failed: \(error)") }
                        }
                        break sending
                    }
                case .failure(let errno):
                    writes.update { $0.failure = Self.failure(errno, "send", context: "writing to \(describing)") }
                    rest.moveReaderIndex(forwardBy: rest.readableBytes)
                }
            }
            endTurn(unsent: 0)
        }
    }

    private func takeUnreportedFailure() -> TransportError? {
        writes.update { state in
            defer { state.failure = nil }
            return state.failure
        }
    }

    /// Waits for readiness inside a use of the gate, until `deadline` if there is one (then throws
    /// `expired()`; the poller's own timer, no task group). A wait the gate's close ends returns;
    /// the caller looks at the gate.
    private func waitFor(_ readiness: SystemPackage.FileDescriptor.Readiness, deadline: ContinuousClock.Instant?,
                         expired: () -> any Error) async throws {
        guard try await gate.wait(until: readiness, deadline: deadline) else { throw expired() }
    }

    /// The error for a failed socket call (recv(2), send(2), connect(2)) in SwiftNIO's wording, so
    /// that a socket says the same whichever backend carries it: "`context` failed: ECONNRESET (…)".
    ///
    /// ```swift
    /// throw StreamSocketBackend.failure(.connectionRefused, "connect", context: "connecting to \(address)")
    /// ```
    public static func failure(_ errno: Errno, _ syscall: String, context: String) -> TransportError {
        TransportError.from(IOError(errnoCode: errno.rawValue, reason: syscall), context: context, syscall: syscall)
    }

    /// Bytes of the write under way (or the rest of an accepted one) that the kernel has not
    /// taken yet; 0 when none, and once closed. What the kernel holds is sent after a close too.
    public var unsentByteCount: Int? { writes.withLock { $0.unsent } }

    /// Bytes in the socket's receive buffer, not read yet (FIONREAD); 0 once closed.
    public var unreadByteCount: Int? {
        guard gate.enter() else { return 0 }
        defer { gate.leave() }
        var count: Int32 = 0
        guard ioctl(fd.rawValue, UInt(FIONREAD), &count) == 0 else { return nil }
        return Int(count)
    }

    /// Sends the peer an end of stream after every byte written (shutdown(2), SHUT_WR), once the
    /// write under way is done. A peer that already closed both ways (ENOTCONN) leaves nothing to do.
    public func closeWrite() async throws {
        guard gate.enter() else { throw TransportError(.misuse, "\(describing) is closed") }
        defer { gate.leave() }
        try await takeTurn(deadline: nil)
        defer { endTurn(unsent: 0) }
        if let failure = takeUnreportedFailure() { throw failure }
        switch Syscall.attempt({ shutdown(fd.rawValue, Int32(SHUT_WR)) }) {
        case .success, .failure(.socketNotConnected): return
        case .failure(let errno): throw Self.failure(errno, "shutdown", context: "half-closing \(describing)")
        }
    }

    /// Waits for the write under way (the kernel taking its bytes: a peer that does not read holds
    /// this up until ``connectionDropped()``, which `Connection.abort()` calls), then wakes reads
    /// waiting for readiness (they return `nil`), waits for calls under way to leave and closes the
    /// descriptor; the kernel sends what it holds. Reports a write whose rest failed.
    public func close() async throws {
        let (writes, gate) = (writes, gate)
        await uncancellable { _ = try? await writes.wait { state -> Void? in state.busy && !gate.isClosed ? nil : () } }
        await gate.close()
        if let failure = takeUnreportedFailure() {
            throw TransportError(failure.kind, "bytes written to \(describing) were not delivered: \(failure.message)",
                                 errno: failure.errno, syscall: failure.syscall)
        }
    }

    /// Closes at once, in a task of its own: a write under way fails, its unsent bytes are dropped.
    public func connectionDropped() {
        startCleanup { [gate] in await gate.close() }
    }
}
