#!/usr/bin/env python3
"""What a user would write instead of an outpost camera pipeline with the
COCO detector, tracking, a zone and a line: OpenCV reads the RTSP camera
(cv2.VideoCapture, its FFmpeg backend, RTSP over TCP), onnxruntime runs
models/coco_det (one intra-op thread) with the pre- and postprocessing of
tests/vision/coco_ref.py (the frame stretched to 512x512 with Pillow's
bilinear filter, RGB, 0..255 floats; rows scoring at least the manifest's
threshold; class-wise NMS, here supervision's Detections.with_nms; boxes
mapped back to the frame), Roboflow's trackers (ByteTrackTracker) follows
the objects, supervision's PolygonZone and LineZone place them, and events
like outpost's (track_start, zone_enter, zone_leave, line_cross, track_end)
are written as JSON lines to --events.

With --fps F it takes F frames a second by the stream's clock: every frame
is grabbed (decoded: H.264 frames need the ones before them), only the
frames taken are retrieved (converted) and run, as
perf/camera_python_service.py does.

Runs until --seconds have passed after the first frame (it prints READY
then), then prints one JSON line:
{"frames": processed, "done_at": [...], "infer_ms": total, "events": {kind: n}}

Usage: coco_python_service.py URL MODEL_DIR --seconds S --fps F
           --zone '[[x, y], ...]' --line '[[x1, y1], [x2, y2]]'
           [--min-hits 3] [--max-age 1.0] [--high-score 0.4] [--resize pil|cv2]
           [--events FILE]
"""

import argparse
import json
import os
import sys
import time
import tomllib

