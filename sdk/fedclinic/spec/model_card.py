"""The model card: what a final model is, how it was trained, by how many sites, and how well it did.

``fedclinic task download`` (:meth:`fedclinic.client.Client.download`) writes ``model_card.json`` and its
Markdown rendering ``MODEL_CARD.md`` beside the package files; ``fedclinic export onnx`` copies the card into
the bundle and adds an ``export`` section. The JSON is strict (no NaN or Infinity), so any language with an
ONNX Runtime binding can read it next to ``model.onnx``.

The label map is ``fedclinic_model.json``, which every package and every bundle holds: its ``labels`` list
is in class-index order (``logits[..., i]`` is ``labels[i]``), and for token-classification its ``tags`` list
is in tag-index order (``logits[..., t]`` and the CRF output ``tags`` index it). The card repeats both and
names that file in ``label_map``; no separate label file is written.

JSON keys (``schema_version`` 1). "null" means *unknown* (the card was made without the task's status, e.g.
for a package made locally); a section that is *absent* was not configured::

    schema_version       1
    created              when this card was written, ISO 8601 UTC ("2025-01-31T12:00:00Z")
    fedclinic_version    the fedclinic that wrote it
    model_hash           the package's content hash (sha256 of its manifest, see fedclinic.transport.package); equal to
                         ModelPackage.load(folder).manifest().model_hash of the downloaded folder
    model_round          the round whose global model this is: 0 = the initial model; null = unknown
    is_final             true when this is the completed task's final model; null = unknown
    family               "text-classification" | "token-classification" | "feature-classification" |
                         "question-answering" | "image-text-classification"
    architecture         e.g. "transformer", "lstm", "logreg", "transformer-crf"
    labels               class names in class-index order (token-classification: the entity types)
    multi_label          bool
    max_length           token sequence length (null for feature models)
    tag_scheme, tags     token-classification only: "BIO" | "BIOES" and the tag names in tag-index order
    image                image-text-classification only: the input every use of the model must prepare,
                         {"channels": 1, "size", "mean", "std", "preprocessing": "fedclinic.data_image"}
    prompt, eos_token,   question-answering only: the prompt template every use of the model must apply
    generation           ({"source", "template", "context_template", "answer_prefix"}), the token that ends
                         an answer, and the generation settings ({"max_new_tokens", "eval_examples"})
    base_model           the pretrained model the task started from ("from-config" when built from a config)
    label_map            "fedclinic_model.json" (see above)
    task                 {"id", "name", "description", "state", "owner", "dataset", "submitted"} or null
    strategy             {"name", "params"} (numeric and string parameters together) or null
    training             the sites' local training settings (TrainingConfig: local_epochs, batch_size,
                         learning_rate, optimizer, ..., seed) or null
    round_config         {"num_rounds", "min_sites", "participation_fraction", "round_timeout_s",
                         "on_quorum_miss", "max_round_retries"} or null
    update               {"trainable", "frozen", "private"}: tensor name patterns, or null
    rounds_completed     rounds that went into this model (null = unknown)
    sites, num_sites     the sites whose updates went into this model (sorted) and their count
    rounds               per round, in order: {"round", "attempt", "sites", "num_samples", "metrics",
                         "uplink_bytes", "downlink_bytes", "model_hash", "closed"}; "metrics" is the round's
                         sample-weighted summary (train_loss, eval_accuracy, eval_macro_f1, eval_strict_f1, ...)
    final_round_metrics  "metrics" of the last of those rounds ({} when there is none; null = unknown)
    privacy              only when the task set differential privacy: {"level", "target_epsilon",
                         "target_delta", "max_grad_norm", "noise_multiplier", "accountant", "unit" (what one
                         epsilon protects: "example", "patient" or "site"; a note says it in words)} and what was spent
                         up to this model: "epsilon_spent_max_site", "delta_spent" (sample level: the largest
                         cumulative spend of any site) or "client_epsilon_spent", "client_delta" (client level)
    secure_aggregation   only when the task enabled it, defaults filled in: {"enabled", "threshold",
                         "min_cohort", "clip", "bits", "rounding", "degree", "weighting", "weight_cap",
                         "metric_clip"}
    thresholds           multi-label only, when set: each label's decision threshold and the rows/sites they were
                         tuned on ({"rule", "values": {label: t}, "tuned_on": {"rows", "sites", "bins"} | null,
                         "source"}; fedclinic.spec.card_thresholds); absent = every label at probability 0.5
    notes                plain-language caveats (list of strings)
    export               only in an ONNX bundle: {"created", "fedclinic_version", "opset", "inputs", "outputs",
                         "files", "fp32": {"max_abs_diff", "tolerance", "top1_agreement", "inputs",
                         "path_agreement"? (CRF), "label_agreement"? (multi-label image-text: per-label
                         decisions that agree)}, "int8": {...same...}?} with the figures of export_report.json

What a round's metrics mean: ``train_*`` come from the sites' local training in that round; ``eval_*`` are
the sites' evaluation, on their held-out splits, of the model that round *started from* (the previous
round's global model). No site has evaluated the final model itself; the card says so in ``notes``.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.spec.card_thresholds import card_markdown_lines, is_per_label_metric
from fedclinic.spec.safl_settings import SaflConfig
from fedclinic.version import __version__
from fedclinic.errors import ConfigError
from fedclinic.transport.package import CARD_FILE, CARD_MARKDOWN_FILE, META_FILE

SCHEMA_VERSION = 1
EVAL_NOTE = ("eval_* metrics of a round are the sites' evaluation of the model that round started from (the "
             "previous round's global model); train_* come from the sites' local training in that round. No site "
             "has evaluated the final model itself.")
#: the round metrics shown first in the Markdown table (the rest follow in name order)
HEADLINE_METRICS = ("eval_accuracy", "eval_macro_f1", "eval_macro_auc", "eval_strict_f1", "eval_relaxed_f1",
                    "eval_loss", "train_loss")

Card = dict[str, Any]


def build_card(meta: Mapping[str, Any], *, model_hash: str, status: Any | None = None,
               requested_round: int | None = None, now: datetime | None = None) -> Card:
    """The card of one package.

    ``meta`` is the package's parsed ``fedclinic_model.json``; ``model_hash`` its manifest hash. ``status``
    is the task's ``control_pb2.TaskStatus`` (or None: then only what the package itself says is written and
    the training keys are null). ``requested_round`` is what was fetched (0 = final, n = after round n,
    -1 = initial; None = unknown); the rounds that went into the model are the closed rounds up to it.
    """
    card: Card = {
        "schema_version": SCHEMA_VERSION,
        "created": _iso(now or datetime.now(timezone.utc)),
        "fedclinic_version": __version__,
        "model_hash": model_hash,
        "model_round": None,
        "is_final": None,
        **model_facts(meta),
        "label_map": META_FILE,
        "task": None, "strategy": None, "training": None, "round_config": None, "update": None,
        "rounds_completed": None, "sites": None, "num_sites": None, "rounds": None, "final_round_metrics": None,
        "notes": [],
    }
    if status is None:
        card["notes"].append("made without the task's status: training history, sites and metrics are unknown")
        return _clean(card)
    spec = status.spec
    card["task"] = {"id": status.task_id, "name": spec.name, "description": spec.description,
                    "state": _enum_name(status, "state", "TASK_STATE_"), "owner": status.owner,
                    "dataset": spec.dataset, "submitted": _ms(status.created_unix_ms)}
    card["strategy"] = {"name": spec.strategy, "params": {**dict(spec.strategy_params), **dict(spec.strategy_options)}}
    card["training"] = _fields(spec.training)
    rc = spec.rounds
    card["round_config"] = {"num_rounds": rc.num_rounds, "min_sites": rc.min_sites,
                            "participation_fraction": rc.participation_fraction,
                            "round_timeout_s": rc.round_timeout_s,
                            "on_quorum_miss": _enum_name(rc, "on_quorum_miss", "QUORUM_POLICY_"),
                            "max_round_retries": rc.max_round_retries}
    card["update"] = {"trainable": list(spec.update.trainable_patterns), "frozen": list(spec.update.frozen_patterns),
                      "private": list(spec.update.private_patterns), "codec": spec.update.codec or "raw",
                      "downlink_codec": spec.update.downlink_codec or "raw"}
    if spec.update.private_patterns:
        card["notes"].append(PRIVATE_NOTE)
    if spec.update.selection == "safl":
        cfg = SaflConfig.from_spec(spec)
        card["update"]["selection"] = {"method": "safl", "top_k": cfg.top_k, "profile_samples": cfg.profile_samples,
                                       "token": cfg.token}
    if spec.HasField("privacy") and spec.privacy.level:
        # the original six fields always; later ones (e.g. distributed DP's mechanism and scale) only when set
        card["privacy"] = {k: v for k, v in _fields(spec.privacy).items() if k in PRIVACY_CORE or v}
        card["privacy"]["unit"] = privacy_unit(spec.privacy)
        card["notes"].append(UNIT_NOTES[card["privacy"]["unit"]])
    if spec.HasField("secure_aggregation") and spec.secure_aggregation.enabled:
        # lazy: the SecAgg stack (cryptography) loads only for a task that used it; serving reads cards without it
        from fedclinic.secagg.task_config import effective_config

        card["secure_aggregation"] = _fields(effective_config(spec.secure_aggregation))  # defaults filled in

    rounds = _rounds_of_model(status, model_hash, requested_round, card["notes"])
    card["rounds"] = [_round_entry(r) for r in rounds]
    card["rounds_completed"] = len(rounds)
    sites = sorted({rep.site_id for r in rounds for rep in r.reports})
    card["sites"], card["num_sites"] = sites, len(sites)
    card["final_round_metrics"] = dict(card["rounds"][-1]["metrics"]) if rounds else {}
    if card.get("privacy") and rounds:  # what was spent up to this model, not only what was asked for
        final = card["final_round_metrics"]
        if "dp_epsilon" in final:
            card["privacy"]["epsilon_spent_max_site"] = final["dp_epsilon"]
            card["privacy"]["delta_spent"] = final.get("dp_delta")
        if "ddp_epsilon" in final:  # distributed DP: the aggregator's accountant over the sites' noise shares
            card["privacy"]["distributed_epsilon_spent"] = final["ddp_epsilon"]
            card["privacy"]["distributed_delta"] = final.get("ddp_delta")
        if "client_dp_epsilon" in final:
            card["privacy"]["client_epsilon_spent"] = final["client_dp_epsilon"]
            card["privacy"]["client_delta"] = final.get("client_dp_delta")
    card["model_round"] = rounds[-1].round if rounds else (0 if model_hash == status.initial_model_hash else None)
    card["is_final"] = bool(status.final_model_hash) and model_hash == status.final_model_hash
    if rounds:
        card["notes"].append(EVAL_NOTE)
    return _clean(card)


def model_facts(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Family, architecture, labels, multi_label, max_length, base_model (and tag_scheme/tags for
    token-classification) from a parsed ``fedclinic_model.json``; missing ones are null."""
    facts: dict[str, Any] = {
        "family": meta.get("family"), "architecture": meta.get("architecture"),
        "labels": list(meta.get("labels") or []), "multi_label": bool(meta.get("multi_label", False)),
        "max_length": meta.get("max_length"), "base_model": meta.get("base_model"),
    }
    if meta.get("family") == "token-classification":
        facts["tag_scheme"] = meta.get("scheme", "BIO")
        facts["tags"] = list(meta.get("tags") or [])
    if meta.get("family") == "question-answering":
        facts["prompt"] = dict(meta.get("prompt") or {})
        facts["eos_token"] = meta.get("eos_token")
        facts["generation"] = dict(meta.get("generation") or {})
    if meta.get("family") == "image-text-classification":
        arch = meta.get("arch_config") or {}
        facts["image"] = {"channels": 1, "size": arch.get("image_size"), "mean": arch.get("image_mean"),
                          "std": arch.get("image_std"), "preprocessing": "fedclinic.data_image"}
    return facts


