import Synchronization

/// Runs an operation that may be abandoned: by a timeout or by cancelling the waiting task.
///
/// The operation runs in its own task so the caller can return the moment the deadline passes or
/// it is cancelled, even if the operation is slow to notice. The operation's task is cancelled
/// then, and a result it still produces later is handed to `discard` (a late connection is closed,
/// not leaked).
enum Deadline {
    static func run<T: Sendable>(
        timeout: Duration?,
        timeoutError: TransportError,
        discard: @escaping @Sendable (T) async -> Void,
        _ operation: @escaping @Sendable () async throws -> T
    ) async throws -> T {
        let outcome = Outcome<T>()
        let work = Task {
            do {
                let value = try await operation()
                if !outcome.deliver(.success(value)) { await discard(value) }
            } catch {
                outcome.deliver(.failure(error))
            }
        }
        let timer = timeout.map { timeout in
            Task {
                try await Task.sleep(for: timeout)
                if outcome.deliver(.failure(timeoutError)) { work.cancel() }
            }
        }
        defer { timer?.cancel() }
        return try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { continuation in
                outcome.wait(continuation)
            }
        } onCancel: {
            if outcome.deliver(.failure(CancellationError())) { work.cancel() }
        }
    }

    /// The first result wins; later ones are refused (so their owner can clean up).
    final class Outcome<T: Sendable>: Sendable {
        private let state = Mutex<(result: Result<T, any Error>?, waiter: CheckedContinuation<T, any Error>?)>((nil, nil))

        /// Returns `true` when `result` is the first.
        @discardableResult
        func deliver(_ result: Result<T, any Error>) -> Bool {
            let (first, waiter) = state.withLock { state -> (Bool, CheckedContinuation<T, any Error>?) in
                guard state.result == nil else { return (false, nil) }
                state.result = result
                defer { state.waiter = nil }
                return (true, state.waiter)
            }
            waiter?.resume(with: result)
            return first
        }

        func wait(_ continuation: CheckedContinuation<T, any Error>) {
            let ready = state.withLock { state -> Result<T, any Error>? in
                if let result = state.result { return result }
                state.waiter = continuation
                return nil
            }
            if let ready { continuation.resume(with: ready) }
        }
    }
}
