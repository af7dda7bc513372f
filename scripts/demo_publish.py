#!/usr/bin/env python3
"""Publish a WAV file as PCM16 chunks over MQTT, as a microphone would.

Usage: scripts/demo_publish.py --port PORT --topic TOPIC --wav FILE [--chunk-ms 20] [--speed 4]
"""
import argparse
import time
import wave

import paho.mqtt.client as mqtt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--wav", required=True)
    ap.add_argument("--chunk-ms", type=int, default=20)
    ap.add_argument("--speed", type=float, default=4.0, help="times real time")
    ap.add_argument("--silence-ms", type=int, default=800, help="quiet room before and after")
    a = ap.parse_args()
    with wave.open(a.wav, "rb") as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1, "PCM16 mono expected"
        rate = w.getframerate()
        pcm = w.readframes(w.getnframes())
    quiet = b"\x00\x00" * (rate * a.silence_ms // 1000)
    pcm = quiet + pcm + quiet
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="demo-mic")
    c.connect(a.host, a.port)
    c.loop_start()
    step = rate * a.chunk_ms // 1000 * 2
    for i in range(0, len(pcm), step):
        c.publish(a.topic, pcm[i:i + step], qos=1).wait_for_publish(5)
        time.sleep(a.chunk_ms / 1000 / a.speed)
    c.loop_stop()
    c.disconnect()


if __name__ == "__main__":
    main()
