"""Sample-level DP-SGD for a site's local training (per-example clipping and Gaussian noise).

One round of local DP-SGD runs ``steps`` steps; each step (Abadi et al. 2016)::

    B   = Poisson sample of the site's examples, each kept with probability q
    g_i = grad of loss(x_i) for i in B                       (per-sample gradients or only their norms)
    g   = ( sum_{i in B} g_i * min(1, C / ||g_i||) + N(0, (sigma C)^2 I) ) / (q n)
    w  <- optimizer step with g

Per-patient DP (``groups``, :mod:`fedclinic.privacy.patient_groups`): the same with "example" read as "group"
(all of one patient's rows): groups are Poisson-sampled with all their rows, each group's summed gradient is
clipped once, and ``q G`` (expected groups) divides the sum.

``q n`` is the *expected* batch size, so the step does not depend on the realised batch size; an empty
sample is a noise-only step (the analysed mechanism releases noise then too: skipping the step would tell
an observer that the sample was empty, an event whose probability depends on the dataset). The accountant
(:mod:`fedclinic.privacy.accounting`) charges ``(sigma, q, steps)`` per round.

Randomness: dropout is seeded from ``cfg.seed`` (the site round's seed) in a forked RNG, as in
:func:`fedclinic.training.trainer.train_local`. The Poisson sampling and the Gaussian noise -- both part of the
privacy analysis -- come from fedclinic's CSPRNG, never from the task's seed (the data scientist knows that
seed; noise they could regenerate would protect nothing): two ChaCha20 keystreams
(:class:`~fedclinic.strategies.secure_random.SecureRandom`) keyed from ``os.urandom`` afresh every round, one for
the sampling (example kept iff a 53-bit uniform is below ``q``) and one for the noise
(:class:`~fedclinic.privacy.tensor_noise.TensorNoise`: the polar method in float64, rounded once to float32; see
:mod:`fedclinic.strategies.secure_gaussian` for what that does against floating-point attacks). The ghost path
adds that noise itself; the hooks path uses :class:`~fedclinic.privacy.secure_dp_optimizer.SecureDPOptimizer`,
Opacus' DPOptimizer with only its noise draw replaced.

Which models
------------
Per family, the privacy unit and the per-example loss are those of :mod:`fedclinic.privacy.per_example`
(one text, one feature row, one sentence/review, one question/answer pair, one image and its report). Every
built-in model is supported (:data:`SUPPORTED`, shared with the task spec and the aggregator through
:mod:`fedclinic.spec.capabilities`; anything else is refused with the reason and the alternative,
:func:`check_supported`). Three exact ways to the clipped sum, chosen per model (``mode``):

``"ghost"`` (:mod:`fedclinic.privacy.ghost`)
    per-example norms layer by layer from the layers' inputs and output gradients, and the clipped sum from the
    same records, in one backward pass and without Opacus. Ghost clipping sums squared per-layer norms, which is
    the squared norm of the example's gradient only when no parameter is used twice (checked), and covers Linear,
    LayerNorm and Embedding parameters, and LoRA adapters (:mod:`fedclinic.models.lora`: parameters of their
    linear with a rule of their own, :func:`fedclinic.privacy.ghost.lora_squared_norms`). ``auto`` uses it for
    text and feature classification (single- and multi-label) when every trained tensor is covered, e.g. a
    LoRA task (adapters and head trained, encoder frozen).
``"hooks"``
    each example's gradient materialised by Opacus' GradSampleModule: the Hugging Face token-classification
    and causal-LM models (Linear, Embedding, LayerNorm grad samplers; GPT-2's ``Conv1D`` and Llama's RMSNorm by
    Opacus' functorch fallback, ``vmap`` of the layer's own gradient; the CRF by per-sequence parameter copies).
    Refused for LoRA adapters (Opacus' Linear grad sampler covers a linear's own weight and bias only) and for
    :data:`LOOP_MODELS` (no exact grad sampler for their layers).
``"loop"`` (:mod:`fedclinic.privacy.per_example_clipping`)
    each example differentiated alone (the definition; one forward and backward pass per example): exact for
    any layer, used by ``auto`` for :data:`LOOP_MODELS` -- the text LSTM and FedNER's BiLSTM over packed
    sequences (cuDNN's kernels included, autograd differentiates whatever ran; no ``DPLSTM``, so every tensor
    keeps its name), the bag-of-tokens ``EmbeddingBag`` with per-token weights, the ResNet + BiLSTM image-text
    model -- and for LoRA adapters outside ghost clipping's families.

Batch normalisation (the image-text ResNet) runs in inference mode in every private round
(:func:`freeze_batch_norm`): in training mode it normalises an example with its batch's statistics, so the
example's output and gradient depend on the other examples and there is no per-example gradient whose clipping
bounds the sensitivity. Frozen, it is a fixed per-channel affine map; the running statistics keep the package's
values (not updated), and its affine weight and bias train only when the task trains them (exactly, per
example). Freezing, not replacing it by GroupNorm, keeps the package's tensors and names unchanged.

BERT-family models
------------------
A plain ``make_private`` on ``BertForSequenceClassification`` fails in ``clip_and_accumulate``: the model
builds ``position_ids`` and ``token_type_ids`` from buffers of batch size 1 that broadcast over the batch,
so the embedding layers' per-sample gradients come out with batch dimension 1 and cannot be stacked with
the others. :func:`explicit_ids_hook` gives every Hugging Face model (outer and base models: the causal LM's
objective calls its base model directly) explicit per-example ids of shape ``[batch, L]``, exactly the values
the model would have used for right-padded input: ``position_ids = 0..L-1`` for the model types in
:data:`ARANGE_POSITIONS` (RoBERTa derives its positions per example from the padding already and gets none),
and ``token_type_ids = 0`` for models with token-type embeddings (``type_vocab_size``; GPT-2 has none and
would add ``wte(0)`` to every position if given them). Nothing is frozen; a test checks that the hook leaves
every allowed model type's outputs unchanged.
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.spec.capabilities import ALTERNATIVE, LOOP_MODELS, REFUSED, SUPPORTED, check_supported  # noqa: F401  (re-exported)
from fedclinic.training import eager_optimizers

if TYPE_CHECKING:
    import torch

    from fedclinic.privacy.patient_groups import PatientGroups
    from fedclinic.privacy.tensor_noise import SecureRandom, TensorNoise
    from fedclinic.training.trainer import TrainConfig, TrainResult

#: families that may use ghost clipping (their models: Linear, LayerNorm and Embedding layers, no tied parameters)
GHOST_FAMILIES = ("text-classification", "feature-classification")
#: DP-SGD modes: per-example gradients materialised by Opacus' hooks, ghost clipping, each example differentiated
#: alone (the loop), or the best exact one for the model
MODES = ("auto", "hooks", "ghost", "loop")
#: HF model types whose default position ids are 0..L-1 for right-padded input (see the module docstring)
ARANGE_POSITIONS = ("bert", "distilbert", "electra", "gpt2", "llama")


@dataclass(frozen=True)
class DPSGD:
    """The DP-SGD settings of one round: noise multiplier sigma, clip norm C, sampling rate q, steps."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ConfigError(f"DP-SGD noise_multiplier must be positive, got {self.noise_multiplier}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"DP-SGD max_grad_norm (the per-example clip C) must be positive, got {self.max_grad_norm}")
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"DP-SGD sample rate must be in (0, 1], got {self.sample_rate}")
        if self.steps <= 0:
            raise ConfigError(f"DP-SGD needs at least one step, got {self.steps}")


