#!/usr/bin/env python3
"""An independent Sparkplug B subscriber for the integration tests.

Decodes with Google's protobuf runtime (pinned in models/requirements.txt),
from message classes built here from the published sparkplug_b.proto
(package org.eclipse.tahu.protobuf, proto2): the descriptor below is that
file's Payload and Payload.Metric, written field by field (name, number,
type); the nested types outpost never sends (MetaData, PropertySet,
DataSet, Template, extensions) are left out, which protobuf skips as
unknown fields.

Usage: sparkplug_sub.py PORT FILTER
Prints `SUBSCRIBED` once the broker acknowledged the subscription, then one
JSON line per message: topic, seq, timestamp, metrics (name, datatype,
timestamp, value).

It also acts as a Sparkplug host application: each line on its standard
input publishes a command at QoS 1 and prints `PUBLISHED` once the broker
acknowledged it:
- `rebirth TOPIC`: a Payload with metric `Node Control/Rebirth`, Boolean,
  true (what a host sends in an NCMD to ask a node for its births);
- `metric TOPIC NAME`: a Payload with one Boolean metric NAME = true;
- `raw TOPIC HEX`: those bytes as they are.
"""

import json
import sys
import threading
import time

try:
    import paho.mqtt.client as mqtt
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as e:  # the test reports this and fails
    print(f"MISSING {e}: pip install -r models/requirements.txt", flush=True)
    sys.exit(3)

F = descriptor_pb2.FieldDescriptorProto


def field(msg, name, number, ftype, label=F.LABEL_OPTIONAL, type_name=None, oneof=None):
    f = msg.field.add(name=name, number=number, type=ftype, label=label)
    if type_name:
        f.type_name = type_name
    if oneof is not None:
        f.oneof_index = oneof


def payload_class():
    fd = descriptor_pb2.FileDescriptorProto(
        name="sparkplug_b.proto", package="org.eclipse.tahu.protobuf", syntax="proto2"
    )
    payload = fd.message_type.add(name="Payload")
    metric = payload.nested_type.add(name="Metric")
    field(metric, "name", 1, F.TYPE_STRING)
    field(metric, "alias", 2, F.TYPE_UINT64)
    field(metric, "timestamp", 3, F.TYPE_UINT64)
    field(metric, "datatype", 4, F.TYPE_UINT32)
    field(metric, "is_historical", 5, F.TYPE_BOOL)
    field(metric, "is_transient", 6, F.TYPE_BOOL)
    field(metric, "is_null", 7, F.TYPE_BOOL)
    metric.oneof_decl.add(name="value")
    for name, number, t in [
        ("int_value", 10, F.TYPE_UINT32),
        ("long_value", 11, F.TYPE_UINT64),
        ("float_value", 12, F.TYPE_FLOAT),
        ("double_value", 13, F.TYPE_DOUBLE),
        ("boolean_value", 14, F.TYPE_BOOL),
        ("string_value", 15, F.TYPE_STRING),
        ("bytes_value", 16, F.TYPE_BYTES),
    ]:
        field(metric, name, number, t, oneof=0)
    field(payload, "timestamp", 1, F.TYPE_UINT64)
    field(
        payload,
        "metrics",
        2,
        F.TYPE_MESSAGE,
        label=F.LABEL_REPEATED,
        type_name=".org.eclipse.tahu.protobuf.Payload.Metric",
    )
    field(payload, "seq", 3, F.TYPE_UINT64)
    field(payload, "uuid", 4, F.TYPE_STRING)
    field(payload, "body", 5, F.TYPE_BYTES)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(
        pool.FindMessageTypeByName("org.eclipse.tahu.protobuf.Payload")
    )


Payload = payload_class()


def on_connect(client, userdata, flags, reason_code, properties=None):
    client.subscribe(userdata, qos=1)


def on_subscribe(client, userdata, mid, reason_codes, properties=None):
    print("SUBSCRIBED", flush=True)


def on_message(client, userdata, msg):
    p = Payload()
    try:
        p.ParseFromString(msg.payload)
    except Exception as e:  # junk a test sent on purpose: say so, go on
        print(json.dumps({"topic": msg.topic, "undecodable": str(e)}), flush=True)
        return
    metrics = []
    for m in p.metrics:
        kind = m.WhichOneof("value")
        v = getattr(m, kind) if kind else None
        if isinstance(v, bytes):
            v = v.hex()
        metrics.append(
            {"name": m.name, "datatype": m.datatype, "timestamp": m.timestamp, "value": v}
        )
    print(
        json.dumps(
            {
                "topic": msg.topic,
                "seq": p.seq if p.HasField("seq") else None,
                "timestamp": p.timestamp,
                "metrics": metrics,
            }
        ),
        flush=True,
    )


BOOLEAN = 11  # DataType.Boolean


def command(name):
    p = Payload()
    p.timestamp = int(time.time() * 1000)
    m = p.metrics.add()
    m.name = name
    m.timestamp = p.timestamp
    m.datatype = BOOLEAN
    m.boolean_value = True
    return p.SerializeToString()


def on_publish(client, userdata, mid, reason_code=None, properties=None):
    print("PUBLISHED", flush=True)


def commands(c):
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "rebirth":
            body = command("Node Control/Rebirth")
        elif parts[0] == "metric":
            body = command(parts[2])
        elif parts[0] == "raw":
            body = bytes.fromhex(parts[2])
        else:
            print(f"UNKNOWN {line.strip()}", flush=True)
            continue
        c.publish(parts[1], body, qos=1)


def main():
    port, filt = int(sys.argv[1]), sys.argv[2]
    c = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id="sparkplug-host",
        userdata=filt,
        protocol=mqtt.MQTTv311,
    )
    c.on_connect = on_connect
    c.on_subscribe = on_subscribe
    c.on_message = on_message
    c.on_publish = on_publish
    c.connect("127.0.0.1", port, keepalive=30)
    threading.Thread(target=commands, args=(c,), daemon=True).start()
    c.loop_forever()


if __name__ == "__main__":
    main()
