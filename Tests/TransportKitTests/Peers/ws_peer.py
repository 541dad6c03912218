#!/usr/bin/python3
"""WebSocket peers for WebSocketTests: python3-websockets as a real server and client, and raw
sockets for the frames no correct implementation sends (RFC 6455 case table).

  ws_peer.py serve PORT [CERT KEY]      websockets server (wss with CERT and KEY); paths below
  ws_peer.py raw PORT CASE              one-shot server: a correct 101, then CASE's frames;
                                        prints "close CODE" for the close frame it gets back
  (servers print "ready PORT" once they listen; PORT 0 picks a free one, with no race)
  ws_peer.py client URL [CAFILE]        websockets client: text, binary, prints what comes back
  ws_peer.py rawclient PORT PATH CASE   raw client of our listener; prints "close CODE"
"""
import asyncio, base64, hashlib, json, os, socket, ssl, struct, sys, zlib

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def log(*parts):
    print(*parts, flush=True)


# ---- websockets server -------------------------------------------------------------------------

async def serve(port, cert=None, key=None):
    import websockets
    from http import HTTPStatus

    async def process_request(path, headers):
        if path.startswith("/reject401"):
            return HTTPStatus.UNAUTHORIZED, [], b"token required\n"
        if path.startswith("/reject403"):
            return HTTPStatus.FORBIDDEN, [], b"not you\n"
        return None

    async def handler(ws, path):
        if path.startswith("/headers"):
            await ws.send(json.dumps({
                "path": path,
                "origin": ws.request_headers.get("Origin"),
                "authorization": ws.request_headers.get("Authorization"),
                "cookie": ws.request_headers.get("Cookie"),
                "subprotocol": ws.subprotocol,
            }))
            await ws.wait_closed()
        elif path.startswith("/close4000"):
            await ws.close(4000, "custom reason")
        elif path.startswith("/bye"):
            await ws.send("bye")
            await ws.close(1000, "done")
        elif path.startswith("/big"):
            size = int(path.split("=")[1])
            await ws.send(b"x" * size)
            await ws.wait_closed()
        else:
            async for message in ws:
                await ws.send(message)

    context = None
    if cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
    async with websockets.serve(handler, "127.0.0.1", port, process_request=process_request,
                                subprotocols=["chat.v2", "chat.v1"], ssl=context,
                                max_size=4 << 20, ping_interval=None) as server:
        log("ready", server.sockets[0].getsockname()[1])
        await asyncio.Future()


# ---- raw frames ----------------------------------------------------------------------------------

def frame(opcode, payload=b"", fin=True, rsv=0, mask=None, length=None):
    first = (0x80 if fin else 0) | (rsv << 4) | opcode
    n = len(payload) if length is None else length
    mask_bit = 0x80 if mask is not None else 0
    if n < 126:
        head = struct.pack("!BB", first, mask_bit | n)
    elif n < 65536:
        head = struct.pack("!BBH", first, mask_bit | 126, n)
    else:
        head = struct.pack("!BBQ", first, mask_bit | 127, n)
    if mask is not None:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return head + mask + payload
    return head + payload


def read_exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def read_frame(conn):
    b1, b2 = read_exact(conn, 2)
    n = b2 & 0x7F
    if n == 126:
        n = struct.unpack("!H", read_exact(conn, 2))[0]
    elif n == 127:
        n = struct.unpack("!Q", read_exact(conn, 8))[0]
    mask = read_exact(conn, 4) if b2 & 0x80 else None
    payload = read_exact(conn, n)
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return b1 & 0x0F, payload, bool(b2 & 0x80)


def report_frames(conn, answer_pings=True):
    """Prints the frames the other side sends until it closes: 'text …', 'ping', 'close CODE'."""
    try:
        while True:
            opcode, payload, masked = read_frame(conn)
            if opcode == 8:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else "none"
                log("close", code)
                return
            if opcode == 9:
                log("ping")
                if answer_pings:
                    conn.sendall(frame(10, payload))
            elif opcode == 10:
                log("pong")
            elif opcode == 1:
                log("text", payload.decode())
            elif opcode == 2:
                log("binary", len(payload))
    except (EOFError, ConnectionError):
        log("eof")


