#!/usr/bin/env python3
"""A Sparkplug B subscriber that measures what reaches the broker.

Usage: sparkplug_sizes.py PORT FILTER
Prints `SUBSCRIBED` once the broker acknowledged the subscription, then one
JSON line per message: `t` (seconds since the subscription, this process's
monotonic clock), `topic`, `bytes` (the payload's length), `seq`, and for
DBIRTH and DDATA the metric names (decoded with Google's protobuf runtime
from the message classes of sparkplug_sub.py, built from the published
sparkplug_b.proto field numbers).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import paho.mqtt.client as mqtt
    from sparkplug_sub import Payload
except ImportError as e:  # the test reports this and fails
    print(f"MISSING {e}: pip install -r models/requirements.txt", flush=True)
    sys.exit(3)

T0 = [None]


def on_connect(client, userdata, flags, reason_code, properties=None):
    client.subscribe(userdata, qos=1)


def on_subscribe(client, userdata, mid, reason_codes, properties=None):
    T0[0] = time.monotonic()
    print("SUBSCRIBED", flush=True)


def on_message(client, userdata, msg):
    kind = msg.topic.split("/")[2] if msg.topic.count("/") >= 2 else ""
    line = {
        "t": time.monotonic() - (T0[0] or time.monotonic()),
        "topic": msg.topic,
        "bytes": len(msg.payload),
    }
    p = Payload()
    try:
        p.ParseFromString(msg.payload)
        line["seq"] = p.seq if p.HasField("seq") else None
        if kind in ("DBIRTH", "DDATA"):
            line["names"] = [m.name for m in p.metrics]
    except Exception as e:  # say so, go on: the test fails on it
        line["undecodable"] = str(e)
    print(json.dumps(line), flush=True)


def main():
    port, filt = int(sys.argv[1]), sys.argv[2]
    c = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"sparkplug-sizes-{os.getpid()}",
        userdata=filt,
        protocol=mqtt.MQTTv311,
    )
    c.on_connect = on_connect
    c.on_subscribe = on_subscribe
    c.on_message = on_message
    c.connect("127.0.0.1", port, keepalive=30)
    c.loop_forever()


if __name__ == "__main__":
    main()
