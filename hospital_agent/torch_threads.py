"""The agent's torch CPU thread pools: ``torch_threads`` in agent.toml, applied once before any training.

``torch_threads = N`` (N >= 1) runs torch's intra-op pool (``torch.set_num_threads``) and its inter-op pool
(``torch.set_num_interop_threads``) with N threads each; 0 (the default) means every core this process may run
on (fedclinic.runtime.cpu_cores.available_cores). Several agents sharing a host should split its cores
(``fedclinic.federation.local_federation.LocalFederation`` gives each of its N agents ``max(1, cores // N)``):
torch's own default is one thread per core in every process, so three agents on two cores would run six
threads fighting over two cores.
"""

from __future__ import annotations

import structlog

from fedclinic.runtime.cpu_cores import available_cores

log = structlog.get_logger("fedclinic.agent")


def resolve_threads(requested: int) -> int:
    """The thread count ``torch_threads = requested`` means: ``requested`` when >= 1, else every available core."""
    return requested if requested >= 1 else available_cores()


def apply_torch_threads(requested: int) -> tuple[int, int]:
    """Set torch's intra-op and inter-op pools to ``resolve_threads(requested)`` threads and log the result;
    returns ``(intra_op, inter_op)`` as torch reports them. The inter-op pool can be sized only before torch
    first uses it: a second call keeps the size the first one set (and says so in the log line)."""
    import torch  # heavy: only the `run` command, which trains, imports torch here

    threads = resolve_threads(requested)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set, or inter-op work has started: the pool keeps its size
        pass
    intra, inter = torch.get_num_threads(), torch.get_num_interop_threads()
    log.info("torch threads", threads=intra, interop_threads=inter, configured=requested or "all cores",
             cores=available_cores())
    return intra, inter


__all__ = ["apply_torch_threads", "resolve_threads"]
