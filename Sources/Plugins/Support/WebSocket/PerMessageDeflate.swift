// permessage-deflate (RFC 7692): the extension's negotiation (the offer, the answer, their
// parameters) and each message compressed with raw DEFLATE through zlib, ending in a sync flush
// whose last four bytes (00 00 FF FF) are left off on the wire. Inflating stops at a limit, so a
// small message that inflates to gigabytes (a compression bomb) fails with 1009 instead.

import CZlib
import NIOCore
@_spi(Plugins) import TransportKitCore

/// What both ends agreed on for permessage-deflate.
package struct DeflateParameters: Sendable, Equatable {
    /// The server resets its compressor after each message.
    package var serverNoContextTakeover = false
    /// The client resets its compressor after each message.
    package var clientNoContextTakeover = false
    /// The server's LZ77 window, 2^N bytes (9…15; RFC 7692 allows 8, which zlib cannot make).
    package var serverMaxWindowBits = 15
    /// The client's LZ77 window.
    package var clientMaxWindowBits = 15

    package init() {}

    /// The header value a client offers: the extension, and that it can take a window size from
    /// the server.
    package static let clientOffer = "permessage-deflate; client_max_window_bits"

    /// Reads the server's answer (a client's view): `nil` when it turned nothing on; throws when
    /// the answer is one a client must refuse (RFC 7692 section 5.1).
    package static func accepted(_ header: [String]) throws -> DeflateParameters? {
        guard let first = header.first else { return nil }
        guard header.count == 1 else { throw Problem("more than one extension was turned on: \(header.joined(separator: ", "))") }
        var parts = first.split(separator: ";").map { $0.trimmingCharacters() }
        guard parts.removeFirst().lowercased() == "permessage-deflate" else { throw Problem("the extension '\(first)' was not offered") }
        var parameters = DeflateParameters()
        var seen: Set<String> = []
        for part in parts {
            let pair = part.split(separator: "=", maxSplits: 1).map { $0.trimmingCharacters().trimmingQuotes() }
            let name = pair[0].lowercased()
            guard seen.insert(name).inserted else { throw Problem("the parameter \(name) appears twice") }
            switch (name, pair.count == 2 ? pair[1] : nil) {
            case ("server_no_context_takeover", nil): parameters.serverNoContextTakeover = true
            case ("client_no_context_takeover", nil): parameters.clientNoContextTakeover = true
            case ("server_max_window_bits", let value?):
                parameters.serverMaxWindowBits = try windowBits(value, name)
            case ("client_max_window_bits", let value?):
                parameters.clientMaxWindowBits = try windowBits(value, name)
                guard parameters.clientMaxWindowBits >= 9 else { throw Problem("client_max_window_bits=8 is a window zlib cannot compress with") }
            default:
                throw Problem("'\(part)' is not a parameter permessage-deflate answers with")
            }
        }
        return parameters
    }

    /// Picks the first offer a server can take (a server's view), and the answer to send; `nil`
    /// when there is none (the connection then goes on uncompressed).
    package static func negotiate(_ offers: [String]) -> (parameters: DeflateParameters, answer: String)? {
        offers: for offer in offers {
            var parts = offer.split(separator: ";").map { $0.trimmingCharacters() }
            guard parts.removeFirst().lowercased() == "permessage-deflate" else { continue }
            var parameters = DeflateParameters()
            var answer = ["permessage-deflate"]
            var seen: Set<String> = []
            for part in parts {
                let pair = part.split(separator: "=", maxSplits: 1).map { $0.trimmingCharacters().trimmingQuotes() }
                let name = pair[0].lowercased()
                guard seen.insert(name).inserted else { continue offers }
                switch (name, pair.count == 2 ? pair[1] : nil) {
                case ("server_no_context_takeover", nil):
                    parameters.serverNoContextTakeover = true
                    answer.append("server_no_context_takeover")
                case ("client_no_context_takeover", nil):
                    parameters.clientNoContextTakeover = true
                    answer.append("client_no_context_takeover")
                case ("server_max_window_bits", let value?):
                    guard let bits = try? windowBits(value, name), bits >= 9 else { continue offers }
                    parameters.serverMaxWindowBits = bits
                    answer.append("server_max_window_bits=\(bits)")
                case ("client_max_window_bits", let value):
                    // The client can take a limit; ours is the whole window, so none is sent. With a
                    // value, the client's own window is at most that.
                    if let value {
                        guard let bits = try? windowBits(value, name) else { continue offers }
                        parameters.clientMaxWindowBits = bits
                    }
                default:
                    continue offers
                }
            }
            return (parameters, answer.joined(separator: "; "))
        }
        return nil
    }

    private static func windowBits(_ text: String, _ name: String) throws -> Int {
        guard let bits = Int(text), (8...15).contains(bits), text.first != "0" else { throw Problem("\(name)=\(text) is not a window size from 8 to 15") }
        return bits
    }

    /// An answer a client cannot accept.
    package struct Problem: Error, CustomStringConvertible {
        package let description: String
        init(_ description: String) { self.description = description }
    }
}

