#!/usr/bin/env python3
"""A silero VAD service over MQTT, as a user would write it without outpost.

paho-mqtt + onnxruntime (CPU provider, 1 intra-op thread, 1 inter-op thread):
subscribes to `<prefix>/+/audio` (PCM16 mono little-endian, 16 kHz, frames of
512 samples), keeps per stream the model state and the last 64 samples (the
silero v5+ streaming contract: each run gets 64 samples of context followed
by the 512 new ones, 576 in all, with `state` <- `stateN` carried over; the
first frame of a stream gets 64 zeros of context), runs the model once per
frame and publishes a small JSON result `{"seq": N, "p": PROB}` at QoS 0 to
`<prefix>/<stream>/vad`. TCP_NODELAY is set on the broker connection.

A frame whose length is not 1024 bytes is counted and skipped (reported at
exit). Runs until SIGTERM/SIGINT or --max-seconds; prints `ready` on stdout
once subscribed, and a JSON summary line on exit.

Usage: perf/vad_mqtt_service.py --port PORT [--host 127.0.0.1]
           [--model models/silero_vad/silero_vad.onnx] [--prefix bench]
           [--max-seconds 900]
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAME = 512
CONTEXT = 64
RATE = 16000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default=os.path.join(REPO, "models", "silero_vad", "silero_vad.onnx"))
    ap.add_argument("--prefix", default="bench", help="topic prefix (default bench)")
    ap.add_argument("--max-seconds", type=float, default=900.0,
                    help="exit after this long whatever happens (default 900)")
    args = ap.parse_args()

    try:
        import numpy as np
        import onnxruntime as ort
        import paho.mqtt.client as mqtt
    except ImportError as e:
        sys.exit(f"vad_mqtt_service: {e}; run: python3 -m pip install -r models/requirements.txt")
    if not os.path.isfile(args.model):
        sys.exit(f"vad_mqtt_service: missing {args.model}; run: models/fetch")

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(args.model, sess_options=so, providers=["CPUExecutionProvider"])
    sr = np.array(RATE, dtype=np.int64)
    # Warm up once so the first real frame is not slow.
    sess.run(None, {"input": np.zeros((1, FRAME + CONTEXT), np.float32),
                    "state": np.zeros((2, 1, 128), np.float32), "sr": sr})

    streams = {}  # name -> [state, context, seq]
    counts = {"frames": 0, "bad": 0, "published": 0}
    x = np.zeros((1, FRAME + CONTEXT), np.float32)
    suffix = "/audio"

    def on_connect(client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            print(f"vad_mqtt_service: connect refused: {reason_code}", file=sys.stderr)
            return
        client.subscribe(f"{args.prefix}/+/audio", qos=0)

    def on_subscribe(client, userdata, mid, reason_codes, properties):
        print("ready", flush=True)

    def on_message(client, userdata, msg):
        topic = msg.topic
        payload = msg.payload
        if len(payload) != 2 * FRAME or not topic.endswith(suffix):
            counts["bad"] += 1
            return
        name = topic[len(args.prefix) + 1:-len(suffix)]
        st = streams.get(name)
        if st is None:
            st = [np.zeros((2, 1, 128), np.float32), np.zeros(CONTEXT, np.float32), 0]
            streams[name] = st
        x[0, :CONTEXT] = st[1]
        x[0, CONTEXT:] = np.frombuffer(payload, dtype="<i2").astype(np.float32) * (1.0 / 32768.0)
        out, state_n = sess.run(None, {"input": x, "state": st[0], "sr": sr})
        st[0] = state_n
        st[1] = x[0, -CONTEXT:].copy()
        st[2] += 1
        counts["frames"] += 1
        client.publish(f"{args.prefix}/{name}/vad",
                       json.dumps({"seq": st[2], "p": round(float(out[0, 0]), 4)}), qos=0)
        counts["published"] += 1

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                         client_id=f"vad-python-{os.getpid()}", protocol=mqtt.MQTTv311)
    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    # paho's own outgoing queue is unbounded for QoS 0; nothing to raise.
    client.connect(args.host, args.port, keepalive=60)
    sock = client.socket()
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            print(f"vad_mqtt_service: TCP_NODELAY not set: {e}", file=sys.stderr)

    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deadline = time.monotonic() + args.max_seconds
    # Single-threaded network loop (no paho thread): bounded by --max-seconds and signals.
    while not stop["now"] and time.monotonic() < deadline:
        rc = client.loop(timeout=0.1)
        if rc != mqtt.MQTT_ERR_SUCCESS:
            if rc == mqtt.MQTT_ERR_NO_CONN or rc == mqtt.MQTT_ERR_CONN_LOST:
                print(f"vad_mqtt_service: connection lost ({mqtt.error_string(rc)})", file=sys.stderr)
                break
    try:
        client.disconnect()
    except Exception:
        pass
    print(json.dumps({"frames": counts["frames"], "bad_frames": counts["bad"],
                      "published": counts["published"], "streams": len(streams)}), flush=True)


if __name__ == "__main__":
    main()
