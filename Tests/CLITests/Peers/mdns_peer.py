#!/usr/bin/python3
"""python-zeroconf (not avahi) as the other machine of the mDNS tests (MDNSTests).

  mdns_peer.py browse TYPE ADDRESS
      prints one JSON line per change: {"state": "added"|"updated"|"removed", "name", "port", "txt"},
      until standard input closes
  mdns_peer.py register TYPE NAME ADDRESS PORT KEY=VALUE...
      registers NAME on ADDRESS, prints {"registered": name}, keeps it until standard input
      closes, then unregisters it (goodbye packets) and prints {"unregistered": name}
TYPE is like "_telnetcpcd._tcp.local.".
"""
import json
import socket
import sys
import time

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf


def show(**fields):
    print(json.dumps(fields), flush=True)


def browse(stype, address):
    zc = Zeroconf(interfaces=[address], ip_version=IPVersion.V4Only)

    def changed(zeroconf, service_type, name, state_change):
        if state_change is ServiceStateChange.Removed:
            show(state="removed", name=name)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None:
            show(state="unresolved", name=name)
            return
        txt = {k.decode(): (v.decode() if v is not None else None) for k, v in info.properties.items()}
        show(state=state_change.name.lower(), name=name, port=info.port, addresses=info.parsed_addresses(), txt=txt)

    ServiceBrowser(zc, stype, handlers=[changed])
    sys.stdin.read()
    zc.close()


def register(stype, name, address, port, items):
    zc = Zeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
    properties = dict(item.split("=", 1) for item in items)
    info = ServiceInfo(stype, f"{name}.{stype}", addresses=[socket.inet_aton(address)], port=port,
                       properties=properties, server="zc-peer.local.")
    zc.register_service(info, allow_name_change=True)
    show(registered=info.name)
    sys.stdin.read()
    zc.unregister_service(info)
    show(unregistered=info.name)
    zc.close()


if __name__ == "__main__":
    if sys.argv[1] == "browse":
        browse(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "register":
        register(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6:])
    else:
        sys.exit("usage: mdns_peer.py browse|register …")
