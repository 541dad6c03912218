// CLibUSB: libusb-1.0 (libusb-1.0-0-dev). pkg-config adds .../include/libusb-1.0, hence <libusb.h>.
#ifndef TK_CLIBUSB_SHIM_H
#define TK_CLIBUSB_SHIM_H

#include <libusb.h>

/// LIBUSB_API_VERSION is a macro with a cast-free value; exposed so Swift can check the header it built against.
static inline int tk_libusb_api_version(void) { return LIBUSB_API_VERSION; }

#endif
