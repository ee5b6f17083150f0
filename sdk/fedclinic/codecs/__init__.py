"""Update-payload codecs: encode a float32 weight delta into bytes + JSON-able params, and decode it back,
streaming straight into an aggregator's accumulator.

Codec ids (negotiated at ``Hello`` with :func:`available_codecs`) and their per-element error bounds
(``x̂ = decode(encode(x))``):

========  ==========================================================================  ==================
codec     bound                                                                       bytes / element
========  ==========================================================================  ==================
fp32      exact                                                                       4
fp16      ``2^-11 |x| + 2^-25``; refuses ``|x| >= 65520``                             2
bf16      ``2^-8 |x| + 2^-134``                                                       2
int8      ``(rho + 2^-22) S_b + 2^-22 (A_b + |x|) + 2^-149``, ``S_b ~ A_b / 127``     1 + 4 / block
int4      same with ``S_b ~ A_b / 7``                                                 0.5 + 4 / block
topk      ``|x_i|`` (<= k-th largest) for unsent ``i``; the value codec's for sent    (index + value) * k/n
========  ==========================================================================  ==================

``A_b`` is the absmax of the element's block, ``rho`` = 1/2 (rounding=nearest) or 1 (stochastic, which is
unbiased: ``E[x̂] = x``). Spec strings such as ``"topk:0.01+int8:block=128"`` are parsed by
:func:`parse_codec`; :class:`ErrorFeedback` keeps what a lossy codec did not send for the next round and
persists it; :func:`decode_into` adds ``weight * decode(...)`` into an accumulator chunk by chunk.
"""

from fedclinic.codecs.accounting import ByteCount, count_bytes, fp32_bytes, params_json, total_bytes
from fedclinic.codecs.base import DEFAULT_CHUNK, Codec, Encoded, decode, decode_into, open_payload
from fedclinic.codecs.blockquant import Int4, Int8
from fedclinic.codecs.errors import CodecInputError, CodecSpecError, IntegrityError
from fedclinic.codecs.feedback import ErrorFeedback
from fedclinic.codecs.floats import BF16, FP16, FP32
from fedclinic.codecs.spec import CodecInfo, available_codecs, check_supported, codec_info, parse_codec, stage_names
from fedclinic.codecs.topk import TopK

__all__ = [
    "BF16", "DEFAULT_CHUNK", "FP16", "FP32", "ByteCount", "Codec", "CodecInfo", "CodecInputError", "CodecSpecError",
    "Encoded", "ErrorFeedback", "Int4", "Int8", "IntegrityError", "TopK", "available_codecs", "check_supported",
    "codec_info", "count_bytes", "decode", "decode_into", "fp32_bytes", "open_payload", "params_json",
    "parse_codec", "stage_names", "total_bytes",
]
