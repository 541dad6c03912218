// StreamListener.swift: a tcp:// listener without protocol layers, on a listening socket of its
// own (socket(7), bind(2), listen(2), accept4(2)): each accepted socket becomes a
// StreamSocketBackend connection, whose reads and writes are system calls on the calling task's
// thread. Accepting is driven by demand: accept4 runs only inside accept(), so connections wait
// in the kernel's backlog, never in a queue here; a waiting accept() parks on the readiness poller.
// Listeners with layers (tls://, ws://, rfc2217://) stay on SwiftNIO (SocketListener.swift).

import Glibc
import NIOCore
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

final class StreamListener: ListenerBackend {
    private let fd: SystemPackage.FileDescriptor
    /// accept() calls inside a wait or accept4 on `fd`; closes it once they left.
    private let gate: DescriptorGate
    private let configure: @Sendable (SystemPackage.FileDescriptor) throws -> Void
    private let largestRead: Int
    /// The address bound (the port the kernel chose for port 0).
    let localAddress: SocketAddress?

    private init(fd: SystemPackage.FileDescriptor, largestRead: Int, configure: @escaping @Sendable (SystemPackage.FileDescriptor) throws -> Void) {
        self.fd = fd
        self.largestRead = largestRead
        gate = DescriptorGate(fd)
        self.configure = configure
        localAddress = StreamSocketBackend.address(of: fd, peer: false)
    }

    /// Binds `address` and listens with `backlog`; SO_REUSEADDR set, as SwiftNIO's listeners do.
    /// `configure` sets socket options on each accepted socket. Throws `mapError`'s view of the
    /// failed call's errno (bind: EADDRINUSE, EADDRNOTAVAIL, EACCES).
    static func bind(_ address: SocketAddress, backlog: Int, largestRead: Int, configure: @escaping @Sendable (SystemPackage.FileDescriptor) throws -> Void,
                     mapError: (Errno, String) -> TransportError) throws -> StreamListener {
        let raw = socket(Int32(address.protocol.rawValue), Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard raw >= 0 else { throw mapError(Syscall.errno, "socket") }
        let fd = SystemPackage.FileDescriptor(rawValue: raw)
        var one: Int32 = 1
        let steps: [(String, () -> Int32)] = [
            ("setsockopt(SO_REUSEADDR)", { setsockopt(raw, SOL_SOCKET, SO_REUSEADDR, &one, socklen_t(MemoryLayout<Int32>.size)) }),
            ("bind", { address.withSockAddr { Glibc.bind(raw, $0, socklen_t($1)) } }),
            ("listen", { Glibc.listen(raw, Int32(clamping: backlog)) }),
        ]
        for (name, step) in steps {
            if case .failure(let errno) = Syscall.attempt(step) {
                fd.closeOwned()
                throw mapError(errno, name)
            }
        }
        return StreamListener(fd: fd, largestRead: largestRead, configure: configure)
    }

    /// The next connection from the kernel's backlog, waiting for one; `nil` once closed. A
    /// connection that failed before it was taken (ECONNABORTED) or whose options cannot be set
    /// is skipped; out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), it tries again
    /// after a second. Throws a `TransportError` naming accept4 for any other failure.
    func accept() async throws -> Connection? {
        guard gate.enter() else { return nil }
        defer { gate.leave() }
        let describing = localAddress.map { "tcp://\(TCPSocket.hostPort($0))" } ?? "the tcp:// listener"
        while true {
            if gate.isClosed { return nil }
            switch Syscall.accept(fd) {
            case .success(let accepted):
                do {
                    try configure(accepted)
                } catch {
                    accepted.closeOwned()
                    continue
                }
                let peer = StreamSocketBackend.address(of: accepted, peer: true).map { "tcp://\(TCPSocket.hostPort($0))" } ?? "tcp://?"
                let backend = StreamSocketBackend(adopting: accepted, describing: peer, largestRead: largestRead)
                return Connection(url: (try? TransportURL(peer)) ?? TransportURL(scheme: "tcp"), backend: backend,
                                  metadata: StreamSocketBackend.metadata(of: accepted, name: peer))
            case .failure(.resourceTemporarilyUnavailable):
                try await gate.wait(until: .readable)
            case .failure(let errno) where Self.retried.contains(errno):
                continue   // gone before it was taken, or a network error accept(2) says to retry
            case .failure(let errno) where Self.outOfResources.contains(errno):
                // The listening socket stays readable while connections wait, so retrying at once
                // would spin; ending accept() would end the server (a flood of clients can bring
                // this on). As SwiftNIO's AcceptBackoffHandler: wait a second, then try again.
                for _ in 0..<10 where !gate.isClosed { try await Task.sleep(for: .milliseconds(100)) }
            case .failure(let errno):
                if gate.isClosed { return nil }
                throw StreamSocketBackend.failure(errno, "accept4", context: "accepting on \(describing)")
            }
        }
    }

    /// accept(2)'s errors of a connection, not of the listener: ECONNABORTED, EPROTO, and the
    /// network errors Linux passes on (accept(2), "Error handling").
    static let retried: [Errno] = [.connectionAbort, .protocolError, .networkDown, .protocolNotAvailable, .hostIsDown,
                                   Errno(rawValue: ENONET), .noRouteToHost, .notSupported, .networkUnreachable]
    /// Out of descriptors or memory: retried after a pause.
    static let outOfResources: [Errno] = [.tooManyOpenFiles, .tooManyOpenFilesInSystem, .noBufferSpace, .noMemory]

    /// Stops accepting: a waiting accept() returns `nil`, and the socket is closed once no accept
    /// is using it. Connections accepted before stay open.
    func close() async throws {
        await gate.close()
    }

    deinit {
        // Dropped without close(): nothing can be using the descriptor any more.
        if !gate.isClosed { fd.closeOwned() }
    }
}
