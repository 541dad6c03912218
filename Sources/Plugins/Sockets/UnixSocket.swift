// Unix domain stream sockets: unix(7). A listener owns its socket file: it replaces a stale one,
// creates it with exactly the mode asked for (fchmod(2) before bind(2), which Linux applies to the
// file less the umask, so the file is never more open than asked; listen(2) at once, so a client
// that sees the file is queued; then chmod(2) through /proc/self/fd for the bits the umask took),
// and unlink(2)s it when closed if it is still its own;
// /proc/net/unix says whether a socket file has a listener.

import Glibc
import NIOCore
import NIOPosix
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

enum UnixSocket {
    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let path = request.url.path
        let target = "unix://\(path)"
        let backend = try await ClientSocket.connect(
            describing: target, buffering: request.buffering,
            mapError: { mapError($0, path: path, doing: "connecting to") }
        ) { bootstrap, initializer in
            try await bootstrap.connect(unixDomainSocketPath: path, channelInitializer: initializer)
        }
        return Connection(url: request.url, backend: backend, metadata: ConnectionMetadata(name: target, remoteAddress: path))
    }

    /// What a bridge checks before it listens: a path that is there and is no socket can never be
    /// connected to. (A missing one may appear once its server starts.)
    @Sendable static func check(_ request: ConnectRequest) async throws {
        guard request.mode?.role == .connect else { return }
        let path = request.url.path
        var info = stat()
        if lstat(path, &info) == 0, info.st_mode & S_IFMT != S_IFSOCK, info.st_mode & S_IFMT != S_IFLNK {
            throw TransportError(.invalidURL, "\(TransportError.printable(path)) is \(UserPath.fileKind(info.st_mode)), not a socket: give the path of a unix socket that a server listens on")
        }
    }

    static func mapError(_ error: any Error, path: String, doing: String) -> TransportError {
        if error is SocketAddressError {
            return TransportError(.invalidURL, "the socket path '\(TransportError.printable(path))' is too long: Linux allows 107 bytes")
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
                return TransportError(.refused, "\(path) is \(UserPath.fileKind(info.st_mode)), not a socket: give the path of a unix socket that a server listens on",
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
        let mode = try fileMode(request)
        let backlog = request[SocketsPlugin.backlog]
        try await removeStaleSocket(at: path)
        let (fd, owned) = try bindSocketFile(path, mode: mode, backlog: backlog)
        let listener: SocketListener
        // Whether `fd` was handed to NIO, which closes it with its channel; until then a failure
        // closes it here.
        var adopted = false
        do {
            listener = try await SocketListener.bind(
                backlog: backlog,
                buffering: request.buffering,
                configure: { _ in },
                describePeer: { _ in "unix://\(path)" },
                bind: { bootstrap in
                    do {
                        // From here NIO owns the socket: a channel it fails to set up, it closes.
                        adopted = true
                        let channel = try await bootstrap.withBoundSocket(fd).get()
                        // NIO listens again, with its own backlog, when it adopts a bound socket;
                        // listen(2) once more sets the one asked for (connections queued meanwhile stay).
                        do {
                            try Syscall.run("listen", on: path) { Glibc.listen(fd, Int32(backlog)) }
                        } catch {
                            try? await channel.close()
                            throw error
                        }
                        return channel
                    } catch {
                        throw mapError(error, path: path, doing: "listening on")
                    }
                },
                onClose: { owned.remove() }
            )
        } catch {
            if !adopted { Glibc.close(fd) }
            owned.remove()
            throw error
        }
        let exposure = mode & 0o077 == 0
            ? ListenerExposure(reach: .thisUser, authenticated: false, who: "this user's programs (socket file mode \(octal(mode)))")
            : ListenerExposure(reach: .thisMachine, authenticated: false, who: "this machine's users that mode \(octal(mode)) lets open \(path)")
        return Listener(url: request.url, backend: listener, exposure: exposure)
    }

    /// The `mode=` of a listener: permission bits in octal, no more than 0777.
    static func fileMode(_ request: ConnectRequest) throws -> mode_t {
        let text = request[SocketsPlugin.mode]
        guard (3...4).contains(text.utf8.count), text.utf8.allSatisfy({ $0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "7") }),
              let mode = mode_t(text, radix: 8), mode <= 0o777 else {
            throw TransportError(.invalidURL, "\(request.url.shown): mode=\(TransportError.printable(text, limit: 40)) is not "
                                 + "a file mode: give permission bits in octal, such as 0600 (this user only) or 0660 (its group too). Grammar: \(request.scheme.grammar)")
        }
        return mode
    }

    static func octal(_ mode: mode_t) -> String {
        let digits = String(mode, radix: 8)
        return String(repeating: "0", count: max(0, 4 - digits.count)) + digits
    }

    /// socket(2), fchmod(2), bind(2) and listen(2): a unix socket file at `path` with exactly
    /// `mode`, listening as soon as it exists (a client that waits for the file to appear, then
    /// connects, is queued rather than refused), and the record of the file that lets close
    /// remove only it.
    static func bindSocketFile(_ path: String, mode: mode_t, backlog: Int) throws -> (Int32, OwnedPath) {
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: address.sun_path) else {
            throw TransportError(.invalidURL, "the socket path '\(TransportError.printable(path))' is too long: Linux allows 107 bytes")
        }
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: bytes) }
        let fd = try Syscall.run("socket(AF_UNIX)", on: path) {
            socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
        }
        do {
            // Linux gives the socket file these bits less the umask at bind(2) (af_unix.c).
            try Syscall.run("fchmod", on: path) { fchmod(fd, mode) }
            let length = socklen_t(MemoryLayout<sockaddr_un>.size)
            do {
                try Syscall.run("bind", on: path) {
                    withUnsafePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.bind(fd, $0, length) } }
                }
            } catch {
                throw mapError(error, path: path, doing: "listening on")
            }
            // listen(2) the moment the file exists, before anything else: a client that connects as
            // soon as it appears finds it listening, but for the few microseconds between the calls.
            let listening = Syscall.attempt { Glibc.listen(fd, Int32(backlog)) }
            guard let owned = OwnedPath(recording: path, kind: S_IFSOCK) else {
                // Not removed: whatever is there now is somebody else's.
                throw TransportError(.busy, "the socket file \(TransportError.printable(path)) was removed or replaced right after bind(2); "
                                     + "another program is using that path: choose another one")
            }
            do {
                if case .failure(let errno) = listening { throw TransportError.posix("listen", errno: errno, what: path) }
                try setExactMode(path, mode, of: owned)
            } catch {
                owned.remove()
                throw error
            }
            return (fd, owned)
        } catch {
            _ = Glibc.close(fd)
            throw error
        }
    }

    /// Gives the socket file at `path` exactly `mode` when the umask took bits from it: chmod(2)
    /// through /proc/self/fd of an O_PATH descriptor, so a link put in its place is not followed.
    private static func setExactMode(_ path: String, _ mode: mode_t, of owned: OwnedPath) throws {
        var info = stat()
        guard lstat(path, &info) == 0, info.st_mode & 0o777 != mode else { return }
        let located = try Syscall.run("open", on: path) { open(path, Syscall.openPath | O_NOFOLLOW | O_CLOEXEC) }
        defer { _ = Glibc.close(located) }
        guard fstat(located, &info) == 0, owned.isEntry(info) else {
            throw TransportError(.busy, "the socket file \(TransportError.printable(path)) was replaced right after it was made; try again")
        }
        try Syscall.run("chmod", on: path, hint: "the socket file's mode could not be set to \(octal(mode))") { chmod("/proc/self/fd/\(located)", mode) }
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
            throw TransportError(.busy, "\(path) exists and is \(UserPath.fileKind(info.st_mode)), not a socket; choose another path, or remove it if it is yours",
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
}
