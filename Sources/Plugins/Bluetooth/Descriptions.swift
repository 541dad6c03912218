// Descriptions.swift: how the Bluetooth plugin's public values print — adapters, devices and
// scan results as a person reads them (address, name, state), not as Swift's memberwise dump.

extension BluetoothAdapter: CustomStringConvertible {
    /// `hci0 00:1A:7D:DA:71:13 "lab-pi" (powered, discovering)`: the name `adapter=` takes, the
    /// address, the alias where there is one, and its state (`off` when not powered).
    ///
    /// ```swift
    /// print(adapter)   // hci0 00:1A:7D:DA:71:13 "lab-pi" (powered, discovering)
    /// ```
    public var description: String {
        var state = [powered ? "powered" : "off"]
        if discoverable { state.append("discoverable") }
        if discovering { state.append("discovering") }
        let label = alias.map { " \"\($0)\"" } ?? ""
        return "\(name.isEmpty ? path : name) \(address)\(label) (\(state.joined(separator: ", ")))"
    }
}

extension BluetoothDevice: CustomStringConvertible {
    /// `E3:2E:44:66:A2:4A "Nordic_UART" (random address, -60 dBm, connected, paired)`: the
    /// address, the name (or alias), then the address type, the signal strength when recent and
    /// the link's state.
    ///
    /// ```swift
    /// print(device)   // E3:2E:44:66:A2:4A "Nordic_UART" (random address, -60 dBm, connected, paired)
    /// ```
    public var description: String {
        var facts = ["\(addressType) address"]
        if let rssi { facts.append("\(rssi) dBm") }
        if connected { facts.append("connected") }
        if paired { facts.append("paired") }
        if servicesResolved { facts.append("services resolved") }
        let label = (name ?? alias).map { " \"\($0)\"" } ?? ""
        return "\(address)\(label) (\(facts.joined(separator: ", ")))"
    }
}

extension BluetoothDiscovery: CustomStringConvertible {
    /// The URL that connects to it, then what the scan saw, as its ``record`` lists it:
    /// `ble://nus/E3:2E:44:66:A2:4A?adapter=hci0 ("Nordic_UART", random address, -60 dBm)`.
    ///
    /// ```swift
    /// for try await event in BluetoothPlugin().scan(BluetoothScan(services: ["nus"], end: .after(.seconds(5)))) {
    ///     if case .discovered(let device) = event { print(device) }
    /// }
    /// ```
    public var description: String {
        var facts = [name.map { "\"\($0)\"" } ?? "(no name)", "\(addressType) address"]
        if let rssi { facts.append("\(rssi) dBm") }
        return "\(url) (\(facts.joined(separator: ", ")))"
    }
}
