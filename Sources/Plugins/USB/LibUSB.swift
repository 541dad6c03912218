// LibUSB.swift: the libusb-1.0 calls the usb:// plugin makes to open a device (libusb.h of 1.0.26;
// https://libusb.sourceforge.io/api-1.0/). The device node is opened here with open(2), so that a
// refusal carries the real errno and the node's owner and mode, and handed to libusb with
// libusb_wrap_sys_device; libusb's own device discovery is switched off (the plugin found the
// device through sysfs). Every libusb error becomes a TransportError naming the libusb call.

import CLibUSB
import Glibc
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux
import TransportKitUdev

/// One endpoint as the active configuration describes it.
struct USBEndpoint: Sendable, Equatable {
    var address: UInt8
    /// 2 bulk, 3 interrupt.
    var type: UInt8
    var maxPacketSize: Int
    var isIn: Bool { address & 0x80 != 0 }
    var typeName: String { ["control", "isochronous", "bulk", "interrupt"][Int(type & 3)] }
    var addressText: String { "0x" + Hex.digits(address) }
}

/// One alternate setting of one interface.
struct USBAlternate: Sendable, Equatable {
    var interface: Int
    var alternate: Int
    var interfaceClass: UInt8
    var endpoints: [USBEndpoint]
}

/// The endpoints a connection uses.
struct USBEndpointChoice: Sendable, Equatable {
    var interface: Int
    var alternate: Int
    var input: USBEndpoint
    var output: USBEndpoint
}

/// An open libusb device: our descriptor, a context of its own and the handle wrapping it.
/// Closed once, by ``close()``, after every transfer ended.
final class LibUSBDevice: @unchecked Sendable {
    // @unchecked: `context` and `handle` are set in init and never change; libusb's calls on them
    // are thread-safe (libusb is documented so for one context shared by threads). close() runs
    // once (the backend's teardown), after the event thread stopped.
    let context: OpaquePointer
    let handle: OpaquePointer
    let fd: Int32
    let node: String

    private static let discoveryOff: Int32 = tk_libusb_disable_device_discovery()

    /// Opens `node` (`/dev/bus/usb/BBB/DDD`) read-write and wraps it in a libusb handle.
    init(node: String, device: USBDeviceInfo, describing: String) throws {
        let fd = open(node, O_RDWR | O_CLOEXEC)
        guard fd >= 0 else {
            let code = Errno(rawValue: errno)
            switch code {
            case .permissionDenied, .notPermitted:
                throw TransportError(.permissionDenied, "\(describing): " + Self.permissionMessage(node: node, device: device), errno: code, syscall: "open")
            case .noSuchFileOrDirectory, .noSuchAddressOrDevice, .operationNotSupportedByDevice:
                throw TransportError(.notFound, "\(describing): \(node) is gone (the device was unplugged while opening); plug it in again, or add ?wait=true",
                                     errno: code, syscall: "open")
            default:
                throw TransportError.posix("open", errno: code, what: "\(describing) (\(node))")
            }
        }
        guard Self.discoveryOff == 0 else {
            Glibc.close(fd)
            throw Self.error(Self.discoveryOff, "libusb_set_option(NO_DEVICE_DISCOVERY)", describing)
        }
        var context: OpaquePointer?
        let initialised = libusb_init(&context)
        guard initialised == 0, let context else {
            Glibc.close(fd)
            throw Self.error(initialised, "libusb_init", describing)
        }
        var handle: OpaquePointer?
        let wrapped = libusb_wrap_sys_device(context, Int(fd), &handle)
        guard wrapped == 0, let handle else {
            libusb_exit(context)
            Glibc.close(fd)
            throw Self.error(wrapped, "libusb_wrap_sys_device", "\(describing) (\(node))")
        }
        self.context = context
        self.handle = handle
        self.fd = fd
        self.node = node
    }

