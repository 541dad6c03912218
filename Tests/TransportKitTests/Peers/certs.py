#!/usr/bin/python3
"""Throw-away certificates for the TLS tests (python3-trustme), written into the folder given."""
import datetime
import os
import sys

import trustme

out = sys.argv[1]
os.makedirs(out, exist_ok=True)


def write(name, blob):
    blob.write_to_path(os.path.join(out, name))


ca = trustme.CA(organization_unit_name="TransportKit test CA")
write("ca.pem", ca.cert_pem)
leaf = ca.issue_cert("localhost", "127.0.0.1", common_name="localhost")
write("cert.pem", leaf.cert_chain_pems[0])
write("key.pem", leaf.private_key_pem)
wrong = ca.issue_cert("example.com", common_name="example.com")
write("wrong-cert.pem", wrong.cert_chain_pems[0])
write("wrong-key.pem", wrong.private_key_pem)
expired = ca.issue_cert("localhost", common_name="expired", not_after=datetime.datetime(2021, 1, 1))
write("expired-cert.pem", expired.cert_chain_pems[0])
write("expired-key.pem", expired.private_key_pem)
# A CA's own certificate served as a leaf: self-signed, trusted by nothing here.
lone = trustme.CA(organization_unit_name="self-signed")
write("self-cert.pem", lone.cert_pem)
write("self-key.pem", lone.private_key_pem)
# Client certificates and the authority a listener requires them from.
clients = trustme.CA(organization_unit_name="TransportKit client CA")
write("client-ca.pem", clients.cert_pem)
client = clients.issue_cert("client@example.com", common_name="client")
write("client-cert.pem", client.cert_chain_pems[0])
write("client-key.pem", client.private_key_pem)
