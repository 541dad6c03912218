// DBusConnection.swift: a D-Bus client over sd-bus (sd-bus(3), sd_bus_call_async(3),
// sd_bus_add_match_async(3), sd_bus_add_object(3), sd_bus_get_events(3)), for plugins that talk to
// system services such as bluetoothd.
//
// sd-bus objects must never be used from two threads at once, so each connection lives on a thread
// of its own (a WorkerThread): every sd-bus call happens there. Callers queue jobs and wake the
// thread through a pipe; the thread runs the jobs, lets sd-bus process until it has nothing left,
// and waits in poll(2) on the bus descriptor, the wake pipe and sd-bus's next timeout.

import CSDBus
import Glibc
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// A connection to a D-Bus bus: method calls, signal subscriptions and exported objects.
///
/// ```swift
/// let bus = try DBusConnection(.system)
/// let objects = try await bus.call(destination: "org.bluez", path: "/",
///                                  interface: "org.freedesktop.DBus.ObjectManager", member: "GetManagedObjects")
/// await bus.close()
/// ```
public final class DBusConnection: Sendable {
    /// Which bus to connect to.
    public enum Bus: Sendable, CustomStringConvertible {
        /// The system bus (bluetoothd's): `DBUS_SYSTEM_BUS_ADDRESS`, else /run/dbus/system_bus_socket.
        case system
        /// A bus by its address (`unix:path=/tmp/dbus-…`), as `dbus-daemon --print-address` prints it.
        case address(String)

        /// The bus and its address, for messages (`the D-Bus bus at unix:path=/tmp/dbus-…`).
        public var description: String {
            switch self {
            case .system: "the system bus (\(getenv("DBUS_SYSTEM_BUS_ADDRESS").map { String(cString: $0) } ?? "/run/dbus/system_bus_socket"))"
            case .address(let address): "the D-Bus bus at \(address)"
            }
        }
    }

    private let loop: BusLoop
    private let thread: WorkerThread
    /// The bus, for messages.
    public let bus: Bus
    /// Calls an in-order export (`export(path:subtree:inOrder:answering:)`) keeps waiting for their
    /// turn; more are refused with `org.freedesktop.DBus.Error.LimitsExceeded`.
    public static let inOrderCallLimit = 256

    /// Connects and authenticates; calls wait until the bus has answered the connection's Hello.
    ///
    /// - Throws: `TransportError` `.notFound` when no bus listens there (dbus-daemon not running),
    ///   `.permissionDenied` when this user may not connect.
    public init(_ bus: Bus = .system) throws {
        self.bus = bus
        let pointer = try Self.open(bus)
        let loop: BusLoop
        do {
            loop = try BusLoop(bus: pointer, describing: bus.description)
        } catch {
            sd_bus_flush_close_unref(pointer)
            throw error
        }
        self.loop = loop
        thread = try WorkerThread(name: "d-bus") { isStopping in
            loop.run(isStopping: isStopping)
        } interrupt: {
            loop.wake()
        }
    }

    /// `false` once the connection was closed or lost (dbus-daemon stopped): open a new one then.
    public var isConnected: Bool { !loop.hasEnded }

    /// Stops the bus thread and closes the connection: calls still waiting fail with `.closed`,
    /// signal streams end, exported objects go away.
    public func close() async {
        await thread.stop()
    }

    deinit {
        // Not closed: stop the thread anyway (it would keep the bus alive forever).
        loop.requestStop()
    }

    private static func open(_ bus: Bus) throws -> OpaquePointer {
        var pointer: OpaquePointer?
        var result: Int32
        switch bus {
        case .address(let address):
            result = sd_bus_new(&pointer)
            if result >= 0, let pointer {
                result = sd_bus_set_address(pointer, address)
                if result >= 0 { result = sd_bus_set_bus_client(pointer, 1) }   // or no Hello is sent
                if result >= 0 { result = sd_bus_start(pointer) }
                if result < 0 { sd_bus_unref(pointer) }
            }
        case .system:
            result = sd_bus_open_system(&pointer)
        }
        guard result >= 0, let pointer else {
            let errno = Errno(rawValue: -result)
            if errno == .permissionDenied {
                throw TransportError(.permissionDenied, "this user may not connect to \(bus): the socket's permissions or the D-Bus policy refuse it",
                                     errno: errno, syscall: "sd_bus_start")
            }
            throw TransportError(.notFound, "cannot connect to \(bus): is dbus-daemon running? (`systemctl start dbus`)",
                                 errno: errno, syscall: "sd_bus_start")
        }
        return pointer
    }

