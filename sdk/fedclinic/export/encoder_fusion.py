"""One fused ``Attention`` node per layer for exported BERT encoders, so onnxruntime runs attention as one kernel
(the ``--int8`` graph unpacks it again into the form onnxruntime's int8 kernels run fastest:
:mod:`fedclinic.export.encoder_int8`).

Why this module exists: torch's dynamo exporter writes BERT's attention as ~15 primitive nodes per layer (with
the default SDPA attention also a ``Where``/``IsNaN`` mask chain per layer), and onnxruntime's transformer
optimizer (``onnxruntime.transformers.optimizer``, model type ``bert``) fuses none of them: its pattern matcher
expects the graph the TorchScript exporter used to write. Three small, exactly equivalent changes make it match:

1. export side (:func:`encoder_export_forward`): the encoder runs with eager attention and gets the additive
   mask ``(1 - mask[:, None, None, :]) * -10000`` as a 4-D ``attention_mask`` (what BERT computed internally
   before transformers 5). For a padding mask this equals transformers' own masking: a masked key gets
   ``exp(-10000 - max) = 0`` weight in float32, exactly like the boolean mask, and every row keeps at least
   one real key.
2. graph side (:func:`fuse_attention`): the exporter folds ``unsqueeze(1).unsqueeze(2)`` into one
   ``Unsqueeze(axes=[1, 2])``; the matcher wants two, so it is split back.
3. graph side: ``softmax(QK^T * s + mask)``'s ``Mul`` by ``s`` becomes ``Div`` by ``1/s`` (the matcher finds the
   first ``Mul`` parent of the ``Add``, which would be the mask's, and stops).

Then ``optimize_model(model_type="bert")`` fuses Attention and Gelu. The caller keeps the fused graph only when
every layer fused (:func:`fuse_attention` returns how many did) and the usual parity check against the untouched
PyTorch model passes: nothing here is trusted without that check.

Two fusions stay off, in the graph and (:data:`fedclinic.serving.bundle.SESSION_DISABLED_OPTIMIZERS`) in the serving session, because
onnxruntime 1.31's CPU kernels for them are slower than the ops they replace (2 threads, this machine):
``SkipLayerNormalization`` 4.0 ms vs ``Add`` + ``LayerNormalization`` 1.2 ms on ``[32, 128, 384]``; ``BiasGelu``
5.9 ms vs ``Add`` + ``Gelu`` 4.2 ms on ``[32, 128, 1536]``. On MiniLM int8 at batch 32 that is 276 ms instead of
322 ms per call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedclinic.serving.bundle import SESSION_DISABLED_OPTIMIZERS  # noqa: F401  (defined by the session that uses it)

#: config.model_type values whose attention block has BERT's layout (the optimizer's ``bert`` patterns)
FUSABLE_MODEL_TYPES = ("bert",)
#: the mask value BERT used before transformers 5, and the default of onnxruntime's Attention op
MASK_FILTER_VALUE = -10000.0


def fusable(module: Any) -> bool:
    """Whether ``module`` (a loaded family's torch module) is a Hugging Face BERT this module can fuse."""
    config = getattr(module, "config", None)
    return (getattr(config, "model_type", None) in FUSABLE_MODEL_TYPES
            and hasattr(module, "set_attn_implementation")
            and int(getattr(config, "num_attention_heads", 0) or 0) > 0)


def encoder_export_forward(module: Any, output: str = "logits") -> Any:
    """A torch module with inputs ``(input_ids, attention_mask)`` that runs ``module`` (a HF ``*For...``
    model) with eager attention and the 4-D additive mask; returns ``module(...).<output>``.

    Use it as a context manager: entering switches the model to eager attention, leaving restores the
    implementation it had (the model is shared with the caller's parity reference and with training)."""
    import torch

    class EncoderExportForward(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = module
            self._previous = module.config._attn_implementation

        def forward(self, input_ids, attention_mask):
            additive = (1.0 - attention_mask.unsqueeze(1).unsqueeze(2).to(torch.float32)) * MASK_FILTER_VALUE
            return getattr(self.model(input_ids=input_ids, attention_mask=additive), output)

        def __enter__(self) -> "EncoderExportForward":
            self.model.set_attn_implementation("eager")
            return self

        def __exit__(self, *_exc) -> None:
            self.model.set_attn_implementation(self._previous)

    return EncoderExportForward().eval()


def fuse_attention(src: Path, dst: Path, *, num_heads: int, hidden_size: int) -> int:
    """Rewrite the graph at ``src`` (exported through :func:`encoder_export_forward`) as described in the module
    docstring, run onnxruntime's BERT fusions, write the result to ``dst`` and return the number of fused
    ``Attention`` nodes (0 when the patterns did not match; ``dst`` is written either way)."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model = onnx.load(str(src))
    model.graph.ClearField("value_info")  # the exporter's example-sized shapes confuse the optimizer's inference
    _split_mask_unsqueeze(model)
    _scale_by_division(model)
    plain = dst.with_name(dst.name + ".rewritten")
    onnx.save(model, str(plain))
    try:
        options = FusionOptions("bert")
        options.enable_skip_layer_norm = options.enable_bias_skip_layer_norm = options.enable_bias_gelu = False
        optimized = optimize_model(str(plain), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                                   opt_level=0, optimization_options=options)
    finally:
        plain.unlink(missing_ok=True)
    optimized.save_model_to_file(str(dst))
    return int(optimized.get_fused_operator_statistics().get("Attention", 0))


def _initializers(graph) -> dict[str, Any]:
    from onnx import numpy_helper

    values = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    return values


def _split_mask_unsqueeze(model) -> None:
    """``Unsqueeze(attention_mask, axes=[a, b])`` -> ``Unsqueeze(Unsqueeze(attention_mask, [a]), [b])``."""
    from onnx import TensorProto, helper

    graph = model.graph
    values = _initializers(graph)
    nodes = []
    for node in graph.node:
        axes = values.get(node.input[1]) if node.op_type == "Unsqueeze" and len(node.input) > 1 else None
        if node.input and node.input[0] == "attention_mask" and axes is not None and axes.size == 2:
            first, second = (int(a) for a in axes.reshape(-1))
            mid = node.output[0] + "_unsqueezed_once"
            graph.initializer.extend([helper.make_tensor(mid + "_axes", TensorProto.INT64, [1], [first]),
                                      helper.make_tensor(node.output[0] + "_axes", TensorProto.INT64, [1], [second])])
            nodes.append(helper.make_node("Unsqueeze", [node.input[0], mid + "_axes"], [mid], name=node.name + "_a"))
            nodes.append(helper.make_node("Unsqueeze", [mid, node.output[0] + "_axes"], list(node.output),
                                          name=node.name + "_b"))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _scale_by_division(model) -> None:
    """In ``Softmax(Add(Mul(MatMul(q, k), s), mask))`` replace ``Mul(., s)`` by ``Div(., 1/s)``."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    values = _initializers(graph)
    producer = {out: node for node in graph.node for out in node.output}
    for softmax in (n for n in graph.node if n.op_type == "Softmax"):
        add = producer.get(softmax.input[0])
        if add is None or add.op_type != "Add":
            continue
        for name in add.input:
            mul = producer.get(name)
            if (mul is None or mul.op_type != "Mul" or mul.input[1] not in values
                    or getattr(producer.get(mul.input[0]), "op_type", None) != "MatMul"):
                continue
            scale = np.asarray(values[mul.input[1]], dtype=np.float32)
            inverse = mul.input[1] + "_inverse"
            if inverse not in values:
                graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), inverse))
                values[inverse] = 1.0 / scale
            mul.op_type = "Div"
            mul.input[1] = inverse
