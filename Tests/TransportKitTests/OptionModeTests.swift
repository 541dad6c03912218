import Foundation
import Glibc
import NIOCore
import NIOPosix
import Synchronization
import TestSupport
import Testing
@_spi(Plugins) import TransportKitLinux
@_spi(Plugins) @testable import TransportKit

/// Issue 25, item 7: an option a mode of a scheme takes must do something, and one it does not use
/// is refused with a message that names the mode. The table tests below are built from the
/// registered descriptors, so a new mode or option is covered (or fails) without editing them;
/// the connect tests give every option of a mode at once (the registry refuses a connect whose
/// plugin left one unread) and check its effect where one can be seen. Bluetooth and USB modes
/// are exercised the same way in the lab (Tests/LabTests/OptionModeLabTests.swift).
@Suite("options by mode: each used, the rest refused")
struct OptionModeTests {
    /// A URL of each mode of each built-in scheme, without options.
    static let samples: [String: String] = [
        "tcp:// connection": "tcp://127.0.0.1:9",
        "tcp:// listener": "tcp://127.0.0.1:0",
        "unix:// connection": "unix:///tmp/tk-mode.sock",
        "unix:// listener": "unix:///tmp/tk-mode.sock",
        "loop:// connection": "loop://",
        "tty:// connection to a USB adapter": "tty://usb/0403:6001",
        "tty:// connection to a device node": "tty:///dev/ttyUSB0",
        "pty:// connection": "pty://",
        "rfc2217:// connection": "rfc2217://127.0.0.1:9",
        "rfc2217:// listener": "rfc2217://127.0.0.1:0",
        "spy:// connection": "spy+loop://",
        "reconnect:// connection": "reconnect+loop://",
        "replay:// connection": "replay:///tmp/session.rec",
        "rfcomm:// connection to a channel": "rfcomm://00:11:22:33:44:55:3",
        "rfcomm:// connection found through SDP": "rfcomm://00:11:22:33:44:55",
        "rfcomm:// listener": "rfcomm://any",
        "ble:// L2CAP connection": "ble://FFF0:128/00:11:22:33:44:55",
        "ble:// GATT serial connection": "ble://nus/00:11:22:33:44:55",
        "ble:// L2CAP listener": "ble://FFF0:128",
        "ble:// GATT serial listener": "ble://nus",
        "ea:// connection": "ea://com.example",
        "usb:// connection": "usb://0403:6001",
        "usb:// control-only connection": "usb://0403:6001?controlOnly=true",
        "tls:// connection": "tls://127.0.0.1:9",
        "tls:// listener": "tls://127.0.0.1:0",
        "tls+ over another URL": "tls+loop://",
        "tls+ listener around a protocol on TCP": "tls+rfc2217://127.0.0.1:0",
        "ws:// connection": "ws://127.0.0.1:9/",
        "ws:// listener": "ws://127.0.0.1:0/",
        "wss:// connection": "wss://127.0.0.1:9/",
        "wss:// listener": "wss://127.0.0.1:0/",
        "http:// request": "http://127.0.0.1:9/",
        "https:// request": "https://127.0.0.1:9/",
    ]

    /// A value `spec` accepts, for URLs that give every option.
    static func value(for spec: OptionSpec) -> String {
        switch spec.kind {
        case .bool: return spec.defaultValue == "true" ? "false" : "true"
        case .integer(let min, let max): return String(Swift.max(min, Swift.min(max, 64)))
        case .number(let min, let max), .duration(let min, let max): return min == 0 ? (max >= 5 ? "5" : "1") : String(Int(min.rounded(.up)))
        case .choice(let values): return values.last ?? ""
        case .string:
            switch spec.name {
            case "mode": return "0640"
            case "rx", "tx": return "6E400003-B5A3-F393-E0A9-E50E24DCCA9E"
            case "uuid": return "1101"
            case "adapter": return "hci0"
            case "in": return "0x81"
            case "out": return "0x02"
            default: return "x"
            }
        }
    }

