"""The launcher process of a distributed site round: ``python -m fedclinic.federation.distributed_launch JOBDIR N``.

Runs torch's elastic launcher (what ``torchrun`` runs) for one node of ``N`` workers, each the command
``python -m fedclinic.federation.distributed_worker JOBDIR`` (a subprocess, so nothing is pickled), with a c10d
rendezvous on 127.0.0.1 (a free port, no restarts) and the workers' logs in ``JOBDIR/logs``. Exits 0 when every
worker did, 1 otherwise (torch elastic stops the others when one fails). Started and stopped by
:mod:`fedclinic.federation.distributed_round`; on SIGTERM torch elastic stops the workers.
"""

from __future__ import annotations

import socket
import sys
import uuid
from pathlib import Path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    job, processes = Path(argv[0]), int(argv[1])
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=f"fedclinic-{uuid.uuid4().hex}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", rdzv_configs={"timeout": 120},
        max_restarts=0, monitor_interval=0.1, local_addr="127.0.0.1",
        logs_specs=DefaultLogsSpecs(log_dir=str(job / "logs")), shutdown_timeout=5)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "fedclinic.federation.distributed_worker", str(job))
    except ChildFailedError as exc:
        print(f"distributed round failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