def explicit_ids_hook(module: "torch.nn.Module") -> list:
    """Give each Hugging Face model inside ``module`` explicit ``[batch, L]`` position and token-type ids when
    the caller passes ``input_ids`` without them (see the module docstring). Returns the hook handles (call
    ``.remove()`` on each when done)."""
    import torch

    handles = []

    def hook(mod, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2:
            return args, kwargs
        b, length = ids.shape
        fill = fills[id(mod)]
        if "position_ids" in fill and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = torch.arange(length, device=ids.device).unsqueeze(0).repeat(b, 1)
        if "token_type_ids" in fill and kwargs.get("token_type_ids") is None:
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        return args, kwargs

    fills: dict[int, set[str]] = {}
    for sub in module.modules():
        if not _is_hf_model(sub):
            continue
        params = inspect.signature(sub.forward).parameters
        config = sub.config
        fill = set()
        if "position_ids" in params and getattr(config, "model_type", None) in ARANGE_POSITIONS:
            fill.add("position_ids")
        if "token_type_ids" in params and int(getattr(config, "type_vocab_size", 0) or 0) > 0:
            fill.add("token_type_ids")
        fills[id(sub)] = fill
        handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _is_hf_model(module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a train dependency
        return False
    return isinstance(module, PreTrainedModel)


def train_local_private(loaded, data, cfg: "TrainConfig", dp: DPSGD, *, trainable: Collection[str],
                        progress: Callable[[int, int, float], None] | None = None,
                        mode: str = "auto", step_hook: Callable[[Any], None] | None = None,
                        entropy: int | None = None, groups: "PatientGroups | None" = None) -> "TrainResult":
    """Train ``loaded.module`` in place with DP-SGD (``dp.steps`` Poisson-sampled steps); only ``trainable``
    tensors change. Same contract as :func:`fedclinic.training.trainer.train_local` otherwise; optimizer state is
    not kept across rounds (it would be a function of earlier noisy gradients only, but the simpler contract
    is the one stated here), and AMP, FedProx and the gradient-change measure are refused.

    The objective is the batch mean of per-example losses (:class:`~fedclinic.privacy.per_example.PerExampleObjective`).
    ``mode``: ``"hooks"`` materialises one gradient per example and trained tensor (Opacus' GradSampleModule);
    ``"ghost"`` computes the per-example norms and the clipped sum without them, in one backward pass
    (:mod:`fedclinic.privacy.ghost`), so memory and time stay near non-private training; ``"loop"``
    differentiates each example alone (:mod:`fedclinic.privacy.per_example_clipping`); ``"auto"`` (default)
    uses ghost clipping for text and feature classification when every trained tensor is a Linear, LayerNorm or
    Embedding parameter or a LoRA adapter, the loop for :data:`LOOP_MODELS` and adapters elsewhere, and hooks
    otherwise (the module docstring). All compute the same clipped sum (tested). All take a Poisson
    sample larger than ``cfg.batch_size`` in parts of at most that size (the clipped sum adds over examples), so
    memory follows the batch size, not the sample's. ``step_hook(optimizer)``
    is called after the noise of every step is drawn with an object carrying ``noise_multiplier``,
    ``max_grad_norm``, ``expected_batch_size`` and ``accumulated_iterations`` (Opacus' accountant hook fits: the
    caller can account what actually ran). ``entropy`` keys the Poisson sampler's and the noise's keystreams; None
    (the default, and what every site runs) keys them from the operating system (``os.urandom``); a test gives an
    integer to replay a round bit for bit (:func:`~fedclinic.strategies.secure_gaussian.replay_key`). ``groups`` (one group per row of ``data``: the
    patients) makes the unit a group: groups are Poisson-sampled with rate ``dp.sample_rate`` (each kept with all of
    its rows), each group's summed gradient is clipped once, the sum is divided by the expected number of groups, and
    parts are whole groups of at most ``cfg.batch_size`` rows (a larger group is a part alone)."""
    if mode not in MODES:
        raise ConfigError(f"DP-SGD mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "ghost" and loaded.family not in GHOST_FAMILIES:
        raise ConfigError(f"ghost clipping is available for {' and '.join(GHOST_FAMILIES)} (per-example losses of "
                          "Linear, LayerNorm and Embedding layers, no parameter used twice); use mode 'hooks' for "
                          "this task")
    # lazy: torch and opacus load when a private round runs (the agent and the simulator import this module to
    # plan budgets, which needs neither)
    import torch

    from fedclinic.training import data_parallel
    from fedclinic.training.optimizers import make_optimizer
    from fedclinic.privacy.ghost import unsupported_parameters
    from fedclinic.training.trainer import TrainResult, select_device

    cfg.validate()
    check_supported(loaded.family, loaded.architecture)
    if cfg.mixed_precision or cfg.proximal_mu > 0 or cfg.measure_gradient_change:
        raise ConfigError("DP-SGD runs in float32 without a proximal term or the gradient-change measure; turn off "
                          "mixed_precision, proximal_mu and measure_gradient_change for a private task")
    n = len(data)
    if n == 0:
        raise DatasetError("no training examples; the site's dataset is empty")
    if groups is not None and len(groups) != n:
        raise DatasetError(f"{len(groups)} patient ids for {n} training rows; every row needs its patient's id",
                           rule="the patient ids do not match the rows")
    units = n if groups is None else groups.num_groups  # what is sampled, clipped and counted
    device = select_device(cfg.device)
    module = loaded.module.to(device)
    wanted = set(trainable)
    named_train = [(name, p) for name, p in module.named_parameters() if name in wanted]
    if not named_train:
        raise ConfigError("none of the trainable names is a parameter of the model; nothing to train")
    train_params = [p for _, p in named_train]
    for name, p in module.named_parameters():
        p.requires_grad_(name in wanted)
    group = data_parallel.current()
    if group is not None:  # several processes: the same sample and noise on every rank, shards clipped apart
        problem = distributed_problem(loaded, [n for n, _ in named_train], groups, mode=mode)
        if problem:
            raise ConfigError(problem)
        entropy = group.shared_entropy(entropy)
    sampler, noise = _randomness(entropy)
    optimizer = make_optimizer(cfg.optimizer, train_params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    noisy = NoisyStep(dp.noise_multiplier, dp.max_grad_norm, expected_batch_size=max(1, round(dp.sample_rate * units)))
    run_class = _run_class(mode, loaded, unsupported_parameters(module, train_params))
    original = loaded.module
    handles = explicit_ids_hook(module)
    run = None
    loss_sum, seen = 0.0, 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(cfg.seed))  # dropout only (no privacy rests on it): the site round's seed, as train_local
        try:
            run = run_class(loaded, module, data, device, cfg.batch_size, train_params, optimizer, noisy, noise,
                            step_hook, groups)
            module.train()
            freeze_batch_norm(module)
            for step in range(1, dp.steps + 1):
                keep = torch.from_numpy(sampler.uniform(units) < dp.sample_rate)
                idx = keep.nonzero().flatten() if groups is None else groups.sample(keep)
                loss_sum += run.step(idx)
                seen += len(idx)
                if progress is not None:
                    progress(step, dp.steps, loss_sum / max(seen, 1))
        finally:
            for h in handles:
                h.remove()
            if run is not None:
                run.close()
            loaded.module = original
            for p in module.parameters():
                p.requires_grad_(True)
                p.grad = None
            module.eval()
    if not math.isfinite(loss_sum):
        raise IntegrityError("private training diverged (loss is NaN/Inf); lower the learning rate")
    return TrainResult(num_samples=n, steps=dp.steps, loss=loss_sum / max(seen, 1))


def distributed_problem(loaded, trainable: Collection[str], groups: object = None, *, mode: str = "auto"
                        ) -> str | None:
    """Why a private round training ``trainable`` cannot run data-parallel on several processes (None: it can):
    ghost and loop clipping shard the Poisson sample by example; Opacus' hooks and per-patient ``groups`` do not
    yet (the caller then trains in one process)."""
    from fedclinic.privacy.ghost import unsupported_parameters  # lazy: torch

    wanted = set(trainable)
    module = loaded.module
    train_params = [p for name, p in module.named_parameters() if name in wanted]
    if groups is not None:
        return ("per-patient DP-SGD runs in one process; set the site's devices to one device for this task "
                "(privacy.unit = \"patient\")")
    if _run_class(mode, loaded, unsupported_parameters(module, train_params)) is _OpacusRun:
        return (f"DP-SGD for {loaded.family} ({loaded.architecture}) clips with Opacus' hooks, which run in one "
                "process; set the site's devices to one device for this task")
    return None


def _randomness(entropy: int | None) -> tuple["SecureRandom", "TensorNoise"]:
    """The round's Poisson sampler (a :class:`SecureRandom`) and Gaussian noise (a :class:`TensorNoise`): keyed
    from the OS, or replayed from a test's ``entropy``."""
    from fedclinic.privacy.tensor_noise import SecureRandom, TensorNoise, replay_key  # lazy: torch

    if entropy is None:
        return SecureRandom(), TensorNoise()
    return SecureRandom(replay_key(entropy, "dp-sgd sampler")), TensorNoise.replay(entropy, "dp-sgd noise")


@dataclass(frozen=True)
class NoisyStep:
    """What a step hook is shown of a ghost-clipping step: the attributes Opacus' accountant hook reads."""

    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: int
    accumulated_iterations: int = 1


class _GhostRun:
    """DP-SGD steps with :class:`~fedclinic.privacy.ghost.GhostClipping`: ``p.grad = (S + N(0, (sigma C)^2 I)) /
    (q n)`` per trained tensor (noise from the CSPRNG, :class:`~fedclinic.privacy.tensor_noise.TensorNoise`, drawn
    one tensor at a time), then the optimizer's step. ``S`` adds over
    examples, so the Poisson sample is processed in parts of at most the task's batch size: a sample larger than
    expected costs time, not memory beyond what non-private training at that batch size needs."""

    clipping: Any = None  # the clipped-sum class (GhostClipping's interface); None: GhostClipping

    def __init__(self, loaded, module, data, device, part_size: int, params: list, optimizer, noisy: NoisyStep,
                 noise, step_hook, groups: "PatientGroups | None" = None) -> None:
        # lazy: torch (see train_local_private)
        from fedclinic.privacy.ghost import GhostClipping
        from fedclinic.privacy.per_example import PerExampleObjective

        self.clip = (self.clipping or GhostClipping)(module, params, noisy.max_grad_norm)
        self.objective = PerExampleObjective(loaded, module, data.multi_label)
        self.data, self.device, self.part_size = data, device, max(1, part_size)
        self.params, self.optimizer, self.noisy, self.noise, self.step_hook = params, optimizer, noisy, noise, step_hook
        self.groups = groups
        from fedclinic.training import data_parallel

        self.group = data_parallel.current()  # several processes: this rank clips its shard of each sample

    def step(self, idx: "torch.Tensor") -> float:
        """One noisy step on the Poisson sample ``idx`` (empty: a noise-only step, as the accountant assumes);
        returns the sample's summed loss."""
        self.optimizer.zero_grad(set_to_none=True)  # p.grad must hold only this step's clipped sum and noise
        total = 0.0
        mine = idx if self.group is None else self.group.shard(idx)
        for part, local in _parts(mine, self.part_size, self.groups):
            inputs, y = self.data.batch(part, self.device)
            with self.clip.recording():
                losses = self.objective.per_example(inputs, y)
            self.clip.add_clipped_sum(losses, None if local is None else local.to(losses.device))
            total += float(losses.detach().sum())
            del losses
        if self.group is not None:  # the sample's clipped sum: every rank's shard added, before the noise
            total = self.group.sum_gradients(self.params, total)
        std = self.noisy.noise_multiplier * self.noisy.max_grad_norm
        for p in self.params:
            noise = self.noise.like(p, std)
            p.grad = noise if p.grad is None else p.grad.add_(noise)
            p.grad.div_(self.noisy.expected_batch_size)
        if self.step_hook is not None:
            self.step_hook(self.noisy)
        eager_optimizers.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def close(self) -> None:
        self.clip.close()


class _LoopRun(_GhostRun):
    """:class:`_GhostRun` with the clipped sum of :class:`~fedclinic.privacy.per_example_clipping.PerExampleClipping`
    (each example differentiated alone): the same parts, noise and step."""

    def __init__(self, loaded, module, data, device, part_size: int, params: list, optimizer, noisy: NoisyStep,
                 noise, step_hook, groups: "PatientGroups | None" = None) -> None:
        from fedclinic.privacy.per_example_clipping import PerExampleClipping  # lazy: torch

        if groups is not None:
            raise ConfigError("per-patient DP-SGD (privacy.unit = \"patient\") is available for models clipped by ghost "
                              "clipping or Opacus' hooks; this model is clipped one example at a time, which does not "
                              "sum a patient's rows before clipping yet; use privacy.unit = \"example\" or client-level DP")
        self.clipping = PerExampleClipping
        super().__init__(loaded, module, data, device, part_size, params, optimizer, noisy, noise, step_hook)
        self.objective = self.clip.objective(self.objective)


def _run_class(mode: str, loaded, unsupported: list[str]) -> type:
    """The run of ``mode`` for this model (``auto``: ghost where its layer rules cover every trained tensor, hooks
    for the Hugging Face families, the per-example loop otherwise); ConfigError where a mode cannot be exact."""
    lora = loaded.meta.get("lora") is not None
    loop_model = (loaded.family, loaded.architecture) in LOOP_MODELS
    if mode == "auto":
        if loaded.family in GHOST_FAMILIES and not unsupported:
            mode = "ghost"
        elif loop_model or lora:
            mode = "loop"
        else:
            mode = "hooks"
    if mode == "ghost" and unsupported:
        raise ConfigError(f"ghost clipping has no layer rule for {unsupported[:4]}; use mode 'auto' (it picks "
                          f"{'loop' if loop_model or lora else 'hooks'} for this model)")
    if mode == "hooks" and (lora or loop_model):
        what = "LoRA adapters (its Linear grad sampler covers a linear's own weight and bias only)" if lora else (
            f"the {loaded.architecture} architecture (torch's nn.LSTM / EmbeddingBag with per-token weights / "
            "BatchNorm have no exact grad sampler there)")
        raise ConfigError(f"Opacus' hooks mode has no per-sample gradients for {what}; use mode 'loop' or 'auto'")
    return {"ghost": _GhostRun, "loop": _LoopRun, "hooks": _OpacusRun}[mode]


def freeze_batch_norm(module: "torch.nn.Module") -> None:
    """Put every batch-norm layer of ``module`` in inference mode (running statistics fixed and not updated).

    In training mode a batch-norm layer normalises each example with the mean and variance of the whole batch,
    so an example's output -- and its gradient -- depends on the other examples: there is no per-example
    gradient to clip and the sensitivity of the clipped sum is not C. In inference mode it is a fixed per-channel
    affine map of each example alone (Opacus refuses train-mode BatchNorm for the same reason). Its tensors stay
    as they are: the running statistics are not updated, the affine weight and bias train only if the task
    trains them, with exact per-example gradients."""
    import torch

    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            sub.eval()


class _OpacusRun:
    """DP-SGD steps with Opacus' GradSampleModule (one gradient per example and trained tensor) and DPOptimizer.

    A Poisson sample larger than the task's batch size is processed in parts of at most that size: after each
    part but the last, the optimizer clips that part's per-sample gradients into its running clipped sum
    (``p.summed_grad``) and skips the noise and the update (Opacus' ``signal_skip_step``), and the part's
    per-sample gradients are dropped; the last part's step adds the noise once and updates. The clipped sum is
    the same as in one batch; memory holds one part's per-sample gradients at a time."""

    def __init__(self, loaded, module, data, device, part_size: int, params: list, optimizer, noisy: NoisyStep,
                 noise, step_hook, groups: "PatientGroups | None" = None) -> None:
        from opacus import GradSampleModule

        from fedclinic.privacy.per_example import PerExampleObjective  # lazy: torch (see train_local_private)
        from fedclinic.privacy.secure_dp_optimizer import SecureDPOptimizer

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Opacus' notes about secure_mode and full backward hooks
            self.gsm = GradSampleModule(module, batch_first=True, loss_reduction="mean", strict=True)
            self.optimizer = SecureDPOptimizer(optimizer, noise_multiplier=noisy.noise_multiplier,
                                               max_grad_norm=noisy.max_grad_norm,
                                               expected_batch_size=noisy.expected_batch_size, loss_reduction="mean",
                                               noise=noise)
        if step_hook is not None:
            self.optimizer.attach_step_hook(step_hook)
        self.data, self.device, self.params, self.part_size = data, device, params, max(1, part_size)
        self.groups = groups
        loaded.module = self.gsm  # loaded.logits(...) now runs through the per-sample gradient hooks
        self.objective = PerExampleObjective(loaded, module, data.multi_label)

    def step(self, idx: "torch.Tensor") -> float:
        """One noisy step on the Poisson sample ``idx`` (empty: a noise-only step), in parts of at most
        ``part_size`` examples; returns the sample's summed loss."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)  # also drops the clipped sum of the previous step
        total = 0.0
        parts = list(_parts(idx, self.part_size, self.groups))
        if not parts:
            for p in self.params:  # the clipped sum of no per-sample gradients is zero; only noise is added
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        for k, (part, local) in enumerate(parts):
            inputs, y = self.data.batch(part, self.device)
            loss = self.objective(inputs, y)
            with warnings.catch_warnings():
                # frozen embeddings feed the first trained layer: torch notes that the full backward hooks
                # then fire on module outputs only, which is all Opacus' per-sample gradients need
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                loss.backward()
            self.objective.after_backward()
            if local is not None:
                _sum_grad_samples(self.params, local)
            total += float(loss.detach()) * len(y)
            if k < len(parts) - 1:
                self.optimizer.signal_skip_step(do_skip=True)
                self.optimizer.step()  # clips this part into p.summed_grad; no noise, no update
                self.optimizer.zero_grad(set_to_none=True)  # this part's per-sample gradients; the sum stays
        self.optimizer.step()
        return total

    def close(self) -> None:
        self.gsm._close()


def _parts(idx: "torch.Tensor", part_size: int, groups: "PatientGroups | None"):
    """A step's sample in parts: ``(rows, None)`` slices of at most ``part_size`` rows, or with ``groups``
    ``(rows, local_group)`` parts of whole groups (:meth:`PatientGroups.parts`)."""
    if len(idx) == 0:
        return iter(())
    if groups is None:
        return ((part, None) for part in idx.split(part_size))
    return groups.parts(idx, part_size)


def _sum_grad_samples(params: list, local: "torch.Tensor") -> None:
    """Per-group DP-SGD with per-sample gradients: replace each parameter's per-row gradients ``[B, ...]`` by their
    sums per group ``[g, ...]`` (``g_k = sum_{i in k} g_i``), which Opacus' optimizer then clips one per group."""
    import torch

    count = int(local.max()) + 1
    for p in params:
        gs = getattr(p, "grad_sample", None)
        if gs is None:
            continue
        if isinstance(gs, list):  # Opacus keeps a list only when batches accumulate; parts zero it in between
            gs = torch.cat(gs)
        p.grad_sample = torch.zeros((count, *gs.shape[1:]), dtype=gs.dtype, device=gs.device).index_add_(
            0, local.to(gs.device), gs)
