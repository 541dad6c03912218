// USBTransfers.swift: a usb:// connection's data path. libusb's asynchronous bulk and interrupt
// transfers (libusb_fill_bulk_transfer, libusb_submit_transfer, libusb_cancel_transfer; "Asynchronous
// device I/O" in libusb's documentation), run by one event thread per connection
// (libusb_handle_events_timeout_completed, woken by libusb_interrupt_event_handler).
//
// - IN: `transfers` transfers are kept in flight. A completion's bytes go to the InboundQueue; when
//   it answers .pause the transfer is parked instead of resubmitted, and the queue's onResume
//   submits the parked ones again once the reader made room. Memory stays bounded by the queue's
//   high watermark plus what is in flight. The completions of one libusb_handle_events round are
//   appended with a deferred wake, and the reader is woken once after the round (BENCHMARKS.md).
// - OUT: a write is cut into pieces of `transferSize` (whole packets). The writer fills the OUT
//   transfers that are free; after that each OUT completion fills its transfer with the next piece
//   and submits it again from the event thread, as a plain libusb loop does, so a long write costs
//   one wake-up of the writer rather than one per piece. A write returns once all its pieces are
//   submitted (a writer waits while every OUT transfer is in flight); close() waits (up to 2 s) for
//   them to reach the device.
// - `zlp`: the last piece of a write gets LIBUSB_TRANSFER_ADD_ZERO_PACKET, so a write whose length is
//   a multiple of the packet size ends with a zero-length packet.
// - Unplugged: libusb completes what arrived, then every other transfer with NO_DEVICE; the reader
//   gets every byte, then "disconnected".

import CLibUSB
import Glibc
import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// libusb's completion callback: every transfer's user_data is its TransferTag, whose engine lives
/// until every transfer has completed (close() waits for that before freeing them).
private func usbTransferCompleted(_ transfer: UnsafeMutablePointer<libusb_transfer>?) {
    guard let transfer, let tag = transfer.pointee.user_data?.assumingMemoryBound(to: TransferTag.self).pointee else { return }
    tag.engine.takeUnretainedValue().completed(transfer, index: tag.index, isIn: tag.isIn)
}

/// What a transfer is, for its callback: no search through the engine's transfers.
private struct TransferTag {
    let engine: Unmanaged<USBTransferEngine>
    let index: Int
    let isIn: Bool
}

/// The transfers of one connection and the thread that runs them.
final class USBTransferEngine: @unchecked Sendable {
    // @unchecked: the transfer pointers are fixed at init. Each transfer, with its slot in
    // `inBuffers` or `outPieces`, has one owner at a time, handed over under `state`'s lock: the
    // engine while it is free or parked, libusb (and then its event thread's callback) from
    // libusb_submit_transfer until the callback.
    private struct State: Sendable {
        var inFlight = 0
        /// Threads inside a libusb call on a transfer outside the event thread (a submission and
        /// what follows it): the event thread, and so close(), waits for them too.
        var submitting = 0
        /// A transfer failed and its error is being worked out: writers wait for it.
        var failing = false
        var parked: [Int] = []
        var freeOut: [Int]
        var failure: TransportError?
        var closing = false
        var writing = false
        /// What the current write has not handed to a transfer yet (nil: no write, or all of it
        /// submitted). Taken piece by piece under the lock, by the writer or the event thread.
        var pending: ByteBuffer?
    }

