#!/usr/bin/env python3
"""What a user writes instead of outpost's camera source: OpenCV reads the
RTSP stream (cv2.VideoCapture, FFmpeg backend, TCP), NumPy preprocesses,
onnxruntime runs the same model, one JSON record per frame.

Frame age here is from `cap.read()` returning the frame to the record (the
earliest moment Python sees a frame). Prints one JSON line:
{"frames": N, "age_p50_ms": .., "age_p99_ms": .., "infer_p50_ms": ..}.

Usage: perf/camera_python.py URL MODEL.onnx --seconds S [--fps F]
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

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--fps", type=float, default=0, help="subsample to this rate (0: every frame)")
    args = ap.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(args.model, so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    cap = cv2.VideoCapture(args.url, cv2.CAP_FFMPEG)
    if not cap.isOpened():
        sys.exit(f"cannot open {args.url}")
    ages, infers = [], []
    interval = 1.0 / args.fps if args.fps else 0.0
    next_due = 0.0
    end = time.time() + args.seconds
    out = open(os.devnull, "w")
    while time.time() < end:
        ok, frame = cap.read()
        t_read = time.time()
        if not ok:
            break
        if interval:
            if t_read < next_due:
                continue
            next_due = max(next_due + interval, t_read)
        rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
        small = cv2.resize(rgb, (224, 224), interpolation=cv2.INTER_LINEAR)
        x = ((small.astype(np.float32) / 255.0 - MEAN) / STD).transpose(2, 0, 1)[None]
        t0 = time.time()
        logits = sess.run(None, {name: np.ascontiguousarray(x)})[0][0]
        infers.append(time.time() - t0)
        e = np.exp(logits - logits.max())
        p = e / e.sum()
        top = np.argsort(-p)[:5]
        rec = {
            "ts": time.time(),
            "outputs": {"top": [{"index": int(i), "score": float(p[i])} for i in top]},
        }
        out.write(json.dumps(rec) + "\n")
        ages.append(time.time() - t_read)
    cap.release()
    ages.sort()
    infers.sort()
    q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))] * 1e3 if v else None  # noqa: E731
    print(
        json.dumps(
            {
                "frames": len(ages),
                "age_p50_ms": q(ages, 0.5),
                "age_p99_ms": q(ages, 0.99),
                "infer_p50_ms": q(infers, 0.5),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
