// The plain libusb loop beside usb:// (usb_loops.h): open(2), libusb_wrap_sys_device, claim, then
// `transfers` OUT and IN bulk transfers resubmitted from their callbacks until `total` bytes went
// out and came back. The same transfer count and size the plugin is given. With `handover`, the
// loop also hands its bytes over as a library must (see usb_loops.h).
#include "usb_loops.h"
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <fcntl.h>
#include <libusb-1.0/libusb.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/// The hand-over: filled IN buffers wait in `list` for the consumer thread, which frees them.
struct handover {
    pthread_mutex_t lock;
    pthread_cond_t ready;
    void **list, **taken;
    int count, capacity, taken_capacity, waiting, done;
};

struct echo {
    long long total, sent_submitted, received;
    int size, in_flight, failed;
    struct handover *handover;
};

/// Under the lock: appends a filled buffer; 0 when out of memory.
static int hand(struct handover *h, void *buffer) {
    if (h->count == h->capacity) {
        int capacity = h->capacity ? 2 * h->capacity : 64;
        void **grown = realloc(h->list, (size_t)capacity * sizeof *grown);
        if (!grown) return 0;
        h->list = grown;
        h->capacity = capacity;
    }
    h->list[h->count++] = buffer;
    return 1;
}

/// The consumer: woken once per libusb_handle_events round, takes every waiting buffer at once.
static void *consume(void *arg) {
    struct handover *h = arg;
    pthread_mutex_lock(&h->lock);
    for (;;) {
        while (h->count == 0 && !h->done) {
            h->waiting = 1;
            pthread_cond_wait(&h->ready, &h->lock);
            h->waiting = 0;
        }
        if (h->count == 0) break;
        void **buffers = h->list;
        int count = h->count, capacity = h->capacity;
        h->list = h->taken;
        h->capacity = h->taken_capacity;
        h->count = 0;
        pthread_mutex_unlock(&h->lock);
        for (int i = 0; i < count; i++) free(buffers[i]);
        pthread_mutex_lock(&h->lock);
        h->taken = buffers;
        h->taken_capacity = capacity;
    }
    pthread_mutex_unlock(&h->lock);
    return NULL;
}

static void out_done(struct libusb_transfer *t) {
    struct echo *e = t->user_data;
    e->in_flight--;
    if (t->status != LIBUSB_TRANSFER_COMPLETED) { e->failed = 1; return; }
    if (e->sent_submitted < e->total) {
        long long left = e->total - e->sent_submitted;
        t->length = left < e->size ? (int)left : e->size;
        e->sent_submitted += t->length;
        if (libusb_submit_transfer(t) == 0) e->in_flight++; else e->failed = 1;
    }
}

static void in_done(struct libusb_transfer *t) {
    struct echo *e = t->user_data;
    e->in_flight--;
    if (t->status != LIBUSB_TRANSFER_COMPLETED) { if (t->status != LIBUSB_TRANSFER_CANCELLED) e->failed = 1; return; }
    e->received += t->actual_length;
    if (e->handover) {
        // The filled buffer goes to the consumer; the transfer reads into a new one.
        void *fresh = malloc((size_t)e->size);
        pthread_mutex_lock(&e->handover->lock);
        int handed = fresh && hand(e->handover, t->buffer);
        pthread_mutex_unlock(&e->handover->lock);
        if (!handed) { free(fresh); e->failed = 1; return; }
        t->buffer = fresh;
    }
    if (e->received < e->total) {
        if (libusb_submit_transfer(t) == 0) e->in_flight++; else e->failed = 1;
    }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double tk_bench_c_usb_echo(const char *path, int interface, unsigned char out_endpoint, unsigned char in_endpoint,
                           int transfers, int size, long long total, int handover, long long *received) {
    *received = 0;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return -1000.0 - errno;
    libusb_context *context = NULL;
    libusb_device_handle *handle = NULL;
    int result = libusb_init(&context);
    if (result == 0) result = libusb_wrap_sys_device(context, (intptr_t)fd, &handle);
    if (result == 0) result = libusb_claim_interface(handle, interface);
    if (result != 0) {
        if (handle) libusb_close(handle);
        if (context) libusb_exit(context);
        close(fd);
        return result;
    }
    struct echo e = { .total = total, .size = size };
    struct handover h = { .lock = PTHREAD_MUTEX_INITIALIZER, .ready = PTHREAD_COND_INITIALIZER };
    pthread_t consumer = 0;
    if (handover) {
        if (pthread_create(&consumer, NULL, consume, &h) != 0) {
            libusb_release_interface(handle, interface);
            libusb_close(handle);
            libusb_exit(context);
            close(fd);
            return -1.0;
        }
        e.handover = &h;
    }
    struct libusb_transfer *all[2 * 64];
    int count = transfers > 64 ? 128 : 2 * transfers;
    double started = now();
    for (int i = 0; i < count; i++) {
        int is_in = i % 2;
        all[i] = libusb_alloc_transfer(0);
        unsigned char *buffer = malloc((size_t)size);
        if (!is_in) memset(buffer, i, (size_t)size);
        libusb_fill_bulk_transfer(all[i], handle, is_in ? in_endpoint : out_endpoint, buffer, size,
                                  is_in ? in_done : out_done, &e, 0);
        if (!is_in) {
            if (e.sent_submitted >= total) continue;
            long long left = total - e.sent_submitted;
            all[i]->length = left < size ? (int)left : size;
            e.sent_submitted += all[i]->length;
        }
        if (libusb_submit_transfer(all[i]) == 0) e.in_flight++; else e.failed = 1;
    }
    while (e.received < total && !e.failed) {
        struct timeval wait = { 1, 0 };
        libusb_handle_events_timeout_completed(context, &wait, NULL);
        if (handover) {
            pthread_mutex_lock(&h.lock);
            if (h.count > 0 && h.waiting) pthread_cond_signal(&h.ready);
            pthread_mutex_unlock(&h.lock);
        }
    }
    double elapsed = now() - started;
    if (handover) {
        pthread_mutex_lock(&h.lock);
        h.done = 1;
        pthread_cond_signal(&h.ready);
        pthread_mutex_unlock(&h.lock);
        pthread_join(consumer, NULL);
        // A transfer that completes while the rest are cancelled keeps its buffer (freed below).
        e.handover = NULL;
        for (int i = 0; i < h.count; i++) free(h.list[i]);
        free(h.list);
        free(h.taken);
    }
    for (int i = 0; i < count; i++) libusb_cancel_transfer(all[i]);
    while (e.in_flight > 0) {
        struct timeval wait = { 1, 0 };
        libusb_handle_events_timeout_completed(context, &wait, NULL);
    }
    for (int i = 0; i < count; i++) {
        free(all[i]->buffer);
        libusb_free_transfer(all[i]);
    }
    libusb_release_interface(handle, interface);
    libusb_close(handle);
    libusb_exit(context);
    close(fd);
    *received = e.received;
    return e.failed ? -1.0 : elapsed;
}
