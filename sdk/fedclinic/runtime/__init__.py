"""What every fedclinic process needs to run: durable files, the blob store, the audit trail, logs,
failpoints, TOML configuration, the Prometheus endpoint and the safetensors reader. Imports nothing of fedclinic above :mod:`fedclinic.errors`.
"""
