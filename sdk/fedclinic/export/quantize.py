"""Dynamic int8 quantization of an exported graph (onnxruntime), with the BERT rewrite for its int8 kernels."""

from __future__ import annotations

from pathlib import Path

from fedclinic.export import encoder_int8 as onnx_encoder_int8


def quantize_int8(src: Path, dst: Path) -> list[str]:
    """Dynamic int8 quantization of the graph at ``src`` into ``dst``: int8 weights, per output channel, on the
    MatMuls (activations are quantized on the fly by onnxruntime).

    A BERT graph is first rewritten for onnxruntime's faster int8 kernels (:mod:`fedclinic.export.encoder_int8`):
    its fused attention ops are unpacked into three projections and the ONNX ``Attention`` op, and a sequence
    classifier's last layer is computed at the first token only. When the installed onnxruntime cannot load the
    rewritten graph, the fused ops are quantized whole instead (``QAttention``). Returns the rewrites made."""
    import onnx  # lazy: onnx is the [export] extra

    # the exporter's recorded intermediate shapes can contradict onnx's own inference (a fixed example
    # size); the quantizer re-infers them, so hand it the graph without them
    graph = onnx.load(str(src))
    graph.graph.ClearField("value_info")
    if any(n.op_type == "Attention" and n.domain == "com.microsoft" for n in graph.graph.node):
        unpacked = onnx.ModelProto()
        unpacked.CopyFrom(graph)
        if onnx_encoder_int8.unpack_attention(unpacked):
            rewrites = [f"attention unpacked into int8 Q/K/V projections and the ONNX Attention op (opset "
                        f"{onnx_encoder_int8.UNPACKED_ATTENTION_OPSET})"]
            if onnx_encoder_int8.keep_first_token(unpacked):
                rewrites.append("last layer computed at the first token only")
            _quantize_dynamic(unpacked, dst, ["MatMul"])
            if _loads_in_onnxruntime(dst):
                return rewrites
    # a fused Attention becomes QAttention (int8 Q/K/V projection, attention in the same op)
    _quantize_dynamic(graph, dst, ["MatMul", "Attention"])
    return []


def _quantize_dynamic(graph, dst: Path, op_types: list[str]) -> None:
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    plain = dst.with_name(dst.name + ".plain")
    onnx.save(graph, str(plain))
    try:
        # per-channel weight scales on the MatMuls: on MiniLM, per-tensor scales moved logits by up to 2.3
        # and flipped 4.5 % of test predictions; per-channel MatMul-only flipped none (max |diff| 0.45).
        # A fused graph holds contrib ops that onnx's shape inference cannot type, hence the default tensor type.
        # reduce_range: 7-bit weights. onnxruntime's u8 x s8 kernels on an x86 CPU without VNNI (AVX2 only, e.g.
        # AMD EPYC before Zen 4) add pairs of products in int16, which 8-bit weights can saturate: there the tiny
        # test models' int8 logits moved by up to 2.2 (a causal LM) and flipped image-text decisions; 7 bits
        # cannot saturate, and a bundle is served on whatever CPU the hospital has, not the one it was made on
        quantize_dynamic(str(plain), str(dst), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                         op_types_to_quantize=op_types,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        plain.unlink(missing_ok=True)


def _loads_in_onnxruntime(path: Path) -> bool:
    """Whether the installed onnxruntime has a CPU kernel for every op of the graph at ``path``."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception:  # onnxruntime raises its own Fail/NotImplemented types for a missing kernel or opset
        return False
    return True
