// The libFuzzer targets (Docs/Testing.md, "Fuzzing"): the URL parser, option validation against
// every built-in scheme, every framing decoder, and the WebSocket session (frames, control frames,
// fragments, permessage-deflate). TK_FUZZ_TARGET picks one: url, options, framing or websocket. Built by Scripts/fuzz with --sanitize=fuzzer and -DFUZZING, libFuzzer supplies main();
// built plainly, `transportkit-fuzz TARGET FILE…` replays inputs (a crash's reproducer, a corpus).

import Dispatch
import Foundation
import NIOCore
import NIOEmbedded
import NIOWebSocket
import TransportKitBluetooth
@_spi(Plugins) import TransportKitCore
import TransportKitLoop
import TransportKitSerial
@_spi(Plugins) import TransportKitSockets
import TransportKitSpy
import TransportKitUSB
import TransportKitWebSocket

/// The built-in schemes but tls (whose URL validation is the same descriptor code): the TLS plugin
/// would bring BoringSSL, twice (swift-nio-ssl, swift-crypto), into the fuzzer's instrumented build,
/// minutes of CI time for no parser of its own.
let fuzzRegistry: TransportRegistry? = try? TransportRegistry(plugins: [LoopPlugin(), SocketsPlugin(), SerialPlugin(), SpyPlugin(),
                                                                        BluetoothPlugin(), USBPlugin()])

enum FuzzTarget: String, CaseIterable {
    case url, options, framing, websocket

    func run(_ data: [UInt8]) {
        switch self {
        case .url: FuzzURL.run(data)
        case .options: FuzzOptions.run(data)
        case .framing: FuzzFraming.run(data)
        case .websocket: FuzzWebSocket.run(data)
        }
    }

    static let selected: FuzzTarget = {
        let name = ProcessInfo.processInfo.environment["TK_FUZZ_TARGET"] ?? ""
        guard let target = FuzzTarget(rawValue: name) else {
            FileHandle.standardError.write(Data("set TK_FUZZ_TARGET to one of: \(allCases.map(\.rawValue).joined(separator: ", "))\n".utf8))
            exit(2)
        }
        return target
    }()
}

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzzOneInput(_ data: UnsafePointer<UInt8>?, _ size: Int) -> Int32 {
    let bytes = data.map { Array(UnsafeBufferPointer(start: $0, count: size)) } ?? []
    FuzzTarget.selected.run(bytes)
    return 0
}

/// A failed invariant: crash so libFuzzer records the input.
func check(_ condition: Bool, _ message: @autoclosure () -> String) {
    if !condition {
        FileHandle.standardError.write(Data("invariant failed: \(message())\n".utf8))
        abort()
    }
}

/// The parser never crashes; what it accepts prints as a URL that parses back to the same value.
enum FuzzURL {
    static func run(_ data: [UInt8]) {
        let text = String(decoding: data, as: UTF8.self)
        guard let url = try? TransportURL(text) else { return }
        let printed = url.description
        guard let again = try? TransportURL(printed) else {
            check(false, "'\(text)' parsed, but its description '\(printed)' does not")
            return
        }
        check(again == url, "'\(text)' → '\(printed)' parses to a different URL")
    }
}

/// Validation against the built-in schemes never crashes, and a URL it accepts is accepted again.
enum FuzzOptions {
    static func run(_ data: [UInt8]) {
        // The first byte picks a scheme, so inputs spend their bytes on options.
        guard let registry = fuzzRegistry else { return check(false, "the registry could not be built") }
        let schemes = registry.schemes.map(\.scheme)
        guard let first = data.first else { return }
        let scheme = schemes[Int(first) % schemes.count]
        let rest = String(decoding: data.dropFirst(), as: UTF8.self)
        let text = "\(scheme)://\(rest)"
        guard let request = try? registry.resolve(text) else { return }
        check((try? registry.resolve(request.url)) != nil, "'\(text)' validated once but not twice")
    }
}

/// Every framing decoder over a loop connection: no crash, frames that obey their framing.
enum FuzzFraming {
    static func run(_ data: [UInt8]) {
        guard data.count >= 2 else { return }
        let done = DispatchSemaphore(value: 0)
        Task {
            await decode(data)
            done.signal()
        }
        done.wait()
    }

    static func decode(_ data: [UInt8]) async {
        let selector = data[0]
        let parameter = data[1]
        let maxLength = Int(parameter % 64) + 1
        let stream = Array(data.dropFirst(2))
        let delimiter: [UInt8] = switch selector % 3 {
        case 0: [parameter]
        case 1: [0x0D, 0x0A]
        default: [parameter, parameter &+ 1]
        }
        let framing: Framing = switch selector % 10 {
        case 0, 1, 2: .delimiter(delimiter)
        case 3: .fixedLength(Int(parameter % 16))
        case 4: .lengthPrefixed(.uint8)
        case 5: .lengthPrefixed(.uint16(.big))
        case 6: .lengthPrefixed(.uint16(.little))
        case 7: .lengthPrefixed(.uint32(.big))
        case 8: .lengthPrefixed(.uint32(.little))
        default: .interByteTimeout(.milliseconds(1))
        }
        guard let connection = try? await fuzzRegistry?.connect(to: "loop://?buffer=65536") else {
            check(false, "loop:// did not connect")
            return
        }
        do {
            // Written in pieces the selector chooses, so frames straddle reads.
            var offset = 0
            let piece = Int(selector / 10 % 7) + 1
            while offset < stream.count {
                let end = min(stream.count, offset + piece * 97)
                try await connection.write(Array(stream[offset..<end]))
                offset = end
            }
            try await connection.closeWrite()
        } catch {
            check(false, "writing to loop:// failed: \(error)")
        }
        var consumed = 0
        while true {
            do {
                guard let frame = try await connection.readFrame(framing, maxLength: maxLength) else { break }
                switch framing {
                case .delimiter(let delimiter):
                    check(frame.count <= maxLength, "a delimited frame longer than maxLength")
                    check(!containsSubsequence(frame, delimiter), "a frame contains its delimiter")
                    consumed += frame.count + delimiter.count
                case .fixedLength(let length):
                    check(frame.count == length, "a fixed-length frame of \(frame.count) bytes, not \(length)")
                    consumed += length
                case .lengthPrefixed(let prefix):
                    check(frame.count <= maxLength, "a length-prefixed frame longer than maxLength")
                    consumed += frame.count + prefixWidth(prefix)
                case .interByteTimeout:
                    check(!frame.isEmpty && frame.count <= maxLength, "a burst of \(frame.count) bytes")
                    consumed += frame.count
                }
                check(consumed <= stream.count + 2, "frames hold more bytes than were written")
                if case .fixedLength(0) = framing { break }   // an empty frame never ends the stream
            } catch let error as TransportError {
                // Refusals the decoders document: too long, ended inside a frame.
                check(error.kind == .io || error.kind == .disconnected, "unexpected \(error.kind): \(error)")
                break
            } catch {
                check(false, "unexpected error \(error)")
            }
        }
        try? await connection.close()
    }

