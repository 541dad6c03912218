// PseudoTerminal.swift: pty:// — a new pseudo-terminal pair through openpty(3) (pty(7)).
// The connection is the master side; the peer node (/dev/pts/N) is what another program opens as
// if it were a serial port. Both sides start in raw mode so bytes pass untouched.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

enum PseudoTerminal {
    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let settings = try request.ttySettings()
        var masterFD: Int32 = -1
        var peerFD: Int32 = -1
        try Syscall.run("openpty", on: "a new pseudo-terminal") { openpty(&masterFD, &peerFD, nil, nil, nil) }
        let master = FileDescriptor(rawValue: masterFD)
        let peer = FileDescriptor(rawValue: peerFD)
        // openpty(3) has no close-on-exec flag; set it before anything can fork.
        _ = fcntl(masterFD, F_SETFD, FD_CLOEXEC)
        _ = fcntl(peerFD, F_SETFD, FD_CLOEXEC)
        // The peer descriptor lives as long as the connection, so programs can open and close the
        // node repeatedly: a pty whose peer side has no open descriptor makes the master read EIO,
        // which would end the connection the first time a program closed it.
        let peerPath = peerName(peer)
        let device = TTYDevice(path: "pty master of \(peerPath)", fd: master)
        let link: OwnedPath?
        do {
            try Termios.apply(settings, over: try Termios.get(peer, path: peerPath), to: peer, path: peerPath)
            link = try request[SerialPlugin.link].map { path in try makeLink(path, to: peerPath) }
        } catch {
            device.close()
            peer.closeOwned()
            throw error
        }
        let cleanup: @Sendable () -> Void = {
            peer.closeOwned()
            // Only the link made here: a file someone put in its place stays.
            link?.remove()
        }
        let channel: ChannelBackend
        do {
            channel = try await DescriptorChannel.adoptDuplicate(of: master, describing: "pty://\(peerPath)", buffering: request.buffering,
                                                                 hangUp: SerialBackend.hangUp("the pty \(peerPath)"))
        } catch {
            device.close()
            cleanup()
            throw error
        }
        // metadata.peerPath and peerLink (extra["peer"] and extra["link"]).
        var metadata = ConnectionMetadata(name: "pseudo-terminal", remoteAddress: peerPath)
        metadata.peerPath = peerPath
        metadata.peerLink = link?.path
        return Connection(url: request.url,
                          backend: SerialBackend(device: device, channel: channel, cleanup: cleanup),
                          metadata: metadata)
    }

    /// symlink(2) with an explanation for the ways it fails; the link as made, to be removed
    /// only while it is still that link.
    static func makeLink(_ path: String, to peerPath: String) throws -> OwnedPath {
        guard !path.isEmpty else {
            throw TransportError(.invalidURL, "the option 'link' needs a path, such as link=/tmp/ttyFAKE0")
        }
        guard case .failure(let errno) = Syscall.attempt({ symlink(peerPath, path) }) else {
            guard let owned = OwnedPath(recording: path, kind: S_IFLNK, target: peerPath) else {
                // Not removed: whatever is there now is somebody else's.
                throw TransportError(.busy, "the link \(TransportError.printable(path)) was removed or replaced right after it was made; "
                                     + "another program is using that path: choose another link path")
            }
            return owned
        }
        let path = TransportError.printable(path)
        let directory = path.lastIndex(of: "/").map { String(path[..<$0]) }.map { $0.isEmpty ? "/" : $0 } ?? "the current directory"
        let message = switch errno {
        case .fileExists:
            "cannot create the link \(path): something is already there. Remove it if it is a leftover link, or choose another link path"
        case .noSuchFileOrDirectory:
            "cannot create the link \(path): the directory \(directory) does not exist"
        case .permissionDenied, .notPermitted, .readOnlyFileSystem:
            "cannot create the link \(path): this user may not create files in \(directory); choose a directory you can write to, such as /tmp"
        case .notDirectory:
            "cannot create the link \(path): a part of the path is not a directory"
        default:
            "cannot create the link \(path)"
        }
        throw TransportError(errno == .fileExists ? .busy : TransportError.Kind(errno: errno), message, errno: errno, syscall: "symlink")
    }

    /// The peer's node, from /proc/self/fd (ptsname(3) is not visible to Swift).
    static func peerName(_ fd: FileDescriptor) -> String {
        Sysfs.readLink("/proc/self/fd/\(fd.rawValue)") ?? "/dev/pts/?"
    }
}
