// USBTransfers.swift: a usb:// connection's data path. libusb's asynchronous bulk and interrupt
// transfers (libusb_fill_bulk_transfer, libusb_submit_transfer, libusb_cancel_transfer; "Asynchronous
// device I/O" in libusb's documentation), run by one event thread per connection
// (libusb_handle_events_timeout_completed, woken by libusb_interrupt_event_handler).
//
// - IN: `transfers` transfers are kept in flight. A completion's bytes go to the InboundQueue; when
//   it answers .pause the transfer is parked instead of resubmitted, and the queue's onResume
//   submits the parked ones again once the reader made room. Memory stays bounded by the queue's
//   high watermark plus what is in flight.
// - OUT: a write is cut into pieces of `transferSize` (whole packets), each copied into a free OUT transfer and
//   submitted; a writer waits while every OUT transfer is in flight. A write returns once all its
//   pieces are submitted; close() waits (up to 2 s) for them to reach the device.
// - `zlp`: the last piece of a write gets LIBUSB_TRANSFER_ADD_ZERO_PACKET, so a write whose length is
//   a multiple of the packet size ends with a zero-length packet.
// - Unplugged: libusb completes what arrived, then every other transfer with NO_DEVICE; the reader
//   gets every byte, then "disconnected".

import CLibUSB
import Glibc
import NIOCore
import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitLinux

/// libusb's completion callback: every transfer's user_data is its engine, which lives until every
/// transfer has completed (close() waits for that before freeing them).
private func usbTransferCompleted(_ transfer: UnsafeMutablePointer<libusb_transfer>?) {
    guard let transfer, let engine = transfer.pointee.user_data else { return }
    Unmanaged<USBTransferEngine>.fromOpaque(engine).takeUnretainedValue().completed(transfer)
}

