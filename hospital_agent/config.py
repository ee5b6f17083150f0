"""Agent configuration (``agent.toml`` + ``FEDCLINIC_AGENT_*`` environment overrides) and site policy.

Example::

    aggregator = "aggregator.example.org:7443"   # a hot-standby pair: ["agg-0.example.org:7443", "agg-1...:7443"]
    work_dir = "/var/lib/hospital-agent"
    device = "auto"            # "cpu", "cuda", "cuda:1"; auto = CUDA when present
    # devices = ["cuda:0", "cuda:1"]   # optional: train every round data-parallel, one process per device
                               # (torch.distributed: NCCL on GPUs, gloo for ["cpu", "cpu"] = 2 CPU processes);
                               # "all" = every visible GPU (one CPU process where there is none); replaces device
    # sharding = "none"                # with devices: "fsdp" shards a causal LM across them (each holds 1/N)
    # distributed_timeout = 600        # seconds a process of a multi-device round waits for a silent peer
    # gradient_checkpointing = false   # recompute activations in the backward pass (less GPU memory, ~30% more time)
    mixed_precision = false    # allow autocast on CUDA when a task asks for it
    torch_threads = 0          # torch CPU threads (intra- and inter-op); 0 = every core (split them between
                               # agents sharing a host)
    preload_training_stack = true   # import the model stack at start-up, not in the first round
    metrics_address = "127.0.0.1:9465"   # optional: Prometheus endpoint (HTTP GET /metrics); off when absent

    [tls]
    cert = "/etc/hospital-agent/site-a.crt"
    key = "/etc/hospital-agent/site-a.key"
    ca = "/etc/hospital-agent/ca.crt"

    [datasets.notes]           # name used by tasks
    path = "/data/notes/train.jsonl"
    format = "jsonl"           # jsonl | csv | tsv | conll (default: from the file extension)
    text_field = "text"
    label_field = "label"
    eval_path = "/data/notes/val.jsonl"   # optional: the site's held-out split, used to evaluate global models
    # entities_field = "entities"          # NER JSONL ({"text", "entities": [{"start", "end", "label"}]})
    # question_field = "question"          # question-answering JSONL ({"question", "answer", "context"?})
    # answer_field = "answer"
    # context_field = "context"
    # image_field = "image"                # image + text manifests (CSV/TSV/JSONL: image path, text, labels)
    # tokenizer_sha256 = "..."             # optional: the only tokenizer.json (sha256) tasks on it may use
    # privacy_epsilon = 8.0                # the dataset's privacy budget over all DP tasks (with privacy_delta);
    # privacy_delta = 1e-5                 # without one, tasks asking for sample-level DP on it are refused
    # group_field = "patient_id"           # the column holding each row's patient id: enables per-patient DP tasks

    [datasets.cdw]             # rows read where they live (fedclinic.data.sources, docs/hospital-it.md):
    source = "omop"            # "sql" (a SELECT + column names) | "omop" | "fhir" (a bulk NDJSON export);
    engine = "postgresql"      # a Parquet file is path = "x.parquet" with the columns above
    dsn = "host=cdw.hospital.local dbname=cdw user=fedclinic_reader"
    password_file = "/etc/hospital-agent/cdw-password"   # or password_env; never a password in this file
    [datasets.cdw.labels]      # condition_concept_id -> label
    "201826" = "diabetes"

    [policy]
    allowed_families = ["text-classification"]
    allowed_datasets = ["notes"]
    # secure_aggregation_min_cohort = 3   # fewest sites this site masks its update with (>= 3)
    # approval = "manual"                 # a new task waits for `hospital-agent tasks approve ID` (default "auto")
    # require_signed_tasks = true         # run only tasks their owner signed (default); false also runs unsigned ones
    # allowed_owners = ["dr-lee"]         # train only for these task owners (signers); default: any owner
    # signed_task_max_age_days = 7        # do not start a task signed longer ago than this (default: no limit)
    # require_secure_aggregation = true   # decline tasks that do not enable secure aggregation
    # require_dp = true                   # decline tasks without sample-level differential privacy
    # min_cohort = 5                      # decline tasks whose rounds may close with fewer sites than this
    # max_epsilon = 8.0                   # decline tasks whose target epsilon is larger (or that declare none)
    # publish_updates_allowed = true      # take part in tasks that show each site's update to their owner
    # min_cell_rows = 10                  # evaluation/statistics cells of fewer rows are withheld (default 10)
    # allow_evaluation = false            # do not evaluate models for others (final model, "evaluate" tasks)
    # allow_statistics = false            # do not answer "statistics" tasks

The site policy is enforced here, at the hospital, whatever the aggregator asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from fedclinic.data.sources import SOURCE_KEYS, SOURCE_KINDS, DataSource, ParquetSource, parse_source
from fedclinic.data.sources.database import refuse_password
from fedclinic.errors import ConfigError
from fedclinic.runtime.metrics_endpoint import MetricsAddress, parse_metrics_address
from fedclinic.proto import task_pb2
from fedclinic.transport.addresses import parse_addresses
from fedclinic.transport.rpc import TlsFiles
from fedclinic.runtime.tomlconfig import env_overrides, load_toml, refuse_unknown, require
from fedclinic.secagg import ClientPolicy
from fedclinic.secagg.task_config import floor_of

ENV_PREFIX = "FEDCLINIC_AGENT"
FORMATS = ("jsonl", "csv", "tsv", "conll", "parquet")
APPROVAL_MODES = ("auto", "manual")
#: the keys each table may hold; anything else is refused (a misspelt ``aproval`` must not mean "auto")
TLS_KEYS = ("cert", "key", "ca")
POLICY_KEYS = ("allowed_families", "allowed_datasets", "secure_aggregation_min_cohort", "approval",
               "require_signed_tasks", "allowed_owners", "signed_task_max_age_days", "require_secure_aggregation",
               "require_dp", "min_cohort", "max_epsilon", "publish_updates_allowed", "min_cell_rows",
               "allow_evaluation", "allow_statistics")
DATASET_KEYS = ("path", "format", "text_field", "label_field", "eval_path", "entities_field", "tokenizer_sha256",
                "question_field", "answer_field", "context_field", "image_field", "privacy_epsilon",
                "privacy_delta", "group_field")


def _sha256_or_none(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise ConfigError(f"{where} tokenizer_sha256 must be 64 lowercase hex digits (sha256sum tokenizer.json)")
    return value


def _privacy_budget(entry: dict[str, Any], where: str) -> dict[str, float]:
    eps, delta = entry.get("privacy_epsilon"), entry.get("privacy_delta")
    if eps is None and delta is None:
        return {}
    if eps is None or delta is None:
        raise ConfigError(f"{where}: set both privacy_epsilon and privacy_delta (the dataset's privacy budget)")
    if not (isinstance(eps, (int, float)) and eps > 0) or not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"{where}: privacy_epsilon must be > 0 and privacy_delta in (0, 1), e.g. 8.0 and 1e-5")
    return {"privacy_epsilon": float(eps), "privacy_delta": float(delta)}


def _group_field(entry: dict[str, Any], fmt: str | None, where: str) -> str | None:
    value = entry.get("group_field")
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: group_field must name the column that holds each row's patient id, e.g. "
                          f"\"patient_id\", got {value!r}")
    path = str(entry.get("path", ""))
    if fmt == "conll" or (fmt is None and path.lower().endswith((".conll", ".bio", ".iob"))):
        raise ConfigError(f"{where}: group_field needs a JSONL, CSV or TSV dataset (CoNLL has no patient id column)")
    return value


def _protection_policy(pol: dict[str, Any], where: str) -> dict[str, Any]:
    """The [policy] keys on signed tasks and required protection, checked (ConfigError says what is wrong)."""
    out: dict[str, Any] = {}
    for key in ("require_signed_tasks", "require_secure_aggregation", "require_dp"):
        if key in pol:
            if not isinstance(pol[key], bool):
                raise ConfigError(f"{where} {key} must be true or false, got {pol[key]!r}")
            out[key] = pol[key]
    if "allowed_owners" in pol:
        owners = pol["allowed_owners"]
        if not isinstance(owners, list) or not all(isinstance(o, str) and o for o in owners):
            raise ConfigError(f"{where} allowed_owners must be a list of task owners' certificate names, e.g. "
                              "[\"dr-lee\"]")
        out["allowed_owners"] = tuple(owners)
    if "min_cohort" in pol:
        value = pol["min_cohort"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where} min_cohort must be an integer >= 0 (0: no floor), got {value!r}")
        out["min_cohort"] = value
    for key, example in (("max_epsilon", "8.0"), ("signed_task_max_age_days", "7")):
        if key in pol:
            value = pol[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{where} {key} must be a number > 0, e.g. {example}, got {value!r}")
            out[key] = float(value)
    return out


def _results_policy(pol: dict[str, Any], where: str) -> dict[str, Any]:
    """The policy keys of non-training work: min_cell_rows (an integer >= 1), allow_evaluation and
    allow_statistics (true or false)."""
    out: dict[str, Any] = {}
    if "min_cell_rows" in pol:
        k = pol["min_cell_rows"]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 1_000_000:
            raise ConfigError(f"{where} min_cell_rows must be an integer 1-1000000 (cells of fewer rows are "
                              f"withheld; default 10), got {k!r}")
        out["min_cell_rows"] = k
    for key in ("allow_evaluation", "allow_statistics"):
        if key in pol:
            if not isinstance(pol[key], bool):
                raise ConfigError(f"{where} {key} must be true or false, got {pol[key]!r}")
            out[key] = pol[key]
    return out


def _torch_threads(value: Any, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 4096:
        raise ConfigError(f"{source}: torch_threads must be a whole number of CPU threads, 0-4096 (0 = every core), "
                          f"got {value!r}")
    return value


def _devices(doc: dict[str, Any], source: str) -> list[str] | str | None:
    """The ``devices`` setting, checked (fedclinic.federation.distributed_round.check_devices); None when absent.
    With it, ``device`` must stay "auto" (one setting says where training runs)."""
    if "devices" not in doc:
        return None
    from fedclinic.federation.distributed_round import check_devices  # only for multi-device sites

    devices = check_devices(doc["devices"], f"{source}: devices")
    if str(doc.get("device", "auto")) != "auto":
        raise ConfigError(f"{source}: set either device (one process) or devices (one process per device), not both")
    return devices


def _seconds(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 86_400:
        raise ConfigError(f"{source}: {key} must be a number of seconds between 1 and 86400, got {value!r}")
    return float(value)


def _sharding(doc: dict[str, Any], source: str) -> str:
    """The ``sharding`` setting, checked (fedclinic.federation.distributed_round.check_sharding): "none" (default)
    or "fsdp", which needs ``devices``."""
    value = doc.get("sharding", "none")
    if value == "none":
        return "none"
    from fedclinic.federation.distributed_round import check_sharding  # only for multi-device sites

    value = check_sharding(value, f"{source}: sharding")
    if "devices" not in doc:
        raise ConfigError(f'{source}: sharding = "{value}" shards the model across devices; set devices too '
                          '(e.g. devices = ["cuda:0", "cuda:1"])')
    return value


def _flag(doc: dict[str, Any], key: str, default: bool, source: str) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    #: the dataset file; None for a dataset read from a ``source`` (then ``source`` is set)
    path: Path | None
    format: str | None
    text_field: str = "text"
    label_field: str = "label"
    eval_path: Path | None = None
    entities_field: str = "entities"     # NER JSONL: the list of {"start", "end", "label"} spans
    #: when set, the only tokenizer (sha256 of tokenizer.json) tasks on this dataset may use: e.g. the one
    #: the site validated its data, or de-identification, with
    tokenizer_sha256: str | None = None
    question_field: str = "question"     # question-answering JSONL: the question, the reference answer and an
    answer_field: str = "answer"         # optional context passage
    context_field: str = "context"
    image_field: str = "image"           # image + text manifest: the image path, relative to the manifest's folder
    #: the dataset's differential-privacy budget over every task that trains on it (hospital_agent.privacy_ledger)
    privacy_epsilon: float | None = None
    privacy_delta: float | None = None
    #: the column (JSONL key, CSV/TSV header) holding each row's patient id; set, tasks with ``privacy.unit =
    #: "patient"`` sample, clip and account per patient (fedclinic.privacy.patient_groups); None: they are declined
    group_field: str | None = None
    #: where the rows live when not in a JSONL/CSV/TSV/CoNLL file: a SQL query, an OMOP CDM mapping, a FHIR NDJSON
    #: export, a Parquet file (fedclinic.data.sources; read by hospital_agent.site_data); None: ``path``
    source: DataSource | None = None


#: the keys every dataset table may hold whatever its source
COMMON_DATASET_KEYS = ("tokenizer_sha256", "privacy_epsilon", "privacy_delta")
#: the patient id column a source gives without a group_field (OMOP: person_id, FHIR: subject.reference)
IMPLIED_GROUP = {"omop": "person_id", "fhir": "subject"}


def _source_entry(name: str, entry: dict[str, Any], base: Path, where: str) -> DatasetEntry:
    """A ``[datasets.NAME]`` table with a ``source``: its keys checked, its DataSource built."""
    kind = entry.get("source")
    if kind not in SOURCE_KEYS:
        raise ConfigError(f"{where}: source must be one of {', '.join(SOURCE_KINDS)}, got {kind!r} (a file dataset "
                          "has no source key, only path)")
    columns = ("text_field", "label_field", "group_field") if kind == "sql" else ()
    refuse_password(entry, where)  # before the unknown keys: say where a password goes
    refuse_unknown(entry, COMMON_DATASET_KEYS + SOURCE_KEYS[kind] + columns, where, ENV_PREFIX)
    data_source = parse_source(name, entry, base, where)
    group = entry.get("group_field") if kind == "sql" else IMPLIED_GROUP.get(kind)
    return DatasetEntry(name, None, None, text_field=entry.get("text_field", "text"),
                        label_field=entry.get("label_field", "label"),
                        tokenizer_sha256=_sha256_or_none(entry.get("tokenizer_sha256"), where),
                        group_field=group, source=data_source, **_privacy_budget(entry, where))


def _parquet_entry(name: str, entry: dict[str, Any], p, where: str) -> DatasetEntry:
    """A ``[datasets.NAME]`` table of a Parquet file (``format = "parquet"`` or a ``.parquet`` path)."""
    refuse_unknown(entry, COMMON_DATASET_KEYS + ("path", "format", "eval_path", "text_field", "label_field",
                                                 "group_field"), where, ENV_PREFIX)
    group = _group_field(entry, "parquet", where)
    fields = dict(text_field=entry.get("text_field", "text"), label_field=entry.get("label_field", "label"))
    data_source = ParquetSource(name, p(entry["path"]), eval_path=p(entry["eval_path"]) if entry.get("eval_path")
                                else None, group_field=group, **fields)
    return DatasetEntry(name, None, "parquet", tokenizer_sha256=_sha256_or_none(entry.get("tokenizer_sha256"), where),
                        group_field=group, source=data_source, **fields, **_privacy_budget(entry, where))


@dataclass(frozen=True)
class SitePolicy:
    allowed_families: tuple[str, ...] = ()
    allowed_datasets: tuple[str, ...] = ()
    #: under secure aggregation, refuse sessions (cohort, key directory, survivors) smaller than this (>= 3);
    #: enforced by fedclinic.secagg.ClientSession whatever the aggregator says
    secure_aggregation_min_cohort: int = 3
    #: "auto": a task the policy allows runs at once; "manual": it waits for ``hospital-agent tasks approve ID``
    #: (hospital_agent.approvals), and nothing is downloaded or trained before that
    approval: str = "auto"
    #: run only tasks signed by their owner (fedclinic.spec.signed_task, checked by hospital_agent.gates); false
    #: also runs unsigned ones (an altered or forged signed task is declined either way)
    require_signed_tasks: bool = True
    #: the task owners (signers' identity names) this site trains for; empty: any owner the CA certified
    allowed_owners: tuple[str, ...] = ()
    #: do not start (accept for the first time) a task signed longer ago than this; None: no limit. A task already
    #: running here goes on whatever its age
    signed_task_max_age_days: float | None = None
    #: decline tasks that do not enable secure aggregation
    require_secure_aggregation: bool = False
    #: decline tasks without sample-level differential privacy (DP-SGD at the site)
    require_dp: bool = False
    #: decline tasks whose rounds may close with fewer sites than this (rounds.min_sites; under secure
    #: aggregation the session floor max(3, min_cohort, min_sites)); 0: no floor
    min_cohort: int = 0
    #: decline tasks whose target epsilon is larger than this, or that declare none; None: no bound
    max_epsilon: float | None = None
    #: take part in tasks that publish each site's committed update to the task's owner (``[verification]
    #: publish_updates``, for `fedclinic task verify`); off by default: the owner otherwise sees only aggregates
    publish_updates_allowed: bool = False
    #: k of small-cell suppression: an evaluation or statistics cell of fewer rows is withheld (sent with the
    #: results; the aggregator shows such a cell as suppressed and pools it into nothing)
    min_cell_rows: int = 10
    #: evaluate models for others: the final model after training, and tasks of kind "evaluate"
    allow_evaluation: bool = True
    #: answer tasks of kind "statistics" (statistics of the site's dataset)
    allow_statistics: bool = True

    def secagg_policy(self):
        """The site's fedclinic.secagg.ClientPolicy."""
        return ClientPolicy(min_cohort=self.secure_aggregation_min_cohort)

    def refusal(self, spec: task_pb2.TaskSpec, datasets: dict[str, DatasetEntry]) -> str | None:
        """Why this site will not run ``spec`` (None when it may). Checked before anything is downloaded."""
        if spec.family not in self.allowed_families:
            return (f"site policy does not allow model family {spec.family!r} "
                    f"(allowed: {', '.join(self.allowed_families) or 'none'})")
        if spec.dataset not in self.allowed_datasets:
            return f"site policy does not allow tasks on dataset {spec.dataset!r}"
        if spec.dataset not in datasets:
            return f"this site has no dataset named {spec.dataset!r} in its registry"
        pinned = datasets[spec.dataset].tokenizer_sha256
        if pinned and spec.tokenizer_sha256 != pinned:
            return (f"dataset {spec.dataset!r} is pinned to tokenizer {pinned[:12]}... but the task uses "
                    f"{(spec.tokenizer_sha256 or 'none')[:12]}...; the site's data contract allows only the pinned "
                    "tokenizer (change tokenizer_sha256 in [datasets] if the new one was reviewed)")
        if spec.verification.publish_updates and not self.publish_updates_allowed:
            return ("the task publishes each site's update to its owner ([verification] publish_updates = true), which "
                    "this site's policy does not allow; submit it without publish_updates, or the site sets [policy] "
                    "publish_updates_allowed = true")
        if spec.privacy.level not in ("", "sample", "client", "distributed"):
            return f"the task asks for privacy level {spec.privacy.level!r}, which this agent does not know"
        if spec.privacy.unit not in ("", "example", "patient"):
            return f"the task asks for privacy unit {spec.privacy.unit!r}, which this agent does not know"
        if spec.privacy.unit == "patient" and not datasets[spec.dataset].group_field:
            return (f"the task protects each patient (privacy.unit = \"patient\") but dataset {spec.dataset!r} "
                    "declares no patient id column at this site; the site admin sets group_field under "
                    f"[datasets.{spec.dataset}] in agent.toml, or the task uses unit \"example\"")
        return self.protection_refusal(spec)

    def protection_refusal(self, spec: task_pb2.TaskSpec) -> str | None:
        """Why ``spec`` does not offer the protection this site's policy requires (None when it does); each reason
        names the policy key and what the task owner must change."""
        secure = spec.secure_aggregation.enabled
        if self.require_secure_aggregation and not secure:
            return ("site policy require_secure_aggregation: this site sends updates only under secure aggregation; "
                    "the task must set [secure_aggregation] enabled = true")
        sample_dp = spec.privacy.level == "sample"
        if self.require_dp and not sample_dp:
            return ("site policy require_dp: this site trains only with sample-level differential privacy; the "
                    "task must set [privacy] level = \"sample\" with a target_epsilon")
        cohort = floor_of(spec) if secure else spec.rounds.min_sites
        if self.min_cohort and cohort < self.min_cohort:
            return (f"site policy min_cohort = {self.min_cohort}: the task's rounds may close with {cohort} site(s); "
                    f"the task must set min_sites (and, under secure aggregation, min_cohort) to at least "
                    f"{self.min_cohort}")
        if self.max_epsilon is not None:
            eps = spec.privacy.target_epsilon if sample_dp else 0.0
            if eps <= 0:
                return (f"site policy max_epsilon = {self.max_epsilon:g}: the task declares no target epsilon "
                        "(sample-level differential privacy with [privacy] target_epsilon), so its privacy loss "
                        "here has no bound this site can check")
            if eps > self.max_epsilon:
                return (f"site policy max_epsilon = {self.max_epsilon:g}: the task's target epsilon is {eps:g}; "
                        f"the task must set [privacy] target_epsilon to at most {self.max_epsilon:g}")
        return None


