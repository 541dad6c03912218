// An app's file that imports TransportKit and nothing else: the types the app API names must be
// writable here (Sources/TransportKit/Core/Reexports.swift). It compiles or the test target does not.
import Testing
import TransportKit

@Suite("what import TransportKit alone offers")
struct AppImportsExample {
    @Test("ByteBuffer and Errno can be named without importing NIOCore or SystemPackage")
    func namedTypes() async throws {
        let connection = try await Transport.connect(to: "loop://?buffer=64")
        let outgoing = ByteBuffer(bytes: Array("ping".utf8))
        try await connection.write(outgoing)
        let incoming: ByteBuffer? = try await connection.readBuffer(maxBytes: 16, timeout: .seconds(5))
        #expect(incoming.map { Array($0.readableBytesView) } == Array("ping".utf8))
        try await connection.close()
        let refused = TransportError.posix("connect", errno: Errno.connectionRefused, what: "tcp://127.0.0.1:9")
        let code: Errno? = refused.errno
        #expect(code == .connectionRefused)
    }
}
