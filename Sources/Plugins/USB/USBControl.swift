// USBControl.swift: control transfers on an open usb:// connection (the device's endpoint 0):
// standard, class and vendor requests, in and out, each with a timeout. Asynchronous libusb
// control transfers (libusb_fill_control_setup, libusb_fill_control_transfer) completed on the
// connection's own event thread; USB 2.0 §9.3 describes the setup packet.

import CLibUSB
import Glibc
import Synchronization
@_spi(Plugins) import TransportKitCore

/// Control requests to the device behind a `usb://` connection (also through wrappers such as
/// `spy+usb://`, which trace them). A device with no bulk or interrupt pair is opened for these
/// alone with `usb://VID:PID?controlOnly=true`.
///
/// ```swift
/// let connection = try await Transport.connect(to: "usb://1d50:6089?serial=0000000000000000a06063c8234e925f")
/// guard let usb = connection.usbDevice else { return }
/// let descriptor = try await usb.controlIn(requestType: 0x80, request: 6, value: 0x0100, index: 0, length: 18)   // GET_DESCRIPTOR(DEVICE)
/// try await usb.controlOut(requestType: 0x40, request: 0x01, value: 1, index: 0)   // a vendor request, no data
/// ```
public struct USBDeviceControl: Sendable {
    let engine: USBTransferEngine
    let connection: Connection

    /// bmRequestType's direction bit: set for device-to-host (IN).
    public static let directionIn: UInt8 = 0x80

    /// A request that reads: `requestType` must have bit 7 set (0x80 standard, 0xc0 vendor, 0xa0 class
    /// to the device; the low bits name the recipient). Returns what the device sent, up to `length`.
    public func controlIn(requestType: UInt8, request: UInt8, value: UInt16, index: UInt16, length: Int,
                          timeout: Duration = .seconds(5)) async throws -> [UInt8] {
        guard requestType & Self.directionIn != 0 else {
            throw TransportError(.misuse, "controlIn needs a device-to-host request type (bit 7 set, such as 0xc0), not 0x\(String(requestType, radix: 16))")
        }
        guard (0...0xffff).contains(length) else { throw TransportError(.misuse, "a control transfer carries at most 65535 bytes, not \(length)") }
        return try await connection.performControl(ControlOperation("control IN", describe(requestType, request, value, index, length)),
                                                   describe: { "\($0.count) bytes" }) {
            try await engine.control(requestType: requestType, request: request, value: value, index: index, data: [], length: length,
                                     timeout: timeout)
        }
    }

    /// A request that writes `data` (possibly none): `requestType` must have bit 7 clear (0x40 vendor,
    /// 0x21 class to an interface, …).
    public func controlOut(requestType: UInt8, request: UInt8, value: UInt16, index: UInt16, data: [UInt8] = [],
                           timeout: Duration = .seconds(5)) async throws {
        guard requestType & Self.directionIn == 0 else {
            throw TransportError(.misuse, "controlOut needs a host-to-device request type (bit 7 clear, such as 0x40), not 0x\(String(requestType, radix: 16))")
        }
        guard data.count <= 0xffff else { throw TransportError(.misuse, "a control transfer carries at most 65535 bytes, not \(data.count)") }
        _ = try await connection.performControl(ControlOperation("control OUT", describe(requestType, request, value, index, data.count))) {
            try await engine.control(requestType: requestType, request: request, value: value, index: index, data: data, length: data.count,
                                     timeout: timeout)
        }
    }

    private func describe(_ requestType: UInt8, _ request: UInt8, _ value: UInt16, _ index: UInt16, _ length: Int) -> String {
        func hex(_ value: some BinaryInteger, _ digits: Int) -> String { "0x" + Hex.digits(value, width: digits) }
        return "type \(hex(requestType, 2)) request \(hex(request, 2)) value \(hex(value, 4)) index \(hex(index, 4)) length \(length)"
    }
}

extension Connection {
    /// Control requests to a `usb://` connection's device; `nil` for other transports.
    public var usbDevice: USBDeviceControl? {
        backend(as: USBBackend.self).map { USBDeviceControl(engine: $0.engine, connection: self) }
    }
}

/// One control transfer in flight: its transfer, the engine it counts in, and the waiting task.
final class USBControlRequest: @unchecked Sendable {
    // @unchecked: `transfer` is owned by libusb from submission until the callback, which runs once
    // on the event thread and hands the result over through `waiting` (a Locked); the waiting task
    // frees the transfer only after that.
    let transfer: UnsafeMutablePointer<libusb_transfer>
    let engine: USBTransferEngine
    let waiting = Locked<CheckedContinuation<(libusb_transfer_status, [UInt8]), Never>?>(nil)

