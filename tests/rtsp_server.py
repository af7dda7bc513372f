#!/usr/bin/python3
"""An RTSP server on 127.0.0.1 for the camera tests and benchmarks.

Runs on Debian's python3 with python3-gi and gir1.2-gst-rtsp-server-1.0.
Serves, encoded live with x264enc (x265enc with --codec h265):
  /cam    the given photographs, each held for --hold seconds, in a loop,
          as H.264 (or H.265) at --width x --height and --fps
  /audio  an audio-only stream (a stream with no video track)
With --user/--password every path needs those credentials (basic auth).
With --key-int N a keyframe starts every N frames exactly (no others at
scene changes; default: one a second); with --mark-keyframes the keyframes
show the first photograph and every other frame is black, so a reader can
tell from a frame's picture whether it was a keyframe.
With --keyframes-for S the encoder's keyframes are sent for the first S
seconds of the stream only; after that only delta frames go out (a camera
whose keyframes stopped).
A still photograph encodes to delta frames with nearly nothing in them,
which decode almost for free; a real camera's frames each differ from the
one before (sensor noise, motion). With --noise every frame gets fresh noise
in the two low bits of each byte (cycling through a few noisy copies made
at start); with --pan N the picture scrolls N rows a frame, wrapping round.
A hostile or broken camera (H.264 only): with --corrupt-keyframes MODE
every keyframe from --corrupt-after seconds into the stream on is sent
broken: `truncate` cuts its IDR slices to an eighth, `random` replaces them
with random bytes after the first bytes of the slice header, `mixed`
alternates the two. With --flood RATE the stream is all keyframes of fresh
noise (each frame its own, encoded at --fps like any other stream at this
size; x264 declares a higher level for a higher --bitrate: give every
stream the same --level) sent RATE a second. Both send frames encoded once at start, with
the encoder settings of the live stream (the same parameter sets), so a
reader decodes them as it decodes the other cameras.
Binds port 0 unless --port is given and prints `PORT <n>` once listening,
then `CLIENTS <n>` each time an RTSP client connects or leaves.
"""

import argparse
import os
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


# Noisy copies of each photograph: consecutive frames never repeat one.
NOISY_COPIES = 7


def load_frame(path, width, height):
    """Decodes a photograph to one I420 frame of width x height."""
    desc = (
        f'filesrc location="{path}" ! decodebin ! videoconvert ! videoscale '
        f"! video/x-raw,format=I420,width={width},height={height},pixel-aspect-ratio=1/1 "
        "! appsink name=out sync=false"
    )
    p = Gst.parse_launch(desc)
    sink = p.get_by_name("out")
    p.set_state(Gst.State.PLAYING)
    sample = sink.emit("try-pull-sample", 10 * Gst.SECOND)
    if sample is None:
        sys.exit(f"cannot decode {path}")
    buf = sample.get_buffer()
    ok, info = buf.map(Gst.MapFlags.READ)
    data = bytes(info.data)
    buf.unmap(info)
    p.set_state(Gst.State.NULL)
    return data


def x264(a, key_int):
    """The encoder of every H.264 stream served, and its output caps."""
    # With --key-int the keyframes are where the reader expects them:
    # none extra at scene changes (the photographs change abruptly).
    opts = (["scenecut=0"] if a.key_int else []) + ([f"level={a.level}"] if a.level else [])
    opts = f' option-string="{":".join(opts)}"' if opts else ""
    return (
        f"x264enc name=enc tune=zerolatency speed-preset=ultrafast key-int-max={key_int} bitrate={a.bitrate}{opts} "
        "! video/x-h264,profile=constrained-baseline"
    )


def encode(a, frames, key_int):
    """The access units (bytes, keyframe) of `frames` encoded as the live
    stream would be, once."""
    desc = (
        "appsrc name=src format=time "
        f"caps=video/x-raw,format=I420,width={a.width},height={a.height},framerate={a.fps}/1 "
        f"! {x264(a, key_int)},stream-format=byte-stream,alignment=au ! appsink name=out sync=false"
    )
    p = Gst.parse_launch(desc)
    src, sink = p.get_by_name("src"), p.get_by_name("out")
    p.set_state(Gst.State.PLAYING)
    dur = Gst.SECOND // a.fps
    for n, f in enumerate(frames):
        buf = Gst.Buffer.new_wrapped(f)
        buf.pts = n * dur
        buf.duration = dur
        src.emit("push-buffer", buf)
    src.emit("end-of-stream")
    units = []
    while True:
        sample = sink.emit("try-pull-sample", 120 * Gst.SECOND)
        if sample is None:
            break
        buf = sample.get_buffer()
        ok, info = buf.map(Gst.MapFlags.READ)
        units.append((bytes(info.data), not buf.has_flags(Gst.BufferFlags.DELTA_UNIT)))
        buf.unmap(info)
    p.set_state(Gst.State.NULL)
    if len(units) != len(frames):
        sys.exit(f"encoded {len(units)} of {len(frames)} frames")
    return units


def idr_at(unit):
    """Where the first IDR slice's header byte is in an access unit."""
    i = unit.find(b"\x00\x00\x01\x65")
    if i < 0:
        sys.exit("a keyframe without an IDR slice")
    return i + 3