os.environ.setdefault("OPENCV_FFMPEG_CAPTURE_OPTIONS", "rtsp_transport;tcp")

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import supervision as sv  # noqa: E402
from PIL import Image  # noqa: E402
from trackers import ByteTrackTracker  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("model_dir")
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--fps", type=float, required=True)
    ap.add_argument("--zone", required=True, help="JSON [[x, y], ...] in frame pixels")
    ap.add_argument("--line", required=True, help="JSON [[x1, y1], [x2, y2]] in frame pixels")
    ap.add_argument("--min-hits", type=int, default=3)
    ap.add_argument("--max-age", type=float, default=1.0, help="seconds")
    ap.add_argument("--high-score", type=float, default=0.4)
    ap.add_argument("--inertia", type=int, default=3, help="frames in (out) before zone_enter (zone_leave)")
    ap.add_argument("--resize", choices=["pil", "cv2"], default="pil",
                    help="pil: Pillow's bilinear as tests/vision/coco_ref.py; cv2: cv2.resize INTER_LINEAR")
    ap.add_argument("--events", default=os.devnull)
    args = ap.parse_args()

    with open(os.path.join(args.model_dir, "manifest.toml"), "rb") as f:
        man = tomllib.load(f)
    pre, post = man["preprocess"], man["postprocess"]
    with open(os.path.join(args.model_dir, post["labels"])) as f:
        labels = [line.rstrip("\n") for line in f]
    tw, th = pre["width"], pre["height"]

    cv2.setNumThreads(1)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(os.path.join(args.model_dir, man["file"]), so,
                                providers=["CPUExecutionProvider"])
    in_name = man["inputs"][0]["name"]

    tracker = ByteTrackTracker(
        frame_rate=args.fps,
        lost_track_buffer=max(1, round(args.max_age * args.fps)),
        track_activation_threshold=args.high_score,
        high_conf_det_threshold=args.high_score,
        minimum_consecutive_frames=args.min_hits,
    )
    zone = sv.PolygonZone(np.array(json.loads(args.zone), np.int64))
    (x1, y1), (x2, y2) = json.loads(args.line)
    line = sv.LineZone(sv.Point(x1, y1), sv.Point(x2, y2),
                       triggering_anchors=[sv.Position.BOTTOM_CENTER])
    out = open(args.events, "w")
    counts = {}
    tracks = {}  # tracker id -> {"label", "last", "in", "streak", "inside"}

    def emit(kind, tid, label, box, score, ts, **kw):
        counts[kind] = counts.get(kind, 0) + 1
        out.write(json.dumps({"event": kind, "track": int(tid), "label": label,
                              "box": [round(float(v), 1) for v in box],
                              "score": round(float(score), 4), "ts": ts, **kw}) + "\n")
        out.flush()

    cap = cv2.VideoCapture(args.url, cv2.CAP_FFMPEG)
    if not cap.isOpened():
        sys.exit(f"cannot open {args.url}")
    done_at = []
    infer_s = 0.0
    end = due = None
    iv = 1.0 / args.fps
    while True:
        if not cap.grab():
            break
        pts = cap.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
        # As outpost's gate: an eighth of an interval early still counts,
        # the cadence is kept, and a gap resynchronises.
        if due is not None and pts + iv / 8 < due:
            continue
        due = due + iv if due is not None and pts <= due + iv else pts + iv
        ok, frame = cap.retrieve()
        if not ok:
            break
        now = time.time()
        if end is None:
            end = now + args.seconds
            print("READY", flush=True)
        h, w = frame.shape[:2]
        rgb = cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
        if args.resize == "pil":
            x = np.asarray(Image.fromarray(rgb).resize((tw, th), Image.BILINEAR), np.float32)[None]
        else:
            x = cv2.resize(rgb, (tw, th), interpolation=cv2.INTER_LINEAR).astype(np.float32)[None]
        t_run = time.perf_counter()
        (rows,) = sess.run([post["output"]], {in_name: x})
        infer_s += time.perf_counter() - t_run
        rows = rows.reshape(-1, rows.shape[-1])
        rows = rows[np.isfinite(rows[:, :5]).all(axis=1) & (rows[:, 4] >= post["score_threshold"])]
        xyxy = rows[:, :4] * np.array([w / tw, h / th, w / tw, h / th], np.float32)
        xyxy = np.clip(xyxy, 0, [w, h, w, h])
        dets = sv.Detections(xyxy=xyxy.astype(np.float32), confidence=rows[:, 4],
                             class_id=np.round(rows[:, 5]).astype(int))
        dets = dets.with_nms(threshold=post["iou_threshold"], class_agnostic=False)
        dets = tracker.update(dets)
        ts = round(pts, 3)
        inside = zone.trigger(dets)
        crossed_in, crossed_out = line.trigger(dets)
        for i in range(len(dets)):
            tid = int(dets.tracker_id[i])
            if tid < 0:
                continue
            label = labels[int(dets.class_id[i])]
            box, score = dets.xyxy[i], dets.confidence[i]
            t = tracks.get(tid)
            if t is None:
                t = tracks[tid] = {"label": label, "inside": False, "streak": 0,
                                   "box": box, "score": score}
                emit("track_start", tid, label, box, score, ts)
            t.update(last=now, box=box, score=score)
            # inertia: frames on the other side before the change counts.
            if bool(inside[i]) != t["inside"]:
                t["streak"] += 1
                if t["streak"] >= args.inertia:
                    t["inside"], t["streak"] = bool(inside[i]), 0
                    emit("zone_enter" if t["inside"] else "zone_leave", tid, label, box, score, ts,
                         zone="road")
            else:
                t["streak"] = 0
            if crossed_in[i] or crossed_out[i]:
                emit("line_cross", tid, label, box, score, ts, line="lane",
                     direction="in" if crossed_in[i] else "out")
        for tid in [k for k, t in tracks.items() if now - t["last"] > args.max_age]:
            t = tracks.pop(tid)
            if t["inside"]:
                emit("zone_leave", tid, t["label"], t["box"], t["score"], ts, zone="road")
            emit("track_end", tid, t["label"], t["box"], t["score"], ts, reason="lost")
        done_at.append(time.time())
        if done_at[-1] >= end:
            break
    out.close()
    print(json.dumps({"frames": len(done_at), "done_at": done_at, "infer_ms": infer_s * 1000,
                      "events": counts}), flush=True)


if __name__ == "__main__":
    main()
