// node ws as a server for TransportKit's client (WebSocketClientTests): echoes each message with
// its kind, permessage-deflate on (with server_no_context_takeover, to try that parameter).
const WebSocket = require('ws');
const server = new WebSocket.Server({
    host: '127.0.0.1', port: Number(process.argv[2]),
    perMessageDeflate: { serverNoContextTakeover: true, threshold: 0 },
});
server.on('connection', (socket, request) => {
    console.log('path', request.url, 'extensions', request.headers['sec-websocket-extensions']);
    socket.on('message', (data, isBinary) => socket.send(data, { binary: isBinary }));
    socket.on('close', (code) => console.log('closed', code));
});
server.on('listening', () => console.log('ready', server.address().port));
