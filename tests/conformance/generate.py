#!/usr/bin/env python3
"""Regenerates tests/conformance/cases: the ONNX backend node test cases of every op type the
frontend supports (SUPPORTED_OPS in frontend/src/onnx/ops/mod.rs), written in the layout the old
onnx wheels shipped (model.onnx, test_data_set_N/{input,output}_K.pb).

Recent onnx wheels no longer ship the data, but they ship the generators; this script runs them
(a few seconds, byte-identical across runs). Run from the repository root:

    /tmp/fxvenv/bin/pip install onnx==1.23.2 numpy
    /tmp/fxvenv/bin/python tests/conformance/generate.py

A case belongs to the op its name is about (the longest ONNX op name, in snake case, that
prefixes it; a few ops have irregular case names, see ALIASES). Every case of a supported op is
vendored, `_expanded` variants included. Every vendored case must pass the
conformance test or be listed, with its reason, in tests/conformance/manifest.txt.
"""
import os
import re
import shutil
import sys

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.case.node import collect_testcases

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def supported_ops():
    src = open(os.path.join(ROOT, "frontend/src/onnx/ops/mod.rs")).read()
    block = re.search(r"pub const SUPPORTED_OPS: &\[&str\] = &\[(.*?)\];", src, re.S).group(1)
    return set(re.findall(r'"(\w+)"', block))


# ONNX's case names that are not the snake case of their op.
ALIASES = {
    "SoftmaxCrossEntropyLoss": ["sce"],
    "NegativeLogLikelihoodLoss": ["nllloss"],
    "ConstantOfShape": ["constantofshape"],
    "CastLike": ["castlike"],
    "LessOrEqual": ["less_equal"],
    "GreaterOrEqual": ["greater_equal"],
    "LogSoftmax": ["logsoftmax"],
    "Trilu": ["tril", "triu"],
    "RMSNormalization": ["rms_normalization"],
    "OneHot": ["onehot"],
    "CumSum": ["cumsum"],
    "GatherND": ["gathernd"],
    "ScatterND": ["scatternd", "scatter_nd"],
    "ArgMax": ["argmax"],
    "ArgMin": ["argmin"],
}


def snake(name):
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def case_op(case_name, prefixes):
    """The op a case is about: the longest prefix followed by '_' or the end of the name."""
    rest = case_name[len("test_"):]
    best = None
    for prefix, op in prefixes:
        if (rest == prefix or rest.startswith(prefix + "_")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, op)
    return best[1] if best else None


def is_tensor(value):
    return isinstance(value, (np.ndarray, np.generic, onnx.TensorProto))


def write_tensor(path, value, name):
    if isinstance(value, onnx.TensorProto):
        proto = onnx.TensorProto()
        proto.CopyFrom(value)
        proto.name = name
    else:
        proto = numpy_helper.from_array(np.asarray(value), name)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def main():
    ops = supported_ops()
    prefixes = []
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain in ("", "ai.onnx"):
            prefixes.append((snake(schema.name), schema.name))
            prefixes.extend((alias, schema.name) for alias in ALIASES.get(schema.name, []))
    prefixes = sorted(set(prefixes))
    out = os.path.join(HERE, "cases")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    written = 0
    for case in sorted(collect_testcases(), key=lambda c: c.name):
        if case_op(case.name, prefixes) not in ops:
            continue
        case_dir = os.path.join(out, case.name)
        os.makedirs(case_dir)
        with open(os.path.join(case_dir, "model.onnx"), "wb") as f:
            f.write(case.model.SerializeToString())
        for i, (inputs, outputs) in enumerate(case.data_sets or []):
            if not all(is_tensor(v) for v in list(inputs) + list(outputs)):
                # Sequence or optional values: the IR has only tensors; the model is kept so
                # the case is still run (and fails with a message naming the input).
                continue
            ds = os.path.join(case_dir, f"test_data_set_{i}")
            os.makedirs(ds)
            graph_inputs = [v.name for v in case.model.graph.input]
            graph_outputs = [v.name for v in case.model.graph.output]
            for k, v in enumerate(inputs):
                write_tensor(os.path.join(ds, f"input_{k}.pb"), v, graph_inputs[k])
            for k, v in enumerate(outputs):
                write_tensor(os.path.join(ds, f"output_{k}.pb"), v, graph_outputs[k])
        written += 1
    print(f"wrote {written} cases for {len(ops)} supported ops (onnx {onnx.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