def broken(unit, mode):
    """A keyframe broken as `mode` says."""
    at = idr_at(unit)
    if mode == "truncate":
        return unit[:at + (len(unit) - at) // 8]
    return unit[:at + 4] + os.urandom(len(unit) - at - 4)


class EncodedFactory(GstRtspServer.RTSPMediaFactory):
    """Access units encoded once, sent in a loop at `rate` a second,
    keyframes broken from --corrupt-after seconds on if asked."""

    def __init__(self, units, rate, args):
        super().__init__()
        self.units = units
        self.rate = rate
        self.args = args
        self.set_shared(True)

    def do_create_element(self, url):
        a = self.args
        bin_ = Gst.parse_launch(
            "( appsrc name=src is-live=true format=time do-timestamp=false "
            "caps=video/x-h264,stream-format=byte-stream,alignment=au "
            "! rtph264pay name=pay0 pt=96 config-interval=1 )"
        )
        state = {"n": 0, "keys": 0}
        dur = Gst.SECOND // self.rate
        after = int((a.corrupt_after or 0) * self.rate)
        modes = ["truncate", "random"] if a.corrupt_keyframes == "mixed" else [a.corrupt_keyframes]

        def need_data(appsrc, _length):
            n = state["n"]
            unit, key = self.units[n % len(self.units)]
            if key and a.corrupt_keyframes and n >= after:
                unit = broken(unit, modes[state["keys"] % len(modes)])
                state["keys"] += 1
            buf = Gst.Buffer.new_wrapped(unit)
            buf.pts = n * dur
            buf.duration = dur
            if not key:
                buf.set_flags(Gst.BufferFlags.DELTA_UNIT)
            state["n"] = n + 1
            appsrc.emit("push-buffer", buf)

        bin_.get_by_name("src").connect("need-data", need_data)
        return bin_


class PhotoFactory(GstRtspServer.RTSPMediaFactory):
    """Each client gets the photographs as a live H.264 stream."""

    def __init__(self, frames, args):
        super().__init__()
        self.frames = frames
        self.args = args
        # Noisy copies of each frame (big-integer XOR: fast without NumPy).
        self.noisy = {}
        if args.noise:
            for f in frames:
                n = len(f)
                low = int.from_bytes(b"\x03" * n, "little")
                base = int.from_bytes(f, "little")
                self.noisy[f] = [
                    (base ^ (int.from_bytes(os.urandom(n), "little") & low)).to_bytes(n, "little")
                    for _ in range(NOISY_COPIES)
                ]
        self.set_shared(True)

    def do_create_element(self, url):
        a = self.args
        key_int = a.key_int or a.fps
        if a.codec == "h265":
            # x265's own scene-cut option; key-int-max is its keyframe distance.
            exact = ' option-string="scenecut=0"' if a.key_int else ""
            enc = (
                f"x265enc name=enc tune=zerolatency speed-preset=ultrafast key-int-max={key_int} bitrate={a.bitrate}{exact} "
                "! rtph265pay name=pay0 pt=96 config-interval=1"
            )
        else:
            enc = f"{x264(a, key_int)} ! rtph264pay name=pay0 pt=96 config-interval=1"
        desc = (
            "appsrc name=src is-live=true format=time do-timestamp=false "
            f"caps=video/x-raw,format=I420,width={a.width},height={a.height},framerate={a.fps}/1 ! {enc}"
        )
        bin_ = Gst.parse_launch(f"( {desc} )")
        src = bin_.get_by_name("src")
        if a.key_int:
            # A client that loses packets (a loaded machine) asks for a
            # keyframe (RTCP PLI/FIR, a force-key-unit event upstream to the
            # encoder): dropped, so keyframes stay exactly every --key-int
            # frames, as the tests that mark them rely on.
            def no_forced_keyframes(_pad, info):
                ev = info.get_event()
                st = ev.get_structure() if ev else None
                if st is not None and st.get_name() == "GstForceKeyUnit":
                    return Gst.PadProbeReturn.DROP
                return Gst.PadProbeReturn.OK

            bin_.get_by_name("enc").get_static_pad("src").add_probe(
                Gst.PadProbeType.EVENT_UPSTREAM, no_forced_keyframes)
        if a.keyframes_for is not None:
            span = int(a.keyframes_for * Gst.SECOND)
            # The encoder offsets its timestamps (room for negative DTS):
            # time counts from the first frame out of it.
            first = {}

            def no_more_keyframes(_pad, info):
                buf = info.get_buffer()
                if buf is None or buf.pts == Gst.CLOCK_TIME_NONE:
                    return Gst.PadProbeReturn.OK
                t0 = first.setdefault("pts", buf.pts)
                if buf.pts - t0 >= span and not buf.has_flags(Gst.BufferFlags.DELTA_UNIT):
                    return Gst.PadProbeReturn.DROP
                return Gst.PadProbeReturn.OK

            bin_.get_by_name("enc").get_static_pad("src").add_probe(
                Gst.PadProbeType.BUFFER, no_more_keyframes)
        state = {"n": 0}
        # I420 black: luma 16, chroma 128.
        luma = a.width * a.height
        chroma = ((a.width + 1) // 2) * ((a.height + 1) // 2)
        black = bytes([16]) * luma + bytes([128]) * (2 * chroma)
        dur = Gst.SECOND // a.fps
        hold = max(1, int(a.hold * a.fps))
        cw = (a.width + 1) // 2

        def scrolled(frame, rows):
            """The I420 frame scrolled up by `rows` (even) rows, wrapping round."""
            rows -= rows % 2
            y, u, v = frame[:luma], frame[luma:luma + chroma], frame[luma + chroma:]
            k, kc = rows * a.width, (rows // 2) * cw
            return y[k:] + y[:k] + u[kc:] + u[:kc] + v[kc:] + v[:kc]

        def need_data(appsrc, _length):
            n = state["n"]
            if a.mark_keyframes:
                frame = self.frames[0] if n % key_int == 0 else black
            else:
                frame = self.frames[(n // hold) % len(self.frames)]
            copies = self.noisy.get(frame)
            if copies:
                frame = copies[n % len(copies)]
            if a.pan:
                frame = scrolled(frame, (n * a.pan) % a.height)
            buf = Gst.Buffer.new_wrapped(frame)
            buf.pts = n * dur
            buf.duration = dur
            state["n"] = n + 1
            appsrc.emit("push-buffer", buf)

        src.connect("need-data", need_data)
        return bin_


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("images", nargs="+")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--hold", type=float, default=1.0, help="seconds per photograph")
    ap.add_argument("--bitrate", type=int, default=2048, help="kbit/s")
    ap.add_argument("--user")
    ap.add_argument("--password")
    ap.add_argument("--key-int", type=int, default=0, help="frames from keyframe to keyframe")
    ap.add_argument("--pan", type=int, default=0, help="rows the picture scrolls a frame")
    ap.add_argument("--noise", action="store_true", help="fresh noise in every frame")
    ap.add_argument("--codec", choices=["h264", "h265"], default="h264", help="the video's encoding")
    ap.add_argument(
        "--mark-keyframes",
        action="store_true",
        help="keyframes show the first photograph, other frames are black",
    )
    ap.add_argument("--keyframes-for", type=float, default=None,
                    help="seconds of the stream with keyframes; delta frames only after")
    ap.add_argument("--corrupt-keyframes", choices=["truncate", "random", "mixed"],
                    help="send keyframes broken (after --corrupt-after seconds)")
    ap.add_argument("--corrupt-after", type=float, default=0.0,
                    help="seconds of good keyframes before they are broken")
    ap.add_argument("--flood", type=int, default=0,
                    help="keyframes of noise a second, nothing else")
    ap.add_argument("--level", help="the H.264 level the stream declares (x264 picks one by default)")
    args = ap.parse_args()

    Gst.init(None)
    frames = [load_frame(p, args.width, args.height) for p in args.images]
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    mounts = server.get_mount_points()
    if args.flood:
        size = len(frames[0])
        noise = [os.urandom(size) for _ in range(NOISY_COPIES)]
        cam = EncodedFactory(encode(args, noise, 1), args.flood, args)
    elif args.corrupt_keyframes:
        key_int = args.key_int or args.fps
        # Two seconds of the photographs, from a keyframe: looped.
        n = 2 * key_int * max(1, -(-args.fps // key_int))
        hold = max(1, int(args.hold * args.fps))
        raw = [frames[(i // hold) % len(frames)] for i in range(n)]
        cam = EncodedFactory(encode(args, raw, key_int), args.fps, args)
    else:
        cam = PhotoFactory(frames, args)
    audio = GstRtspServer.RTSPMediaFactory()
    audio.set_launch(
        "( audiotestsrc is-live=true wave=sine ! audio/x-raw,rate=16000,channels=1 "
        "! audioconvert ! rtpL16pay name=pay0 )"
    )
    audio.set_shared(True)
    if args.user is not None:
        auth = GstRtspServer.RTSPAuth()
        token = GstRtspServer.RTSPToken()
        token.set_string("media.factory.role", "viewer")
        auth.add_basic(GstRtspServer.RTSPAuth.make_basic(args.user, args.password or ""), token)
        server.set_auth(auth)
        for f in (cam, audio):
            f.add_role_from_structure(
                Gst.Structure.from_string(
                    "viewer, media.factory.access=(boolean)true, media.factory.construct=(boolean)true"
                )[0]
            )
    mounts.add_factory("/cam", cam)
    mounts.add_factory("/audio", audio)
    clients = {"n": 0}

    def closed(_client):
        clients["n"] -= 1
        print(f"CLIENTS {clients['n']}", flush=True)

    def connected(_server, client):
        clients["n"] += 1
        client.connect("closed", closed)
        print(f"CLIENTS {clients['n']}", flush=True)

    server.connect("client-connected", connected)
    if server.attach(None) == 0:
        sys.exit("cannot listen")
    print(f"PORT {server.get_bound_port()}", flush=True)
    GLib.MainLoop().run()


if __name__ == "__main__":
    main()
