// PseudoTerminal.swift: pty:// — a new pseudo-terminal pair through openpty(3) (pty(7)).
// The connection is the master side; the peer node (/dev/pts/N) is what another program opens as
// if it were a serial port. Both sides start in raw mode so bytes pass untouched.

import Foundation
import Glibc
import TransportKitCore

enum PseudoTerminal {
    static func connect(_ request: ConnectRequest) async throws -> Connection {
        let settings = try request.serialSettings()
        var master: Int32 = -1
        var peer: Int32 = -1
        try Posix.call("openpty", what: "a new pseudo-terminal") { openpty(&master, &peer, nil, nil, nil) }
        // openpty(3) has no close-on-exec flag; set it before anything can fork.
        _ = fcntl(master, F_SETFD, FD_CLOEXEC)
        _ = fcntl(peer, F_SETFD, FD_CLOEXEC)
        // The peer descriptor lives as long as the connection, so programs can open and close the
        // node repeatedly: a pty whose peer side has no open descriptor makes the master read EIO,
        // which would end the connection the first time a program closed it.
        let peerFD = peer
        let peerPath = peerName(peerFD)
        let device = TTYDevice(path: "pty master of \(peerPath)", fd: master)
        let link: String?
        do {
            var tio = try Termios.get(peerFD, path: peerPath)
            Termios.configure(&tio, settings)
            try Termios.set(peerFD, tio, path: peerPath)
            link = try request.options.string("link").map { path in
                try Posix.call("symlink", what: path, hint: "remove the file that is there, or choose another link path") { symlink(peerPath, path) }
                return path
            }
        } catch {
            device.close()
            Posix.close(peerFD)
            throw error
        }
        let cleanup: @Sendable () -> Void = {
            Posix.close(peerFD)
            if let link { unlink(link) }
        }
        let channel: ChannelBackend
        do {
            channel = try await SerialChannel.attach(fd: master, describing: "pty://\(peerPath)")
        } catch {
            device.close()
            cleanup()
            throw error
        }
        var extra = ["peer": peerPath]
        if let link { extra["link"] = link }
        return Connection(url: request.url,
                          backend: SerialBackend(device: device, channel: channel, describing: "the pty \(peerPath)", cleanup: cleanup),
                          metadata: ConnectionMetadata(name: "pseudo-terminal", remoteAddress: peerPath, extra: extra))
    }

    /// The peer's node, from /proc/self/fd (ptsname(3) is not visible to Swift).
    static func peerName(_ fd: Int32) -> String {
        (try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(fd)")) ?? "/dev/pts/?"
    }
}
