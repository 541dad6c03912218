import Foundation
import Testing
@testable import TransportKit

@Suite("Docs/Plugins.md example")
struct PluginExampleTests {
    @Test func theExamplePluginWorksLikeABuiltIn() async throws {
        let registry = try TransportRegistry(plugins: Transport.builtInPlugins)
        try registry.register(EchoPlugin())
        let answer = try await registry.withConnection(to: "echo://?uppercase=true") { connection in
            try await connection.write("hello")
            return try await connection.read()
        }
        #expect(answer == Array("HELLO".utf8))
        await expectTransportError(.invalidURL) { try await registry.connect(to: "echo://?uppercase=perhaps") }
    }

    @Test func theDocumentQuotesTheExampleVerbatim() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        let source = try String(contentsOf: root.appendingPathComponent("Tests/TransportKitTests/PluginExample.swift"), encoding: .utf8)
        let document = try String(contentsOf: root.appendingPathComponent("Docs/Plugins.md"), encoding: .utf8)
        let start = try #require(source.range(of: "// BEGIN EXAMPLE\n"))
        let end = try #require(source.range(of: "// END EXAMPLE"))
        let example = String(source[start.upperBound..<end.lowerBound])
        #expect(document.contains("```swift\n" + example + "```"), "Docs/Plugins.md must quote PluginExample.swift between its markers")
    }
}