    /// Calls a method and returns the reply's values. Descriptors in the reply (`h`) are the
    /// caller's to close.
    ///
    /// - Parameters:
    ///   - destination: the service's bus name (`org.bluez`) or a unique name (`:1.42`).
    ///   - path: the object (`/org/bluez/hci0`).
    ///   - interface: the method's interface (`org.bluez.Adapter1`).
    ///   - member: the method (`StartDiscovery`).
    ///   - arguments: the arguments, with their exact types.
    ///   - timeout: how long to wait for the reply; `nil` is sd-bus's default (25 s).
    /// - Throws: `TransportError` with the D-Bus error's name and message: `.notFound` when the
    ///   destination is not running, `.permissionDenied` when the policy refuses, `.timedOut` when no
    ///   reply came; `CancellationError` when the task is cancelled (the reply is then dropped).
    ///
    /// ```swift
    /// let owner = try await bus.call(destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus",
    ///                                interface: "org.freedesktop.DBus", member: "GetNameOwner", [.string("org.bluez")])
    /// ```
    public func call(destination: String, path: String, interface: String, member: String,
                     _ arguments: [DBusValue] = [], timeout: Duration? = nil) async throws -> [DBusValue] {
        let pending = PendingCall(describing: "\(destination) \(path) \(interface).\(member)")
        let micros = timeout.map { UInt64(max($0.components.seconds, 0)) * 1_000_000 + UInt64(max($0.components.attoseconds, 0) / 1_000_000_000_000) } ?? 0
        let loop = self.loop
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
                guard pending.wait(continuation) else { return }
                loop.submit { state in
                    pending.start(on: state, destination: destination, path: path, interface: interface, member: member,
                                  arguments: arguments, timeoutMicros: micros)
                } orElse: { error in
                    pending.finish(.failure(error))
                }
            }
        } onCancel: {
            pending.finish(.failure(CancellationError()))
            loop.submit { state in state.remove(pending) } orElse: { _ in }
        }
        return try pending.takeResult()
    }

    /// Subscribes to signals that match `rule`; returns once the bus has installed the match, so
    /// every matching signal sent after this returns is delivered. The stream ends with an error
    /// when the connection ends, or when more signals wait unread than `buffering` allows;
    /// ending its iteration removes the match.
    ///
    /// ```swift
    /// let added = try await bus.signals(DBusMatch(sender: "org.bluez", interface: "org.freedesktop.DBus.ObjectManager"),
    ///                                   buffering: .all(limit: 1024))
    /// for try await signal in added { print(signal.member, signal.values) }
    /// ```
    public func signals(_ rule: DBusMatch, buffering: DBusSignalBuffering) async throws -> AsyncThrowingStream<DBusSignal, any Error> {
        try await signals(matchingAnyOf: [rule], buffering: buffering)
    }

    /// Subscribes to signals that match any of `rules`, in one stream in the order the bus sent
    /// them (a device's PropertiesChanged and the InterfacesAdded of its services, for one). A
    /// signal that matches several rules comes once. Otherwise as ``signals(_:buffering:)``.
    ///
    /// ```swift
    /// let events = try await bus.signals(matchingAnyOf: [
    ///     DBusMatch(sender: "org.bluez", interface: "org.freedesktop.DBus.ObjectManager"),
    ///     DBusMatch(sender: "org.bluez", path: device, interface: "org.freedesktop.DBus.Properties"),
    /// ], buffering: .all(limit: 1024))
    /// ```
    public func signals(matchingAnyOf rules: [DBusMatch], buffering: DBusSignalBuffering) async throws -> AsyncThrowingStream<DBusSignal, any Error> {
        guard !rules.isEmpty else { throw TransportError(.misuse, "a D-Bus subscription needs at least one match rule") }
        let (stream, continuation) = AsyncThrowingStream<DBusSignal, any Error>.makeStream(bufferingPolicy: buffering.policy)
        let subscription = Subscription(rules: rules.map(\.description), buffering: buffering, continuation: continuation)
        let loop = self.loop
        continuation.onTermination = { _ in
            loop.submit { state in state.remove(subscription) } orElse: { _ in }
        }
        try await withCheckedThrowingContinuation { (installed: CheckedContinuation<Void, any Error>) in
            subscription.awaitInstall(installed)
            loop.submit { state in subscription.install(on: state) } orElse: { error in
                subscription.installFinished(.failure(error))
            }
        }
        return stream
    }

    /// Serves method calls on `path` (and, with `subtree`, every path below it) with `handler`,
    /// which runs on the bus thread and must not block. Keep the returned object; ``DBusExport/remove()``
    /// takes the object off the bus.
    ///
    /// ```swift
    /// let profile = try await bus.export(path: "/org/transportkit/spp") { call in
    ///     guard call.member == "NewConnection", case .unixFD(let fd)? = call.arguments.dropFirst().first else { return .notHandled }
    ///     accepted.yield(fd)
    ///     return .reply([])
    /// }
    /// ```
    public func export(path: String, subtree: Bool = false,
                       _ handler: @escaping @Sendable (DBusMethodCall) -> DBusMethodResult) async throws -> DBusExport {
        try await export(ExportedObject(path: path, subtree: subtree, handler: .immediate(handler), loop: loop))
    }

    /// Serves method calls on `path` (and, with `subtree`, every path below it) with an
    /// asynchronous `handler`: each call runs in a task of its own, and its result is sent as the
    /// reply when it returns, so a handler may wait (for the application, for a device) without
    /// holding up the bus. Calls not handled get `org.freedesktop.DBus.Error.UnknownMethod`. The
    /// caller's own timeout (25 s for most) still bounds how long it waits.
    ///
    /// ```swift
    /// let characteristic = try await bus.export(path: "/org/transportkit/app/service0/char0") { call in
    ///     guard call.member == "ReadValue" else { return .notHandled }
    ///     return .reply([.bytes(await sensor.currentValue())])
    /// }
    /// ```
    ///
    /// With `inOrder`, the calls are answered one at a time in the order they came, each handler
    /// returning before the next starts (as a GATT server's writes must be, and as ATT itself
    /// serves one request at a time); without it each call runs in a task of its own. At most
    /// ``inOrderCallLimit`` calls wait for their turn; one more is answered at once with
    /// `org.freedesktop.DBus.Error.LimitsExceeded`. Without `inOrder` the calls in progress are as
    /// many as callers wait for answers, which the bus bounds per peer (dbus-daemon's
    /// max_replies_per_connection).
    public func export(path: String, subtree: Bool = false, inOrder: Bool = false,
                       answering handler: @escaping @Sendable (DBusMethodCall) async -> DBusMethodResult) async throws -> DBusExport {
        let object: ExportedObject
        if inOrder {
            let (calls, queue) = AsyncStream<@Sendable () async -> Void>.makeStream(bufferingPolicy: .bufferingOldest(Self.inOrderCallLimit))
            // One task answers them all; it ends once the object is removed and the queue is empty.
            Task { for await call in calls { await call() } }
            object = ExportedObject(path: path, subtree: subtree, handler: .later(handler, queue: queue), loop: loop, onRemoval: { queue.finish() })
        } else {
            object = ExportedObject(path: path, subtree: subtree, handler: .later(handler, queue: nil), loop: loop)
        }
        return try await export(object)
    }

    private func export(_ object: ExportedObject) async throws -> DBusExport {
        let path = object.path
        let loop = self.loop
        do {
            try await perform { state in try object.register(on: state) }
        } catch {
            object.onRemoval()
            throw error
        }
        return DBusExport(path: path) {
            await withCheckedContinuation { (done: CheckedContinuation<Void, Never>) in
                loop.submit { state in
                    state.remove(object)
                    object.onRemoval()
                    done.resume()
                } orElse: { _ in
                    object.onRemoval()
                    done.resume()
                }
            }
        }
    }

    /// Sends a signal from `path` (PropertiesChanged, InterfacesAdded, …).
    public func emitSignal(path: String, interface: String, member: String, _ values: [DBusValue] = []) async throws {
        try await perform { state in
            var message: OpaquePointer?
            let what = "the signal \(interface).\(member) from \(path)"
            try SDBus.check(sd_bus_message_new_signal(state.bus, &message, path, interface, member), "sd_bus_message_new_signal", what)
            guard let message else { throw TransportError(.io, "\(what): sd-bus made no message") }
            defer { sd_bus_message_unref(message) }
            try DBusWriter(message: message, what: what).append(values)
            try SDBus.check(sd_bus_send(state.bus, message, nil), "sd_bus_send", what)
        }
    }

    /// This connection's unique name on the bus (`:1.42`): the destination for calls to the
    /// objects it exports.
    public func uniqueName() async throws -> String {
        // Until the Hello reply has arrived the name is not known: ask the bus's own GetId-free way,
        // a round trip, which orders this after Hello.
        _ = try await call(destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus",
                           interface: "org.freedesktop.DBus", member: "GetId")
        return try await perform { state in
            var name: UnsafePointer<CChar>?
            try SDBus.check(sd_bus_get_unique_name(state.bus, &name), "sd_bus_get_unique_name", "\(state.describing)")
            return SDBus.string(name)
        }
    }

    /// Runs `body` on the bus thread and returns its result.
    private func perform<T: Sendable>(_ body: @escaping @Sendable (BusState) throws -> T) async throws -> T {
        let loop = self.loop
        return try await withCheckedThrowingContinuation { continuation in
            loop.submit { state in
                continuation.resume(with: Result { try body(state) })
            } orElse: { error in
                continuation.resume(throwing: error)
            }
        }
    }
}

