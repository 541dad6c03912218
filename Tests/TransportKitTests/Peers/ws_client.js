// node ws as a client of a TransportKit listener (WebSocketListenerTests): a text message, a
// binary one, each echoed back with its kind, then a normal close.
const WebSocket = require('ws');
const socket = new WebSocket(process.argv[2]);
let replies = 0;
socket.on('open', () => socket.send('from node'));
socket.on('message', (data, isBinary) => {
    replies += 1;
    if (isBinary) {
        console.log('binary', Buffer.from(data).toString('hex'), isBinary);
    } else {
        console.log('text', data.toString(), isBinary);
    }
    if (replies === 1) socket.send(Buffer.from([0x0a, 0x0b]));
    else socket.close(1000, 'finished');
});
socket.on('close', (code) => console.log('closed', code));
socket.on('error', (error) => console.log('error', error.message));