def add_export(card: Mapping[str, Any], report: Mapping[str, Any], *, inputs: Sequence[str],
               outputs: Sequence[str], now: datetime | None = None) -> Card:
    """A copy of ``card`` with the ``export`` section, from ``report`` (``asdict`` of an
    :class:`fedclinic.export.onnx_export.ExportReport`) and the graph's input and output names."""
    section: dict[str, Any] = {"created": _iso(now or datetime.now(timezone.utc)), "fedclinic_version": __version__,
                               "opset": report["opset"], "inputs": list(inputs), "outputs": list(outputs),
                               "files": sorted({*report.get("files", []), CARD_FILE, CARD_MARKDOWN_FILE,
                                                "export_report.json"})}
    for precision in ("fp32", "int8"):
        parity = report.get(precision)
        if parity:
            section[precision] = {k: v for k, v in parity.items() if v is not None}
    return _clean({**card, "export": section})


def card_for_bundle(existing: Mapping[str, Any] | None, meta: Mapping[str, Any], *, model_hash: str,
                    now: datetime | None = None) -> Card:
    """The card an export starts from: the package's own card when it describes this package (same
    ``model_hash``), else one made from ``fedclinic_model.json`` alone (with a note saying why)."""
    if existing is not None and existing.get("model_hash") == model_hash:
        return dict(existing)
    card = build_card(meta, model_hash=model_hash, now=now)
    if existing is not None:
        card["notes"].insert(0, f"the package's {CARD_FILE} describes model {existing.get('model_hash')!r}, not "
                                "this package (its weights or files changed since download); its history was "
                                "not carried over")
    return card