    /// The URL of `sample` with `spec` added (with its wrapper prefix). An option that selects
    /// another mode (`controlOnly`) is given as off, so the URL stays in `mode`.
    static func url(_ sample: String, adding spec: OptionSpec, wrapper: String?, mode: SchemeMode? = nil,
                    of descriptor: SchemeDescriptor? = nil) -> String {
        let name = wrapper.map { "\($0).\(spec.name)" } ?? spec.name
        if let mode, let descriptor, mode.selectedBy?.lowercased() != spec.name.lowercased(),
           descriptor.effectiveModes.contains(where: { $0.selectedBy?.lowercased() == spec.name.lowercased() }) {
            return sample + (sample.contains("?") ? "&" : "?") + "\(name)=false"
        }
        // The option that selects the sample's mode is in it already.
        if sample.contains("?\(name)=") || sample.contains("&\(name)=") { return sample }
        return sample + (sample.contains("?") ? "&" : "?") + "\(name)=\(value(for: spec))"
    }

    static var modes: [(descriptor: SchemeDescriptor, mode: SchemeMode)] {
        Transport.registry.schemes.flatMap { descriptor in descriptor.effectiveModes.map { (descriptor, $0) } }
    }

    @Test func everyModeOfEveryBuiltInSchemeHasASample() {
        for (_, mode) in Self.modes {
            #expect(Self.samples[mode.name] != nil, "no sample URL for the mode '\(mode.name)': add one above")
        }
    }

    @Test func anOptionAModeDoesNotUseIsRefusedNamingTheMode() throws {
        var refused = 0
        for (descriptor, mode) in Self.modes {
            guard let sample = Self.samples[mode.name] else { continue }
            let used = descriptor.options(of: mode).map { $0.name.lowercased() }
            for spec in descriptor.allOptions where !used.contains(spec.name.lowercased()) {
                let url = Self.url(sample, adding: spec, wrapper: descriptor.wraps ? descriptor.scheme : nil)
                do {
                    _ = try Transport.registry.resolve(url, role: mode.role)
                    Issue.record("\(url) (\(mode.role)) was taken, though \(mode.name) does not use \(spec.name)")
                } catch let error as TransportError {
                    #expect(error.kind == .invalidURL)
                    let shown = (descriptor.wraps ? descriptor.scheme + "." : "") + spec.name
                    #expect(error.message.contains("option '\(shown)' is not used by this mode, \(mode.phrase)"), "\(url): \(error.message)")
                    refused += 1
                }
            }
        }
        #expect(refused >= 25, "the built-in schemes have that many options some mode of theirs does not use (\(refused))")
    }

    @Test func everyOptionAModeUsesPassesValidation() throws {
        for (descriptor, mode) in Self.modes {
            guard let sample = Self.samples[mode.name] else { continue }
            for spec in descriptor.options(of: mode) {
                let url = Self.url(sample, adding: spec, wrapper: descriptor.wraps ? descriptor.scheme : nil, mode: mode, of: descriptor)
                #expect(throws: Never.self, "\(url) (\(mode.role))") { try Transport.registry.resolve(url, role: mode.role) }
                #expect(descriptor.mode(for: try TransportURL(url), role: mode.role)?.name == mode.name, "\(url) stays in \(mode.name)")
            }
        }
    }

    @Test func timeoutIsForConnectingOnly() async throws {
        let error = await expectTransportError(.invalidURL) { try await Transport.listen(on: "tcp://127.0.0.1:0?timeout=5") }
        #expect(error?.message.contains("option 'timeout' is not used by this mode, tcp:// listener") == true, "\(error?.message ?? "")")
    }

    // MARK: - The registry holds plugins to what they declare

