#!/usr/bin/python3
"""pyserial's rfc2217:// client (Debian's python3-serial, every answer checked: no ign_set_control)
against `transportkit bridge --listen rfc2217://127.0.0.1:0 tty://PTY`, for RFC2217BridgeTests.

Usage: rfc2217_client.py TRANSPORTKIT

Makes a pty, runs the bridge in front of it, opens the port through the bridge at 57600 bits/s
with two stop bits, and prints one line per check ("ok NAME" or "FAIL NAME: why"): the settings
read from the pty's termios, bytes both ways (0xff included), DTR/RTS answered on a port without
modem lines, a baud change at run time, purges, and an open-ended break (held from BREAK on to
BREAK off, and released when a client leaves with it on: the target is spy+tty://, whose trace
shows the port's break calls). Exit status 0 only if every check passed.
"""
import json
import os
import pty
import subprocess
import sys
import tempfile
import termios
import time
import tty

import serial


def main(transportkit):
    master, slave = pty.openpty()
    tty.setraw(master)
    name = os.ttyname(slave)
    os.close(slave)
    trace = tempfile.mktemp(prefix="rfc2217-break-", suffix=".txt")
    bridge = subprocess.Popen([transportkit, "bridge", "--json", "--listen", "rfc2217://127.0.0.1:0", f"spy+tty://{name}?spy.file={trace}"],
                              stderr=subprocess.PIPE, text=True)
    failures = 0

    def check(label, passed, why=""):
        nonlocal failures
        print(f"ok {label}" if passed else f"FAIL {label}: {why}", flush=True)
        failures += 0 if passed else 1

    try:
        port = None
        while port is None:
            line = bridge.stderr.readline()
            if not line:
                print("FAIL bridge: it ended before listening", flush=True)
                return 1
            event = json.loads(line)
            if event.get("event") == "listening":
                port = event["url"].rsplit(":", 1)[1]
        # pyserial waits for every answer at open (settings, flow control, DTR, RTS, both purges).
        client = serial.serial_for_url(f"rfc2217://127.0.0.1:{port}", baudrate=57600, stopbits=2, timeout=3)
        attrs = termios.tcgetattr(master)
        check("settings", attrs[4] == termios.B57600 and attrs[2] & termios.CSTOPB != 0, f"speed {attrs[4]}, cflag {attrs[2]:o}")
        client.write(b"to the device \xff\xff end")
        time.sleep(0.5)
        received = os.read(master, 100)
        check("to-device", received == b"to the device \xff\xff end", repr(received))
        os.write(master, b"from the device \xff end")
        received = client.read(21)
        check("from-device", received == b"from the device \xff end", repr(received))
        client.dtr = False
        client.rts = True
        check("lines", True)
        client.baudrate = 19200
        attrs = termios.tcgetattr(master)
        check("baud-at-run-time", attrs[4] == termios.B19200, f"speed {attrs[4]}")
        client.reset_input_buffer()
        client.reset_output_buffer()
        check("purge", True)
        # pyserial waits for each BREAK answer and rejects one that differs from its request.
        client.break_condition = True
        time.sleep(0.3)
        client.break_condition = False
        client.break_condition = True
        client.close()  # with BREAK on: the bridge releases it
        breaks = []
        for _ in range(50):
            with open(trace, errors="replace") as file:
                breaks = [line.split("CTRL  ", 1)[1].strip() for line in file if "CTRL  break" in line]
            if len(breaks) >= 8:
                break
            time.sleep(0.1)
        calls = [line for line in breaks if "→" not in line]
        check("break", calls == ["break on", "break off", "break on", "break off"]
              and breaks.count("break on → ok") == 2 and breaks.count("break off → ok") == 2, repr(breaks))
    except Exception as error:  # every failure is reported as a line, with the exit status
        check("exception", False, repr(error))
    finally:
        bridge.terminate()
        bridge.wait(10)
        if os.path.exists(trace):
            os.unlink(trace)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    sys.exit(main(sys.argv[1]))
