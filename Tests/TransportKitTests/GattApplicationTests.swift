import Synchronization
import Testing
import TransportKit
@testable import TransportKitDBus
@testable import TransportKitBluetooth
@_spi(Plugins) import TransportKitCore

/// What a GATTServer publishes and how it answers bluetoothd's calls, without bluetoothd: the
/// object tree, the flags per security level, reads cut at their offset, long writes assembled,
/// handlers' failures as the D-Bus errors bluetoothd turns into ATT errors. The lab's
/// GattServerLabTests run the same through bluetoothd with a central.
@Suite("GATT server definitions and answers")
struct GattApplicationTests {
    static let characteristic = "org.bluez.GattCharacteristic1"

    static func call(_ path: String, _ member: String, _ arguments: [DBusValue], interface: String = characteristic) -> DBusMethodCall {
        DBusMethodCall(sender: ":1.1", path: path, interface: interface, member: member, arguments: arguments)
    }

    static func replyBytes(_ result: DBusMethodResult) -> [UInt8]? {
        guard case .reply(let values) = result else { return nil }
        return values.first?.bytes
    }

    static func errorName(_ result: DBusMethodResult) -> String? {
        guard case .error(let name, _) = result else { return nil }
        return name
    }

    @Test func theObjectTreeHasEveryAttributeWithBlueZsFlags() throws {
        let core = try GATTServer.Core(services: [
            GATTServer.Service(uuid: "180F", characteristics: [
                GATTServer.Characteristic(uuid: "2a19", properties: [.read, .notify], descriptors: [.userDescription("level")], value: [87]),
            ]),
            GATTServer.Service(uuid: "a0c1e000-7b2d-4a0e-9d4c-5e7a1b2c3d40", characteristics: [
                GATTServer.Characteristic(uuid: "a0c1e001-7b2d-4a0e-9d4c-5e7a1b2c3d40", properties: [.read, .write, .writeWithoutResponse, .indicate],
                                          security: .encrypted),
            ]),
        ], root: "/t")
        #expect(Set(core.objects.keys) == ["/t/service0", "/t/service0/char0", "/t/service0/char0/desc0", "/t/service1", "/t/service1/char0"])
        #expect(core.objects["/t/service0"]?["org.bluez.GattService1"]?["UUID"]?.text == "0000180f-0000-1000-8000-00805f9b34fb")
        #expect(core.objects["/t/service0/char0"]?[Self.characteristic]?["Flags"]?.strings == ["read", "notify"])
        #expect(core.objects["/t/service1/char0"]?[Self.characteristic]?["Flags"]?.strings
                == ["encrypt-read", "write", "write-without-response", "encrypt-write", "indicate", "encrypt-indicate"])
        #expect(core.objects["/t/service0/char0/desc0"]?["org.bluez.GattDescriptor1"]?["Characteristic"] == .objectPath("/t/service0/char0"))
        #expect(GATTServer.Core.flags([.read], .authenticated) == ["encrypt-authenticated-read"])
        #expect(GATTServer.Core.flags([.write], .secure) == ["write", "secure-write"])
        // The tree is what GetManagedObjects answers.
        guard case .reply(let managed)? = BlueZ.serve(Self.call("/t", "GetManagedObjects", [], interface: "org.freedesktop.DBus.ObjectManager"), from: core.objects) else {
            Issue.record("GetManagedObjects not answered")
            return
        }
        #expect(managed.first?.elements?.count == 5)
    }

    @Test func definitionsBluetoothdWouldRefuseAreRefusedFirst() {
        func refused(_ services: [GATTServer.Service], saying text: String) {
            do {
                _ = try GATTServer.Core(services: services, root: "/t")
                Issue.record("accepted; expected a refusal saying \(text)")
            } catch let error as TransportError {
                #expect(error.kind == .misuse && error.message.contains(text), "\(error)")
            } catch {
                Issue.record(error)
            }
        }
        refused([], saying: "at least one service")
        refused([GATTServer.Service(uuid: "xyz", characteristics: [])], saying: "'xyz' is not a UUID")
        refused([GATTServer.Service(uuid: "180f", characteristics: [GATTServer.Characteristic(uuid: "2a19", properties: [])])], saying: "has no properties")
        refused([GATTServer.Service(uuid: "180f", characteristics: [GATTServer.Characteristic(uuid: "2a19", properties: .read, value: Array(repeating: 0, count: 513))])],
                saying: "at most 512 bytes")
        refused([GATTServer.Service(uuid: "180f", characteristics: [
            GATTServer.Characteristic(uuid: "2a19", properties: .notify, descriptors: [GATTServer.Descriptor(uuid: "2902", value: [0, 0])]),
        ])], saying: "adds descriptor 2902 itself")
        do {
            _ = try GATTServer.Core(services: [GATTServer.Service(uuid: "180f", characteristics: [
                GATTServer.Characteristic(uuid: "2a19", properties: .writeWithoutResponse, security: .encrypted),
            ])], root: "/t")
            Issue.record("secured writes without response alone were accepted")
        } catch let error as TransportError {
            #expect(error.kind == .unsupported && error.message.contains("cannot secure writes without response alone"), "\(error)")
        } catch {
            Issue.record(error)
        }
        // An application error outside ATT's range is not sent as another code.
        guard case .error(let name, _) = GATTServer.Failure.application(0x05).dbusError else {
            Issue.record("no error for an out-of-range application code")
            return
        }
        #expect(name == "org.transportkit.Error.Unlikely")
    }

    @Test func readsAreCutAtTheirOffsetAndHandlersAnswerInOrder() async throws {
        let reads = Locked<[GATTServer.ReadRequest]>([])
        let long = (0..<300).map { UInt8(truncatingIfNeeded: $0) }
        let core = try GATTServer.Core(services: [GATTServer.Service(uuid: "180f", characteristics: [
            GATTServer.Characteristic(uuid: "2a19", properties: .read, onRead: { request in
                reads.withLock { $0.append(request) }
                return long
            }),
            GATTServer.Characteristic(uuid: "2a1a", properties: .read, value: [1, 2, 3]),
        ])], root: "/t")
        let options: DBusValue = .dictionary(["offset": .uint16(22), "mtu": .uint16(23), "device": .objectPath("/org/bluez/hci1/dev_00_AA_01_00_00_23")])
        #expect(Self.replyBytes(await core.answer(Self.call("/t/service0/char0", "ReadValue", [options]))) == Array(long[22...]))
        #expect(reads.withLock { $0 } == [GATTServer.ReadRequest(characteristic: "00002a19-0000-1000-8000-00805f9b34fb", offset: 22, attMTU: 23,
                                                                  central: "00:AA:01:00:00:23")])
        #expect(Self.replyBytes(await core.answer(Self.call("/t/service0/char1", "ReadValue", [.dictionary([:])]))) == [1, 2, 3])
        #expect(Self.replyBytes(await core.answer(Self.call("/t/service0/char1", "ReadValue", [.dictionary(["offset": .uint16(3)])]))) == [],
                "an offset at the end reads nothing")
        #expect(Self.errorName(await core.answer(Self.call("/t/service0/char1", "ReadValue", [.dictionary(["offset": .uint16(4)])])))
                == "org.bluez.Error.InvalidOffset")
        // Not ours: left to the bus's UnknownMethod.
        guard case .notHandled = await core.answer(Self.call("/t/service0/char9", "ReadValue", [.dictionary([:])])) else {
            Issue.record("a call to no attribute was answered")
            return
        }
    }

    @Test func writesAreStoredAssembledAndHandlersMayRefuseThem() async throws {
        let writes = Locked<[GATTServer.WriteRequest]>([])
        let core = try GATTServer.Core(services: [GATTServer.Service(uuid: "180f", characteristics: [
            GATTServer.Characteristic(uuid: "2a19", properties: [.write, .writeWithoutResponse], onWrite: { request in
                writes.withLock { $0.append(request) }
                if request.value == [0xff] { throw GATTServer.Failure.application(0x85) }
                if request.value == [0xfe] { throw TransportError(.io, "the app failed") }
            }),
        ])], root: "/t")
        let path = "/t/service0/char0"
        let first = Array(repeating: UInt8(1), count: 18), second = Array(repeating: UInt8(2), count: 18)
        guard case .reply(let written) = await core.answer(Self.call(path, "WriteValue", [.bytes(first), .dictionary(["offset": .uint16(0)])])), written.isEmpty else {
            Issue.record("a write was not answered with an empty reply")
            return
        }
        _ = await core.answer(Self.call(path, "WriteValue", [.bytes(second), .dictionary(["offset": .uint16(18)])]))
        #expect(core.values.withLock { $0[path] } == first + second, "a long write's parts are assembled")
        _ = await core.answer(Self.call(path, "WriteValue", [.bytes([7]), .dictionary([:])]))
        #expect(core.values.withLock { $0[path] } == [7])
        #expect(writes.withLock { $0.map(\.offset) } == [0, 18, 0])

        guard case .error(let name, let message) = await core.answer(Self.call(path, "WriteValue", [.bytes([0xff]), .dictionary([:])])) else {
            Issue.record("a refused write was answered")
            return
        }
        #expect(name == "org.bluez.Error.Failed" && message == "0x85", "bluetoothd sends ATT error 0x85")
        #expect(Self.errorName(await core.answer(Self.call(path, "WriteValue", [.bytes([0xfe]), .dictionary([:])]))) == "org.transportkit.Error.Unlikely")
        #expect(core.values.withLock { $0[path] } == [7], "refused writes are not stored")
        let handled = writes.withLock { $0.count }
        #expect(Self.errorName(await core.answer(Self.call(path, "WriteValue", [.bytes([1]), .dictionary(["offset": .uint16(5)])]))) == "org.bluez.Error.InvalidOffset")
        #expect(writes.withLock { $0.count } == handled, "a write refused for its offset reaches no handler")
        #expect(Self.errorName(await core.answer(Self.call(path, "WriteValue", [.bytes(Array(repeating: 0, count: 513)), .dictionary([:])])))
                == "org.bluez.Error.InvalidValueLength")
    }

    @Test func descriptorsAndSubscriptionsAndFindingCharacteristics() async throws {
        let core = try GATTServer.Core(services: [GATTServer.Service(uuid: "180f", characteristics: [
            GATTServer.Characteristic(uuid: "2a19", properties: [.read, .notify], descriptors: [
                .userDescription("level"), GATTServer.Descriptor(uuid: "a0c1e0ff-7b2d-4a0e-9d4c-5e7a1b2c3d40", value: [0], writable: true),
            ]),
            GATTServer.Characteristic(uuid: "2a1a", properties: .read),
        ])], root: "/t")
        let events = core.events.subscribe()
        let descriptor = "org.bluez.GattDescriptor1"
        #expect(Self.replyBytes(await core.answer(Self.call("/t/service0/char0/desc0", "ReadValue", [.dictionary([:])], interface: descriptor))) == Array("level".utf8))
        #expect(Self.errorName(await core.answer(Self.call("/t/service0/char0/desc0", "WriteValue", [.bytes([1]), .dictionary([:])], interface: descriptor)))
                == "org.bluez.Error.NotPermitted")
        _ = await core.answer(Self.call("/t/service0/char0/desc1", "WriteValue", [.bytes([5]), .dictionary([:])], interface: descriptor))
        #expect(core.values.withLock { $0["/t/service0/char0/desc1"] } == [5])

        _ = await core.answer(Self.call("/t/service0/char0", "StartNotify", []))
        _ = await core.answer(Self.call("/t/service0/char0", "Confirm", []))
        _ = await core.answer(Self.call("/t/service0/char0", "StopNotify", []))
        core.events.finish(with: .stopped(reason: "closed"))
        var seen: [GATTServer.Event] = []
        for await event in events { seen.append(event) }
        let level = "00002a19-0000-1000-8000-00805f9b34fb"
        #expect(seen == [.subscribed(characteristic: level), .indicationConfirmed(characteristic: level), .unsubscribed(characteristic: level),
                         .stopped(reason: "closed")])
        var late: [GATTServer.Event] = []
        for await event in core.events.subscribe() { late.append(event) }
        #expect(late == [.stopped(reason: "closed")], "a sequence taken after the end gets the last event")

        #expect(throws: TransportError.self) { try core.store([1], characteristic: "2a1a", service: nil, notifying: true) }
        do {
            _ = try core.find("2a00", service: nil)
            Issue.record("a characteristic the server does not have was found")
        } catch let error as TransportError {
            #expect(error.kind == .notFound && error.message.contains("180f/2a19, 180f/2a1a"), "\(error)")
        }
        #expect(throws: TransportError.self) { try core.store(Array(repeating: 0, count: 513), characteristic: "2a19", service: nil, notifying: true) }
    }

    /// The server follows bluetoothd's signals: a central new to bluetoothd arrives as an
    /// InterfacesAdded that is already connected (seen in the lab's full run, after earlier tests
    /// had forgotten every device), a known one as PropertiesChanged; the adapter's removal
    /// (with Adapter1 among the interfaces) stops the server, another interface's does not.
    @Test func centralsComingAndGoingAndTheAdapterLeavingAreEvents() async throws {
        let core = try GATTServer.Core(services: [GATTServer.Service(uuid: "180f", characteristics: [
            GATTServer.Characteristic(uuid: "2a19", properties: .read),
        ])], root: "/t")
        let adapter = BluetoothAdapter(path: "/org/bluez/hci1", name: "hci1", index: 1, address: "00:AA:01:01:00:01", alias: nil, powered: true,
                                       discoverable: false, discovering: false)
        let central = "/org/bluez/hci1/dev_00_AA_01_00_00_00"
        func signal(_ path: String, _ interface: String, _ member: String, _ values: [DBusValue]) -> DBusSignal {
            DBusSignal(sender: ":1.2", path: path, interface: interface, member: member, values: values)
        }
        let objectManager = "org.freedesktop.DBus.ObjectManager", properties = "org.freedesktop.DBus.Properties"
        let (signals, feed) = AsyncThrowingStream<DBusSignal, any Error>.makeStream()
        for item in [
            signal("/", objectManager, "InterfacesAdded", [.objectPath(central), .array(element: "{sa{sv}}", [
                .dictEntry(.string("org.bluez.Device1"), .dictionary(["Connected": .variant(.bool(true))])),
            ])]),
            signal(central, properties, "PropertiesChanged", [.string("org.bluez.Device1"), .dictionary(["Connected": .variant(.bool(false))]), .array(element: "s", [])]),
            signal(central, properties, "PropertiesChanged", [.string("org.bluez.Device1"), .dictionary(["Connected": .variant(.bool(true))]), .array(element: "s", [])]),
            signal("/", objectManager, "InterfacesRemoved", [.objectPath(adapter.path), .array(element: "s", [.string("org.bluez.GattManager1")])]),
            signal("/", objectManager, "InterfacesRemoved", [.objectPath(adapter.path), .array(element: "s", [.string("org.bluez.Adapter1")])]),
        ] { feed.yield(item) }
        let events = core.events.subscribe()
        await core.follow(signals, adapter: adapter)
        var seen: [GATTServer.Event] = []
        for await event in events { seen.append(event) }
        #expect(seen == [.centralConnected(address: "00:AA:01:00:00:00"), .centralDisconnected(address: "00:AA:01:00:00:00"),
                         .centralConnected(address: "00:AA:01:00:00:00"), .stopped(reason: "adapter hci1 went away")])
    }

    @Test func advertisingDataIsCheckedBeforeBluetoothdSeesIt() throws {
        var advertising = BluetoothAdvertising(localName: "TK", serviceUUIDs: ["180f"], manufacturerData: [0xffff: [1, 2]], appearance: 0x0340)
        let properties = try advertising.properties()
        #expect(properties["Type"]?.text == "peripheral" && properties["LocalName"]?.text == "TK" && properties["Appearance"] == .uint16(0x0340))
        #expect(properties["ManufacturerData"] == .array(element: "{qv}", [.dictEntry(.uint16(0xffff), .variant(.bytes([1, 2])))]))
        #expect(advertising.estimatedLength == 3 + 4 + 6 + 4, "the name goes in the scan response")
        #expect(properties["Discoverable"] == .bool(true))
        advertising.connectable = false
        #expect(try advertising.properties()["Type"]?.text == "broadcast")
        #expect(try advertising.properties()["Discoverable"] == nil, "a broadcast carries no flags: bluetoothd refuses Discoverable on one")
        advertising.interval = .milliseconds(10) ... .milliseconds(100)
        #expect(throws: TransportError.self) { try advertising.properties() }
        advertising.interval = .milliseconds(100) ... .milliseconds(200)
        #expect(try advertising.properties()["MinInterval"] == .uint32(100))
    }
}