    /// A plugin that declares `color` and never reads it.
    struct ForgetfulPlugin: TransportPlugin {
        static let color = URLOption.string("color", help: "Declared, never read")
        var schemes: [Scheme] {
            [Scheme(SchemeDescriptor(scheme: "forgetful", summary: "Ignores an option", grammar: "forgetful://[?color=NAME]",
                                     host: .forbidden, port: .forbidden, path: .forbidden, options: [Self.color])) { request in
                Connection(url: request.url, backend: try await request.connect(to: TransportURL("loop://")).backendForTests())
            }]
        }
    }

    @Test func aConnectWhosePluginIgnoredAnOptionIsRefusedAndClosed() async throws {
        let registry = try TransportRegistry(plugins: [ForgetfulPlugin(), LoopPlugin()])
        let error = await expectTransportError(.misuse) { try await registry.connect(to: "forgetful://?color=red") }
        #expect(error?.message.contains("accepted 'color' but never used it") == true, "\(error?.message ?? "")")
        // Without the option nothing is left unread.
        let plain = try await registry.connect(to: "forgetful://")
        try await plain.close()
    }

    @Test func aModeThatNamesAnUndeclaredOptionOrAnOptionNoModeUsesIsRefusedAtRegistration() {
        let stray = URLOption.bool("stray", default: false, help: "In no mode")
        let used = URLOption.bool("used", default: false, help: "In one")
        let descriptor = SchemeDescriptor(scheme: "modal", summary: "", grammar: "modal://", host: .forbidden, port: .forbidden, path: .forbidden,
                                          options: [stray, used],
                                          modes: [SchemeMode("modal:// connection", form: "modal://", options: [used, URLOption.bool("ghost", default: false, help: "")])])
        let problems = descriptor.declarationProblems().joined(separator: "; ")
        #expect(problems.contains("uses the option 'ghost', which the scheme does not declare"), "\(problems)")
        #expect(problems.contains("the option 'stray' is used by none of the modes"), "\(problems)")
    }

