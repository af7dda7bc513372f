#!/usr/bin/env python3
"""The reference of the COCO-80 detector (models/coco_det): the converted
ONNX file run by Python onnxruntime with the daemon's pre- and
postprocessing written out in numpy, read from the model's manifest:

- the image decoded to RGB and stretched to 512x512 with Pillow's BILINEAR
  filter (the daemon resizes with fast_image_resize's bilinear convolution,
  Pillow's filter, antialiased when shrinking), fed as 0..255 floats NHWC;
- rows scoring below `score_threshold` dropped, then greedy class-wise NMS
  at `iou_threshold` (highest score first, ties in row order), at most
  `max_detections`;
- boxes mapped back to the image: x / (512 / width), clamped to the image.

Prints JSON {"model": sha256, "images": {NAME: [{"box": [x1, y1, x2, y2],
"score": s, "class": c, "label": l}, ...]}} with NAME the file name, boxes
rounded to 0.01 pixel and scores to 1e-5.

Usage: coco_ref.py [--model DIR] IMAGE...
"""
import argparse
import hashlib
import json
import os
import sys
import tomllib

import numpy as np
import onnxruntime as ort
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "..", "..", "models", "coco_det")


def iou(a, b):
    iw = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0)
    ih = max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    inter = iw * ih
    area = lambda r: max(r[2] - r[0], 0.0) * max(r[3] - r[1], 0.0)
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def nms(dets, thr, max_det):
    kept = []
    for d in sorted(dets, key=lambda d: -d[1]):
        if len(kept) >= max_det:
            break
        if all(k[2] != d[2] or iou(k[0], d[0]) <= thr for k in kept):
            kept.append(d)
    return kept


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, help="the model folder (models/coco_det)")
    ap.add_argument("images", nargs="+")
    args = ap.parse_args()
    with open(os.path.join(args.model, "manifest.toml"), "rb") as f:
        man = tomllib.load(f)
    path = os.path.join(args.model, man["file"])
    if not os.path.exists(path):
        sys.exit(f"coco_ref.py: {path} is missing: run models/fetch")
    pre, post = man["preprocess"], man["postprocess"]
    assert (pre["resize"], pre["layout"], pre["channel_order"], pre["scale"]) == \
        ("stretch", "nhwc", "rgb", 1.0), pre
    with open(os.path.join(args.model, post["labels"])) as f:
        labels = [line.rstrip("\n") for line in f]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    tw, th = pre["width"], pre["height"]
    out = {}
    for p in args.images:
        im = Image.open(p).convert("RGB")
        w, h = im.size
        if (w, h) != (tw, th):
            im = im.resize((tw, th), Image.BILINEAR)
        x = np.asarray(im, np.float32)[None]
        (rows,) = sess.run([post["output"]], {man["inputs"][0]["name"]: x})
        dets = []
        for r in rows.reshape(-1, rows.shape[-1]):
            r = [float(v) for v in r]
            if r[4] >= post["score_threshold"] and all(np.isfinite(r[:5])):
                c = int(round(r[5])) if np.isfinite(r[5]) and r[5] >= 0 else 0
                dets.append((r[:4], r[4], c))
        kept = nms(dets, post["iou_threshold"], post["max_detections"])
        sx, sy = tw / w, th / h
        res = []
        for b, s, c in kept:
            box = [min(max(b[0] / sx, 0.0), w), min(max(b[1] / sy, 0.0), h),
                   min(max(b[2] / sx, 0.0), w), min(max(b[3] / sy, 0.0), h)]
            res.append({"box": [round(v, 2) for v in box], "score": round(s, 5), "class": c,
                        "label": labels[c] if c < len(labels) else str(c)})
        out[os.path.basename(p)] = res
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    print(json.dumps({"model": sha, "images": out}, indent=1))


if __name__ == "__main__":
    main()
