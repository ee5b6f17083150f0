"""One site's local round: the one implementation the hospital agent and the simulator both run.

From the global model (already in ``loaded``), the site's encoded data, the task's training settings, the
round, the site's name, its private-module values and its error-feedback state, one round is::

    s      = site_seed(train.seed, round, site)              # shuffles, dropout (one derivation, below)
    load the site's private values (private modules: trained here, never sent)
    send   = SAFL ? select_layers(global, data, seed=profile_seed(train.seed, round, site)).tensors : send
    before = global values of send
    train on send + private: DP-SGD (per-example clip C, noise sigma C) when the task asks, else train_local
    d      = local - before on send                          (float32)
    codec  : raw -> d as it is; else C(d [+ residual]), residual staged (top-k: error feedback)
             stochastic rounding from tensor_rng(task, round, site, tensor)

Seeds. A site's training seed is ``SeedSequence([DOMAIN, train_seed mod 2^64, round, H(site)])`` (31 bits), with
``H(site)`` the SHA-256 of the site's name as a 256-bit integer: an agent knows its certificate name, and the
simulator names its site ``i`` ``"site-{i}"`` (or as told). So every site gets its own shuffle order and dropout
draws, different in every round, equal-sized sites do not share an order, and the same task trains the same
models in the simulator and over the services. DP-SGD's Poisson sampling and noise are not seeded from any of
this (see :mod:`fedclinic.privacy.dp_sgd`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Hashable, Mapping, Sequence

import numpy as np

from fedclinic.transport import codec_wire
from fedclinic.codecs import CodecInputError, ErrorFeedback
from fedclinic.errors import FedclinicError, IntegrityError
from fedclinic.federation.spilled_tensors import SpilledTensors
from fedclinic.transport.package import tensor_sha256
from fedclinic.training.private_modules import outgoing_problems
from fedclinic.proto import tensors_pb2

if TYPE_CHECKING:  # torch-heavy modules are imported where a round runs (keeps `import fedclinic.federation.site_round` light)
    from fedclinic.models import LoadedModel
    from fedclinic.privacy.dp_sgd import DPSGD
    from fedclinic.training.safl import LayerSelection, SaflConfig
    from fedclinic.training.trainer import TrainConfig, TrainResult

#: separates the training seed from other seeds derived from the same keys (e.g. SAFL's profiling sample)
SEED_DOMAIN = 0x517E_5EED


def site_key(site: str) -> int:
    """A site's name as a number for seed derivations: SHA-256 of its UTF-8 bytes, big-endian."""
    return int.from_bytes(hashlib.sha256(site.encode()).digest(), "big")


def site_seed(train_seed: int, round_: int, site: str) -> int:
    """The local training seed of ``site`` in ``round_`` of a task with training seed ``train_seed``:
    ``SeedSequence([SEED_DOMAIN, train_seed mod 2^64, round_, site_key(site)])``, its first word shifted to 31
    bits."""
    keys = [SEED_DOMAIN, int(train_seed) & 0xFFFF_FFFF_FFFF_FFFF, int(round_), site_key(site)]
    return int(np.random.SeedSequence(keys).generate_state(1)[0] >> 1)