    @Test func aBooleanOptionTurnedOnSelectsItsMode() throws {
        let descriptor = try #require(Transport.registry.descriptor(for: "usb"))
        for (query, mode) in [("?controlOnly=true", "usb:// control-only connection"), ("?controlOnly", "usb:// control-only connection"),
                              ("?CONTROLONLY=yes", "usb:// control-only connection"), ("?controlOnly=false", "usb:// connection"),
                              ("", "usb:// connection")] {
            #expect(descriptor.mode(for: try TransportURL("usb://0403:6001\(query)"), role: .connect)?.name == mode, "\(query)")
        }
        let error = #expect(throws: TransportError.self) { try Transport.registry.resolve("usb://0403:6001?controlOnly=maybe", role: .connect) }
        #expect(error?.kind == .invalidURL && error?.message.contains("controlOnly") == true, "\(String(describing: error))")
        let refused = #expect(throws: TransportError.self) { try Transport.registry.resolve("usb://0403:6001?controlOnly=true&transfers=8", role: .connect) }
        #expect(refused?.message.contains("option 'transfers' is not used by this mode, usb:// control-only connection") == true,
                "\(String(describing: refused))")
    }

    @Test func aModeSelectedByAnOptionThatIsNotABooleanOfItsOwnIsRefusedAtRegistration() {
        let on = URLOption.bool("on", default: false, help: "Selects")
        let yes = URLOption.bool("yes", default: true, help: "True unless given")
        let late = URLOption.bool("late", default: false, help: "Selects a mode declared too late")
        let name = URLOption.string("name", help: "Not a boolean")
        let descriptor = SchemeDescriptor(scheme: "switched", summary: "", grammar: "switched://", host: .forbidden, port: .forbidden, path: .forbidden,
                                          options: [on, yes, late, name],
                                          modes: [SchemeMode("switched:// by name", form: "switched://?name=X", selectedBy: name, options: [name]),
                                                  SchemeMode("switched:// on", form: "switched://?on", selectedBy: on, options: [name]),
                                                  SchemeMode("switched:// yes", form: "switched://?yes", selectedBy: yes, options: [yes]),
                                                  SchemeMode("switched:// connection", form: "switched://", options: [on, name]),
                                                  SchemeMode("switched:// late", form: "switched://?late", selectedBy: late, options: [late])])
        let problems = descriptor.declarationProblems().joined(separator: "; ")
        #expect(problems.contains("'switched:// by name' is selected by 'name', which is not a boolean option"), "\(problems)")
        #expect(problems.contains("'switched:// on' is selected by 'on' but does not list it among its options"), "\(problems)")
        #expect(problems.contains("'switched:// yes' is selected by 'yes', whose default is true"), "\(problems)")
        #expect(problems.contains("'switched:// late' comes after a connect mode without selectors"), "\(problems)")
        #expect(!problems.contains("'switched:// on' comes after"), "\(problems)")
    }

    @Test func usbControlOnlyRefusesAltOrDetachWithoutAnInterfaceBeforeWaitingForTheDevice() async throws {
        for (option, says) in [("alt=1", "alt= sets the alternate setting"), ("detach=true", "detach=true takes the claimed interface")] {
            let started = ContinuousClock.now
            let error = await expectTransportError(.invalidURL) {
                try await Transport.connect(to: "usb://0403:6001?controlOnly=true&\(option)&wait=true&timeout=120")
            }
            #expect(error?.message.contains(says) == true && error?.message.contains("give interface= too") == true, "\(String(describing: error))")
            // Well below wait's 120 s (5.2 s once under ThreadSanitizer with the suite in parallel).
            #expect(ContinuousClock.now - started < .seconds(60), "refused before waiting for the device")
        }
    }

    // MARK: - Every option of a mode, and its effect

    /// The options of `mode` that `url` does not give.
    static func missing(_ url: String, mode name: String, scheme: String) throws -> [String] {
        let descriptor = try #require(Transport.registry.descriptor(for: scheme))
        let mode = try #require(descriptor.effectiveModes.first { $0.name == name })
        let parsed = try TransportURL(url)
        var layer: TransportURL? = parsed
        var given: [String] = []
        while let current = layer {
            if current.scheme == scheme { given = current.query.map { $0.name.lowercased() } }
            layer = current.inner
        }
        return descriptor.options(of: mode).map { $0.name.lowercased() }.filter { !given.contains($0) }
    }

    static func socketOption(_ connection: Connection, _ level: NIOBSDSocket.OptionLevel, _ name: Int32) async throws -> Int {
        if let socket = connection.backend(as: StreamSocketBackend.self) {
            return Int(try socket.integerOption(level: level.rawValue, name: name))
        }
        let backend = try #require(connection.backend(as: ChannelBackend.self))
        let option = ChannelOptions.Types.SocketOption(level: level, name: NIOBSDSocket.Option(rawValue: name))
        return try await backend.channel.getOption(option).get()
    }

    /// The backlog ss(8) shows for a listening socket (its Send-Q column).
    /// Runs ss(8) and waits for it: call it off the cooperative pool.
    static func listenBacklog(_ filter: [String]) -> Int? {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/ss")
        process.arguments = ["-lnH"] + filter
        let output = Pipe()
        process.standardOutput = output
        guard (try? process.run()) != nil else { return nil }
        let data = output.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        let fields = String(decoding: data, as: UTF8.self).split(separator: "\n").first?.split(separator: " ", omittingEmptySubsequences: true) ?? []
        // Netid (with -x and -t both absent: shown), State, Recv-Q, Send-Q …
        guard let listen = fields.firstIndex(of: "LISTEN"), fields.count > listen + 2 else { return nil }
        return Int(fields[listen + 2])
    }

    @Test func aTCPConnectionSetsEverySocketOption() async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let url = "tcp://127.0.0.1:\(listener.url.port ?? 0)?noDelay=false&keepAlive=true&keepAliveIdle=30&timeout=30"
        #expect(try Self.missing(url, mode: "tcp:// connection", scheme: "tcp").isEmpty)
        let connection = try await Transport.connect(to: url)
        #expect(try await Self.socketOption(connection, .tcp, TCP_NODELAY) == 0)
        #expect(try await Self.socketOption(connection, .socket, SO_KEEPALIVE) == 1)
        #expect(try await Self.socketOption(connection, .tcp, TCP_KEEPIDLE) == 30)
        try await connection.close()
        try await listener.close()
    }

    @Test func aTCPListenerAppliesItsOptionsToEveryAcceptedConnection() async throws {
        let url = "tcp://127.0.0.1:0?backlog=7&noDelay=false&keepAlive=true&keepAliveIdle=31"
        #expect(try Self.missing(url, mode: "tcp:// listener", scheme: "tcp").isEmpty)
        let listener = try await Transport.listen(on: url)
        let port = listener.url.port ?? 0
        #expect(await Support.offPool { Self.listenBacklog(["-t", "sport = :\(port)"]) } == 7, "ss shows the backlog asked for")
        let client = try await Transport.connect(to: "tcp://127.0.0.1:\(port)")
        let accepted = try #require(try await listener.accept())
        #expect(try await Self.socketOption(accepted, .tcp, TCP_NODELAY) == 0)
        #expect(try await Self.socketOption(accepted, .socket, SO_KEEPALIVE) == 1)
        #expect(try await Self.socketOption(accepted, .tcp, TCP_KEEPIDLE) == 31)
        try await client.close()
        try await accepted.close()
        try await listener.close()
    }

    @Test func aUnixListenerTakesItsBacklogAndMode() async throws {
        let path = temporaryPath("modes.sock")
        let url = "unix://\(path)?backlog=5&mode=0640"
        #expect(try Self.missing(url, mode: "unix:// listener", scheme: "unix").isEmpty)
        let listener = try await Transport.listen(on: url)
        var info = stat()
        #expect(lstat(path, &info) == 0 && info.st_mode & 0o7777 == 0o640)
        #expect(await Support.offPool { Self.listenBacklog(["-x", "src", path]) } == 5)
        let client = try await Transport.connect(to: "unix://\(path)?timeout=60")
        #expect(try Self.missing("unix://\(path)?timeout=60", mode: "unix:// connection", scheme: "unix").isEmpty)
        let accepted = try #require(try await listener.accept())
        try await client.close()
        try await accepted.close()
        try await listener.close()
        let bad = await expectTransportError(.invalidURL) { try await Transport.listen(on: "unix://\(path)?mode=0999") }
        #expect(bad?.message.contains("is not a file mode") == true)
        #expect(!FileManager.default.fileExists(atPath: path), "a refused mode leaves no socket file")
    }

    @Test func aLoopTakesEveryOption() async throws {
        let url = "loop://?buffer=100&messages=true&maxWrite=10&timeout=60"
        #expect(try Self.missing(url, mode: "loop:// connection", scheme: "loop").isEmpty)
        let loop = try await Transport.connect(to: url)
        #expect(loop.metadata.maximumWriteSize == 10)
        #expect(loop.carriesMessages)
        try await loop.close()
    }

    @Test("an option's former name is still accepted, counted as read, and refused beside its current name")
    func formerNames() async throws {
        // loop://'s maxWrite was mtu, ble://'s receiveMTU was mtu.
        let loop = try await Transport.connect(to: "loop://?MTU=7&buffer=64")
        #expect(loop.metadata.maximumWriteSize == 7)
        try await loop.close()
        let both = await expectTransportError(.invalidURL) { try await Transport.connect(to: "loop://?mtu=7&maxWrite=8") }
        #expect(both?.message.contains("option 'maxWrite' is given twice, under its name and its former name 'mtu'; keep only 'maxWrite'") == true,
                "\(both?.message ?? "")")
        let range = await expectTransportError(.invalidURL) { try await Transport.connect(to: "loop://?mtu=0") }
        #expect(range?.message.contains("option 'mtu=0'") == true, "the message names the option as written: \(range?.message ?? "")")
        // A GATT URL has no use for the L2CAP receive MTU, under either name.
        let gatt = await expectTransportError(.invalidURL) { try await Transport.registry.check("ble://nus/E3:2E:44:66:A2:4A?mtu=100") }
        #expect(gatt?.message.contains("option 'mtu' is not used by this mode") == true, "\(gatt?.message ?? "")")
        let ble = try #require(Transport.registry.descriptor(for: "ble"))
        #expect(ble.helpText.contains("receiveMTU (integer 23…65535; formerly mtu)"), "\(ble.helpText)")
    }

    @Test("a former name that another option has, or that is malformed, is a declaration problem")
    func formerNameProblems() {
        let taken = SchemeDescriptor(scheme: "renamed", summary: "s", grammar: "renamed://", examples: [], host: .forbidden, port: .forbidden,
                                     path: .forbidden, options: [URLOption.integer("size", in: 1...9, help: "h"),
                                                                 URLOption.integer("length", in: 1...9, help: "h").formerly("SIZE", "bad-name")])
        let problems = taken.declarationProblems()
        #expect(problems.contains { $0.contains("the option 'SIZE' is declared twice") }, "\(problems)")
        #expect(problems.contains { $0.contains("the option name 'bad-name' must start with a letter") }, "\(problems)")
        // A mode is picked by the URL's item of its selector's exact name: a selector keeps one name.
        let only = URLOption.bool("only", help: "Selects the second mode").formerly("solely")
        let selected = SchemeDescriptor(scheme: "selected", summary: "s", grammar: "selected://", host: .forbidden, port: .forbidden,
                                        path: .forbidden, options: [only],
                                        modes: [SchemeMode("selected:// plain connection", form: "selected://", options: []),
                                                SchemeMode("selected:// only connection", form: "selected://?only", selectedBy: only, options: [only])])
        let selectorProblems = selected.declarationProblems()
        #expect(selectorProblems.contains { $0.contains("is selected by 'only', which has former names") }, "\(selectorProblems)")
    }

    @Test func aPtyTakesEveryOption() async throws {
        let link = temporaryPath("mode-pty")
        let url = "pty://?baud=19200&stopBits=2&flowControl=xonxoff&link=\(link)&timeout=60"
        #expect(try Self.missing(url, mode: "pty:// connection", scheme: "pty").isEmpty)
        let pty = try await Transport.connect(to: url)
        let peer = try #require(pty.metadata.extra["peer"])
        #expect(FileManager.default.destinationOfSymbolicLinkAtPathOrNil(link) == peer)
        let fd = open(peer, O_RDWR | O_NOCTTY)
        var tio = termios()
        #expect(tcgetattr(fd, &tio) == 0)
        #expect(cfgetospeed(&tio) == speed_t(B19200))
        #expect(tio.c_cflag & tcflag_t(CSTOPB) != 0)
        #expect(tio.c_iflag & tcflag_t(IXON) != 0)
        close(fd)
        try await pty.close()
    }

    @Test func aTTYByPathTakesEveryOption() async throws {
        // A pty made here plays the serial port: every option but the modem lines works on it.
        var master: Int32 = -1
        var peer: Int32 = -1
        #expect(openpty(&master, &peer, nil, nil, nil) == 0)
        defer { close(master); close(peer) }
        let path = FileManager.default.destinationOfSymbolicLinkAtPathOrNil("/proc/self/fd/\(peer)") ?? ""
        var before = termios()
        _ = tcgetattr(peer, &before)
        let url = "tty://\(path)?baud=57600&dataBits=8&parity=none&stopBits=2&flowControl=rtscts&exclusive=false&lowLatency=true&wait=true&restore=true&timeout=60"
        let missing = try Self.missing(url, mode: "tty:// connection to a device node", scheme: "tty")
        #expect(missing.sorted() == ["dtr", "rts"], "the modem lines are checked below: \(missing)")
        let tty = try await Transport.connect(to: url)
        var during = termios()
        _ = tcgetattr(peer, &during)
        #expect(cfgetospeed(&during) == speed_t(B57600))
        #expect(during.c_cflag & tcflag_t(CSTOPB) != 0)
        #expect(during.c_cflag & tcflag_t(CRTSCTS) != 0)
        #expect(tty.metadata.extra["lowLatency"] != nil, "low latency was asked of the driver")
        try await tty.close()
        var after = termios()
        _ = tcgetattr(peer, &after)
        #expect(cfgetospeed(&after) == cfgetospeed(&before), "restore=true put the settings back")
        // A pty keeps 8 data bits without parity whatever is asked: an error, not a setting ignored.
        let framing = await expectTransportError(.unsupported) { try await Transport.connect(to: "tty://\(path)?dataBits=7&parity=even") }
        #expect(framing?.message.contains("is a pseudo-terminal, which has no parity bit and carries only 8 data bits") == true, "\(framing?.message ?? "")")
        // A pty has no modem lines: asking for them is an error, so the options are not ignored.
        for option in ["dtr=true", "rts=false"] {
            let error = await expectTransportError(.unsupported) { try await Transport.connect(to: "tty://\(path)?\(option)") }
            #expect(error?.message.contains("has no modem control lines") == true, "\(option): \(error?.message ?? "")")
        }
    }

    @Test func aSpyLayerTakesEveryOption() async throws {
        let trace = temporaryPath("mode-trace")
        let recording = temporaryPath("mode-recording")
        defer { unlink(recording) }
        let url = "spy+loop://?spy.format=hex&spy.direction=rx&spy.file=\(trace)&spy.label=[mode]&spy.record=\(recording)"
        #expect(try Self.missing(url, mode: "spy:// connection", scheme: "spy").isEmpty)
        try await Transport.withConnection(to: url) { loop in
            try await loop.write("abc")
            _ = try await loop.read(timeout: .seconds(5))
        }
        let text = try String(contentsOfFile: trace, encoding: .utf8)
        #expect(text.split(separator: "\n").allSatisfy { $0.hasPrefix("[mode] ") }, "every line labelled: \(text)")
        #expect(text.contains(" RX ") && !text.contains(" TX "), "direction=rx: \(text)")
        let recorded = try String(contentsOfFile: recording, encoding: .utf8)
        #expect(recorded.contains(" > \"abc\"") && recorded.contains(" < \"abc\""), "the recording has both directions: \(recorded)")
        let raw = await expectTransportError(.invalidURL) { try await Transport.connect(to: "spy+loop://?spy.format=raw&spy.label=x") }
        #expect(raw?.message.contains("spy.label= begins the lines of the hex format") == true)
    }
}

extension Connection {
    /// This connection's backend, to wrap in a test plugin's own connection.
    fileprivate func backendForTests() -> any ConnectionBackend { LoopThrough(self) }
}

/// Passes everything to another connection (a test plugin's stand-in backend).
private final class LoopThrough: ConnectionBackend {
    let inner: Connection
    init(_ inner: Connection) { self.inner = inner }
    var supportsHalfClose: Bool { inner.supportsHalfClose }
    func read() async throws -> ByteBuffer? { try await inner.readBuffer() }
    func write(_ buffer: ByteBuffer) async throws { try await inner.write(buffer) }
    func closeWrite() async throws { try await inner.closeWrite() }
    func close() async throws { try await inner.close() }
}

extension FileManager {
    fileprivate func destinationOfSymbolicLinkAtPathOrNil(_ path: String) -> String? {
        try? destinationOfSymbolicLink(atPath: path)
    }
}