    let device: LibUSBDevice
    /// The endpoint pair data moves on; `nil` for a control-only connection (`controlOnly=true`),
    /// which has no data transfers: its reads and writes are refused.
    let choice: USBEndpointChoice?
    /// The interface claimed, given back on close (`nil`: none).
    let claimed: Int?
    let inbound: InboundQueue
    let describing: String
    let transferSize: Int
    /// The OUT transfers' size: `transferSize` rounded down to whole packets, so that only a
    /// write's last piece can end in a short packet.
    let outSize: Int
    let zlp: Bool
    /// The device's sysfs directory: gone once it is unplugged.
    let sysPath: String?
    private let inTransfers: [UnsafeMutablePointer<libusb_transfer>]
    private let outTransfers: [UnsafeMutablePointer<libusb_transfer>]
    /// The IN transfers' memory: each reads into a ByteBuffer of its own, which goes to the reader
    /// as it is when the transfer came back at least half full (no copy), and is replaced.
    private let inBuffers: UnsafeMutablePointer<ByteBuffer>
    private let inSize: Int
    /// The OUT transfers' memory: each points into the piece of the write it carries (no copy);
    /// the piece's storage is retained here until the transfer completes.
    private let outPieces: UnsafeMutablePointer<Unmanaged<AnyObject>?>
    /// The transfers' user_data: IN transfers first, then OUT.
    private let tags: UnsafeMutablePointer<TransferTag>
    private let state: AsyncCondition<State>
    private let worker = Locked<WorkerThread?>(nil)
    /// Control transfers in flight (USBControl.swift), for close() to cancel.
    private let controls = Locked<[ObjectIdentifier: USBControlRequest]>([:])
    private let closed = Atomic<Bool>(false)
    /// Held from taking a write's piece until it is submitted (pump()).
    private let outOrder = Locked<Void>(())

    /// Allocates the transfers and starts the event thread; `start()` submits the IN transfers.
    /// Without `choice`, no transfer is allocated: the thread runs control transfers only.
    init(device: LibUSBDevice, choice: USBEndpointChoice?, claimed: Int?, transfers: Int, transferSize: Int, zlp: Bool, sysPath: String?,
         describing: String) throws {
        self.device = device
        self.sysPath = sysPath
        self.choice = choice
        self.claimed = claimed
        let transfers = choice == nil ? 0 : transfers
        self.describing = describing
        self.zlp = zlp
        self.transferSize = transferSize
        // IN transfers are a multiple of the packet size, or a full packet into the remainder
        // overflows; an interrupt IN transfer is one packet, so that each report arrives at once.
        let packet = max(1, choice?.input.maxPacketSize ?? 1)
        let inSize = choice?.input.type == 3 ? packet : (transferSize + packet - 1) / packet * packet
        let outPacket = max(1, choice?.output.maxPacketSize ?? 1)
        let outSize = max(outPacket, transferSize / outPacket * outPacket)
        self.outSize = outSize
        self.inSize = inSize
        var ins: [UnsafeMutablePointer<libusb_transfer>] = []
        var outs: [UnsafeMutablePointer<libusb_transfer>] = []
        func release() {
            for transfer in ins + outs { libusb_free_transfer(transfer) }
        }
        // No transfers without a choice (transfers is 0 then).
        for index in 0..<(2 * transfers) {
            guard let choice else { break }
            let isIn = index < transfers
            guard let transfer = libusb_alloc_transfer(0) else {
                release()
                throw TransportError(.io, "\(describing): out of memory for \(transfers) transfers", errno: .noMemory, syscall: "libusb_alloc_transfer")
            }
            // The buffer and length are set before each submission (arm(), send()).
            let endpoint = isIn ? choice.input : choice.output
            let fill = endpoint.type == 3 ? libusb_fill_interrupt_transfer : libusb_fill_bulk_transfer
            fill(transfer, device.handle, endpoint.address, nil, 0, usbTransferCompleted, nil, 0)
            if isIn { ins.append(transfer) } else { outs.append(transfer) }
        }
        inTransfers = ins
        outTransfers = outs
        inBuffers = .allocate(capacity: transfers)
        inBuffers.initialize(repeating: ByteBuffer(), count: transfers)
        outPieces = .allocate(capacity: transfers)
        outPieces.initialize(repeating: nil, count: transfers)
        state = AsyncCondition(State(freeOut: Array(0..<transfers).reversed()))
        let hook = ResumeHook()
        inbound = InboundQueue { hook.run() }
        tags = .allocate(capacity: 2 * transfers)
        for (offset, transfer) in (ins + outs).enumerated() {
            let isIn = offset < transfers
            (tags + offset).initialize(to: TransferTag(engine: Unmanaged.passUnretained(self), index: isIn ? offset : offset - transfers, isIn: isIn))
            transfer.pointee.user_data = UnsafeMutableRawPointer(tags + offset)
        }
        hook.set { [weak self] in self?.resumeReading() }
        do {
            // The device (Sendable) carries the context into the thread.
            let thread = try WorkerThread(name: "usb \(choice?.input.addressText ?? "ep0")") { [state, inbound] isStopping in
                var wait = timeval(tv_sec: 1, tv_usec: 0)
                while !(isStopping() && state.withLock({ $0.inFlight == 0 && $0.submitting == 0 })) {
                    _ = libusb_handle_events_timeout_completed(device.context, &wait, nil)
                    // The IN completions of this round were appended without waking the reader.
                    inbound.wakeReader()
                }
            } interrupt: {
                libusb_interrupt_event_handler(device.context)
            }
            worker.withLock { $0 = thread }
        } catch {
            release()
            freeMemory()
            throw error
        }
        for index in inTransfers.indices { arm(index) }
    }

