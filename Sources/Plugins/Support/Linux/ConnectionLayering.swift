// ConnectionLayering.swift: protocol layers (TLS, WebSocket) over a Connection that is not a
// SwiftNIO channel of its own making (tls+tty://, tls+rfcomm://, tls+unix://). socketpair(2) gives
// the layers a real channel: one end carries the layers' pipeline, the other is relayed to and
// from the wrapped connection. tls://HOST:PORT runs its layer on the TCP channel itself
// (TCPSocket.connect(_:host:port:layers:)) without a relay; tls+tcp:// goes through the relay.

import Glibc
import NIOCore
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore

/// Runs `ProtocolLayer`s over any `Connection`.
///
/// ```swift
/// // A wrapper scheme's connect handler: TLS over whatever URL it wraps.
/// let inner = try await request.connectInner()
/// return try await ConnectionLayering.layer([tlsLayer], over: inner, request: request)
/// ```
@_spi(Plugins)
public enum ConnectionLayering {
    /// Runs `layers` over `inner`, their ready steps (handshakes) inside this call: a failure is
    /// its error, and `inner` is closed then. The returned connection owns `inner`: closing it runs
    /// the layers' closing handshakes, then closes `inner`. Its metadata is `inner`'s with the
    /// layers' facts added; control calls (`serialPort`) reach `inner`. When `inner` fails (a
    /// device unplugged), reads report that failure rather than the layer's view of it.
    public static func layer(_ layers: [ProtocolLayer], over inner: Connection, request: ConnectRequest) async throws -> Connection {
        let describing = request.url.shown
        var pair: [Int32] = [-1, -1]
        do {
            try Syscall.run("socketpair", on: describing) { socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0, &pair) }
        } catch {
            try? await inner.close()
            throw error
        }
        let steps = Locked<[ProtocolLayer.ReadyStep]>([])
        let wire: ChannelBackend
        let top: ChannelBackend
        do {
            wire = try await DescriptorChannel.adoptSocket(FileDescriptor(rawValue: pair[0]), describing: "the wire of \(describing)",
                                                           buffering: request.buffering)
        } catch {
            FileDescriptor(rawValue: pair[1]).closeOwned()
            try? await inner.close()
            throw error
        }
        do {
            top = try await DescriptorChannel.adoptSocket(FileDescriptor(rawValue: pair[1]), describing: describing, buffering: request.buffering,
                                                          messages: layers.last?.messages ?? false,
                                                          messageKinds: layers.last?.messageKinds ?? false,
                                                          supportsHalfClose: layers.allSatisfy(\.supportsHalfClose)) { channel in
                let made = try ProtocolLayer.install(layers, on: channel)
                steps.withLock { $0 = made }
            }
        } catch {
            try? await wire.close()
            try? await inner.close()
            throw error
        }
        let relay = Relay(inner: inner, wire: wire, top: top)
        let told: [String: String]
        do {
            told = try await ProtocolLayer.awaitReady(steps.withLock { $0 }, on: top.channel)
        } catch {
            // Nothing was acknowledged yet: the inner connection goes at once, without waiting on it.
            top.connectionDropped()
            relay.abandon()
            await relay.finished()
            // The inner connection's own failure says more than the handshake's view of it.
            throw relay.innerFailure ?? error
        }
        var extra = await ProtocolLayer.metadata(of: layers, on: top.channel)
        extra.merge(told) { _, new in new }
        inner.updateMetadata { $0.extra.merge(extra) { _, new in new } }
        return Connection(url: request.url, backend: LayeredBackend(top: top, wrapped: inner, relay: relay))
    }

    /// Copies bytes between the wrapped connection and the wire end of the socket pair, both ways,
    /// with the connections' own backpressure; tears everything down once the layers' end closed.
    final class Relay: Sendable {
        private let task: Locked<Task<Void, Never>?> = Locked(nil)
        private let failure = FirstFailure()
        private let undelivered = FirstFailure()
        private let inner: Connection

        /// The first failure of one kind, kept for whoever reports it.
        final class FirstFailure: Sendable {
            private let value = Locked<(error: TransportError?, frozen: Bool)>((nil, false))
            var error: TransportError? { value.withLock { $0.error } }
            func record(_ error: any Error, _ context: String) {
                guard !(error is CancellationError) else { return }
                let mapped = TransportError.from(error, context: context)
                value.withLock { if !$0.frozen { $0.error = $0.error ?? mapped } }
            }
            /// Records nothing more: what follows is the relay's own teardown.
            func freeze() { value.withLock { $0.frozen = true } }
        }

        /// The wrapped connection's own failure (reading from it, or writing to it), never the
        /// socket pair's: a read reports it rather than the layers' view of it.
        var innerFailure: TransportError? { failure.error }
        /// Why bytes the layers wrote did not all reach the wrapped connection (a failed write or
        /// close of it): `close()` reports it, so no acknowledged byte is lost silently.
        var undeliveredFailure: TransportError? { undelivered.error }

        init(inner: Connection, wire: ChannelBackend, top: ChannelBackend) {
            self.inner = inner
            let wireConnection = Connection(url: inner.url, backend: wire)
            let failure = self.failure
            let undelivered = self.undelivered
            let task = Task {
                // Down: the wrapped connection's bytes to the layers; its end is the wire's end.
                // An error writing to the wire means the layers' end closed: not the inner's fault.
                let down = Task {
                    // Unstructured: the relay cancels it itself.
                    while !Task.isCancelled {
                        let chunk: ByteBuffer?
                        do {
                            chunk = try await inner.readBuffer()
                        } catch {
                            if !Task.isCancelled { failure.record(error, "reading from \(inner.url.shown)") }
                            break
                        }
                        guard let chunk else { break }
                        do { try await wireConnection.write(chunk) } catch { return }
                    }
                    try? await wireConnection.closeWrite()
                }
                // Up: the layers' bytes (records, frames, closing handshakes) to the wrapped connection.
                while true {
                    let chunk: ByteBuffer?
                    do {
                        chunk = try await wireConnection.readBuffer()
                    } catch {
                        break   // the layers' end reset: nothing more to forward
                    }
                    guard let chunk else { break }
                    do {
                        try await inner.write(chunk)
                    } catch {
                        if !Task.isCancelled {
                            failure.record(error, "writing to \(inner.url.shown)")
                            undelivered.record(error, "writing to \(inner.url.shown)")
                        }
                        break
                    }
                }
                // The layers closed their sending side; once they closed entirely, so does the rest.
                try? await top.channel.closeFuture.get()
                down.cancel()
                if Task.isCancelled {
                    inner.abort()
                } else {
                    do { try await inner.close() } catch { undelivered.record(error, "closing \(inner.url.shown)") }
                }
                _ = await down.value
                try? await wireConnection.close()
            }
            self.task.withLock { $0 = task }
        }

        /// Waits until the relay has closed the wrapped connection.
        func finished() async {
            await task.withLock { $0 }?.value
        }

        /// Stops relaying and releases the wrapped connection at once (nothing acknowledged is
        /// pending: the handshake failed, or the application dropped the connection).
        func abandon() {
            failure.freeze()
            undelivered.freeze()
            task.withLock { $0 }?.cancel()
            inner.abort()
        }
    }
}

