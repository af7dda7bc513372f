#!/usr/bin/env python3
"""Scores a tracker's output against ground truth with motmetrics (the
py-motmetrics package, CLEAR MOT and identity metrics).

Usage: mot_score.py FILE
FILE is JSON: {"gt": [[frame, id, x, y, w, h], ...],
               "hyp": [[frame, id, x, y, w, h], ...]}
boxes as top-left corner, width and height in pixels. Every frame that
appears in either list is scored; a ground-truth box without a matching
hypothesis in its frame counts as a miss, a hypothesis without a matching
ground-truth box as a false positive.

Prints one JSON line: {"mota", "idf1", "num_switches",
"num_false_positives", "num_misses", "num_frames", "num_objects",
"min_matched_iou"}.
"""
import json
import sys
from collections import defaultdict

import numpy as np

# motmetrics 1.4.0 (the newest release) calls np.asfarray in
# distances.iou_matrix, which NumPy 2.0 removed. Put back the same thing
# (an array of floats, float64 by default) before motmetrics is imported,
# only where it is missing, so the installed package stays as released.
if not hasattr(np, "asfarray"):
    np.asfarray = lambda a, dtype=np.float64: np.asarray(a, dtype=dtype)

import motmetrics as mm  # noqa: E402

# iou_matrix's max_iou is a largest *distance*, 1 - IoU: a pair further
# apart than that cannot match. The tracking test's faces are 60x75 patches
# (tests/vision/render_scene.py), a crop with hair, ears and background
# around the face; MTCNN's box is the face alone, about 44x56 inside the
# patch, so its IoU with its own patch is only 0.50 to 0.59 (measured over
# all 96 tracked boxes of the scene; 0.48 at the lowest when the patches
# moved 7 px a frame) and 0 with the other patch, which it never touches.
# The customary IoU 0.5 would sit on the worst box; IoU 0.25 (distance
# 0.75) leaves a margin of 0.25 and still refuses a box that covers less
# than a quarter of its union with a patch.
MAX_DISTANCE = 0.75

METRICS = ["mota", "idf1", "num_switches", "num_false_positives", "num_misses",
           "num_frames", "num_objects"]


def by_frame(rows):
    out = defaultdict(list)
    for frame, oid, x, y, w, h in rows:
        out[int(frame)].append((int(oid), [float(x), float(y), float(w), float(h)]))
    return out


def main():
    with open(sys.argv[1]) as f:
        data = json.load(f)
    gt, hyp = by_frame(data["gt"]), by_frame(data["hyp"])
    acc = mm.MOTAccumulator(auto_id=False)
    min_iou = None
    for frame in sorted(set(gt) | set(hyp)):
        g, h = gt.get(frame, []), hyp.get(frame, [])
        d = mm.distances.iou_matrix([b for _, b in g], [b for _, b in h],
                                    max_iou=MAX_DISTANCE)
        acc.update([i for i, _ in g], [i for i, _ in h], d, frameid=frame)
    # The IoU of each matched pair, to see how far the threshold is.
    ev = acc.mot_events
    matched = ev[ev["Type"].isin(["MATCH", "SWITCH"])]
    if len(matched):
        min_iou = float(1.0 - matched["D"].max())
    summary = mm.metrics.create().compute(acc, metrics=METRICS, name="scene")
    row = summary.loc["scene"]
    out = {m: (int(row[m]) if m.startswith("num_") else float(row[m])) for m in METRICS}
    out["min_matched_iou"] = min_iou
    print(json.dumps(out))


if __name__ == "__main__":
    main()
