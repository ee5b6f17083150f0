"""Verifiable rounds: each site's signed round statement, and checking a task's public records against them.

- :mod:`~fedclinic.verification.round_statement`: what a site signs about a round (torch-free; the agent signs it,
  the aggregator checks it against the update it arrives with);
- :mod:`~fedclinic.verification.records`: a task's public records as read from the aggregator (``GetTaskRecords``)
  and the models and blobs they name;
- :mod:`~fedclinic.verification.recompute`: a round's model recomputed from the committed updates or a secure sum;
- :mod:`~fedclinic.verification.verifier`: every check of ``fedclinic task verify`` and its report;
- :mod:`~fedclinic.verification.site_records`: the records as a site reads them with its agent certificate.
"""
