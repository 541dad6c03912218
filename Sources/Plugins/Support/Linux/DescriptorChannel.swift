// DescriptorChannel.swift: putting a descriptor someone else opened on SwiftNIO's event loop, with a
// ChannelBackend at the end of its pipeline.
//   - a connected stream socket (AF_UNIX, AF_BLUETOOTH RFCOMM or L2CAP, one BlueZ handed over):
//     ClientBootstrap.withConnectedSocket, so closeWrite() is a real shutdown(SHUT_WR);
//   - a tty or a pipe: NIOPipeBootstrap on a duplicate, so the caller keeps the original for
//     ioctls (termios, modem lines). Pipes and ttys have no half-close.

import Glibc
import NIOCore
import NIOPosix
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// Adopts descriptors as SwiftNIO channels that end in a `ChannelBackend`.
///
/// ```swift
/// let fd = try Syscall.descriptor("socket", on: "rfcomm") { socket(AF_BLUETOOTH, SOCK_STREAM | SOCK_CLOEXEC, BTPROTO_RFCOMM) }
/// // … connect(2) …
/// let backend = try await DescriptorChannel.adoptSocket(fd, describing: "rfcomm://00:0A:3A:22:68:73:3")
/// return Connection(url: request.url, backend: backend)
/// ```
public enum DescriptorChannel {
    /// Takes ownership of a connected stream socket: the channel closes it, and when it cannot be
    /// adopted (not an open stream socket) it is closed here. `closeWrite()` shuts down the sending
    /// direction (the peer reads an end). A SOCK_SEQPACKET socket is refused: SwiftNIO's reads
    /// would cut records larger than its buffer; ``PacketSocketBackend`` carries those.
    /// `hangUp` and `shutsDownOnClose` are `ChannelBackend`'s (a Bluetooth link that drops, a
    /// socket bluetoothd holds too).
    @_spi(Plugins)
    public static func adoptSocket(_ fd: SystemPackage.FileDescriptor, describing: String,
                                   buffering: Buffering = .standard, messages: Bool = false, messageKinds: Bool = false,
                                   supportsHalfClose: Bool = true,
                                   configure: @escaping @Sendable (any Channel) throws -> Void = { _ in },
                                   hangUp: HangUp? = nil, shutsDownOnClose: Bool = false) async throws -> ChannelBackend {
        // SwiftNIO traps on a descriptor it cannot use (EBADF); check first.
        var type: Int32 = 0
        var length = socklen_t(MemoryLayout<Int32>.size)
        do {
            try Syscall.run("getsockopt(SO_TYPE)", on: describing) { getsockopt(fd.rawValue, SOL_SOCKET, SO_TYPE, &type, &length) }
            guard type == Int32(SOCK_STREAM.rawValue) else {
                throw TransportError.misuse("\(describing) is not a stream socket (SO_TYPE \(type)); only SOCK_STREAM sockets go on the event loop")
            }
        } catch {
            fd.closeOwned()
            throw error
        }
        do {
            return try await ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
                .channelOption(.allowRemoteHalfClosure, value: true)
                .withConnectedSocket(fd.rawValue) { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try configure(channel)
                        return try ChannelBackend.install(on: channel, describing: describing, supportsHalfClose: supportsHalfClose, messages: messages,
                                                          messageKinds: messageKinds, buffering: buffering, hangUp: hangUp,
                                                          shutsDownOnClose: shutsDownOnClose)
                    }
                }
        } catch {
            throw TransportError.from(error, context: "putting \(describing) on the event loop")
        }
    }

    /// Puts duplicates of a tty or pipe descriptor on the event loop (one for reading, one for
    /// writing, as SwiftNIO's pipe channel wants); the caller keeps `fd` (and closes it), the
    /// channel owns and closes the duplicates. `hangUp` is `ChannelBackend`'s: a tty whose
    /// adapter is unplugged, a pty whose other side closed.
    @_spi(Plugins)
    public static func adoptDuplicate(of fd: SystemPackage.FileDescriptor, describing: String,
                                      buffering: Buffering = .standard, hangUp: HangUp? = nil) async throws -> ChannelBackend {
        // SwiftNIO refuses regular files before it takes the descriptors, and would hand them back
        // unclosed: refuse them here, before duplicating anything.
        var info = stat()
        try Syscall.run("fstat", on: describing) { fstat(fd.rawValue, &info) }
        guard info.st_mode & S_IFMT != S_IFREG else {
            throw TransportError.misuse("\(describing) is a regular file; only ttys, pipes and sockets go on the event loop")
        }
        let input = try fd.duplicateCloseOnExec(describing: describing)
        let output: SystemPackage.FileDescriptor
        do {
            output = try fd.duplicateCloseOnExec(describing: describing)
        } catch {
            input.closeOwned()
            throw error
        }
        do {
            return try await NIOPipeBootstrap(group: MultiThreadedEventLoopGroup.singleton)
                .takingOwnershipOfDescriptors(input: input.rawValue, output: output.rawValue) { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try ChannelBackend.install(on: channel, describing: describing, supportsHalfClose: false, buffering: buffering, hangUp: hangUp)
                    }
                }
        } catch {
            throw TransportError.from(error, context: "putting \(describing) on the event loop")
        }
    }
}
