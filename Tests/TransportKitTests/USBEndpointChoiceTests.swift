import Testing
@testable import TransportKit
@testable import TransportKitUSB

/// Which interface and endpoints a usb:// connection takes (chooseEndpoints), on configurations
/// written out by hand: no device is needed for the rule itself.
@Suite("usb:// endpoint choice")
struct USBEndpointChoiceTests {
    static func endpoint(_ address: UInt8, _ type: UInt8, _ packet: Int = 64) -> USBEndpoint {
        USBEndpoint(address: address, type: type, maxPacketSize: packet)
    }

    /// Interface 0: a HID-like interrupt pair; interface 1: a bulk pair; interface 2: isochronous only.
    static let composite = [
        USBAlternate(interface: 0, alternate: 0, interfaceClass: 3, endpoints: [endpoint(0x81, 3), endpoint(0x01, 3)]),
        USBAlternate(interface: 1, alternate: 0, interfaceClass: 0xff, endpoints: [endpoint(0x82, 2, 512), endpoint(0x02, 2, 512)]),
        USBAlternate(interface: 2, alternate: 0, interfaceClass: 1, endpoints: [endpoint(0x83, 1, 192)]),
    ]

    static func choose(_ alternates: [USBAlternate], interface: Int? = nil, input: UInt8? = nil, output: UInt8? = nil) throws -> USBEndpointChoice {
        try chooseEndpoints(alternates, interface: interface, alternate: nil, input: input, output: output, describing: "usb://1234:5678")
    }

    @Test func aBulkPairWinsOverAnEarlierInterruptPair() throws {
        let choice = try Self.choose(Self.composite)
        #expect(choice.interface == 1 && choice.input.address == 0x82 && choice.output.address == 0x02)
    }

    @Test func aDeviceWithOnlyAnInterruptPairGetsIt() throws {
        let choice = try Self.choose([Self.composite[0], Self.composite[2]])
        #expect(choice.interface == 0 && choice.input.type == 3 && choice.output.type == 3)
        let named = try Self.choose(Self.composite, interface: 0)
        #expect(named.interface == 0 && named.input.address == 0x81, "interface= alone reaches the interrupt pair beside a bulk interface")
    }

    @Test func halfAPairIsNoPairAndTheErrorListsWhatIsOffered() throws {
        // A CDC-ACM control interface: one interrupt IN, nothing OUT; its data interface is not offered here.
        let control = [USBAlternate(interface: 0, alternate: 0, interfaceClass: 2, endpoints: [Self.endpoint(0x83, 3, 16)])]
        let error = #expect(throws: TransportError.self) { try Self.choose(control) }
        #expect(error?.kind == .notFound)
        #expect(error?.message.contains("a bulk (or interrupt) IN and OUT endpoint pair") == true, "\(String(describing: error))")
        #expect(error?.message.contains("interface 0 alt 0: interrupt in 0x83") == true, "\(String(describing: error))")
    }

    @Test func namedEndpointsAreCheckedForDirectionAndType() throws {
        let backwards = #expect(throws: TransportError.self) { try Self.choose(Self.composite, input: 0x02) }
        #expect(backwards?.kind == .invalidURL && backwards?.message.contains("is an OUT endpoint") == true, "\(String(describing: backwards))")
        let isochronous = #expect(throws: TransportError.self) { try Self.choose(Self.composite, interface: 2, input: 0x83) }
        #expect(isochronous?.kind == .unsupported && isochronous?.message.contains("isochronous") == true, "\(String(describing: isochronous))")
        let chosen = try Self.choose(Self.composite, input: 0x81, output: 0x01)
        #expect(chosen.interface == 0 && chosen.input.type == 3)
    }
}
