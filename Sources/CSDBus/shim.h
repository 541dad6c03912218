// sd-bus (libsystemd): the D-Bus client TransportKitDBus drives from a thread of its own.
// Only the non-variadic API is usable from Swift (sd_bus_message_append_basic, open_container, …).
#include <systemd/sd-bus.h>
