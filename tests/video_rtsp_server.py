#!/usr/bin/python3
"""An RTSP server on 127.0.0.1 that serves a recorded H.264 video as a live
camera, looped without end and without re-encoding: the video's access
units are read once from the file (qtdemux ! h264parse, parameter sets put
before every keyframe) and sent again and again on /cam, each pass's
timestamps following on from the last, at the video's own frame rate.

Runs on Debian's python3 with python3-gi and gir1.2-gst-rtsp-server-1.0;
used by scripts/demo, tests/it/street.rs and perf/compare_coco.
The file must start with a keyframe (an .mp4 from a camera or an encoder
does), so every pass decodes on its own.

With --rate R the video plays at R times its speed (0.25: each frame
shown four times as long; the frames themselves unchanged), for readers
slower than the video: a debug build running a detector.

With --scale WxH it first writes the video scaled to that size into
--scaled FILE (decoded and encoded once with x264enc, one keyframe a second)
unless that file is already there, and serves that file instead.

Binds port 0 unless --port is given and prints `PORT <n>` once listening,
then `CLIENTS <n>` each time an RTSP client connects or leaves.

Usage: video_rtsp_server.py VIDEO.mp4 [--port N] [--rate R] [--scale 1920x1080 --scaled OUT.mp4]
"""

import argparse
import os
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402


def run_to_eos(desc, what):
    """Runs a pipeline until its end of stream, or exits with its error."""
    p = Gst.parse_launch(desc)
    p.set_state(Gst.State.PLAYING)
    msg = p.get_bus().timed_pop_filtered(
        Gst.CLOCK_TIME_NONE, Gst.MessageType.EOS | Gst.MessageType.ERROR)
    p.set_state(Gst.State.NULL)
    if msg.type == Gst.MessageType.ERROR:
        err, dbg = msg.parse_error()
        sys.exit(f"{what}: {err.message} ({dbg})")


def scale(src, dst, width, height):
    """Writes `src` scaled to width x height as H.264 in an .mp4 (once)."""
    tmp = dst + ".tmp"
    run_to_eos(
        f'filesrc location="{src}" ! qtdemux ! h264parse ! avdec_h264 ! videoconvert '
        f"! videoscale method=bilinear ! video/x-raw,width={width},height={height},pixel-aspect-ratio=1/1 "
        "! x264enc speed-preset=veryfast key-int-max=25 bitrate=6000 "
        f'! video/x-h264,profile=high ! h264parse ! mp4mux ! filesink location="{tmp}"',
        f"scaling {src}",
    )
    os.replace(tmp, dst)


def read_access_units(path):
    """The video's H.264 access units (byte-stream, parameter sets before
    each keyframe), their caps, and the length of one pass in nanoseconds."""
    p = Gst.parse_launch(
        f'filesrc location="{path}" ! qtdemux ! h264parse config-interval=-1 '
        "! video/x-h264,stream-format=byte-stream,alignment=au "
        "! appsink name=out sync=false emit-signals=false max-buffers=0"
    )
    sink = p.get_by_name("out")
    p.set_state(Gst.State.PLAYING)
    units, caps = [], None
    while True:
        sample = sink.emit("try-pull-sample", 30 * Gst.SECOND)
        if sample is None:
            break
        caps = caps or sample.get_caps()
        buf = sample.get_buffer()
        ok, info = buf.map(Gst.MapFlags.READ)
        if not ok:
            sys.exit(f"cannot read {path}")
        units.append((bytes(info.data), buf.pts, buf.dts, buf.duration,
                      buf.has_flags(Gst.BufferFlags.DELTA_UNIT)))
        buf.unmap(info)
    p.set_state(Gst.State.NULL)
    if not units or caps is None:
        sys.exit(f"no H.264 video in {path}")
    if units[0][4]:
        sys.exit(f"{path} does not start with a keyframe")
    s = caps.get_structure(0)
    ok, num, den = s.get_fraction("framerate")
    frame = Gst.SECOND * den // num if ok and num > 0 else Gst.SECOND // 25
    first = min(u[1] for u in units)
    last = max(u[1] for u in units)
    return units, caps, last - first + frame, first, frame


class VideoFactory(GstRtspServer.RTSPMediaFactory):
    """Every client of the shared media gets the same looped video."""

    def __init__(self, units, caps, period, first, frame, rate):
        super().__init__()
        self.units, self.caps, self.period, self.first, self.frame = units, caps, period, first, frame
        self.rate = rate
        self.set_shared(True)

    def do_create_element(self, url):
        s = self.caps.get_structure(0)
        ok, num, den = s.get_fraction("framerate")
        # At another rate the timestamps say how fast frames come.
        fr = f",framerate={num}/{den}" if ok and num > 0 and self.rate == 1 else ""
        caps = (f"video/x-h264,stream-format=byte-stream,alignment=au,"
                f"width={s.get_value('width')},height={s.get_value('height')}{fr}")
        bin_ = Gst.parse_launch(
            f"( appsrc name=src is-live=true format=time do-timestamp=false caps={caps} "
            "! h264parse ! rtph264pay name=pay0 pt=96 config-interval=1 )"
        )
        src = bin_.get_by_name("src")
        state = {"n": 0}
        # Decode timestamps may start below the first presentation time
        # (B-frames): every pass is shifted so none is negative.
        dts = [u[2] for u in self.units if u[2] != Gst.CLOCK_TIME_NONE]
        lead = max(0, self.first - min(dts)) if dts else 0

        def need_data(appsrc, _length):
            n = state["n"]
            data, pts, dts, dur, delta = self.units[n % len(self.units)]
            shift = (n // len(self.units)) * self.period - self.first + lead
            buf = Gst.Buffer.new_wrapped(data)
            k = 1 / self.rate
            buf.pts = int((pts + shift) * k)
            if dts != Gst.CLOCK_TIME_NONE:
                buf.dts = int((dts + shift) * k)
            buf.duration = int((dur if dur != Gst.CLOCK_TIME_NONE else self.frame) * k)
            if delta:
                buf.set_flags(Gst.BufferFlags.DELTA_UNIT)
            state["n"] = n + 1
            appsrc.emit("push-buffer", buf)

        src.connect("need-data", need_data)
        return bin_


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("video")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rate", type=float, default=1.0, help="playback speed (0.25: a quarter)")
    ap.add_argument("--scale", help="WxH: serve the video scaled to this size (encoded once)")
    ap.add_argument("--scaled", help="where the scaled video is written (kept for later runs)")
    args = ap.parse_args()

    Gst.init(None)
    path = args.video
    if args.scale:
        if not args.scaled:
            sys.exit("--scale needs --scaled FILE")
        w, h = (int(v) for v in args.scale.lower().split("x"))
        if not os.path.exists(args.scaled):
            scale(path, args.scaled, w, h)
        path = args.scaled
    units, caps, period, first, frame = read_access_units(path)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    server.get_mount_points().add_factory("/cam", VideoFactory(units, caps, period, first, frame, args.rate))
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
