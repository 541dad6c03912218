#!/usr/bin/python3
"""bleak (Debian's python3-bleak 0.20) as the central against a GATT server under test.

Usage: bleak_central.py ADDRESS READ_UUID WRITE_UUID NOTIFY_UUID [ADAPTER]

Scans hci0 for ADDRESS, connects, reads READ_UUID, writes 01 02 03 (with response) to
WRITE_UUID, subscribes to NOTIFY_UUID and waits for one value, then keeps the link 3 s and says
whether it held. One event loop for the whole run: bleak sends Device1.Disconnect when the loop
that connected ends (its disconnect monitor is cancelled), which a run per step would do.
Each step prints one line; the exit status is 0 only if every step passed.
"""
import asyncio
import sys

from bleak import BleakClient, BleakScanner
from bleak.exc import BleakError


async def main(address, read_uuid, write_uuid, notify_uuid, adapter):
    device = await BleakScanner.find_device_by_address(address, timeout=20.0, adapter=adapter)
    if device is None:
        print(f"not found: {address} on {adapter}", flush=True)
        return 2
    print(f"found {device.address}", flush=True)
    # bluetoothd may resolve the services from its cache of the device, taken before the server
    # under test was published, and read the new ones only on Service Changed: bleak keeps the
    # services it got at connect, so one connect more takes the current ones.
    # bleak 0.20 can also fail its own service walk while bluetoothd replaces the services under
    # it (KeyError 'org.bluez.GattService1' in manager.get_services), or see the emulated link
    # drop during service discovery ("failed to discover services, device disconnected"; each
    # seen in CI runs): that connect is tried again too, up to five in all.
    for attempt in (1, 2, 3, 4, 5):
        try:
            async with BleakClient(device, adapter=adapter, timeout=20.0) as client:
                if client.services.get_characteristic(read_uuid) is None and attempt < 5:
                    print("services without the characteristic (bluetoothd's cache): connecting again", flush=True)
                    await asyncio.sleep(2.0)
                    continue
                return await exchange(client, read_uuid, write_uuid, notify_uuid)
        except (KeyError, BleakError) as error:
            if attempt == 5 or (isinstance(error, BleakError) and "disconnected" not in str(error)):
                raise
            print(f"bleak's connect failed ({error!r}): connecting again", flush=True)
            await asyncio.sleep(2.0)
    return 5


async def exchange(client, read_uuid, write_uuid, notify_uuid):
    value = await client.read_gatt_char(read_uuid)
    print(f"read {bytes(value).hex()}", flush=True)
    await client.write_gatt_char(write_uuid, b"\x01\x02\x03", response=True)
    print("wrote 010203", flush=True)
    values = asyncio.Queue()
    await client.start_notify(notify_uuid, lambda _, data: values.put_nowait(bytes(data)))
    print("subscribed", flush=True)
    notified = await asyncio.wait_for(values.get(), 15.0)
    print(f"notified {notified.hex()}", flush=True)
    await asyncio.sleep(3.0)
    print(f"connected after 3 s: {client.is_connected}", flush=True)
    return 0 if client.is_connected else 3


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if len(arguments) not in (4, 5):
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    adapter = arguments[4] if len(arguments) == 5 else "hci0"
    # bleak 0.20 bounds the scan, the connect and the disconnect, not a read, a write or
    # start_notify: the whole run gets a limit, so a wedged bluetoothd ends it with status 4.
    try:
        sys.exit(asyncio.run(asyncio.wait_for(main(*arguments[:4], adapter), 90.0)))
    except asyncio.TimeoutError:
        print("timed out after 90 s", flush=True)
        sys.exit(4)
