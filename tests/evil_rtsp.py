#!/usr/bin/env python3
"""A hostile RTSP camera on 127.0.0.1 for the hardening tests: it answers
like a camera until the point its mode names, then sends what a broken
firmware or a device taken over might.

Modes:
  describe-huge   DESCRIBE answered with Content-Length: 100000000000
  describe-max    DESCRIBE answered with Content-Length: 18446744073709551615
  play-huge       a normal session; after PLAY, a message declaring 100 GB
  endless-frame   a normal session; after PLAY, an H.264 FU-A fragment
                  that starts a frame and is never ended, as fast as the
                  client reads

Binds port 0 and prints `PORT <n>`, then `CLIENTS <n>` for every
connection accepted (every reconnect of the client).
"""

import argparse
import socket
import struct
import sys
import threading

SDP = (
    "v=0\r\n"
    "o=- 1 1 IN IP4 127.0.0.1\r\n"
    "s=camera\r\n"
    "c=IN IP4 127.0.0.1\r\n"
    "t=0 0\r\n"
    "m=video 0 RTP/AVP 96\r\n"
    "a=rtpmap:96 H264/90000\r\n"
    "a=fmtp:96 packetization-mode=1;profile-level-id=42c01e;"
    "sprop-parameter-sets=Z0LAHtkDxWhAAAADAEAAAAwDxYuS,aMuMsg==\r\n"
    "a=control:trackID=0\r\n"
)


def read_request(conn, buf):
    """The next request's head (bytes), or None when the client left."""
    while b"\r\n\r\n" not in buf[0]:
        data = conn.recv(65536)
        if not data:
            return None
        buf[0] += data
    head, _, rest = buf[0].partition(b"\r\n\r\n")
    buf[0] = rest
    return head.decode("latin-1")


def cseq(head):
    for line in head.split("\r\n"):
        if line.lower().startswith("cseq:"):
            return line.split(":", 1)[1].strip()
    return "0"


def answer(conn, seq, headers="", body=b"", length=None):
    n = len(body) if length is None else length
    conn.sendall(
        f"RTSP/1.0 200 OK\r\nCSeq: {seq}\r\n{headers}Content-Length: {n}\r\n\r\n".encode()
        + body
    )


def rtp(seq, ts, payload, marker=False):
    head = struct.pack("!BBHII", 0x80, (0x80 if marker else 0) | 96, seq & 0xFFFF, ts, 0x1234)
    pkt = head + payload
    return b"$" + bytes([0]) + struct.pack("!H", len(pkt)) + pkt


def after_play(conn, mode):
    if mode == "play-huge":
        conn.sendall(b"GET_PARAMETER rtsp://127.0.0.1/cam RTSP/1.0\r\nCSeq: 1\r\n"
                     b"Content-Length: 100000000000\r\n\r\n")
        chunk = b"x" * 65536
        while True:
            conn.sendall(chunk)
    if mode == "endless-frame":
        # FU-A (type 28) of an IDR slice (type 5): a start, then middles.
        start = bytes([0x7C, 0x85]) + b"\xaa" * 1400
        middle = bytes([0x7C, 0x05]) + b"\xbb" * 1400
        seq = 0
        conn.sendall(rtp(seq, 9000, start))
        while True:
            conn.sendall(b"".join(rtp(seq + 1 + i, 9000, middle) for i in range(64)))
            seq += 64


def serve(conn, mode):
    buf = [b""]
    try:
        while True:
            head = read_request(conn, buf)
            if head is None:
                return
            method = head.split(" ", 1)[0]
            seq = cseq(head)
            if method == "OPTIONS":
                answer(conn, seq, "Public: OPTIONS, DESCRIBE, SETUP, PLAY, TEARDOWN\r\n")
            elif method == "DESCRIBE":
                if mode == "describe-huge":
                    answer(conn, seq, "Content-Type: application/sdp\r\n", b"v=0\r\n",
                           length=100000000000)
                    # The body never comes; the connection stays open.
                    conn.recv(1)
                    return
                if mode == "describe-max":
                    answer(conn, seq, "Content-Type: application/sdp\r\n", b"v=0\r\n",
                           length=18446744073709551615)
                    conn.recv(1)
                    return
                answer(conn, seq, "Content-Type: application/sdp\r\n"
                       "Content-Base: rtsp://127.0.0.1/cam/\r\n", SDP.encode())
            elif method == "SETUP":
                answer(conn, seq, "Session: 12345678;timeout=60\r\n"
                       "Transport: RTP/AVP/TCP;unicast;interleaved=0-1;ssrc=00001234\r\n")
            elif method == "PLAY":
                answer(conn, seq, "Session: 12345678\r\n"
                       "RTP-Info: url=rtsp://127.0.0.1/cam/trackID=0;seq=0;rtptime=9000\r\n")
                after_play(conn, mode)
            else:
                answer(conn, seq)
    except OSError:
        return
    finally:
        conn.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["describe-huge", "describe-max", "play-huge", "endless-frame"])
    args = ap.parse_args()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    print(f"PORT {s.getsockname()[1]}", flush=True)
    n = 0
    while True:
        conn, _ = s.accept()
        n += 1
        print(f"CLIENTS {n}", flush=True)
        threading.Thread(target=serve, args=(conn, args.mode), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
