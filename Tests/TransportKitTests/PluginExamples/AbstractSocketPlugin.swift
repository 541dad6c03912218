// Example 1 of Docs/Plugins.md: a plugin over a file descriptor. PluginExampleTests checks that the
// document quotes this file verbatim between the markers, and runs the plugin.
// BEGIN EXAMPLE
import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// abstract://NAME connects to a Unix stream socket in Linux's abstract namespace (no file; `ss -x`
/// shows it as @NAME), which SwiftNIO's path-based API cannot reach. The plugin makes the socket
/// itself and hands the connected descriptor to the event loop.
struct AbstractSocketPlugin: TransportPlugin {
    var schemes: [Scheme] {
        [Scheme(SchemeDescriptor(
            scheme: "abstract",
            summary: "Unix stream socket in the abstract namespace",
            grammar: "abstract://NAME",
            examples: ["abstract://my-daemon"],
            host: .required, port: .forbidden, path: .forbidden
        )) { request in
            let target = "abstract://\(request.host)"
            let name = Array(request.host.utf8)
            guard name.count <= 107 else { throw TransportError(.invalidURL, "\(target): a name has at most 107 bytes") }
            // Non-blocking, so a listener with a full backlog fails (EAGAIN, .busy) instead of
            // blocking a thread; close-on-exec, so a spawned program does not inherit it.
            let fd = try Syscall.descriptor("socket", on: target) {
                socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
            }
            do {
                var address = sockaddr_un()
                address.sun_family = sa_family_t(AF_UNIX)
                // sun_path[0] stays 0: that is what puts the name in the abstract namespace.
                withUnsafeMutableBytes(of: &address.sun_path) { path in path[1...name.count].copyBytes(from: name) }
                let length = socklen_t(MemoryLayout<sa_family_t>.size + 1 + name.count)
                try Syscall.run("connect", on: target) {
                    withUnsafePointer(to: &address) { pointer in
                        pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { Glibc.connect(fd.rawValue, $0, length) }
                    }
                }
            } catch {
                fd.closeOwned()
                throw error
            }
            // From here the channel owns the descriptor: backpressure, half-close (shutdown), errno
            // and the system call in every error.
            let backend = try await DescriptorChannel.adoptSocket(fd, describing: target)
            return Connection(url: request.url, backend: backend, metadata: ConnectionMetadata(name: "@" + request.host))
        }]
    }
}
// END EXAMPLE
