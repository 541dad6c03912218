// HappyEyeballs.swift: connecting a stream socket to a host's addresses as RFC 8305 describes.
// A literal address is used as is; a name goes through getaddrinfo(3), on a thread of its own (it
// can block for seconds on DNS; a connect cancelled meanwhile returns at once and the thread
// finishes alone). The addresses alternate between families, the first family getaddrinfo
// returned first (RFC 8305 §4); an attempt starts every 250 ms (§5's Connection Attempt Delay),
// or at once when the one before failed, and the first connection made wins: the others are
// cancelled and their sockets closed. Each attempt is a non-blocking connect(2) that waits for
// writability on the readiness poller and reads SO_ERROR (connect(2), socket(7)).

import Glibc
import NIOCore
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

enum HappyEyeballs {
    /// RFC 8305 §5: the delay before the next attempt starts while one is under way.
    static let attemptDelay: Duration = .milliseconds(250)

    /// The addresses of `host`: a literal (IPv4, or IPv6 without brackets) as is; a name resolved
    /// with getaddrinfo(3), families alternating. Throws `.notFound` naming getaddrinfo for a name
    /// that does not resolve.
    static func addresses(host: String, port: Int) async throws -> [SocketAddress] {
        if let literal = try? SocketAddress(ipAddress: host, port: port) { return [literal] }
        let answer = AsyncCondition<Result<[SocketAddress], TransportError>?>(nil)
        // Counted as cleanup: a connect cancelled during a slow lookup leaves the thread to
        // finish, and waitForAbandonedConnects() waits for it.
        startCleanup {
            let result: Result<[SocketAddress], TransportError>
            do {
                result = .success(try await Blocking.runOnThread("tk getaddrinfo") { try resolve(host: host, port: port) })
            } catch {
                result = .failure(error as? TransportError ?? TransportError(.io, "resolving '\(TransportError.printable(host))' failed: \(error)"))
            }
            answer.update { $0 = result }
        }
        return try await answer.wait { $0 }.get()
    }

    /// getaddrinfo(3) for stream sockets, both families; interleaved by family.
    static func resolve(host: String, port: Int) throws(TransportError) -> [SocketAddress] {
        var hints = addrinfo()
        hints.ai_family = AF_UNSPEC
        hints.ai_socktype = Int32(SOCK_STREAM.rawValue)
        // No AI_ADDRCONFIG (as SwiftNIO's resolver): glibc does not count loopback as configured,
        // so a host without other IPv6 addresses would lose ::1 for localhost.
        var list: UnsafeMutablePointer<addrinfo>?
        let code = getaddrinfo(host, String(port), &hints, &list)
        guard code == 0, let list else {
            let reason = code == EAI_SYSTEM ? Syscall.errno.symbolicDescription : String(cString: gai_strerror(code))
            throw TransportError(.notFound, "cannot resolve the host '\(TransportError.printable(host))' (\(reason)): check the name, or use an IP address",
                                 syscall: "getaddrinfo")
        }
        defer { freeaddrinfo(list) }
        var found: [SocketAddress] = []
        var entry: UnsafeMutablePointer<addrinfo>? = list
        while let info = entry?.pointee {
            entry = info.ai_next
            guard let address = info.ai_addr else { continue }
            switch info.ai_family {
            case AF_INET: found.append(address.withMemoryRebound(to: sockaddr_in.self, capacity: 1) { SocketAddress($0.pointee, host: host) })
            case AF_INET6: found.append(address.withMemoryRebound(to: sockaddr_in6.self, capacity: 1) { SocketAddress($0.pointee, host: host) })
            default: continue
            }
        }
        let interleaved = interleave(found)
        guard !interleaved.isEmpty else {
            throw TransportError(.notFound, "cannot resolve the host '\(TransportError.printable(host))': it has no IPv4 or IPv6 address; check the name, or use an IP address",
                                 syscall: "getaddrinfo")
        }
        return interleaved
    }

    /// `addresses` without repeats, families alternating from the family of the first (RFC 8305
    /// §4): the first of that family, the first of the other, the second of the first, ….
    static func interleave(_ addresses: [SocketAddress]) -> [SocketAddress] {
        var byFamily: [(family: NIOBSDSocket.ProtocolFamily, addresses: [SocketAddress])] = []
        for address in addresses {
            if let index = byFamily.firstIndex(where: { $0.family == address.protocol }) {
                if !byFamily[index].addresses.contains(address) { byFamily[index].addresses.append(address) }
            } else {
                byFamily.append((address.protocol, [address]))
            }
        }
        var interleaved: [SocketAddress] = []
        for rank in 0..<(byFamily.map(\.addresses.count).max() ?? 0) {
            for family in byFamily where rank < family.addresses.count { interleaved.append(family.addresses[rank]) }
        }
        return interleaved
    }

