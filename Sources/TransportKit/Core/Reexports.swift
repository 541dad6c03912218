// Reexports.swift: the types of other packages that the app API names, re-exported one by one so
// that `import TransportKit` (or `TransportKitCore`) is enough to write them. Only these two: the
// rest of SwiftNIO and swift-system stays out of an app's completion list.
//   - ByteBuffer: `Connection.readBuffer`, `readMessageBuffer`, `write(_: ByteBuffer)`,
//     `writeMessage(_: ByteBuffer)`, `TransportMessage.payload`.
//   - Errno: `TransportError.errno`.

@_exported import struct NIOCore.ByteBuffer
@_exported import struct SystemPackage.Errno
