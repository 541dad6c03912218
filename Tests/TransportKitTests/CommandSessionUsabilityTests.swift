import Testing
@testable import TransportKit

/// What new users tripped on with CommandSession (issue 30): the README's spelling returned the
/// device's echo, a command could not have a timeout of its own, and an answer more than about a
/// second late put a default session one answer behind.
@Suite("CommandSession: what new users tripped on")
struct CommandSessionUsabilityTests {
    @Test("the README's spelling returns just the answer, whether the device echoes or not", arguments: [true, false])
    func theReadmeSpellingReturnsTheAnswer(deviceEchoes: Bool) async throws {
        try await withScriptedELM(echo: deviceEchoes) { (connection: Connection) async throws in
            let elm = CommandSession(connection, terminator: ">")
            #expect(try await elm.send("ATRV") == "12.6V")
            #expect(try await elm.send("ATZ") == "ELM327 v1.5")
            #expect(try await elm.send("0100") == "41 00 BE 3F A8 13\n41 00 98 18 80 11")
            #expect(try await elm.send("AT") == "?", "an echo is a whole line: \"AT\" is not cut from \"ATRV\"")
        }
    }

    @Test("echo: .keep returns the device's bytes, echo included; the setting can change between commands")
    func keepingTheEcho() async throws {
        try await withScriptedELM(echo: true) { (connection: Connection) async throws in
            var elm = CommandSession(connection, terminator: ">", echo: .keep)
            #expect(try await elm.send("ATRV") == "ATRV\n12.6V")
            #expect(try await elm.request(Array("ATRV\r".utf8)) == Array("ATRV\r12.6V\r\r".utf8))
            elm.echo = .strip
            #expect(try await elm.send("ATRV") == "12.6V")
            #expect(try await elm.request(Array("ATRV\r".utf8), timeout: .seconds(20)) == Array("12.6V\r\r".utf8))
        }
    }

    @Test("a timeout for one command, shorter or longer than the session's")
    func aTimeoutPerCommand() async throws {
        let slow: [String: [Duration]] = ["SLOW": [.milliseconds(2500), .milliseconds(2500)]]
        try await withScriptedELM(echo: true, delays: slow) { (connection: Connection) async throws in
            let patient = CommandSession(connection, timeout: .seconds(60))
            let clock = ContinuousClock()
            let start = clock.now
            _ = await expectTransportError(.timedOut) { try await patient.send("SLOW", timeout: .seconds(1)) }
            #expect(clock.now - start < .seconds(30), "the command's 1 s, not the session's 60 s")
            #expect(try await patient.send("ATRV") == "12.6V", "SLOW's late answer is not ATRV's")

            let hasty = CommandSession(connection, timeout: .seconds(1))
            #expect(try await hasty.send("SLOW", timeout: .seconds(20)) == "LATE ANSWER", "the command's 20 s, not the session's 1 s")
            #expect(hasty.timeout == .seconds(1), "the session's own timeout is unchanged")
            #expect(try await hasty.send("ATRV") == "12.6V")
        }
    }

    @Test("an answer seconds late does not put a default session one answer behind")
    func aVeryLateAnswerIsNotTheNextCommands() async throws {
        try await withScriptedELM(echo: true, delays: ["SLOW": [.seconds(3)]]) { (connection: Connection) async throws in
            let elm = CommandSession(connection, terminator: ">")   // the defaults: 5 s, late answers waited for 1 s
            _ = await expectTransportError(.timedOut) { try await elm.send("SLOW", timeout: .seconds(1)) }
            // SLOW's answer comes at 3 s, after ATRV's 1-s wait for it gave up: its echo marks it.
            #expect(try await elm.send("ATRV") == "12.6V")
            #expect(try await elm.send("ATZ") == "ELM327 v1.5")
            #expect(try await elm.send("0100") == "41 00 BE 3F A8 13\n41 00 98 18 80 11")
        }
    }

    @Test("without an echo, an answer seconds late costs one answer at most")
    func withoutEchoTheSessionComesBackInStep() async throws {
        try await withScriptedELM(echo: false, delays: ["SLOW": [.seconds(3)]]) { (connection: Connection) async throws in
            let elm = CommandSession(connection, terminator: ">")
            _ = await expectTransportError(.timedOut) { try await elm.send("SLOW", timeout: .seconds(1)) }
            // Nothing tells SLOW's answer (at 3 s, after the 1-s wait) from ATRV's: ATRV gets it,
            // unless a loaded machine's wait was still on when it came.
            let displaced = try await elm.send("ATRV")
            #expect(displaced == "LATE ANSWER" || displaced == "12.6V")
            try await Task.sleep(for: .seconds(1))   // ATRV's own answer arrives meanwhile
            #expect(try await elm.send("ATZ") == "ELM327 v1.5", "the answer ATRV displaced is dropped, not read as ATZ's")
            #expect(try await elm.send("ATRV") == "12.6V")
        }
    }