    /// Gives IN transfer `index` a new, empty buffer of its own (its owner calls this).
    private func arm(_ index: Int) {
        var buffer = ByteBufferAllocator().buffer(capacity: inSize)
        // The pointer outlives the closure on purpose: libusb writes through it until the transfer
        // completes. `inBuffers` keeps the only reference to the storage meanwhile, and nothing
        // changes the buffer before then, so the storage neither moves nor goes away.
        let base = buffer.withUnsafeMutableWritableBytes { $0.baseAddress }
        (inBuffers + index).pointee = buffer
        inTransfers[index].pointee.buffer = base?.assumingMemoryBound(to: UInt8.self)
        inTransfers[index].pointee.length = Int32(inSize)
    }

    /// Lets go of the storage OUT transfer `index` pointed into (its owner calls this).
    private func releasePiece(_ index: Int) {
        outPieces[index]?.release()
        outPieces[index] = nil
    }

    /// Frees `inBuffers` and `outPieces`, once no transfer is in flight.
    private func freeMemory() {
        for index in outTransfers.indices { releasePiece(index) }
        inBuffers.deinitialize(count: inTransfers.count)
        inBuffers.deallocate()
        outPieces.deinitialize(count: outTransfers.count)
        outPieces.deallocate()
        tags.deinitialize(count: inTransfers.count + outTransfers.count)
        tags.deallocate()
    }

    /// Submits every IN transfer; throws when libusb refuses them (usbfs's memory limit, say).
    func start() throws {
        let all = state.update { state -> [Int] in
            state.inFlight += inTransfers.count
            return Array(inTransfers.indices)
        }
        for index in all { submit(inTransfers[index]) }
        if let failure = state.withLock({ $0.failure }) { throw failure }
    }

    /// On libusb's event thread, for every transfer that ended.
    fileprivate func completed(_ transfer: UnsafeMutablePointer<libusb_transfer>, index: Int, isIn: Bool) {
        let status = transfer.pointee.status
        if isIn {
            let length = Int(transfer.pointee.actual_length)
            var element: ByteBuffer?
            if length * 2 >= inSize {
                // At least half full: the buffer itself goes to the reader, and the transfer gets
                // a new one. A short one is copied, so that what waits unread stays within twice
                // the queue's watermark however small the device's packets.
                var full = (inBuffers + index).move()
                full.moveWriterIndex(forwardBy: length)
                (inBuffers + index).initialize(to: ByteBuffer())
                arm(index)
                element = full
            } else if length > 0 {
                element = ByteBuffer(bytes: UnsafeRawBufferPointer(start: transfer.pointee.buffer, count: length))
            }
            let demand = element.map { inbound.append($0, deferringWake: true) } ?? .more
            guard status == LIBUSB_TRANSFER_COMPLETED else {
                // Only close() and end() cancel; a cancellation from elsewhere still ends the stream.
                let first = state.withLock { state -> Bool in
                    state.inFlight -= 1
                    guard !state.closing, state.failure == nil, !state.failing else { return false }
                    state.failing = true
                    return true
                }
                if first { end(failure(status, direction: "IN")) }
                return
            }
            let resubmit = state.withLock { state -> Bool in
                if state.closing || state.failure != nil || demand == .pause {
                    if demand == .pause && !state.closing && state.failure == nil { state.parked.append(index) }
                    state.inFlight -= 1
                    return false
                }
                return true
            }
            if resubmit {
                submit(transfer, onEventThread: true)
            } else if demand == .pause, inbound.shouldProduce() {
                // The reader drained between append and parking: no onResume is owed for that.
                resumeReading()
            }
        } else {
            let failed = status != LIBUSB_TRANSFER_COMPLETED && status != LIBUSB_TRANSFER_CANCELLED
            // The slot is freed and the failure flagged at once, so nothing is submitted after a
            // piece that failed; the error itself may take a moment (deviceStays). Otherwise the
            // transfer carries the current write's next piece, if there is one.
            releasePiece(index)
            let first = state.withLock { state -> Bool in
                state.inFlight -= 1
                state.freeOut.append(index)
                guard failed, state.failure == nil, !state.failing else { return false }
                state.failing = true
                return true
            }
            if first {
                end(failure(status, direction: "OUT"))
            } else if !failed {
                pump(onEventThread: true)
            }
            // close() may wait for every OUT transfer to be back.
            if state.withLock({ $0.freeOut.count == outTransfers.count }) { state.update { _ in } }
        }
    }