    /// The alternate settings of the active configuration, every interface.
    func alternates(describing: String) throws -> [USBAlternate] {
        var config: UnsafeMutablePointer<libusb_config_descriptor>?
        let result = libusb_get_active_config_descriptor(libusb_get_device(handle), &config)
        guard result == 0, let config else { throw Self.error(result, "libusb_get_active_config_descriptor", describing) }
        defer { libusb_free_config_descriptor(config) }
        var alternates: [USBAlternate] = []
        for i in 0..<Int(config.pointee.bNumInterfaces) {
            let interface = config.pointee.interface[i]
            for a in 0..<Int(interface.num_altsetting) {
                let setting = interface.altsetting[a]
                let endpoints = (0..<Int(setting.bNumEndpoints)).map { e -> USBEndpoint in
                    let endpoint = setting.endpoint[e]
                    return USBEndpoint(address: endpoint.bEndpointAddress, type: endpoint.bmAttributes & 3,
                                       maxPacketSize: Int(endpoint.wMaxPacketSize & 0x7ff))
                }
                alternates.append(USBAlternate(interface: Int(setting.bInterfaceNumber), alternate: Int(setting.bAlternateSetting),
                                               interfaceClass: setting.bInterfaceClass, endpoints: endpoints))
            }
        }
        return alternates
    }

    /// Takes the interface: from a kernel driver bound to it when `detach` (given back when the
    /// interface is released), else refused naming the driver.
    func claim(_ interface: Int, alternate: Int, detach: Bool, driver: String?, describing: String) throws {
        if detach {
            let result = libusb_set_auto_detach_kernel_driver(handle, 1)
            guard result == 0 else { throw Self.error(result, "libusb_set_auto_detach_kernel_driver", describing) }
        } else if libusb_kernel_driver_active(handle, Int32(interface)) == 1 {
            throw TransportError(.busy, "\(describing): interface \(interface) belongs to the kernel driver \(driver ?? "bound to it"); "
                                 + "add ?detach=true to take it for this connection (the driver gets it back on close)",
                                 errno: .resourceBusy, syscall: "libusb_kernel_driver_active")
        }
        let claimed = libusb_claim_interface(handle, Int32(interface))
        guard claimed == 0 else {
            if claimed == LIBUSB_ERROR_BUSY.rawValue {
                throw TransportError(.busy, "\(describing): interface \(interface) is claimed by another program"
                                     + (DeviceNode.openers(of: node).map { " (\($0) has \(node) open)" } ?? "")
                                     + "; close it, or choose another interface", errno: .resourceBusy, syscall: "libusb_claim_interface")
            }
            throw Self.error(claimed, "libusb_claim_interface", describing)
        }
        if alternate != 0 {
            let set = libusb_set_interface_alt_setting(handle, Int32(interface), Int32(alternate))
            guard set == 0 else {
                libusb_release_interface(handle, Int32(interface))
                throw Self.error(set, "libusb_set_interface_alt_setting", describing)
            }
        }
    }

    /// Gives the interface back (a driver detached for it is attached again), closes the handle,
    /// the context and the descriptor. Only once no transfer is in flight.
    func close(releasing interface: Int?) {
        if let interface { libusb_release_interface(handle, Int32(interface)) }
        libusb_close(handle)
        libusb_exit(context)
        Glibc.close(fd)
    }

    /// "permission denied opening /dev/bus/usb/001/004: owned by root:root, mode crw-rw-r--; …" with a
    /// udev rule for this VID:PID (USB nodes belong to group root by default, so "join the group"
    /// is no advice here).
    static func permissionMessage(node: String, device: USBDeviceInfo) -> String {
        let rule = #"SUBSYSTEM=="usb", ATTR{idVendor}=="\#(device.vendorId)", ATTR{idProduct}=="\#(device.productId)", MODE="0660", GROUP="plugdev", TAG+="uaccess""#
        var info = stat()
        var message = "permission denied opening \(node)"
        if stat(node, &info) == 0 {
            let owner = getpwuid(info.st_uid).flatMap { $0.pointee.pw_name.map { String(cString: $0) } } ?? String(info.st_uid)
            let group = getgrgid(info.st_gid).flatMap { $0.pointee.gr_name.map { String(cString: $0) } } ?? String(info.st_gid)
            message += " (the \(device.product ?? "USB device") \(device.vendorId):\(device.productId)): owned by \(owner):\(group), mode \(DeviceNode.modeString(info.st_mode)); this process is uid \(geteuid())"
        }
        return message + ". Fix: install a udev rule such as \(rule) as /etc/udev/rules.d/70-\(device.vendorId)-\(device.productId).rules, "
            + "run `sudo udevadm control --reload && sudo udevadm trigger`, add the user to group plugdev and log in again (TAG+=\"uaccess\" "
            + "alone gives access to the user at the seat), then plug the device in again"
    }

