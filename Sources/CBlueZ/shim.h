// CBlueZ: the BlueZ user-space headers (libbluetooth-dev) as seen from Swift.
// Macros and ioctl numbers that the Swift importer cannot see are re-exposed as tk_bt_* helpers.
#ifndef TK_CBLUEZ_SHIM_H
#define TK_CBLUEZ_SHIM_H

#include <sys/ioctl.h>
#include <sys/socket.h>
#include <bluetooth/bluetooth.h>
#include <bluetooth/hci.h>
#include <bluetooth/hci_lib.h>
#include <bluetooth/l2cap.h>
#include <bluetooth/rfcomm.h>

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

#endif
