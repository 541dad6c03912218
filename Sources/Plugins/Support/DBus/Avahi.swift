// Avahi.swift: DNS-SD over multicast DNS (RFC 6762, RFC 6763) through avahi-daemon's D-Bus API
// (org.freedesktop.Avahi, avahi 0.8: Server, EntryGroup, ServiceBrowser; avahi-common/defs.h for
// the flags and states). Publishing is an EntryGroup; browsing is one ServiceBrowser per type and a
// synchronous Server.ResolveService per service found.

import Glibc
import Synchronization
@_spi(Plugins) import TransportKitCore

/// A DNS-SD service instance: its name, type and domain (`"Bench port"`, `"_telnetcpcd._tcp"`, `"local"`).
public struct DNSServiceName: Sendable, Hashable, CustomStringConvertible {
    /// The instance name people see (`Bench port`); any UTF-8, up to 63 bytes.
    public var name: String
    /// The service type: `_SERVICE._tcp` or `_SERVICE._udp` (`_telnetcpcd._tcp`).
    public var type: String
    /// The domain; `local` for multicast DNS.
    public var domain: String

    /// A service name in `domain` (`local` unless given).
    public init(name: String, type: String, domain: String = "local") {
        self.name = name
        self.type = type
        self.domain = domain
    }

    /// `"Bench port" (_telnetcpcd._tcp.local)`.
    public var description: String { "\"\(name)\" (\(type).\(domain))" }
}

/// A service found on the network and resolved: where it is and what its TXT record says.
public struct DNSService: Sendable, Equatable {
    /// Its name, type and domain.
    public var service: DNSServiceName
    /// The host name it is on (`tk-a.local`).
    public var host: String
    /// A numeric address of that host (IPv4 by default; an IPv6 link-local address carries its
    /// `%interface` scope), ready for a URL.
    public var address: String
    /// The port the service listens on.
    public var port: Int
    /// The TXT record's keys and values, first occurrence of a key winning (RFC 6763 §6.4); a key
    /// without `=` has the value `""`. Keys as published (RFC 6763 compares them case-insensitively).
    public var txt: [String: String]
    /// The network interface it was found on (`eth0`), when avahi-daemon names it.
    public var interface: String?
    /// Published by avahi-daemon on this host (by this process or another).
    public var isLocal: Bool

    /// A resolved service; each parameter is the property of the same name (a browse makes these;
    /// tests and listings may too).
    public init(service: DNSServiceName, host: String, address: String, port: Int, txt: [String: String],
                interface: String? = nil, isLocal: Bool = false) {
        self.service = service
        self.host = host
        self.address = address
        self.port = port
        self.txt = txt
        self.interface = interface
        self.isLocal = isLocal
    }

    /// A TXT record's items as RFC 6763 §6.4 reads them, from items in wire order.
    public static func txt(fromItems items: [[UInt8]]) -> [String: String] {
        var txt: [String: String] = [:]
        for item in items where !item.isEmpty && item.first != UInt8(ascii: "=") {
            let text = String(decoding: item, as: UTF8.self)
            let (key, value) = text.firstIndex(of: "=").map { (String(text[..<$0]), String(text[text.index(after: $0)...])) } ?? (text, "")
            if txt.keys.contains(where: { $0.lowercased() == key.lowercased() }) { continue }
            txt[key] = value
        }
        return txt
    }
}

/// What a browse reports.
public enum DNSServiceEvent: Sendable, Equatable {
    /// A service appeared and was resolved.
    case found(DNSService)
    /// A service that was found went away (its goodbye packet, or its records expired).
    case removed(DNSServiceName)
    /// Every service avahi-daemon knew of when the browse began has been reported: a listing can stop here.
    case allForNow
}