def card_summary(card: Mapping[str, Any]) -> dict[str, Any]:
    """A few headline facts (for ``/readyz``): task, model hash, rounds, sites, last round's metrics."""
    task = card.get("task") or {}
    return {"task_id": task.get("id"), "task_name": task.get("name"), "model_hash": card.get("model_hash"),
            "base_model": card.get("base_model"), "rounds_completed": card.get("rounds_completed"),
            "num_sites": card.get("num_sites"), "final_round_metrics": card.get("final_round_metrics"),
            "created": card.get("created")}


def read_card(folder: str | os.PathLike[str]) -> Card | None:
    """``folder/model_card.json`` parsed, or None when there is none; ConfigError when it is not a JSON object."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return None
    try:
        card = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); delete it or download the model again") from None
    if not isinstance(card, dict):
        raise ConfigError(f"{path} is not a JSON object; delete it or download the model again")
    return card


def write_card(folder: str | os.PathLike[str], card: Mapping[str, Any]) -> Path:
    """Write ``model_card.json`` and ``MODEL_CARD.md`` into ``folder`` (each replaced atomically); returns the
    JSON's path."""
    root = Path(folder)
    _atomic_write(root / CARD_FILE, json.dumps(_clean(card), indent=2, allow_nan=False) + "\n")
    _atomic_write(root / CARD_MARKDOWN_FILE, render_markdown(card))
    return root / CARD_FILE


