"""CRF Viterbi decoding as ONNX nodes, appended to an exported emission graph (so ``model.onnx`` itself
returns the tag path, for any ONNX Runtime binding).

The nodes compute exactly :meth:`fedclinic.models.crf.CRF.viterbi` on ``emissions [B, L, T]`` (float32) and
``mask [B, L]`` (int64, right-padded, ``mask[:, 0] = 1``)::

    score_0 = start + E[:, 0]
    for t in 1..L-1 (a Scan):  cand = score[:, :, None] + trans        # [B, prev, next]
                               bp_t = argmax_prev cand ; best = max_prev cand
                               score, bp_t = (best + E[:, t], bp_t) where mask[:, t] else (score, identity)
    tag_{L-1} = argmax(score + end)
    for t = L-1..1 (a reverse Scan): tag_{t-1} = bp_t[tag_t]
    tags = [tag_0 .. tag_{L-1}] * mask

ONNX ArgMax picks the first maximal index, as torch's max does on ties. Sequences of length 1 (``L = 1``) are
not supported by the export's dynamic axes (min 2), so the scans always run at least once.
"""

from __future__ import annotations

import numpy as np


def append_viterbi(model, *, emissions: str, mask: str, transitions: np.ndarray, start: np.ndarray,
                   end: np.ndarray, output: str = "tags") -> None:
    """Add Viterbi decoding of graph tensors ``emissions`` and ``mask`` to ``model`` (an ``onnx.ModelProto``,
    opset >= 18) as a new int64 output ``output`` of shape ``[batch, seq]``."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    num_tags = int(transitions.shape[0])
    p = "crf_viterbi_"

    def const(name: str, value: np.ndarray) -> str:
        g.initializer.append(numpy_helper.from_array(np.array(value, order="C"), p + name))
        return p + name

    trans = const("transitions", transitions.astype(np.float32))
    start_c = const("start", start.astype(np.float32))
    end_c = const("end", end.astype(np.float32))
    identity = const("identity", np.arange(num_tags, dtype=np.int64))
    ax1, ax2 = (const(f"axis{i}", np.array([i], np.int64)) for i in (1, 2))
    zero, one = const("zero", np.array(0, np.int64)), const("one", np.array([1], np.int64))
    big = const("big", np.array([np.iinfo(np.int64).max], np.int64))

    def node(op: str, inputs: list[str], out: str, **attrs) -> str:
        g.node.append(helper.make_node(op, inputs, [p + out], name=p + out, **attrs))
        return p + out

    em = node("Cast", [emissions], "em", to=TensorProto.FLOAT)
    on = node("Cast", [mask], "on", to=TensorProto.BOOL)
    em0 = node("Gather", [em, zero], "em0", axis=1)                       # [B, T]
    score0 = node("Add", [em0, start_c], "score0")
    em_rest = node("Transpose", [node("Slice", [em, one, big, ax1], "em_rest_bt")], "em_rest", perm=[1, 0, 2])
    on_rest = node("Transpose", [node("Slice", [on, one, big, ax1], "on_rest_bt")], "on_rest", perm=[1, 0])

    # forward scan body: state score [B, T]; scan inputs em_t [B, T], on_t [B]; scan output bp_t [B, T]
    fwd = [
        helper.make_node("Unsqueeze", ["score_in", ax2], ["score_col"]),
        helper.make_node("Add", ["score_col", trans], ["cand"]),
        helper.make_node("ReduceMax", ["cand", ax1], ["best"], keepdims=0),
        helper.make_node("ArgMax", ["cand"], ["arg"], axis=1, keepdims=0),
        helper.make_node("Add", ["best", "em_t"], ["moved"]),
        helper.make_node("Unsqueeze", ["on_t", ax1], ["on_col"]),
        helper.make_node("Where", ["on_col", "moved", "score_in"], ["score_out"]),
        helper.make_node("Where", ["on_col", "arg", identity], ["bp_t"]),
    ]
    f32, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    fwd_body = helper.make_graph(
        fwd, p + "forward",
        [helper.make_tensor_value_info("score_in", f32, None), helper.make_tensor_value_info("em_t", f32, None),
         helper.make_tensor_value_info("on_t", b, None)],
        [helper.make_tensor_value_info("score_out", f32, None), helper.make_tensor_value_info("bp_t", i64, None)])
    g.node.append(helper.make_node("Scan", [score0, em_rest, on_rest], [p + "score_last", p + "bps"],
                                   name=p + "forward_scan", num_scan_inputs=2, body=fwd_body))
    last = node("ArgMax", [node("Add", [p + "score_last", end_c], "final")], "tag_last", axis=1, keepdims=0)

    # backward scan body: state tag_t [B]; scan input bp_t [B, T] (reversed); outputs tag_{t-1} as new state and
    # tag_t as the scan output (written back in reverse, so position k holds tag_{k+1})
    bwd = [
        helper.make_node("Unsqueeze", ["tag_in", ax1], ["tag_col"]),
        helper.make_node("GatherElements", ["bp", "tag_col"], ["prev_col"], axis=1),
        helper.make_node("Squeeze", ["prev_col", ax1], ["tag_out"]),
        helper.make_node("Identity", ["tag_in"], ["tag_emit"]),
    ]
    bwd_body = helper.make_graph(
        bwd, p + "backward",
        [helper.make_tensor_value_info("tag_in", i64, None), helper.make_tensor_value_info("bp", i64, None)],
        [helper.make_tensor_value_info("tag_out", i64, None), helper.make_tensor_value_info("tag_emit", i64, None)])
    g.node.append(helper.make_node("Scan", [last, p + "bps"], [p + "tag_first", p + "tags_rest"],
                                   name=p + "backward_scan", num_scan_inputs=1, body=bwd_body,
                                   scan_input_directions=[1], scan_output_directions=[1]))
    first = node("Unsqueeze", [p + "tag_first", ax1], "tag_first_col")
    rest = node("Transpose", [p + "tags_rest"], "tags_rest_bt", perm=[1, 0])
    path = node("Concat", [first, rest], "path", axis=1)
    g.node.append(helper.make_node("Mul", [path, node("Cast", [mask], "mask64", to=TensorProto.INT64)], [output],
                                   name=p + "masked"))
    g.output.append(helper.make_tensor_value_info(output, TensorProto.INT64, ["batch", "seq"]))


__all__ = ["append_viterbi"]
