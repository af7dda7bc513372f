#!/usr/bin/env python3
"""The demo's camera part, as it happens: follows the records the daemon
prints (--print-records, one JSON a line, in RECORDS), prints each tracking
event of PIPELINE about people, bicycles and vehicles as it comes, and writes
an annotated snapshot: the daemon's latest frame with its tracked boxes
(GET /v1/pipelines/PIPELINE/snapshot.jpg, taken when an object enters the
zone or crosses the line), with the pipeline's zones (yellow) and lines
(red, an arrow to their `in` side) from /v1/status drawn over it.

Stops once every kind of event was seen (track_start, zone_enter,
zone_leave, line_cross, track_end) or after --seconds.

Usage: demo_events.py RECORDS --api HOST:PORT --pipeline street --snapshot OUT.jpg [--seconds 90]
"""

import argparse
import io
import json
import time
import urllib.request

from PIL import Image, ImageDraw

LABELS = {"person", "bicycle", "car", "motorcycle", "bus", "truck"}
KINDS = ["track_start", "zone_enter", "zone_leave", "line_cross", "track_end"]


def get(api, path):
    with urllib.request.urlopen(f"http://{api}{path}", timeout=10) as r:
        return r.read()


def describe(e):
    """One event as a line of text."""
    box = ",".join(str(round(v)) for v in e["box"])
    what = {
        "zone_enter": lambda: f"zone {e['zone']}",
        "zone_leave": lambda: f"zone {e['zone']} after {e['dwell_s']:.1f} s",
        "line_cross": lambda: f"line {e['line']} {e['direction']}",
        "track_end": lambda: f"{e['reason']}, {e['frames']} frames, zones {e['zones']}, lines "
                             + str([f"{c['line']} {c['direction']}" for c in e["lines"]]),
        # zone_occupancy (zone analytics: objects per zone and label) prints
        # here once the daemon sends it.
        "zone_occupancy": lambda: f"zone {e.get('zone')} {e.get('count')}",
    }.get(e["event"], lambda: "")()
    track = e["track"].rsplit("/", 1)[-1]
    return f"{e['ts'][11:22]}  {e['event']:<12} {track:<6} {e['label']:<8} {e['score']:.2f}  box {box:<17} {what}"


def annotate(api, pipeline, out):
    """The daemon's snapshot with the pipeline's zones and lines drawn."""
    img = Image.open(io.BytesIO(get(api, f"/v1/pipelines/{pipeline}/snapshot.jpg"))).convert("RGB")
    st = json.loads(get(api, "/v1/status"))
    p = next(p for p in st["pipelines"] if p["name"] == pipeline)
    geo = (p.get("tracking") or {}).get("geometry") or {}
    g = ImageDraw.Draw(img)
    for z in geo.get("zones", []):
        pts = [tuple(v) for v in z["polygon"]]
        g.line(pts + [pts[0]], fill=(255, 220, 0), width=2)
        g.text((pts[0][0] + 4, pts[0][1] + 2), z["name"], fill=(255, 220, 0))
    for ln in geo.get("lines", []):
        (x1, y1), (x2, y2) = ln["points"]
        g.line([(x1, y1), (x2, y2)], fill=(255, 40, 40), width=3)
        # The `in` side: to the right of the line seen from its first point.
        mx, my = (x1 + x2) / 2, (y1 + y2) / 2
        dx, dy = x2 - x1, y2 - y1
        n = max((dx * dx + dy * dy) ** 0.5, 1e-6)
        nx, ny = -dy / n, dx / n
        tip = (mx + 18 * nx, my + 18 * ny)
        g.line([(mx, my), tip], fill=(255, 40, 40), width=2)
        g.text((tip[0] + 3, tip[1] - 6), f"{ln['name']} in", fill=(255, 40, 40))
    img.save(out, quality=90)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("records")
    ap.add_argument("--api", required=True)
    ap.add_argument("--pipeline", default="street")
    ap.add_argument("--snapshot", required=True)
    ap.add_argument("--seconds", type=float, default=90)
    args = ap.parse_args()

    seen, other = {}, 0
    snap = False
    end = time.time() + args.seconds
    with open(args.records) as f:
        buf = ""
        while time.time() < end and not all(k in seen for k in KINDS):
            chunk = f.readline()
            if not chunk:
                time.sleep(0.05)
                continue
            buf += chunk
            if not buf.endswith("\n"):
                continue
            line, buf = buf, ""
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("pipeline") != args.pipeline:
                continue
            events = (r.get("outputs") or {}).get("events") or []
            for e in events:
                if e.get("label") not in LABELS:
                    other += 1
                    continue
                seen[e["event"]] = seen.get(e["event"], 0) + 1
                print(describe(e), flush=True)
                if not snap and e["event"] in ("line_cross", "zone_enter"):
                    try:
                        annotate(args.api, args.pipeline, args.snapshot)
                        snap = e["event"] == "line_cross"
                    except OSError as err:
                        print(f"(snapshot: {err})")
    missing = [k for k in KINDS if k not in seen]
    print(f"-- {sum(seen.values())} events ({', '.join(f'{k} {n}' for k, n in seen.items())}); "
          f"{other} about other labels (traffic lights, ...) not shown"
          + (f"; none yet of {', '.join(missing)}" if missing else ""))


if __name__ == "__main__":
    main()
