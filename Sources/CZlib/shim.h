// CZlib: zlib (zlib1g-dev) as seen from Swift, for WebSocket's permessage-deflate (RFC 7692).
// deflateInit2 and inflateInit2 are macros that pass the library's version and z_stream size;
// these wrappers make them callable.
#ifndef TK_CZLIB_SHIM_H
#define TK_CZLIB_SHIM_H

#include <zlib.h>

static inline int tk_deflate_init(z_stream *stream, int level, int window_bits) {
    return deflateInit2(stream, level, Z_DEFLATED, window_bits, 8, Z_DEFAULT_STRATEGY);
}

static inline int tk_inflate_init(z_stream *stream, int window_bits) {
    return inflateInit2(stream, window_bits);
}

#endif