/// A match rule for ``DBusConnection/signals(_:buffering:)`` (dbus-specification, "Match Rules").
public struct DBusMatch: Sendable, CustomStringConvertible {
    /// The sender's bus name (`org.bluez`); nil for any sender.
    public var sender: String?
    /// The object path, exactly; nil for any path.
    public var path: String?
    /// Matches the path and every path below it.
    public var pathNamespace: String?
    /// The signal's interface (`org.freedesktop.DBus.Properties`); nil for any.
    public var interface: String?
    /// The signal's name (`PropertiesChanged`); nil for any.
    public var member: String?
    /// The first argument, when it is a string (PropertiesChanged's interface name).
    public var arg0: String?

    /// A rule matching signals on every field given; a field left nil matches anything.
    ///
    /// ```swift
    /// let rule = DBusMatch(sender: "org.bluez", pathNamespace: "/org/bluez/hci0",
    ///                      interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged")
    /// ```
    public init(sender: String? = nil, path: String? = nil, pathNamespace: String? = nil, interface: String? = nil,
                member: String? = nil, arg0: String? = nil) {
        self.sender = sender
        self.path = path
        self.pathNamespace = pathNamespace
        self.interface = interface
        self.member = member
        self.arg0 = arg0
    }

    /// The rule in the bus's syntax, as `AddMatch` takes it (`type='signal',sender='org.bluez',…`).
    public var description: String {
        let fields: [(String, String?)] = [("sender", sender), ("path", path), ("path_namespace", pathNamespace),
                                           ("interface", interface), ("member", member), ("arg0", arg0)]
        let quoted = fields.compactMap { key, value in value.map { "\(key)='\($0.replacingQuotes())'" } }
        return (["type='signal'"] + quoted).joined(separator: ",")
    }
}

private extension String {
    /// A match rule value cannot contain a quote; D-Bus names and paths never do.
    func replacingQuotes() -> String { String(filter { $0 != "'" }) }
}

/// How many signals a subscription keeps while its reader is busy: there is no flow control on a
/// bus (bluetoothd sends every notification, every advertisement), so each subscription says what
/// happens when its reader falls behind.
public enum DBusSignalBuffering: Sendable {
    /// Every signal, in order, up to `limit` waiting unread; one more ends the stream with an
    /// `.io` error that says the reader fell behind. For signals that must not be lost: a GATT
    /// value, a device that went away.
    case all(limit: Int)
    /// The newest `count` signals: older ones unread are dropped. For state where the latest
    /// signal says everything (a property's current value).
    case newest(Int)

