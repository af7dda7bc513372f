#!/usr/bin/env python3
"""Time Python onnxruntime `session.run` on silero VAD, one chunk at a time.

Baseline for outpost's Rust path: 1 intra-op thread, 1 inter-op thread,
sequential execution; inputs as in models/silero_vad/ref ([1, 576] f32 audio,
state [2, 1, 128], sr = 16000), with the state fed back after every run as in
a stream. Each run is timed with time.perf_counter_ns.

Needs the packages of models/requirements.txt and models/fetch to have run.

Usage: perf/silero_python.py [--iterations N] [--warmup N] [--model PATH] [--json]
"""

import argparse
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(REPO, "models", "silero_vad", "silero_vad.onnx")
SEED = 20261130      # same seed as models/build


def make_inputs(np, model):
    """The reference inputs: loaded from <model dir>/ref/in if present, else
    generated exactly as models/build does."""
    ref = os.path.join(os.path.dirname(os.path.abspath(model)), "ref", "in")
    names = ("input", "state", "sr")
    if all(os.path.isfile(os.path.join(ref, n + ".npy")) for n in names):
        return {n: np.load(os.path.join(ref, n + ".npy")) for n in names}
    rng = np.random.default_rng([SEED, 1, 1])
    t = np.arange(576) / 16000.0
    x = 0.3 * np.sin(2 * np.pi * 440.0 * t) + rng.normal(0.0, 0.01, size=576)
    return {
        "input": x.reshape(1, 576).astype(np.float32),
        "state": np.zeros((2, 1, 128), dtype=np.float32),
        "sr": np.array(16000, dtype=np.int64),
    }


def percentile(sorted_values, p):
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(p / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.iterations < 1 or args.warmup < 0:
        ap.error("--iterations must be >= 1 and --warmup >= 0")
    try:
        import numpy as np
        import onnxruntime as ort
    except ImportError as e:
        print(f"silero_python.py: {e}", file=sys.stderr)
        print("run: python3 -m pip install -r models/requirements.txt", file=sys.stderr)
        return 1
    if not os.path.isfile(args.model):
        print(f"silero_python.py: no model at {args.model}; run: models/fetch", file=sys.stderr)
        return 1

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(args.model, sess_options=so,
                                providers=["CPUExecutionProvider"])
    feeds = make_inputs(np, args.model)
    out_names = ["output", "stateN"]

    for _ in range(args.warmup):
        _, feeds["state"] = sess.run(out_names, feeds)
    feeds["state"] = np.zeros((2, 1, 128), dtype=np.float32)

    clock = time.perf_counter_ns
    times = [0] * args.iterations
    run = sess.run
    for i in range(args.iterations):
        t0 = clock()
        outs = run(out_names, feeds)
        times[i] = clock() - t0
        feeds["state"] = outs[1]

    times_us = sorted(t / 1000.0 for t in times)
    total_s = sum(times) / 1e9
    result = {
        "p50_us": round(percentile(times_us, 50), 3),
        "p90_us": round(percentile(times_us, 90), 3),
        "p99_us": round(percentile(times_us, 99), 3),
        "max_us": round(times_us[-1], 3),
        "throughput_per_s": round(args.iterations / total_s, 1) if total_s > 0 else 0.0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"silero_vad, Python onnxruntime {ort.__version__}, 1 thread, "
              f"{args.iterations} runs after {args.warmup} warm-up runs")
        for k, v in result.items():
            print(f"  {k:17} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
