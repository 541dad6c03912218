/// Runs an operation that may be abandoned: by its deadline or by cancelling the waiting task.
///
/// The operation runs in its own task so the caller can return the moment the deadline passes or
/// it is cancelled, even if the operation is slow to notice. The operation's task is cancelled
/// then, and a result it still produces later is handed to `discard` (a late connection is closed,
/// not leaked). This is the one timer of a connect: plugins and the URLs they open through the
/// request share it.
enum Deadline {
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
            do {
                let value = try await operation()
                if !deliver(.success(value)) { await discard(value) }
            } catch {
                _ = deliver(.failure(error))
            }
        }
        let timer = deadline.map { deadline in
            Task {
                try await Task.sleep(until: deadline, clock: .continuous)
                if deliver(.failure(timeoutError)) { work.cancel() }
            }
        }
        defer { timer?.cancel() }
        do {
            return try await outcome.wait { $0 }.get()
        } catch is CancellationError where Task.isCancelled {
            // This task was cancelled while waiting: the operation is abandoned.
            if deliver(.failure(CancellationError())) { work.cancel() }
            return try await outcome.wait { $0 }.get()
        }
    }
}
