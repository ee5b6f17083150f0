"""What a task is and what it produced: the task definition, the one validator of its ``TaskSpec`` proto
(:mod:`fedclinic.spec.validation`, used by ``Task``, the aggregator and the agents), the torch-free tables it
checks against, which tensors a task trains and sends, and the model card. No torch: the aggregator imports
this package.
"""
