#!/usr/bin/python3
"""An HTTP server for HTTPUploadTests (python3-aiohttp, which no one here wrote).

  http_peer.py PORT [CERT KEY]      prints "ready PORT" (PORT 0 picks a free one)

  /ingest     reads the body as it streams and answers JSON: bytes, sha256, method, query,
              content type, whether it was chunked, Authorization; prints "body N" per read
  /reject401  401 with a short body, without reading the body
  /redirect   307 to /ingest
  /reset      reads 64 KiB of the body, then resets the connection
  /slow       reads the body, waits a second, then answers
  /stall      reads nothing for 30 seconds
  /early413   answers 413 at once, without reading the body
  /slowread   reads the body 16 KiB at a time with a pause after each, then answers with its length
              (every connection has a 64 KiB receive buffer)
"""
import asyncio, hashlib, json, socket, ssl, struct, sys
from aiohttp import web


async def ingest(request):
    digest = hashlib.sha256()
    total = 0
    async for chunk in request.content.iter_any():
        digest.update(chunk)
        total += len(chunk)
    return web.json_response({
        "bytes": total, "sha256": digest.hexdigest(), "method": request.method, "query": request.query_string,
        "contentType": request.headers.get("Content-Type"), "chunked": request.headers.get("Transfer-Encoding") == "chunked",
        "length": request.headers.get("Content-Length"), "authorization": request.headers.get("Authorization"),
    })


async def reject401(request):
    return web.Response(status=401, text="token required\n")


async def redirect(request):
    raise web.HTTPTemporaryRedirect("/ingest")


async def reset(request):
    total = 0
    async for chunk in request.content.iter_any():
        total += len(chunk)
        if total >= 65536:
            sock = request.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            request.transport.abort()
            break
    return web.Response(text="unreachable")


async def slow(request):
    await request.read()
    await asyncio.sleep(1)
    return web.Response(text="done slowly\n")


async def stall(request):
    await asyncio.sleep(30)
    return web.Response(text="late\n")


async def early413(request):
    return web.Response(status=413, text="too large for us\n")


async def slowread(request):
    total = 0
    while True:
        chunk = await request.content.read(16384)
        if not chunk:
            break
        total += len(chunk)
        await asyncio.sleep(0.002)
    return web.json_response({"bytes": total})


def main():
    port = int(sys.argv[1])
    app = web.Application(client_max_size=1 << 40)
    app.router.add_route("*", "/ingest", ingest)
    app.router.add_route("*", "/reject401", reject401)
    app.router.add_route("*", "/redirect", redirect)
    app.router.add_route("*", "/reset", reset)
    app.router.add_route("*", "/slow", slow)
    app.router.add_route("*", "/stall", stall)
    app.router.add_route("*", "/early413", early413)
    app.router.add_route("*", "/slowread", slowread)
    context = None
    if len(sys.argv) > 3:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(sys.argv[2], sys.argv[3])
    # A small receive buffer, set on the listening socket and so on every connection: a server
    # that reads slowly then holds the client back at once, as a slow link would, instead of
    # letting the kernel take megabytes for it.
    listening = socket.socket()
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    listening.bind(("127.0.0.1", port))
    print("ready", listening.getsockname()[1], flush=True)
    web.run_app(app, sock=listening, ssl_context=context, print=None, access_log=None)


main()