#: why the global model of a task with private modules is not a site's model
#: what the privacy guarantee is about, by ``privacy.unit`` (sample level) or level (client)
UNIT_NOTES = {
    "example": ("privacy unit: one example (a row of a site's dataset). A patient with several rows is protected "
                "only as a group of that many examples (epsilon grows with the number of rows)."),
    "patient": ("privacy unit: one patient (all rows with the same patient id at a site): each site sampled and "
                "clipped whole patients and accounted epsilon per patient. A patient with many rows weighs more "
                "than one with few before clipping; after clipping each patient's contribution to a step is at "
                "most max_grad_norm."),
    "site": ("privacy unit: one site's whole update (client-level DP at the aggregator), not a row or a patient "
             "inside a site."),
}


def privacy_unit(privacy: Any) -> str:
    """What a task's differential privacy protects: "example", "patient" (sample level) or "site" (client level)."""
    if privacy.level == "client":
        return "site"
    return "patient" if privacy.unit == "patient" else "example"


PRIVATE_NOTE = ("the task kept private modules at the sites (update.private): in this global model those tensors hold "
                "their initial values; each site's own model is this one with its private tensors "
                "(`hospital-agent model export TASK OUT_DIR` at the site)")


def render_markdown(card: Mapping[str, Any]) -> str:
    """The card as Markdown (what ``MODEL_CARD.md`` holds): model, training, sites, per-round metrics,
    privacy, export parity and notes."""
    task = card.get("task") or {}
    title = task.get("name") or card.get("base_model") or str(card.get("model_hash") or "")[:12] or "model"
    lines = [f"# Model card: {title}", ""]
    rows: list[tuple[str, Any]] = [
        ("Family", card.get("family")), ("Architecture", card.get("architecture")),
        ("Base model", card.get("base_model")),
        ("Labels", ", ".join(map(str, card.get("labels") or [])) or None),
    ]
    if card.get("family") == "token-classification":
        rows += [("Tag scheme", card.get("tag_scheme")), ("Tags", ", ".join(card.get("tags") or []) or None)]
    if card.get("family") == "question-answering":
        prompt = card.get("prompt") or {}
        rows += [("Prompt", f"{prompt.get('source')}: `{json.dumps(prompt.get('template'))}`" if prompt else None),
                 ("End of answer", f"`{card.get('eos_token')}`" if card.get("eos_token") else None)]
    if card.get("family") == "image-text-classification":
        image = card.get("image") or {}
        rows += [("Image input", f"grayscale {image.get('size')} x {image.get('size')}, (v - {image.get('mean')}) / "
                                 f"{image.get('std')} ({image.get('preprocessing')})" if image else None)]
    rows += [("Multi-label", "yes" if card.get("multi_label") else "no"), ("Max length", card.get("max_length")),
             ("Model hash", f"`{card.get('model_hash')}`"), ("Label map", f"`{card.get('label_map', META_FILE)}`")]
    lines += ["## Model", "", *_table(("", ""), rows), ""]

    lines += ["## Training", ""]
    if not task:
        lines += ["Unknown: this card was made without the task's status.", ""]
    else:
        strategy = card.get("strategy") or {}
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted((strategy.get("params") or {}).items()))
        rc = card.get("round_config") or {}
        trows: list[tuple[str, Any]] = [
            ("Task", f"{task.get('name')} (`{task.get('id')}`), {task.get('state')}"),
            ("Dataset", task.get("dataset")),
            ("Strategy", f"{strategy.get('name')}" + (f" ({params})" if params else "")),
            ("Rounds completed", f"{card.get('rounds_completed')} of {rc.get('num_rounds')}"),
            ("Model from round", card.get("model_round")),
            ("Sites", f"{card.get('num_sites')}: {', '.join(card.get('sites') or [])}"),
            ("Min sites per round", rc.get("min_sites")),
        ]
        training = card.get("training") or {}
        trows += [(k, _fmt(v)) for k, v in training.items()]
        lines += [*_table(("setting", "value"), trows), ""]
        if task.get("description"):
            lines += [str(task["description"]), ""]

    rounds = card.get("rounds") or []
    if rounds:
        keys = sorted({k for r in rounds for k in r.get("metrics", {})
                       if k not in UPLINK_METRICS and not is_per_label_metric(k)},
                      key=lambda k: (HEADLINE_METRICS.index(k) if k in HEADLINE_METRICS else len(HEADLINE_METRICS), k))
        header = ("round", "sites", "samples", *keys, "uplink bytes", "downlink bytes")
        body = [(r["round"], len(r.get("sites", [])), r.get("num_samples"),
                 *(_fmt(r.get("metrics", {}).get(k)) for k in keys), uplink_text(r.get("uplink_bytes"), r.get("metrics")),
                 f"{r.get('downlink_bytes')}" + (f" ({r['downlink_wire_bytes']} on the wire)"
                                                 if r.get("downlink_wire_bytes") else ""))
                for r in rounds]
        lines += ["## Rounds", "", *_table(header, body), ""]
        final = card.get("final_round_metrics") or {}
        lines += ["Final round: " + (", ".join(f"{k} {_fmt(v)}" for k, v in sorted(final.items())
                                               if not is_per_label_metric(k)) or "no metrics"), ""]
    lines += card_markdown_lines(card)

    lines += ["## Privacy", ""]
    privacy, secagg = card.get("privacy"), card.get("secure_aggregation")
    if privacy:
        lines += [*_table(("differential privacy", ""), [(k, _fmt(v)) for k, v in privacy.items()]), ""]
    if secagg:
        lines += [*_table(("secure aggregation", ""), [(k, _fmt(v)) for k, v in secagg.items()]), ""]
    if not privacy and not secagg:
        lines += ["Unknown (no task status)." if not task else
                  "No differential privacy and no secure aggregation were configured for this task. Sites sent "
                  "weight deltas of the trainable tensors; their data never left them.", ""]

    export = card.get("export")
    if export:
        erows: list[tuple[str, Any]] = [("Opset", export.get("opset")),
                                        ("Inputs", ", ".join(export.get("inputs", []))),
                                        ("Outputs", ", ".join(export.get("outputs", [])))]
        for precision in ("fp32", "int8"):
            p = export.get(precision)
            if p:
                text = (f"max abs diff {_fmt(p.get('max_abs_diff'))} (tolerance {_fmt(p.get('tolerance'))}), "
                        f"top-1 agreement {_fmt(p.get('top1_agreement'))} over {p.get('inputs')} inputs")
                if p.get("path_agreement") is not None:
                    text += f", CRF path agreement {_fmt(p['path_agreement'])}"
                if p.get("label_agreement") is not None:
                    text += f", per-label decision agreement {_fmt(p['label_agreement'])}"
                erows.append((f"{precision} parity vs PyTorch", text))
        lines += ["## ONNX export", "", *_table(("", ""), erows), ""]

    notes = card.get("notes") or []
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    lines.append(f"_Written {card.get('created')} by fedclinic {card.get('fedclinic_version')}._")
    return "\n".join(lines) + "\n"


