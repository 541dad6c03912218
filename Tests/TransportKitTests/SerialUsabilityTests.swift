import Foundation
import Glibc
import SystemPackage
import TestSupport
import Testing
@testable import TransportKit
@testable import TransportKitBluetooth
@_spi(Plugins) import TransportKitLinux
@testable import TransportKitSerial

/// What a new user tripped on (issue 30, part 7): values that print as they read, a pty's peer
/// path as a property, errors that fit the call and the machine, and the pyserial features a
/// local port has (bytes waiting, break on and off, RS-485).
@Suite("values print as they read")
struct DescriptionTests {
    @Test("serial settings print as the URL options read")
    func serialSettings() {
        #expect(SerialSettings(baudRate: 115_200).description == "115200 8N1, flow none")
        #expect("\(SerialSettings(baudRate: 9600, dataBits: 7, parity: .even, stopBits: 2, flowControl: .rtscts))" == "9600 7E2, flow rtscts")
        #expect(SerialSettings(baudRate: 250_000, parity: .mark, flowControl: .xonxoff).description == "250000 8M1, flow xonxoff")
        #expect(SerialSettings(parity: .space).description == "9600 8S1, flow none")
        // The summary, as traces and messages use it, is unchanged.
        #expect(SerialSettings(baudRate: 9600, dataBits: 7, parity: .even, stopBits: 2, flowControl: .rtscts).summary == "9600 7E2 rtscts")
        #expect(SerialSettings(baudRate: 115_200).summary == "115200 8N1")
    }

    @Test("a device record prints its URL, then what `transportkit list` shows of it")
    func deviceRecord() {
        let adapter = DeviceRecord(url: "tty://usb/0403:6001?serial=A50285BI", scheme: "tty", devnode: "/dev/ttyUSB0", name: "ttyUSB0",
                                   vendorId: "0403", productId: "6001", serialNumber: "A50285BI", manufacturer: "FTDI",
                                   product: "FT232R USB UART", driver: "ftdi_sio")
        #expect(adapter.description == "tty://usb/0403:6001?serial=A50285BI (/dev/ttyUSB0, FTDI FT232R USB UART, serial A50285BI, driver ftdi_sio)")
        let byID = DeviceRecord(url: "tty:///dev/serial/by-id/usb-FTDI_FT232R_A123-if00-port0", scheme: "tty", devnode: "/dev/ttyUSB1",
                                vendorId: "0403", productId: "6001", serialNumber: "A123", manufacturer: "FTDI", product: "FT232R")
        #expect("\(byID)" == "tty:///dev/serial/by-id/usb-FTDI_FT232R_A123-if00-port0 (/dev/ttyUSB1, FTDI FT232R, 0403:6001, serial A123)")
        // A product that already names its maker is not prefixed twice; an interface the URL omits is named.
        let cp210x = DeviceRecord(url: "tty://usb/10c4:ea60?location=1-2", scheme: "tty", devnode: "/dev/ttyUSB2", vendorId: "10c4",
                                  productId: "ea60", manufacturer: "Silicon Labs", product: "Silicon Labs CP2102", interface: 0)
        #expect(cp210x.description == "tty://usb/10c4:ea60?location=1-2 (/dev/ttyUSB2, Silicon Labs CP2102, interface 0)")
        let uart = DeviceRecord(url: "tty:///dev/ttyS0", scheme: "tty", devnode: "/dev/ttyS0", name: "ttyS0", driver: "serial8250")
        #expect(uart.description == "tty:///dev/ttyS0 (driver serial8250)")
        #expect(DeviceRecord(url: "loop://", scheme: "loop").description == "loop://")
    }

