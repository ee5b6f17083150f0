"""The fedclinic hospital agent: dials out to the aggregator, enforces the site policy, trains locally."""
