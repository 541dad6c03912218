// LocalTerminal.swift: the terminal `transportkit term` runs in, through termios(3). Raw mode as
// cfmakeraw(3) sets it (no echo, no line editing, no signal keys, no output processing), so that
// every key, Ctrl-C included, reaches the device as a byte and its bytes reach the screen untouched.
// The settings from before are put back on every way out: the normal end, a signal the tool
// handles (Signals.run), the tool's own forced exit, and a crash (SIGSEGV, SIGILL, SIGTRAP, SIGBUS,
// SIGFPE, SIGABRT, and SIGQUIT, which Swift's backtracer also takes), whose handler restores them
// and passes the signal on. A signal nothing here handles (SIGKILL, a stop signal sent by another
// process, SIGUSR1 and the like) leaves a raw terminal behind; `stty sane` mends it.

import Glibc
import SystemPackage
import TransportKit

enum LocalTerminal {
    /// The settings standard input had before raw mode, for the crash handler. Written once, in
    /// `enterRawMode`, before the handlers that read it are installed and before raw mode is set;
    /// after that only read (by `restore` and by the signal handler, which may run on any thread),
    /// so no lock is needed, and a signal handler could not take one.
    nonisolated(unsafe) private static var saved = termios()
    nonisolated(unsafe) private static var isRaw = false
    /// The crash signals' handlers from before (the Swift runtime's backtracer): written once, as
    /// the handlers are installed; read by the handler, which puts the old one back and raises the
    /// signal again, so that a crash still prints its backtrace and ends as it would have.
    nonisolated(unsafe) private static let previous: UnsafeMutablePointer<sigaction> = {
        let table = UnsafeMutablePointer<sigaction>.allocate(capacity: 7)   // kept for the process's life
        table.initialize(repeating: sigaction(), count: 7)
        return table
    }()

    /// The signals that mean a crash: the handler puts the terminal back, then the signal does
    /// what it would have done.
    static let crashSignals: [Int32] = [SIGSEGV, SIGBUS, SIGILL, SIGTRAP, SIGFPE, SIGABRT, SIGQUIT]

    /// Whether signal `number` with `si_code` `code` comes back by itself when its handler
    /// returns: a synchronous fault whose instruction runs again. Not SIGABRT or SIGQUIT, not a
    /// signal sent by a process (code ≤ 0), not x86's int3 (SIGTRAP, already past it), not an
    /// asynchronous machine-check SIGBUS (BUS_MCEERR_AO, 5).
    private static func replays(_ number: Int32, code: Int32) -> Bool {
        switch number {
        case SIGSEGV, SIGILL, SIGFPE: return code > 0
        case SIGBUS: return code > 0 && code != 5
        case SIGTRAP:
            #if arch(arm64)
            return code == 1   // TRAP_BRKPT: brk leaves the PC on the instruction
            #else
            return false
            #endif
        default: return false
        }
    }

    /// The crash signal's place in `previous`.
    private static func slot(_ number: Int32) -> Int? {
        switch number {
        case SIGSEGV: 0
        case SIGBUS: 1
        case SIGILL: 2
        case SIGTRAP: 3
        case SIGFPE: 4
        case SIGABRT: 5
        case SIGQUIT: 6
        default: nil
        }
    }

    /// Standard input's terminal settings now; throws when it is not a terminal.
    static func settings() throws -> termios {
        var current = termios()
        guard tcgetattr(0, &current) == 0 else {
            let failure = Errno(rawValue: errno)
            if failure == .inappropriateIOCTLForDevice || failure == .invalidArgument {
                throw TransportError(.unsupported, "term needs a terminal on standard input, and it is a file or a pipe; "
                                     + "run it from a terminal, or use `transportkit connect` to relay a pipe")
            }
            throw TransportError.posix("tcgetattr", errno: failure, what: "standard input")
        }
        return current
    }

    /// Puts standard input's terminal in raw mode. Throws when standard input is not a terminal.
    static func enterRawMode() throws {
        let current = try settings()
        saved = current
        var action = sigaction()
        action.__sigaction_handler.sa_sigaction = { number, info, _ in
            LocalTerminal.restore()
            // The handler from before (Swift's backtracer, or the default action) gets the signal.
            if let index = LocalTerminal.slot(number) {
                sigaction(number, LocalTerminal.previous + index, nil)   // pointers and a switch: nothing counted or allocated in a handler
            }
            // A fault that happens again when the handler returns (the faulting instruction runs
            // again) reaches the handler from before with its real address and context.
            if LocalTerminal.replays(number, code: info?.pointee.si_code ?? Int32(SI_USER)) { return }
            // Anything else (kill(2), abort(3), int3, a keyboard SIGQUIT) is raised again; if the
            // handler from before returns (Swift's does, expecting a fault to come back), the
            // default action ends the process.
            raise(number)
            signal(number, SIG_DFL)
            raise(number)
        }
        // On the alternate stack where the thread has one (the one that installed Swift's crash
        // handler does; the pool's threads do not, so a stack overflow there is not caught).
        action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER
        sigemptyset(&action.sa_mask)
        for number in crashSignals {
            if let index = slot(number) { sigaction(number, &action, previous + index) }
        }
        var raw = current
        cfmakeraw(&raw)
        // One byte is enough for read(2) to return; no timer.
        withUnsafeMutableBytes(of: &raw.c_cc) { cc in
            cc[Int(VMIN)] = 1
            cc[Int(VTIME)] = 0
        }
        isRaw = true   // before the change: a crash from here on finds the settings to put back
        guard tcsetattr(0, TCSAFLUSH, &raw) == 0 else {
            throw TransportError.posix("tcsetattr", errno: Errno(rawValue: errno), what: "standard input")
        }
    }

    /// Puts the settings from before raw mode back, if raw mode was set. Async-signal-safe: only
    /// tcsetattr(3), which is ioctl(2). Called more than once, it sets the same settings again.
    static func restore() {
        guard isRaw else { return }
        var settings = saved
        _ = tcsetattr(0, TCSANOW, &settings)
    }
}
