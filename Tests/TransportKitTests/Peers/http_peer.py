#!/usr/bin/python3
"""An HTTP server for HTTPUploadTests (python3-aiohttp, which no one here wrote).

  http_peer.py PORT [CERT KEY]

  /ingest     reads the body as it streams and answers JSON: bytes, sha256, method, query,
              content type, whether it was chunked, Authorization; prints "body N" per read
  /reject401  401 with a short body, without reading the body
  /redirect   307 to /ingest
  /reset      reads 64 KiB of the body, then resets the connection
  /slow       reads the body, waits a second, then answers
  /stall      reads nothing for 30 seconds
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


def main():
    port = int(sys.argv[1])
    app = web.Application(client_max_size=1 << 40)
    app.router.add_route("*", "/ingest", ingest)
    app.router.add_route("*", "/reject401", reject401)
    app.router.add_route("*", "/redirect", redirect)
    app.router.add_route("*", "/reset", reset)
    app.router.add_route("*", "/slow", slow)
    app.router.add_route("*", "/stall", stall)
    context = None
    if len(sys.argv) > 3:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(sys.argv[2], sys.argv[3])
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=context, print=None, access_log=None)


main()
