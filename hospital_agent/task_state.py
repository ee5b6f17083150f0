"""What the agent keeps warm for one task across its rounds, and how a round is interrupted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

if TYPE_CHECKING:
    from hospital_agent.site_privacy import PrivatePlan


class Stopped(Exception):
    """The agent is shutting down (SIGTERM) or the task was cancelled."""


@dataclass
class TaskState:
    """One task's model, data and site-kept state, in memory across its rounds."""

    loaded: object = None                       # fedclinic.models.LoadedModel
    tensor_sha: dict[str, str] = field(default_factory=dict)
    #: the global model the module was last synced to, read from the tensor cache a tensor at a time
    #: (hospital_agent.model_sync.CachedTensors); the site round's delta is taken against it
    global_tensors: Mapping[str, np.ndarray] | None = None
    raw_train: list | None = None               # validated rows: fedclinic.data.text.Example or data_ner.NerExample
    raw_eval: list | None = None
    #: the patient id of each training row (per-patient DP tasks only; data: kept in memory, never logged or sent)
    patient_ids: list[str] | None = None
    train_data: object = None                   # fedclinic.training.trainer.EncodedData
    #: the model package's files (tokenizer, fedclinic_model.json, ...): a multi-device round's processes build the
    #: model from them
    package_files: dict[str, bytes] | None = None
    eval_data: object = None
    #: local optimizer moments by tensor name, for tasks with optimizer_state = "keep" (memory only: an agent
    #: restart starts them afresh, as "reset" would)
    optimizer_state: dict | None = None
    #: the task's DP-SGD plan (sample-level privacy), admitted to the ledger once
    private: "PrivatePlan | None" = None
    #: the site's own values of the task's private tensors (private_patterns), as trained in its last round;
    #: None until read from the private store (or taken from the global model on a site's first round)
    private_values: dict[str, np.ndarray] | None = None
    #: the tokenizer coverage (``tokenizer_unk_rate``) went out with this process's first update of the task
    coverage_reported: bool = False