    /// The `TransportError.code` of the error that ends an `.all` subscription
    /// whose reader fell behind.
    public static let overflowCode = "org.transportkit.Error.SignalsOverflowed"

    var policy: AsyncThrowingStream<DBusSignal, any Error>.Continuation.BufferingPolicy {
        switch self {
        case .all(let limit): .bufferingOldest(max(limit, 1))
        case .newest(let count): .bufferingNewest(max(count, 1))
        }
    }
}

/// A signal received through ``DBusConnection/signals(_:buffering:)``.
public struct DBusSignal: Sendable {
    /// The sender's unique bus name (`:1.42`), as the bus delivered it.
    public let sender: String
    /// The object path that emitted it.
    public let path: String
    /// The signal's interface.
    public let interface: String
    /// The signal's name (`InterfacesAdded`).
    public let member: String
    /// The values; descriptors among them are the receiver's to close.
    public let values: [DBusValue]
}

/// A method call on an exported object.
public struct DBusMethodCall: Sendable {
    /// The caller's unique bus name (`:1.7`).
    public let sender: String
    /// The object path called: the exported path, or with `subtree`, the path below it that was called.
    public let path: String
    /// The method's interface.
    public let interface: String
    /// The method's name (`RequestPasskey`).
    public let member: String
    /// The arguments; descriptors among them (`h`) are the handler's to close or keep.
    public let arguments: [DBusValue]
}

/// What an exported object's handler answers.
public enum DBusMethodResult: Sendable {
    /// A method return with these values. Descriptors among them (`h`) are taken: closed once the
    /// reply holds its own duplicates.
    case reply([DBusValue])
    /// An error reply: a D-Bus error name (`org.bluez.Error.Rejected`) and a message.
    case error(name: String, message: String)
    /// Not this object's method: the caller gets `org.freedesktop.DBus.Error.UnknownMethod`.
    case notHandled
}

/// An object served on the bus by ``DBusConnection/export(path:subtree:_:)``.
public struct DBusExport: Sendable {
    /// The object path it is served at (the subtree's root for a subtree export).
    public let path: String
    private let removal: @Sendable () async -> Void

    init(path: String, removal: @escaping @Sendable () async -> Void) {
        self.path = path
        self.removal = removal
    }

    /// Takes the object off the bus; calls to it fail from then on.
    public func remove() async { await removal() }
}

/// Turns D-Bus error names into errors a person can act on.
public enum DBusErrors {
    /// The error for a D-Bus error reply `name: message` to `call`.
    public static func map(name: String, message: String, call: String) -> TransportError {
        let detail = "\(call) failed: \(name): \(message)"
        switch name {
        case "org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.NameHasNoOwner":
            return TransportError(.notFound, "\(detail). The service is not running (for Bluetooth: start bluetoothd, `systemctl start bluetooth`)", code: name)
        case _ where name.hasPrefix("org.freedesktop.DBus.Error.Spawn."):
            // D-Bus activation could not start the service (Spawn.PermissionsInvalid,
            // Spawn.ServiceNotFound, Spawn.ExecFailed, …): what it would start is missing or may not run.
            return TransportError(.notFound, "\(detail). The service is not running and the D-Bus daemon could not start it "
                                  + "(for Bluetooth: install bluez and start bluetoothd, `systemctl start bluetooth`)", code: name)
        case "org.freedesktop.DBus.Error.AccessDenied":
            return TransportError(.permissionDenied, "\(detail). The D-Bus policy (/etc/dbus-1/system.d/, /usr/share/dbus-1/system.d/) "
                                  + "does not allow this user the call: run as a user the policy names (for BlueZ: a member of group 'bluetooth' on most distributions) or as root",
                                  code: name)
        case "org.freedesktop.DBus.Error.NoReply", "org.freedesktop.DBus.Error.Timeout":
            return TransportError(.timedOut, detail, code: name)
        default:
            return TransportError(.io, detail, code: name)
        }
    }
}

/// sd-bus's conventions, in one place: a negative result is -errno; strings may be NULL.
enum SDBus {
    /// Throws the errno of a failed sd-bus call (`result < 0`), naming the call.
    static func check(_ result: Int32, _ function: String, _ what: String) throws {
        if result < 0 { throw TransportError.posix(function, errno: Errno(rawValue: -result), what: what) }
    }

    /// A C string sd-bus returned, "" for NULL.
    static func string(_ pointer: UnsafePointer<CChar>?) -> String {
        pointer.map { String(cString: $0) } ?? ""
    }

    /// The error a reply carries, turned into one a person can act on; nil for a method return.
    static func error(in reply: OpaquePointer, call: String) -> TransportError? {
        guard sd_bus_message_is_method_error(reply, nil) > 0 else { return nil }
        let error = sd_bus_message_get_error(reply)
        let name = error?.pointee.name.map { String(cString: $0) } ?? "?"
        return DBusErrors.map(name: name, message: string(error?.pointee.message), call: call)
    }
}

// MARK: - The bus thread

/// The queue of jobs, the wake pipe and the loop the bus thread runs.
private final class BusLoop: Sendable {
    /// Jobs for the bus thread, and whether it still takes them (false once it has ended).
    private let jobs = Locked<(open: Bool, queue: [Job])>((true, []))
    private let stopRequested = Atomic<Bool>(false)
    private let wakeRead: Int32
    private let wakeWrite: Int32
    private let state: BusState
    var hasEnded: Bool { state.hasEnded.load(ordering: .acquiring) }

