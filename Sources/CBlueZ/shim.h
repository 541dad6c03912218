// CBlueZ: the BlueZ user-space headers (libbluetooth-dev) as seen from Swift.
// Macros and ioctl numbers that the Swift importer cannot see are re-exposed as tk_bt_* helpers.
#ifndef TK_CBLUEZ_SHIM_H
#define TK_CBLUEZ_SHIM_H

#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <bluetooth/bluetooth.h>
#include <bluetooth/hci.h>
#include <bluetooth/hci_lib.h>
#include <bluetooth/l2cap.h>
#include <bluetooth/rfcomm.h>
#include <bluetooth/sdp.h>
#include <bluetooth/sdp_lib.h>

/// BDADDR_ANY, BDADDR_ALL and BDADDR_LOCAL are address-of-compound-literal macros.
static inline bdaddr_t tk_bt_bdaddr_any(void) { bdaddr_t a = {{0, 0, 0, 0, 0, 0}}; return a; }
static inline bdaddr_t tk_bt_bdaddr_all(void) { bdaddr_t a = {{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}}; return a; }
static inline bdaddr_t tk_bt_bdaddr_local(void) { bdaddr_t a = {{0, 0, 0, 0xff, 0xff, 0xff}}; return a; }

/// Byte-order helpers (macros in bluetooth.h).
static inline uint16_t tk_bt_htobs(uint16_t v) { return htobs(v); }
static inline uint32_t tk_bt_htobl(uint32_t v) { return htobl(v); }
static inline uint16_t tk_bt_btohs(uint16_t v) { return btohs(v); }
static inline uint32_t tk_bt_btohl(uint32_t v) { return btohl(v); }

/// HCI ioctl numbers (_IOW/_IOR macros).
static inline unsigned long tk_bt_ioctl_hcidevup(void) { return HCIDEVUP; }
static inline unsigned long tk_bt_ioctl_hcidevdown(void) { return HCIDEVDOWN; }
static inline unsigned long tk_bt_ioctl_hcigetdevlist(void) { return HCIGETDEVLIST; }
static inline unsigned long tk_bt_ioctl_hcigetdevinfo(void) { return HCIGETDEVINFO; }

/// Socket addresses for RFCOMM and L2CAP. `struct sockaddr_rc` and `struct sockaddr_l2` hold the
/// packed `bdaddr_t`, so their C layout is filled here rather than guessed from Swift.
static inline struct sockaddr_rc tk_bt_rfcomm_address(bdaddr_t address, uint8_t channel) {
    struct sockaddr_rc a;
    memset(&a, 0, sizeof a);
    a.rc_family = AF_BLUETOOTH;
    a.rc_bdaddr = address;
    a.rc_channel = channel;
    return a;
}
/// `addressType` is BDADDR_BREDR, BDADDR_LE_PUBLIC or BDADDR_LE_RANDOM; `psm` in host order.
static inline struct sockaddr_l2 tk_bt_l2cap_address(bdaddr_t address, uint8_t addressType, uint16_t psm) {
    struct sockaddr_l2 a;
    memset(&a, 0, sizeof a);
    a.l2_family = AF_BLUETOOTH;
    a.l2_bdaddr = address;
    a.l2_bdaddr_type = addressType;
    a.l2_psm = htobs(psm);
    return a;
}
static inline int tk_bt_rfcomm_bind(int fd, bdaddr_t address, uint8_t channel) {
    struct sockaddr_rc a = tk_bt_rfcomm_address(address, channel);
    return bind(fd, (struct sockaddr *)&a, sizeof a);
}
static inline int tk_bt_rfcomm_connect(int fd, bdaddr_t address, uint8_t channel) {
    struct sockaddr_rc a = tk_bt_rfcomm_address(address, channel);
    return connect(fd, (struct sockaddr *)&a, sizeof a);
}
static inline int tk_bt_l2cap_bind(int fd, bdaddr_t address, uint8_t addressType, uint16_t psm) {
    struct sockaddr_l2 a = tk_bt_l2cap_address(address, addressType, psm);
    return bind(fd, (struct sockaddr *)&a, sizeof a);
}
static inline int tk_bt_l2cap_connect(int fd, bdaddr_t address, uint8_t addressType, uint16_t psm) {
    struct sockaddr_l2 a = tk_bt_l2cap_address(address, addressType, psm);
    return connect(fd, (struct sockaddr *)&a, sizeof a);
}
/// accept4(2) on a listening L2CAP socket: the new socket (non-blocking, close-on-exec) and the
/// peer's address and address type, or -1 with errno.
static inline int tk_bt_l2cap_accept(int fd, bdaddr_t *peer, uint8_t *addressType) {
    struct sockaddr_l2 a;
    socklen_t length = sizeof a;
    memset(&a, 0, sizeof a);
    int client = accept4(fd, (struct sockaddr *)&a, &length, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (client >= 0) {
        *peer = a.l2_bdaddr;
        *addressType = a.l2_bdaddr_type;
    }
    return client;
}

#endif
