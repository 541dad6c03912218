// TCP stream sockets: socket(7), tcp(7). Connect resolves names with getaddrinfo(3) and races IPv6
// and IPv4 (SwiftNIO's Happy Eyeballs); options map to setsockopt(2).

import Glibc
import NIOCore
import NIOPosix
import TransportKitCore

enum TCPSocket {
    static func connect(_ request: ConnectRequest) async throws -> Connection {
        guard let host = request.url.host, let port = request.url.port else {
            throw TransportError(.invalidURL, "tcp:// needs HOST:PORT. Grammar: \(request.scheme.grammar)")
        }
        let target = "tcp://\(host.contains(":") ? "[\(host)]" : host):\(port)"
        let options = request.options
        let (channel, backend) = try await ClientSocket.connect(
            request, describing: target,
            configure: { try applySocketOptions(options, to: $0) },
            mapError: { mapConnectError($0, host: host, port: port, target: target) }
        ) { bootstrap in
            try await bootstrap.connect(host: host, port: port).get()
        }
        return Connection(url: request.url, backend: backend, metadata: metadata(of: channel, name: target))
    }

    static func applySocketOptions(_ options: OptionValues, to channel: any Channel) throws {
        let sync = channel.syncOptions
        try sync?.setOption(.socketOption(.tcp_nodelay), value: options.bool("noDelay") ?? true ? 1 : 0)
        let idle = options.double("keepAliveIdle")
        if options.bool("keepAlive") == true || idle != nil {
            try sync?.setOption(.socketOption(.so_keepalive), value: 1)
        }
        if let idle {
            let option = ChannelOptions.Types.SocketOption(level: .tcp, name: NIOBSDSocket.Option(rawValue: TCP_KEEPIDLE))
            try sync?.setOption(option, value: SocketOptionValue(max(1, Int32(idle.rounded()))))
        }
    }

    static func metadata(of channel: any Channel, name: String) -> ConnectionMetadata {
        ConnectionMetadata(name: name, localAddress: channel.localAddress?.description,
                           remoteAddress: channel.remoteAddress?.description)
    }

    static func mapConnectError(_ error: any Error, host: String, port: Int, target: String) -> TransportError {
        if let error = error as? NIOConnectionError {
            if error.connectionErrors.isEmpty, error.dnsAError != nil || error.dnsAAAAError != nil {
                return TransportError(.notFound, "cannot resolve the host '\(host)': check the name, or use an IP address")
            }
            let failures = error.connectionErrors.map { TransportError.from($0.error, context: "connecting to \($0.target)", syscall: "connect") }
            if let refused = failures.first(where: { $0.kind == .refused }) {
                return TransportError(.refused, "\(target) refused the connection: is the server running and listening on port \(port)?",
                                      errno: refused.errno, syscall: "connect")
            }
            if let first = failures.first { return first }
        }
        return TransportError.from(error, context: "connecting to \(target)", syscall: "connect")
    }

    static func listen(_ request: ConnectRequest) async throws -> Listener {
        guard let host = request.url.host, let port = request.url.port else {
            throw TransportError(.invalidURL, "tcp:// listening needs HOST:PORT (PORT 0 picks one). Grammar: \(request.scheme.grammar)")
        }
        let options = request.options
        let listener = try await SocketListener.bind(
            backlog: options.int("backlog") ?? 128,
            configure: { channel in try applySocketOptions(options, to: channel) },
            describePeer: { channel in "tcp://\(channel.remoteAddress.map(hostPort) ?? "?")" },
            bind: { bootstrap in
                do {
                    return try await bootstrap.bind(host: host, port: port).get()
                } catch {
                    throw TransportError.from(error, context: "listening on \(host):\(port)")
                }
            }
        )
        var url = request.url
        url.port = listener.boundPort ?? port
        return Listener(url: url, backend: listener)
    }

    static func hostPort(_ address: SocketAddress) -> String {
        let ip = address.ipAddress ?? "?"
        let host = ip.contains(":") ? "[\(ip)]" : ip
        return "\(host):\(address.port ?? 0)"
    }
}
