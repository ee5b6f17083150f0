"""What every fedclinic process needs to run: durable files, the blob store, the audit trail, logs,
failpoints, TOML configuration and the Prometheus endpoint. Imports nothing of fedclinic above :mod:`fedclinic.errors`.
"""