    @Test("Bluetooth adapters, devices and scan results print address, name and state")
    func bluetooth() {
        let adapter = BluetoothAdapter(path: "/org/bluez/hci0", name: "hci0", index: 0, address: "00:1A:7D:DA:71:13", alias: "lab-pi",
                                       powered: true, discoverable: false, discovering: true)
        #expect(adapter.description == #"hci0 00:1A:7D:DA:71:13 "lab-pi" (powered, discovering)"#)
        let off = BluetoothAdapter(path: "/org/bluez/hci1", name: "hci1", index: 1, address: "00:AA:01:01:00:01", alias: nil,
                                   powered: false, discoverable: false, discovering: false)
        #expect("\(off)" == "hci1 00:AA:01:01:00:01 (off)")
        let device = BluetoothDevice(path: "/org/bluez/hci0/dev_E3_2E_44_66_A2_4A", adapterPath: "/org/bluez/hci0", address: "E3:2E:44:66:A2:4A",
                                     addressType: "random", name: "Nordic_UART", alias: nil, rssi: -60, uuids: [], connected: true,
                                     paired: true, servicesResolved: false, manufacturerData: [:], serviceData: [:])
        #expect(device.description == #"E3:2E:44:66:A2:4A "Nordic_UART" (random address, -60 dBm, connected, paired)"#)
        let seen = BluetoothDiscovery(address: "E3:2E:44:66:A2:4A", addressType: "random", name: nil, rssi: -71, serviceUUIDs: [],
                                      manufacturerData: [:], serviceData: [:], adapter: "hci0", url: "ble://nus/E3:2E:44:66:A2:4A?adapter=hci0")
        #expect(seen.description == "ble://nus/E3:2E:44:66:A2:4A?adapter=hci0 ((no name), random address, -71 dBm)")
    }

    @Test("RS-485 settings print as they read, and map to the kernel's flags")
    func rs485() {
        #expect(RS485Settings.disabled.description == "RS-485 off")
        let mode = RS485Settings(receiveDuringTransmit: true, delayBeforeSend: .milliseconds(1), delayAfterSend: .milliseconds(2))
        #expect(mode.description == "RS-485 on, RTS high while sending and low after, delays 1 ms before and 2 ms after, receiving while sending")
        #expect(KernelSerialRS485.layoutMatchesKernel)
        let kernel = try? KernelSerialRS485(mode, path: "test")
        #expect(kernel?.flags == 0b1_0011, "SER_RS485_ENABLED | RTS_ON_SEND | RX_DURING_TX")
        #expect(kernel?.delayRTSBeforeSend == 1 && kernel?.delayRTSAfterSend == 2)
        #expect(kernel?.settings == mode)
        #expect(RS485Settings.milliseconds(.microseconds(500)) == nil)
        #expect(RS485Settings.milliseconds(.seconds(-1)) == nil)
        #expect(RS485Settings.milliseconds(.seconds(2)) == 2000)
    }

    @Test("ConnectionMetadata.peerPath is extra[\"peer\"]")
    func peerPathAccessor() {
        var metadata = ConnectionMetadata(name: "pseudo-terminal")
        #expect(metadata.peerPath == nil && metadata.peerLink == nil)
        metadata.peerPath = "/dev/pts/7"
        metadata.peerLink = "/tmp/ttyFAKE0"
        #expect(metadata.extra == ["peer": "/dev/pts/7", "link": "/tmp/ttyFAKE0"])
        metadata.extra["peer"] = "/dev/pts/8"
        #expect(metadata.peerPath == "/dev/pts/8")
    }
}

@Suite("serial ports as a new user meets them")
struct SerialUsabilityTests {
    @Test("a pty's peer node is metadata.peerPath (and still extra[\"peer\"]), its link peerLink")
    func peerPath() async throws {
        let link = Support.temporaryPath("ttyPEER")
        let device = try await Transport.connect(to: "pty://?link=\(link)")
        let peer = try #require(device.metadata.peerPath)
        #expect(peer.hasPrefix("/dev/pts/"))
        #expect(device.metadata.extra["peer"] == peer)
        #expect(device.metadata.peerLink == link)
        let client = try await Transport.connect(to: "tty://\(peer)")
        try await client.write("hi")
        #expect(try await device.readFrame(.fixedLength(2)).map { String(decoding: $0, as: UTF8.self) } == "hi")
        try await client.close()
        try await device.close()
        // Other transports have none.
        let loop = try await Transport.connect(to: "loop://")
        #expect(loop.metadata.peerPath == nil)
        try await loop.close()
    }

