// UdevMonitor.swift: hot-plug events of one subsystem (tty, usb, bluetooth) from the kernel's uevent
// netlink socket through libudev's monitor (udev_monitor_new_from_netlink(3), netlink(7)).
//
// - Group: "udev" when udevd runs (its events come after rules ran: permissions set, by-id links
//   made), "kernel" otherwise (containers), so events are never silently absent.
// - Nothing missed or doubled: the socket subscribes before the devices are enumerated; an "add"
//   for a device already known and a "remove" for one never seen are dropped.
// - Overflow: the receive buffer is raised (SO_RCVBUFFORCE as root); when the kernel still drops
//   messages, recvmsg fails with ENOBUFS and the monitor re-enumerates and reports the difference
//   instead of going silent.
// - No thread waits: FileDescriptor.wait(until: .readable) (TransportKitLinux) resumes the consumer.
// - No walk of sysfs on the consumer's thread: `deviceEvents` makes the monitor (which lists) on
//   Blocking's pool, a resync runs on a thread of its own.
// - Backpressure: events are pulled; while nobody pulls, the kernel's socket buffer holds them
//   and an overflow is repaired by the resync above. No queue grows without bound.

import CUdev
import Glibc
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// A device record a monitor keeps: whatever a plugin reads for a device, keyed by its sysfs path.
public protocol SysfsRecord: Sendable, Equatable {
    /// The device's sysfs directory: the key events and listings are matched by.
    var sysPath: String { get }
}

/// Hot-plug events of one subsystem, as records the plugin reads itself (the same reader as its
/// listing, so an event and a listing of the same device compare equal).
///
/// ```swift
/// let monitor = try UdevMonitor(subsystem: "tty",
///                               list: { try Sysfs.devices(subsystem: "tty").filter(isPort) },
///                               read: { name, _ in Sysfs.device(subsystem: "tty", name: name).flatMap { isPort($0) ? $0 : nil } })
/// while true {
///     let (action, device) = try await monitor.next()
///     print(action, device.sysPath)
/// }
/// ```
public final class UdevMonitor<Record: SysfsRecord>: Sendable {
    /// What happened to a device.
    public enum Action: String, Sendable {
        /// The device arrived.
        case added
        /// The device went away.
        case removed
        /// The device is still there and says something new about itself.
        case changed
    }

    /// "udev" or "kernel".
    public let group: String
    /// The subsystem whose events this monitor receives.
    public let subsystem: String
    private let fd: FileDescriptor
    private let list: @Sendable () throws -> [Record]
    private let read: @Sendable (_ sysName: String, _ sysPath: String) -> Record?
    private let state: Locked<State>

    private struct State {
        var udev: OpaquePointer
        var monitor: OpaquePointer
        /// Devices reported so far (or present at the start), by sysfs path.
        var known: [String: Record] = [:]
        /// Events found by a resync, not yet handed out.
        var pending: [(Action, Record)] = []
        var resyncs = 0
    }

