"""Sample-level DP at the site: plan a private task, admit it against the dataset's budget, charge each round
before its update leaves.

For a task whose spec asks for ``privacy.level = "sample"``:

1. :meth:`SitePrivacy.admit` (before anything is downloaded or trained) plans DP-SGD for the whole task —
   sampling rate ``q = batch_size / n`` (or the privacy section's logical batch / sample rate),
   ``local_epochs / q`` steps per round (or its ``steps_per_round``; ``plan_for_config``), the noise multiplier
   that meets the task's ``target_epsilon`` over all its rounds (or the epsilon a given ``noise_multiplier`` spends) —
   and reserves the planned epsilon in the privacy ledger. A task that would exceed the dataset's budget,
   or that asks for DP-SGD on a model without per-sample gradients, is refused with the reason.
2. After local training, :meth:`SitePrivacy.charge` adds the round's steps to the task's accountant (restored
   from the ledger, so a restart continues it), charges the new cumulative epsilon to the ledger, and only
   then returns the ``DpReport`` the update carries. If the charge is refused, the update is not sent.
   Charging the task's last round (``rounds.num_rounds``) finishes the task in the ledger: no further round
   exists, so the unspent rest of its reservation goes back to the dataset's budget.
Per-patient tasks (``privacy.unit = "patient"``): the units are the dataset's patients (its ``group_field``):
``q = batch_size / patients`` (``batch_size`` = expected patients per step), steps per round count epochs over
patients, and the ledger's record and the ``DpReport`` name the unit. A task asking for it on a dataset without
a ``group_field`` is refused with the reason (:meth:`SitePrivacy.admit`; the policy gate refuses it first).

3. :meth:`SitePrivacy.task_ended` finishes the task in the ledger when the agent learns that it will spend
   nothing more on it (cancelled or failed at the aggregator, or declined for good by this site).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fedclinic.errors import ConfigError
from fedclinic.privacy.accounting import TaskAccountant, TaskPlan, plan_for_config
from fedclinic.privacy.dp_sgd import DPSGD, check_supported
from fedclinic.proto import agent_pb2, task_pb2

from hospital_agent.config import DatasetEntry
from hospital_agent.privacy_ledger import PrivacyLedger


@dataclass(frozen=True)
class PrivatePlan:
    plan: TaskPlan
    max_grad_norm: float
    unit: str = "example"      # "example" (one row) | "patient" (q over patients; training samples whole patients)

    @property
    def dp_sgd(self) -> DPSGD:
        return DPSGD(self.plan.noise_multiplier, self.max_grad_norm, self.plan.sample_rate, self.plan.steps_per_round)


class SitePrivacy:
    def __init__(self, ledger_path: Path, datasets: dict[str, DatasetEntry]) -> None:
        self.ledger = PrivacyLedger(ledger_path)
        for entry in datasets.values():
            if entry.privacy_epsilon is not None and entry.privacy_delta is not None:
                self.ledger.set_budget(entry.name, entry.privacy_epsilon, entry.privacy_delta)

    def admit(self, task_id: str, spec: task_pb2.TaskSpec, num_examples: int, *, batch_size: int,
              local_epochs: int, num_patients: int | None = None) -> PrivatePlan | None:
        """None for a task without sample-level DP; else the plan, reserved in the ledger (raises
        ConfigError / BudgetExceeded with the reason otherwise). ``num_patients``: the dataset's patients when it
        declares a ``group_field`` (None otherwise); a per-patient task is planned over them."""
        pc = spec.privacy
        if pc.level != "sample":
            return None
        check_supported(spec.family, spec.architecture)
        unit = privacy_unit(spec)
        if unit == "patient":
            if not num_patients:
                raise ConfigError(f"the task protects each patient (privacy.unit = \"patient\") but dataset "
                                  f"{spec.dataset!r} declares no patient id column at this site; the site admin sets "
                                  f"group_field under [datasets.{spec.dataset}], or the task uses unit \"example\"")
            num_examples = num_patients
        plan = plan_for_config(pc, num_examples=num_examples, batch_size=batch_size, local_epochs=local_epochs,
                               rounds=spec.rounds.num_rounds)
        self.ledger.admit(spec.dataset, task_id, plan.planned_epsilon, plan.delta,
                          accountant=TaskAccountant(plan.accountant, plan.delta, unit=unit).to_json())
        return PrivatePlan(plan, pc.max_grad_norm or 1.0, unit)

    def charge(self, task_id: str, spec: task_pb2.TaskSpec, round_number: int, private: PrivatePlan
               ) -> agent_pb2.DpReport:
        """Charge one trained round to the ledger (before its update is written or sent); its DpReport."""
        plan = private.plan
        saved = self.ledger.accountant_state(spec.dataset, task_id)
        accountant = TaskAccountant.from_json(saved) if saved else TaskAccountant(plan.accountant, plan.delta,
                                                                                  unit=private.unit)
        nxt = accountant.with_steps(plan.noise_multiplier, plan.sample_rate, plan.steps_per_round)
        epsilon = nxt.epsilon()
        if not math.isfinite(epsilon):
            epsilon = float("inf")
        self.ledger.charge(spec.dataset, task_id, round_number, epsilon, accountant=nxt.to_json())
        if round_number >= spec.rounds.num_rounds:
            self.ledger.finish(spec.dataset, task_id)  # the last round: nothing more can be spent
        return agent_pb2.DpReport(epsilon=epsilon, delta=plan.delta, noise_multiplier=plan.noise_multiplier,
                                  max_grad_norm=private.max_grad_norm, accountant=plan.accountant,
                                  unit=private.unit)

    def open_tasks(self) -> list[str]:
        """The tasks holding an unspent reservation here (named on the work stream as it opens: hospital_agent.worker)."""
        return self.ledger.open_tasks()

    def task_ended(self, task_id: str) -> list[str]:
        """The task will spend nothing more at this site: release its unspent reservations (the datasets)."""
        return self.ledger.finish_task(task_id)


def privacy_unit(spec: task_pb2.TaskSpec) -> str:
    """The privacy unit a sample-level task asks for: "patient" or "example" (the default)."""
    return "patient" if spec.privacy.unit == "patient" else "example"
