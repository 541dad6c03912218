import NIOCore
import Synchronization

/// Runs Swift tasks on one NIO event loop: the loop that does a channel's I/O.
///
/// A task that prefers this executor (`withTaskExecutorPreference`) is resumed on the thread that
/// read its bytes, instead of being handed to the cooperative pool: one thread wake-up less per
/// read. Worth it for chatty request/response loops; for bulk transfers the default is as fast.
/// Never block inside such a task: it holds up every channel on that loop.
///
/// ```swift
/// let executor = EventLoopTaskExecutor(channel.eventLoop)
/// try await withTaskExecutorPreference(executor) { /* runs on channel.eventLoop */ }
/// ```
///
/// ``ChannelBackend`` goes one step further with the executor it hands out as
/// ``ChannelBackend/preferredExecutor``: when bytes arrive for a reader parked in such a task, the
/// task runs at once, inside the read, until it next suspends, as a SwiftNIO handler would; it is
/// not queued behind the rest of the loop's work. See ``resumeInline(_:)``.
@_spi(Plugins)
public final class EventLoopTaskExecutor: TaskExecutor {
    /// The loop the executor's jobs run on.
    public let eventLoop: any EventLoop
    /// Open only on the loop's thread, while ``resumeInline(_:)`` runs its closure; then it holds
    /// the job that closure made ready instead of queueing it.
    private let handoff = Locked(Handoff())

    private struct Handoff {
        var open = false
        var job: UnownedJob?
    }

    /// An executor that runs jobs on `eventLoop`.
    public init(_ eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
    }

    /// Runs `job` on the loop: handed to the running ``resumeInline(_:)`` when there is one, queued otherwise.
    public func enqueue(_ job: consuming ExecutorJob) {
        let job = UnownedJob(job)
        // Only the loop's thread can find the handoff open: resumeInline opens it there and closes
        // it before returning, and no other thread passes the inEventLoop test.
        if eventLoop.inEventLoop, handoff.withLock({ handoff in
            guard handoff.open, handoff.job == nil else { return false }
            handoff.job = job
            return true
        }) {
            return
        }
        let executor = self.asUnownedTaskExecutor()
        eventLoop.execute {
            job.runSynchronously(on: executor)
        }
    }

    /// Runs `resume`, which resumes a continuation of a task that may prefer this executor, and then
    /// runs that task right here until it next suspends, instead of queueing it on the event loop.
    ///
    /// Called by ``ChannelBackend``'s handler on the loop's thread when it hands bytes to a parked
    /// reader, so a request/response loop writes its reply before the event loop goes on, as a
    /// SwiftNIO handler would. Anywhere else (another thread, or inside a running task, where a
    /// nested job would break the runtime's bookkeeping) it only runs `resume` and the task is
    /// queued as usual. Continuations resumed elsewhere (a cancellation handler, the end of the
    /// stream, a writer waiting for room) never come through here and are always queued: the
    /// runtime calls cancellation handlers while it holds the task's status-record lock and walks
    /// those records, and the task would remove its own record from under it.
    ///
    /// ```swift
    /// // In a handler's channelRead, on the loop, with the reader taken out of shared state:
    /// executor.resumeInline { reader.resume(returning: buffer) }
    /// ```
    public func resumeInline(_ resume: () -> Void) {
        guard eventLoop.inEventLoop, withUnsafeCurrentTask(body: { $0 == nil }) else {
            resume()
            return
        }
        handoff.withLock { $0.open = true }
        resume()
        let job = handoff.withLock { handoff in
            handoff.open = false
            defer { handoff.job = nil }
            return handoff.job
        }
        job?.runSynchronously(on: self.asUnownedTaskExecutor())
    }
}
