"""Task specs (the ``TaskSpec`` proto) as every part checks them: :mod:`fedclinic.spec.validation`."""

from fedclinic.spec.validation import (check_spec, definition_problems, privacy_problems, rounds_problems,
                                       spec_problems, strategy_of, submit_problems)

__all__ = ["check_spec", "definition_problems", "privacy_problems", "rounds_problems", "spec_problems",
           "strategy_of", "submit_problems"]
