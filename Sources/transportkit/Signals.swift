// Signals.swift: SIGINT, SIGTERM and SIGHUP through Dispatch signal sources (signal(7)). A
// signal cancels the command's work, so everything it opened is closed the normal way (a tty gets
// its settings back, links and socket files are removed), and the tool then exits with 128 + the
// signal's number, as shells report a process killed by it. A connect in progress is cancelled
// too: what it made is closed by the registry, which Signals waits for.

import ArgumentParser
import Dispatch
import Glibc
import Synchronization
import TransportKit
@_spi(Plugins) import TransportKitCore

enum Signals {
    /// The signals that end the tool cleanly.
    static let handled: [Int32] = [SIGINT, SIGTERM, SIGHUP]

    /// How long the work may take to close up after a signal before the tool exits anyway.
    static let cleanupLimit: DispatchTimeInterval = .seconds(3)

    /// Runs `work` until it ends or a handled signal arrives. After a signal the work's task is
    /// cancelled and awaited (up to ``cleanupLimit``; a second signal exits at once), then
    /// `ExitCode(128 + signal)` is thrown.
    ///
    /// Standard output or a socket whose reader went away must be an error (EPIPE), not a
    /// signal that kills the tool mid-cleanup, so SIGPIPE is ignored here too.
    static func run(_ work: @escaping @Sendable () async throws -> Void) async throws {
        signal(SIGPIPE, SIG_IGN)
        // The handlers are in place before the work starts: a signal that arrives while it opens
        // something (a link, a socket file) must find it handled, not kill the process.
        let state = Locked<(received: Int32?, task: Task<Void, any Error>?)>((nil, nil))
        // A signal the tool was started with ignored stays ignored: `nohup` ignores SIGHUP, a
        // shell ignores SIGINT for a job it starts with `&`. (Dispatch would see it anyway.)
        let caught = handled.filter { number in
            let previous = signal(number, SIG_IGN)   // delivered to the source only
            let wasIgnored = previous.map { unsafeBitCast($0, to: Int.self) == 1 } ?? false   // SIG_IGN is 1
            return !wasIgnored
        }
        let sources = caught.map { number in
            let source = DispatchSource.makeSignalSource(signal: number, queue: .global())
            source.setEventHandler {
                let (first, task) = state.withLock { state in
                    defer { if state.received == nil { state.received = number } }
                    return (state.received == nil, state.task)
                }
                guard first else {
                    LocalTerminal.restore()   // `term`'s raw mode; nothing otherwise
                    _exit(128 + number)
                }
                task?.cancel()
                DispatchQueue.global().asyncAfter(deadline: .now() + cleanupLimit) {
                    LocalTerminal.restore()
                    StandardError.write("transportkit: closing up took longer than 3 s; exiting without waiting for the rest\n")
                    _exit(128 + number)
                }
            }
            source.resume()
            return source
        }
        defer { for source in sources { source.cancel() } }
        let task = Task { try await work() }
        let early = state.withLock { state in
            state.task = task
            return state.received != nil
        }
        if early { task.cancel() }
        do {
            try await task.value
        } catch {
            guard let number = state.withLock({ $0.received }) else { throw error }
            // A connect cut short by the signal may still finish; what it made is closed first.
            await Transport.registry.waitForAbandonedConnects()
            throw ExitCode(128 + number)
        }
        if let number = state.withLock({ $0.received }) { throw ExitCode(128 + number) }
    }
}
