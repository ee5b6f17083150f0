"""Unit tests, laid out like the code they test: ``<package>/`` for each subpackage of ``sdk/fedclinic`` (runtime,
transport, pki, spec, proto, data, assets, models, training, privacy, export, federation, strategies, codecs,
secagg), ``aggregator_service/`` and ``hospital_agent/`` for the two services, and ``deploy/`` for the deployment
files. Tests of the SDK's top-level modules (the public API, ``fedclinic.client``) and tests that span the SDK and
both services (service configuration, metrics endpoints) stay in this folder. Shared builders live in
``tests/helpers``."""