    struct Job {
        let run: @Sendable (BusState) -> Void
        let fail: @Sendable (TransportError) -> Void
    }

    init(bus: OpaquePointer, describing: String) throws {
        var ends: [Int32] = [-1, -1]
        guard pipe(&ends) == 0 else {
            throw TransportError.posix("pipe", errno: Errno(rawValue: errno), what: "the D-Bus thread's wake pipe")
        }
        for end in ends {
            _ = fcntl(end, F_SETFD, FD_CLOEXEC)
            _ = fcntl(end, F_SETFL, O_NONBLOCK)
        }
        wakeRead = ends[0]
        wakeWrite = ends[1]
        state = BusState(bus: bus, describing: describing)
    }

    deinit {
        Glibc.close(wakeRead)
        Glibc.close(wakeWrite)
    }

    func wake() {
        var one: UInt8 = 1
        _ = Glibc.write(wakeWrite, &one, 1)
    }

    func requestStop() {
        stopRequested.store(true, ordering: .sequentiallyConsistent)
        wake()
    }

    /// Queues `job` for the bus thread; `fail` instead when the connection has ended.
    func submit(_ job: @escaping @Sendable (BusState) -> Void, orElse fail: @escaping @Sendable (TransportError) -> Void) {
        let queued = jobs.withLock { jobs in
            guard jobs.open else { return false }
            jobs.queue.append(Job(run: job, fail: fail))
            return true
        }
        if queued {
            wake()
        } else {
            fail(TransportError(.disconnected, "the D-Bus connection to \(state.describing) is closed"))
        }
    }

    /// The bus thread's loop.
    func run(isStopping: () -> Bool) {
        var drain = [UInt8](repeating: 0, count: 64)
        while !isStopping() && !stopRequested.load(ordering: .sequentiallyConsistent) {
            for job in jobs.withLock({ jobs in defer { jobs.queue = [] }; return jobs.queue }) {
                if let ended = state.ended { job.fail(ended) } else { job.run(state) }
            }
            var timeout: Int32 = -1
            var fds = [pollfd(fd: wakeRead, events: Int16(POLLIN), revents: 0)]
            if state.ended == nil {
                state.processAll()
            }
            if state.ended == nil {
                fds.append(pollfd(fd: sd_bus_get_fd(state.bus), events: Int16(truncatingIfNeeded: max(sd_bus_get_events(state.bus), 0)), revents: 0))
                timeout = state.pollTimeout()
            }
            _ = poll(&fds, nfds_t(fds.count), timeout)
            if fds[0].revents != 0 { while Glibc.read(wakeRead, &drain, drain.count) > 0 {} }
        }
        let leftover = jobs.withLock { jobs in
            defer { jobs = (false, []) }
            return jobs.queue
        }
        let closed = TransportError(.disconnected, "the D-Bus connection to \(state.describing) is closed")
        for job in leftover { job.fail(closed) }
        state.shutDown(closed)
    }
}

/// What only the bus thread touches: the sd-bus object and the slots of calls, matches and
/// exported objects, each with the record its callbacks reach through their userdata.
final class BusState: @unchecked Sendable {
    // @unchecked Sendable: created before the bus thread starts, then used only on that thread
    // (every access happens in a job or callback the bus thread runs).
    let bus: OpaquePointer
    let describing: String
    /// Set when the connection has ended (closed, or lost): every later job fails with it.
    private(set) var ended: TransportError?
    /// `ended != nil`, readable from any thread.
    let hasEnded = Atomic<Bool>(false)
    /// Keeps each record alive while sd-bus may call back into it.
    private var records: [ObjectIdentifier: any SlotRecord] = [:]
    /// Method calls whose reply an asynchronous handler will send: a reference each, released by
    /// the reply, or by the connection's end.
    private var held: [Int: OpaquePointer] = [:]
    private var nextHeld = 0

    /// Keeps a referenced call message for a reply sent later; returns its number.
    func hold(_ message: OpaquePointer) -> Int {
        nextHeld += 1
        held[nextHeld] = message
        return nextHeld
    }

    /// The held message, handed back with its reference (nil when the connection ended and
    /// released it).
    func release(held number: Int) -> OpaquePointer? { held.removeValue(forKey: number) }

    init(bus: OpaquePointer, describing: String) {
        self.bus = bus
        self.describing = describing
    }

    func keep(_ record: any SlotRecord) { records[ObjectIdentifier(record)] = record }

    /// Releases the record's slots (no callback after this) and forgets it.
    func remove(_ record: any SlotRecord) {
        release(record)
        records[ObjectIdentifier(record)] = nil
    }

    private func release(_ record: any SlotRecord) {
        let slots = record.slots
        record.slots = []
        for slot in slots { sd_bus_slot_unref(slot) }
    }

    /// Lets sd-bus do everything it can without waiting; notices a lost connection.
    func processAll() {
        var result: Int32
        repeat { result = sd_bus_process(bus, nil) } while result > 0
        if result < 0 || sd_bus_is_open(bus) <= 0 {
            // Let pending calls receive the errors sd-bus synthesises for a closed connection.
            while sd_bus_process(bus, nil) > 0 {}
            shutDown(TransportError(.disconnected, "the D-Bus connection to \(describing) was lost (dbus-daemon stopped?)",
                                    errno: result < 0 ? Errno(rawValue: -result) : nil, syscall: result < 0 ? "sd_bus_process" : nil))
        }
    }

