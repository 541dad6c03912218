// Plain C baseline for the usb:// benchmark: libusb's own asynchronous API, no TransportKit, on one
// thread (two with `handover`), measured beside the plugin in the same run (transportkit-bench usb,
// USBBench.swift).
#ifndef TK_CBENCH_USB_H
#define TK_CBENCH_USB_H

/// Sends `total` bytes to bulk OUT endpoint `out_endpoint` of the device node `path` (interface
/// `interface` claimed) and reads them back from bulk IN `in_endpoint` (a loopback device), with
/// `transfers` transfers of `size` bytes in flight each way, libusb_handle_events on this thread.
/// Returns the seconds from the first submission until the last byte came back; negative (a libusb
/// error code, or -1000 - errno for open(2)) on failure. `*received` gets the bytes read back.
///
/// `handover` nonzero: the loop also does what a library must do and the plain loop does not. Each
/// IN transfer that completes reads into a newly allocated buffer next, and the filled one goes to a
/// consumer thread, woken once per libusb_handle_events round, which frees it. That is the shape of
/// usb://'s data path without any of its code.
double tk_bench_c_usb_echo(const char *path, int interface, unsigned char out_endpoint, unsigned char in_endpoint,
                           int transfers, int size, long long total, int handover, long long *received);

#endif
