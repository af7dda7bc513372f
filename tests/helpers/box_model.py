#!/usr/bin/env python3
"""Writes a model folder `boxes` into MODEL_DIR: a detector whose boxes are
its input, so a test decides every box of every frame.

  box_model.py MODEL_DIR N

Input `rows` f32 [1, N, 6] (x1, y1, x2, y2, score, class), output `dets`,
the same tensor (Identity); the manifest reads JSON frames of N rows and
decodes `dets` with the `rows` layout. Rows with a score of 0 are no box.
"""

import hashlib
import os
import sys

import onnx
from onnx import TensorProto, helper


def main():
    out, n = sys.argv[1], int(sys.argv[2])
    folder = os.path.join(out, "boxes")
    os.makedirs(folder, exist_ok=True)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["rows"], ["dets"])],
        "boxes",
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, n, 6])],
        [helper.make_tensor_value_info("dets", TensorProto.FLOAT, [1, n, 6])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = os.path.join(folder, "boxes.onnx")
    onnx.save(model, path)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    manifest = f'''name = "boxes"
version = "1.0.0"
file = "boxes.onnx"
sha256 = "{sha}"
source = "tests/helpers/box_model.py"
license = "Apache-2.0"
description = "Boxes in, the same boxes out: a test decides every detection"

[[inputs]]
name = "rows"
dtype = "f32"
shape = [1, {n}, 6]

[[outputs]]
name = "dets"
dtype = "f32"
shape = [1, {n}, 6]

[preprocess]
type = "sensor"
shape = [{n}, 6]
format = "json"

[postprocess]
type = "detections"
layout = "rows"
output = "dets"
score_threshold = 0.1
iou_threshold = 0.9
max_detections = {n}
'''
    with open(os.path.join(folder, "manifest.toml"), "w") as f:
        f.write(manifest)


if __name__ == "__main__":
    main()