    /// poll(2)'s timeout in milliseconds for sd-bus's next deadline, -1 when there is none.
    func pollTimeout() -> Int32 {
        var deadline: UInt64 = 0
        guard sd_bus_get_timeout(bus, &deadline) >= 0, deadline != UInt64.max else { return -1 }
        var now = timespec()
        clock_gettime(CLOCK_MONOTONIC, &now)
        let nowMicros = UInt64(now.tv_sec) * 1_000_000 + UInt64(now.tv_nsec / 1000)
        guard deadline > nowMicros else { return 0 }
        return Int32(min((deadline - nowMicros + 999) / 1000, UInt64(Int32.max)))
    }

    /// Ends every record with `error` and closes the bus (once).
    func shutDown(_ error: TransportError) {
        guard ended == nil else { return }
        ended = error
        hasEnded.store(true, ordering: .releasing)
        let all = records.values
        records = [:]
        for record in all {
            release(record)
            record.connectionEnded(error)
        }
        for message in held.values { sd_bus_message_unref(message) }
        held = [:]
        sd_bus_flush_close_unref(bus)
    }
}

/// Something that holds sd-bus slots and hears about the connection's end.
protocol SlotRecord: AnyObject {
    /// Touched only on the bus thread.
    var slots: [OpaquePointer] { get set }
    func connectionEnded(_ error: TransportError)
}

/// One method call in flight.
private final class PendingCall: SlotRecord, @unchecked Sendable {
    // @unchecked Sendable: `slots` is touched only on the bus thread; the continuation is behind its Locked.
    var slots: [OpaquePointer] = []
    /// The waiting caller and the call's result. The result is handed over through this lock, not
    /// through the continuation: the caller takes it under the lock after it is resumed, so the
    /// values the bus thread decoded are visibly published to it (ThreadSanitizer sees the lock).
    private let continuation = Locked<(finished: Bool, waiting: CheckedContinuation<Void, any Error>?, result: Result<[DBusValue], any Error>?)>((false, nil, nil))
    let describing: String

    init(describing: String) { self.describing = describing }

    /// Stores the continuation; false (and resumed) when the call already finished (cancelled).
    func wait(_ waiting: CheckedContinuation<Void, any Error>) -> Bool {
        let finished = continuation.withLock { state in
            if !state.finished { state.waiting = waiting }
            return state.finished
        }
        if finished { waiting.resume(throwing: CancellationError()) }
        return !finished
    }

    /// The result, once the caller was resumed; `CancellationError` when there is none.
    func takeResult() throws -> [DBusValue] {
        let result = continuation.withLock { state in
            defer { state.result = nil }
            return state.result
        }
        guard let result else { throw CancellationError() }
        return try result.get()
    }

    /// Resumes the caller once; a later result is dropped (its descriptors closed).
    func finish(_ result: Result<[DBusValue], any Error>) {
        let (first, waiting) = continuation.withLock { state in
            defer { state.finished = true; state.waiting = nil }
            if !state.finished && state.waiting != nil { state.result = result }
            return (!state.finished, state.waiting)
        }
        guard first else {
            if case .success(let values) = result { DBusValue.closeDescriptors(in: values) }
            return
        }
        waiting?.resume()
        if waiting == nil, case .success(let values) = result { DBusValue.closeDescriptors(in: values) }
    }

    var isFinished: Bool { continuation.withLock { $0.finished } }

    func connectionEnded(_ error: TransportError) { finish(.failure(error)) }

    /// On the bus thread.
    func start(on state: BusState, destination: String, path: String, interface: String, member: String,
               arguments: [DBusValue], timeoutMicros: UInt64) {
        guard !isFinished else { return }
        do {
            var message: OpaquePointer?
            try SDBus.check(sd_bus_message_new_method_call(state.bus, &message, destination, path, interface, member),
                      "sd_bus_message_new_method_call", describing)
            guard let message else { throw TransportError(.io, "\(describing): sd-bus made no message") }
            defer { sd_bus_message_unref(message) }
            try DBusWriter(message: message, what: describing).append(arguments)
            var slot: OpaquePointer?
            try SDBus.check(sd_bus_call_async(state.bus, &slot, message, { reply, userdata, _ in
                guard let reply, let userdata else { return 0 }
                let call = Unmanaged<PendingCall>.fromOpaque(userdata).takeUnretainedValue()
                call.received(reply)
                call.owner?.remove(call)
                return 0
            }, Unmanaged.passUnretained(self).toOpaque(), timeoutMicros), "sd_bus_call_async", describing)
            if let slot { slots = [slot] }
            owner = state
            state.keep(self)
        } catch {
            finish(.failure(error))
        }
    }

    /// The state that keeps this record (bus thread only).
    private(set) weak var owner: BusState?

    private func received(_ reply: OpaquePointer) {
        if let error = SDBus.error(in: reply, call: describing) { return finish(.failure(error)) }
        guard !isFinished else { return }
        finish(Result { try DBusReader(message: reply, what: "the reply to \(describing)").readAll() })
    }
}

/// One subscription: one or more match rules feeding one stream, in the order the bus delivered
/// the signals.
private final class Subscription: SlotRecord, @unchecked Sendable {
    // @unchecked Sendable: `slots`, `pendingInstalls`, `lastDelivered` and `installed` are touched
    // only on the bus thread (the continuation is set before the install job is queued); the
    // stream continuation is Sendable.
    var slots: [OpaquePointer] = []
    let rules: [String]
    private let buffering: DBusSignalBuffering
    private let continuation: AsyncThrowingStream<DBusSignal, any Error>.Continuation
    private var installed: CheckedContinuation<Void, any Error>?
    /// Matches whose AddMatch the bus has not answered yet.
    private var pendingInstalls = 0
    /// The last signal delivered (a message that matches two of the rules comes once).
    private var lastDelivered: (sender: String, cookie: UInt64)?

