#!/usr/bin/env python3
"""Writes ONNX files a model importer or a daemon must survive.

  hostile_model.py vad FILE D0 D1 D2 [FOLDER]
      A streaming VAD in silero's form whose state declares [D0, D1, D2]
      (f32): inputs `input` [batch, samples], `state`, `sr` (i64 scalar);
      outputs `output` [batch, 1], `stateN` (the state). With FOLDER, also a
      model folder there (FILE inside it and the manifest an importer that
      never checked the sizes would have written).
  hostile_model.py classifier FILE CLASSES NAMES
      An image classifier of CLASSES classes ([1, 3, 32, 32] in) whose
      metadata `names` is NAMES, written as it is (a Python dict literal).
  hostile_model.py aux FROM FILE
      The detector FROM (rows [1, N, 6] from an NHWC image) with two more
      outputs before its own, as a CenterNet converted with tf2onnx has
      them: `wh` [1, 128, 128, 4] and `heatmap` [1, 128, 128, 80].
  hostile_model.py chain FILE NODES
      An image classifier whose graph is a chain of NODES element-wise
      operators: a large graph of a small file.
"""

import hashlib
import os
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def save(model, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    onnx.save(model, path)


def vad(path, d0, d1, d2, folder=None):
    state = [d0, d1, d2]
    nodes = [
        helper.make_node("ReduceMean", ["input"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("Cast", ["sr"], ["srf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["srf", "zero"], ["nothing"]),
        helper.make_node("Add", ["mean", "nothing"], ["output"]),
        helper.make_node("Identity", ["state"], ["stateN"]),
    ]
    graph = helper.make_graph(
        nodes,
        "vad",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "samples"]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, state),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
        ],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, state),
        ],
        [numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    if folder is None:
        save(model, path)
        return
    name = os.path.basename(os.path.normpath(folder))
    file = os.path.join(folder, os.path.basename(path))
    save(model, file)
    with open(file, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    manifest = f'''name = "{name}"
version = "1.0.0"
file = "{os.path.basename(path)}"
sha256 = "{sha}"
source = "tests/helpers/hostile_model.py"
license = "Apache-2.0"

[[inputs]]
name = "input"
dtype = "f32"
shape = ["batch", 576]

[[inputs]]
name = "state"
dtype = "f32"
shape = [{d0}, {d1}, {d2}]

[[inputs]]
name = "sr"
dtype = "i64"
shape = []
fill = 16000.0

[[outputs]]
name = "output"
dtype = "f32"
shape = ["batch", 1]

[[outputs]]
name = "stateN"
dtype = "f32"
shape = [{d0}, {d1}, {d2}]

[[state]]
input = "state"
output = "stateN"

[preprocess]
type = "audio"
sample_rate = 16000
window = 576
hop = 512

[postprocess]
type = "threshold"
output = "output"
on = 0.5
off = 0.35
'''
    with open(os.path.join(folder, "manifest.toml"), "w") as f:
        f.write(manifest)


def classifier(path, classes, names):
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((3, classes)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("MatMul", ["flat", "w"], ["scores"]),
        ],
        "classifier",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, classes])],
        [numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    helper.set_model_props(model, {"names": names})
    save(model, path)


def aux(src, path):
    model = onnx.load(src)
    g = model.graph
    image = g.input[0].name
    g.node.extend([
        helper.make_node("ReduceMean", [image], ["aux_mean"], keepdims=1),
        helper.make_node("Expand", ["aux_mean", "aux_wh_shape"], ["wh"]),
        helper.make_node("Expand", ["aux_mean", "aux_heatmap_shape"], ["heatmap"]),
    ])
    g.initializer.extend([
        numpy_helper.from_array(np.array([1, 128, 128, 4], dtype=np.int64), "aux_wh_shape"),
        numpy_helper.from_array(np.array([1, 128, 128, 80], dtype=np.int64), "aux_heatmap_shape"),
    ])
    own = list(g.output)
    del g.output[:]
    g.output.extend([
        helper.make_tensor_value_info("wh", TensorProto.FLOAT, [1, 128, 128, 4]),
        helper.make_tensor_value_info("heatmap", TensorProto.FLOAT, [1, 128, 128, 80]),
    ] + own)
    save(model, path)


def chain(path, n):
    ops = ["Neg", "Relu"]
    nodes = [helper.make_node("GlobalAveragePool", ["images"], ["t0"])]
    for i in range(n):
        nodes.append(helper.make_node(ops[i % 2], [f"t{i}"], [f"t{i + 1}"]))
    nodes.append(helper.make_node("Flatten", [f"t{n}"], ["scores"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    save(model, path)


def main():
    kind, args = sys.argv[1], sys.argv[2:]
    if kind == "vad":
        vad(args[0], *map(int, args[1:4]), *(args[4:5]))
    elif kind == "classifier":
        classifier(args[0], int(args[1]), args[2])
    elif kind == "aux":
        aux(args[0], args[1])
    elif kind == "chain":
        chain(args[0], int(args[1]))
    else:
        sys.exit(f"unknown kind {kind}")


if __name__ == "__main__":
    main()