/// DNS-SD through avahi-daemon, the mDNS responder of Linux distributions, on the system bus.
///
/// ```swift
/// let avahi = Avahi(bus: try DBusConnection(.system))
/// let publication = try await avahi.publish(DNSServiceName(name: "Bench port", type: "_telnetcpcd._tcp"),
///                                           port: 2217, txt: ["txtvers=1", "protocol=rfc2217"])
/// print(publication.name)          // "Bench port", or "Bench port #2" after a collision
/// for try await event in avahi.browse(types: ["_telnetcpcd._tcp"]) { print(event) }
/// await publication.withdraw()
/// ```
public struct Avahi: Sendable {
    static let service = "org.freedesktop.Avahi"
    static let server = "org.freedesktop.Avahi.Server"
    static let entryGroup = "org.freedesktop.Avahi.EntryGroup"
    static let serviceBrowser = "org.freedesktop.Avahi.ServiceBrowser"
    /// AVAHI_IF_UNSPEC, AVAHI_PROTO_UNSPEC, AVAHI_PROTO_INET.
    static let anyInterface: Int32 = -1
    static let anyProtocol: Int32 = -1
    static let ipv4: Int32 = 0
    /// AvahiLookupResultFlags: AVAHI_LOOKUP_RESULT_LOCAL.
    static let resultLocal: UInt32 = 8
    /// How long avahi-daemon takes at most to resolve (5 s, resolve-service.c), with a margin.
    static let resolveTimeout: Duration = .seconds(8)

    /// The bus avahi-daemon is reached on (the system bus).
    public let bus: DBusConnection

    /// DNS-SD through avahi-daemon on `bus`; nothing is called until a publish or browse, so a
    /// missing avahi-daemon shows there.
    public init(bus: DBusConnection) { self.bus = bus }

    // MARK: Publishing

    /// Publishes a service on every interface avahi-daemon serves, renaming it on a collision
    /// (`"name #2"`, as avahi's own tools do), and returns once it is established on the network
    /// (probing takes about a second) or fails.
    ///
    /// - Parameters:
    ///   - service: the instance name (at most 63 bytes of UTF-8) and type (`_telnetcpcd._tcp`).
    ///   - port: the TCP port clients connect to.
    ///   - txt: the TXT record's items, `key=value` or a bare `key`, in this order.
    ///   - timeout: how long probing may take.
    /// - Throws: `TransportError` `.notFound` when avahi-daemon is not on the bus, `.invalidURL`
    ///   for a name or type avahi refuses, `.timedOut` when probing does not end.
    public func publish(_ service: DNSServiceName, port: Int, txt: [String], timeout: Duration = .seconds(10)) async throws -> DNSPublication {
        guard (1...65535).contains(port) else { throw TransportError(.misuse, "a DNS-SD service needs a port between 1 and 65535, not \(port)") }
        guard service.name.utf8.count <= 63, !service.name.isEmpty else {
            throw TransportError(.invalidURL, "a DNS-SD instance name is 1 to 63 bytes of UTF-8: \"\(service.name)\" has \(service.name.utf8.count)")
        }
        let group = try await call(path: "/", interface: Self.server, member: "EntryGroupNew").first?.text ?? ""
        guard !group.isEmpty else { throw TransportError(.protocolError, "avahi-daemon's EntryGroupNew returned no object path") }
        do {
            let states = try await bus.signals(DBusMatch(sender: Self.service, path: group, interface: Self.entryGroup, member: "StateChanged"),
                                               buffering: .all(limit: 64))
            var name = service.name
            let limit = ContinuousClock.now + timeout
            for attempt in 1...16 {
                do {
                    try await add(name, service, port: port, txt: txt, group: group)
                } catch let error as TransportError where error.code == "org.freedesktop.Avahi.CollisionError" && attempt < 16 {
                    // Another group of this daemon has the name.
                    name = try await alternative(to: name)
                    continue
                }
                switch try await Self.settled(states, until: limit, service: service) {
                case .established:
                    let published = DNSServiceName(name: name, type: service.type, domain: service.domain)
                    return DNSPublication(service: published, port: port, txt: txt, group: group, avahi: self, states: states)
                case .collision:
                    // Someone on the network has the name: take the next one, as avahi's tools do.
                    name = try await alternative(to: name)
                    _ = try await call(path: group, interface: Self.entryGroup, member: "Reset")
                case .failure(let error):
                    throw TransportError(.io, "avahi-daemon could not publish \(service): \(error)", code: error)
                }
            }
            throw TransportError(.busy, "every name tried for \(service) collided (16 tries, up to \"\(name)\"): choose another name")
        } catch {
            _ = try? await call(path: group, interface: Self.entryGroup, member: "Free")
            throw error
        }
    }

