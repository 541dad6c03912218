import Foundation
import Testing
import TransportKit

/// The lists kept by hand (the README's products and scheme table, the headings of Docs/Schemes.md,
/// the exclusive targets in Docs/CLI.md and Docs/Security.md, the tool's abstract, Scripts/docs'
/// modules, the shim tests' C modules) checked against the package and the registry. Each failure
/// names the file to update.
@Suite("Docs and hand-kept lists match the code")
struct DocsDriftTests {
    static let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()

    static func read(_ path: String) throws -> String {
        try String(contentsOf: root.appendingPathComponent(path), encoding: .utf8)
    }

    // MARK: Package.swift, read as text

    /// The strings between double quotes in `text`.
    static func quoted(_ text: some StringProtocol) -> [String] {
        text.components(separatedBy: "\"").enumerated().filter { $0.offset % 2 == 1 }.map(\.element)
    }

    /// The value of `key: "VALUE"`, the first one in `text`.
    static func value(of key: String, in text: String) -> String? {
        guard let start = text.range(of: key + ": \"") else { return nil }
        let rest = text[start.upperBound...]
        return rest.firstIndex(of: "\"").map { String(rest[..<$0]) }
    }

    /// Every product in `products:`: libraries and executables.
    static func products() throws -> [String] {
        let package = try read("Package.swift")
        let start = try #require(package.range(of: "products: ["), "Package.swift has no products: list")
        let end = try #require(package.range(of: "dependencies: [", range: start.upperBound..<package.endIndex))
        return package[start.upperBound..<end.lowerBound].components(separatedBy: "\n")
            .filter { $0.contains(".library(") || $0.contains(".executable(") }
            .compactMap { value(of: "name", in: $0) }
    }

    /// `.target(…)`s: name and path.
    static func regularTargets() throws -> [(name: String, path: String?)] {
        let package = try read("Package.swift")
        return package.components(separatedBy: ".target(").dropFirst().compactMap { chunk in
            var body = chunk
            for next in [".executableTarget(", ".testTarget(", ".systemLibrary("] {
                if let range = body.range(of: next) { body = String(body[..<range.lowerBound]) }
            }
            return value(of: "name", in: body).map { (name: $0, path: value(of: "path", in: body)) }
        }
    }

    /// Library modules: `.target`s under Sources/ written in Swift (not CBenchLoops, not TestSupport).
    static func swiftLibraryModules() throws -> [String] {
        try regularTargets().compactMap { target -> String? in
            guard let path = target.path, path.hasPrefix("Sources/") else { return nil }
            let files = FileManager.default.enumerator(atPath: root.appendingPathComponent(path).path)
            while let file = files?.nextObject() as? String {
                if file.hasSuffix(".swift") { return target.name }
            }
            return nil
        }
    }

    /// The built-in schemes, from a registry of their own: a test that registers a scheme on
    /// `Transport.registry` meanwhile does not count.
    static func builtInSchemes() throws -> [SchemeDescriptor] {
        try TransportRegistry(plugins: Transport.builtInPlugins).schemes
    }

    // MARK: Markdown

    /// The lines from the first that starts with `prefix` to the next blank line, as one line.
    static func paragraph(startingWith prefix: String, in text: String) -> String? {
        let lines = text.components(separatedBy: "\n")
        guard let first = lines.firstIndex(where: { $0.hasPrefix(prefix) }) else { return nil }
        return lines[first...].prefix { !$0.trimmingCharacters(in: .whitespaces).isEmpty }.joined(separator: " ")
    }

    /// What follows `marker` up to the next ")": the parenthesis a marker such as
    /// "An exclusive target (" opens.
    static func parenthesis(after marker: String, in text: String) -> String? {
        guard let start = text.range(of: marker) else { return nil }
        let rest = text[start.upperBound...]
        return rest.firstIndex(of: ")").map { String(rest[..<$0]) }
    }

    /// Words with backticks and punctuation around them removed: "`tty://`)," is "tty://".
    static func tokens(_ text: String) -> [String] {
        text.components(separatedBy: .whitespacesAndNewlines)
            .map { $0.trimmingCharacters(in: CharacterSet(charactersIn: "`()[],.;*")) }
            .filter { !$0.isEmpty }
    }