/// The transfers of one connection and the thread that runs them.
final class USBTransferEngine: @unchecked Sendable {
    // @unchecked: the transfer pointers and buffers are fixed at init. Each transfer has one owner
    // at a time, handed over under `state`'s lock: the engine while it is free or parked, libusb
    // (and then its event thread's callback) from libusb_submit_transfer until the callback.
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
    }

    let device: LibUSBDevice
    let choice: USBEndpointChoice
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
    private let state: AsyncCondition<State>
    private let worker = Mutex<WorkerThread?>(nil)
    /// Control transfers in flight (USBControl.swift), for close() to cancel.
    private let controls = Mutex<[ObjectIdentifier: USBControlRequest]>([:])
    private let closed = Atomic<Bool>(false)

    /// Allocates the transfers and starts the event thread; `start()` submits the IN transfers.
    init(device: LibUSBDevice, choice: USBEndpointChoice, transfers: Int, transferSize: Int, zlp: Bool, sysPath: String?,
         describing: String) throws {
        self.device = device
        self.sysPath = sysPath
        self.choice = choice
        self.describing = describing
        self.zlp = zlp
        self.transferSize = transferSize
        // IN transfers are a multiple of the packet size, or a full packet into the remainder
        // overflows; an interrupt IN transfer is one packet, so that each report arrives at once.
        let packet = max(1, choice.input.maxPacketSize)
        let inSize = choice.input.type == 3 ? packet : (transferSize + packet - 1) / packet * packet
        let outPacket = max(1, choice.output.maxPacketSize)
        let outSize = max(outPacket, transferSize / outPacket * outPacket)
        self.outSize = outSize
        var ins: [UnsafeMutablePointer<libusb_transfer>] = []
        var outs: [UnsafeMutablePointer<libusb_transfer>] = []
        func release() {
            for transfer in ins + outs {
                free(transfer.pointee.buffer)
                libusb_free_transfer(transfer)
            }
        }
        for index in 0..<(2 * transfers) {
            let isIn = index < transfers
            let size = isIn ? inSize : outSize
            guard let transfer = libusb_alloc_transfer(0) else {
                release()
                throw TransportError(.io, "\(describing): out of memory for \(transfers) transfers", errno: .noMemory, syscall: "libusb_alloc_transfer")
            }
            guard let buffer = malloc(size) else {
                libusb_free_transfer(transfer)
                release()
                throw TransportError(.io, "\(describing): out of memory for \(transfers) transfers of \(size) bytes", errno: .noMemory, syscall: "malloc")
            }
            let endpoint = isIn ? choice.input : choice.output
            let fill = endpoint.type == 3 ? libusb_fill_interrupt_transfer : libusb_fill_bulk_transfer
            fill(transfer, device.handle, endpoint.address, buffer.assumingMemoryBound(to: UInt8.self), Int32(size), usbTransferCompleted, nil, 0)
            if isIn { ins.append(transfer) } else { outs.append(transfer) }
        }
        inTransfers = ins
        outTransfers = outs
        state = AsyncCondition(State(freeOut: Array(0..<transfers).reversed()))
        let hook = ResumeHook()
        inbound = InboundQueue { hook.run() }
        let opaque = Unmanaged.passUnretained(self).toOpaque()
        for transfer in ins + outs { transfer.pointee.user_data = opaque }
        hook.set { [weak self] in self?.resumeReading() }
        do {
            // The device (Sendable) carries the context into the thread.
            let thread = try WorkerThread(name: "usb \(choice.input.addressText)") { [state] isStopping in
                var wait = timeval(tv_sec: 1, tv_usec: 0)
                while !(isStopping() && state.withLock({ $0.inFlight == 0 && $0.submitting == 0 })) {
                    _ = libusb_handle_events_timeout_completed(device.context, &wait, nil)
                }
            } interrupt: {
                libusb_interrupt_event_handler(device.context)
            }
            worker.withLock { $0 = thread }
        } catch {
            release()
            throw error
        }
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
    fileprivate func completed(_ transfer: UnsafeMutablePointer<libusb_transfer>) {
        let status = transfer.pointee.status
        if let index = inTransfers.firstIndex(of: transfer) {
            let length = Int(transfer.pointee.actual_length)
            var demand = InboundQueue.Demand.more
            if length > 0 {
                demand = inbound.append(ByteBuffer(bytes: UnsafeRawBufferPointer(start: transfer.pointee.buffer, count: length)))
            }
            guard status == LIBUSB_TRANSFER_COMPLETED else {
                // Only close() and end() cancel; a cancellation from elsewhere still ends the stream.
                let first = state.update { state -> Bool in
                    state.inFlight -= 1
                    guard !state.closing, state.failure == nil, !state.failing else { return false }
                    state.failing = true
                    return true
                }
                if first { end(failure(status, direction: "IN")) }
                return
            }
            let resubmit = state.update { state -> Bool in
                if state.closing || state.failure != nil || demand == .pause {
                    if demand == .pause && !state.closing && state.failure == nil { state.parked.append(index) }
                    state.inFlight -= 1
                    return false
                }
                return true
            }
            if resubmit {
                submit(transfer)
            } else if demand == .pause, inbound.shouldProduce() {
                // The reader drained between append and parking: no onResume is owed for that.
                resumeReading()
            }
        } else if let index = outTransfers.firstIndex(of: transfer) {
            let failed = status != LIBUSB_TRANSFER_COMPLETED && status != LIBUSB_TRANSFER_CANCELLED
            // The slot is freed and the failure flagged at once, so no writer submits after a
            // piece that failed; the error itself may take a moment (deviceStays).
            let first = state.update { state -> Bool in
                state.inFlight -= 1
                state.freeOut.append(index)
                guard failed, state.failure == nil, !state.failing else { return false }
                state.failing = true
                return true
            }
            if first { end(failure(status, direction: "OUT")) }
        }
    }

    /// Submits parked IN transfers again (the queue's onResume, on the reader's thread).
    private func resumeReading() {
        let parked = state.update { state -> [Int] in
            guard !state.closing, state.failure == nil else { return [] }
            defer { state.parked = [] }
            state.inFlight += state.parked.count
            return state.parked
        }
        for index in parked { submit(inTransfers[index]) }
    }

    /// libusb_submit_transfer for a transfer already counted in flight.
    private func submit(_ transfer: UnsafeMutablePointer<libusb_transfer>) {
        whileSubmitting {
            let result = libusb_submit_transfer(transfer)
            guard result != 0 else {
                // close() or a failure may have cancelled everything in flight just before this
                // submission: cancel it too, or the event thread would wait for it forever.
                if state.withLock({ $0.closing || $0.failure != nil }) { _ = libusb_cancel_transfer(transfer) }
                return
            }
            state.update { state in
                state.inFlight -= 1
                if let index = outTransfers.firstIndex(of: transfer) { state.freeOut.append(index) }
            }
            end(result == LIBUSB_ERROR_NO_DEVICE.rawValue ? gone : LibUSBDevice.error(result, "libusb_submit_transfer", describing))
        }
    }

    /// Runs libusb calls on transfers from a thread other than the event thread, holding the event
    /// thread (and so close()'s freeing of the transfers and the context) until they are done.
    func whileSubmitting<Result>(_ body: () -> Result) -> Result {
        state.update { $0.submitting += 1 }
        defer {
            let closing = state.update { state -> Bool in
                state.submitting -= 1
                return state.closing
            }
            if closing { libusb_interrupt_event_handler(device.context) }
        }
        return body()
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
        let endpoint = direction == "IN" ? choice.input.addressText : choice.output.addressText
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

    /// Sends `buffer`: returns once every piece is submitted.
    func write(_ buffer: ByteBuffer) async throws {
        _ = try await state.wait { state -> Bool? in
            if let failure = state.failure { throw failure }
            if state.closing { throw TransportError(.misuse, "\(self.describing): the connection is closed") }
            guard !state.writing else { return nil }
            state.writing = true
            return true
        }
        defer { state.update { $0.writing = false } }
        let total = buffer.readableBytes
        var offset = 0
        repeat {
            let length = min(outSize, total - offset)
            let slot = try await state.wait { state -> Int? in
                if let failure = state.failure { throw failure }
                if state.closing { throw TransportError(.misuse, "\(self.describing): the connection is closed") }
                guard !state.failing, let slot = state.freeOut.popLast() else { return nil }
                state.inFlight += 1
                return slot
            }
            let transfer = outTransfers[slot]
            buffer.withUnsafeReadableBytes { bytes in
                if length > 0, let base = bytes.baseAddress {
                    transfer.pointee.buffer.update(from: (base + offset).assumingMemoryBound(to: UInt8.self), count: length)
                }
            }
            transfer.pointee.length = Int32(length)
            let last = offset + length >= total
            transfer.pointee.flags = zlp && last ? UInt8(LIBUSB_TRANSFER_ADD_ZERO_PACKET.rawValue) : 0
            submit(transfer)
            if let failure = state.withLock({ $0.failure }) { throw failure }
            offset += length
        } while offset < total
    }

    /// Waits (with `drain`, up to 2 s) for written data to reach the device, cancels what is left,
    /// stops the event thread once every transfer ended, gives the interface back and closes the
    /// device.
    func close(drain: Bool = true) async {
        guard !closed.exchange(true, ordering: .acquiringAndReleasing) else { return }
        let outs = outTransfers.count
        if drain {
            _ = try? await withThrowingTaskGroup(of: Void.self) { group in
                group.addTask { try await self.state.wait { $0.freeOut.count == outs || $0.failure != nil ? () : nil } }
                group.addTask { try await Task.sleep(for: .seconds(2)) }
                try await group.next()
                group.cancelAll()
            }
        }
        state.update { $0.closing = true }
        cancelAll()
        await worker.withLock { $0 }?.stop()
        // Transfers first: libusb_free_transfer logs through the transfer's handle and context.
        for transfer in inTransfers + outTransfers {
            free(transfer.pointee.buffer)
            libusb_free_transfer(transfer)
        }
        device.close(releasing: choice.interface)
        if state.withLock({ $0.failure }) == nil {
            inbound.finish()
            state.update { $0.failure = TransportError(.misuse, "\(describing): the connection is closed") }
        }
    }
}

/// Lets the InboundQueue's onResume reach the engine made after it.
private final class ResumeHook: Sendable {
    private let action = Mutex<(@Sendable () -> Void)?>(nil)
    func set(_ action: @escaping @Sendable () -> Void) { self.action.withLock { $0 = action } }
    func run() { action.withLock { $0 }?() }
}

/// The ConnectionBackend of a usb:// connection.
final class USBBackend: ConnectionBackend {
    let engine: USBTransferEngine
    let supportsHalfClose = false

    init(engine: USBTransferEngine) { self.engine = engine }

    func read() async throws -> ByteBuffer? { try await engine.inbound.next() }

    func write(_ buffer: ByteBuffer) async throws { try await engine.write(buffer) }

    func closeWrite() async throws {
        throw TransportError(.unsupported, "usb:// has no half-close (a bulk endpoint has no end-of-stream); close the connection instead")
    }

    func close() async throws { await engine.close() }

    func connectionDropped() {
        // Released without waiting for written data (the contract of connectionDropped).
        let engine = engine
        Task { await engine.close(drain: false) }
    }
}