    func add(_ name: String, _ service: DNSServiceName, port: Int, txt: [String], group: String) async throws {
        let items = DBusValue.array(element: "ay", txt.map { .byteArray(Array($0.utf8)) })
        _ = try await call(path: group, interface: Self.entryGroup, member: "AddService",
                           [.int32(Self.anyInterface), .int32(Self.anyProtocol), .uint32(0), .string(name), .string(service.type),
                            .string(service.domain == "local" ? "" : service.domain), .string(""), .uint16(UInt16(port)), items])
        _ = try await call(path: group, interface: Self.entryGroup, member: "Commit")
    }

    func alternative(to name: String) async throws -> String {
        try await call(path: "/", interface: Self.server, member: "GetAlternativeServiceName", [.string(name)]).first?.text ?? name + " #2"
    }

    enum GroupState: Equatable {
        case established, collision
        case failure(String)
    }

    /// Reads StateChanged(i state, s error) until the group is established (2), collides (3) or
    /// fails (4); states 0 and 1 (uncommitted, registering) are on the way.
    static func settled(_ states: AsyncThrowingStream<DBusSignal, any Error>, until limit: ContinuousClock.Instant,
                        service: DNSServiceName) async throws -> GroupState {
        try await withDeadline(limit, TransportError(.timedOut, "avahi-daemon did not establish \(service) on the network in time (probing takes about a second)")) {
            for try await signal in states {
                switch signal.values.first?.integer ?? -1 {
                case 2: return .established
                case 3: return .collision
                case 4: return .failure(signal.values.dropFirst().first?.text ?? "")
                default: continue
                }
            }
            try Task.checkCancellation()
            throw TransportError(.disconnected, "the bus connection to avahi-daemon ended while it published \(service)")
        }
    }

    // MARK: Browsing

    /// Browses for services of `types` (`_telnetcpcd._tcp`) on IPv4, resolving each one found;
    /// returns once avahi-daemon browses, so a service that appears after this returns is reported.
    /// The sequence runs until its iteration ends or its task is cancelled; ``DNSServiceEvent/allForNow``
    /// comes once what avahi-daemon knew at the start has been reported.
    ///
    /// A service seen on several interfaces is reported once; it is removed when it has left all
    /// of them. A service that cannot be resolved (its host does not answer) is left out.
    ///
    /// - Throws: `TransportError` `.notFound` when avahi-daemon is not on the bus, `.invalidURL`
    ///   for a type it refuses; the sequence ends with `.io` when avahi-daemon reports a failure or
    ///   the reader fell 4,096 events behind, `.disconnected` when the bus connection ends.
    public func browse(types: [String]) async throws -> AsyncThrowingStream<DNSServiceEvent, any Error> {
        let browser = try await Browser.start(avahi: self, types: types)
        let (events, continuation) = AsyncThrowingStream<DNSServiceEvent, any Error>.makeStream(bufferingPolicy: .bufferingOldest(4096))
        let feed = BrowseFeed(continuation)
        let task = Task {
            do {
                try await browser.run(feed)
                feed.finish(nil)
            } catch is CancellationError {
                feed.finish(nil)
            } catch {
                feed.finish(error)
            }
            await browser.free()
        }
        continuation.onTermination = { _ in task.cancel() }
        return events
    }

    /// Sends one event, and ends the stream with an error when the reader fell too far behind.
    final class BrowseFeed: Sendable {
        let continuation: AsyncThrowingStream<DNSServiceEvent, any Error>.Continuation
        init(_ continuation: AsyncThrowingStream<DNSServiceEvent, any Error>.Continuation) { self.continuation = continuation }

        func yield(_ event: DNSServiceEvent) {
            if case .dropped = continuation.yield(event) {
                finish(TransportError(.io, "the reader of a DNS-SD browse fell 4,096 events behind; browse again"))
            }
        }

        func finish(_ error: (any Error)?) { continuation.finish(throwing: error) }
    }

    /// One browse: a ServiceBrowser per type, the signals of all of them in one subscription made
    /// before any exists (so the first ItemNew, sent a few milliseconds after the browser is made,
    /// cannot be missed, on any avahi version), and a resolve per item.
    struct Browser {
        let avahi: Avahi
        let signals: AsyncThrowingStream<DBusSignal, any Error>
        let browsers: Set<String>

        /// An item as ServiceBrowser reports it: the service on one interface and protocol.
        struct Item: Hashable {
            var interface: Int32
            var proto: Int32
            var service: DNSServiceName
        }

