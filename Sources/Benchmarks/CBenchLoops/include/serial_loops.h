// Plain C baselines for the serial benchmarks: pty loops, a libudev enumeration and a libudev
// monitor, measured against TransportKit's tty:// plugin and its discovery in the same run.
#ifndef TK_CBENCH_SERIAL_H
#define TK_CBENCH_SERIAL_H
#include <stddef.h>

/// Enumerates the tty subsystem with libudev and reads what a port listing needs (node, USB IDs,
/// serial, manufacturer, product, interface). Returns seconds; `*count` gets the devices seen.
double tk_bench_c_udev_list(int *count);

/// Average seconds from writing "change" to `uevent_path` to a libudev monitor (kernel group,
/// tty subsystem) receiving the event, over `rounds` events. Negative on failure.
double tk_bench_c_uevent_latency(const char *uevent_path, int rounds);

/// `rounds` 32-byte round trips over a fresh pty pair, both ends in C (echo thread on the master).
double tk_bench_c_pty_round_trips(int rounds);

/// `total` bytes in `chunk`-sized writes into a pty slave, read from the master by a thread.
double tk_bench_c_pty_throughput(size_t total, size_t chunk);

/// A pty whose master is served by a C thread, for the TransportKit runs: with `echo` it echoes
/// 32-byte messages until the slave closes; otherwise it swallows `sink_total` bytes and then
/// writes one byte back. Writes the slave's path into `path` and returns 0, or -1.
int tk_bench_c_pty_peer(int echo, size_t sink_total, char *path, size_t path_length);
#endif
