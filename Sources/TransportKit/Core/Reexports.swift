// Reexports.swift: the types of other packages that an app's reads, writes and errors name,
// re-exported one by one so that `import TransportKit` (or `TransportKitCore`) is enough to write
// them; the rest of SwiftNIO and swift-system stays out of an app's completion list. Two other
// foreign types appear in optional parameters and are not re-exported: swift-log's `Logger`
// (`TransportRegistry(plugins:logger:)`: an app that configures logging imports Logging anyway) and
// TransportKitDBus's `DBusConnection.Bus` (`BluetoothPlugin(bus:)`, for the session bus in tests).
//   - ByteBuffer: `Connection.readBuffer`, `readMessageBuffer`, `write(_: ByteBuffer)`,
//     `writeMessage(_: ByteBuffer)`, `TransportMessage.payload`.
//   - Errno: `TransportError.errno`.

@_exported import struct NIOCore.ByteBuffer
@_exported import struct SystemPackage.Errno