    /// A libusb error as a TransportError with the errno it stands for and the call's name.
    static func error(_ code: Int32, _ call: String, _ describing: String) -> TransportError {
        let name = libusb_error_name(code).map { String(cString: $0) } ?? "LIBUSB_ERROR \(code)"
        let (kind, errno, advice): (TransportError.Kind, Errno?, String) = switch code {
        case LIBUSB_ERROR_IO.rawValue: (.io, .ioError, "an input/output error on the bus")
        case LIBUSB_ERROR_INVALID_PARAM.rawValue: (.misuse, .invalidArgument, "libusb refused the arguments")
        case LIBUSB_ERROR_ACCESS.rawValue: (.permissionDenied, .permissionDenied, "access denied")
        case LIBUSB_ERROR_NO_DEVICE.rawValue: (.disconnected, .operationNotSupportedByDevice, "the device is gone (unplugged?)")
        case LIBUSB_ERROR_NOT_FOUND.rawValue: (.notFound, .noSuchFileOrDirectory, "no such interface or endpoint")
        case LIBUSB_ERROR_BUSY.rawValue: (.busy, .resourceBusy, "busy")
        case LIBUSB_ERROR_TIMEOUT.rawValue: (.timedOut, .timedOut, "timed out")
        case LIBUSB_ERROR_OVERFLOW.rawValue: (.io, .overflow, "the device sent more than asked for")
        case LIBUSB_ERROR_PIPE.rawValue: (.io, .brokenPipe, "the endpoint stalled (the device refused the request)")
        case LIBUSB_ERROR_NO_MEM.rawValue: (.io, .noMemory, "out of memory; usbfs limits what all programs keep in flight (usbcore.usbfs_memory_mb, 16 MiB by default): fewer or smaller transfers")
        case LIBUSB_ERROR_NOT_SUPPORTED.rawValue: (.unsupported, .notSupported, "not supported on this system")
        case LIBUSB_ERROR_INTERRUPTED.rawValue: (.io, .interrupted, "interrupted")
        default: (.io, .ioError, "failed")
        }
        return TransportError(kind, "\(describing): \(call): \(advice) (\(name))", errno: errno, syscall: call)
    }
}

