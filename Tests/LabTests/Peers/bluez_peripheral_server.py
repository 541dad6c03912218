#!/usr/bin/python3
"""A GATT server written with bluez-peripheral (PyPI, on dbus-next), for TransportKit's central.

Usage: bluez_peripheral_server.py ADAPTER

Publishes one service (SERVICE below) on ADAPTER through bluetoothd's GattManager1:
  LONG    read: 100 bytes 0..99, cut at the offset the central asks for (a long read)
  STORED  read, write with and without response: keeps the last value, prints "wrote HEX"
  TICKER  read, notify: while a central is subscribed, notifies a counter every 200 ms
Prints "ready" once registered and runs until killed. Lines are flushed as they are printed.
"""
import asyncio
import sys

from bluez_peripheral.gatt.characteristic import CharacteristicFlags as Flags
from bluez_peripheral.gatt.characteristic import characteristic
from bluez_peripheral.gatt.service import Service, ServiceCollection
from bluez_peripheral.util import Adapter, get_message_bus

SERVICE = "7e1a0000-6c3d-4b8e-9f1a-3c5e2d4b6a70"
LONG = "7e1a0001-6c3d-4b8e-9f1a-3c5e2d4b6a70"
STORED = "7e1a0002-6c3d-4b8e-9f1a-3c5e2d4b6a70"
TICKER = "7e1a0003-6c3d-4b8e-9f1a-3c5e2d4b6a70"


class Exchange(Service):
    def __init__(self):
        self.stored = b"\x00"
        self.count = 0
        super().__init__(SERVICE, True)

    @characteristic(LONG, Flags.READ)
    def long(self, options):
        return bytes(range(100))[options.offset:]

    @characteristic(STORED, Flags.READ | Flags.WRITE | Flags.WRITE_WITHOUT_RESPONSE)
    def stored_value(self, options):
        return self.stored[options.offset:]

    @stored_value.setter
    def stored_value(self, value, options):
        self.stored = bytes(value)
        print(f"wrote {self.stored.hex()}", flush=True)

    @characteristic(TICKER, Flags.READ | Flags.NOTIFY)
    def ticker(self, options):
        return bytes([self.count % 256])

    async def tick(self):
        while True:
            await asyncio.sleep(0.2)
            self.count += 1
            self.ticker.changed(bytes([self.count % 256]))


async def main(adapter_name):
    bus = await get_message_bus()
    path = "/org/bluez/" + adapter_name
    adapter = Adapter(bus.get_proxy_object("org.bluez", path, await bus.introspect("org.bluez", path)))
    service = Exchange()
    await ServiceCollection([service]).register(bus, adapter=adapter)
    print("ready", flush=True)
    await service.tick()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    asyncio.run(main(sys.argv[1]))
