"""Privacy accounting for DP-SGD: the sites' path to :mod:`fedclinic.strategies.dp_accounting`.

The accounting is torch-free math shared by both sides, so it lives below the strategies (whose ``dp-fedavg``
reports its epsilon with it); DP-SGD at a site (:mod:`fedclinic.privacy.dp_sgd`) plans and charges its budget
with the same functions, re-exported here.
"""

from __future__ import annotations

from fedclinic.strategies.dp_accounting import (
    ACCOUNTANTS,
    TaskAccountant,
    TaskPlan,
    epsilon_of,
    noise_for_target,
    plan_for_config,
    plan_task,
)

__all__ = ["ACCOUNTANTS", "TaskAccountant", "TaskPlan", "epsilon_of", "noise_for_target", "plan_for_config",
           "plan_task"]
