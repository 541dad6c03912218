import Synchronization
import Testing
import TransportKit
import TransportKitDBus
@testable import TransportKitBluetooth
@_spi(Plugins) import TransportKitCore

/// A scan's events while the application does not read (BluetoothScanEvents): bounded by devices,
/// not by advertisements, and in an order that still tells the truth.
@Suite("Bluetooth scan events for a slow reader")
struct ScanEventsTests {
    static func device(_ address: String, rssi: Int) -> BluetoothDiscovery {
        BluetoothDiscovery(address: address, addressType: "public", name: nil, rssi: rssi, serviceUUIDs: [], manufacturerData: [:],
                           serviceData: [:], adapter: "hci0", url: "ble://SERVICE/\(address)?adapter=hci0")
    }

    static func summary(_ event: BluetoothScan.Event) -> String {
        switch event {
        case .discovered(let device): "discovered \(device.address) \(device.rssi ?? 0)"
        case .updated(let device): "updated \(device.address) \(device.rssi ?? 0)"
        case .expired(let device): "expired \(device.address)"
        }
    }

    @Test func aDevicesNewestUnreadUpdateReplacesTheOneBeforeAndNothingElseIsLost() async throws {
        let events = BluetoothScanEvents()
        let feed = events.feed
        feed.yield(.discovered(Self.device("A", rssi: -50)))
        for rssi in -60 ... -51 { feed.yield(.updated(Self.device("A", rssi: rssi))) }
        feed.yield(.discovered(Self.device("B", rssi: -70)))
        feed.yield(.updated(Self.device("B", rssi: -71)))
        feed.yield(.updated(Self.device("A", rssi: -40)))
        feed.yield(.expired(Self.device("B", rssi: -71)))
        feed.yield(.discovered(Self.device("B", rssi: -65)))
        feed.yield(.updated(Self.device("B", rssi: -64)))
        feed.finish(nil)
        var received: [String] = []
        for try await event in events { received.append(Self.summary(event)) }
        #expect(received == ["discovered A -50", "updated A -40", "discovered B -70", "updated B -71", "expired B", "discovered B -65", "updated B -64"],
                "\(received)")
    }

    @Test func aFailureComesAfterTheQueuedEventsAndDroppingTheSequenceStopsTheScan() async throws {
        let stopped = Locked(false)
        func scanAndDrop() async throws {
            let events = BluetoothScanEvents()
            events.feed.onTermination { stopped.withLock { $0 = true } }
            var iterator = events.makeAsyncIterator()
            events.feed.yield(.discovered(Self.device("A", rssi: -50)))
            #expect(try await iterator.next().map(Self.summary) == "discovered A -50")
            withExtendedLifetime(events) { #expect(!stopped.withLock { $0 }) }
        }
        try await scanAndDrop()
        #expect(stopped.withLock { $0 }, "the sequence and its iterator were dropped: the scan was told to stop")

        let failing = BluetoothScanEvents()
        failing.feed.yield(.discovered(Self.device("C", rssi: -30)))
        failing.feed.finish(TransportError(.unsupported, "adapter powered off"))
        var iterator = failing.makeAsyncIterator()
        #expect(try await iterator.next().map(Self.summary) == "discovered C -30")
        await #expect(throws: TransportError.self) { _ = try await iterator.next() }
    }

    @Test func cancellingTheReaderEndsTheSequence() async throws {
        let events = BluetoothScanEvents()
        let reader = Task { () -> Int in
            var count = 0
            for try await _ in events { count += 1 }
            return count
        }
        events.feed.yield(.discovered(Self.device("A", rssi: -50)))
        try await Task.sleep(for: .milliseconds(100))
        reader.cancel()
        #expect(try await reader.value == 1, "the reader's loop ended when its task was cancelled")
    }
}

@Suite("BlueZ: the adapters from /org/bluez's introspection")
struct BlueZIntrospectionTests {
    @Test func childNodesAreTheNamesOfTheNodesBelow() {
        let xml = """
            <!DOCTYPE node PUBLIC "-//freedesktop//DTD D-BUS Object Introspection 1.0//EN" "http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd">
            <node><interface name="org.bluez.AgentManager1"><method name="RegisterAgent"><arg name="agent" type="o" direction="in"/></method></interface>
            <node name="hci0"/><node name="hci1"/></node>
            """
        #expect(BlueZ.childNodes(inIntrospection: xml) == ["hci0", "hci1"])
        #expect(BlueZ.childNodes(inIntrospection: "<node></node>").isEmpty)
        #expect(BlueZ.childNodes(inIntrospection: "<node name=\"hci0") .isEmpty, "an unterminated name is not a node")
    }
}

@Suite("The GATT serial peripheral's application objects")
struct GattServerObjectsTests {
    @Test func twoCharacteristicsForNUSAndOneBothWaysForHM10() {
        let nus = BluetoothUUID.serialServices["nus"]
        let hm10 = BluetoothUUID.serialServices["hm10"]
        let two = GattServerListener.objects(root: "/a", service: nus?.service ?? "", notify: nus?.rx ?? "", write: nus?.tx ?? "")
        #expect(Set(two.keys) == ["/a/service0", "/a/service0/char0", "/a/service0/char1"])
        #expect(two["/a/service0/char0"]?["org.bluez.GattCharacteristic1"]?["Flags"]?.strings == ["notify"])
        #expect(two["/a/service0/char1"]?["org.bluez.GattCharacteristic1"]?["Flags"]?.strings == ["write", "write-without-response"])
        #expect(two["/a/service0/char1"]?["org.bluez.GattCharacteristic1"]?["UUID"]?.text == "6e400002-b5a3-f393-e0a9-e50e24dcca9e",
                "the central writes NUS's RX")
        #expect(GattServerListener.writePath("/a", sameCharacteristic: false) == "/a/service0/char1")
        let one = GattServerListener.objects(root: "/b", service: hm10?.service ?? "", notify: hm10?.rx ?? "", write: hm10?.tx ?? "")
        #expect(Set(one.keys) == ["/b/service0", "/b/service0/char0"])
        #expect(one["/b/service0/char0"]?["org.bluez.GattCharacteristic1"]?["Flags"]?.strings == ["write", "write-without-response", "notify"])
        // security=medium and high: a central pairs before it writes or subscribes.
        let medium = GattServerListener.objects(root: "/c", service: hm10?.service ?? "", notify: hm10?.rx ?? "", write: hm10?.tx ?? "", security: .medium)
        #expect(medium["/c/service0/char0"]?["org.bluez.GattCharacteristic1"]?["Flags"]?.strings
                == ["write", "write-without-response", "encrypt-write", "notify", "encrypt-notify"])
        let high = GattServerListener.objects(root: "/d", service: nus?.service ?? "", notify: nus?.rx ?? "", write: nus?.tx ?? "", security: .high)
        #expect(high["/d/service0/char0"]?["org.bluez.GattCharacteristic1"]?["Flags"]?.strings == ["notify", "encrypt-authenticated-notify"])
        #expect(GattServerListener.writePath("/b", sameCharacteristic: true) == GattServerListener.notifyPath("/b"))
    }
}