        static func start(avahi: Avahi, types: [String]) async throws -> Browser {
            let signals = try await avahi.bus.signals(DBusMatch(sender: Avahi.service, interface: Avahi.serviceBrowser), buffering: .all(limit: 4096))
            var browsers: Set<String> = []
            do {
                for type in types {
                    let reply = try await avahi.call(path: "/", interface: Avahi.server, member: "ServiceBrowserNew",
                                                     [.int32(Avahi.anyInterface), .int32(Avahi.ipv4), .string(type), .string(""), .uint32(0)])
                    guard let path = reply.first?.text else { throw TransportError(.protocolError, "avahi-daemon's ServiceBrowserNew returned no object path") }
                    browsers.insert(path)
                }
            } catch {
                await Browser(avahi: avahi, signals: signals, browsers: browsers).free()
                throw error
            }
            return Browser(avahi: avahi, signals: signals, browsers: browsers)
        }

        /// Ends the browsers (avahi-daemon also ends them when the bus connection closes).
        func free() async {
            await uncancellable { [browsers, avahi] in
                for path in browsers { _ = try? await avahi.call(path: path, interface: Avahi.serviceBrowser, member: "Free") }
            }
        }

        func run(_ feed: BrowseFeed) async throws {
            var items: Set<Item> = []
            var found: [DNSServiceName: DNSService] = [:]
            var waitingForAllForNow = browsers
            var saidAllForNow = false
            // Services are resolved one at a time, in the order found; signals wait in the
            // subscription's buffer meanwhile (a resolve of a live host takes milliseconds; one
            // whose host vanished gives up after avahi-daemon's 5 s).
            for try await signal in signals {
                guard browsers.contains(signal.path) else { continue }
                switch signal.member {
                case "ItemNew":
                    guard let item = Self.item(signal.values), items.insert(item).inserted, found[item.service] == nil else { continue }
                    if let service = await avahi.resolve(item.service, interface: item.interface, proto: item.proto) {
                        found[item.service] = service
                        feed.yield(.found(service))
                    }
                case "ItemRemove":
                    guard let item = Self.item(signal.values) else { continue }
                    items.remove(item)
                    if !items.contains(where: { $0.service == item.service }), found.removeValue(forKey: item.service) != nil {
                        feed.yield(.removed(item.service))
                    }
                case "AllForNow":
                    waitingForAllForNow.remove(signal.path)
                    if !saidAllForNow && waitingForAllForNow.isEmpty {
                        saidAllForNow = true
                        feed.yield(.allForNow)
                    }
                case "Failure":
                    let message = signal.values.first?.text ?? "?"
                    throw TransportError(.io, "avahi-daemon's browse failed: \(message)", code: message)
                default:
                    continue
                }
            }
            try Task.checkCancellation()
            throw TransportError(.disconnected, "the bus connection to avahi-daemon ended during a DNS-SD browse")
        }

        /// ItemNew/ItemRemove(i interface, i protocol, s name, s type, s domain, u flags).
        static func item(_ values: [DBusValue]) -> Item? {
            guard values.count >= 5, let interface = values[0].integer, let proto = values[1].integer,
                  let name = values[2].text, let type = values[3].text, let domain = values[4].text else { return nil }
            return Item(interface: Int32(truncatingIfNeeded: interface), proto: Int32(truncatingIfNeeded: proto),
                        service: DNSServiceName(name: name, type: type, domain: domain))
        }
    }

    // MARK: Resolving and calls

