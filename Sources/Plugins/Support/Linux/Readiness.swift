// Readiness.swift: waiting, without a thread, until a descriptor SwiftNIO does not own is readable
// or writable (a netlink socket, a D-Bus connection, a SEQPACKET socket BlueZ hands out).
//
// SwiftNIO 2.101 has no public way to register a foreign descriptor with its event loop, so this
// uses libdispatch's read and write sources (its own epoll): one source per wait, cancelled when
// the wait ends, and no thread is parked. Level-triggered: a descriptor that is already ready
// returns at once.

@preconcurrency import Dispatch  // DispatchSource types are not marked Sendable; they are thread-safe (libdispatch)
import SystemPackage
import TransportKitCore

extension FileDescriptor {
    /// What to wait for.
    public enum Readiness: Sendable {
        /// Bytes (or a hang-up, or an error) can be read without blocking.
        case readable
        /// Bytes can be written without blocking.
        case writable
    }

    private static let readinessQueue = DispatchQueue(label: "TransportKit.Readiness")

    /// Suspends until the descriptor is readable or writable. Cancelling the task ends the wait
    /// with `CancellationError`. The descriptor must stay open while this waits; when it returns
    /// (or throws), libdispatch is done with it and it may be closed.
    ///
    /// ```swift
    /// while true {
    ///     switch Syscall.attempt({ recv(fd.rawValue, &buffer, buffer.count, 0) }) {
    ///     case .success(let count): return count
    ///     case .failure(.resourceTemporarilyUnavailable): try await fd.wait(until: .readable)
    ///     case .failure(let errno): throw TransportError.posix("recv", errno: errno, what: path)
    ///     }
    /// }
    /// ```
    public func wait(until readiness: Readiness) async throws {
        let ready = AsyncCondition(false)
        let cancelled = AsyncCondition(false)
        let source: any DispatchSourceProtocol = switch readiness {
        case .readable: DispatchSource.makeReadSource(fileDescriptor: rawValue, queue: Self.readinessQueue)
        case .writable: DispatchSource.makeWriteSource(fileDescriptor: rawValue, queue: Self.readinessQueue)
        }
        source.setEventHandler {
            source.cancel()
            ready.update { $0 = true }
        }
        // libdispatch stops watching the descriptor only when the cancel handler runs: until then
        // the descriptor must stay open (its number could be reused by another file).
        source.setCancelHandler { cancelled.update { $0 = true } }
        source.resume()
        var failure: (any Error)?
        do {
            try await ready.wait { $0 ? () : nil }
        } catch {
            failure = error
        }
        source.cancel()
        // Not cancellable: the descriptor may be closed once this returns.
        await uncancellable { _ = try? await cancelled.wait { $0 ? () : nil } }
        if let failure { throw failure }
    }
}
