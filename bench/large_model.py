"""A 1.1-billion-parameter model end to end over the real services, with each process's peak memory.

Workload (full run): a random-initialised Llama-shaped causal LM of TinyLlama-1.1B's shape (hidden 2048, 22 layers,
32 attention heads / 4 key-value heads, intermediate 5632, vocab 32000; 1.1 B parameters, 4.4 GB in float32) packaged
by the question-answering family (``fedclinic.models.causal_lm_packaging.package_qa_from_config``) in a separate
process that saves it as a package folder. Then, over mutual TLS on 127.0.0.1 (``LocalFederation``: the aggregator
and one hospital agent as separate processes):

1. **submit** — the SDK client streams the package from the folder (``ModelPackage.load``) to the aggregator;
2. **round** — the aggregator broadcasts round 1, the agent fetches every tensor, trains one local round (SGD with
   the step fused into the backward pass, ``step_in_backward``; ``--ordinary-step`` for the ordinary step), uploads
   an update that covers every tensor (``trainable`` = all) and the aggregator folds it and stores round 1's model;
   the final evaluation phase follows (the site scores the final model);
3. **download** — the SDK client writes the final model as a package folder.

Each phase's peak resident set (``VmHWM`` of ``/proc/PID/status``, reset between phases through
``/proc/PID/clear_refs``) is read for the aggregator and the agent; the SDK client's phases run in a child process
of their own so their peaks are measured the same way. The baseline in the same run is each process's resident set
when idle after start-up (``VmRSS``), and every figure is printed against the model size.

Targets (issue 21): aggregator peak <= 1 GB, agent peak <= model size + 1 GB.

``--smoke`` runs the same path on a tiny Llama (a few MB) in seconds (tests/integration/test_large_model_bench.py);
``--hidden/--layers/--intermediate/--vocab`` pick an intermediate size (the scaling figures in
docs/results/large-model.md). The full run is ``make bench-large``.

Prints the per-phase table and ends with ``RESULT large_model ... met=yes|no``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GB = 1e9
#: TinyLlama-1.1B's shape
FULL = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "intermediate": 5632, "vocab": 32000}
SMOKE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 2000}
DATASET = "qa"


def llama_config(shape: dict) -> dict:
    """The HF config dict of a Llama of ``shape`` (untied head, as TinyLlama)."""
    return {"model_type": "llama", "hidden_size": shape["hidden"], "num_hidden_layers": shape["layers"],
            "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
            "intermediate_size": shape["intermediate"], "vocab_size": shape["vocab"], "max_position_embeddings": 64,
            "tie_word_embeddings": False}


def parameters(shape: dict) -> int:
    """Parameter count of the Llama of ``shape`` (embeddings, untied head, attention, MLP, norms)."""
    h, i, v, layers = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    kv = h * shape["kv_heads"] // shape["heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * v * h + layers * per_layer + h


# --- memory of a process -------------------------------------------------------------------------------------------
def status_kb(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/PID/status (VmHWM: peak resident set; VmRSS: resident set now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Start a new peak: VmHWM becomes the current resident set (Linux ``clear_refs`` 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Sampler:
    """Samples each process's anonymous and file-backed resident memory (``RssAnon``/``RssFile``) every 50 ms,
    keeping the largest of each per phase: what a peak was made of (VmHWM gives the exact peak)."""

    def __init__(self, procs: dict[str, int]) -> None:
        import threading

        self.procs = procs
        self.peaks: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, pid in list(self.procs.items()):
                try:
                    values = {k: status_kb(pid, k) * 1024 for k in ("RssAnon", "RssFile")}
                except (OSError, KeyError):
                    continue
                mine = self.peaks.setdefault(name, {})
                for k, v in values.items():
                    mine[k] = max(mine.get(k, 0), v)

    def take(self) -> dict[str, dict[str, int]]:
        """The peaks since the last take (a new phase starts)."""
        out, self.peaks = self.peaks, {}
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# --- the package, made in a process of its own -----------------------------------------------------------------------
def make_package(shape: dict, folder: Path, seed: int) -> None:
    """Save a seeded Llama of ``shape`` as a question-answering package folder (run in a child process)."""
    from fedclinic.models.causal_lm import package_qa_from_config
    from tests.helpers.qa_models import tokenizer_json

    pkg = package_qa_from_config(tokenizer_json=tokenizer_json(), config=llama_config(shape), seed=seed,
                                 max_length=16, max_new_tokens=2, eval_examples=2)
    pkg.save(folder)


def _child(argv: list[str]) -> dict:
    """Run ``python bench/large_model.py --child ...`` and return the JSON it prints last (with its peak RSS)."""
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"child {argv[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_main(argv: list[str]) -> int:
    """The client-side jobs, each in its own process so its peak memory is its own."""
    job = argv[0]
    if job == "package":
        make_package(json.loads(argv[1]), Path(argv[2]), int(argv[3]))
        out: dict = {}
    elif job == "submit":
        from fedclinic.client import connect
        from fedclinic.spec.task import Task
        from fedclinic.transport.package import ModelPackage

        creds, address, folder, task_doc = json.loads(argv[1]), argv[2], Path(argv[3]), json.loads(argv[4])
        package = ModelPackage.load(folder, mapped=True)  # hashed and streamed one tensor at a time
        with connect(address, server_name="localhost", **creds) as client:
            out = {"task_id": client.submit(Task(**task_doc), package=package).task_id}
    elif job == "download":
        from fedclinic.client import connect

        creds, address, task_id, folder = json.loads(argv[1]), argv[2], argv[3], Path(argv[4])
        with connect(address, server_name="localhost", **creds) as client:
            client.download(task_id, folder)
        out = {}
    else:
        raise SystemExit(f"unknown child job {job!r}")
    out["peak_kb"] = status_kb(os.getpid(), "VmHWM")
    print(json.dumps(out), flush=True)
    return 0


# --- the run ---------------------------------------------------------------------------------------------------------
def _write_data(folder: Path) -> dict:
    from tests.helpers.qa_models import toy_examples

    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps({"question": e.question, "answer": e.answer}) + "\n" for e in toy_examples()[:2])
    (folder / "train.jsonl").write_text(rows)
    (folder / "eval.jsonl").write_text(rows)
    return {"path": str(folder / "train.jsonl"), "eval_path": str(folder / "eval.jsonl")}


def run(shape: dict, out: Path, *, seed: int = 1, timeout: float = 3600, trainable: tuple[str, ...] = (),
        step_in_backward: bool = True,
        in_process_package: bool = False) -> dict:
    """Submit, train one round, fold and download the Llama of ``shape``; return per-phase peaks in bytes."""
    from fedclinic.client import connect, state_name
    from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
    from tests.helpers.federation import streams_open

    params = parameters(shape)
    model_bytes = 4 * params
    folder = out / "package"
    t0 = time.monotonic()
    if in_process_package:  # the smoke's few-MB model: no process of its own needed (saves its start-up)
        make_package(shape, folder, seed)
        made = ""
    else:
        made = f" (packaging process peak {_child(['package', json.dumps(shape), str(folder), str(seed)])['peak_kb'] / 1e6:.2f} GB)"
    print(f"model: {params / 1e6:.1f} M parameters, {model_bytes / GB:.3f} GB float32; packaged in "
          f"{time.monotonic() - t0:.0f} s{made}", flush=True)
    site = "hospital-a"
    setup = SiteSetup(site, datasets={DATASET: _write_data(out / "data")},
                      policy={"allowed_families": ["question-answering"], "allowed_datasets": [DATASET],
                              "min_cell_rows": 1})
    task = {"name": "bench-large-model", "family": "question-answering", "architecture": "causal-lm",
            "dataset": DATASET, "num_rounds": 1, "min_sites": 1, "local_epochs": 1, "batch_size": 1,
            "learning_rate": 1e-4, "optimizer": "sgd", "max_length": 16, "round_timeout_s": int(timeout),
            "on_quorum_miss": "fail", "seed": seed}
    if step_in_backward:  # the optimizer step fused into the backward pass (fedclinic.training.fused_step)
        task.update(step_in_backward=True, max_grad_norm=0.0)
    if trainable:
        task["trainable"] = list(trainable)
    peaks: dict[str, dict[str, int]] = {}
    client_peaks: dict[str, int] = {}
    times: dict[str, float] = {}
    with LocalFederation(out / "federation", [setup], agent_threads=1) as fed:
        fed.make_pki()
        fed.start_aggregator()
        procs = {"aggregator": fed.aggregator.pid}
        creds = json.dumps(fed.creds("scientist"))
        idle = {"aggregator": status_kb(fed.aggregator.pid, "VmRSS") * 1024}

        sampler = Sampler(procs)
        parts: dict[str, dict] = {}

        def phase(name: str, started: float) -> None:
            times[name] = time.monotonic() - started
            peaks[name] = {p: status_kb(pid, "VmHWM") * 1024 for p, pid in procs.items()}
            parts[name] = sampler.take()
            for pid in procs.values():
                reset_peak(pid)

        reset_peak(fed.aggregator.pid)
        t = time.monotonic()  # 1. submit: the client streams the package folder to the aggregator
        sub = _child(["submit", creds, fed.address, str(folder), json.dumps(task)])
        client_peaks["submit"] = sub["peak_kb"] * 1024
        phase("submit", t)
        # 2. the round: the agent starts now (so its fetch is not mixed into the submission), opens its work
        # stream, fetches the model, trains, uploads; the aggregator folds and closes the round; evaluation follows
        agent = fed.start_agent(site)
        wait_until(lambda: site in streams_open(fed), 300, "the agent to open its work stream",
                   check=lambda: None if agent.poll() is None else _died("agent", fed))
        procs["agent"] = agent.pid
        idle["agent"] = status_kb(agent.pid, "VmRSS") * 1024
        reset_peak(agent.pid)
        t = time.monotonic()
        with connect(fed.address, server_name="localhost", **fed.creds("scientist")) as client:
            final = client.wait(sub["task_id"], timeout=timeout, progress=False)
        if state_name(final.state) != "completed":
            raise SystemExit(f"the task ended {state_name(final.state)}: {final.error}")
        phase("round", t)
        uplink = sum(int(r.uplink_bytes) for r in final.rounds)
        # the agent's work is done: stopped before the download so that the client's copy of the model does not
        # sit beside the agent's on this host (the agent's peak is already read)
        fed.signal_agent(site)
        del procs["agent"]
        t = time.monotonic()  # 3. download: the client writes the final model as a package folder
        down = _child(["download", creds, fed.address, sub["task_id"], str(out / "final")])
        client_peaks["download"] = down["peak_kb"] * 1024
        phase("download", t)
        sampler.stop()
    return {"params": params, "model_bytes": model_bytes, "idle": idle, "peaks": peaks, "client": client_peaks,
            "times": times, "uplink_bytes": uplink, "trainable": list(trainable), "sampled": parts,
            "step_in_backward": step_in_backward}


def _died(name: str, fed) -> None:
    raise SystemExit(f"the {name} exited; its log:\n{fed.log_text('agent-hospital-a')[-3000:]}")


def report(res: dict) -> tuple[bool, str]:
    """Print the table (peaks against the idle baseline and the model size); return (met, RESULT line)."""
    mb = res["model_bytes"]
    print(f"\n{'phase':10s} {'aggregator GB':>14s} {'agent GB':>10s} {'client GB':>10s} {'seconds':>8s}   "
          "sampled peaks, anonymous / file-backed GB")
    print(f"{'idle':10s} {res['idle']['aggregator'] / GB:14.3f} {res['idle'].get('agent', 0) / GB:10.3f}")
    for name, p in res["peaks"].items():
        client = res["client"].get(name)
        agent = f"{p['agent'] / GB:10.3f}" if "agent" in p else f"{'-':>10s}"
        sampled = "  ".join(f"{proc} {v.get('RssAnon', 0) / GB:.3f} / {v.get('RssFile', 0) / GB:.3f}"
                            for proc, v in res.get("sampled", {}).get(name, {}).items())
        print(f"{name:10s} {p['aggregator'] / GB:14.3f} {agent} "
              f"{(f'{client / GB:10.3f}' if client else f'{chr(45):>10s}')} {res['times'][name]:8.1f}   {sampled}")
    agg = max(p["aggregator"] for p in res["peaks"].values())
    agent = max(p.get("agent", 0) for p in res["peaks"].values())
    client = max(res["client"].values())
    growth = {"aggregator": agg - res["idle"]["aggregator"], "agent": agent - res["idle"]["agent"]}
    print(f"\nmodel {mb / GB:.3f} GB ({res['params'] / 1e6:.1f} M parameters); update uploaded "
          f"{res['uplink_bytes'] / GB:.3f} GB ({res['uplink_bytes'] / mb:.2f}x the model"
          f"{', trainable ' + ' '.join(res['trainable']) if res['trainable'] else ', every tensor trained'}"
          f"{' with the step fused into the backward pass' if res.get('step_in_backward') else ' with the ordinary step'})")
    print(f"peak / model size: aggregator {agg / mb:.2f}x, agent {agent / mb:.2f}x, client {client / mb:.2f}x; "
          f"growth over idle / model size: aggregator {growth['aggregator'] / mb:.2f}x, agent "
          f"{growth['agent'] / mb:.2f}x")
    met = agg <= 1 * GB and agent <= mb + 1 * GB
    line = (f"RESULT large_model params={res['params'] / 1e9:.3f}B model_gb={mb / GB:.3f} "
            f"uplink_gb={res['uplink_bytes'] / GB:.3f} aggregator_peak_gb={agg / GB:.3f} "
            f"agent_peak_gb={agent / GB:.3f} agent_over_model_gb={(agent - mb) / GB:.3f} "
            f"client_peak_gb={client / GB:.3f} target=aggregator<=1GB,agent<=model+1GB met={'yes' if met else 'no'}")
    return met, line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny Llama (seconds) instead of the 1.1 B one")
    for key in FULL:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"override the shape's {key}")
    ap.add_argument("--trainable", nargs="*", default=[],
                    help="the task's trainable patterns (default: every tensor, so the update is full-size)")
    ap.add_argument("--ordinary-step", action="store_true",
                    help="train with the ordinary optimizer step (all gradients kept until the step, clipping at "
                         "1.0) instead of the step fused into the backward pass")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", help="work folder (default: a temporary one, removed after)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    shape.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    with tempfile.TemporaryDirectory(prefix="bench-large-", dir=args.out) as tmp:
        res = run(shape, Path(tmp), seed=args.seed, trainable=tuple(args.trainable), in_process_package=args.smoke,
                  step_in_backward=not args.ordinary_step)
    met, line = report(res)
    if args.json:
        Path(args.json).write_text(json.dumps({**res, "shape": shape, "met": met}, indent=2))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