    /// Resolves a service found on `interface` with `proto` (Server.ResolveService: host, address,
    /// port and TXT in one reply, no signal to wait for); nil when its host does not answer.
    func resolve(_ service: DNSServiceName, interface: Int32, proto: Int32) async -> DNSService? {
        // ResolveService(iisssiu) → (i interface, i protocol, s name, s type, s domain, s host,
        // i aprotocol, s address, q port, aay txt, u flags).
        guard let reply = try? await call(path: "/", interface: Self.server, member: "ResolveService",
                                          [.int32(interface), .int32(proto), .string(service.name), .string(service.type),
                                           .string(service.domain), .int32(proto), .uint32(0)], timeout: Self.resolveTimeout),
              reply.count >= 11, let host = reply[5].text, var address = reply[7].text, let port = reply[8].integer else { return nil }
        let interfaceName = try? await call(path: "/", interface: Self.server, member: "GetNetworkInterfaceNameByIndex", [.int32(interface)]).first?.text
        if address.lowercased().hasPrefix("fe80:"), let interfaceName { address += "%" + interfaceName }
        // avahi-daemon hands the TXT items back in reverse wire order (avahi_string_list_parse prepends).
        let items = (reply[9].elements ?? []).compactMap(\.bytes).reversed()
        let flags = reply[10].integer ?? 0
        return DNSService(service: service, host: host, address: address, port: Int(port), txt: DNSService.txt(fromItems: Array(items)),
                          interface: interfaceName, isLocal: flags & Int64(Self.resultLocal) != 0)
    }

    /// A call to avahi-daemon, with an error that says to start it when it is not on the bus.
    func call(path: String, interface: String, member: String, _ arguments: [DBusValue] = [], timeout: Duration? = nil) async throws -> [DBusValue] {
        do {
            return try await bus.call(destination: Self.service, path: path, interface: interface, member: member, arguments, timeout: timeout)
        } catch let error as TransportError where error.code == "org.freedesktop.DBus.Error.ServiceUnknown" || error.code == "org.freedesktop.DBus.Error.NameHasNoOwner" {
            throw TransportError(.notFound, "avahi-daemon is not running on \(bus.bus): mDNS needs it (`apt install avahi-daemon`, then `systemctl start avahi-daemon`)",
                                 code: error.code)
        } catch let error as TransportError where error.code == "org.freedesktop.Avahi.InvalidServiceTypeError" || error.code == "org.freedesktop.Avahi.InvalidServiceNameError" {
            throw TransportError(.invalidURL, "avahi-daemon refused the service: \(error.message)", code: error.code)
        }
    }
}

/// A service published by ``Avahi/publish(_:port:txt:timeout:)``: it stays on the network until
/// ``withdraw()``, or until the bus connection closes (avahi-daemon then withdraws it itself, so a
/// process that crashes leaves nothing behind). A collision that happens later (another host
/// claims the name) renames it as at first; ``service`` says the name in use.
public final class DNSPublication: Sendable {
    private let group: String
    private let avahi: Avahi
    /// Guards the name in use, and the task that follows the group's state.
    private let state: Locked<(service: DNSServiceName, follower: Task<Void, Never>?)>

    init(service: DNSServiceName, port: Int, txt: [String], group: String, avahi: Avahi, states: AsyncThrowingStream<DBusSignal, any Error>) {
        self.group = group
        self.avahi = avahi
        state = Locked((service, nil))
        let follower = Task { [weak self] in
            do {
                for try await signal in states where signal.values.first?.integer == 3 {
                    guard let self else { return }
                    try await self.rename(port: port, txt: txt)
                }
            } catch {
                // The bus connection ended, or the publication was withdrawn.
            }
        }
        state.withLock { $0.follower = follower }
    }

    /// The service as it is published now.
    public var service: DNSServiceName { state.withLock { $0.service } }

    /// The instance name in use (the one asked for, or the one a collision led to).
    public var name: String { service.name }

    /// Takes the next name after a collision on the network; a name that collides on this host
    /// at once takes the one after it (16 tries, as at first).
    private func rename(port: Int, txt: [String]) async throws {
        let old = service
        var name = try await avahi.alternative(to: old.name)
        _ = try await avahi.call(path: group, interface: Avahi.entryGroup, member: "Reset")
        for attempt in 1...16 {
            do {
                try await avahi.add(name, old, port: port, txt: txt, group: group)
                break
            } catch let error as TransportError where error.code == "org.freedesktop.Avahi.CollisionError" && attempt < 16 {
                name = try await avahi.alternative(to: name)
            }
        }
        state.withLock { $0.service.name = name }
    }

    /// Takes the service off the network (avahi-daemon sends its goodbye packets).
    public func withdraw() async {
        let follower = state.withLock { state in
            defer { state.follower = nil }
            return state.follower
        }
        follower?.cancel()
        _ = try? await avahi.call(path: group, interface: Avahi.entryGroup, member: "Free")
    }

    deinit {
        state.withLock { $0.follower?.cancel() }
    }
}
