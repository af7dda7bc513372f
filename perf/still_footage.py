#!/usr/bin/python3
"""Footage that is still most of the time, made from real frames: the demo's
street shot (models/videos/bikes.mp4, seconds 5.6-7.4: cars driving away
past a fence) held still, then played, held again on its last frame, then
played backwards, so the loop has no cut: the movers pass and come back,
and between their passes nothing moves for --hold seconds.

With --night the frames are made night-like first: dark (gamma 2.2 and a
third of the brightness), the colours faded, with the sensor noise of a dim
picture mixed in (videotestsrc's snow at 5 %, fresh in every frame).

Writes an H.264 .mp4 (x264enc, a keyframe every second) at the footage's
25 fps and size. Runs on Debian's python3 with python3-gi (GStreamer 1.22:
qtdemux, avdec_h264, x264enc, mp4mux); no other package.

Usage: perf/still_footage.py OUT.mp4 [--hold 8] [--night] [--start 5.6] [--end 7.4]
"""

import argparse
import os
import sys

import gi

gi.require_version("Gst", "1.0")
from gi.repository import Gst  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIDEO = os.path.join(REPO, "models/videos/bikes.mp4")
FPS = 25


def decode(path, start, end):
    """The I420 frames of [start, end) seconds, with their width and height."""
    p = Gst.parse_launch(
        f'filesrc location="{path}" ! qtdemux ! h264parse ! avdec_h264 ! videoconvert '
        "! video/x-raw,format=I420 ! appsink name=out sync=false max-buffers=0"
    )
    sink = p.get_by_name("out")
    p.set_state(Gst.State.PLAYING)
    frames, size = [], None
    while True:
        sample = sink.emit("try-pull-sample", 30 * Gst.SECOND)
        if sample is None:
            break
        if size is None:
            s = sample.get_caps().get_structure(0)
            size = (s.get_value("width"), s.get_value("height"))
        buf = sample.get_buffer()
        t = buf.pts / Gst.SECOND
        if start <= t < end:
            ok, info = buf.map(Gst.MapFlags.READ)
            if not ok:
                sys.exit(f"cannot read {path}")
            frames.append(bytes(info.data))
            buf.unmap(info)
        if t >= end:
            break
    p.set_state(Gst.State.NULL)
    if not frames:
        sys.exit(f"no frames of {path} in [{start}, {end})")
    return frames, size


# Night: the luma darkened (gamma 2.2, a third as bright, a floor of 8), the
# chroma faded towards grey; the encoder then mixes in a few levels of noise.
NIGHT_LUMA = bytes(min(255, int(8 + 255 / 3 * (v / 255) ** 2.2)) for v in range(256))
NIGHT_CHROMA = bytes(128 + (v - 128) // 3 for v in range(256))


def night(frame, w, h):
    luma = w * h
    return frame[:luma].translate(NIGHT_LUMA) + frame[luma:].translate(NIGHT_CHROMA)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hold", type=float, default=8.0, help="seconds still at each end")
    ap.add_argument("--night", action="store_true")
    ap.add_argument("--start", type=float, default=5.6)
    ap.add_argument("--end", type=float, default=7.4)
    args = ap.parse_args()
    Gst.init(None)
    clip, (w, h) = decode(VIDEO, args.start, args.end)
    hold = int(args.hold * FPS)
    seq = [clip[0]] * hold + clip + [clip[-1]] * hold + clip[::-1]
    caps = f"video/x-raw,format=I420,width={w},height={h},framerate={FPS}/1"
    head = f"appsrc name=src format=time caps={caps} "
    if args.night:
        seq = [night(f, w, h) for f in seq]
        # The sensor noise of a dim picture: snow mixed in, fresh every frame.
        head = (f"videotestsrc pattern=snow num-buffers={len(seq)} ! {caps} ! mix.sink_1 "
                f"{head} ! mix.sink_0 "
                "compositor name=mix sink_1::alpha=0.05 ! videoconvert ! video/x-raw,format=I420 ")
    tmp = args.out + ".tmp"
    p = Gst.parse_launch(
        f"{head}"
        "! x264enc speed-preset=veryfast key-int-max=25 bitrate=2000 "
        f'! video/x-h264,profile=high ! h264parse ! mp4mux ! filesink location="{tmp}"'
    )
    src = p.get_by_name("src")
    p.set_state(Gst.State.PLAYING)
    for i, f in enumerate(seq):
        buf = Gst.Buffer.new_wrapped(f)
        buf.pts = i * Gst.SECOND // FPS
        buf.duration = Gst.SECOND // FPS
        if src.emit("push-buffer", buf) != Gst.FlowReturn.OK:
            sys.exit("the encoder refused a frame")
    src.emit("end-of-stream")
    msg = p.get_bus().timed_pop_filtered(
        Gst.CLOCK_TIME_NONE, Gst.MessageType.EOS | Gst.MessageType.ERROR)
    p.set_state(Gst.State.NULL)
    if msg.type == Gst.MessageType.ERROR:
        err, dbg = msg.parse_error()
        sys.exit(f"encoding: {err.message} ({dbg})")
    os.replace(tmp, args.out)
    moving = 2 * len(clip)
    print(f"{args.out}: {len(seq)} frames ({len(seq) / FPS:.1f} s a loop), "
          f"{moving} with movers ({100 * moving / len(seq):.0f} %), {w}x{h}", file=sys.stderr)


if __name__ == "__main__":
    main()
