import CBlueZ
import CLibUSB
import CUdev
import Testing

/// The C targets build and their shim helpers return what the C macros do.
@Suite("C shims")
struct CShimTests {
    @Test func bluezAddressesAndByteOrder() {
        #expect(withUnsafeBytes(of: tk_bt_bdaddr_any().b) { Array($0) } == [0, 0, 0, 0, 0, 0])
        #expect(withUnsafeBytes(of: tk_bt_bdaddr_all().b) { Array($0) } == [0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF])
        #expect(withUnsafeBytes(of: tk_bt_bdaddr_local().b) { Array($0) } == [0, 0, 0, 0xFF, 0xFF, 0xFF])
        #expect(tk_bt_btohs(tk_bt_htobs(0x1234)) == 0x1234)
        #expect(tk_bt_htobs(0x1234) == UInt16(0x1234).littleEndian)
    }

    @Test func bluezIoctlNumbers() {
        // _IOW('H', 201, int) and _IOR('H', 210, int) as the kernel defines them.
        #expect(tk_bt_ioctl_hcidevup() == 0x4004_48C9)
        #expect(tk_bt_ioctl_hcigetdevlist() == 0x8004_48D2)
        #expect(AF_BLUETOOTH == 31)
    }

    @Test func udevContextWorksWithoutUdevd() {
        let context = udev_new()
        #expect(context != nil)
        udev_unref(context)
    }

    @Test func libusbInitialises() {
        #expect(tk_libusb_api_version() >= 0x0100_0108)
        var context: OpaquePointer?
        #expect(libusb_init(&context) == 0)
        libusb_exit(context)
    }

    @Test func libusbOptionsThroughTheShim() {
        // The variadic libusb_set_option, reached through its non-variadic wrappers.
        #expect(tk_libusb_disable_device_discovery() == 0)
        var context: OpaquePointer?
        #expect(libusb_init(&context) == 0)
        #expect(tk_libusb_set_log_level(context, 0) == 0)
        #expect(tk_libusb_set_log_level(context, 99) == LIBUSB_ERROR_INVALID_PARAM.rawValue, "a level out of range is refused")
        libusb_exit(context)
    }
}
