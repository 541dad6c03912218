// UdevMonitor.swift: hot-plug events from the kernel's uevent netlink socket through libudev's
// monitor (udev_monitor_new_from_netlink(3), netlink(7)).
//
// - Group: "udev" when udevd runs (its events come after rules ran: permissions set, by-id links
//   made), "kernel" otherwise (containers), so events are never silently absent.
// - Nothing missed or doubled: the socket subscribes before the devices are enumerated; an "add"
//   for a device already known and a "remove" for one never seen are dropped.
// - Overflow: the receive buffer is raised (SO_RCVBUFFORCE as root); when the kernel still drops
//   messages, recvmsg fails with ENOBUFS and the monitor re-enumerates and reports the difference
//   instead of going silent.
// - No thread waits: a one-shot Dispatch read source per wait resumes the consumer.
// - Backpressure: events are pulled; while nobody pulls, the kernel's socket buffer holds them
//   and an overflow is repaired by the resync above. No queue grows without bound.

import CUdev
@preconcurrency import Dispatch  // DispatchSourceRead is not marked Sendable; it is thread-safe (libdispatch)
import Glibc
import Synchronization
import TransportKitCore

final class UdevMonitor: Sendable {
    enum Action: String, Sendable { case added, removed, changed }

    /// "udev" or "kernel".
    let group: String
    let fd: Int32
    private let include: @Sendable (TTYDeviceInfo) -> Bool
    private let state: Mutex<State>
    private static let queue = DispatchQueue(label: "TransportKit.UdevMonitor")

    private struct State {
        var udev: OpaquePointer
        var monitor: OpaquePointer
        /// Devices reported so far (or present at the start), by sysfs path.
        var known: [String: TTYDeviceInfo] = [:]
        /// Events found by a resync, not yet handed out.
        var pending: [(Action, TTYDeviceInfo)] = []
        var resyncs = 0
    }

    /// Subscribes to tty uevents, then enumerates what is there.
    /// - Parameters:
    ///   - include: which devices to report (the "real ports only" filter of a listing).
    ///   - receiveBufferSize: the socket's receive buffer; tests make it tiny to force ENOBUFS.
    init(include: @escaping @Sendable (TTYDeviceInfo) -> Bool, receiveBufferSize: Int32 = 8 << 20) throws {
        guard let udev = udev_new() else {
            throw TransportError(.unsupported, "libudev could not start (udev_new failed)", syscall: "udev_new")
        }
        // udevd creates /run/udev/control; without it only the kernel's group carries events.
        let group = access("/run/udev/control", F_OK) == 0 ? "udev" : "kernel"
        guard let monitor = udev_monitor_new_from_netlink(udev, group) else {
            let code = errno
            udev_unref(udev)
            throw TransportError(.unsupported, "cannot open the uevent netlink socket (\(group) group): \(ErrnoName.describe(code)); hot-plug events need a kernel with CONFIG_NET and netlink",
                                 errno: code, syscall: "udev_monitor_new_from_netlink")
        }
        udev_monitor_filter_add_match_subsystem_devtype(monitor, "tty", nil)
        let enabled = udev_monitor_enable_receiving(monitor)
        guard enabled >= 0 else {
            udev_monitor_unref(monitor)
            udev_unref(udev)
            throw TransportError(.io, "cannot subscribe to uevents: \(ErrnoName.describe(-enabled))", errno: -enabled, syscall: "udev_monitor_enable_receiving")
        }
        let fd = udev_monitor_get_fd(monitor)
        if receiveBufferSize >= 8 << 20 {
            // Tries SO_RCVBUFFORCE (root) and falls back to SO_RCVBUF (capped by rmem_max).
            _ = udev_monitor_set_receive_buffer_size(monitor, receiveBufferSize)
        } else {
            var size = receiveBufferSize
            _ = setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        }
        self.group = group
        self.fd = fd
        self.include = include
        self.state = Mutex(State(udev: udev, monitor: monitor))
        // Enumerate only now that the socket listens: a device arriving in between shows up in
        // both, and the "add" is then dropped as a duplicate.
        let present = try Sysfs.ttyDevices().filter(include)
        state.withLock { state in
            for device in present { state.known[device.sysPath] = device }
        }
    }

    deinit {
        state.withLock { state in
            udev_monitor_unref(state.monitor)
            udev_unref(state.udev)
        }
    }

    /// How many times an overflow (ENOBUFS) forced a re-enumeration.
    var resyncCount: Int { state.withLock { $0.resyncs } }

    /// The devices known now (present at start plus arrivals minus removals).
    var knownDevices: [TTYDeviceInfo] { state.withLock { Array($0.known.values) } }