RAW_SERVER_CASES = {
    # case: (frames to send, answer pings)
    "masked": [frame(1, b"hi", mask=b"abcd")],
    "rsv1": [frame(1, b"hi", rsv=4)],
    "opcode3": [frame(3, b"hi")],
    "badutf8": [frame(1, b"\xff\xfe\xfd")],
    "fragmentedping": [frame(9, b"x", fin=False)],
    "longping": [frame(9, b"x" * 126)],
    "orphancontinuation": [frame(0, b"lo")],
    "newduringfragment": [frame(1, b"Hel", fin=False), frame(1, b"lo")],
    "toobig": [frame(2, b"y" * 2000)],
    "toobigfragments": [frame(2, b"y" * 700, fin=False), frame(0, b"y" * 700)],
    "closecode999": [frame(8, struct.pack("!H", 999))],
    "close1byte": [frame(8, b"\x03")],
    "fragmented": [frame(1, "Hé".encode()[:2], fin=False), frame(9, b"mid"), frame(0, "Hé".encode()[2:] + b"llo"),
                   frame(2, b""), frame(8, struct.pack("!H", 1000) + b"done")],
    "nopong": [],
    "noclose": [],
    # After the 101, in the same write: a message and a close (or only a FIN), then the socket ends.
    "burst": [frame(1, b"first"), frame(8, struct.pack("!H", 1000))],
    "finwithoutclose": [frame(1, b"first")],
    "silentfin": [],
    # permessage-deflate with each message a whole DEFLATE stream ending in a final block (BFINAL).
    "bfinal": [],
}


def final_block(data):
    compressor = zlib.compressobj(wbits=-15)
    return compressor.compress(data) + compressor.flush(zlib.Z_FINISH)


def raw_server(port, case):
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1)
    log("ready", listener.getsockname()[1])
    conn, _ = listener.accept()
    request = b""
    while b"\r\n\r\n" not in request:
        request += conn.recv(4096)
    if case == "silentfin":
        conn.shutdown(socket.SHUT_WR)
        log("eof" if not conn.recv(4096) else "data")
        return
    key = [l.split(b":", 1)[1].strip() for l in request.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    answer = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: "
              + accept + b"\r\n")
    if case == "bfinal":
        answer += b"Sec-WebSocket-Extensions: permessage-deflate\r\n"
        frames = [frame(1, final_block(b"one " * 50), rsv=4), frame(1, final_block(b"two " * 50), rsv=4),
                  frame(8, struct.pack("!H", 1000))]
    else:
        frames = RAW_SERVER_CASES[case]
    if case in ("burst", "finwithoutclose"):
        conn.sendall(answer + b"\r\n" + b"".join(frames))
        conn.shutdown(socket.SHUT_WR)
        report_frames(conn)
        conn.close()
        return
    conn.sendall(answer + b"\r\n")
    for data in frames:
        conn.sendall(data)
    if case == "nopong":
        # Reads (so the client's pings are taken) and never answers them.
        report_frames(conn, answer_pings=False)
    elif case == "noclose":
        # Takes everything and answers nothing, the close frame included.
        try:
            while conn.recv(4096):
                pass
        except ConnectionError:
            pass
        log("eof")
    else:
        report_frames(conn)
    conn.close()


# ---- clients -------------------------------------------------------------------------------------

async def client(url, cafile=None):
    import websockets
    context = ssl.create_default_context(cafile=cafile) if url.startswith("wss") else None
    async with websockets.connect(url, ssl=context, subprotocols=["chat.v1"]) as ws:
        log("subprotocol", ws.subprotocol)
        log("extensions", ",".join(e.name for e in ws.extensions) or "none")
        await ws.send("text é")
        reply = await ws.recv()
        log("reply", type(reply).__name__, reply if isinstance(reply, str) else reply.hex())
        await ws.send(b"\x00\x01\x02")
        reply = await ws.recv()
        log("reply", type(reply).__name__, reply if isinstance(reply, str) else reply.hex())
        await ws.close(1000, "finished")
        log("closed", ws.close_code)


RAW_CLIENT_CASES = {
    "unmasked": frame(1, b"hi"),
    "toobig": frame(2, b"z" * 2000, mask=b"wxyz"),
    "badutf8": frame(1, b"\xc3\x28", mask=b"wxyz"),
    "rsv2": frame(2, b"z", rsv=2, mask=b"wxyz"),
}


def raw_client(port, path, case):
    conn = socket.create_connection(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16))
    conn.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key + b"\r\n\r\n")
    response = b""
    while b"\r\n\r\n" not in response:
        chunk = conn.recv(4096)
        if not chunk:
            break
        response += chunk
    log("status", response.split(b"\r\n")[0].decode())
    conn.sendall(RAW_CLIENT_CASES[case])
    report_frames(conn)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "serve":
        asyncio.run(serve(int(sys.argv[2]), *sys.argv[3:5]))
    elif mode == "raw":
        raw_server(int(sys.argv[2]), sys.argv[3])
    elif mode == "client":
        asyncio.run(client(sys.argv[2], *sys.argv[3:4]))
    elif mode == "rawclient":
        raw_client(int(sys.argv[2]), sys.argv[3], sys.argv[4])