/// The compressor or the decompressor of one direction of one connection. Not thread-safe: the
/// WebSocket handler uses it on its event loop only.
package final class DeflateStream {
    private let stream: UnsafeMutablePointer<z_stream>
    private let inflating: Bool
    /// Reset after each message (no context takeover).
    private let resetEachMessage: Bool

    /// A compressor with a window of 2^`windowBits` bytes.
    package static func compressor(windowBits: Int, resetEachMessage: Bool) -> DeflateStream? {
        DeflateStream(inflating: false, windowBits: windowBits, resetEachMessage: resetEachMessage)
    }

    /// A decompressor for a peer whose window is at most 2^`windowBits` bytes.
    package static func decompressor(windowBits: Int, resetEachMessage: Bool) -> DeflateStream? {
        DeflateStream(inflating: true, windowBits: windowBits, resetEachMessage: resetEachMessage)
    }

    private init?(inflating: Bool, windowBits: Int, resetEachMessage: Bool) {
        let stream = UnsafeMutablePointer<z_stream>.allocate(capacity: 1)
        stream.initialize(to: z_stream())
        // Negative window bits: raw DEFLATE, without zlib's header and checksum. Set up before
        // the properties: a failed init then never runs deinit (which would end the stream).
        let status = inflating ? tk_inflate_init(stream, -Int32(windowBits)) : tk_deflate_init(stream, Z_DEFAULT_COMPRESSION, -Int32(windowBits))
        guard status == Z_OK else {
            stream.deallocate()
            return nil
        }
        self.stream = stream
        self.inflating = inflating
        self.resetEachMessage = resetEachMessage
    }

    deinit {
        if inflating { inflateEnd(stream) } else { deflateEnd(stream) }
        stream.deallocate()
    }

    /// The message's compressed bytes, without the sync flush's trailing 00 00 FF FF.
    package func compress(_ message: ByteBuffer, allocator: ByteBufferAllocator) -> ByteBuffer {
        var output = allocator.buffer(capacity: max(64, message.readableBytes / 2 + 64))
        var input = message
        input.withUnsafeMutableReadableBytes { raw in
            stream.pointee.next_in = raw.bindMemory(to: Bytef.self).baseAddress
            stream.pointee.avail_in = uInt(raw.count)
            repeat {
                output.reserveCapacity(minimumWritableBytes: 4096)
                output.writeWithUnsafeMutableBytes(minimumWritableBytes: 4096) { out in
                    stream.pointee.next_out = out.bindMemory(to: Bytef.self).baseAddress
                    stream.pointee.avail_out = uInt(out.count)
                    _ = deflate(stream, Z_SYNC_FLUSH)
                    return out.count - Int(stream.pointee.avail_out)
                }
            } while stream.pointee.avail_out == 0
        }
        stream.pointee.next_in = nil
        stream.pointee.next_out = nil
        if resetEachMessage { deflateReset(stream) }
        // A sync flush ends in an empty stored block: 00 00 FF FF, which the wire leaves off.
        if output.readableBytes >= 4 { output.moveWriterIndex(to: output.writerIndex - 4) }
        return output
    }

    /// Why ``decompress(_:limit:allocator:)`` failed.
    package enum Failure: Error {
        /// The message inflates to more than the limit.
        case tooBig
        /// The bytes are not DEFLATE data.
        case corrupt(String)
    }

    /// The message's bytes, inflated; fails once they pass `limit`.
    package func decompress(_ message: ByteBuffer, limit: Int, allocator: ByteBufferAllocator) throws(Failure) -> ByteBuffer {
        var input = message
        input.writeBytes([0x00, 0x00, 0xFF, 0xFF])
        var output = allocator.buffer(capacity: min(limit, max(256, message.readableBytes * 4)))
        var failure: Failure?
        input.withUnsafeMutableReadableBytes { raw in
            stream.pointee.next_in = raw.bindMemory(to: Bytef.self).baseAddress
            stream.pointee.avail_in = uInt(raw.count)
            while stream.pointee.avail_in > 0 || stream.pointee.avail_out == 0 {
                let room = limit + 1 - output.readableBytes
                guard room > 0 else {
                    failure = .tooBig
                    return
                }
                var status: Int32 = Z_OK
                output.writeWithUnsafeMutableBytes(minimumWritableBytes: min(room, 16384)) { out in
                    let count = min(out.count, room)
                    stream.pointee.next_out = out.bindMemory(to: Bytef.self).baseAddress
                    stream.pointee.avail_out = uInt(count)
                    status = inflate(stream, Z_SYNC_FLUSH)
                    return count - Int(stream.pointee.avail_out)
                }
                if status == Z_BUF_ERROR && stream.pointee.avail_in == 0 { break }
                guard status == Z_OK || status == Z_STREAM_END || status == Z_BUF_ERROR else {
                    let reason = stream.pointee.msg.map { String(cString: $0) } ?? "zlib status \(status)"
                    failure = .corrupt(reason)
                    return
                }
                if status == Z_STREAM_END {
                    // A final block (BFINAL, RFC 7692 section 7.2.3.5) ends zlib's stream: what is
                    // left is the appended 00 00 FF FF, not data. The next message starts a new
                    // stream, with no window carried over.
                    inflateReset(stream)
                    break
                }
            }
        }
        stream.pointee.next_in = nil
        stream.pointee.next_out = nil
        if let failure {
            inflateReset(stream)
            throw failure
        }
        if output.readableBytes > limit { throw .tooBig }
        if resetEachMessage { inflateReset(stream) }
        return output
    }
}

extension Substring {
    fileprivate func trimmingCharacters() -> String {
        String(drop { $0 == " " || $0 == "\t" }.reversed().drop { $0 == " " || $0 == "\t" }.reversed())
    }
}

extension String {
    fileprivate func trimmingCharacters() -> String { self[...].trimmingCharacters() }
    fileprivate func trimmingQuotes() -> String {
        count >= 2 && hasPrefix("\"") && hasSuffix("\"") ? String(dropFirst().dropLast()) : self
    }
}
