// epoll(7): Glibc's Swift module leaves sys/epoll.h out. TransportKitLinux's readiness poller
// (Readiness.swift) is the only importer.
#include <sys/epoll.h>
