"""One site's round on several devices: the same :func:`~fedclinic.federation.site_round.run_site_round`, run by
one process per device as a torch.distributed job (data-parallel, :mod:`fedclinic.training.data_parallel`).

:func:`run_site_round_distributed` is the one entry point (the hospital agent's training step and
``bench/gpu_check.py`` call it)::

    job dir  (private temp dir, 0700): model/ (the package files + the module's current tensors, safetensors),
             data.safetensors + data.json (the encoded training data), job.json (the round's settings)
    launcher = python -m fedclinic.federation.distributed_launch JOBDIR     (its own session)
             -> torch.distributed.launcher.api.elastic_launch(LaunchConfig(nproc_per_node = len(devices), c10d
                rendezvous on 127.0.0.1), entrypoint = python -m fedclinic.federation.distributed_worker JOBDIR)
    rank r   = init_process_group(gloo on CPU / nccl on CUDA, timeout) ; build the model from model/ ;
               run_site_round(...) with its shard of every global batch (codec raw)
    rank 0   -> result.safetensors (the trained send + private tensors), result.json (seed, steps, loss, metrics),
                progress.json after every step (read here for progress and cancellation)
    here     : the trained tensors into ``loaded``, delta = trained - before, the task's codec (with the caller's
               error feedback): the update is computed once, from rank 0's replica, and sent once

Nothing crosses a process boundary as a pickle: files are safetensors and JSON; the launcher starts its workers
as commands (``subprocess``), so torch elastic passes them no Python objects and collects no return value (the
rendezvous and the collectives go over loopback TCP: torch's TCPStore and gloo/NCCL). A worker that fails writes
``error-<rank>.json`` and exits non-zero; torch elastic then stops the other ranks and the launcher exits non-zero:
the round fails with the worker's error. A rank that hangs fails its peers' collectives after ``collective_timeout``;
``deadline`` bounds the whole launch; cancelling (``inp.progress`` raising) stops the launcher (SIGTERM, then
SIGKILL of its session) and re-raises. Workers die with the launcher (``PR_SET_PDEATHSIG``).

Sharding (``sharding``, :func:`check_sharding`): ``"none"`` (default) -- every rank holds the whole model and the
gradients are all-reduced (:mod:`fedclinic.training.data_parallel`); ``"fsdp"`` -- every rank holds ``1/W`` of the
model (FSDP2 ``fully_shard`` per transformer block, :mod:`fedclinic.training.fully_sharded`), for causal LMs too
large for one device; the same global batch and update, gathered once to rank 0 for the result.

Devices: ``["cpu", "cpu"]`` is two CPU processes (gloo); ``["cuda:0", "cuda:1"]`` one process per GPU (NCCL);
``"all"`` every visible GPU, or one CPU process where there is none (:func:`resolve_devices`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from fedclinic import errors
from fedclinic.errors import ConfigError, FedclinicError
from fedclinic.federation.site_round import SiteRoundInput, SiteRoundResult, encode_update

if TYPE_CHECKING:  # pragma: no cover
    from fedclinic.models import LoadedModel

#: encoded-data classes a job may carry (module, class): anything else is refused, nothing is imported by name
DATA_CLASSES = {
    "EncodedData": "fedclinic.models.base",
    "TokenData": "fedclinic.models.token_classification",
    "QAData": "fedclinic.models.causal_lm",
    "ImageTextData": "fedclinic.models.image_text",
    "FeatureData": "fedclinic.models.feature_classification",
}
log = logging.getLogger("fedclinic.federation")

#: the most processes one site round may start
MAX_PROCESSES = 64
_DEVICE = re.compile(r"cpu|cuda:\d{1,3}")
#: how a distributed round holds the model: "none" (a replica per process) or "fsdp" (sharded, FSDP2)
SHARDINGS = ("none", "fsdp")


def check_sharding(value: Any, where: str = "sharding") -> str:
    """The ``sharding`` setting (no torch): one of :data:`SHARDINGS`; ConfigError says what to write."""
    if value not in SHARDINGS:
        raise ConfigError(f'{where} must be "none" (each process holds the whole model) or "fsdp" (each holds a '
                          f"shard: causal LMs too large for one device); got {value!r}")
    return str(value)


def check_devices(value: Any, where: str = "devices") -> list[str] | str:
    """The syntax of a ``devices`` setting (no torch): ``"all"``, or a non-empty list of ``"cpu"`` (one CPU
    process each) or of distinct ``"cuda:N"``, not both. ConfigError says what is wrong and what to write."""
    if value == "all":
        return "all"
    if not isinstance(value, list) or not value or not all(isinstance(d, str) for d in value):
        raise ConfigError(f'{where} must be "all" or a list of devices such as ["cuda:0", "cuda:1"] or, for N CPU '
                          f'processes, ["cpu", "cpu"]; got {value!r}')
    devices = [d.strip().lower() for d in value]
    bad = [d for d in devices if not _DEVICE.fullmatch(d)]
    if bad:
        raise ConfigError(f'{where}: unknown device(s) {bad}; each entry is "cpu" or "cuda:N" (e.g. "cuda:0")')
    kinds = {d.split(":")[0] for d in devices}
    if len(kinds) > 1:
        raise ConfigError(f"{where} mixes CPU and GPU processes ({devices}); list only cuda:N devices or only "
                          '"cpu" entries')
    if kinds == {"cuda"} and len(set(devices)) != len(devices):
        raise ConfigError(f"{where} names a GPU twice ({devices}); one process per GPU")
    if len(devices) > MAX_PROCESSES:
        raise ConfigError(f"{where} asks for {len(devices)} processes; at most {MAX_PROCESSES}")
    return devices


def resolve_devices(value: list[str] | str) -> list[str]:
    """The processes a ``devices`` setting starts here: ``"all"`` -> every visible GPU (``cuda:0..``), or
    ``["cpu"]`` (one process, the single-process round) where torch sees none; a list of GPUs is checked against
    the visible ones (ConfigError naming CUDA_VISIBLE_DEVICES)."""
    import torch  # lazy: the agent reads its config without torch

    devices = check_devices(value)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices == "all":
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    wanted = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
    if wanted and not count:
        raise ConfigError(f"devices {devices} name GPUs but torch sees none here (torch {torch.__version__}); "
                          'use "all" (falls back to the CPU), ["cpu", ...] or install a CUDA build of torch')
    missing = [f"cuda:{i}" for i in wanted if i >= count]
    if missing:
        raise ConfigError(f"devices name {missing} but only {count} GPU(s) are visible (cuda:0..cuda:{count - 1}); "
                          "check CUDA_VISIBLE_DEVICES or list fewer devices")
    return devices


def single_process_reason(loaded: "LoadedModel", inp: SiteRoundInput) -> str | None:
    """Why this round runs in one process even though several devices are configured (None: it can run
    data-parallel): SAFL's layer selection, kept optimizer state, the step fused into the backward pass, per-patient DP-SGD and DP-SGD through Opacus'
    hooks (fedclinic.privacy.dp_sgd.distributed_problem) are not sharded yet."""
    if inp.safl is not None:
        return "SAFL layer selection runs in one process"
    if inp.train.optimizer_state == "keep":
        return 'optimizer_state = "keep" runs in one process'
    if inp.train.step_in_backward:  # each rank would step before the gradients are all-reduced
        return "step_in_backward (the optimizer step fused into the backward pass) runs in one process"
    if inp.dp is not None:
        from fedclinic.privacy.dp_sgd import distributed_problem  # lazy: torch

        return distributed_problem(loaded, list(inp.send) + list(inp.private), inp.dp_groups)
    return None


def fsdp_problem(loaded: "LoadedModel", inp: SiteRoundInput) -> str | None:
    """Why this round cannot train sharded (``sharding = "fsdp"``; None: it can):
    :func:`fedclinic.training.fully_sharded.sharding_problem` for the model's family and the round's settings."""
    from fedclinic.training.fully_sharded import sharding_problem, tied_output  # lazy: numpy, torch.distributed

    return sharding_problem(loaded.family, tied=tied_output(loaded.module), dp=inp.dp is not None,
                            measure_gradient_change=inp.train.measure_gradient_change)


def run_site_round_distributed(loaded: "LoadedModel", data: object, inp: SiteRoundInput, *,
                               files: Mapping[str, bytes], devices: Sequence[str], threads: int = 0,
                               collective_timeout: float = 600.0, deadline: float = 86_400.0,
                               gradient_checkpointing: bool = False, sharding: str = "none",
                               workdir: str | os.PathLike[str] | None = None) -> SiteRoundResult:
    """Run one site round (:func:`~fedclinic.federation.site_round.run_site_round`, same inputs, same result) as
    ``len(devices)`` data-parallel processes on ``devices`` (from :func:`resolve_devices`; at least 2).

    ``loaded`` holds the global model (and the site's private values) on entry and the trained tensors on return,
    as with ``run_site_round``; ``files`` are the model package's files (tokenizer, ``fedclinic_model.json``, ...:
    ``ModelPackage.files``) from which each process builds the model. ``threads``: CPU threads of each process
    (0: this host's cores shared between them). ``collective_timeout``: seconds a collective waits for a silent
    rank before the round fails; ``deadline``: seconds the whole launch may take; ``gradient_checkpointing``:
    recompute activations in the backward pass (:func:`fedclinic.models.base.enable_gradient_checkpointing`: Hugging
    Face models; the same gradients for less memory). ``sharding``: :data:`SHARDINGS` (``"fsdp"``: ConfigError before
anything starts for a round it cannot shard, :func:`fedclinic.training.fully_sharded.sharding_problem`). ``workdir``: where the private
    job directory is made (default: the system's temp dir); it is removed afterwards. Raises the worker's error
    (ConfigError, DatasetError, IntegrityError, else FedclinicError) when a process fails, FedclinicError on the
    deadline, and whatever ``inp.progress`` raises (cancellation) after stopping the processes."""
    from fedclinic.models import load_tensors, module_tensors
    from fedclinic.models.base import ModuleTensorView
    from fedclinic.models.causal_lm_module import tied_aliases
    from fedclinic.runtime.cpu_cores import cores_per_process
    from fedclinic.training.private_modules import outgoing_problems
    from fedclinic.training.trainer import TrainResult, compute_delta
    from fedclinic.transport.package import ModelPackage

    devices = list(devices)
    if len(devices) < 2:
        raise ConfigError(f"a distributed round needs at least 2 devices, got {devices}; run run_site_round")
    leaking = outgoing_problems(list(inp.send), list(inp.private))
    if leaking:
        raise errors.IntegrityError("refusing to send: " + "; ".join(leaking))
    reason = single_process_reason(loaded, inp)
    if reason:
        raise ConfigError(f"this round cannot run on several devices: {reason}")
    if check_sharding(sharding) == "fsdp":
        problem = fsdp_problem(loaded, inp)
        if problem:
            raise ConfigError(f'sharding = "fsdp" cannot train this round: {problem}; use sharding = "none"')
    if inp.private and inp.private_values is not None:
        load_tensors(loaded.module, dict(inp.private_values))
    job = Path(tempfile.mkdtemp(prefix="fedclinic-ddp-", dir=workdir))  # mkdtemp: mode 0700, this user only
    try:
        aliases = set(tied_aliases(loaded.module))  # a tied output embedding is stored once, as in the package
        names = [n for n in loaded.module.state_dict() if n not in aliases]
        ModelPackage(tensors=module_tensors(loaded.module, names), files=dict(files)).save(job / "model")
        write_data(data, job)
        _write_json(job / "job.json", {
            "task_id": inp.task_id, "site": inp.site, "round": int(inp.round), "send": list(inp.send),
            "private": list(inp.private), "train": _jsonable(asdict(inp.train)),
            "dp": None if inp.dp is None else asdict(inp.dp), "dp_entropy": inp.dp_entropy,
            "devices": devices, "threads": int(threads) or cores_per_process(len(devices)),
            "collective_timeout": float(collective_timeout), "gradient_checkpointing": bool(gradient_checkpointing),
            "sharding": sharding})
        _launch(job, len(devices), inp.progress, deadline)
        result = json.loads((job / "result.json").read_text())
        trained = _read_tensors(job / "result.safetensors")
    finally:
        shutil.rmtree(job, ignore_errors=True)
    send = list(result["send"])
    # as run_site_round: the delta against the agent's cache when the caller gives it, one trained tensor at a time
    before = inp.base if inp.base is not None else module_tensors(loaded.module, send)
    load_tensors(loaded.module, trained)
    delta = compute_delta(before, ModuleTensorView(loaded.module), send)
    update, feedback = encode_update(delta, send, inp)
    train = TrainResult(**result["train"])
    return SiteRoundResult(seed=int(result["seed"]), send=send, delta=delta, update=update, train=train,
                           metrics={k: float(v) for k, v in result["metrics"].items()},
                           private_values=module_tensors(loaded.module, list(inp.private)) if inp.private else {},
                           selection=None, feedback=feedback)


# ------------------------------------------------------------------------------------------------------------
# the launch


def _launch(job: Path, processes: int, progress, deadline: float) -> None:
    """Run the launcher on ``job`` until it exits; relay rank 0's progress; stop it on cancel or deadline."""
    log = open(job / "launcher.log", "wb")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fedclinic.federation.distributed_launch", str(job),
                             str(processes)], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    ends = time.monotonic() + deadline
    last = None
    try:
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > ends:
                raise FedclinicError(f"the distributed round did not finish within {deadline:.0f} s; its processes "
                                     "were stopped")
            last = _relay_progress(job, progress, last)
        _relay_progress(job, progress, last)
    except BaseException:
        _stop(proc)
        raise
    finally:
        log.close()
    if proc.returncode != 0 or not (job / "result.json").exists():
        raise _failure(job, proc.returncode)


def _relay_progress(job: Path, progress, last):
    if progress is None:
        return last
    try:
        now = json.loads((job / "progress.json").read_text())
    except (OSError, ValueError):
        return last
    if now != last:
        progress(int(now["step"]), int(now["total"]), float(now["loss"]))
    return now


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the launcher (torch elastic stops its workers), SIGKILL its session after 10 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _failure(job: Path, code: int | None) -> FedclinicError:
    """The round's error: the first failed rank's when it is one of fedclinic's (its class and message, as the
    one-process round raises it), else a FedclinicError naming the error's type only -- its message and the
    processes' output go to this host's log (``fedclinic.federation``), never into a reason sent elsewhere."""
    found = []
    for path in job.glob("error-*.json"):
        try:
            found.append((json.loads(path.read_text()), path.stat().st_mtime))
        except (OSError, ValueError):
            continue
    # the cause first: one of fedclinic's errors, else the earliest (the other ranks then fail in a collective)
    found.sort(key=lambda e: (not _fedclinic_error(e[0].get("type")), e[1]))
    try:
        tail = (job / "launcher.log").read_text(errors="replace")[-4000:]
    except OSError:
        tail = ""
    if found:
        err = found[0][0]
        cls = _fedclinic_error(err.get("type"))
        if cls is not None and cls is not FedclinicError:
            try:
                return cls(str(err.get("message")))
            except TypeError:  # an error class with required keyword arguments
                pass
        log.error("distributed round failed on rank %s: %s: %s\n%s", err.get("rank"), err.get("type"),
                  err.get("message"), tail)
        return FedclinicError(f"the distributed round failed on rank {err.get('rank')} with {err.get('type')} "
                              "(its message and the processes' output are in this site's log)")
    log.error("distributed round's launcher exited with code %s\n%s", code, tail)
    return FedclinicError(f"the distributed round's processes stopped (launcher exit code {code}) without a result; "
                          "their output is in this site's log")


def _fedclinic_error(name: Any) -> type | None:
    cls = getattr(errors, str(name), None)
    return cls if isinstance(cls, type) and issubclass(cls, FedclinicError) else None


# ------------------------------------------------------------------------------------------------------------
# job files (safetensors + JSON, never pickle)


def write_data(data: object, folder: Path) -> None:
    """``data`` (an encoded-data dataclass of :data:`DATA_CLASSES`) as ``data.safetensors`` (its tensors) and
    ``data.json`` (its class and flags); fields that are neither (evaluation-only lists) are not carried."""
    import torch
    from safetensors.torch import save_file

    name = type(data).__name__
    if DATA_CLASSES.get(name) != type(data).__module__:
        raise ConfigError(f"a distributed round cannot carry training data of type {type(data).__module__}.{name}")
    tensors, flags = {}, {}
    for f in fields(data):
        value = getattr(data, f.name)
        if isinstance(value, torch.Tensor):
            tensors[f.name] = value.contiguous()
        elif isinstance(value, (bool, int, float, str)):
            flags[f.name] = value
    save_file(tensors, str(folder / "data.safetensors"))
    _write_json(folder / "data.json", {"class": name, "flags": flags})


def read_data(folder: Path) -> object:
    """The encoded data :func:`write_data` wrote."""
    import importlib

    from safetensors.torch import load_file

    meta = json.loads((folder / "data.json").read_text())
    name = meta["class"]
    if name not in DATA_CLASSES:
        raise ConfigError(f"unknown training data class {name!r} in the job")
    cls = getattr(importlib.import_module(DATA_CLASSES[name]), name)
    return cls(**load_file(str(folder / "data.safetensors")), **meta["flags"])


def _read_tensors(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def train_config_from_job(doc: Mapping[str, Any], device: str):
    """The job's TrainConfig for one rank's device (tuples restored)."""
    from fedclinic.training.trainer import TrainConfig

    kw = dict(doc)
    kw["pos_weight"] = tuple(kw.get("pos_weight", ()))
    known = {f.name for f in fields(TrainConfig)}
    return replace(TrainConfig(**{k: v for k, v in kw.items() if k in known and k != "device"}), device=device)


__all__ = ["DATA_CLASSES", "MAX_PROCESSES", "SHARDINGS", "check_devices", "check_sharding", "fsdp_problem", "read_data", "resolve_devices",
           "run_site_round_distributed", "single_process_reason", "train_config_from_job", "write_data"]
