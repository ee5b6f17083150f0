"""Answer generation with an exported causal LM on onnxruntime: numpy only, no torch (serving must not need it).

The graph is the one :mod:`fedclinic.export.causal_lm` writes (``model.onnx``): one decoder step with past
key/values::

    inputs   input_ids [batch, seq] int64, attention_mask [batch, past + seq] int64,
             position_ids [batch, seq] int64,
             past_key_values.{i}.key / .value [batch, kv_heads, past, head_dim] float32   (i = 0 .. layers - 1)
    outputs  logits [batch, seq, vocab] float32, present.{i}.key / .value [batch, kv_heads, past + seq, head_dim]

The first step feeds the whole left-padded prompt batch with ``past`` of length 0; every later step feeds the
chosen token of each row and the ``present`` tensors of the step before as ``past``. Prompts, padding, position
ids, the stopping rule and decoding come from :mod:`fedclinic.data.qa_prompt`, the same code the PyTorch model
(:meth:`fedclinic.models.causal_lm.CausalLMModel.generate`) uses, so greedy answers are the same token for token
(``fedclinic export onnx`` checks exactly that).

Greedy decoding takes ``argmax`` (the first index on ties, as torch does). Sampling (``do_sample=True``) draws
from ``softmax(logits / temperature)`` restricted to the nucleus (the smallest set of most likely tokens whose
probability reaches ``top_p``), with a ``numpy.random.Generator`` seeded by ``seed``: reproducible for the same
inputs, batch size and seed, but not the same draws as PyTorch's sampler (a different random generator).

:class:`OnnxQAModel` wraps the graph with a bundle's tokenizer and ``fedclinic_model.json`` (prompt settings,
EOS/BOS/padding ids, ``max_length``, ``max_positions``, ``generation.max_new_tokens``)::

    qa = OnnxQAModel.load("onnx-model/")
    qa.generate(["What is sertraline used for?"])          # ["Depression."]
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.data.qa_prompt import (
    check_generation_args,
    cut_at_eos,
    decode_answers,
    generation_steps,
    left_pad,
    prompt_budget,
    prompt_token_ids,
    truncate_prompts,
)
from fedclinic.models.base import load_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    import onnxruntime
    import tokenizers

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"
#: default cap on generated tokens when the bundle does not say (the family's default)
MAX_NEW_TOKENS = 64
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def past_name(layer: int, kind: str) -> str:
    """Graph input holding layer ``layer``'s cached ``kind`` ("key" or "value")."""
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """Graph output holding layer ``layer``'s ``kind`` after this step (the next step's past)."""
    return f"present.{layer}.{kind}"


