import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif
import Synchronization
import TestSupport
import Testing
@testable import TransportKit
@testable import TransportKitFoundation
@_spi(Plugins) import TransportKitCore

/// The seed article's code shape ("Uploading streams of data"): a URLSession streamed upload fed
/// through a bound pair of streams, written on a thread of its own, to aiohttp (Peers/http_peer.py).
final class StreamedUpload: NSObject, URLSessionDataDelegate, @unchecked Sendable {
    // @unchecked Sendable: `input` and `output` are set before the task starts and only read
    // after; `state` is a Locked.
    let input: InputStream
    let output: OutputStream
    private let state = Locked<(received: Data, error: (any Error)?, status: Int?, done: Bool)>((Data(), nil, nil, false))

    init(bufferSize: Int) {
        var inputOrNil: InputStream? = nil
        var outputOrNil: OutputStream? = nil
        Stream.getBoundStreams(withBufferSize: bufferSize, inputStream: &inputOrNil, outputStream: &outputOrNil)
        guard let input = inputOrNil, let output = outputOrNil else {
            preconditionFailure("getBoundStreams returns both streams")
        }
        self.input = input
        self.output = output
    }

    func urlSession(_ session: URLSession, task: URLSessionTask, needNewBodyStream completionHandler: @escaping (InputStream?) -> Void) {
        completionHandler(input)
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive response: URLResponse,
                    completionHandler: @escaping (URLSession.ResponseDisposition) -> Void) {
        state.withLock { $0.status = (response as? HTTPURLResponse)?.statusCode }
        completionHandler(.allow)
    }

    func urlSession(_ session: URLSession, dataTask: URLSessionDataTask, didReceive data: Data) {
        state.withLock { $0.received.append(data) }
    }

    func urlSession(_ session: URLSession, task: URLSessionTask, didCompleteWithError error: (any Error)?) {
        state.withLock {
            $0.error = error
            $0.done = true
        }
    }

    var result: (received: Data, error: (any Error)?, status: Int?, done: Bool) { state.withLock { $0 } }
}

@Suite("URLSession's streamed upload through a bound stream pair", .serialized)
struct StreamedUploadTests {
    @Test func theArticlesCodeUploadsThroughABoundPairOnLinux() async throws {
        let (server, port) = try await httpPeer()
        defer { server.kill() }
        let upload = StreamedUpload(bufferSize: 4096)
        let session = URLSession(configuration: .ephemeral, delegate: upload, delegateQueue: nil)
        defer { session.invalidateAndCancel() }
        var request = URLRequest(url: try #require(URL(string: "http://127.0.0.1:\(port)/ingest")),
                                 cachePolicy: .reloadIgnoringLocalCacheData, timeoutInterval: 30)
        request.httpMethod = "POST"
        let task = session.uploadTask(withStreamedRequest: request)
        task.resume()

        // The writer: 1 MiB in lines, blocking writes on a thread of its own (the output's write
        // waits while the 4 KiB between the streams is full), then the end.
        let lines = (0..<16_384).map { "line \(String($0).padding(toLength: 58, withPad: " ", startingAt: 0))\n" }
        let expected = lines.joined()
        let wrote = Locked(0)
        Thread {
            let output = upload.output
            output.open()
            for line in lines {
                let bytes = Array(line.utf8)
                var offset = 0
                while offset < bytes.count {
                    let count = bytes[offset...].withUnsafeBufferPointer { chunk in
                        chunk.baseAddress.map { output.write($0, maxLength: chunk.count) } ?? 0
                    }
                    guard count > 0 else { return }
                    offset += count
                    wrote.withLock { $0 += count }
                }
            }
            output.close()
        }.start()

        #expect(await eventually(30, every: .milliseconds(50)) { upload.result.done }, "wrote \(wrote.withLock { $0 }) bytes")
        let result = upload.result
        #expect(result.error == nil, "\(String(describing: result.error))")
        #expect(result.status == 200)
        let fields = try #require(try JSONSerialization.jsonObject(with: result.received) as? [String: Any])
        #expect(fields["bytes"] as? Int == expected.utf8.count)
        #expect(fields["chunked"] as? Bool == true, "a stream of unknown length goes chunked")
    }

    @Test func closingTheInputOfABoundPairFailsTheWriterInsteadOfBlockingIt() async throws {
        var inputOrNil: InputStream? = nil
        var outputOrNil: OutputStream? = nil
        Stream.getBoundStreams(withBufferSize: 1024, inputStream: &inputOrNil, outputStream: &outputOrNil)
        let streams = UncheckedStreams(input: try #require(inputOrNil), output: try #require(outputOrNil))
        let outcome = Locked<Int?>(nil)
        Thread {
            streams.output.open()
            streams.input.open()
            let block = [UInt8](repeating: 1, count: 1024)
            var total = 0
            // Nothing reads: the buffers fill, then the input is closed from the test.
            while true {
                let count = block.withUnsafeBufferPointer { chunk in chunk.baseAddress.map { streams.output.write($0, maxLength: chunk.count) } ?? 0 }
                if count <= 0 { break }
                total += count
            }
            outcome.withLock { $0 = total }
        }.start()
        try await Task.sleep(for: .milliseconds(300))
        #expect(outcome.withLock { $0 } == nil, "the writer waits for room")
        streams.input.close()
        #expect(await eventually(10) { outcome.withLock { $0 } != nil }, "the writer's next write fails once the input is closed")
        #expect(streams.output.streamStatus == .error || streams.output.streamError != nil)
        streams.output.close()
    }
}