    @Test("polling one command: after a timeout its answers come back in step")
    func pollingTheSameCommand() async throws {
        try await withScriptedELM(echo: true, delays: ["COUNT": [.seconds(3)]]) { (connection: Connection) async throws in
            let elm = CommandSession(connection, terminator: ">")
            _ = await expectTransportError(.timedOut) { try await elm.send("COUNT", timeout: .seconds(1)) }
            // The late N=1 echoes the same command: the same question's answer, older.
            let next = try await elm.send("COUNT")
            #expect(next == "N=1" || next == "N=2")
            try await Task.sleep(for: .seconds(1))   // the poll interval
            #expect(try await elm.send("COUNT") == "N=3", "the answer the late one displaced is dropped")
            #expect(try await elm.send("ATRV") == "12.6V")
            #expect(try await elm.send("COUNT") == "N=4")
        }
    }

    @Test("a cancelled command's answer is not the next command's")
    func aCancelledCommandsAnswerIsDropped() async throws {
        try await withScriptedELM(echo: true, delays: ["SLOW": [.seconds(3)]]) { (connection: Connection) async throws in
            let elm = CommandSession(connection, terminator: ">")
            let waiting = Task { try await elm.send("SLOW") }
            try await Task.sleep(for: .milliseconds(500))
            waiting.cancel()
            let outcome = await waiting.result
            #expect(throws: CancellationError.self) { try outcome.get() }
            #expect(try await elm.send("ATRV") == "12.6V")
            #expect(try await elm.send("ATZ") == "ELM327 v1.5")
        }
    }

    @Test("a response that came before the command is not its answer, unless lateAnswerWait is nil")
    func aBannerIsNotTheFirstAnswer() async throws {
        let c = try await Transport.connect(to: "loop://?buffer=65536")
        try await c.write("\r\rELM327 v1.5\r\r>")   // unasked: an adapter's power-up banner
        // On a loop the command (ended by the prompt character) comes back as its own answer.
        let session = CommandSession(c, terminator: ">", lineEnding: ">")
        #expect(try await session.send("fresh") == "fresh")
        try await c.write("stale>")
        let inTurn = CommandSession(c, terminator: ">", lineEnding: ">", lateAnswerWait: nil)
        #expect(try await inTurn.send("fresh") == "stale", "lateAnswerWait: nil reads every response in turn")
        try await c.close()
    }

    /// Runs `body` against a scripted ELM327-like device over tcp on loopback.
    private func withScriptedELM(echo: Bool, delays: [String: [Duration]] = [:],
                                 _ body: (Connection) async throws -> Void) async throws {
        let listener = try await Transport.listen(on: "tcp://127.0.0.1:0")
        let device = Task {
            let connection = try #require(try await listener.accept())
            await runScriptedELM(connection, echo: echo, delays: delays)
            try await connection.close()
        }
        let connection = try await Transport.connect(to: "tcp://127.0.0.1:\(listener.url.port ?? 0)")
        let outcome: Result<Void, any Error>
        do {
            try await body(connection)
            outcome = .success(())
        } catch {
            outcome = .failure(error)
        }
        try await connection.close()
        try await device.value
        try await listener.close()
        try outcome.get()
    }
}

/// An ELM327-like device: one command at a time, in turn, as an adapter works. With `echo` it
/// echoes each command as it reads it (`ATE1`, the adapter's default), before working on it.
/// `delays[command][n]` is how long the n-th `command` takes (none: at once). "COUNT" answers
/// "N=1", "N=2", … so that the answers to a repeated command can be told apart.
private func runScriptedELM(_ device: Connection, echo: Bool, delays: [String: [Duration]]) async {
    var seen: [String: Int] = [:]
    do {
        while let frame = try await device.readFrame(.delimiter("\r")) {
            let command = String(decoding: frame, as: UTF8.self)
            let index = seen[command, default: 0]
            seen[command] = index + 1
            if echo { try await device.write(command + "\r") }
            if let delay = delays[command], index < delay.count { try await Task.sleep(for: delay[index]) }
            let answer: String = switch command {
            case "ATZ": "\rELM327 v1.5"
            case "ATRV": "12.6V"
            case "0100": "41 00 BE 3F A8 13\r41 00 98 18 80 11"
            case "SLOW": "LATE ANSWER"
            case "COUNT": "N=\(index + 1)"
            default: "?"
            }
            try await device.write(answer + "\r\r>")
        }
    } catch {
        // The session closed while the device worked on a command: the device stops too.
    }
}