# helpers -------------------------------------------------------------------------------------------------------
def _rounds_of_model(status: Any, model_hash: str, requested_round: int | None, notes: list[str]) -> list[Any]:
    """The closed rounds whose aggregation led to ``model_hash``, in order."""
    # lazy: the protobuf stubs load only when a card is built from a task's status; serving reads cards without them
    from fedclinic.proto import control_pb2

    closed = sorted((r for r in status.rounds if r.state == control_pb2.ROUND_STATE_CLOSED), key=lambda r: r.round)
    if requested_round == -1 or (requested_round is None and model_hash == status.initial_model_hash):
        return []
    if requested_round is not None and requested_round > 0:
        cutoff = requested_round
    else:
        matching = [r.round for r in closed if r.model_hash == model_hash]
        cutoff = matching[-1] if matching else (closed[-1].round if closed else 0)
    rounds = [r for r in closed if r.round <= cutoff]
    if rounds and rounds[-1].model_hash and rounds[-1].model_hash != model_hash:
        notes.append(f"the model's hash differs from the one round {rounds[-1].round} recorded "
                     f"({rounds[-1].model_hash[:12]}); the round history may not describe this model")
    return rounds


UPLINK_METRICS = ("uplink_payload_bytes", "uplink_fp32_bytes", "uplink_wire_bytes", "uplink_reduction")
"""Round metrics of the update codecs' byte accounting (shown in the uplink column, not as metrics)."""