    /// How a scheme is written in prose: `tcp://` or `spy+` (as in spy+URL).
    static func form(_ descriptor: SchemeDescriptor) -> String {
        descriptor.wraps ? descriptor.scheme + "+" : descriptor.scheme + "://"
    }

    static func names(_ descriptor: SchemeDescriptor, in tokens: [String]) -> Bool {
        descriptor.wraps ? tokens.contains { $0.hasPrefix(form(descriptor)) } : tokens.contains(form(descriptor))
    }

    // MARK: The checks

    @Test("README.md and Docs/Architecture.md list every product in Package.swift")
    func productLists() throws {
        let products = try Self.products()
        #expect(products.count >= 6, "Package.swift's products: could not be read (found \(products))")
        for document in ["README.md", "Docs/Architecture.md"] {
            let text = try Self.read(document)
            let list = try #require(Self.paragraph(startingWith: "Products", in: text),
                                    "\(document) has no paragraph starting with \"Products\"")
            for product in products {
                #expect(list.contains("`\(product)`"),
                        "\(document): the paragraph starting with \"Products\" does not name `\(product)`, a product in Package.swift; add it")
            }
        }
    }

    @Test("README.md's scheme table has a row for every registered scheme, and only for those")
    func readmeSchemeTable() throws {
        let readme = try Self.read("README.md")
        let start = try #require(readme.range(of: "\n## Schemes\n"), "README.md has no \"## Schemes\" section")
        let section = readme[start.upperBound...].components(separatedBy: "\n## ").first ?? ""
        // The first cell of each row: "| `ws`, `wss` | …".
        let listed = Set(section.components(separatedBy: "\n").filter { $0.hasPrefix("| `") }.flatMap { row in
            row.components(separatedBy: "|")[1].components(separatedBy: "`").enumerated().filter { $0.offset % 2 == 1 }.map(\.element)
        })
        let registered = try Self.builtInSchemes()
        #expect(!registered.isEmpty)
        for descriptor in registered {
            #expect(listed.contains(descriptor.scheme),
                    "README.md's scheme table (## Schemes) has no row for `\(descriptor.scheme)`, which the built-in plugins register; add one")
        }
        for name in listed.subtracting(registered.map(\.scheme)) {
            Issue.record("README.md's scheme table has a row for `\(name)`, which no built-in plugin registers; remove or rename it")
        }
    }

    @Test("Docs/Schemes.md has a heading for every registered scheme")
    func schemesDocumentHeadings() throws {
        let headings = try Self.read("Docs/Schemes.md").components(separatedBy: "\n").filter { $0.hasPrefix("#") }
        for descriptor in try Self.builtInSchemes() {
            let written = descriptor.wraps ? "`\(descriptor.scheme)+URL" : "`\(descriptor.scheme)://"
            #expect(headings.contains { $0.contains(written) },
                    "Docs/Schemes.md has no heading with \(written)`; document the scheme there under a heading that names it")
        }
    }

    @Test("Docs/CLI.md and Docs/Security.md name exactly the exclusive schemes")
    func exclusiveTargets() throws {
        let registered = try Self.builtInSchemes()
        let exclusive = registered.filter(\.exclusive)
        #expect(!exclusive.isEmpty)
        for (document, marker) in [("Docs/CLI.md", "An **exclusive** target ("), ("Docs/Security.md", "An exclusive target (")] {
            let text = try Self.read(document)
            let parenthesis = try #require(Self.parenthesis(after: marker, in: text), "\(document) no longer says \"\(marker)…)\"")
            let words = Self.tokens(parenthesis)
            for descriptor in exclusive {
                #expect(words.contains(Self.form(descriptor)),
                        "\(document): \"\(marker)…)\" does not name \(Self.form(descriptor)), whose descriptor says exclusive; add it")
            }
            for word in words where word.hasSuffix("://") && !exclusive.contains(where: { Self.form($0) == word }) {
                Issue.record("\(document): \"\(marker)…)\" names \(word), which is not exclusive; remove it")
            }
        }
    }

    @Test("Scripts/docs lists every library module, and nothing else")
    func docsModuleList() throws {
        let script = try Self.read("Scripts/docs")
        // The default list: `modules=(A B …)`, not `modules=("$@")`.
        let lists = script.components(separatedBy: "modules=(").dropFirst().compactMap { $0.components(separatedBy: ")").first }
        let list = try #require(lists.first { !$0.contains("\"") }, "Scripts/docs has no default modules=(…) list")
        let listed = Set(list.components(separatedBy: .whitespacesAndNewlines).filter { !$0.isEmpty })
        let modules = try Self.swiftLibraryModules()
        #expect(modules.count >= 10, "Package.swift's .target(…)s could not be read (found \(modules))")
        for module in modules {
            #expect(listed.contains(module), "Scripts/docs: the modules=(…) list lacks \(module), a library target in Package.swift; add it")
        }
        for name in listed.subtracting(modules) {
            Issue.record("Scripts/docs lists \(name), which is no library target in Package.swift; remove or rename it")
        }
        // Every DocC catalog belongs to a module that is built.
        let catalogs = FileManager.default.enumerator(atPath: Self.root.appendingPathComponent("Sources").path)
        while let path = catalogs?.nextObject() as? String {
            guard path.hasSuffix(".docc") else { continue }
            let module = URL(fileURLWithPath: path).deletingPathExtension().lastPathComponent
            #expect(listed.contains(module), "Sources/\(path) is the catalog of \(module), which Scripts/docs does not build; add it to its modules=(…) list")
        }
    }

    @Test("the tool's abstract names every registered scheme")
    func cliAbstract() async throws {
        let binary = URL(fileURLWithPath: ProcessInfo.processInfo.arguments[0]).deletingLastPathComponent()
            .appendingPathComponent("transportkit").path
        try #require(FileManager.default.isExecutableFile(atPath: binary), "no transportkit binary at \(binary): build the package first (swift build)")
        let help = await Support.offPool { () -> String in
            let process = Process()
            process.executableURL = URL(fileURLWithPath: binary)
            process.arguments = ["--help"]
            let pipe = Pipe()
            process.standardOutput = pipe
            process.standardError = FileHandle.nullDevice
            guard (try? process.run()) != nil else { return "" }
            let data = pipe.fileHandleForReading.readDataToEndOfFile()
            process.waitUntilExit()
            return String(decoding: data, as: UTF8.self)
        }
        // ArgumentParser prints "OVERVIEW: <abstract>", wrapped, then a blank line.
        let start = try #require(help.range(of: "OVERVIEW: "), "transportkit --help printed no OVERVIEW: \(help)")
        let overview = help[start.upperBound...].components(separatedBy: "\n\n").first ?? ""
        let words = Self.tokens(overview)
        for descriptor in try Self.builtInSchemes() {
            #expect(Self.names(descriptor, in: words),
                    "the tool's abstract (TransportKitCLI.configuration in Sources/transportkit/TransportKitCLI.swift) does not name \(Self.form(descriptor))\(descriptor.wraps ? "URL" : ""); add it. It reads: \(overview)")
        }
    }

    @Test("every C module is a dependency of CShimTests, and imported there")
    func shimTestsCoverEveryCModule() throws {
        let sources = Self.root.appendingPathComponent("Sources")
        let modules = try FileManager.default.contentsOfDirectory(atPath: sources.path).filter { name in
            FileManager.default.fileExists(atPath: sources.appendingPathComponent(name).appendingPathComponent("module.modulemap").path)
        }
        #expect(modules.count >= 5, "no C modules (Sources/*/module.modulemap) found: \(modules)")
        let package = try Self.read("Package.swift")
        let target = try #require(package.range(of: "name: \"CShimTests\""), "Package.swift has no CShimTests target")
        let rest = package[target.upperBound...]
        let listStart = try #require(rest.range(of: "dependencies: ["))
        let listEnd = try #require(rest[listStart.upperBound...].firstIndex(of: "]"))
        let dependencies = Set(Self.quoted(rest[listStart.upperBound..<listEnd]))
        let tests = try Self.read("Tests/CShimTests/CShimTests.swift").components(separatedBy: "\n")
        for module in modules {
            #expect(dependencies.contains(module), "Package.swift: the CShimTests target's dependencies lack \(module) (Sources/\(module)); add it")
            #expect(tests.contains("import \(module)"), "Tests/CShimTests/CShimTests.swift does not import \(module); import it and test its shim")
        }
    }
}