@dataclass
class SiteRoundInput:
    """What one site's round is computed from, besides the model and the data.

    ``send``: the tensors the task may send (an Assignment's ``send_tensors``, or the simulator's selection);
    never a private tensor. ``train``: the task's training settings (``seed`` = the task's seed, ``device`` as
    the site runs it). ``dp``: DP-SGD settings for this round (None: non-private). ``optimizer_state``: the
    moments kept from the site's previous round (``optimizer_state = "keep"``). ``private_values``: the site's
    own values of its private tensors, loaded before training (None: the model's current ones). ``feedback``:
    the site's error-feedback state for a top-k codec (None: a fresh one is made when the codec needs it);
    the new residual is staged in it, for the caller to commit once the update is delivered.
    ``dp_entropy``: seed of DP-SGD's sampler and noise; None (what sites run) draws it from the OS; a test
    gives a value to replay a private round."""

    task_id: str
    site: str
    round: int
    send: Sequence[str]
    train: "TrainConfig"
    private: Sequence[str] = ()
    codec: str = codec_wire.RAW
    safl: "SaflConfig | None" = None
    dp: "DPSGD | None" = None
    optimizer_state: dict | None = None
    private_values: Mapping[str, np.ndarray] | None = None
    feedback: ErrorFeedback | None = None
    progress: Callable[[int, int, float], None] | None = None
    dp_entropy: int | None = None
    #: per-patient DP: the patient id of each training row (None: the unit is a row); see fedclinic.privacy.patient_groups
    dp_groups: Sequence[Hashable] | None = None
    #: the global values of the tensors that may be sent, where the caller keeps them outside the module (the
    #: agent's tensor cache, read a tensor at a time): the delta is taken against them instead of a copy of the
    #: model made before training. They must equal the module's values on entry. None: that copy is made.
    base: Mapping[str, np.ndarray] | None = None
    #: a folder for the delta: each tensor's difference is written there as it is computed and the update reads
    #: them back one at a time (fedclinic.federation.spilled_tensors; the agent). None: the delta is held as arrays.
    spill_dir: Path | None = None


@dataclass
class EncodedUpdate:
    """The update as it leaves the site: one ``TensorHeader`` per sent tensor (in send order) and its payload
    (the raw float32 delta, or the codec's bytes)."""

    headers: list[tensors_pb2.TensorHeader]
    payloads: Mapping[str, np.ndarray | bytes]

    def decoded(self) -> dict[str, np.ndarray]:
        """What the aggregator decodes from it: float32 deltas by name."""
        from fedclinic.codecs import decode, parse_codec  # cheap, but only tests and the simulator decode

        out: dict[str, np.ndarray] = {}
        for h in self.headers:
            payload = self.payloads[h.name]
            if codec_wire.is_raw(h.codec):
                out[h.name] = np.asarray(payload, dtype=np.float32).reshape(tuple(h.shape))
            else:
                params = codec_wire.params_of(h.name, parse_codec(h.codec), list(h.shape), dict(h.codec_params))
                out[h.name] = decode(payload, params).reshape(tuple(h.shape))
        return out


@dataclass
class SiteRoundResult:
    """One site's round: what it sends, how it was trained, and what it keeps."""

    seed: int                                   # the training seed used (site_seed)
    send: list[str]                             # the tensors sent (SAFL: selected layers + head)
    delta: dict[str, np.ndarray]                # local - global on ``send``, float32
    update: EncodedUpdate                       # ``delta`` through the task's codec
    train: "TrainResult"
    metrics: dict[str, float]                   # reported with the update (training + SAFL scores)
    private_values: dict[str, np.ndarray] = field(default_factory=dict)  # the site's private tensors after training
    selection: "LayerSelection | None" = None
    feedback: ErrorFeedback | None = None       # the error-feedback state with the staged residual (top-k)


