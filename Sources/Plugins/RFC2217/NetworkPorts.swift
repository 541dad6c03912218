// NetworkPorts.swift: serial ports on the network, found and announced through DNS-SD over
// multicast DNS (RFC 6763; avahi-daemon, Avahi.swift). The announced type is IANA's
// "telnetcpcd" (3696/tcp, Telnet Com Port Control); ser2net's `_iostream._tcp` and pyserial's
// port_publisher `_serial_port._tcp` are browsed too.

import Synchronization
@_spi(Plugins) import TransportKitCore
import TransportKitDBus

/// Serial ports other machines share, found through DNS-SD, and the announcement of ours.
///
/// ```swift
/// for port in try await RFC2217Plugin().networkPorts().devices {
///     print(port.url, port.name ?? "")        // rfc2217://192.168.1.20:2217  Bench port
/// }
/// ```
public enum NetworkPorts {
    /// The type TransportKit announces an RFC 2217 port as.
    public static let announcedType = "_telnetcpcd._tcp"
    /// The types browsed: TransportKit's (and every `_telnetcpcd` server's), ser2net's default
    /// (its TXT `gensiostack` says which protocols it speaks), pyserial's port_publisher.
    public static let browsedTypes = ["_telnetcpcd._tcp", "_iostream._tcp", "_serial_port._tcp"]

    /// The device a service found on the network is: a URL that connects to it (`rfc2217://`, or
    /// `tcp://` for a ser2net port of raw bytes, with `tls+` when ser2net adds TLS), its name, and
    /// the USB attributes its TXT record carries (ser2net's `mdns-sysattrs` names, which TransportKit
    /// uses too). Nil for a protocol stack TransportKit cannot speak (UDP, SCTP).
    public static func record(for found: DNSService) -> DeviceRecord? {
        // TransportKit's own announcements say tls=1 for RFC 2217 over TLS.
        var scheme = found.txt["tls"] == "1" ? "tls+rfc2217" : "rfc2217"
        if found.service.type == "_iostream._tcp" {
            // ser2net's gensio stack, outermost first, each with its options: "telnet(rfc2217),tcp",
            // "tcp", "telnet(rfc2217),ssl(CA=…),tcp".
            let stack = gensioStack(found.txt["gensiostack"] ?? "telnet,tcp")
            guard stack.last == "tcp", stack.dropLast().allSatisfy({ $0 == "telnet" || $0 == "ssl" }) else { return nil }
            scheme = (stack.contains("ssl") ? "tls+" : "") + (stack.contains("telnet") ? "rfc2217" : "tcp")
        }
        var properties = ["host": found.host, "address": found.address, "port": String(found.port), "serviceType": found.service.type]
        for (key, value) in found.txt { properties["txt." + key] = value }
        if let interface = found.interface { properties["interface"] = interface }
        if found.isLocal { properties["local"] = "true" }
        // Through the URL model: an IPv6 address in brackets, its zone as RFC 6874 writes it (%25).
        let tls = scheme.hasPrefix("tls+")
        let bottom = TransportURL(scheme: tls ? String(scheme.dropFirst(4)) : scheme, host: found.address, port: found.port)
        let url = (tls ? TransportURL(scheme: "tls", inner: bottom) : bottom).description
        return DeviceRecord(url: url, scheme: scheme.hasSuffix("rfc2217") ? "rfc2217" : "tcp",
                            devnode: nil, name: found.service.name,
                            vendorId: found.txt["idVendor"], productId: found.txt["idProduct"], serialNumber: found.txt["serial"],
                            manufacturer: found.txt["manufacturer"], product: found.txt["product"],
                            location: "\(found.host):\(found.port)", properties: properties)
    }

    /// The names of a gensio stack's layers ("telnet(rfc2217),tcp" → ["telnet", "tcp"]): split at
    /// the commas outside parentheses, options dropped.
    static func gensioStack(_ text: String) -> [String] {
        var layers: [String] = []
        var current = ""
        var depth = 0
        for character in text {
            switch character {
            case "(": depth += 1
            case ")": depth = max(depth - 1, 0)
            case "," where depth == 0:
                layers.append(current)
                current = ""
            default:
                if depth == 0 && character != " " { current.append(character) }
            }
        }
        layers.append(current)
        return layers
    }

