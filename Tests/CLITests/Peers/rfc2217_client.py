#!/usr/bin/python3
"""RFC 2217 clients no one here wrote against `transportkit bridge --listen rfc2217://127.0.0.1:0
spy+tty://PTY`, for RFC2217BridgeTests. The script makes the pty, runs the bridge in front of it,
and prints one line per check ("ok NAME", "FAIL NAME: why", or "skip NAME: why"); the exit
status is 0 only if no check failed. The target is spy+tty://, whose trace shows the port's
control calls (a pty keeps only the speed and the stop bits of what is set; tcgetattr on it
shows those).

Usage: rfc2217_client.py TRANSPORTKIT [pyserial|gensiot|cyclades]

pyserial (Debian's python3-serial, every answer checked: no ign_set_control): opens the port at
57600 bits/s with two stop bits; bytes both ways (0xff included), DTR/RTS answered on a port
without modem lines, a baud change at run time, purges, and an open-ended break (held from BREAK
on to BREAK off, and released when a client leaves with it on).

gensiot (gensio 2.6, `telnet(rfc2217)` as a client): bytes both ways; its escape keys set 19200
bits/s, even parity, 7 data bits and 2 stop bits, ask for the signature and the settings (its
answer is printed), and send Telnet's break key (IAC BRK: a 250 ms break on the port).

cyclades (cyclades-serial-client 0.94): cyclades-ser-cli makes a local pty linked at a path and
speaks RFC 2217 to the bridge; bytes both ways through that pty; and, as root, `stty 19200
cstopb` on it through its LD_PRELOAD library (which reads /etc/cyclades-devices: a private mount
namespace binds a file naming the link over it) reaches the served pty.
"""
import json
import os
import pty
import shlex
import signal
import subprocess
import sys
import tempfile
import termios
import time
import tty

import serial


failures = 0


def check(label, passed, why=""):
    global failures
    print(f"ok {label}" if passed else f"FAIL {label}: {why}", flush=True)
    failures += 0 if passed else 1


def control_calls(trace, name, count):
    """The spy trace's CTRL lines about `name` ("break on", "break off → ok", …), once there
    are `count` of them (or after 5 s)."""
    calls = []
    for _ in range(50):
        with open(trace, errors="replace") as file:
            calls = [line.split("CTRL  ", 1)[1].strip() for line in file if f"CTRL  {name}" in line]
        if len(calls) >= count:
            break
        time.sleep(0.1)
    return calls


def wait_for_termios(master, condition):
    """The pty's termios once `condition` holds for it (or after 5 s)."""
    attrs = termios.tcgetattr(master)
    for _ in range(50):
        if condition(attrs):
            break
        time.sleep(0.1)
        attrs = termios.tcgetattr(master)
    return attrs


def read_until(fd, expected, seconds=5):
    """Bytes read from the non-blocking `fd` until they contain `expected` (or `seconds` pass). A
    pty's master reads EIO until the bridge has opened the other side (at its first client)."""
    received = b""
    deadline = time.monotonic() + seconds
    while expected not in received and time.monotonic() < deadline:
        try:
            more = os.read(fd, 4096)
        except (BlockingIOError, OSError):
            time.sleep(0.05)
            continue
        if not more:
            break  # the other side is gone
        received += more
    return received