def uplink_text(uplink_bytes: Any, metrics: Any) -> str:
    """A round's uplink bytes, with the float32 equivalent and the reduction when the round recorded them, e.g.
    ``48 (fp32 744, 15.5x smaller; 4278 on the wire)``."""
    m = metrics or {}
    fp32, wire = m.get("uplink_fp32_bytes"), m.get("uplink_wire_bytes")
    if not fp32:
        return f"{uplink_bytes}"
    text = f"{uplink_bytes} (fp32 {int(fp32)}"
    if m.get("uplink_reduction"):
        text += f", {m['uplink_reduction']:.1f}x smaller"
    return text + (f"; {int(wire)} on the wire)" if wire else ")")


def site_bytes(r: Any) -> dict[str, dict[str, int]]:
    """Per reporting site of a RoundSummary: what it sent and fetched, as payload and on the wire."""
    return {rep.site_id: {"uplink": rep.uplink_bytes, "uplink_wire": rep.uplink_wire_bytes,
                          "downlink": rep.downlink_bytes, "downlink_wire": rep.downlink_wire_bytes}
            for rep in sorted(r.reports, key=lambda rep: rep.site_id)}


def _round_entry(r: Any) -> dict[str, Any]:
    return {"round": r.round, "attempt": r.attempt, "sites": sorted(rep.site_id for rep in r.reports),
            "num_samples": sum(rep.num_samples for rep in r.reports), "metrics": dict(sorted(r.metrics.items())),
            "uplink_bytes": r.uplink_bytes, "downlink_bytes": r.downlink_bytes,
            "downlink_wire_bytes": r.downlink_wire_bytes, "site_bytes": site_bytes(r), "model_hash": r.model_hash,
            "closed": _ms(r.closed_unix_ms),
            **({"selected_layers": {rep.site_id: list(rep.selected_layers) for rep in r.reports}}
               if any(rep.selected_layers for rep in r.reports) else {})}


