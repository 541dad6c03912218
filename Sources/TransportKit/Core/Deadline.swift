/// Runs an operation that may be abandoned: by its deadline or by cancelling the waiting task.
///
/// The operation runs in its own task so the caller can return the moment the deadline passes or
/// it is cancelled, even if the operation is slow to notice. The operation's task is cancelled
/// then, and a result it still produces later is handed to `discard` (a late connection is closed,
/// not leaked). This is the one timer of a connect: plugins and the URLs they open through the
/// request share it.
enum Deadline {
    /// Operations whose caller gave up on them and that are still running (their late result is
    /// yet to be discarded), plus cleanups started by `startCleanup` that have not finished.
    /// Never below zero; briefly above while a give-up races the result.
    static let abandoned = AsyncCondition(0)

    /// Waits until every abandoned operation has finished and discarded its result.
    static func waitForAbandoned() async {
        try? await abandoned.wait { $0 <= 0 ? () : nil }
    }

    static func run<T: Sendable>(
        until deadline: ContinuousClock.Instant?,
        timeoutError: TransportError,
        discard: @escaping @Sendable (T) async -> Void,
        _ operation: @escaping @Sendable () async throws -> T
    ) async throws -> T {
        // The first result wins; the ones after it are refused, so their owner cleans up.
        let outcome = AsyncCondition<Result<T, any Error>?>(nil)
        let deliver: @Sendable (Result<T, any Error>) -> Bool = { result in
            outcome.update { current in
                guard current == nil else { return false }
                current = result
                return true
            }
        }
        let work = Task {
            let result: Result<T, any Error>
            do {
                result = .success(try await operation())
            } catch {
                result = .failure(error)
            }
            if !deliver(result) {
                // Abandoned: whatever was made late is cleaned up, then the count drops.
                if case .success(let value) = result { await discard(value) }
                abandoned.update { $0 -= 1 }
            }
        }
        // Counted before the failure is delivered, so the work's decrement (which follows only a
        // delivery of ours) never comes first; taken back when the work delivered first.
        let abandon: @Sendable (any Error) -> Void = { error in
            abandoned.update { $0 += 1 }
            if deliver(.failure(error)) {
                work.cancel()
            } else {
                abandoned.update { $0 -= 1 }
            }
        }
        let timer = deadline.map { deadline in
            Task {
                try await Task.sleep(until: deadline, clock: .continuous)
                abandon(timeoutError)
            }
        }
        defer { timer?.cancel() }
        do {
            return try await outcome.wait { $0 }.get()
        } catch is CancellationError where Task.isCancelled {
            // This task was cancelled while waiting: the operation is abandoned.
            abandon(CancellationError())
            return try await outcome.wait { $0 }.get()
        }
    }
}