def main(transportkit, client):
    # A test runner's thread may have blocked signals, and children inherit the mask: the
    # clients and the bridge are stopped with SIGTERM, so none is blocked for them.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    master, slave = pty.openpty()
    tty.setraw(master)
    name = os.ttyname(slave)
    os.close(slave)
    directory = tempfile.mkdtemp(prefix="rfc2217-client-")
    trace = os.path.join(directory, "trace.txt")
    # Its standard output is not the test runner's pipe: a bridge that outlived this script
    # would hold that pipe open.
    bridge = subprocess.Popen([transportkit, "bridge", "--json", "--listen", "rfc2217://127.0.0.1:0", f"spy+tty://{name}?spy.file={trace}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        while port is None:
            line = bridge.stderr.readline()
            if not line:
                print("FAIL bridge: it ended before listening", flush=True)
                return 1
            event = json.loads(line)
            if event.get("event") == "listening":
                port = int(event["url"].rsplit(":", 1)[1])
        {"pyserial": pyserial, "gensiot": gensiot, "cyclades": cyclades}[client](port, master, trace)
    except Exception as error:  # every failure is reported as a line, with the exit status
        check("exception", False, repr(error))
    finally:
        stop(bridge)
        if os.path.exists(trace):
            os.unlink(trace)
        os.rmdir(directory)
    return 0 if failures == 0 else 1


def stop(process):
    """Ends `process`: TERM, and KILL if it is still there after 10 s."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def pyserial(port, master, trace):
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
    breaks = control_calls(trace, "break", 8)
    calls = [line for line in breaks if "→" not in line]
    check("break", calls == ["break on", "break off", "break on", "break off"]
          and breaks.count("break on → ok") == 2 and breaks.count("break off → ok") == 2, repr(breaks))


def gensiot(port, master, trace):
    # -e 28: Ctrl-\ is the escape character (gensiot turns it on only for a terminal otherwise).
    client = subprocess.Popen(["gensiot", "-e", "28", f"telnet(rfc2217),tcp,127.0.0.1,{port}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    os.set_blocking(client.stdout.fileno(), False)

    def send(data):
        client.stdin.write(data)
        client.stdin.flush()

    try:
        # Its escapes are ignored until the connection is open: the first bytes' arrival says it is.
        send(b"to the device \xff end")
        os.set_blocking(master, False)
        received = read_until(master, b"to the device \xff end")
        check("to-device", received == b"to the device \xff end", repr(received))
        os.write(master, b"from the device \xff end")
        received = read_until(client.stdout.fileno(), b"from the device \xff end")
        check("from-device", b"from the device \xff end" in received, repr(received))
        # SET-BAUDRATE, -PARITY, -DATASIZE, -STOPSIZE; then the queries (signature and each value).
        for key in [b"s19200\n", b"e", b"7", b"2"]:
            send(b"\x1c" + key)
        attrs = wait_for_termios(master, lambda a: a[4] == termios.B19200 and a[2] & termios.CSTOPB != 0)
        check("settings", attrs[4] == termios.B19200 and attrs[2] & termios.CSTOPB != 0, f"speed {attrs[4]}, cflag {attrs[2]:o}")
        # Each key is one SET, applied on its own: the pty refuses even parity and 7 bits (it
        # keeps 8N1), so the answers say 8 and none.
        settings = control_calls(trace, "settings ", 8)
        check("settings-asked", all(asked in settings for asked in ["settings 19200 8E1", "settings 19200 7N1", "settings 19200 8N2 → ok"]),
              repr(settings))
        send(b"\x1cd")
        answer = read_until(client.stdout.fileno(), b"Speed:")
        answer += read_until(client.stdout.fileno(), b"\n", 2)
        # The pty kept 8 bits and no parity: the answers say what is in force, as RFC 2217 asks.
        check("queries", b"Signature: TransportKit" in answer and b"Speed: 19200N82" in answer, repr(answer))
        send(b"\x1cb")
        breaks = control_calls(trace, "break", 4)
        check("break-key", [line for line in breaks if "→" not in line] == ["break on", "break off"], repr(breaks))
        send(b"\x1cq")
        check("quit", client.wait(5) == 0, "gensiot did not end after its escape q")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()


def cyclades(port, master, trace):
    directory = tempfile.mkdtemp(prefix="rfc2217-cyclades-")
    link = os.path.join(directory, "ttyCyc")
    # The TCP port is -p base plus the physical port; 0 would mean port 23.
    client = subprocess.Popen(["cyclades-ser-cli", "-x", "-m", "1", "-p", str(port - 1), link, "127.0.0.1", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fd = None
    try:
        for _ in range(50):
            if os.path.exists(link):
                break
            time.sleep(0.1)
        fd = os.open(link, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
        tty.setraw(fd)
        os.set_blocking(master, False)
        # It connects a second after it starts, then asks for every setting and waits for each
        # answer before it passes data.
        os.write(fd, b"to the device \xff end")
        received = read_until(master, b"to the device \xff end", 10)
        check("to-device", received == b"to the device \xff end", repr(received))
        os.write(master, b"from the device \xff end")
        received = read_until(fd, b"from the device \xff end")
        check("from-device", received == b"from the device \xff end", repr(received))
        if os.geteuid() != 0:
            print("skip settings: binding a file over /etc/cyclades-devices needs root", flush=True)
            return
        devices = os.path.join(directory, "devices")
        with open(devices, "w") as file:
            file.write(f"{link}:prts:127.0.0.1:1:rtelnet:\n")
        # Its library turns tcsetattr into SET-BAUDRATE, … (stty then reports a partial failure:
        # the library garbles the local pty's flags).
        # A private mount namespace: the bind is seen by this shell alone, never by the machine.
        stty = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               f"mount --bind {shlex.quote(devices)} /etc/cyclades-devices && "
                               f"LD_PRELOAD=/usr/lib/libcyclades-ser-cli.so stty -F {shlex.quote(link)} 19200 cstopb"],
                              capture_output=True, text=True, timeout=20)
        attrs = wait_for_termios(master, lambda a: a[4] == termios.B19200 and a[2] & termios.CSTOPB != 0)
        check("settings", attrs[4] == termios.B19200 and attrs[2] & termios.CSTOPB != 0,
              f"speed {attrs[4]}, cflag {attrs[2]:o}; unshare/stty said: {stty.stderr.strip()!r}")
    finally:
        if fd is not None:
            os.close(fd)
        stop(client)
        for entry in os.listdir(directory):
            os.unlink(os.path.join(directory, entry))
        os.rmdir(directory)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and sys.argv[2] not in ("pyserial", "gensiot", "cyclades")):
        print(__doc__, file=sys.stderr)
        sys.exit(64)
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "pyserial"))
