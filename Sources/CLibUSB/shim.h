// CLibUSB: libusb-1.0 (libusb-1.0-0-dev). pkg-config adds .../include/libusb-1.0, hence <libusb.h>.
#ifndef TK_CLIBUSB_SHIM_H
#define TK_CLIBUSB_SHIM_H

#include <libusb.h>

/// LIBUSB_API_VERSION is a macro with a cast-free value; exposed so Swift can check the header it built against.
static inline int tk_libusb_api_version(void) { return LIBUSB_API_VERSION; }

/// libusb_set_option is variadic, which Swift does not import. LIBUSB_OPTION_NO_DEVICE_DISCOVERY
/// with a NULL context applies to every later libusb_init (libusb 1.0.26: its Linux backend keeps
/// it in a process-wide flag): no scan of /dev/bus/usb and no hot-plug thread of libusb's own, for
/// a process that opens devices it found itself (libusb_wrap_sys_device).
static inline int tk_libusb_disable_device_discovery(void) {
    return libusb_set_option(NULL, LIBUSB_OPTION_NO_DEVICE_DISCOVERY);
}

/// LIBUSB_OPTION_LOG_LEVEL for one context (0 none … 4 debug).
static inline int tk_libusb_set_log_level(libusb_context *context, int level) {
    return libusb_set_option(context, LIBUSB_OPTION_LOG_LEVEL, level);
}

#endif
