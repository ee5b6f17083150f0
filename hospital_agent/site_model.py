"""The site's own model of a task: the aggregator's newest global model with this site's private modules in place.

Under a task with ``private_patterns`` (FedNER's private modules, fedclinic.training.private_modules) the global model
holds the private tensors' initial values; only the site has its trained ones, under
``WORK_DIR/private-modules/<task_id>.safetensors``. ``hospital-agent model export TASK OUT_DIR`` fetches the task's
final (or newest) global model over the agent's own mTLS channel, puts the site's private tensors into it and
writes a package folder that ``fedclinic export onnx`` and ``fedclinic.serving.bundle`` take, with ``site_model.json``
saying what it is made of. Nothing leaves the site: the private tensors are read from disk and written to
``OUT_DIR`` only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.transport.package import ModelPackage
from fedclinic.training.private_modules import PrivateStore
from fedclinic.pki import identity_from_pem
from fedclinic.proto import agent_pb2
from fedclinic.transport.rpc import explain_rpc_error
from fedclinic.transport.resume import receive_package_resuming
from hospital_agent.config import AgentConfig
from hospital_agent.connection import AgentChannel

PRIVATE_FOLDER = "private-modules"
PROVENANCE_FILE = "site_model.json"


def private_store_folder(work_dir: Path) -> Path:
    """Where the agent keeps its private modules, one file per task."""
    return Path(work_dir) / PRIVATE_FOLDER


@dataclass(frozen=True)
class SiteModel:
    package: ModelPackage
    global_model_hash: str
    private_round: int | None       # the round whose training produced the private values; None: none held
    private_tensors: tuple[str, ...]


def merge_private(global_package: ModelPackage, global_model_hash: str, store: PrivateStore, task_id: str) -> SiteModel:
    """``global_package`` with the site's stored private tensors of ``task_id`` in place of its own.

    IntegrityError (the global package is not changed) when a stored tensor is not in the model or has
    another shape or dtype: the file then belongs to another model."""
    stored = store.load(task_id)
    if stored is None:
        return SiteModel(global_package, global_model_hash, None, ())
    tensors, round_ = stored
    for name, arr in tensors.items():
        have = global_package.tensors.get(name)
        if have is None or have.shape != arr.shape or have.dtype != arr.dtype:
            what = "not in" if have is None else f"{arr.dtype}{list(arr.shape)} against {have.dtype}{list(have.shape)} in"
            raise IntegrityError(f"private tensor {name!r} of {store.path(task_id)} is {what} the task's global model; "
                                 "the file belongs to another model")
    merged = ModelPackage({**global_package.tensors, **{n: np.array(a) for n, a in tensors.items()}},
                          dict(global_package.files))
    return SiteModel(merged, global_model_hash, round_, tuple(sorted(tensors)))


def check_new_folder(out_dir: Path) -> None:
    """ConfigError unless ``out_dir`` is absent or an empty folder (a site model never overwrites anything)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} exists and is not an empty folder; choose a new folder for the site model")


def write_site_model(model: SiteModel, out_dir: Path, *, task_id: str, site: str) -> Path:
    """Save the package into ``out_dir`` (which must be empty or absent: nothing there is overwritten) with its
    provenance file."""
    out_dir = Path(out_dir)
    check_new_folder(out_dir)
    folder = model.package.save(out_dir)
    provenance = {"task_id": task_id, "site": site, "global_model_hash": model.global_model_hash,
                  "private_round": model.private_round, "private_tensors": list(model.private_tensors),
                  "note": ("global model with this site's private modules; they never left the site"
                           if model.private_tensors else "global model: this site holds no private modules for the task")}
    (folder / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return folder


def export_site_model(config_path: str, task_id: str, out_dir: str) -> int:
    """CLI body of ``hospital-agent model export``: fetch, merge, write; 0 on success, 1 or 2 with a message."""
    import grpc
    import sys



    out = Path(out_dir)
    try:
        config = AgentConfig.load(config_path)
        check_new_folder(out)  # before anything is fetched
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = PrivateStore(private_store_folder(config.work_dir))
    conn = AgentChannel(config.aggregator, config.tls, server_name=config.server_name)
    try:
        package, model_hash = receive_package_resuming(lambda point: conn.stub().FetchModel(agent_pb2.FetchModelRequest(
            task_id=task_id, latest=True, include_files=True, resume_tensor=point[0], resume_offset=point[1])))
        model = merge_private(package, model_hash, store, task_id)
        site = identity_from_pem(config.tls.cert.read_bytes()).name
        folder = write_site_model(model, out, task_id=task_id, site=site)
    except grpc.RpcError as exc:
        print(f"error: {explain_rpc_error(exc, config.aggregator)}", file=sys.stderr)
        return 1
    except (ConfigError, IntegrityError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    if model.private_tensors:
        print(f"wrote {folder}: global model {model_hash[:12]} with this site's private modules "
              f"({len(model.private_tensors)} tensors, trained in round {model.private_round})")
    else:
        print(f"wrote {folder}: global model {model_hash[:12]}; this site holds no private modules for task {task_id}")
    return 0