PRIVACY_CORE = ("level", "target_epsilon", "target_delta", "max_grad_norm", "noise_multiplier", "accountant")


def _fields(message: Any) -> dict[str, Any]:
    """Every field of a flat proto message (defaults included), enums by name."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.enum_type is not None:
            value = f.enum_type.values_by_number[value].name.lower() if value in f.enum_type.values_by_number else value
        elif f.is_repeated:
            value = list(value)
        out[f.name] = value
    return out


def _enum_name(message: Any, field: str, prefix: str) -> str:
    f = message.DESCRIPTOR.fields_by_name[field]
    value = getattr(message, field)
    name = f.enum_type.values_by_number[value].name if value in f.enum_type.values_by_number else str(value)
    return name.removeprefix(prefix).lower()


def _clean(value: Any) -> Any:
    """A JSON-safe copy: non-finite floats become null (strict JSON has no NaN), tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _ms(unix_ms: int) -> str | None:
    return _iso(datetime.fromtimestamp(unix_ms / 1000, timezone.utc)) if unix_ms else None


def _fmt(value: Any) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "–"
    return str(value)


def _table(header: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[str]:
    def cell(v: Any) -> str:
        return _fmt(v).replace("|", "\\|").replace("\n", " ")

    return ["| " + " | ".join(cell(h) if h != "" else " " for h in header) + " |",
            "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def _atomic_write(path: Path, text: str) -> None:
    write_atomically(path, text.encode("utf-8"))