class OnnxCausalLM:
    """One exported decoder graph on onnxruntime: a forward step with past key/values, and batched generation.

    ``session`` is an ``onnxruntime.InferenceSession`` of a graph with the inputs and outputs of the module
    docstring; the layer count, key/value heads and head size are read from its inputs. ``max_positions`` is
    the model's position limit (None: none); generation never runs past it.
    """

    def __init__(self, session: "onnxruntime.InferenceSession", *, eos_id: int, pad_id: int,
                 max_positions: int | None) -> None:
        self.session = session
        self.eos_id, self.pad_id = int(eos_id), int(pad_id)
        self.max_positions = None if max_positions is None else int(max_positions)
        inputs = {i.name: i for i in session.get_inputs()}
        missing = [n for n in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) if n not in inputs]
        layers = sorted({int(m.group(1)) for n in inputs if (m := _PAST.match(n))})
        if missing or not layers or layers != list(range(len(layers))):
            raise IntegrityError(f"the ONNX graph is not a fedclinic causal-LM export (inputs {sorted(inputs)}); "
                                 "re-export the model with `fedclinic export onnx`")
        self.num_layers = len(layers)
        shape = inputs[past_name(0, "key")].shape
        if len(shape) != 4 or not all(isinstance(d, int) for d in (shape[1], shape[3])):
            raise IntegrityError(f"past key/value inputs must be [batch, kv_heads, past, head_dim] with fixed heads "
                                 f"and head size, got {shape}; re-export the model with `fedclinic export onnx`")
        self.kv_heads, self.head_dim = int(shape[1]), int(shape[3])
        self._outputs = [LOGITS] + [present_name(i, k) for i in range(self.num_layers) for k in ("key", "value")]
        outputs = {o.name for o in session.get_outputs()}
        if not set(self._outputs) <= outputs:
            raise IntegrityError(f"the ONNX graph lacks output(s) {sorted(set(self._outputs) - outputs)}; re-export "
                                 "the model with `fedclinic export onnx`")

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """Past key/values of length 0 for a first step: ``[key_0, value_0, key_1, ...]``."""
        return [np.zeros((batch, self.kv_heads, 0, self.head_dim), np.float32) for _ in range(2 * self.num_layers)]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             past: Sequence[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """One decoder step: ``(logits [batch, seq, vocab], present [key_0, value_0, ...])``."""
        feeds: dict[str, np.ndarray] = {INPUT_IDS: np.ascontiguousarray(input_ids, np.int64),
                                        ATTENTION_MASK: np.ascontiguousarray(attention_mask, np.int64),
                                        POSITION_IDS: np.ascontiguousarray(position_ids, np.int64)}
        for i in range(self.num_layers):
            feeds[past_name(i, "key")], feeds[past_name(i, "value")] = past[2 * i], past[2 * i + 1]
        logits, *present = self.session.run(self._outputs, feeds)
        return logits, present

    def prompt_logits(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The first step on a left-padded batch: ``(logits [batch, width, vocab], attention_mask)``."""
        ids, mask, positions = left_pad(prompts, self.pad_id)
        logits, _ = self.step(ids, mask, positions, self.empty_past(len(prompts)))
        return logits, mask

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = MAX_NEW_TOKENS,
                     do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                     batch_size: int = 16) -> list[list[int]]:
        """Generated token ids per prompt (without the prompt and without the final EOS).

        Prompts are taken ``batch_size`` at a time, left-padded; each stops at EOS or after ``max_new_tokens``
        (fewer when the model's position limit comes first). Greedy unless ``do_sample``."""
        check_generation_args(prompts, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                              top_p=top_p, batch_size=batch_size)
        rng = np.random.default_rng(int(seed)) if do_sample else None
        out: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            out.extend(self._generate_batch(prompts[start:start + batch_size], max_new_tokens, rng,
                                            float(temperature), float(top_p)))
        return out

    def _generate_batch(self, prompts, max_new_tokens: int, rng, temperature: float, top_p: float) -> list[list[int]]:
        ids, mask, positions = left_pad(prompts, self.pad_id)
        steps = generation_steps(ids.shape[1], max_new_tokens, self.max_positions)
        logits, past = self.step(ids, mask, positions, self.empty_past(len(prompts)))
        last = logits[:, -1, :]
        done = np.zeros(len(prompts), dtype=bool)
        generated: list[np.ndarray] = []
        for step in range(steps):
            nxt = next_token(last, rng, temperature, top_p)
            nxt = np.where(done, self.pad_id, nxt).astype(np.int64)
            generated.append(nxt)
            done |= nxt == self.eos_id
            if bool(done.all()) or step == steps - 1:
                break
            next_pos = mask.sum(-1, keepdims=True)
            mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
            logits, past = self.step(nxt[:, None], mask, next_pos, past)
            last = logits[:, -1, :]
        return cut_at_eos(np.stack(generated, axis=1).tolist(), self.eos_id)


def next_token(logits: np.ndarray, rng: np.random.Generator | None, temperature: float = 1.0,
               top_p: float = 1.0) -> np.ndarray:
    """``[batch, vocab]`` -> ``[batch]``: argmax when ``rng`` is None, else a draw from the temperature-scaled
    nucleus (top-p) distribution (the most likely token always stays in the nucleus)."""
    if rng is None:
        return np.asarray(logits).argmax(axis=-1)
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass of the strictly more likely tokens
        sorted_p = np.where(before >= top_p, 0.0, sorted_p)
        probs = np.zeros_like(probs)
        np.put_along_axis(probs, order, sorted_p, axis=-1)
        probs /= probs.sum(axis=-1, keepdims=True)
    u = 1.0 - rng.random(len(probs))  # in (0, 1]: the draw is the first token whose cumulative mass reaches u
    chosen = (np.cumsum(probs, axis=-1) < u[:, None]).sum(axis=-1)
    last_possible = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)  # rounding can leave u above the sum
    return np.minimum(chosen, last_possible)


class OnnxQAModel:
    """Questions in, generated answers out, with an exported question-answering bundle.

    ``meta`` is the bundle's ``fedclinic_model.json`` (family "question-answering", written by
    ``fedclinic export onnx``: the package's prompt settings and special token ids plus ``max_positions``);
    ``tokenizer`` the bundle's ``tokenizer.json``. Prompts are built exactly as in training
    (:mod:`fedclinic.data.qa_prompt`).
    """

    def __init__(self, session: "onnxruntime.InferenceSession", meta: Mapping[str, Any],
                 tokenizer: "tokenizers.Tokenizer") -> None:
        prompt = meta.get("prompt")
        if not isinstance(prompt, dict) or not all(isinstance(prompt.get(k), str) for k in
                                                    ("template", "context_template", "answer_prefix")):
            raise IntegrityError("fedclinic_model.json of a question-answering bundle needs prompt settings "
                                 "(template, context_template, answer_prefix); re-export the model")
        ids = {k: meta.get(k) for k in ("eos_token_id", "pad_token_id")}
        bad = [k for k, v in ids.items() if not isinstance(v, int) or isinstance(v, bool)]
        if bad or not (meta.get("bos_token_id") is None or isinstance(meta.get("bos_token_id"), int)):
            raise IntegrityError(f"fedclinic_model.json of a question-answering bundle needs integer "
                                 f"{', '.join(bad) or 'bos_token_id'}; re-export the model")
        if "max_positions" not in meta:
            raise ConfigError("fedclinic_model.json has no max_positions (the bundle predates ONNX export of "
                              "question-answering models); re-run `fedclinic export onnx` into a fresh folder")
        self.meta = dict(meta)
        self.prompt_settings = dict(prompt)
        self.tokenizer = tokenizer
        self.max_length = int(meta.get("max_length", 128))
        self.bos_id = None if meta.get("bos_token_id") is None else int(meta["bos_token_id"])
        self.max_new_tokens = int((meta.get("generation") or {}).get("max_new_tokens", MAX_NEW_TOKENS))
        max_positions = meta["max_positions"]
        self.lm = OnnxCausalLM(session, eos_id=int(ids["eos_token_id"]), pad_id=int(ids["pad_token_id"]),
                               max_positions=None if max_positions is None else int(max_positions))

    @classmethod
    def load(cls, folder: str | Path, *, int8: bool = False, threads: int = 0) -> "OnnxQAModel":
        """The bundle in ``folder`` (``model.onnx``, or ``model.int8.onnx`` with ``int8``)."""
        import onnxruntime as ort

        root = Path(folder)
        name = "model.int8.onnx" if int8 else "model.onnx"
        for needed in (name, "fedclinic_model.json", "tokenizer.json"):
            if not (root / needed).is_file():
                raise ConfigError(f"{root} has no {needed}; create the bundle with `fedclinic export onnx MODEL_DIR "
                                  f"{root}`" + (" --int8" if needed == name and int8 else ""))
        meta = json.loads((root / "fedclinic_model.json").read_text(encoding="utf-8"))
        if meta.get("family") != "question-answering":
            raise ConfigError(f"{root} holds a {meta.get('family')} model, not a question-answering one")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        session = ort.InferenceSession(str(root / name), options, providers=["CPUExecutionProvider"])
        return cls(session, meta, load_tokenizer((root / "tokenizer.json").read_bytes()))

    @property
    def prompt_budget(self) -> int:
        """Most prompt tokens (BOS included) a question may take."""
        return prompt_budget(self.max_length)

    def prompt_ids(self, questions: Sequence[str], contexts: Sequence[str] | None = None, *,
                   strict: bool = False) -> list[list[int]]:
        """Prompt token ids per question; cut from the left to the prompt budget as in training, or, with
        ``strict``, a DatasetError naming the first question whose prompt does not fit (what a server wants:
        a silently cut question is a different question)."""
        bad = [i for i, q in enumerate(questions) if not isinstance(q, str) or not q.strip()]
        if bad:
            raise DatasetError(f"question {bad[0]} is empty or not a string; every question must be non-empty text")
        if contexts is not None:
            badc = [i for i, c in enumerate(contexts) if not isinstance(c, str)]
            if badc:
                raise DatasetError(f"context {badc[0]} is not a string; give \"\" for a question without context")
        full = prompt_token_ids(self.tokenizer, self.prompt_settings, self.bos_id, list(questions), contexts)
        if strict:
            budget = self.prompt_budget
            for i, ids in enumerate(full):
                if len(ids) > budget:
                    raise DatasetError(f"question {i} is too long: its prompt is {len(ids)} tokens and the model "
                                       f"takes at most {budget} (max_length {self.max_length}); shorten the "
                                       "question or its context")
        return truncate_prompts(full, self.max_length)

    def generate(self, questions: Sequence[str], contexts: Sequence[str] | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, batch_size: int = 16, strict: bool = False) -> list[str]:
        """Answers to ``questions`` (greedy, or sampled when ``do_sample``), as text without the prompt."""
        if isinstance(questions, str):
            raise ConfigError("questions must be a list of strings, not one string")
        prompts = self.prompt_ids(list(questions), contexts, strict=strict)
        ids = self.lm.generate_ids(prompts, max_new_tokens=self.max_new_tokens if max_new_tokens is None else
                                   max_new_tokens, do_sample=do_sample, temperature=temperature, top_p=top_p,
                                   seed=seed, batch_size=batch_size)
        return decode_answers(self.tokenizer, ids)


__all__ = ["OnnxCausalLM", "OnnxQAModel", "next_token", "past_name", "present_name"]