def _model_folders(doc: dict[str, Any], p: Callable[[str], Path], source: str) -> tuple[Path, ...]:
    """``[models] folders``: pretrained model folders installed at the site, each an existing folder."""
    table = doc.get("models") or {}
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [models] must be a table with 'folders', a list of pretrained model folders")
    refuse_unknown(table, ("folders",), f"{source}: [models]", ENV_PREFIX)
    folders = table.get("folders", [])
    if not isinstance(folders, list) or not all(isinstance(f, str) and f for f in folders):
        raise ConfigError(f"{source}: [models] folders must be a list of folder paths, got {folders!r}")
    out = tuple(p(f) for f in folders)
    for folder in out:
        if not folder.is_dir():
            raise ConfigError(f"{source}: [models] folders: {folder} is not a folder; list the pretrained model "
                              "folders installed at this site (each with its *.safetensors weights)")
    return out


@dataclass(frozen=True)
class AgentConfig:
    #: the aggregator's ``host:port``; several (a hot-standby pair) comma-separated, tried in turn
    #: (fedclinic.transport.addresses; the TOML may give a list: ``aggregator = ["a:7443", "b:7443"]``)
    aggregator: str
    work_dir: Path
    tls: TlsFiles
    datasets: dict[str, DatasetEntry] = field(default_factory=dict)
    policy: SitePolicy = SitePolicy()
    server_name: str | None = None
    device: str = "auto"
    mixed_precision: bool = False
    log_level: str = "info"
    source: str = ""
    #: where the Prometheus endpoint listens (fedclinic.runtime.metrics_endpoint); None: no endpoint, no open port
    metrics_address: MetricsAddress | None = None
    #: torch's intra-op and inter-op CPU threads (hospital_agent.torch_threads); 0: every core of this machine
    torch_threads: int = 0
    #: import the training stack at start-up, before connecting (hospital_agent.warm_start), not in the first round
    preload_training_stack: bool = True
    #: train each round on these devices, one torch.distributed process each ("all": every visible GPU); None:
    #: one process on ``device`` (fedclinic.federation.distributed_round)
    devices: list[str] | str | None = None
    #: how a multi-device round holds the model: "none" (a replica per process), "fsdp" (sharded; causal LMs)
    sharding: str = "none"
    #: seconds a process of a multi-device round waits in a collective for a silent peer before the round fails
    distributed_timeout: float = 600.0
    #: recompute Hugging Face models' activations in the backward pass (the same gradients for less memory)
    gradient_checkpointing: bool = False
    #: pretrained model folders installed at this site (``[models] folders``): a task's tensors they hold are
    #: copied into the cache instead of being downloaded (hospital_agent.local_models)
    model_folders: tuple[Path, ...] = ()

    @classmethod
    def load(cls, path: str | Path) -> "AgentConfig":
        doc = env_overrides(load_toml(path), ENV_PREFIX)
        return cls.from_dict(doc, base=Path(path).resolve().parent, source=str(path))

    @classmethod
    def from_dict(cls, doc: dict[str, Any], *, base: Path, source: str) -> "AgentConfig":
        def p(value: str) -> Path:
            q = Path(value).expanduser()
            return q if q.is_absolute() else base / q

        tls = TlsFiles(p(require(doc, "tls.cert", str, source)), p(require(doc, "tls.key", str, source)),
                       p(require(doc, "tls.ca", str, source)))
        refuse_unknown(doc["tls"], TLS_KEYS, f"{source}: [tls]", ENV_PREFIX)
        datasets = {}
        for name, entry in (doc.get("datasets") or {}).items():
            if isinstance(entry, dict) and "source" in entry:
                datasets[name] = _source_entry(name, entry, base, f"{source}: [datasets.{name}]")
                continue
            if not isinstance(entry, dict) or "path" not in entry:
                raise ConfigError(f"{source}: [datasets.{name}] needs a 'path' (a file), or a 'source' (\"sql\", "
                                  "\"omop\" or \"fhir\": docs/hospital-it.md, \"Data where it lives\")")
            if entry.get("format") == "parquet" or (entry.get("format") is None
                                                    and str(entry["path"]).lower().endswith(".parquet")):
                datasets[name] = _parquet_entry(name, entry, p, f"{source}: [datasets.{name}]")
                continue
            refuse_unknown(entry, DATASET_KEYS, f"{source}: [datasets.{name}]", ENV_PREFIX)
            fmt = entry.get("format")
            if fmt is not None and fmt not in FORMATS:
                raise ConfigError(f"{source}: [datasets.{name}] format must be one of {', '.join(FORMATS)}")
            datasets[name] = DatasetEntry(name, p(entry["path"]), fmt, entry.get("text_field", "text"),
                                          entry.get("label_field", "label"),
                                          p(entry["eval_path"]) if entry.get("eval_path") else None,
                                          entry.get("entities_field", "entities"),
                                          _sha256_or_none(entry.get("tokenizer_sha256"),
                                                          f"{source}: [datasets.{name}]"),
                                          question_field=entry.get("question_field", "question"),
                                          answer_field=entry.get("answer_field", "answer"),
                                          context_field=entry.get("context_field", "context"),
                                          image_field=entry.get("image_field", "image"),
                                          group_field=_group_field(entry, fmt, f"{source}: [datasets.{name}]"),
                                          **_privacy_budget(entry, f"{source}: [datasets.{name}]"))
        pol = doc.get("policy") or {}
        refuse_unknown(pol, POLICY_KEYS, f"{source}: [policy]", ENV_PREFIX)
        min_cohort = pol.get("secure_aggregation_min_cohort", 3)
        if isinstance(min_cohort, bool) or not isinstance(min_cohort, int) or min_cohort < 3:
            raise ConfigError(f"{source}: [policy] secure_aggregation_min_cohort must be an integer >= 3 (with two "
                              "sites each learns the other's update from the sum)")
        approval = pol.get("approval", "auto")
        if approval not in APPROVAL_MODES:
            raise ConfigError(f"{source}: [policy] approval must be \"auto\" or \"manual\", got {approval!r}")
        published = pol.get("publish_updates_allowed", False)
        if not isinstance(published, bool):
            raise ConfigError(f"{source}: [policy] publish_updates_allowed must be true or false, got {published!r}")
        policy = SitePolicy(tuple(pol.get("allowed_families", ["text-classification"])),
                            tuple(pol.get("allowed_datasets", list(datasets))), min_cohort, approval,
                            publish_updates_allowed=published, **_protection_policy(pol, f"{source}: [policy]"),
                            **_results_policy(pol, f"{source}: [policy]"))
        unknown = set(doc) - {"aggregator", "work_dir", "tls", "datasets", "policy", "server_name", "device",
                              "mixed_precision", "log_level", "metrics_address", "torch_threads",
                              "preload_training_stack", "devices", "distributed_timeout", "sharding",
                              "gradient_checkpointing", "models"}
        if unknown:
            raise ConfigError(f"{source}: unknown setting(s) {sorted(unknown)}")
        if "aggregator" not in doc:
            raise ConfigError(f"{source}: missing required setting 'aggregator'")
        aggregator = ",".join(parse_addresses(doc["aggregator"], f"{source}: aggregator"))
        return cls(aggregator=aggregator, work_dir=p(require(doc, "work_dir", str, source)),
                   tls=tls, datasets=datasets, policy=policy, server_name=doc.get("server_name"),
                   device=str(doc.get("device", "auto")), mixed_precision=bool(doc.get("mixed_precision", False)),
                   log_level=str(doc.get("log_level", "info")), source=source,
                   metrics_address=parse_metrics_address(doc.get("metrics_address"), source),
                   torch_threads=_torch_threads(doc.get("torch_threads", 0), source),
                   preload_training_stack=_flag(doc, "preload_training_stack", True, source),
                   devices=_devices(doc, source), sharding=_sharding(doc, source),
                   distributed_timeout=_seconds(doc.get("distributed_timeout", 600), "distributed_timeout", source),
                   gradient_checkpointing=_flag(doc, "gradient_checkpointing", False, source),
                   model_folders=_model_folders(doc, p, source))

    def with_metrics_address(self, value: str, where: str) -> "AgentConfig":
        """This configuration with the Prometheus endpoint at ``value`` (e.g. from the command line; "" = off)."""
        return replace(self, metrics_address=parse_metrics_address(value, where))
