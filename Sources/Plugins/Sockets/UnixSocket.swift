// Unix domain stream sockets: unix(7). A listener owns its socket file: it replaces a stale one
// and unlink(2)s it when closed; /proc/net/unix says whether a socket file has a listener.

import Glibc
import NIOCore
import NIOPosix
import SystemPackage
@_spi(Plugins) import TransportKitCore
import TransportKitLinux

enum UnixSocket {
    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let path = request.url.path
        let target = "unix://\(path)"
        let backend = try await ClientSocket.connect(
            describing: target,
            mapError: { mapError($0, path: path, doing: "connecting to") }
        ) { bootstrap, initializer in
            try await bootstrap.connect(unixDomainSocketPath: path, channelInitializer: initializer)
        }
        return Connection(url: request.url, backend: backend, metadata: ConnectionMetadata(name: target, remoteAddress: path))
    }

    static func mapError(_ error: any Error, path: String, doing: String) -> TransportError {
        if error is SocketAddressError {
            return TransportError(.invalidURL, "the socket path '\(path)' is too long: Linux allows 107 bytes")
        }
        let mapped = TransportError.from(error, context: "\(doing) unix://\(path)", syscall: doing == "connecting to" ? "connect" : "bind")
        let listening = doing != "connecting to"
        switch mapped.kind {
        case .notFound where listening:
            return TransportError(.notFound, "cannot create the socket \(path): its directory does not exist",
                                  errno: mapped.errno, syscall: mapped.syscall)
        case .permissionDenied where listening:
            return TransportError(.permissionDenied, "cannot create the socket \(path): this user may not create files in its directory; choose one you can write to, such as /tmp",
                                  errno: mapped.errno, syscall: mapped.syscall)
        case .notFound:
            return TransportError(.notFound, "no socket at \(path): is the server running, and is the path right?",
                                  errno: mapped.errno, syscall: mapped.syscall)
        case .refused:
            // connect(2) refuses anything that is not a listening socket: say what is there.
            var info = stat()
            if stat(path, &info) == 0, info.st_mode & S_IFMT != S_IFSOCK {
                return TransportError(.refused, "\(path) is \(fileKind(info.st_mode)), not a socket: give the path of a unix socket that a server listens on",
                                      errno: mapped.errno, syscall: mapped.syscall)
            }
            return TransportError(.refused, "nobody accepts connections on \(path): the server is not running, and this socket file was left behind when it stopped",
                                  errno: mapped.errno, syscall: mapped.syscall)
        case .permissionDenied:
            return TransportError(.permissionDenied, "no permission to use \(path): the socket file and its directories need write and search access for this user",
                                  errno: mapped.errno, syscall: mapped.syscall)
        default:
            return mapped
        }
    }

    @Sendable static func listen(_ request: ConnectRequest) async throws -> Listener {
        let path = request.url.path
        try await removeStaleSocket(at: path)
        let listener = try await SocketListener.bind(
            backlog: request[SocketsPlugin.backlog],
            configure: { _ in },
            describePeer: { _ in "unix://\(path)" },
            bind: { bootstrap in
                do {
                    return try await bootstrap.bind(unixDomainSocketPath: path).get()
                } catch {
                    throw mapError(error, path: path, doing: "listening on")
                }
            },
            onClose: { unlink(path) }
        )
        return Listener(url: request.url, backend: listener)
    }

    /// A socket file nobody listens on is left over from a process that died: replace it. One that
    /// a process listens on is refused with "busy", naming the process where it can be seen.
    ///
    /// Whether anyone listens is read from /proc/net/unix (unix(7)) first, not probed by
    /// connecting: a probe would be a real client to the other listener, which would serve it (and
    /// a bridge that serves one client would then exit and remove its socket). Only a file the
    /// table does not show as listened on is probed.
    static func removeStaleSocket(at path: String) async throws {
        var info = stat()
        guard lstat(path, &info) == 0 else { return }
        guard info.st_mode & S_IFMT == S_IFSOCK else {
            throw TransportError(.busy, "\(path) exists and is \(fileKind(info.st_mode)), not a socket; choose another path, or remove it if it is yours",
                                 errno: .addressInUse, syscall: "bind")
        }
        var listening = DeviceNode.readText("/proc/net/unix", limit: 64 << 20).map { listeningState(of: path, in: $0) } ?? .none
        if listening == .none, await probeByConnecting(path) {
            // Not in this network namespace's table (a listener in another container sharing
            // the directory), or no /proc: connect(2) decides. A stale file refuses the probe,
            // so a probe only ever reaches a listener the table could not show.
            listening = .listening(inode: nil)
        }
        if case .listening(let inode) = listening {
            let holder = inode.flatMap { inode in DeviceNode.describeHolders { $0 == "socket:[\(inode)]" } }
            throw TransportError(.busy, "\(holder ?? "another process") is listening on \(path); stop it or choose another path",
                                 errno: .addressInUse, syscall: "bind")
        }
        if unlink(path) != 0 {
            throw TransportError.posix("unlink", errno: Errno(rawValue: errno), what: path, hint: "remove the stale socket file by hand")
        }
    }

    enum ListeningState: Equatable {
        case none
        /// A listening socket is bound to the path; its socket inode, when the table gives it.
        case listening(inode: Int?)
    }

    /// Reads /proc/net/unix: `Num RefCount Protocol Flags Type St Inode Path`, Flags in hex with
    /// __SO_ACCEPTCON (0x10000) on listening sockets. A listening socket bound by a relative path
    /// with the same file name counts as listening: the table does not say what it is relative to,
    /// and refusing is the safe side.
    static func listeningState(of path: String, in table: String) -> ListeningState {
        let name = path.split(separator: "/").last.map(String.init) ?? path
        var info = stat()
        let file = stat(path, &info) == 0 ? (info.st_dev, info.st_ino) : nil
        for line in table.split(separator: "\n").dropFirst() {
            let fields = line.split(separator: " ", maxSplits: 7, omittingEmptySubsequences: true)
            guard fields.count == 8, let flags = Int(fields[3], radix: 16), flags & 0x10000 != 0 else { continue }
            let bound = String(fields[7])
            // Only paths with the same file name are looked at (no stat(2) of every socket on the
            // machine, some of which may sit on a hung network file system).
            guard !bound.hasPrefix("@"), bound.split(separator: "/").last.map(String.init) == name else { continue }
            if bound.hasPrefix("/") {
                // The same file by another spelling (/var/run and /run, a doubled slash) counts.
                var other = stat()
                guard bound == path || (file != nil && stat(bound, &other) == 0 && other.st_dev == file?.0 && other.st_ino == file?.1) else { continue }
            }
            return .listening(inode: Int(fields[6]))
        }
        return .none
    }

    /// connect(2) with a one-second limit, closed at once: whether anyone accepts on `path`.
    private static func probeByConnecting(_ path: String) async -> Bool {
        do {
            let probe = try await ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
                .connectTimeout(.seconds(1))
                .connect(unixDomainSocketPath: path).get()
            try? await probe.close().get()
            return true
        } catch {
            return false
        }
    }

    /// "a directory", "a regular file", … for messages about a path that is not a socket.
    static func fileKind(_ mode: mode_t) -> String {
        switch mode & S_IFMT {
        case S_IFDIR: "a directory"
        case S_IFREG: "a regular file"
        case S_IFIFO: "a FIFO (named pipe)"
        case S_IFCHR: "a character device"
        case S_IFBLK: "a block device"
        case S_IFLNK: "a symbolic link"
        default: "not a socket"
        }
    }
}