    var describing: String { rules.joined(separator: " or ") }

    init(rules: [String], buffering: DBusSignalBuffering, continuation: AsyncThrowingStream<DBusSignal, any Error>.Continuation) {
        self.rules = rules
        self.buffering = buffering
        self.continuation = continuation
    }

    func awaitInstall(_ waiting: CheckedContinuation<Void, any Error>) { installed = waiting }

    func installFinished(_ result: Result<Void, any Error>) {
        let waiting = installed
        installed = nil
        waiting?.resume(with: result)
        if case .failure(let error) = result { continuation.finish(throwing: error) }
    }

    func connectionEnded(_ error: TransportError) {
        installFinished(.failure(error))
        continuation.finish(throwing: error)
    }

    /// On the bus thread.
    func install(on state: BusState) {
        let userdata = Unmanaged.passUnretained(self).toOpaque()
        pendingInstalls = rules.count
        for rule in rules {
            var slot: OpaquePointer?
            let result = sd_bus_add_match_async(state.bus, &slot, rule, { message, userdata, _ in
                guard let message, let userdata else { return 0 }
                Unmanaged<Subscription>.fromOpaque(userdata).takeUnretainedValue().received(message)
                return 0
            }, { reply, userdata, _ in
                guard let userdata else { return 0 }
                Unmanaged<Subscription>.fromOpaque(userdata).takeUnretainedValue().answered(reply)
                return 0
            }, userdata)
            guard result >= 0 else {
                state.remove(self)
                return installFinished(.failure(TransportError.posix("sd_bus_add_match_async", errno: Errno(rawValue: -result), what: rule)))
            }
            if let slot { slots.append(slot) }
            state.keep(self)
        }
    }

    /// The bus answered one AddMatch: the stream is ready when it has answered all of them.
    private func answered(_ reply: OpaquePointer?) {
        if let reply, let error = SDBus.error(in: reply, call: "AddMatch \(describing)") {
            return installFinished(.failure(error))
        }
        pendingInstalls -= 1
        if pendingInstalls == 0 { installFinished(.success(())) }
    }

    private func received(_ message: OpaquePointer) {
        // sd-bus runs every matching rule's callback for one message, one after the other: a
        // sender's serial numbers its messages, so (sender, serial) names one.
        var cookie: UInt64 = 0
        _ = sd_bus_message_get_cookie(message, &cookie)
        let sender = SDBus.string(sd_bus_message_get_sender(message))
        guard lastDelivered?.sender != sender || lastDelivered?.cookie != cookie else { return }
        lastDelivered = (sender, cookie)
        let text = SDBus.string
        do {
            let values = try DBusReader(message: message, what: "a signal").readAll()
            let signal = DBusSignal(sender: text(sd_bus_message_get_sender(message)), path: text(sd_bus_message_get_path(message)),
                                    interface: text(sd_bus_message_get_interface(message)), member: text(sd_bus_message_get_member(message)),
                                    values: values)
            switch continuation.yield(signal) {
            case .enqueued:
                break
            case .terminated:
                DBusValue.closeDescriptors(in: values)
            case .dropped(let dropped):
                DBusValue.closeDescriptors(in: dropped.values)
                if case .all(let limit) = buffering {
                    continuation.finish(throwing: TransportError(.io, "more than \(limit) D-Bus signals (\(describing)) waited unread: "
                                                                 + "their reader fell behind, and these may not be dropped",
                                                                 code: DBusSignalBuffering.overflowCode))
                }
            @unknown default:
                DBusValue.closeDescriptors(in: values)
            }
        } catch {
            continuation.finish(throwing: error)
        }
    }
}

/// One exported object (or subtree).
private final class ExportedObject: SlotRecord, @unchecked Sendable {
    // @unchecked Sendable: `slots` and `owner` are touched only on the bus thread; the rest is immutable.
    var slots: [OpaquePointer] = []
    /// The state that keeps this object (bus thread only).
    private weak var owner: BusState?
    let path: String
    let subtree: Bool
    let handler: Handler
    /// For replies sent later: they go out on the bus thread.
    private let loop: BusLoop
    /// Run once the object is off the bus (ends an in-order export's queue: calls already
    /// queued are still answered, or dropped with the connection).
    let onRemoval: @Sendable () -> Void

    enum Handler {
        /// Answers on the bus thread, before the next message is read.
        case immediate(@Sendable (DBusMethodCall) -> DBusMethodResult)
        /// Answers from a task of its own (or, given a queue, from the queue's one task, in the
        /// order the calls came); the reply goes out when it returns.
        case later(@Sendable (DBusMethodCall) async -> DBusMethodResult, queue: AsyncStream<@Sendable () async -> Void>.Continuation?)
    }

    init(path: String, subtree: Bool, handler: Handler, loop: BusLoop, onRemoval: @escaping @Sendable () -> Void = {}) {
        self.path = path
        self.subtree = subtree
        self.handler = handler
        self.loop = loop
        self.onRemoval = onRemoval
    }

    /// The connection ended: no call comes any more (an in-order export's queue ends).
    func connectionEnded(_ error: TransportError) { onRemoval() }