/// The interface and endpoints a connection uses: those the URL names, else the first interface
/// (and alternate setting) with a bulk IN and a bulk OUT endpoint, else, on a device with no bulk
/// pair (a vendor HID device, say), the first with an interrupt IN and an interrupt OUT endpoint.
/// A bulk endpoint beside an interrupt one is used only when the URL names them.
func chooseEndpoints(_ alternates: [USBAlternate], interface: Int?, alternate: Int?, input: UInt8?, output: UInt8?,
                     describing: String) throws -> USBEndpointChoice {
    let (candidates, offered) = try matchingAlternates(alternates, interface: interface, alternate: alternate, describing: describing)
    // Bulk pairs first; interrupt pairs only where no interface has a bulk pair.
    for type: UInt8 in [2, 3] {
        for candidate in candidates {
            func pick(_ address: UInt8?, wantIn: Bool) throws -> USBEndpoint? {
                if let address {
                    guard let endpoint = candidate.endpoints.first(where: { $0.address == address }) else { return nil }
                    guard endpoint.isIn == wantIn else {
                        throw TransportError(.invalidURL, "\(describing): endpoint \(endpoint.addressText) is an \(endpoint.isIn ? "IN" : "OUT") endpoint; "
                                             + "\(wantIn ? "in=" : "out=") needs an \(wantIn ? "IN (0x80 set)" : "OUT") one. The device offers \(offered)")
                    }
                    guard endpoint.type == 2 || endpoint.type == 3 else {
                        throw TransportError(.unsupported, "\(describing): endpoint \(endpoint.addressText) is \(endpoint.typeName); usb:// streams bulk and interrupt endpoints")
                    }
                    return endpoint
                }
                return candidate.endpoints.first { $0.isIn == wantIn && $0.type == type }
            }
            if let inEndpoint = try pick(input, wantIn: true), let outEndpoint = try pick(output, wantIn: false) {
                return USBEndpointChoice(interface: candidate.interface, alternate: candidate.alternate, input: inEndpoint, output: outEndpoint)
            }
        }
    }
    let named = [input.map { "in=0x\(Hex.digits($0))" }, output.map { "out=0x\(Hex.digits($0))" }].compactMap { $0 }
    throw TransportError(.notFound, "\(describing): no \(interface.map { "interface \($0) " } ?? "interface ")with "
                         + (named.isEmpty ? "a bulk (or interrupt) IN and OUT endpoint pair" : named.joined(separator: " and "))
                         + "; the device offers \(offered). Name them with interface=, in= and out=; for control transfers alone, controlOnly=true")
}

/// The alternate settings `interface=` and `alt=` name (of any interface without `interface=`;
/// setting 0 without `alt=`), and what the device offers, for messages. `.notFound` listing the
/// offer when none matches.
func matchingAlternates(_ alternates: [USBAlternate], interface: Int?, alternate: Int?,
                        describing: String) throws -> (matches: [USBAlternate], offered: String) {
    func describe(_ alternate: USBAlternate) -> String {
        "interface \(alternate.interface) alt \(alternate.alternate): "
            + (alternate.endpoints.isEmpty ? "no endpoints" : alternate.endpoints.map { "\($0.typeName) \($0.isIn ? "in" : "out") \($0.addressText)" }.joined(separator: ", "))
    }
    let offered = alternates.map(describe).joined(separator: "; ")
    let matches = alternates.filter { (interface == nil || $0.interface == interface) && $0.alternate == (alternate ?? 0) }
    guard !matches.isEmpty else {
        throw TransportError(.notFound, "\(describing): no interface \(interface.map(String.init) ?? "?") with alternate setting \(alternate ?? 0); the device offers \(offered)")
    }
    return (matches, offered)
}

/// An endpoint option (`in=0x81`, `in=81`, `in=129`): hexadecimal with 0x or as USB tools print
/// it (two hex digits), else decimal.
func parseEndpoint(_ text: String?, option: String, describing: String) throws -> UInt8? {
    guard let text else { return nil }
    let value: UInt8?
    // Digits only (Hex.value): UInt8(_:radix:) would also take "+1".
    if text.lowercased().hasPrefix("0x") {
        value = Hex.value(text.dropFirst(2), as: UInt8.self)
    } else if text.count == 2 {
        value = Hex.value(text, as: UInt8.self)
    } else {
        value = text.allSatisfy({ $0.isASCII && $0.isNumber }) ? UInt8(text) : nil
    }
    let shown = TransportError.printable(text, limit: 40)
    guard let value, value & 0x70 == 0, value & 0x0f != 0 else {
        throw TransportError(.invalidURL, "\(TransportError.printable(describing)): \(option)=\(shown) is not an endpoint address: give one such as 0x81 (IN 1) or 0x02 (OUT 2)")
    }
    let isIn = value & 0x80 != 0
    guard isIn == (option == "in") else {
        throw TransportError(.invalidURL, "\(TransportError.printable(describing)): \(option)=\(shown) is an \(isIn ? "IN" : "OUT") endpoint (bit 7 \(isIn ? "set" : "clear")); "
                             + "\(option)= takes an \(option == "in" ? "IN endpoint, 0x81 to 0x8F" : "OUT endpoint, 0x01 to 0x0F")")
    }
    return value
}
