// ReconnectPlugin.swift: the `reconnect+URL` wrapper: one Connection that outlives the losses of
// the connection it wraps. The descriptor and its options; ReconnectBackend does the work.

@_spi(Plugins) import TransportKitCore

/// The `reconnect+URL` wrapper: a connection that connects again, with backoff, each time the one
/// it wraps is lost (a device unplugged, a server restarted, a link out of range), and keeps the
/// same `Connection` for the application.
///
/// ```swift
/// let port = try await Transport.connect(to: "reconnect+tty://usb/0403:6001?serial=A50285BI&baud=115200")
/// Task { for await event in port.events() { print(event) } }   // "disconnected: …", "connected again …"
/// while let bytes = try await port.read() { print(bytes) }     // reads carry on across replugs
/// ```
///
/// At most once: a write that was in flight when the link dropped fails with `.disconnected`, and
/// is never sent again; writes while no connection is up fail at once, or wait up to
/// `reconnect.writeWait`. What the application set on a serial port (line settings, DTR, RTS)
/// is set again on each new connection, as the URL's options are.
public struct ReconnectPlugin: TransportPlugin {
    /// The plugin; `Transport.builtInPlugins` has one.
    public init() {}

    static let initialDelay = URLOption.duration("initialDelay", seconds: 0...3600, default: 1,
                                                 help: "Seconds before the first attempt after a loss (gRPC's backoff: 1)")
    static let multiplier = URLOption.number("multiplier", in: 1...10, default: 1.6, help: "Each next delay is this many times the last (1.6)")
    static let maxDelay = URLOption.duration("maxDelay", seconds: 0...86400, default: 120, help: "The longest delay between attempts, in seconds (120)")
    static let jitter = URLOption.number("jitter", in: 0...1, default: 0.2,
                                         help: "Each delay moves by a random part of up to this share of itself (0.2: ±20 %), so clients do not come back in step")
    static let stableAfter = URLOption.duration("stableAfter", seconds: 0...86400, default: 10,
                                                help: "A connection that stayed up this many seconds starts the next outage's delays from the first again")
    static let attempts = URLOption.integer("attempts", in: 0...1_000_000, default: 0,
                                            help: "Give up after this many failed attempts in one outage (0: never)")
    static let giveUpAfter = URLOption.timeLimit("giveUpAfter", seconds: 0...31_536_000, default: 0,
                                                 help: "Give up when one outage has lasted this many seconds (0: never)")
    static let writeWait = URLOption.duration("writeWait", seconds: 0...86400, default: 0,
                                              help: "Seconds a write waits for the next connection while none is up (0: it fails at once with .disconnected)")

    /// The `reconnect` wrapper scheme.
    public var schemes: [Scheme] {
        [Scheme.wrapper(SchemeDescriptor(
            scheme: "reconnect",
            summary: "Wraps any URL and connects again, with backoff, each time the connection is lost; one Connection throughout",
            grammar: "reconnect+URL[?reconnect.initialDelay=S&reconnect.multiplier=X&reconnect.maxDelay=S&reconnect.jitter=F&"
                + "reconnect.stableAfter=S&reconnect.attempts=N&reconnect.giveUpAfter=S&reconnect.writeWait=S]",
            examples: ["reconnect+tty://usb/0403:6001?serial=A50285BI&baud=115200", "reconnect+tcp://192.168.1.20:4001?reconnect.maxDelay=10",
                       "reconnect+rfc2217://rack-pi:4001?baud=9600&reconnect.writeWait=30"],
            host: .forbidden, port: .forbidden, path: .forbidden,
            options: [Self.initialDelay, Self.multiplier, Self.maxDelay, Self.jitter, Self.stableAfter, Self.attempts, Self.giveUpAfter, Self.writeWait]
        ), connect: { request in
            let settings = ReconnectSettings(request)
            // The first connection is made as a plain connect would be, inside its deadline: a
            // URL that is wrong, or a device that is not there, fails now (tty://…?wait=true
            // waits for it to appear).
            let first = try await request.connectInner()
            let core = ReconnectCore(first: first, request: request, settings: settings)
            let backend: any ConnectionBackend = first.serialPort == nil ? ReconnectBackend(core: core) : ReconnectSerialBackend(core: core)
            return Connection(url: request.url, backend: backend, metadata: first.metadata)
        })]
    }
}

/// A reconnect layer's options, read together.
struct ReconnectSettings: Sendable {
    var initialDelay: Duration
    var multiplier: Double
    var maxDelay: Duration
    var jitter: Double
    var stableAfter: Duration
    var attempts: Int
    var giveUpAfter: Duration?
    var writeWait: Duration

    init(_ request: ConnectRequest) {
        initialDelay = request[ReconnectPlugin.initialDelay]
        multiplier = request[ReconnectPlugin.multiplier]
        maxDelay = request[ReconnectPlugin.maxDelay]
        jitter = request[ReconnectPlugin.jitter]
        stableAfter = request[ReconnectPlugin.stableAfter]
        attempts = request[ReconnectPlugin.attempts]
        giveUpAfter = request[ReconnectPlugin.giveUpAfter]
        writeWait = request[ReconnectPlugin.writeWait]
    }

    var backoff: Backoff {
        Backoff(initial: initialDelay, multiplier: multiplier, maximum: maxDelay, jitter: jitter)
    }
}