/// The connection ``ConnectionLayering`` returns: the layers' end of the socket pair, wrapping the
/// connection the relay serves.
final class LayeredBackend: WrappingBackend {
    let top: ChannelBackend
    let wrapped: Connection
    let relay: ConnectionLayering.Relay

    init(top: ChannelBackend, wrapped: Connection, relay: ConnectionLayering.Relay) {
        self.top = top
        self.wrapped = wrapped
        self.relay = relay
    }

    var supportsHalfClose: Bool { top.supportsHalfClose }
    var carriesMessages: Bool { top.carriesMessages }
    var maximumWriteSize: Int? { nil }
    var preferredExecutor: (any TaskExecutor)? { top.preferredExecutor }
    /// Not known: the relay between the layers and the wrapped connection holds bytes of its own.
    var unsentByteCount: Int? { nil }
    /// What the top of the stack (the decrypted side) holds for the reader.
    var unreadByteCount: Int? { top.unreadByteCount }

    func read() async throws -> ByteBuffer? {
        do {
            return try await top.read()
        } catch {
            throw relay.innerFailure ?? error
        }
    }

    func write(_ buffer: ByteBuffer) async throws {
        do {
            try await top.write(buffer)
        } catch {
            throw relay.innerFailure ?? error
        }
    }

    /// The layers' next message, with its kind (the wrapped connection carries their bytes).
    func readMessage() async throws -> TransportMessage? {
        do {
            return try await top.readMessage()
        } catch {
            throw relay.innerFailure ?? error
        }
    }

    func writeMessage(_ message: TransportMessage) async throws {
        do {
            try await top.writeMessage(message)
        } catch {
            throw relay.innerFailure ?? error
        }
    }

    func closeWrite() async throws { try await top.closeWrite() }

    /// The layers' closing handshake, then the wrapped connection's close (by the relay), which
    /// this waits for even when the handshake failed; a byte the wrapped connection did not take
    /// is reported.
    func close() async throws {
        var failure: (any Error)?
        do { try await top.close() } catch { failure = error }
        await uncancellable { [relay] in await relay.finished() }
        if let failure { throw failure }
        if let undelivered = relay.undeliveredFailure {
            throw TransportError(undelivered.kind, "bytes written to \(wrapped.url.shown) were not delivered: \(undelivered.message)",
                                 errno: undelivered.errno, syscall: undelivered.syscall)
        }
    }

    func connectionDropped() {
        top.connectionDropped()
        relay.abandon()
    }
}
