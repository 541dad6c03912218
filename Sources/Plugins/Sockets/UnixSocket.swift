// Unix domain stream sockets: unix(7). A listener owns its socket file: it replaces a stale one
// and unlink(2)s it when closed.

import Glibc
import NIOCore
import NIOPosix
import SystemPackage
@_spi(Plugins) import TransportKitCore

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
        switch mapped.kind {
        case .notFound:
            return TransportError(.notFound, "no socket at \(path): is the server running, and is the path right?",
                                  errno: mapped.errno, syscall: mapped.syscall)
        case .refused:
            return TransportError(.refused, "nobody accepts connections on \(path) (a stale socket file?)",
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

    /// A socket file nobody accepts on is left over from a process that died: replace it. One that
    /// accepts belongs to a live process: refuse with "busy" rather than steal its address.
    static func removeStaleSocket(at path: String) async throws {
        var info = stat()
        guard lstat(path, &info) == 0 else { return }
        guard info.st_mode & S_IFMT == S_IFSOCK else {
            throw TransportError(.busy, "\(path) exists and is not a socket; choose another path or remove the file")
        }
        do {
            let probe = try await ClientBootstrap(group: MultiThreadedEventLoopGroup.singleton)
                .connectTimeout(.seconds(1))
                .connect(unixDomainSocketPath: path).get()
            try? await probe.close().get()
            throw TransportError(.busy, "another process is listening on \(path); stop it or choose another path",
                                 errno: .addressInUse, syscall: "bind")
        } catch let error as TransportError {
            throw error
        } catch {
            if unlink(path) != 0 {
                throw TransportError.posix("unlink", errno: Errno(rawValue: errno), what: path, hint: "remove the stale socket file by hand")
            }
        }
    }
}
