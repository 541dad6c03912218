// CLinux: Linux calls that Glibc's Swift module leaves out, for TransportKitLinux (its only
// importer): epoll(7) (Readiness.swift) and accept4(2) (Syscall.swift).
#ifndef TK_CLINUX_SHIM_H
#define TK_CLINUX_SHIM_H

#include <sys/epoll.h>
#include <sys/socket.h>

/// accept4(2) with SOCK_NONBLOCK | SOCK_CLOEXEC: the new socket, or -1 with errno.
static inline int tk_accept_nonblocking(int fd, struct sockaddr *address, socklen_t *length) {
    return accept4(fd, address, length, SOCK_NONBLOCK | SOCK_CLOEXEC);
}

#endif