    /// The TXT record TransportKit announces a port with: `txtvers=1`, `protocol=rfc2217`,
    /// `provider=transportkit`, `tls=1` for a server that runs RFC 2217 over TLS, and for a known
    /// device its node (`path`) and, on USB, ser2net's `mdns-sysattrs` keys (`devicetype`,
    /// `idVendor`, `idProduct`, `serial`, `manufacturer`, `product`).
    public static func txt(for device: DeviceRecord?, tls: Bool = false) -> [String] {
        var items = ["txtvers=1", "protocol=rfc2217", "provider=transportkit"] + (tls ? ["tls=1"] : [])
        guard let device else { return items }
        if let devnode = device.devnode { items.append("path=\(devnode)") }
        items.append("devicetype=\(device.vendorId == nil ? "serial" : "serialusb")")
        let usb: [(String, String?)] = [("idVendor", device.vendorId), ("idProduct", device.productId), ("serial", device.serialNumber),
                                         ("manufacturer", device.manufacturer), ("product", device.product)]
        // A TXT item is at most 255 bytes (RFC 6763 §6.1); longer values are left out.
        items += usb.compactMap { key, value in value.map { "\(key)=\($0)" } }.filter { $0.utf8.count <= 255 }
        return items
    }
}

/// What ``RFC2217Plugin/networkPorts(bus:waiting:)`` found.
public struct NetworkPortListing: Sendable {
    /// The ports, each with a URL ready to connect.
    public var devices: [DeviceRecord]
    /// `false` when the wait ended before avahi-daemon had reported everything it knew (a host
    /// that does not answer its resolve holds the listing up): there may be more.
    public var complete: Bool
}

/// A port announced on the network by ``RFC2217Plugin/announce(port:name:device:tls:bus:)``: it stays
/// announced until ``withdraw()`` or until the process ends (avahi-daemon then withdraws it).
public final class NetworkAnnouncement: Sendable {
    private let publication: DNSPublication
    private let bus: DBusConnection

    init(publication: DNSPublication, bus: DBusConnection) {
        self.publication = publication
        self.bus = bus
    }

    /// The instance name in use: the one asked for, or `"name #2"` after a collision.
    public var name: String { publication.name }

    /// The DNS-SD type and domain it is announced under.
    public var service: DNSServiceName { publication.service }

    /// Takes the announcement off the network (goodbye packets) and closes the bus connection.
    public func withdraw() async {
        await publication.withdraw()
        await bus.close()
    }
}

extension RFC2217Plugin {
    /// Announces an RFC 2217 server on `port` as `name` (type ``NetworkPorts/announcedType``;
    /// `tls`: it runs over TLS), through avahi-daemon on the system bus (or `bus`); returns once
    /// announced on the network.
    ///
    /// ```swift
    /// let announcement = try await RFC2217Plugin().announce(port: 2217, name: "Bench port", device: nil)
    /// print(announcement.name)
    /// ```
    ///
    /// - Throws: `TransportError` `.notFound` when there is no system bus or no avahi-daemon on
    ///   it, `.invalidURL` for a name avahi refuses, `.timedOut` when probing does not end.
    public func announce(port: Int, name: String, device: DeviceRecord?, tls: Bool = false, bus: DBusConnection.Bus = .system) async throws -> NetworkAnnouncement {
        let connection = try DBusConnection(bus)
        do {
            let publication = try await Avahi(bus: connection).publish(DNSServiceName(name: name, type: NetworkPorts.announcedType),
                                                                       port: port, txt: NetworkPorts.txt(for: device, tls: tls))
            return NetworkAnnouncement(publication: publication, bus: connection)
        } catch {
            await connection.close()
            throw error
        }
    }