    @Test("apply() with parity on a pty is refused before anything changes, saying a pty has no parity bit")
    func parityOnAPty() async throws {
        let device = try await Transport.connect(to: "pty://?baud=38400")
        let port = try #require(device.serialPort)
        let error = await expectTransportError(.unsupported) { try await port.apply(SerialSettings(baudRate: 115_200, parity: .even)) }
        #expect(error?.message.contains("is a pseudo-terminal, which has no parity bit") == true, "\(error?.message ?? "")")
        #expect(error?.message.contains("so it cannot do 115200 8E1; nothing was changed") == true, "\(error?.message ?? "")")
        #expect(try await port.settings().baudRate == 38_400, "not even the rate changed")
        let sevenBits = await expectTransportError(.unsupported) { try await port.apply(SerialSettings(dataBits: 7)) }
        #expect(sevenBits?.message.contains("carries only 8 data bits") == true, "\(sevenBits?.message ?? "")")
        // What a pty carries is applied.
        try await port.apply(SerialSettings(baudRate: 115_200, stopBits: 2))
        #expect(try await port.settings() == SerialSettings(baudRate: 115_200, stopBits: 2))
        try await device.close()

        // The same from the other side, a tty:// on the peer node.
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let tty = try #require(connection.serialPort)
        let odd = await expectTransportError(.unsupported) { try await tty.apply(SerialSettings(baudRate: 57_600, parity: .odd)) }
        #expect(odd?.message.contains("\(pty.path) is a pseudo-terminal, which has no parity bit") == true, "\(odd?.message ?? "")")
        #expect(try pty.termios2().c_ospeed == 9600)
        try await connection.close()
    }

