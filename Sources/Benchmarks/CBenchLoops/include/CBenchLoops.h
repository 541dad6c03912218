// Plain C read/write loops over loopback TCP: the baseline the TransportKit benchmarks are
// measured against. Both ends run in this process (the peer on a pthread).
#ifndef TK_CBENCHLOOPS_H
#define TK_CBENCHLOOPS_H
#include <stddef.h>
#include "serial_loops.h"
#include "usb_loops.h"

/// Sends `total` bytes in `chunk`-sized write(2)s to a peer that read(2)s them all.
/// Returns the elapsed seconds, or a negative value on failure.
double tk_bench_c_tcp_throughput(size_t total, size_t chunk);

/// `rounds` 32-byte request/response round trips against an echoing peer. Returns seconds.
double tk_bench_c_tcp_round_trips(int rounds);

/// A 32-byte echo server for the TransportKit round-trip run: listens on 127.0.0.1, returns the
/// port, and serves one connection on a pthread until it closes.
int tk_bench_c_echo_server(void);
/// A blocking loopback TCP connection to `port` with TCP_NODELAY; -1 on failure.
int tk_bench_c_connect(int port);
/// A connected loopback TCP pair (client, accepted), both with TCP_NODELAY; -1 on failure.
int tk_bench_c_tcp_pair(int fds[2]);

/// A sink for the TransportKit throughput run: listens on 127.0.0.1, returns the port, and reads
/// one connection to its end on a pthread. `tk_bench_c_sink_join` waits for that end and returns
/// the bytes read (-1 on failure). One sink at a time.
int tk_bench_c_sink_start(void);
long tk_bench_c_sink_join(void);
#endif
