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
vendored, `_expanded` variants included, and `test_autotp_*` cases of the forms the sweep's
models use that onnx's cases lack (outputs from onnx's reference evaluator, a fixed seed). Every
vendored case must pass the
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
    "Conv": ["basic_conv"],
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


# Forms of ops that the sweep's models use and onnx's node tests do not cover (onnx's Conv cases
# are all 2-D with one channel): the model and onnx's reference evaluator's outputs.
CONV_FORMS = {
    "depthwise_causal_1d": ([2, 8, 6], [8, 1, 3], dict(group=8, pads=[2, 2])),
    "depthwise_multiplier_1d": ([1, 2, 5], [4, 1, 2], dict(group=2)),
    "grouped_strided_dilated_1d": ([2, 4, 9], [6, 2, 3], dict(group=2, pads=[1, 2], strides=[2], dilations=[2])),
    "same_lower_1d": ([1, 3, 7], [2, 3, 4], dict(auto_pad="SAME_LOWER", strides=[2])),
    "dense_2d": ([2, 3, 5, 4], [4, 3, 2, 3], dict(pads=[1, 0, 0, 1], strides=[1, 2], dilations=[2, 1])),
    "depthwise_2d": ([1, 3, 4, 4], [3, 1, 3, 3], dict(group=3, auto_pad="SAME_UPPER")),
}


def block_indices(data_shape, axis, start, length):
    """ScatterND indices writing `length` elements of `axis` from `start`, every other axis
    whole, each update's full coordinates (as the legacy exporter writes `x[..., a:b] = u`)."""
    shape = list(data_shape)
    shape[axis] = length
    grid = np.indices(shape).reshape(len(shape), -1).T
    grid[:, axis] += start
    return grid.reshape(*shape, len(shape)).astype(np.int64)


# ScatterND forms the frontend imports as a slice assignment (a concat): full coordinates of a
# block on the last axis, rows of the first axis, and a block that is not contiguous (a scatter).
SCATTER_FORMS = {
    "block_last_axis": ([2, 3, 6], block_indices([2, 3, 6], 2, 2, 3)),
    "block_rows": ([6, 4], np.array([[2], [3]], dtype=np.int64)),
    "strided_not_a_block": ([2, 6], block_indices([2, 3], 1, 0, 3) * np.array([1, 2])),
}


def autotp_cases():
    """`test_autotp_<op>_<form>` cases: (name, model, [(inputs, outputs)])."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    rng = np.random.default_rng(0)
    for form, (data_shape, indices) in SCATTER_FORMS.items():
        updates_shape = list(indices.shape[:-1]) + list(data_shape[indices.shape[-1]:])
        node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"])
        floats = lambda name, shape: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
        # The indices an initializer: the constant an export has.
        graph = helper.make_graph([node], form, [floats("data", data_shape), floats("updates", updates_shape)],
                                  [floats("y", None)], initializer=[numpy_helper.from_array(indices, "indices")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        inputs = [rng.standard_normal(data_shape).astype(np.float32),
                  rng.standard_normal(updates_shape).astype(np.float32)]
        outputs = ReferenceEvaluator(model).run(None, dict(zip(["data", "updates"], inputs)))
        yield f"test_autotp_scatternd_{form}", model, [(inputs, outputs)]
    for form, (x_shape, w_shape, attributes) in CONV_FORMS.items():
        node = helper.make_node("Conv", ["x", "w", "b"], ["y"], **attributes)
        floats = lambda name, shape: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
        graph = helper.make_graph([node], form, [floats("x", x_shape), floats("w", w_shape), floats("b", w_shape[:1])],
                                  [floats("y", None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        inputs = [rng.standard_normal(s).astype(np.float32) for s in (x_shape, w_shape, w_shape[:1])]
        outputs = ReferenceEvaluator(model).run(None, dict(zip("xwb", inputs)))
        yield f"test_autotp_conv_{form}", model, [(inputs, outputs)]
    for form, x_shape in IF_FORMS.items():
        yield f"test_autotp_if_{form}", *squeeze_if(x_shape, rng)


# The legacy exporter's `squeeze` of a dim it cannot see: If(shape[1] == 1, Squeeze, Identity),
# the condition decided by the input's static shape (both branches).
IF_FORMS = {"squeeze_taken": [3, 1, 4], "squeeze_not_taken": [3, 2, 4]}


def squeeze_if(x_shape, rng):
    """A model squeezing dim 1 of `x` when it is 1, its data set from onnx's reference evaluator."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    ints = lambda name, values: numpy_helper.from_array(np.array(values, dtype=np.int64), name)
    floats = lambda name, shape: helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
    then_branch = helper.make_graph([helper.make_node("Squeeze", ["x", "axes"], ["squeezed"])], "then", [],
                                    [floats("squeezed", None)], initializer=[ints("axes", [1])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["kept"])], "else", [], [floats("kept", None)])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one"], ["dim"], axis=0),
             helper.make_node("Equal", ["dim", "one"], ["is_one"]),
             helper.make_node("If", ["is_one"], ["picked"], then_branch=then_branch, else_branch=else_branch),
             helper.make_node("Neg", ["picked"], ["y"])]
    graph = helper.make_graph(nodes, "squeeze_if", [floats("x", x_shape)], [floats("y", None)],
                              initializer=[ints("one", 1)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    inputs = [rng.standard_normal(x_shape).astype(np.float32)]
    return model, [(inputs, ReferenceEvaluator(model).run(None, {"x": inputs[0]}))]


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
    cases = [(c.name, c.model, c.data_sets or []) for c in collect_testcases() if case_op(c.name, prefixes) in ops]
    for name, model, data_sets in sorted([*cases, *autotp_cases()], key=lambda c: c[0]):
        case_dir = os.path.join(out, name)
        os.makedirs(case_dir)
        with open(os.path.join(case_dir, "model.onnx"), "wb") as f:
            f.write(model.SerializeToString())
        for i, (inputs, outputs) in enumerate(data_sets):
            if not all(is_tensor(v) for v in list(inputs) + list(outputs)):
                # Sequence or optional values: the IR has only tensors; the model is kept so
                # the case is still run (and fails with a message naming the input).
                continue
            ds = os.path.join(case_dir, f"test_data_set_{i}")
            os.makedirs(ds)
            graph_inputs = [v.name for v in model.graph.input]
            graph_outputs = [v.name for v in model.graph.output]
            for k, v in enumerate(inputs):
                write_tensor(os.path.join(ds, f"input_{k}.pb"), v, graph_inputs[k])
            for k, v in enumerate(outputs):
                write_tensor(os.path.join(ds, f"output_{k}.pb"), v, graph_outputs[k])
        written += 1
    print(f"wrote {written} cases for {len(ops)} supported ops (onnx {onnx.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
