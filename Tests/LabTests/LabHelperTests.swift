import Foundation
import TestSupport
import Testing

/// The lab helpers later plugins stand on: the USB Loopback gadget (libusb bulk tests) and BlueZ's
/// D-Bus service (the BLE plugin).
@Suite("lab: helpers for the USB and BlueZ plugins", .serialized, .enabled(if: Lab.isActive, "needs the qemu lab's USB and Bluetooth drivers: run Scripts/lab"))
struct LabHelperTests {
    @Test("usb-loopback plug: a vendor-class interface with a bulk IN and a bulk OUT endpoint appears; unplug removes it")
    func loopbackGadget() async throws {
        let ids = try await Lab.ctl("usb-loopback", "plug").trimmingCharacters(in: .whitespacesAndNewlines)
        #expect(ids == "1d6b:0104")
        let device = try #require(Self.usbDevice(vendor: "1d6b", product: "0104"), "no USB device 1d6b:0104 in /sys/bus/usb/devices")
        let interface = try #require(Self.children(of: device).first { Self.attribute($0, "bInterfaceClass") == "ff" },
                                     "no vendor-specific interface under \(device)")
        let endpoints = Self.children(of: interface).filter { $0.hasPrefix("ep_") }
        let bulk = endpoints.filter { Self.attribute(interface + "/" + $0, "type") == "Bulk" }
        let directions = Set(bulk.compactMap { Self.attribute(interface + "/" + $0, "direction") })
        #expect(directions == ["in", "out"], "bulk endpoints: \(bulk) \(directions)")
        try await Lab.ctl("usb-loopback", "unplug")
        #expect(await eventually(10) { Self.usbDevice(vendor: "1d6b", product: "0104") == nil })
    }

    @Test("bluez-start: bluetoothd owns org.bluez on the system bus and shows both adapters")
    func bluezOnDBus() async throws {
        try await Lab.ctl("bt-up")
        try await Lab.ctl("bluez-start")
        let tree = try await Lab.run("/usr/bin/busctl", ["--system", "tree", "org.bluez"])
        #expect(tree.status == 0, "\(tree.stderr)")
        #expect(tree.stdout.contains("/org/bluez/hci0") && tree.stdout.contains("/org/bluez/hci1"), "\(tree.stdout)")
    }

    static func usbDevice(vendor: String, product: String) -> String? {
        let root = "/sys/bus/usb/devices"
        let entries = (try? FileManager.default.contentsOfDirectory(atPath: root)) ?? []
        return entries.map { root + "/" + $0 }.first { attribute($0, "idVendor") == vendor && attribute($0, "idProduct") == product }
    }

    static func children(of path: String) -> [String] {
        ((try? FileManager.default.contentsOfDirectory(atPath: path)) ?? []).map { $0.hasPrefix("ep_") ? $0 : path + "/" + $0 }
    }

    static func attribute(_ path: String, _ name: String) -> String? {
        (try? String(contentsOfFile: path + "/" + name, encoding: .utf8))?.trimmingCharacters(in: .whitespacesAndNewlines)
    }
}