    /// The serial ports shared on the network now: browses ``NetworkPorts/browsedTypes`` until
    /// avahi-daemon has reported what it knows (or `limit` passes: then what was found so far,
    /// with ``NetworkPortListing/complete`` false), each with a URL ready to connect. Services
    /// are resolved one at a time; one whose host does not answer holds the rest up to 5 s.
    ///
    /// - Throws: `TransportError` `.notFound` when there is no system bus or no avahi-daemon on it.
    public func networkPorts(bus: DBusConnection.Bus = .system, waiting limit: Duration = .seconds(8)) async throws -> NetworkPortListing {
        let connection = try DBusConnection(bus)
        let found = Found()
        let incomplete = "org.transportkit.ListingIncomplete"
        var complete = true
        do {
            try await withDeadline(.now + limit, TransportError(.timedOut, "avahi-daemon did not finish its listing in time", code: incomplete)) {
                for try await event in try await Avahi(bus: connection).browse(types: NetworkPorts.browsedTypes) {
                    switch event {
                    case .found(let service):
                        if let record = NetworkPorts.record(for: service) { found.records.withLock { $0[service.service] = record } }
                    case .removed(let service):
                        _ = found.records.withLock { $0.removeValue(forKey: service) }
                    case .allForNow:
                        return
                    }
                }
            }
        } catch let error as TransportError where error.code == incomplete {
            // avahi-daemon did not say "all for now" in time: what was found so far is the answer.
            complete = false
        } catch {
            await connection.close()
            throw error
        }
        await connection.close()
        let devices = found.records.withLock { $0.values.sorted { ($0.name ?? "", $0.url) < ($1.name ?? "", $1.url) } }
        return NetworkPortListing(devices: devices, complete: complete)
    }

    /// The records found by ``networkPorts(bus:waiting:)`` so far.
    private final class Found: Sendable {
        /// Guards the records, written by the browsing task and read once it ended or timed out.
        let records = Locked<[DNSServiceName: DeviceRecord]>([:])
    }

    /// Serial ports appearing on the network and leaving it, as device events (`.added` once
    /// resolved, `.removed` when it said goodbye or expired), until the iteration ends. Returns
    /// once browsing: a port that appears after this returns is reported (those already there are
    /// reported first, as added).
    ///
    /// ```swift
    /// for try await event in try await RFC2217Plugin().networkPortEvents() { print(event.action, event.device.url) }
    /// ```
    ///
    /// - Throws: `TransportError` `.notFound` when there is no system bus or no avahi-daemon on it;
    ///   the sequence ends with an error when the bus connection or avahi-daemon goes away.
    public func networkPortEvents(bus: DBusConnection.Bus = .system) async throws -> AsyncThrowingStream<DeviceEvent, any Error> {
        let connection = try DBusConnection(bus)
        let browse: AsyncThrowingStream<DNSServiceEvent, any Error>
        do {
            browse = try await Avahi(bus: connection).browse(types: NetworkPorts.browsedTypes)
        } catch {
            await connection.close()
            throw error
        }
        let (events, continuation) = AsyncThrowingStream<DeviceEvent, any Error>.makeStream(bufferingPolicy: .bufferingOldest(4096))
        let task = Task {
            var records: [DNSServiceName: DeviceRecord] = [:]
            do {
                for try await event in browse {
                    let outgoing: DeviceEvent?
                    switch event {
                    case .found(let service):
                        records[service.service] = NetworkPorts.record(for: service)
                        outgoing = records[service.service].map { DeviceEvent(.added, $0) }
                    case .removed(let service):
                        outgoing = records.removeValue(forKey: service).map { DeviceEvent(.removed, $0) }
                    case .allForNow:
                        outgoing = nil
                    }
                    if let outgoing, case .dropped = continuation.yield(outgoing) {
                        throw TransportError(.io, "the reader of network port events fell 4,096 events behind; list again")
                    }
                }
                continuation.finish()
            } catch is CancellationError {
                continuation.finish()
            } catch {
                continuation.finish(throwing: error)
            }
            await connection.close()
        }
        continuation.onTermination = { _ in task.cancel() }
        return events
    }

}