    /// Submits parked IN transfers again (the queue's onResume, on the reader's thread).
    private func resumeReading() {
        let parked = state.withLock { state -> [Int] in
            guard !state.closing, state.failure == nil else { return [] }
            defer { state.parked = [] }
            state.inFlight += state.parked.count
            return state.parked
        }
        for index in parked { submit(inTransfers[index]) }
    }

    /// libusb_submit_transfer for a transfer already counted in flight. On the event thread no
    /// `whileSubmitting` is needed: close() frees nothing before that thread has ended.
    private func submit(_ transfer: UnsafeMutablePointer<libusb_transfer>, out: Int? = nil, onEventThread: Bool = false) {
        func body() {
            let result = libusb_submit_transfer(transfer)
            guard result != 0 else {
                // close() or a failure may have cancelled everything in flight just before this
                // submission: cancel it too, or the event thread would wait for it forever.
                if state.withLock({ $0.closing || $0.failure != nil }) { _ = libusb_cancel_transfer(transfer) }
                return
            }
            if let out { releasePiece(out) }
            state.update { state in
                state.inFlight -= 1
                if let out { state.freeOut.append(out) }
            }
            end(result == LIBUSB_ERROR_NO_DEVICE.rawValue ? gone : LibUSBDevice.error(result, "libusb_submit_transfer", describing))
        }
        if onEventThread { body() } else { whileSubmitting(body) }
    }

    /// Runs libusb calls on transfers from a thread other than the event thread, holding the event
    /// thread (and so close()'s freeing of the transfers and the context) until they are done.
    func whileSubmitting<Result>(_ body: () -> Result) -> Result {
        state.withLock { $0.submitting += 1 }
        defer {
            let closing = state.withLock { state -> Bool in
                state.submitting -= 1
                return state.closing
            }
            if closing { libusb_interrupt_event_handler(device.context) }
        }
        return body()
    }

    /// A read or write on a control-only connection.
    func controlOnlyRefusal(_ call: String) -> TransportError {
        TransportError(.unsupported, "\(describing): this connection was opened for control transfers only (controlOnly=true): it has no data "
                       + "endpoints to \(call); use connection.usbDevice's controlIn and controlOut, or leave controlOnly out to stream "
                       + "over a bulk or interrupt pair")
    }

    var gone: TransportError {
        TransportError(.disconnected, "\(describing): the USB device went away (unplugged or reset); reconnect when it is back (?wait=true waits for it)",
                       errno: .operationNotSupportedByDevice, syscall: "libusb_submit_transfer")
    }

    /// Whether the device is still in sysfs, waiting up to 1 s for it to leave: an unplug fails
    /// the transfers in flight first (with a protocol error, as dummy_hcd does, or NO_DEVICE) and
    /// removes the device a moment later (usb_disconnect runs from the hub's work queue).
    private func deviceStays() -> Bool {
        guard let sysPath else { return true }
        for _ in 0..<50 {
            if access(sysPath, F_OK) != 0 { return false }
            usleep(20_000)
        }
        return true
    }

