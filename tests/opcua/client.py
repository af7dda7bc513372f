#!/usr/bin/env python3
"""An OPC UA client (asyncua) as a SCADA system would be: the test peer of
outpost's OPC UA server. Prints one JSON line per event on stdout.

  client.py URL [--user U --password-env VAR] [--security none|basic256sha256_sign_encrypt]
            [--certs DIR] read NODE...      -> {"values": {NODE: value}}
                                   subscribe NODE... -> {"subscribed": true},
                                                        then {"node": N, "value": v, "received": unix_s}
                                   login             -> {"ok": true} or {"ok": false, "error": "..."}

NODE is the string NodeId under the namespace urn:outpost:<device>
(--device). With a secure policy the client's certificate and key are
made in --certs (client.der, private/client.pem) on first use: the test trusts
that folder's certificate in the server before starting it (`certs`
command, which only makes them).
"""
import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path

from asyncua import Client, ua
from asyncua.crypto.cert_gen import setup_self_signed_certificate
from asyncua.crypto.security_policies import SecurityPolicyBasic256Sha256
from cryptography.x509.oid import ExtendedKeyUsageOID

APP_URI = "urn:outpost:test:client"


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def certs(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "private").mkdir(exist_ok=True)
    key, cert = folder / "private" / "client.pem", folder / "client.der"
    await setup_self_signed_certificate(
        key, cert, APP_URI, socket.gethostname(),
        [ExtendedKeyUsageOID.CLIENT_AUTH], {"commonName": "outpost test client"})
    return key, cert


async def connect(a) -> Client:
    c = Client(url=a.url, timeout=10)
    c.application_uri = APP_URI
    if a.user:
        c.set_user(a.user)
        c.set_password(os.environ[a.password_env])
    if a.security != "none":
        key, cert = await certs(Path(a.certs))
        await c.set_security(SecurityPolicyBasic256Sha256, str(cert), str(key),
                             mode=ua.MessageSecurityMode.SignAndEncrypt)
    await c.connect()
    return c


def plain(v):
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--device", default="gw-opcua")
    p.add_argument("--user")
    p.add_argument("--password-env", default="OPCUA_PASSWORD")
    p.add_argument("--security", default="basic256sha256_sign_encrypt")
    p.add_argument("--certs", default=".")
    p.add_argument("--interval", type=float, default=0.0, help="publishing interval, ms (0: the server's minimum)")
    p.add_argument("--count", type=int, default=0, help="subscribe: stop after this many changes (0: never)")
    p.add_argument("command", choices=["certs", "read", "subscribe", "login"])
    p.add_argument("nodes", nargs="*")
    a = p.parse_args()

    if a.command == "certs":
        key, cert = await certs(Path(a.certs))
        out({"cert": str(cert), "key": str(key)})
        return
    if a.command == "login":
        try:
            c = await connect(a)
        except Exception as e:  # the refusal is what is tested
            out({"ok": False, "error": f"{type(e).__name__}: {e}"})
            return
        out({"ok": True})
        await c.disconnect()
        return

    c = await connect(a)
    try:
        ns = await c.get_namespace_index(f"urn:outpost:{a.device}")
        nodes = [c.get_node(ua.NodeId(n, ns)) for n in a.nodes]
        if a.command == "read":
            values = {}
            for name, node in zip(a.nodes, nodes):
                dv = await node.read_data_value(raise_on_bad_status=False)
                values[name] = plain(dv.Value.Value) if dv.StatusCode.is_good() else f"status:{dv.StatusCode.name}"
            out({"values": values})
            return
        names = {n.nodeid.to_string(): name for name, n in zip(a.nodes, nodes)}
        done = asyncio.Event()
        seen = [0]

        class Handler:
            def datachange_notification(self, node, val, data):
                out({"node": names.get(node.nodeid.to_string(), node.nodeid.to_string()),
                     "value": plain(val), "received": time.time()})
                seen[0] += 1
                if a.count and seen[0] >= a.count:
                    done.set()

        sub = await c.create_subscription(a.interval, Handler())
        await sub.subscribe_data_change(nodes)
        out({"subscribed": True, "interval": sub.parameters.RequestedPublishingInterval})
        # Until the count, or until the test closes stdin / kills it.
        await done.wait()
    finally:
        await c.disconnect()


if __name__ == "__main__":
    asyncio.run(main())