    /// On the bus thread.
    func register(on state: BusState) throws {
        var slot: OpaquePointer?
        let userdata = Unmanaged.passUnretained(self).toOpaque()
        let callback: sd_bus_message_handler_t = { message, userdata, replyError in
            guard let message, let userdata else { return 0 }
            return Unmanaged<ExportedObject>.fromOpaque(userdata).takeUnretainedValue().handle(message, replyError)
        }
        let result = subtree ? sd_bus_add_fallback(state.bus, &slot, path, callback, userdata)
                             : sd_bus_add_object(state.bus, &slot, path, callback, userdata)
        try SDBus.check(result, subtree ? "sd_bus_add_fallback" : "sd_bus_add_object", "the D-Bus object \(path)")
        if let slot { slots = [slot] }
        owner = state
        state.keep(self)
    }

    private func handle(_ message: OpaquePointer, _ replyError: UnsafeMutablePointer<sd_bus_error>?) -> Int32 {
        guard sd_bus_message_is_method_call(message, nil, nil) > 0 else { return 0 }
        let text = SDBus.string
        let path = text(sd_bus_message_get_path(message))
        let member = text(sd_bus_message_get_member(message))
        let arguments: [DBusValue]
        do {
            arguments = try DBusReader(message: message, what: "a call to \(path)").readAll()
        } catch {
            return sd_bus_error_set(replyError, "org.freedesktop.DBus.Error.InvalidArgs", "\(error)")
        }
        let call = DBusMethodCall(sender: text(sd_bus_message_get_sender(message)), path: path,
                                  interface: text(sd_bus_message_get_interface(message)), member: member, arguments: arguments)
        switch handler {
        case .immediate(let handler):
            let result = handler(call)
            if case .notHandled = result {
                DBusValue.closeDescriptors(in: arguments)
                return 0
            }
            return Self.answer(message, with: result, describing: "\(member) on \(path)")
        case .later(let handler, let queue):
            // The call message stays alive, held by the bus state, until the reply is built from
            // it; only the bus thread touches it (its reference count is not atomic).
            guard let state = owner, let reference = sd_bus_message_ref(message) else { return -ENOMEM }
            let held = state.hold(reference)
            let loop = self.loop
            let answer: @Sendable () async -> Void = {
                let result = await handler(call)
                if case .notHandled = result { DBusValue.closeDescriptors(in: arguments) }
                loop.submit { state in
                    guard let message = state.release(held: held) else {
                        if case .reply(let values) = result { DBusValue.closeDescriptors(in: values) }
                        return
                    }
                    _ = Self.answer(message, with: result, describing: "\(member) on \(path)")
                    sd_bus_message_unref(message)
                } orElse: { _ in
                    // The connection ended (and released the message): nobody to answer.
                    if case .reply(let values) = result { DBusValue.closeDescriptors(in: values) }
                }
            }
            if let queue {
                switch queue.yield(answer) {
                case .enqueued:
                    break
                case .terminated:
                    // Removed while this call came: answered as a call to no object.
                    DBusValue.closeDescriptors(in: arguments)
                    if let message = state.release(held: held) { sd_bus_message_unref(message) }
                    return 0
                case .dropped:
                    // More calls wait than the queue takes: this one is refused now.
                    DBusValue.closeDescriptors(in: arguments)
                    if let message = state.release(held: held) { sd_bus_message_unref(message) }
                    return sd_bus_error_set(replyError, "org.freedesktop.DBus.Error.LimitsExceeded",
                                            "more than \(DBusConnection.inOrderCallLimit) calls to \(path) wait for their answer")
                @unknown default:
                    break
                }
            } else {
                // A task per call: as many as callers wait for answers, which the bus bounds.
                Task { await answer() }
            }
            return 1
        }
    }

    /// Sends `result` as the reply to `message` (on the bus thread): 1 once sent, else -errno. A
    /// call that asked for no reply (bluetoothd's StartNotify and WriteValue to an application)
    /// gets none: the bus would refuse it.
    private static func answer(_ message: OpaquePointer, with result: DBusMethodResult, describing: String) -> Int32 {
        if sd_bus_message_get_expect_reply(message) == 0 {
            if case .reply(let values) = result { DBusValue.closeDescriptors(in: values) }
            return 1
        }
        switch result {
        case .notHandled:
            return replyError(message, "org.freedesktop.DBus.Error.UnknownMethod", "no method \(describing)")
        case .error(let name, let text):
            return replyError(message, name, text)
        case .reply(let values):
            // The reply takes the handler's descriptors: sd-bus has its own duplicates once appended.
            defer { DBusValue.closeDescriptors(in: values) }
            var reply: OpaquePointer?
            guard sd_bus_message_new_method_return(message, &reply) >= 0, let reply else { return -ENOMEM }
            defer { sd_bus_message_unref(reply) }
            do {
                try DBusWriter(message: reply, what: "the reply to \(describing)").append(values)
            } catch {
                return replyError(message, "org.freedesktop.DBus.Error.Failed", "\(error)")
            }
            let sent = sd_bus_send(sd_bus_message_get_bus(message), reply, nil)
            return sent < 0 ? sent : 1
        }
    }

    private static func replyError(_ message: OpaquePointer, _ name: String, _ text: String) -> Int32 {
        var error = sd_bus_error(name: nil, message: nil, _need_free: 0)
        defer { sd_bus_error_free(&error) }
        _ = sd_bus_error_set(&error, name, text)
        let sent = sd_bus_reply_method_error(message, &error)
        return sent < 0 ? sent : 1
    }
}