    static func prefixWidth(_ prefix: LengthPrefix) -> Int {
        switch prefix {
        case .uint8: 1
        case .uint16: 2
        case .uint32: 4
        }
    }

    static func containsSubsequence(_ bytes: [UInt8], _ needle: [UInt8]) -> Bool {
        guard !needle.isEmpty, bytes.count >= needle.count else { return false }
        return (0...(bytes.count - needle.count)).contains { bytes[$0..<($0 + needle.count)].elementsEqual(needle) }
    }
}

#if !FUZZING
/// Without libFuzzer: replays files through a target.
@main
struct Replay {
    static func main() {
        let arguments = Array(CommandLine.arguments.dropFirst())
        guard let name = arguments.first, let target = FuzzTarget(rawValue: name) else {
            FileHandle.standardError.write(Data("usage: transportkit-fuzz url|options|framing FILE-OR-DIRECTORY…\n".utf8))
            exit(2)
        }
        var count = 0
        for path in arguments.dropFirst() {
            var isDirectory: ObjCBool = false
            guard FileManager.default.fileExists(atPath: path, isDirectory: &isDirectory) else { continue }
            let files = isDirectory.boolValue
                ? ((try? FileManager.default.contentsOfDirectory(atPath: path)) ?? []).sorted().map { "\(path)/\($0)" }
                : [path]
            for file in files {
                guard let data = FileManager.default.contents(atPath: file) else { continue }
                target.run(Array(data))
                count += 1
            }
        }
        print("\(target.rawValue): \(count) inputs replayed, no failure")
    }
}
#endif

/// The WebSocket session after the handshake, fed arbitrary bytes as a client or a server, with
/// and without permessage-deflate: no crash, and what it hands on obeys RFC 6455: whole messages
/// within the size limit, text that is valid UTF-8, nothing after a failure.
enum FuzzWebSocket {
    static let limit = 1024

    static func run(_ data: [UInt8]) {
        guard let first = data.first else { return }
        let role: WebSocketConfiguration.Role = first & 1 == 0 ? .client : .server
        let handler = WebSocketHandler(WebSocketConfiguration(role: role, maxMessageSize: limit, pingInterval: nil, pingTimeout: nil,
                                                              closeTimeout: .seconds(1), describing: "the fuzzer"))
        let channel = EmbeddedChannel()
        let recorder = Recorder()
        do {
            try channel.pipeline.syncOperations.addHandlers([
                ByteToMessageHandler(WebSocketFrameDecoder(maxFrameSize: limit)), WebSocketFrameEncoder(), handler, recorder,
            ])
            try channel.connect(to: SocketAddress(ipAddress: "127.0.0.1", port: 1)).wait()
            if first & 2 != 0 {
                var parameters = DeflateParameters()
                parameters.serverNoContextTakeover = first & 4 != 0
                parameters.clientNoContextTakeover = first & 8 != 0
                try handler.useDeflate(parameters, role: role)
            }
        } catch {
            return check(false, "the pipeline could not be built: \(error)")
        }
        handler.start()
        // Fed in pieces the second byte chooses, so frames straddle reads.
        let piece = Int(data.count > 1 ? data[1] % 64 : 0) + 1
        var offset = 2
        while offset < data.count, !recorder.failed, channel.isActive {
            let end = min(data.count, offset + piece)
            _ = try? channel.writeInbound(ByteBuffer(bytes: data[offset..<end]))
            while (try? channel.readOutbound(as: ByteBuffer.self)) != nil {}
            offset = end
        }
        // A close runs the closing handshake: it waits for the peer's close frame up to the close
        // timeout, which passes only when the embedded loop's clock is moved.
        channel.close(promise: nil)
        channel.embeddedEventLoop.advanceTime(by: .seconds(2))
        _ = try? channel.finish(acceptAlreadyClosed: true)
    }
}

/// The end of the fuzzed pipeline: checks each message as it arrives, in order with the errors.
final class Recorder: ChannelInboundHandler {
    typealias InboundIn = TransportMessage
    var failed = false

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let message = unwrapInboundIn(data)
        check(!failed, "a message after the session failed")
        check(message.payload.readableBytes <= FuzzWebSocket.limit,
              "a message of \(message.payload.readableBytes) bytes passed the \(FuzzWebSocket.limit)-byte limit")
        if message.kind == .text {
            check(String(validating: message.payload.readableBytesView, as: UTF8.self) != nil, "a text message that is not UTF-8")
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        failed = true
    }
}