    private func failure(_ status: libusb_transfer_status, direction: String) -> TransportError {
        let endpoint = (direction == "IN" ? choice?.input.addressText : choice?.output.addressText) ?? "?"
        var status = status
        if status != LIBUSB_TRANSFER_NO_DEVICE && !deviceStays() { status = LIBUSB_TRANSFER_NO_DEVICE }
        switch status {
        case LIBUSB_TRANSFER_NO_DEVICE:
            return gone
        case LIBUSB_TRANSFER_STALL:
            return TransportError(.io, "\(describing): endpoint \(endpoint) stalled (the device halted it)", errno: .brokenPipe, syscall: "libusb_submit_transfer")
        case LIBUSB_TRANSFER_OVERFLOW:
            return TransportError(.io, "\(describing): the device sent more than the \(direction) transfer holds on \(endpoint)", errno: .overflow, syscall: "libusb_submit_transfer")
        case LIBUSB_TRANSFER_TIMED_OUT:
            return TransportError(.timedOut, "\(describing): a transfer on \(endpoint) timed out", errno: .timedOut, syscall: "libusb_submit_transfer")
        default:
            return TransportError(.io, "\(describing): a transfer on \(endpoint) failed (libusb transfer status \(status.rawValue): a bus or protocol error)",
                                  errno: .ioError, syscall: "libusb_submit_transfer")
        }
    }

    /// The first failure ends the stream (after the bytes before it) and every waiting writer;
    /// the other transfers are cancelled.
    private func end(_ error: TransportError) {
        let first = state.update { state -> Bool in
            guard state.failure == nil else { return false }
            state.failure = error
            return true
        }
        guard first else { return }
        inbound.fail(error)
        cancelAll()
    }

    private func cancelAll() {
        // NOT_FOUND for a transfer that is not in flight: nothing to do for it.
        for transfer in inTransfers + outTransfers { _ = libusb_cancel_transfer(transfer) }
        for request in controls.withLock({ Array($0.values) }) { _ = libusb_cancel_transfer(request.transfer) }
    }

    /// Counts a control transfer in flight; refused once the connection failed or is closing.
    func beginControl(_ request: USBControlRequest) throws {
        try state.update { state in
            if let failure = state.failure { throw failure }
            if state.closing { throw TransportError(.misuse, "\(describing): the connection is closed") }
            state.inFlight += 1
        }
        controls.withLock { $0[ObjectIdentifier(request)] = request }
    }

    /// After libusb_submit_transfer: a close that began meanwhile may have missed it.
    func afterControlSubmitted(_ request: USBControlRequest) {
        if state.withLock({ $0.closing || $0.failure != nil }) { _ = libusb_cancel_transfer(request.transfer) }
    }

    /// The control transfer ended (its callback ran, or it was never submitted).
    func endControl(_ request: USBControlRequest) {
        controls.withLock { $0[ObjectIdentifier(request)] = nil }
        state.update { $0.inFlight -= 1 }
    }

    /// One piece of a write, in the OUT transfer `slot` (counted in flight already).
    private struct Piece {
        let slot: Int
        let bytes: ByteBuffer
        let last: Bool
    }

    /// Under the lock: the current write's next piece in a free OUT transfer, or nil (nothing
    /// pending, no free transfer, or the connection failing or closing).
    private func takePiece(_ state: inout State) -> Piece? {
        guard var pending = state.pending, !state.closing, state.failure == nil, !state.failing,
              let slot = state.freeOut.popLast() else { return nil }
        let length = min(outSize, pending.readableBytes)
        let bytes = pending.readSlice(length: length) ?? ByteBuffer()
        let last = pending.readableBytes == 0
        state.pending = last ? nil : pending
        state.inFlight += 1
        return Piece(slot: slot, bytes: bytes, last: last)
    }

    /// Points a piece's transfer at its bytes and submits it (on the writer's thread or the event thread).
    private func send(_ piece: Piece, onEventThread: Bool) {
        let transfer = outTransfers[piece.slot]
        piece.bytes.withUnsafeReadableBytesWithStorageManagement { bytes, storage in
            // NIO's way to use the bytes after the closure: the retained storage keeps them alive
            // until the transfer completes (releasePiece).
            outPieces[piece.slot] = storage.retain()
            transfer.pointee.buffer = bytes.baseAddress.map { UnsafeMutablePointer(mutating: $0.assumingMemoryBound(to: UInt8.self)) }
        }
        transfer.pointee.length = Int32(piece.bytes.readableBytes)
        transfer.pointee.flags = zlp && piece.last ? UInt8(LIBUSB_TRANSFER_ADD_ZERO_PACKET.rawValue) : 0
        submit(transfer, out: piece.slot, onEventThread: onEventThread)
    }