    /// One connect attempt's outcome.
    private enum Attempt: Sendable {
        case connected(SystemPackage.FileDescriptor, SocketAddress)
        case failed(TransportError)
        case cancelled
        case timer
    }

    /// Connects to the first of `addresses` that answers (see the top of this file); `configure`
    /// sets socket options before each connect(2). Throws the failures as `failure` maps them (all
    /// of them, in the order the attempts started), or `CancellationError`.
    static func connect(to addresses: [SocketAddress], attemptDelay: Duration = attemptDelay,
                        configure: @escaping @Sendable (SystemPackage.FileDescriptor) throws -> Void,
                        failure: ([TransportError]) -> TransportError) async throws -> (SystemPackage.FileDescriptor, SocketAddress) {
        // One address (a literal, the common case): nothing to race, so no task group; the attempt
        // runs in the calling task, and its cancellation closes the socket as in the race.
        if addresses.count == 1, let only = addresses.first {
            do {
                return (try await attempt(only, configure: configure), only)
            } catch let error as TransportError {
                throw failure([error])
            }
        }
        // How many attempts may have started: one more every attemptDelay, or when one fails.
        let started = AsyncCondition(1)
        let count = addresses.count
        let (winner, failures) = await withTaskGroup(of: (Int, Attempt).self) { group -> ((SystemPackage.FileDescriptor, SocketAddress)?, [TransportError]) in
            for (index, address) in addresses.enumerated() {
                group.addTask {
                    do {
                        if index > 0 { try await started.wait { $0 > index ? () : nil } }
                        return (index, .connected(try await attempt(address, configure: configure), address))
                    } catch let error as TransportError {
                        started.update { $0 = max($0, index + 2) }
                        return (index, .failed(error))
                    } catch {
                        return (index, .cancelled)
                    }
                }
            }
            if count > 1 {
                group.addTask {
                    while (try? await Task.sleep(for: attemptDelay)) != nil {
                        if started.update({ value in
                            value += 1
                            return value >= count
                        }) { break }
                    }
                    return (-1, .timer)
                }
            }
            var winner: (SystemPackage.FileDescriptor, SocketAddress)?
            var failures: [(Int, TransportError)] = []
            for await (index, outcome) in group {
                switch outcome {
                case .connected(let fd, let address):
                    if winner == nil {
                        winner = (fd, address)
                        group.cancelAll()
                    } else {
                        fd.closeOwned()   // a second connection made as the first won
                    }
                case .failed(let error):
                    failures.append((index, error))
                    if failures.count == count { group.cancelAll() }
                case .cancelled, .timer:
                    break
                }
            }
            return (winner, failures.sorted { $0.0 < $1.0 }.map(\.1))
        }
        if Task.isCancelled {
            winner?.0.closeOwned()
            throw CancellationError()
        }
        guard let winner else { throw failure(failures) }
        return winner
    }

    /// One non-blocking connect(2) to `address`; the socket is closed on failure and cancellation.
    private static func attempt(_ address: SocketAddress, configure: @Sendable (SystemPackage.FileDescriptor) throws -> Void) async throws -> SystemPackage.FileDescriptor {
        let describing = "connecting to \(address)"
        let raw = socket(Int32(address.protocol.rawValue), Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard raw >= 0 else { throw StreamSocketBackend.failure(Syscall.errno, "socket", context: describing) }
        let fd = SystemPackage.FileDescriptor(rawValue: raw)
        do {
            try configure(fd)
            let result = address.withSockAddr { pointer, length in Syscall.attempt { Glibc.connect(raw, pointer, socklen_t(length)) } }
            switch result {
            case .success: return fd
            case .failure(.nowInProgress): break
            case .failure(let errno): throw StreamSocketBackend.failure(errno, "connect", context: describing)
            }
            if let errno = try await fd.waitForConnect(describing: describing) {
                throw StreamSocketBackend.failure(errno, "connect", context: describing)
            }
            return fd
        } catch {
            fd.closeOwned()
            throw error
        }
    }
}
