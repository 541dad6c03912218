// ServiceDiscovery.swift: the SDP client (libbluetooth's sdp_lib.h) that finds the RFCOMM channel
// of a service on a remote device, for rfcomm://MAC without a channel.
//
// Facts (shared/PLATFORM-NOTES.md, BlueZ lib/bluetooth/sdp.c): a search of a remote device needs no
// bluetoothd --compat (that is for local records only). The L2CAP channel to PSM 1 is made here,
// with the same non-blocking connect as every other socket; sdp_create() then wraps it, and
// sdp_service_search_attr_req() sends one request and waits for the answer in select(2) for up to
// 20 s. That wait runs on a thread of its own (Blocking.runOnThread); a cancellation (the registry's connect deadline among
// them: no timer here, so its error is the one timeout reported) shuts the socket down, which ends
// the wait at once. The SDP socket stays open until the RFCOMM connect has been made, so the
// link made for SDP carries the RFCOMM channel too (one page of the device, not two).

import CBlueZ
import Glibc
import Synchronization
import SystemPackage
@_spi(Plugins) import TransportKitCore
@_spi(Plugins) import TransportKitLinux

/// SDP lookups over a Bluetooth Classic link.
enum ServiceDiscovery {
    /// The Serial Port Profile (0x1101), what rfcomm:// looks for when the URL has no `uuid=`.
    static let serialPort = "00001101" + BluetoothUUID.baseTail

    /// The RFCOMM channel `device` publishes for `service` (a normalized 128-bit UUID), and then
    /// `use(channel)`, run while the SDP channel still holds the link up (the RFCOMM connect: no
    /// second page, and the SDP channel is released while the link has another user).
    static func withRFCOMMChannel<Result: Sendable>(adapter: BluetoothAddress, device: BluetoothAddress, service: String, describing: String,
                                                    _ use: (UInt8) async throws -> Result) async throws -> Result {
        let fd = try await BluetoothSocket.connectClassicL2CAP(adapter: adapter, device: device, psm: 1, describing: describing)
        // libbluetooth waits for the answer with select(2), which cannot watch a descriptor at or above FD_SETSIZE.
        guard fd.rawValue < 1024 else {
            fd.closeOwned()
            throw TransportError(.unsupported, "\(describing): this process has more than 1024 descriptors open, and libbluetooth's SDP client "
                                 + "(select(2)) cannot wait on descriptor \(fd.rawValue); give the channel: rfcomm://\(device):CHANNEL")
        }
        let session = Session(fd: fd)
        defer { session.close() }
        let found: Int32
        do {
            found = try await withTaskCancellationHandler {
                // On a thread of its own: the peer decides how long the search waits.
                try await Blocking.runOnThread("tk sdp search") { try session.search(service, describing: describing) }
            } onCancel: {
                session.interrupt()
            }
        } catch {
            if session.interrupted { throw CancellationError() }
            throw error
        }
        guard (1...30).contains(found) else {
            throw TransportError(.notFound, "\(describing): \(device) publishes no RFCOMM service \(BluetoothUUID.short(service)) in SDP: is the server "
                                 + "application running there? `sdptool browse \(device)` lists what it offers; give another service with uuid= or the channel: "
                                 + "rfcomm://\(device):CHANNEL")
        }
        return try await use(UInt8(found))
    }

    /// One SDP session on a connected L2CAP socket. The lock orders a shutdown from another task
    /// before sdp_close(), never after (the descriptor number could be reused by then).
    private final class Session: Sendable {
        private struct State {
            var fd: Int32
            var open = true
            var interrupted = false
        }
        private let state: Locked<State>

        init(fd: SystemPackage.FileDescriptor) {
            state = Locked(State(fd: fd.rawValue))
        }

        /// The search was ended by ``interrupt()`` (the connect was cancelled).
        var interrupted: Bool { state.withLock { $0.interrupted } }

        /// Ends a search in progress: the socket shut down, select(2) in libbluetooth returns.
        func interrupt() {
            state.withLock { state in
                guard state.open else { return }
                state.interrupted = true
                _ = shutdown(state.fd, Int32(SHUT_RDWR))
            }
        }

        /// Blocking: one ServiceSearchAttributeRequest for `service`; the first record's RFCOMM
        /// channel, or 0 when no record has one. The socket stays open until ``close()``.
        func search(_ service: String, describing: String) throws -> Int32 {
            let fd = state.withLock { $0.fd }
            // sdp_create() only wraps the socket; the session is freed here and the socket closed by close().
            guard let session = sdp_create(fd, 0) else {
                throw TransportError.posix("sdp_create", errno: Syscall.errno, what: describing)
            }
            defer {
                session.pointee.sock = -1
                _ = sdp_close(session)
            }
            let uuid = UnsafeMutablePointer<uuid_t>.allocate(capacity: 1)
            defer { uuid.deallocate() }
            let short = BluetoothUUID.short(service)
            if let value = Hex.value(short, width: 4, as: UInt16.self) {
                sdp_uuid16_create(uuid, value)
            } else {
                var bytes = Self.bytes(service)
                sdp_uuid128_create(uuid, &bytes)
            }
            let range = UnsafeMutablePointer<UInt32>.allocate(capacity: 1)
            defer { range.deallocate() }
            range.pointee = 0x0000_ffff
            let search = sdp_list_append(nil, uuid)
            let attributes = sdp_list_append(nil, range)
            defer {
                sdp_list_free(search, nil)
                sdp_list_free(attributes, nil)
            }
            var records: UnsafeMutablePointer<sdp_list_t>?
            if sdp_service_search_attr_req(session, search, SDP_ATTR_REQ_RANGE, attributes, &records) < 0 {
                throw TransportError.posix("sdp_service_search_attr_req", errno: Syscall.errno, what: "\(describing) (SDP search)")
            }
            defer { sdp_list_free(records) { $0.map { sdp_record_free($0.assumingMemoryBound(to: sdp_record_t.self)) } } }
            var node = records
            while let current = node {
                if let record = current.pointee.data?.assumingMemoryBound(to: sdp_record_t.self) {
                    var protocols: UnsafeMutablePointer<sdp_list_t>?
                    if sdp_get_access_protos(record, &protocols) == 0 {
                        let channel = sdp_get_proto_port(protocols, Int32(RFCOMM_UUID))
                        // Each element is itself a list (one protocol descriptor stack).
                        sdp_list_foreach(protocols, { element, _ in sdp_list_free(element?.assumingMemoryBound(to: sdp_list_t.self), nil) }, nil)
                        sdp_list_free(protocols, nil)
                        if channel > 0 { return channel }
                    }
                }
                node = current.pointee.next
            }
            return 0
        }

        /// Closes the socket (once; a later interrupt() no longer touches it).
        func close() {
            state.withLock { state in
                guard state.open else { return }
                state.open = false
                _ = Glibc.close(state.fd)
            }
        }

        /// A 128-bit UUID's 16 bytes in the order written (SDP's network order).
        static func bytes(_ uuid: String) -> [UInt8] {
            let hex = Array(uuid.filter { $0 != "-" })
            return stride(from: 0, to: min(hex.count, 32), by: 2).map { UInt8(String(hex[$0..<$0 + 2]), radix: 16) ?? 0 }
        }
    }
}
