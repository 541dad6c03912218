import CBlueZ
import CLinux
import CLibUSB
import CSDBus
import CUdev
import CZlib
import Glibc
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

    @Test func epollConstantsAndACall() {
        // The values sys/epoll.h gives (and the kernel's uapi/linux/eventpoll.h).
        #expect(EPOLLIN.rawValue == 0x001 && EPOLLOUT.rawValue == 0x004 && EPOLLRDHUP.rawValue == 0x2000)
        #expect(EPOLLONESHOT.rawValue == 1 << 30 && EPOLL_CTL_MOD == 3)
        let epoll = epoll_create1(Int32(EPOLL_CLOEXEC))
        #expect(epoll >= 0)
        var event = epoll_event()
        #expect(epoll_wait(epoll, &event, 1, 0) == 0, "an empty set has nothing ready")
        close(epoll)
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

    @Test func sdbusErrorNamesMapToErrno() {
        // TransportKitDBus answers a malformed call to an exported object with sd_bus_error_set and
        // hands its result, a negative errno (sd_bus_error_set(3): InvalidArgs is EINVAL), to sd-bus.
        var error = sd_bus_error(name: nil, message: nil, _need_free: 0)
        defer { sd_bus_error_free(&error) }
        #expect(sd_bus_error_set(&error, "org.freedesktop.DBus.Error.InvalidArgs", "bad argument") == -EINVAL)
        #expect(sd_bus_error_is_set(&error) > 0)
        #expect(sd_bus_error_has_name(&error, "org.freedesktop.DBus.Error.InvalidArgs") > 0)
        #expect(error.message.map { String(cString: $0) } == "bad argument")
    }

    @Test func zlibRawDeflateRoundTripThroughTheShim() {
        // tk_deflate_init and tk_inflate_init wrap the deflateInit2/inflateInit2 macros; negative
        // window bits are raw DEFLATE, as permessage-deflate uses it. zlib keeps a pointer to its
        // z_stream, so each lives at one address (allocated, as PerMessageDeflate.swift does).
        let text = Array(String(repeating: "permessage-deflate ", count: 50).utf8)
        let deflater = UnsafeMutablePointer<z_stream>.allocate(capacity: 1)
        deflater.initialize(to: z_stream())
        defer { deflater.deallocate() }
        #expect(tk_deflate_init(deflater, Z_DEFAULT_COMPRESSION, -15) == Z_OK)
        var input = text
        var compressed = [UInt8](repeating: 0, count: 4096)
        let compressedCount = Self.finish(deflater, from: &input, count: text.count, into: &compressed, deflate)
        deflateEnd(deflater)
        #expect(compressedCount > 0 && compressedCount < text.count, "repetitive text compresses")

        let inflater = UnsafeMutablePointer<z_stream>.allocate(capacity: 1)
        inflater.initialize(to: z_stream())
        defer { inflater.deallocate() }
        #expect(tk_inflate_init(inflater, -15) == Z_OK)
        var restored = [UInt8](repeating: 0, count: text.count + 64)
        let restoredCount = Self.finish(inflater, from: &compressed, count: compressedCount, into: &restored, inflate)
        inflateEnd(inflater)
        #expect(Array(restored.prefix(restoredCount)) == text)
    }

    /// Runs `step` (deflate or inflate) over the first `count` bytes of `input` with Z_FINISH,
    /// expecting the stream's end; the number of bytes it wrote into `output`.
    static func finish(_ stream: UnsafeMutablePointer<z_stream>, from input: inout [UInt8], count: Int, into output: inout [UInt8],
                       _ step: (UnsafeMutablePointer<z_stream>, Int32) -> Int32) -> Int {
        input.withUnsafeMutableBufferPointer { source -> Int in
            output.withUnsafeMutableBufferPointer { target -> Int in
                stream.pointee.next_in = source.baseAddress
                stream.pointee.avail_in = uInt(count)
                stream.pointee.next_out = target.baseAddress
                stream.pointee.avail_out = uInt(target.count)
                #expect(step(stream, Z_FINISH) == Z_STREAM_END)
                return target.count - Int(stream.pointee.avail_out)
            }
        }
    }
}