def run_site_round(loaded: "LoadedModel", data: object, inp: SiteRoundInput) -> SiteRoundResult:
    """Run one site's local round (see the module docstring) on ``loaded``, which holds the global model's
    tensors on entry and the site's locally trained ones on return. IntegrityError if a private tensor is
    among those to send; FedclinicError if a tensor cannot be encoded with the task's codec."""
    # lazy: torch/transformers load when a round runs (the agent imports this module at start-up, before it
    # knows whether this site will ever train)
    from fedclinic.training import safl as safl_layers
    from fedclinic.models import load_tensors, module_tensors
    from fedclinic.models.base import ModuleTensorView
    from fedclinic.training.trainer import compute_delta, train_local

    private = list(inp.private)
    leaking = outgoing_problems(list(inp.send), private)
    if leaking:
        raise IntegrityError("refusing to send: " + "; ".join(leaking))
    if private and inp.private_values is not None:
        load_tensors(loaded.module, dict(inp.private_values))
    send = list(inp.send)
    selection = None
    if inp.safl is not None:  # attention-selected layers: profile the global model, train the top-k + head
        selection = safl_layers.select_layers(loaded, data, inp.safl, send,
                                              seed=safl_layers.profile_seed(inp.train.seed, inp.round, inp.site))
        send = selection.tensors
    seed = site_seed(inp.train.seed, inp.round, inp.site)
    cfg = replace(inp.train, seed=seed)
    before = inp.base if inp.base is not None else module_tensors(loaded.module, send)
    if inp.dp is not None:
        from fedclinic.privacy.dp_sgd import train_local_private  # lazy: opacus only for private rounds

        from fedclinic.privacy.patient_groups import PatientGroups

        groups = PatientGroups(inp.dp_groups) if inp.dp_groups is not None else None
        result = train_local_private(loaded, data, cfg, inp.dp, trainable=send + private, progress=inp.progress,
                                     entropy=inp.dp_entropy, groups=groups)
    else:
        result = train_local(loaded, data, cfg, trainable=send + private, progress=inp.progress,
                             optimizer_state=inp.optimizer_state)
    into = SpilledTensors(inp.spill_dir) if inp.spill_dir is not None else None
    delta = compute_delta(before, ModuleTensorView(loaded.module), send, into=into)  # one trained tensor at a time
    leaking = outgoing_problems(send, private)
    if leaking:  # unreachable while the check above holds; the last gate before anything is encoded
        raise IntegrityError("refusing to send: " + "; ".join(leaking))
    update, feedback = encode_update(delta, send, inp)
    metrics = {**result.reported_metrics(), **(selection.metrics() if selection is not None else {})}
    return SiteRoundResult(seed=seed, send=send, delta=delta, update=update, train=result, metrics=metrics,
                           private_values=module_tensors(loaded.module, private) if private else {},
                           selection=selection, feedback=feedback)


def encode_update(delta: Mapping[str, np.ndarray], send: Sequence[str], inp: SiteRoundInput
                  ) -> tuple[EncodedUpdate, ErrorFeedback | None]:
    """``delta`` under the task's codec, one header per tensor of ``send``. Top-k encodes ``delta + residual`` and
    stages the new residual in ``inp.feedback`` (or a fresh state, returned); a residual of another shape (the
    model changed) is dropped first. Stochastic rounding draws from ``codec_wire.tensor_rng``."""
    codec = codec_wire.task_codec(inp.codec)
    headers: list[tensors_pb2.TensorHeader] = []
    if codec is None:
        for name in send:
            arr = delta[name]
            headers.append(tensors_pb2.TensorHeader(name=name, dtype="float32", shape=list(arr.shape), codec="raw",
                                                    sha256=tensor_sha256(arr), encoded_nbytes=int(arr.nbytes)))
        # spilled: the files themselves, read a tensor at a time where the update is written
        payloads = delta if isinstance(delta, SpilledTensors) else {n: delta[n] for n in send}
        return EncodedUpdate(headers, payloads), None
    feedback = None
    if codec_wire.uses_error_feedback(codec):
        feedback = inp.feedback if inp.feedback is not None else ErrorFeedback(codec)
    payloads: dict[str, np.ndarray | bytes] = {}
    for name in send:
        arr = np.ascontiguousarray(delta[name], dtype=np.float32)
        rng = codec_wire.tensor_rng(inp.task_id, inp.round, inp.site, name)
        try:
            if feedback is not None and feedback.residual(name) is not None and \
                    feedback.residual(name).shape != arr.shape:
                feedback.reset(name)
            enc = feedback.encode(name, arr, rng=rng) if feedback is not None else codec.encode(arr, rng=rng)
        except CodecInputError as exc:
            raise FedclinicError(f"tensor {name!r} cannot be encoded with the task's codec: {exc}") from None
        headers.append(tensors_pb2.TensorHeader(
            name=name, dtype="float32", shape=list(arr.shape), codec=codec.spec,
            sha256=hashlib.sha256(enc.payload).hexdigest(), encoded_nbytes=len(enc.payload),
            codec_params=codec_wire.header_params(enc)))
        payloads[name] = enc.payload
    return EncodedUpdate(headers, payloads), feedback


__all__ = ["EncodedUpdate", "SiteRoundInput", "SiteRoundResult", "encode_update", "run_site_round", "site_key",
           "site_seed"]