    @Test("a port without modem lines: the advice fits how they were asked for")
    func modemLineAdvice() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        let dtr = await expectTransportError(.unsupported) { try await port.setDTR(false) }
        #expect(dtr?.message.contains("\(pty.path) has no modem control lines") == true, "\(dtr?.message ?? "")")
        #expect(dtr?.message.contains("leave the setDTR(_:) call out") == true, "\(dtr?.message ?? "")")
        #expect(dtr?.message.contains("dtr=") == false, "a method call is not told about URL options: \(dtr?.message ?? "")")
        let rts = await expectTransportError(.unsupported) { try await port.setRTS(true) }
        #expect(rts?.message.contains("leave the setRTS(_:) call out") == true, "\(rts?.message ?? "")")
        let both = await expectTransportError(.unsupported) { try await port.setLines([.dtr, .rts], true) }
        #expect(both?.message.contains("leave the setLines(_:_:) call out") == true, "\(both?.message ?? "")")
        let lines = await expectTransportError(.unsupported) { _ = try await port.modemLines() }
        #expect(lines?.message.contains("leave the modemLines() call out") == true, "\(lines?.message ?? "")")
        let watch = await expectTransportError(.unsupported) { _ = try await port.modemLineChanges() }
        #expect(watch?.message.contains("modemLineChanges()") == true || watch?.message.contains("SIGURG") == true, "\(watch?.message ?? "")")
        try await connection.close()
        let option = await expectTransportError(.unsupported) { try await Transport.connect(to: "tty://\(pty.path)?rts=true") }
        #expect(option?.message.contains("drop rts= from the URL") == true, "\(option?.message ?? "")")
    }

    @Test("a lock held by this very process is reported as such, not as another program")
    func lockHeldHere() throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let holder = open(pty.path, O_RDWR | O_NOCTTY | O_CLOEXEC)
        defer { if holder >= 0 { close(holder) } }
        try #require(holder >= 0)
        try #require(flock(holder, LOCK_EX | LOCK_NB) == 0)
        #expect(DeviceNode.lockHolderPID(path: pty.path) == Int(getpid()))
        #expect(DeviceNode.isOpenInThisProcess(pty.path))
        let error = DeviceAccess.lockedError(path: pty.path, errno: .wouldBlock)
        #expect(error.kind == .busy && error.syscall == "flock")
        #expect(error.message.contains("is already open in this process (\(getpid())): another connection to it is still open"), "\(error.message)")
        #expect(!error.message.contains("Close that program"), "\(error.message)")
        let file = Support.temporaryPath("not-open")
        _ = FileManager.default.createFile(atPath: file, contents: Data())
        defer { unlink(file) }
        #expect(!DeviceNode.isOpenInThisProcess(file))
        #expect(DeviceNode.lockHolderPID(path: file) == nil)
    }

    @Test("permission advice: no 'join group root', and a USB udev rule only for a port on USB")
    func permissionAdvice() throws {
        let file = TestSupport.temporaryPath("ttyNOACCESS")
        let name = String(file.split(separator: "/").last ?? "")
        _ = FileManager.default.createFile(atPath: file, contents: Data())
        defer { unlink(file) }
        try #require(chmod(file, 0o600) == 0)
        var info = stat()
        try #require(stat(file, &info) == 0)
        let message = DeviceAccess.permissionMessage(path: file)
        // Group root (as root) or a group the mode shuts out: joining it would not help.
        #expect(!message.contains("usermod -aG root"), "\(message)")
        #expect(message.contains("run the program as root (sudo)"), "\(message)")
        #expect(message.contains("install a udev rule that gives a group access"), "\(message)")
        if info.st_gid == 0 { #expect(message.contains(#"GROUP="dialout""#) && message.contains("usermod -aG dialout"), "\(message)") }
        // Not a USB port: the rule names the kernel's name, not a vendor and product.
        #expect(message.contains(#"SUBSYSTEM=="tty", KERNEL==""# + name + "\""), "\(message)")
        #expect(!message.contains("idVendor"), "\(message)")
        // A node whose group may use it: joining that group is the advice.
        let ptmx = DeviceAccess.permissionMessage(path: "/dev/ptmx")
        #expect(ptmx.contains("usermod -aG") && !ptmx.contains("usermod -aG root"), "\(ptmx)")
        #expect(!ptmx.contains("idVendor"), "\(ptmx)")
    }

    /// A tty connection to `pty` with a tiny inbound buffer: past 32 bytes held, TransportKit
    /// stops reading from the driver.
    static func smallBuffered(_ pty: TestPTY) async throws -> (Connection, SerialPort) {
        let small = Buffering(inbound: .init(low: 16, high: 32), outbound: Buffering.standard.outbound, inFlight: Buffering.standard.inFlight,
                              readSize: 64, readsPerWakeup: 1)
        let connection = try await Transport.registry.connect(to: "tty://\(pty.path)", buffering: small)
        return (connection, try #require(connection.ttyPort))
    }

    @Test("input queue: bytes the driver holds that TransportKit has not read (TIOCINQ)")
    func inputQueue() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let (connection, port) = try await Self.smallBuffered(pty)
        #expect(try port.inputQueueBytes() == 0)
        pty.write(String(repeating: "x", count: 500))
        #expect(await eventually { ((try? port.inputQueueBytes()) ?? 0) > 0 }, "the rest waits in the driver")
        #expect(try port.inputQueueBytes() <= 500)
        let all = try await connection.readFrame(.fixedLength(500))
        #expect(all?.count == 500)
        #expect(await eventually { (try? port.inputQueueBytes()) == 0 })
        try await connection.close()
        await expectTransportError(.disconnected) { _ = try port.inputQueueBytes() }
    }

    @Test("bytes waiting: what the connection holds plus what the driver holds, as pyserial's in_waiting")
    func bytesWaiting() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let (connection, port) = try await Self.smallBuffered(pty)
        #expect(try port.bytesWaiting() == 0 && connection.unreadByteCount == 0)
        pty.write(String(repeating: "y", count: 500))
        // Every byte is counted once, wherever it waits: the driver, the inbound queue, the leftover.
        #expect(await eventually { (try? port.bytesWaiting()) == 500 }, "\((try? port.bytesWaiting()) ?? -1)")
        #expect(try await connection.read(maxBytes: 10, timeout: .seconds(5))?.count == 10)
        #expect(await eventually { (try? port.bytesWaiting()) == 490 }, "\((try? port.bytesWaiting()) ?? -1)")
        #expect((connection.unreadByteCount ?? 0) > 0, "part of it is held by TransportKit, not the driver")
        #expect(try await connection.readFrame(.fixedLength(490), timeout: .seconds(5))?.count == 490)
        #expect(try port.bytesWaiting() == 0 && connection.unreadByteCount == 0)
        try await connection.close()
    }

    @Test("unread bytes over TCP: the connection's leftover and the inbound queue")
    func unreadOverTCP() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
        let server = try #require(try await listener.accept())
        try await server.write("0123456789")
        #expect(await eventually { client.unreadByteCount == 10 }, "\(client.unreadByteCount ?? -1)")
        #expect(try await client.read(maxBytes: 3, timeout: .seconds(5)) == Array("012".utf8))
        #expect(client.unreadByteCount == 7, "the rest of the chunk the read cut short")
        #expect(try await client.readFrame(.fixedLength(7), timeout: .seconds(5)) == Array("3456789".utf8))
        #expect(client.unreadByteCount == 0)
        try await client.close()
        try await server.close()
        try await listener.close()
    }

    @Test("break on and off between writes keeps their order (TIOCSBRK waits off the cooperative pool)")
    func breakOnAndOff() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.serialPort)
        try await connection.write("before")
        try await port.setBreak(true)
        try await port.setBreak(false)
        try await connection.write("after")
        #expect(await pty.read(count: 11) == Array("beforeafter".utf8))
        try await port.sendBreak(duration: .milliseconds(10))
        try await connection.close()
    }

    @Test("RS-485 on a pty: .unsupported naming the ioctl, and the port stays usable")
    func rs485OnAPty() async throws {
        let pty = try TestPTY()
        defer { pty.closeMaster() }
        let connection = try await Transport.connect(to: "tty://\(pty.path)")
        let port = try #require(connection.ttyPort)
        let read = await expectTransportError(.unsupported) { _ = try await port.rs485() }
        #expect(read?.syscall == "ioctl(TIOCGRS485)" && read?.errno == .inappropriateIOCTLForDevice, "\(String(describing: read))")
        #expect(read?.message.contains("has no RS-485 mode (ioctl TIOCGRS485 answered ENOTTY)") == true, "\(read?.message ?? "")")
        let set = await expectTransportError(.unsupported) { try await port.setRS485(RS485Settings(delayAfterSend: .milliseconds(1))) }
        #expect(set?.syscall == "ioctl(TIOCSRS485)" && set?.errno == .inappropriateIOCTLForDevice, "\(String(describing: set))")
        #expect(set?.message.contains("pseudo-terminal") == true, "\(set?.message ?? "")")
        // A delay the kernel cannot take is refused before any ioctl.
        let fraction = await expectTransportError(.misuse) { try await port.setRS485(RS485Settings(delayBeforeSend: .microseconds(500))) }
        #expect(fraction?.message.contains("whole milliseconds") == true, "\(fraction?.message ?? "")")
        try await connection.write("ok")
        #expect(await pty.read(count: 2) == Array("ok".utf8))
        try await connection.close()
    }
}
