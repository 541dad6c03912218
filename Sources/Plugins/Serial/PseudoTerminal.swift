// PseudoTerminal.swift: pty:// — a new pseudo-terminal pair through openpty(3) (pty(7)).
// The connection is the master side; the peer node (/dev/pts/N) is what another program opens as
// if it were a serial port. Both sides start in raw mode so bytes pass untouched.

import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
import TransportKitLinux
import TransportKitUdev

enum PseudoTerminal {
    @Sendable static func connect(_ request: ConnectRequest) async throws -> Connection {
        let settings = try request.serialSettings()
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
        let link: String?
        do {
            var tio = try Termios.get(peer, path: peerPath)
            Termios.configure(&tio, settings)
            try Termios.set(peer, tio, path: peerPath)
            link = try request[SerialPlugin.link].map { path in
                try Syscall.run("symlink", on: path, hint: "remove the file that is there, or choose another link path") { symlink(peerPath, path) }
                return path
            }
        } catch {
            device.close()
            peer.closeOwned()
            throw error
        }
        let cleanup: @Sendable () -> Void = {
            peer.closeOwned()
            if let link { unlink(link) }
        }
        let channel: ChannelBackend
        do {
            channel = try await DescriptorChannel.adoptDuplicate(of: master, describing: "pty://\(peerPath)")
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
    static func peerName(_ fd: FileDescriptor) -> String {
        Sysfs.readLink("/proc/self/fd/\(fd.rawValue)") ?? "/dev/pts/?"
    }
}
