#!/usr/bin/env python3
"""What a user would write instead of an outpost camera pipeline: OpenCV
reads an RTSP camera (cv2.VideoCapture, its FFmpeg backend, RTSP over TCP),
each frame is resized and normalised as the model's manifest says, and
onnxruntime runs the model on it (one intra-op thread).

Runs until --seconds have passed, then prints one JSON line:
{"frames": processed, "ages_ms": [...], "done_at": [...], "infer_ms": total}
where a frame's age is the time
from its capture (the stream's timestamp, pinned to the wall clock by the
least delayed frame read) to its result, so frames that wait in OpenCV's buffers while
the model is busy show up as older results.

With --fps F it takes F frames a second by the stream's clock: every frame
is grabbed (cv2.VideoCapture.grab decodes it: H.264 frames need the ones
before them), and only the frames taken are retrieved (converted) and run.

With --preprocess coco the frame is stretched to --size (512 for
models/coco_det) with cv2.resize (bilinear), made RGB and fed as 0..255
floats NHWC, and the rows scoring at least 0.3 are kept, as the COCO
detector's manifest says (perf/many_cameras uses this).

Usage: camera_python_service.py URL MODEL.onnx --seconds S [--size 224] [--fps F]
                                [--preprocess imagenet|coco]
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OPENCV_FFMPEG_CAPTURE_OPTIONS", "rtsp_transport;tcp")

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--fps", type=float, default=0, help="frames taken a second (0: every frame)")
    ap.add_argument("--preprocess", choices=["imagenet", "coco"], default="imagenet",
                    help="imagenet: NCHW, ImageNet mean/std (the classifier); coco: NHWC 0..255")
    args = ap.parse_args()

    cv2.setNumThreads(1)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    cap = cv2.VideoCapture(args.url, cv2.CAP_FFMPEG)
    if not cap.isOpened():
        sys.exit(f"cannot open {args.url}")
    t0 = None
    ages = []
    done_at = []
    pts_list = []
    infer_s = 0.0
    end = None
    due = None
    while True:
        if args.fps > 0:
            if not cap.grab():
                break
            pts = cap.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
            iv = 1.0 / args.fps
            # As outpost's gate: an eighth of an interval early still counts,
            # the cadence is kept, and a gap resynchronises.
            if due is not None and pts + iv / 8 < due:
                continue
            due = due + iv if due is not None and pts <= due + iv else pts + iv
            ok, frame = cap.retrieve()
        else:
            ok, frame = cap.read()
        if not ok:
            break
        pts = cap.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
        got = time.time()
        if t0 is None:
            end = got + args.seconds
            print("READY", flush=True)
        # The stream's clock against the wall clock: the least delayed frame
        # read defines it (its decode and transfer count as zero).
        t0 = got - pts if t0 is None else min(t0, got - pts)
        pts_list.append(pts)
        x = cv2.resize(frame, (args.size, args.size), interpolation=cv2.INTER_LINEAR)
        if args.preprocess == "coco":
            x = cv2.cvtColor(x, cv2.COLOR_BGR2RGB).astype(np.float32)[None]
        else:
            x = cv2.cvtColor(x, cv2.COLOR_BGR2RGB).astype(np.float32) / 255.0
            x = ((x - mean) / std).transpose(2, 0, 1)[None]
        t_run = time.perf_counter()
        out = sess.run(None, {name: x})[0]
        infer_s += time.perf_counter() - t_run
        if args.preprocess == "coco":
            rows = out[0]
            _ = rows[rows[:, 4] >= 0.3]
        else:
            _ = int(out.argmax())
        now = time.time()
        done_at.append(now)
        if now >= end:
            break
    ages = [(d - (t0 + p)) * 1000.0 for d, p in zip(done_at, pts_list)]
    print(
        json.dumps(
            {"frames": len(done_at), "ages_ms": ages, "done_at": done_at, "infer_ms": infer_s * 1000}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