    init(transfer: UnsafeMutablePointer<libusb_transfer>, engine: USBTransferEngine) {
        self.transfer = transfer
        self.engine = engine
    }
}

/// The callback of control transfers: user_data is the request, retained until this runs.
private func usbControlCompleted(_ transfer: UnsafeMutablePointer<libusb_transfer>?) {
    guard let transfer, let opaque = transfer.pointee.user_data else { return }
    let request = Unmanaged<USBControlRequest>.fromOpaque(opaque).takeRetainedValue()
    let status = transfer.pointee.status
    let length = Int(transfer.pointee.actual_length)
    var data: [UInt8] = []
    if length > 0, let buffer = transfer.pointee.buffer {
        data = Array(UnsafeBufferPointer(start: buffer + MemoryLayout<libusb_control_setup>.size, count: length))
    }
    request.engine.endControl(request)
    request.waiting.withLock { $0.take() }?.resume(returning: (status, data))
}

extension USBTransferEngine {
    /// One control transfer on endpoint 0, run by the connection's event thread. It counts as in
    /// flight, so close() cancels it and waits for it.
    func control(requestType: UInt8, request: UInt8, value: UInt16, index: UInt16, data: [UInt8], length: Int,
                 timeout: Duration) async throws -> [UInt8] {
        let setup = MemoryLayout<libusb_control_setup>.size
        guard let transfer = libusb_alloc_transfer(0) else {
            throw TransportError(.io, "\(describing): out of memory for a control transfer", errno: .noMemory, syscall: "libusb_alloc_transfer")
        }
        guard let buffer = malloc(setup + length)?.assumingMemoryBound(to: UInt8.self) else {
            libusb_free_transfer(transfer)
            throw TransportError(.io, "\(describing): out of memory for a control transfer of \(length) bytes", errno: .noMemory, syscall: "malloc")
        }
        defer {
            free(buffer)
            libusb_free_transfer(transfer)
        }
        libusb_fill_control_setup(buffer, requestType, request, value, index, UInt16(length))
        if !data.isEmpty { (buffer + setup).update(from: data, count: data.count) }
        let milliseconds = UInt32(clamping: max(1, timeout.wholeMilliseconds))
        let box = USBControlRequest(transfer: transfer, engine: self)
        try beginControl(box)
        let retained = Unmanaged.passRetained(box)
        libusb_fill_control_transfer(transfer, device.handle, buffer, usbControlCompleted, retained.toOpaque(), milliseconds)
        var refused: Int32 = 0
        let (status, received): (libusb_transfer_status, [UInt8]) = await withCheckedContinuation { continuation in
            box.waiting.withLock { $0 = continuation }
            refused = whileSubmitting {
                let result = libusb_submit_transfer(transfer)
                if result == 0 { afterControlSubmitted(box) }
                return result
            }
            if refused != 0 {
                // It never reached libusb, so its callback will not run.
                retained.release()
                endControl(box)
                box.waiting.withLock { $0.take() }?.resume(returning: (LIBUSB_TRANSFER_ERROR, []))
            }
        }
        if refused != 0 {
            throw refused == LIBUSB_ERROR_NO_DEVICE.rawValue ? gone : LibUSBDevice.error(refused, "libusb_submit_transfer", describing)
        }
        let name = "control request 0x\(String(request, radix: 16))"
        switch status {
        case LIBUSB_TRANSFER_COMPLETED:
            return received
        case LIBUSB_TRANSFER_STALL:
            throw TransportError(.io, "\(describing): the device refused \(name) (it stalled endpoint 0: a request it does not support, or wrong "
                                 + "arguments)", errno: .brokenPipe, syscall: "libusb_submit_transfer")
        case LIBUSB_TRANSFER_TIMED_OUT:
            throw TransportError(.timedOut, "\(describing): \(name) got no answer within \(timeout)", errno: .timedOut, syscall: "libusb_submit_transfer")
        case LIBUSB_TRANSFER_NO_DEVICE:
            throw gone
        case LIBUSB_TRANSFER_CANCELLED:
            throw TransportError(.misuse, "\(describing): \(name) was cancelled: the connection closed")
        default:
            throw TransportError(.io, "\(describing): \(name) failed (libusb transfer status \(status.rawValue))", errno: .ioError,
                                 syscall: "libusb_submit_transfer")
        }
    }
}
