// Uses the plugin through a registry of its own: no built-in scheme, no TransportKit umbrella.
import ReverseScheme
import TransportKitCore

let registry = try TransportRegistry(plugins: [ReversePlugin()])
let answer = try await registry.withConnection(to: "reverse://?limit=64") { connection in
    try await connection.write("stressed")
    try await connection.closeWrite()
    var text = ""
    while let chunk = try await connection.read() { text += String(decoding: chunk, as: UTF8.self) }
    return text
}
print(answer)
do {
    try await registry.check("reverse://?limit=0")
} catch let error as TransportError {
    print(error.kind, error.message)
}