    /// Subscribes to the subsystem's uevents, then enumerates what is there. That walk blocks:
    /// from a task, make the monitor through `Blocking.run` (as ``deviceEvents(_:record:)`` does).
    /// - Parameters:
    ///   - subsystem: the uevent subsystem to receive (`tty`, `usb`, `bluetooth`).
    ///   - devtype: narrows it (`usb_device` leaves out USB interfaces).
    ///   - receiveBufferSize: the socket's receive buffer; tests make it tiny to force ENOBUFS.
    ///   - list: the records present now (only those to report).
    ///   - read: the record of one device, or nil when it is gone again or not to be reported.
    public init(subsystem: String, devtype: String? = nil, receiveBufferSize: Int32 = 8 << 20,
                list: @escaping @Sendable () throws -> [Record],
                read: @escaping @Sendable (_ sysName: String, _ sysPath: String) -> Record?) throws {
        guard let udev = udev_new() else {
            throw TransportError(.unsupported, "libudev could not start (udev_new failed)", syscall: "udev_new")
        }
        // udevd creates /run/udev/control; without it only the kernel's group carries events.
        let group = access("/run/udev/control", F_OK) == 0 ? "udev" : "kernel"
        guard let monitor = udev_monitor_new_from_netlink(udev, group) else {
            let code = Syscall.errno
            udev_unref(udev)
            throw TransportError(.unsupported, "cannot open the uevent netlink socket (\(group) group): \(code.symbolicDescription); hot-plug events need a kernel with CONFIG_NET and netlink",
                                 errno: code, syscall: "udev_monitor_new_from_netlink")
        }
        udev_monitor_filter_add_match_subsystem_devtype(monitor, subsystem, devtype)
        let enabled = udev_monitor_enable_receiving(monitor)
        guard enabled >= 0 else {
            udev_monitor_unref(monitor)
            udev_unref(udev)
            let code = Errno(rawValue: -enabled)
            throw TransportError(.io, "cannot subscribe to uevents: \(code.symbolicDescription)", errno: code, syscall: "udev_monitor_enable_receiving")
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
        self.subsystem = subsystem
        self.fd = FileDescriptor(rawValue: fd)
        self.list = list
        self.read = read
        self.state = Locked(State(udev: udev, monitor: monitor))
        // Enumerate only now that the socket listens: a device arriving in between shows up in
        // both, and the "add" is then dropped as a duplicate.
        let present = try list()
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
    public var resyncCount: Int { state.withLock { $0.resyncs } }

    /// The devices known now (present at start plus arrivals minus removals).
    public var knownDevices: [Record] { state.withLock { Array($0.known.values) } }

    /// The next event; waits without holding a thread. Throws `CancellationError` when cancelled.
    /// After an overflow (ENOBUFS) the re-enumeration runs on a thread started for it, and is
    /// finished even when the caller is cancelled meanwhile. One consumer at a time: a resync
    /// lists with the lock released, and a concurrent `next()` could report an event that the
    /// resync's result then overwrites.
    public func next() async throws -> (Action, Record) {
        while true {
            try Task.checkCancellation()
            switch try receive() {
            case .event(let action, let device):
                return (action, device)
            case .again:
                try await fd.wait(until: .readable)
            case .overflow:
                // The walk of sysfs on a thread of its own (rare: after the kernel dropped
                // uevents), not on the consumer's and not in a pool's queue behind other work.
                try await Blocking.runOnThread("tk uevent resync") { try self.resync() }
            }
        }
    }

    private enum Received {
        case event(Action, Record)
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
                Glibc.errno = 0
                guard let device = udev_monitor_receive_device(state.monitor) else {
                    let code = Syscall.errno
                    switch code {
                    case .noBufferSpace: return .overflow
                    case .resourceTemporarilyUnavailable, .interrupted, Errno(rawValue: 0): return .again
                    default:
                        throw TransportError(.io, "receiving uevents failed: \(code.symbolicDescription)", errno: code, syscall: "udev_monitor_receive_device")
                    }
                }
                let action = udev_device_get_action(device).map { String(cString: $0) } ?? ""
                let sysPath = udev_device_get_syspath(device).map { String(cString: $0) } ?? ""
                let sysName = udev_device_get_sysname(device).map { String(cString: $0) } ?? ""
                udev_device_unref(device)
                if let event = admit(action: action, sysPath: sysPath, sysName: sysName, known: &state.known) {
                    return .event(event.0, event.1)
                }
            }
        }
    }

