"""How shard_module wraps a causal LM (FSDP2 on a 1-process gloo group in this process, no launch): each decoder
layer, the base model and the output layer become FSDP modules holding DTensor parameters, a tied output layer is
refused, and full_tensors gives back the whole tensors. (The 2-process equality with the
1-process round: tests/unit/federation/test_distributed_round.py under `make test-distributed`.)"""

from __future__ import annotations

import numpy as np
import pytest

from fedclinic.errors import ConfigError


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in memory: no port, no peer
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_llama_blocks_base_and_head_are_sharded_and_gathered_back(one_process_group):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fedclinic.models import build_model, module_tensors
    from fedclinic.training.fully_sharded import full_tensors, shard_module
    from tests.helpers import qa_models

    module = build_model(qa_models.package(config=qa_models.TINY_LLAMA)).module
    before = module_tensors(module)
    assert shard_module(module) == 2
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    assert [type(m).__name__ for m in sharded] == ["FSDPLlamaModel", "FSDPLlamaDecoderLayer", "FSDPLlamaDecoderLayer",
                                                   "FSDPLinear"]  # lm_head: its own root
    assert all(isinstance(p, DTensor) for p in module.parameters())
    after = full_tensors(module, list(before), rank=0)
    assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in before)
    assert full_tensors(module, list(before)[:1], rank=1) == {}  # only rank 0 keeps the gathered tensors


def test_a_tied_output_layer_is_refused(one_process_group):
    from fedclinic.models import build_model
    from fedclinic.training.fully_sharded import shard_module, tied_output
    from tests.helpers import qa_models

    module = build_model(qa_models.package()).module  # GPT-2: lm_head.weight is wte.weight
    assert tied_output(module) and not tied_output(build_model(qa_models.package(config=qa_models.TINY_LLAMA)).module)
    # as two FSDP roots the head would keep the unsharded original weight (measured: 0.57 relative off the 1-process
    # update on 2 processes); as one group of both modules FSDP refuses it as a root
    with pytest.raises(ConfigError, match="ties its output layer"):
        shard_module(module)


def test_a_model_without_blocks_is_refused():
    import torch

    with pytest.raises(ConfigError, match='sharding = "none"'):
        from fedclinic.training.fully_sharded import shard_module

        shard_module(torch.nn.Linear(2, 2))
