#define _GNU_SOURCE
#include "serial_loops.h"

#include <fcntl.h>
#include <libudev.h>
#include <poll.h>
#include <pthread.h>
#include <pty.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static const char *attr(struct udev_device *device, const char *name) {
    return device ? udev_device_get_sysattr_value(device, name) : NULL;
}

double tk_bench_c_udev_list(int *count) {
    double start = now();
    struct udev *udev = udev_new();
    if (!udev) return -1;
    struct udev_enumerate *enumerate = udev_enumerate_new(udev);
    udev_enumerate_add_match_subsystem(enumerate, "tty");
    udev_enumerate_scan_devices(enumerate);
    int seen = 0;
    size_t checksum = 0;
    struct udev_list_entry *entry;
    udev_list_entry_foreach(entry, udev_enumerate_get_list_entry(enumerate)) {
        struct udev_device *device = udev_device_new_from_syspath(udev, udev_list_entry_get_name(entry));
        if (!device) continue;
        const char *node = udev_device_get_devnode(device);
        struct udev_device *interface = udev_device_get_parent_with_subsystem_devtype(device, "usb", "usb_interface");
        struct udev_device *usb = udev_device_get_parent_with_subsystem_devtype(device, "usb", "usb_device");
        const char *fields[] = {node, attr(interface, "bInterfaceNumber"), attr(usb, "idVendor"), attr(usb, "idProduct"),
                                attr(usb, "serial"), attr(usb, "manufacturer"), attr(usb, "product")};
        for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) checksum += fields[i] ? strlen(fields[i]) : 0;
        seen += udev_device_get_parent(device) != NULL;
        udev_device_unref(device);
    }
    udev_enumerate_unref(enumerate);
    udev_unref(udev);
    *count = seen;
    static volatile size_t sink;
    sink = checksum;  /* keep the attribute reads from being optimised away */
    return now() - start;
}

double tk_bench_c_uevent_latency(const char *uevent_path, int rounds) {
    struct udev *udev = udev_new();
    struct udev_monitor *monitor = udev_monitor_new_from_netlink(udev, "kernel");
    if (!monitor) return -1;
    udev_monitor_filter_add_match_subsystem_devtype(monitor, "tty", NULL);
    udev_monitor_enable_receiving(monitor);
    int fd = udev_monitor_get_fd(monitor);
    double total = 0;
    int done = 0;
    for (int i = 0; i < rounds; i++) {
        int file = open(uevent_path, O_WRONLY);
        if (file < 0) break;
        double start = now();
        if (write(file, "change", 6) != 6) { close(file); break; }
        close(file);
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 2000) <= 0) break;
        struct udev_device *device = udev_monitor_receive_device(monitor);
        if (!device) break;
        total += now() - start;
        done++;
        udev_device_unref(device);
    }
    udev_monitor_unref(monitor);
    udev_unref(udev);
    return done == rounds ? total / rounds : -1;
}

static int make_pty(int *master, int *slave) {
    if (openpty(master, slave, NULL, NULL, NULL) != 0) return -1;
    struct termios raw;
    tcgetattr(*master, &raw);
    cfmakeraw(&raw);
    tcsetattr(*master, TCSANOW, &raw);
    tcgetattr(*slave, &raw);
    cfmakeraw(&raw);
    tcsetattr(*slave, TCSANOW, &raw);
    return 0;
}

static int read_full(int fd, char *buffer, size_t length) {
    size_t got = 0;
    while (got < length) {
        ssize_t n = read(fd, buffer + got, length - got);
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

struct peer { int fd; int echo; size_t sink_total; };

static void *peer_main(void *argument) {
    struct peer *peer = argument;
    char buffer[65536];
    /* Until somebody opens the slave, the master polls as hung up (and reads EIO): wait for that. */
    for (int waited = 0; waited < 5000; waited++) {
        struct pollfd p = {.fd = peer->fd, .events = POLLIN};
        poll(&p, 1, 1);
        if (!(p.revents & POLLHUP)) break;
        usleep(1000);
    }
    if (peer->echo) {
        while (read_full(peer->fd, buffer, 32) == 0) {
            if (write(peer->fd, buffer, 32) != 32) break;
        }
    } else {
        size_t got = 0;
        while (got < peer->sink_total) {
            ssize_t n = read(peer->fd, buffer, sizeof buffer);
            if (n <= 0) break;
            got += (size_t)n;
        }
        if (write(peer->fd, "!", 1) != 1) { /* the reader is gone */ }
        /* Wait for the slave to close (EIO) before closing the master. */
        while (read(peer->fd, buffer, sizeof buffer) > 0) {}
    }
    close(peer->fd);
    free(peer);
    return NULL;
}

static int start_peer(int master, int echo, size_t sink_total) {
    struct peer *peer = malloc(sizeof *peer);
    if (!peer) return -1;
    *peer = (struct peer){.fd = master, .echo = echo, .sink_total = sink_total};
    pthread_t thread;
    if (pthread_create(&thread, NULL, peer_main, peer) != 0) { free(peer); return -1; }
    pthread_detach(thread);
    return 0;
}

double tk_bench_c_pty_round_trips(int rounds) {
    int master, slave;
    if (make_pty(&master, &slave) != 0 || start_peer(master, 1, 0) != 0) return -1;
    char message[32] = {7};
    double start = now();
    for (int i = 0; i < rounds; i++) {
        if (write(slave, message, 32) != 32 || read_full(slave, message, 32) != 0) { close(slave); return -1; }
    }
    double elapsed = now() - start;
    close(slave);
    return elapsed;
}

double tk_bench_c_pty_throughput(size_t total, size_t chunk) {
    int master, slave;
    if (make_pty(&master, &slave) != 0 || start_peer(master, 0, total) != 0) return -1;
    char *buffer = calloc(1, chunk);
    if (!buffer) return -1;
    double start = now();
    for (size_t sent = 0; sent < total; sent += chunk) {
        size_t part = total - sent < chunk ? total - sent : chunk;
        size_t off = 0;
        while (off < part) {
            ssize_t n = write(slave, buffer + off, part - off);
            if (n <= 0) { free(buffer); close(slave); return -1; }
            off += (size_t)n;
        }
    }
    char ack;
    int ok = read_full(slave, &ack, 1);
    double elapsed = now() - start;
    free(buffer);
    close(slave);
    return ok == 0 ? elapsed : -1;
}

int tk_bench_c_pty_peer(int echo, size_t sink_total, char *path, size_t path_length) {
    int master, slave;
    if (make_pty(&master, &slave) != 0) return -1;
    if (ptsname_r(master, path, path_length) != 0) { close(master); close(slave); return -1; }
    /* Keep the slave open until the peer thread runs, then hand it over: TransportKit opens it again. */
    if (start_peer(master, echo, sink_total) != 0) { close(master); close(slave); return -1; }
    close(slave);
    return 0;
}
