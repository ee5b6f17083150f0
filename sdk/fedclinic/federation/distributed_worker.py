"""One rank of a distributed site round: ``python -m fedclinic.federation.distributed_worker JOBDIR``.

Started by torch elastic (:mod:`fedclinic.federation.distributed_launch`) with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. It joins the process group (gloo on the CPU, NCCL on a
GPU; collectives time out after the job's ``collective_timeout``), builds the model from ``JOBDIR/model``, reads
the encoded data, and runs :func:`fedclinic.federation.site_round.run_site_round` inside a
:class:`fedclinic.training.data_parallel.DataParallel` group (codec raw: the caller encodes the update). Rank 0
writes ``progress.json`` after every step and ``result.safetensors`` + ``result.json`` at the end. Any failure
writes ``error-<rank>.json`` (the error's class name and message) and exits 1.

With the job's ``sharding`` = ``"fsdp"`` the model is sharded after it is built
(:func:`fedclinic.training.fully_sharded.shard_module`), trained inside a
:class:`~fedclinic.training.fully_sharded.ShardedDataParallel` group (the round's seed and training, as
``run_site_round`` runs them for a round without DP-SGD or SAFL), and its trained tensors are gathered once to rank 0
(:func:`~fedclinic.training.fully_sharded.full_tensors`) and written as above.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the launcher) dies, so a killed launcher leaves no rank."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def run(job: Path, rank: int, local_rank: int) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.numpy import save_file

    from fedclinic.federation.distributed_round import read_data, train_config_from_job
    from fedclinic.federation.site_round import SiteRoundInput, run_site_round, site_seed
    from fedclinic.models import build_model, module_tensors
    from fedclinic.models.base import enable_gradient_checkpointing
    from fedclinic.privacy.dp_sgd import DPSGD
    from fedclinic.training import data_parallel, fully_sharded
    from fedclinic.training.trainer import train_local
    from fedclinic.transport.package import ModelPackage

    spec = json.loads((job / "job.json").read_text())
    device = spec["devices"][local_rank]
    torch.set_num_threads(int(spec["threads"]))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            timeout=timedelta(seconds=float(spec["collective_timeout"])))
    try:
        loaded = build_model(ModelPackage.load(job / "model"))
        if spec.get("gradient_checkpointing"):
            enable_gradient_checkpointing(loaded.module)
        sharded = spec.get("sharding") == "fsdp"
        if sharded:
            fully_sharded.shard_module(loaded.module)
        data = read_data(job)

        def progress(step: int, total: int, loss: float) -> None:
            tmp = job / "progress.tmp"
            tmp.write_text(json.dumps({"step": step, "total": total, "loss": loss}))
            os.replace(tmp, job / "progress.json")

        inp = SiteRoundInput(task_id=spec["task_id"], site=spec["site"], round=int(spec["round"]),
                             send=list(spec["send"]), private=list(spec["private"]),
                             train=train_config_from_job(spec["train"], device),
                             dp=DPSGD(**spec["dp"]) if spec["dp"] else None, dp_entropy=spec["dp_entropy"],
                             progress=progress if rank == 0 else None)
        if sharded:  # run_site_round's seed and training; the caller checked the names and computes the delta
            send = list(inp.send)
            cfg = replace(inp.train, seed=site_seed(inp.train.seed, inp.round, inp.site))
            with data_parallel.active(fully_sharded.ShardedDataParallel()):
                tr = train_local(loaded, data, cfg, trainable=send + list(inp.private), progress=inp.progress)
            seed, metrics = cfg.seed, tr.reported_metrics()
            trained = fully_sharded.full_tensors(loaded.module, send + list(inp.private), rank)
        else:
            with data_parallel.active(data_parallel.DataParallel()):
                out = run_site_round(loaded, data, inp)
            send, tr, seed, metrics = out.send, out.train, out.seed, out.metrics
            trained = module_tensors(loaded.module, send + list(inp.private)) if rank == 0 else {}
        if rank == 0:
            save_file(trained, str(job / "result.safetensors"))
            doc = {"seed": seed, "send": send, "metrics": metrics,
                   "train": {"num_samples": tr.num_samples, "steps": tr.steps, "loss": tr.loss,
                             "gradient_change_rate": tr.gradient_change_rate}}
            tmp = job / "result.tmp"
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, job / "result.json")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    _die_with_parent()
    job = Path(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    try:
        run(job, rank, int(os.environ.get("LOCAL_RANK", "0")))
    except BaseException as exc:  # noqa: BLE001 - reported to the agent as the round's error, then re-raised
        err = {"rank": rank, "type": type(exc).__name__, "message": str(exc)}
        (job / f"error-{rank}.json").write_text(json.dumps(err))
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