    /// Submits the current write's next pieces into the free OUT transfers, in order: the writer
    /// and the event thread both pump, and `outOrder` keeps one piece from overtaking another
    /// between being taken and being submitted.
    private func pump(onEventThread: Bool = false) {
        outOrder.withLock { _ in
            while let piece = state.withLock({ takePiece(&$0) }) {
                send(piece, onEventThread: onEventThread)
                // The writer waits for its last piece to be submitted.
                if piece.last { state.update { _ in } }
            }
        }
    }

    /// Sends `buffer`: returns once every piece is submitted.
    func write(_ buffer: ByteBuffer) async throws {
        // One write at a time; the rest of a write that failed or was cancelled is dropped.
        try await state.wait { state -> Void? in
            if let failure = state.failure { throw failure }
            if state.closing { throw TransportError(.misuse, "\(self.describing): the connection is closed") }
            guard !state.writing else { return nil }
            state.writing = true
            state.pending = buffer
            return ()
        }
        defer {
            state.update { state in
                state.writing = false
                state.pending = nil
            }
        }
        // Into the free transfers from here, then from the event thread as transfers complete;
        // this task waits for the last piece to be submitted.
        pump()
        try await state.wait { state -> Void? in
            if let failure = state.failure { throw failure }
            if state.closing { throw TransportError(.misuse, "\(self.describing): the connection is closed") }
            return state.pending == nil ? () : nil
        }
    }

    /// Waits (with `drain`, up to 2 s) for written data to reach the device, cancels what is left,
    /// stops the event thread once every transfer ended, gives the interface back and closes the
    /// device.
    func close(drain: Bool = true) async {
        guard !closed.exchange(true, ordering: .acquiringAndReleasing) else { return }
        let outs = outTransfers.count
        if drain {
            let transfers = state
            _ = try? await withTimeout(.seconds(2)) { try await transfers.wait { $0.freeOut.count == outs || $0.failure != nil ? () : nil } }
        }
        state.update { $0.closing = true }
        cancelAll()
        await worker.withLock { $0 }?.stop()
        // Transfers first: libusb_free_transfer logs through the transfer's handle and context.
        for transfer in inTransfers + outTransfers { libusb_free_transfer(transfer) }
        freeMemory()
        // Releasing the interface gives it back to a kernel driver it was detached from (a bind):
        // on a thread of its own, which a cancelled task (a signal's close) still gets; here only
        // if no thread can be started.
        let (device, claimed) = (device, claimed)
        if (try? await Blocking.runOnThread("tk usb close") { device.close(releasing: claimed) }) == nil { device.close(releasing: claimed) }
        if state.withLock({ $0.failure }) == nil {
            inbound.finish()
            state.update { $0.failure = TransportError(.misuse, "\(describing): the connection is closed") }
        }
    }
}

/// Lets the InboundQueue's onResume reach the engine made after it.
private final class ResumeHook: Sendable {
    private let action = Locked<(@Sendable () -> Void)?>(nil)
    func set(_ action: @escaping @Sendable () -> Void) { self.action.withLock { $0 = action } }
    func run() { action.withLock { $0 }?() }
}

/// The ConnectionBackend of a usb:// connection.
final class USBBackend: ConnectionBackend {
    let engine: USBTransferEngine
    let supportsHalfClose = false

    init(engine: USBTransferEngine) { self.engine = engine }

    func read() async throws -> ByteBuffer? {
        if engine.choice == nil { throw engine.controlOnlyRefusal("read") }
        return try await engine.inbound.next()
    }

    func write(_ buffer: ByteBuffer) async throws {
        if engine.choice == nil { throw engine.controlOnlyRefusal("write") }
        try await engine.write(buffer)
    }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "usb:// has no half-close (a bulk endpoint has no end-of-stream); close the connection instead")
    }

    func close() async throws { await engine.close() }

    func connectionDropped() {
        // Released without waiting for written data (the contract of connectionDropped).
        let engine = engine
        startCleanup { await engine.close(drain: false) }
    }
}
