#!/usr/bin/python3
"""An RFC 2217 server written with pyserial (Debian's python3-serial): serial.rfc2217.PortManager
in front of a pyserial port, for TransportKit's rfc2217:// client.

Usage: rfc2217_server.py PORT-URL

PORT-URL is anything pyserial opens: `loop://` (a loopback device whose CTS follows RTS and DSR
follows DTR, so modem-line changes can be made from the client side) or a tty path. Listens on
127.0.0.1 with a port the kernel chooses, prints "ready PORT", then serves one client at a time
until killed. Every subnegotiation the client sends is logged to standard error by PortManager.
"""
import logging
import socket
import sys
import threading

import serial
import serial.rfc2217


class Connection:
    """What PortManager writes its answers through."""

    def __init__(self, sock):
        self.sock = sock
        self.lock = threading.Lock()

    def write(self, data):
        with self.lock:
            self.sock.sendall(data)


def serve(client, url):
    device = serial.serial_for_url(url, timeout=0.05)
    connection = Connection(client)
    manager = serial.rfc2217.PortManager(device, connection, logger=logging.getLogger("rfc2217"))
    done = threading.Event()

    def device_to_network():
        while not done.is_set():
            try:
                data = device.read(device.in_waiting or 1)
                if data:
                    connection.write(b"".join(manager.escape(data)))
                manager.check_modem_lines()
            except (OSError, serial.SerialException):
                break

    reader = threading.Thread(target=device_to_network, daemon=True)
    reader.start()
    try:
        while True:
            data = client.recv(4096)
            if not data:
                break
            device.write(b"".join(manager.filter(data)))
    except OSError:
        pass
    finally:
        done.set()
        reader.join(2)
        device.close()
        client.close()


def main(url):
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(message)s")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    print(f"ready {listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        try:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            serve(client, url)
        except OSError as error:
            # A client that left at once (a probe of the port): serve the next one.
            logging.getLogger("rfc2217").debug("client gone: %s", error)
            client.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    main(sys.argv[1])
