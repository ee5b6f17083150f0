"""Codec spec strings, the codec registry used at ``Hello``, and parsing into codec objects.

Grammar (whitespace around tokens is ignored)::

    spec   := stage ("+" stage)*
    stage  := NAME [":" arg ("," arg)*]
    arg    := VALUE | KEY "=" VALUE          a bare VALUE is the stage's first positional parameter

A pipeline is one value codec, or ``topk`` followed by at most one value codec for the kept values
(``topk`` alone keeps them as fp32). Examples::

    fp16
    bf16
    int8                                       block=128, scale=fp32, rounding=stochastic
    int4:block=64,rounding=nearest
    topk:0.01                                  fraction 1 %, varint indices, fp32 values
    topk:k=5000,idx=raw+fp16
    topk:0.01+int8:block=128                   top-1 % then int8 (the >= 100x setting)

Parameters: ``int8``/``int4``: ``block`` (positional; 1..2^20, default 128), ``scale`` (fp32|fp16),
``rounding`` (stochastic|nearest). ``topk``: ``fraction`` (positional; (0, 1]) or ``k`` (>= 1), ``idx``
(varint|delta|raw). ``fp32``, ``fp16``, ``bf16``: none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedclinic.codecs.base import Codec, registered
from fedclinic.codecs.blockquant import MAX_BLOCK, Int4, Int8
from fedclinic.codecs.errors import CodecSpecError
from fedclinic.codecs.floats import BF16, FP16, FP32
from fedclinic.codecs.topk import INDEX_ENCODINGS, TopK

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ORDER = ("fp32", "fp16", "bf16", "int8", "int4", "topk")
_POSITIONAL = {"int8": "block", "int4": "block", "topk": "fraction"}
_KEYS: dict[str, tuple[str, ...]] = {"fp32": (), "fp16": (), "bf16": (), "int8": ("block", "scale", "rounding"),
                                     "int4": ("block", "scale", "rounding"), "topk": ("fraction", "k", "idx")}


@dataclass(frozen=True)
class CodecInfo:
    """What a codec id means: ``kind`` (value | sparsifier), its parameters and its error bound."""

    name: str
    kind: str
    parameters: tuple[str, ...]
    bound: str


def available_codecs() -> tuple[str, ...]:
    """Codec ids this version encodes and decodes, for capability negotiation at ``Hello``."""
    names = registered()
    return tuple(n for n in _ORDER if n in names) + tuple(n for n in names if n not in _ORDER)


def codec_info(name: str) -> CodecInfo:
    """Kind, parameters and error bound of a codec id (:class:`CodecSpecError` if unknown)."""
    cls = registered().get(name)
    if cls is None:
        raise CodecSpecError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    return CodecInfo(name, cls.kind, _KEYS.get(name, ()), cls.bound)


def stage_names(codec: Codec) -> tuple[str, ...]:
    """The codec ids a pipeline uses (e.g. ``("topk", "int8")``): what both ends must support."""
    if isinstance(codec, TopK):
        return ("topk", codec.values.name)
    return (codec.name,)


def check_supported(spec: str | Codec, supported: Iterable[str]) -> Codec:
    """Parse ``spec`` and check that every stage is in ``supported`` (the peer's ``available_codecs()``
    from ``Hello``); :class:`CodecSpecError` names the missing ones."""
    codec = parse_codec(spec) if isinstance(spec, str) else spec
    peer = set(supported)
    missing = [s for s in stage_names(codec) if s not in peer]
    if missing:
        raise CodecSpecError(f"codec {codec.spec!r} needs {missing}, which the peer does not support (it offers "
                             f"{sorted(peer)}); choose a codec both sides support or upgrade the peer")
    return codec


def _parse_stage(text: str, spec: str) -> tuple[str, dict[str, str]]:
    name, _, argtext = text.partition(":")
    name = name.strip()
    if not _NAME.match(name):
        raise CodecSpecError(f"codec spec {spec!r}: {name!r} is not a codec name; available: "
                             f"{', '.join(available_codecs())}")
    if name not in _KEYS:
        raise CodecSpecError(f"codec spec {spec!r}: unknown codec {name!r}; available: {', '.join(available_codecs())}")
    args: dict[str, str] = {}
    if not _:
        return name, args
    if not argtext.strip():
        raise CodecSpecError(f"codec spec {spec!r}: {name}: expected parameters after ':'")
    for i, arg in enumerate(argtext.split(",")):
        key, eq, value = arg.partition("=")
        if not eq:
            key, value = "", key
        key, value = key.strip(), value.strip()
        if not key:
            if i or name not in _POSITIONAL:
                raise CodecSpecError(f"codec spec {spec!r}: {name}: bare value {value!r} (only the first parameter "
                                     f"of int8/int4 (block) and topk (fraction) may omit its name)")
            key = _POSITIONAL[name]
        if key not in _KEYS[name]:
            known = ", ".join(_KEYS[name]) or "none"
            raise CodecSpecError(f"codec spec {spec!r}: {name} has no parameter {key!r} (parameters: {known})")
        if key in args:
            raise CodecSpecError(f"codec spec {spec!r}: {name}: parameter {key!r} given twice")
        if not value:
            raise CodecSpecError(f"codec spec {spec!r}: {name}: parameter {key!r} has no value")
        args[key] = value
    return name, args


def _number(value: str, kind: type, what: str, spec: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise CodecSpecError(f"codec spec {spec!r}: {what} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}") from None


def _build(name: str, args: dict[str, str], spec: str) -> Codec:
    try:
        if name == "fp32":
            return FP32()
        if name == "fp16":
            return FP16()
        if name == "bf16":
            return BF16()
        if name in ("int8", "int4"):
            cls = Int8 if name == "int8" else Int4
            block = _number(args.get("block", "128"), int, f"{name} block (1..{MAX_BLOCK})", spec)
            return cls(block=block, scale=args.get("scale", "fp32"),  # type: ignore[arg-type]
                       rounding=args.get("rounding", "stochastic"))  # type: ignore[arg-type]
        assert name == "topk"
        fraction = _number(args["fraction"], float, "topk fraction", spec) if "fraction" in args else None
        k = _number(args["k"], int, "topk k", spec) if "k" in args else None
        idx = args.get("idx", "varint")
        if idx not in INDEX_ENCODINGS:
            raise CodecSpecError(f"topk: idx must be one of {list(INDEX_ENCODINGS)}, got {idx!r}")
        return TopK(fraction=fraction, k=k, idx=idx)  # type: ignore[arg-type]
    except CodecSpecError as e:
        if spec in str(e):
            raise
        raise CodecSpecError(f"codec spec {spec!r}: {e}") from None


def parse_codec(spec: str) -> Codec:
    """Parse a codec spec string (see the module docstring) into a codec; ``parse_codec(c.spec) == c``.

    Raises :class:`CodecSpecError` naming the unknown codec or parameter, or the bad value or order."""
    if not isinstance(spec, str) or not spec.strip():
        raise CodecSpecError(f"codec spec must be a non-empty string like 'int8' or 'topk:0.01+int8', got {spec!r}")
    stages = [_parse_stage(part, spec) for part in spec.split("+")]
    codecs = [_build(name, args, spec) for name, args in stages]
    if len(codecs) == 1:
        return codecs[0]
    if len(codecs) == 2 and isinstance(codecs[0], TopK) and codecs[1].kind == "value":
        first = codecs[0]
        return TopK(fraction=first.fraction, k=first.k, idx=first.idx, values=codecs[1])
    raise CodecSpecError(f"codec spec {spec!r}: a pipeline is one value codec, or topk followed by one value codec "
                         f"(e.g. 'topk:0.01+int8:block=128'); got {' + '.join(n for n, _ in stages)}")
