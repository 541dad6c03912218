// CUdev: libudev (libudev-dev) as seen from Swift. libudev's API is plain functions and opaque
// pointers, so it imports as is; helpers the Swift side needs go here with a tk_udev_ prefix.
#ifndef TK_CUDEV_SHIM_H
#define TK_CUDEV_SHIM_H

#include <libudev.h>

#endif