    /// Applies one uevent to the known set; returns the event to report, or nil for a duplicate,
    /// an action that does not change the device list (unbind, move), or a device the plugin does
    /// not report. "bind" counts as an arrival: a USB device's "add" comes before the kernel has
    /// configured it and made its interfaces, so its reader refuses it until the "bind" that
    /// follows (drivers/base/dd.c sends one once a driver bound).
    private func admit(action: String, sysPath: String, sysName: String, known: inout [String: Record]) -> (Action, Record)? {
        switch action {
        case "add", "change", "bind":
            // Gone again already: its "remove" follows and finds nothing to remove.
            guard let info = read(sysName, sysPath) else { return nil }
            let previous = known.updateValue(info, forKey: info.sysPath)
            // A "change" for a device not known yet (between its "add" and its "bind") is its arrival.
            if action == "change" { return (previous == nil ? .added : .changed, info) }
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

    /// After ENOBUFS: drain the socket, enumerate again, and queue the difference as events.
    public func resync() throws {
        // Drain first: what is in the socket predates the enumeration below. An event that arrives
        // after the drain is both listed and received, and then dropped as a duplicate; draining
        // after listing would throw away an arrival that came in between.
        state.withLock { state in
            while let stale = udev_monitor_receive_device(state.monitor) { udev_device_unref(stale) }
        }
        let present = try list()
        state.withLock { state in
            state.resyncs += 1
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
}

extension UdevMonitor {
    /// What a plugin's `?wait=true` waits for: the first event other than a removal for which
    /// `match` gives a result, until `limit` (nil: no limit; see `ConnectRequest.searchLimit(from:)`).
    /// `timeout` is the connect's own (`ConnectRequest.timeout`), for the message.
    ///
    /// - Throws: `.timedOut` naming `what` when `limit` passes first; what `match` throws (an
    ///   ambiguous match, say).
    ///
    /// ```swift
    /// let found = try await monitor.arrival(of: "no USB device matching \(selector)", until: request.searchLimit(from: .now),
    ///                                       timeout: request.timeout) { device in
    ///     selector.matches(device) ? device : nil
    /// }
    /// ```
    public func arrival<Result: Sendable>(of what: String, until limit: ContinuousClock.Instant?, timeout: Duration? = nil,
                                          _ match: @escaping @Sendable (Record) throws -> Result?) async throws -> Result {
        let started = ContinuousClock.now
        let found = try await ConnectRequest.first(of: [{ @Sendable in
            while true {
                let (action, device) = try await self.next()
                if action != .removed, let result = try match(device) { return result }
            }
        }], until: limit)
        guard let found else { throw Self.notPluggedIn(what, since: started, timeout: timeout) }
        return found
    }

    /// The timeout of a `?wait=true` that saw nothing arrive: "`what` was plugged in within the
    /// 3 s timeout: …", or "within 2.4 s" (the time waited) when `timeout` is not known. The wait
    /// itself ends a little before the timeout, leaving the rest for opening what arrives.
    public static func notPluggedIn(_ what: String, since started: ContinuousClock.Instant, timeout: Duration? = nil) -> TransportError {
        TransportError(.timedOut, "\(what) was plugged in within \(ConnectRequest.searchTime(timeout: timeout, orElse: .now - started)): "
                       + "check the cable and `transportkit list`, or wait longer with ?timeout=SECONDS")
    }
}

extension UdevMonitor {
    /// A plugin's `deviceEvents`: the events of the monitor `make` subscribes, each device turned
    /// into the registry's record by `record`. `make` (which subscribes and lists the subsystem's
    /// devices) runs on `Blocking`'s pool, and this returns once it has: an event after the call is
    /// not missed, and a device removed right after it is reported with its listed record. A
    /// monitor that cannot be made ends the stream with its error (a caller cancelled while `make`
    /// still waited for the pool: `CancellationError`).
    ///
    /// ```swift
    /// public func deviceEvents(includeAll: Bool) async -> AsyncThrowingStream<DeviceEvent, any Error>? {
    ///     await UdevMonitor.deviceEvents({ try USBDiscovery.monitor(includeAll: includeAll) }, record: USBDiscovery.record)
    /// }
    /// ```
    public static func deviceEvents(_ make: @escaping @Sendable () throws -> UdevMonitor<Record>,
                                    record: @escaping @Sendable (Record) -> DeviceRecord) async -> AsyncThrowingStream<DeviceEvent, any Error> {
        let monitor: UdevMonitor<Record>
        do {
            monitor = try await Blocking.run(make)
        } catch {
            return AsyncThrowingStream { $0.finish(throwing: error) }
        }
        return AsyncThrowingStream {
            let (action, device) = try await monitor.next()
            let kind: DeviceEvent.Action = switch action {
            case .added: .added
            case .removed: .removed
            case .changed: .changed
            }
            return DeviceEvent(kind, record(device))
        }
    }
}