    /// The next event; waits without holding a thread. Throws `CancellationError` when cancelled.
    func next() async throws -> (Action, TTYDeviceInfo) {
        while true {
            try Task.checkCancellation()
            switch try receive() {
            case .event(let action, let device):
                return (action, device)
            case .again:
                try await waitReadable()
            case .overflow:
                try resync()
            }
        }
    }

    private enum Received {
        case event(Action, TTYDeviceInfo)
        case again
        case overflow
    }

    private func receive() throws -> Received {
        try state.withLock { state in
            if !state.pending.isEmpty {
                let (action, device) = state.pending.removeFirst()
                return .event(action, device)
            }
            while true {
                errno = 0
                guard let device = udev_monitor_receive_device(state.monitor) else {
                    let code = errno
                    switch code {
                    case ENOBUFS: return .overflow
                    case EAGAIN, EINTR, 0: return .again
                    default:
                        throw TransportError(.io, "receiving uevents failed: \(ErrnoName.describe(code))", errno: code, syscall: "udev_monitor_receive_device")
                    }
                }
                let action = udev_device_get_action(device).map { String(cString: $0) } ?? ""
                let sysPath = udev_device_get_syspath(device).map { String(cString: $0) } ?? ""
                let sysName = udev_device_get_sysname(device).map { String(cString: $0) } ?? ""
                udev_device_unref(device)
                if let event = Self.admit(action: action, sysPath: sysPath, sysName: sysName, known: &state.known, include: include) {
                    return .event(event.0, event.1)
                }
            }
        }
    }

    /// Applies one uevent to the known set; returns the event to report, or nil for a duplicate,
    /// an action that does not change the device list (bind, unbind, move), or a filtered device.
    /// Records are read from sysfs as the listing reads them (Sysfs.swift), so an event and a
    /// listing of the same device compare equal.
    private static func admit(action: String, sysPath: String, sysName: String, known: inout [String: TTYDeviceInfo],
                              include: (TTYDeviceInfo) -> Bool) -> (Action, TTYDeviceInfo)? {
        switch action {
        case "add", "change":
            // Gone again already: its "remove" follows and finds nothing to remove.
            guard let info = Sysfs.device(named: sysName), include(info) else { return nil }
            let previous = known.updateValue(info, forKey: info.sysPath)
            if action == "change" { return (.changed, info) }
            // Listed already (it arrived while we enumerated): a duplicate, unless the listing
            // caught it half-made (sysfs attributes appear one by one) and now it says more.
            guard let previous else { return (.added, info) }
            return previous == info ? nil : (.changed, info)
        case "remove":
            // The cached record: the device is gone from sysfs, so only what was known survives.
            guard let previous = known.removeValue(forKey: sysPath) else { return nil }
            return (.removed, previous)
        default:
            return nil
        }
    }

    /// After ENOBUFS: enumerate again and queue the difference as events.
    func resync() throws {
        let present = try Sysfs.ttyDevices().filter(include)
        state.withLock { state in
            state.resyncs += 1
            // Drain what is left in the socket: it predates the enumeration just made.
            while let stale = udev_monitor_receive_device(state.monitor) { udev_device_unref(stale) }
            let now = Dictionary(present.map { ($0.sysPath, $0) }, uniquingKeysWith: { first, _ in first })
            for (path, device) in state.known where now[path] == nil {
                state.pending.append((.removed, device))
            }
            for (path, device) in now {
                if let before = state.known[path] {
                    if before != device { state.pending.append((.changed, device)) }
                } else {
                    state.pending.append((.added, device))
                }
            }
            state.known = now
        }
    }

    /// Suspends until the socket is readable.
    private func waitReadable() async throws {
        let source = DispatchSource.makeReadSource(fileDescriptor: fd, queue: Self.queue)
        let waiter = Mutex<(continuation: CheckedContinuation<Void, any Error>?, cancelled: Bool)>((nil, false))
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                let cancelled = waiter.withLock { waiter in
                    if waiter.cancelled { return true }
                    waiter.continuation = continuation
                    return false
                }
                if cancelled {
                    source.cancel()
                    source.resume()  // a source must not be released while suspended
                    continuation.resume(throwing: CancellationError())
                    return
                }
                source.setEventHandler {
                    source.cancel()
                    waiter.withLock { waiter in
                        defer { waiter.continuation = nil }
                        return waiter.continuation
                    }?.resume()
                }
                source.resume()
            }
        } onCancel: {
            source.cancel()
            waiter.withLock { waiter in
                waiter.cancelled = true
                defer { waiter.continuation = nil }
                return waiter.continuation
            }?.resume(throwing: CancellationError())
        }
    }
}
