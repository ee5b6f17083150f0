"""The "question-answering" model family: a causal language model that answers by generation (CancersQA).

``fedclinic_model.json``::

    {"format": 1, "family": "question-answering", "architecture": "causal-lm", "labels": [],
     "max_length": 128, "base_model": "...", "arch_config": {"model_type": "gpt2" | "llama"},
     "eos_token": "<|endoftext|>", "eos_token_id": 0, "bos_token_id": null, "pad_token_id": 0,
     "prompt": {"source": "plain" | "chat_template", "template": "...{question}...",
                "context_template": "...{context}...{question}...", "answer_prefix": " "},
     "generation": {"max_new_tokens": 64, "eval_examples": 32}}

Model: a Hugging Face ``*ForCausalLM`` built with ``AutoModelForCausalLM.from_config`` for a ``model_type`` in
:data:`ALLOWED_MODEL_TYPES` (classes that ship inside transformers; no code is ever fetched). For these types
``logits = lm_head(last_hidden_state)``. Tied output embeddings (``lm_head.weight`` = the input embedding) are
stored and sent once, under the input embedding's name.

Prompt
------
The prompt is fixed when the model is packaged and written into ``fedclinic_model.json``, so training,
evaluation, serving and export build byte-identical prompts without running any template engine::

    prompt(q, c) = template with {question} -> q                       (no context)
                 = context_template with {context} -> c, {question} -> q

(one substitution pass: text inside ``q`` or ``c`` is never substituted again). Two sources:

``chat_template``
    The tokenizer's chat template (``tokenizer_config.json`` ``chat_template``, or ``chat_template.jinja``)
    rendered once, at packaging, by transformers' sandboxed jinja2 renderer (local, no network) for one user
    message whose content is the placeholder ``{question}`` (or ``Context: {context}\\nQuestion: {question}``),
    with the generation prompt (e.g. ``<|im_start|>assistant\\n``) appended. ``answer_prefix`` is "".
``plain``
    ``"Question: {question}\\nAnswer:"`` and ``"Context: {context}\\nQuestion: {question}\\nAnswer:"``;
    ``answer_prefix`` is " " (the answer follows "Answer:" after a space). Used when the tokenizer has no chat
    template (the CancersQA setting: GPT-2, bare question), or when asked for.

Encoding and loss
-----------------
``ids = [bos] + tok(prompt) + tok(answer_prefix + answer) + [eos]`` (tokenized without the tokenizer's own
special-token template; ``bos`` only when ``tokenizer_config.json`` says ``add_bos_token``). Labels are
``-100`` on the prompt and on padding, so the loss covers **answer tokens only** (and the EOS that ends the
answer)::

    L = - (1/|A|) sum_{t in A} log p(x_t | x_<t)       A = answer positions of the batch

Truncation to ``max_length``: the prompt keeps at most ``max_length - max(1, max_length // 4)`` tokens (cut from
the left, so the generation cue at its end survives); the answer (with its EOS) fills the rest and is cut at the
end. Generation uses the same prompt tokens.

Generation
----------
Batched, left-padded, with the key/value cache; greedy (``argmax``) or sampled: ``softmax(logits / temperature)``
restricted to the nucleus (the smallest set of most likely tokens whose probability reaches ``top_p``),
renormalised, drawn with a ``torch.Generator`` seeded by ``seed`` (reproducible for the same inputs, batch size
and seed, whatever the global RNG). Stops at EOS or after ``max_new_tokens`` (and never runs past the model's
position limit). Prompt ids, the left-padded layout with its position ids, the stopping rule and decoding come
from :mod:`fedclinic.data.qa_prompt`, which the onnxruntime loop of an exported model
(:mod:`fedclinic.serving.generate`) shares, so both generate the same greedy tokens.

Evaluation
----------
``loss`` (mean answer-token NLL) and ``token_accuracy`` (teacher-forced argmax == answer token) over all
examples; ``rougeL``, ``bleu``, ``meteor``, ``exact_match`` (:mod:`fedclinic.evaluation.generation`) on greedy
generations of the first ``generation.eval_examples`` examples (default :data:`EVAL_EXAMPLES`; ``n_generated``
says how many), so an evaluation costs at most that many generations.

Module layout
-------------
This module is the loaded model (:class:`CausalLMModel`: encoding, loss, generation, evaluation) and
:func:`build`; making a package is :mod:`fedclinic.models.causal_lm_packaging` and the torch module (allowed
HF classes, config, stored tensor names) :mod:`fedclinic.models.causal_lm_module`. Every public name of both is
importable from here as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models.base import (
    EncodedData,
    HF_CONFIG_FILE,
    LoadedModel,
    TOKENIZER_FILE,
    check_max_length,
    format_names,
    load_tensors,
    load_tokenizer,
    max_positions,
)
from fedclinic.models.causal_lm_module import (  # noqa: F401  (re-exported: the family's public names live here too)
    ALLOWED_MODEL_TYPES,
    ARCHITECTURES,
    EVAL_EXAMPLES,
    FAMILY,
    FORMAT,
    MAX_NEW_TOKENS,
    build_module,
    check_architecture,
    hf_lm_config,
    stored_names,
    tied_aliases,
)
from fedclinic.models.causal_lm_packaging import (  # noqa: F401  (re-exported)
    CHAT_TEMPLATE_FILE,
    PLAIN_CONTEXT_TEMPLATE,
    PLAIN_TEMPLATE,
    PROMPT_CHOICES,
    TOKENIZER_CONFIG_FILE,
    chat_prompt,
    package_qa_from_config,
    package_qa_pretrained,
    plain_prompt,
)
from fedclinic.transport.package import META_FILE, ModelPackage
from fedclinic.data.qa_prompt import (  # noqa: F401  (fill_prompt and prompt_budget are re-exported)
    check_generation_args,
    cut_at_eos,
    decode_answers,
    fill_prompt,
    generation_steps,
    left_pad,
    prompt_budget,
    prompt_token_ids,
    text_token_ids,
    truncate_prompts,
)
from fedclinic.evaluation.generation import generation_scores

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fedclinic.data.qa import QAExample

#: label of positions that are not scored (prompt and padding)
IGNORE = -100


# ------------------------------------------------------------------------------------------------------------
# loaded model and encoded data


@dataclass
class QAData(EncodedData):
    """Tokenized QA examples (CPU tensors): encode once, train many rounds.

    ``labels`` ``[N, L]`` hold the answer token ids (and EOS) at answer positions and :data:`IGNORE` elsewhere;
    ``prompts`` the prompt token ids of each example (what generation starts from) and ``references`` the
    reference answers (what generated answers are scored against).
    """

    prompts: list[list[int]] = field(default_factory=list)
    references: list[str] = field(default_factory=list)
    per_token_labels: ClassVar[bool] = True


@dataclass
class CausalLMModel(LoadedModel):
    """A built QA model: the HF causal LM, the task's tokenizer and the parsed ``fedclinic_model.json``."""

    @property
    def prompt_settings(self) -> dict[str, Any]:
        return dict(self.meta["prompt"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_token_id"])

    @property
    def bos_id(self) -> int | None:
        v = self.meta.get("bos_token_id")
        return None if v is None else int(v)

    @property
    def max_new_tokens(self) -> int:
        return int((self.meta.get("generation") or {}).get("max_new_tokens", MAX_NEW_TOKENS))

    @property
    def eval_examples(self) -> int:
        return int((self.meta.get("generation") or {}).get("eval_examples", EVAL_EXAMPLES))

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.module.config)

    def prompt(self, question: str, context: str = "") -> str:
        """The exact prompt text the model is trained and queried with."""
        return fill_prompt(self.prompt_settings, question, context)

    def logits(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        """``[batch, seq]`` -> next-token logits ``[batch, seq, vocab]`` (position t predicts token t + 1)."""
        return self.module(input_ids=input_ids, attention_mask=attention_mask).logits

    # ---- encoding

    def prompt_ids(self, questions: Sequence[str], contexts: Sequence[str] | None = None, *,
                   max_length: int | None = None) -> list[list[int]]:
        """Token ids of each prompt, left-truncated to the prompt budget of ``max_length``."""
        max_length = self.max_length if max_length is None else max_length
        full = prompt_token_ids(self.tokenizer, self.prompt_settings, self.bos_id, questions, contexts)
        return truncate_prompts(full, max_length)

    def _tokens(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without the tokenizer's special-token template (no [CLS], no BOS)."""
        return text_token_ids(self.tokenizer, texts)

    def encode(self, examples: Sequence["QAExample"], *, max_length: int | None = None) -> QAData:
        """Prompt + answer + EOS per example, labels on the answer only (see the module docstring)."""
        import torch

        max_length = self.max_length if max_length is None else max_length
        check_max_length(max_length)
        if not examples:
            raise DatasetError("no examples to encode; the dataset is empty")
        prefix = str(self.prompt_settings.get("answer_prefix", ""))
        for i, ex in enumerate(examples):
            if not (isinstance(getattr(ex, "question", None), str) and isinstance(getattr(ex, "answer", None), str)):
                raise DatasetError(f"example {i} is not a question/answer example; read the dataset with "
                                   "fedclinic.data.qa.read_qa")
        prompts = self.prompt_ids([ex.question for ex in examples],
                                  [getattr(ex, "context", "") or "" for ex in examples], max_length=max_length)
        answers = self._tokens([prefix + ex.answer for ex in examples])
        rows = [(p, (a + [self.eos_id])[:max_length - len(p)]) for p, a in zip(prompts, answers)]
        width = max(len(p) + len(a) for p, a in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE, dtype=np.int64)
        for i, (p, a) in enumerate(rows):
            n = len(p) + len(a)
            ids[i, :n] = p + a
            mask[i, :n] = 1
            labels[i, len(p):n] = a
        return QAData(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                      labels=torch.from_numpy(labels), multi_label=False, num_labels=0,
                      prompts=[p for p, _ in rows], references=[ex.answer for ex in examples])

    # ---- the trainer's interface (fedclinic.training.trainer)

    def training_loss(self, inputs: tuple["torch.Tensor", ...], targets: "torch.Tensor") -> "torch.Tensor":
        """Mean next-token cross-entropy over the batch's answer tokens (labels != -100)."""
        import torch.nn.functional as F

        logits, gold = self._answer_logits(inputs, targets)
        return F.cross_entropy(logits.float(), gold)

    def loss_units(self, targets: "torch.Tensor") -> int:
        """The answer tokens :meth:`training_loss` is the mean over (data-parallel training weights by them)."""
        return int((targets[:, 1:] != IGNORE).sum())

    def _answer_logits(self, inputs, targets) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Logits ``[T, vocab]`` at the positions that predict an answer token, and those tokens ``[T]``.

        The output layer runs only on these positions (a large vocabulary times every prompt position would
        dominate memory); for the allowed model types this equals slicing the full ``logits``."""
        input_ids, mask = inputs
        hidden = self.module.base_model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        gold = targets[:, 1:]
        on = gold != IGNORE
        return self.module.get_output_embeddings()(hidden[:, :-1][on]), gold[on]

    def evaluate(self, data: QAData, *, batch_size: int = 64, max_generate: int | None = None,
                 max_new_tokens: int | None = None) -> dict[str, float]:
        """Loss, token accuracy and generation metrics (see the module docstring)."""
        import torch
        import torch.nn.functional as F

        if len(data) == 0:
            raise DatasetError("no evaluation examples; the evaluation set is empty")
        module = self.module
        device = next(module.parameters()).device
        was_training = module.training
        module.eval()
        nll = 0.0
        correct = 0
        tokens = 0
        try:
            with torch.no_grad():
                for start in range(0, len(data), batch_size):
                    idx = torch.arange(start, min(start + batch_size, len(data)))
                    inputs, y = data.batch(idx, device)
                    logits, gold = self._answer_logits(inputs, y)
                    nll += float(F.cross_entropy(logits.float(), gold, reduction="sum"))
                    correct += int((logits.argmax(dim=-1) == gold).sum())
                    tokens += int(gold.numel())
            k = min(len(data), self.eval_examples if max_generate is None else int(max_generate))
            out: dict[str, float] = {"loss": nll / max(tokens, 1), "token_accuracy": correct / max(tokens, 1)}
            if k > 0:
                generated = self.generate_from_ids(data.prompts[:k], max_new_tokens=max_new_tokens,
                                                   batch_size=min(batch_size, 32))
                out.update(generation_scores(generated, data.references[:k]))
        finally:
            module.train(was_training)
        return {**out, "n": float(len(data)), "n_generated": float(k)}

    # ---- generation

    def generate(self, questions: Sequence[str], contexts: Sequence[str] | None = None, *,
                 max_new_tokens: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, batch_size: int = 16) -> list[str]:
        """Answers to ``questions`` (greedy, or sampled when ``do_sample``), as text without the prompt."""
        if isinstance(questions, str):
            raise ConfigError("questions must be a list of strings, not one string")
        prompts = self.prompt_ids(list(questions), contexts)
        return self.generate_from_ids(prompts, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                      temperature=temperature, top_p=top_p, seed=seed, batch_size=batch_size)

    def answer(self, question: str, context: str = "", **kwargs: Any) -> str:
        """One answer (see :meth:`generate`)."""
        return self.generate([question], [context], **kwargs)[0]

    def generate_from_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                          do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                          batch_size: int = 16) -> list[str]:
        ids = self.generate_ids(prompts, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                top_p=top_p, seed=seed, batch_size=batch_size)
        return decode_answers(self.tokenizer, ids)

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                     do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                     batch_size: int = 16) -> list[list[int]]:
        """Generated token ids per prompt (without the prompt and without the final EOS)."""
        import torch

        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_generation_args(prompts, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                              top_p=top_p, batch_size=batch_size)
        module = self.module
        device = next(module.parameters()).device
        gen = torch.Generator(device=device).manual_seed(int(seed)) if do_sample else None
        was_training = module.training
        module.eval()
        out: list[list[int]] = []
        try:
            with torch.no_grad():
                for start in range(0, len(prompts), batch_size):
                    out.extend(self._generate_batch(prompts[start:start + batch_size], max_new_tokens, device,
                                                    gen, float(temperature), float(top_p)))
        finally:
            module.train(was_training)
        return out

    def _generate_batch(self, prompts, max_new_tokens: int, device, gen, temperature: float,
                        top_p: float) -> list[list[int]]:
        import torch

        ids, mask, positions = (torch.from_numpy(a).to(device) for a in left_pad(prompts, self.pad_id))
        steps = generation_steps(ids.shape[1], max_new_tokens, self.max_positions)
        result = self.module(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        past = result.past_key_values
        logits = result.logits[:, -1, :]
        done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        generated: list["torch.Tensor"] = []
        for step in range(steps):
            nxt = _next_token(logits.float(), gen, temperature, top_p)
            nxt = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)
            generated.append(nxt)
            done |= nxt == self.eos_id
            if bool(done.all()) or step == steps - 1:
                break
            next_pos = mask.sum(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(nxt).unsqueeze(1)], dim=1)
            result = self.module(input_ids=nxt.unsqueeze(1), attention_mask=mask, position_ids=next_pos,
                                 past_key_values=past, use_cache=True)
            past = result.past_key_values
            logits = result.logits[:, -1, :]
        return cut_at_eos(torch.stack(generated, dim=1).cpu().tolist(), self.eos_id)


def _next_token(logits: "torch.Tensor", gen, temperature: float, top_p: float) -> "torch.Tensor":
    """Greedy when ``gen`` is None; else a draw from the temperature-scaled nucleus (top-p) distribution."""
    import torch

    if gen is None:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the strictly more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs / probs.sum(dim=-1, keepdim=True), 1, generator=gen).squeeze(1)


# ------------------------------------------------------------------------------------------------------------
# building


def build(package: ModelPackage) -> CausalLMModel:
    """Build the causal LM of a question-answering package and load its tensors strictly."""
    meta = package.meta
    check_architecture(meta.get("architecture"))
    for key in ("prompt", "eos_token_id", "pad_token_id"):
        if key not in meta:
            raise IntegrityError(f"{META_FILE} has no {key!r}; re-package the model with "
                                 "fedclinic.models.causal_lm.package_qa_pretrained()")
    prompt = meta["prompt"]
    if not isinstance(prompt, dict) or not all(isinstance(prompt.get(k), str) for k in
                                                ("template", "context_template", "answer_prefix")):
        raise IntegrityError(f"{META_FILE} prompt must hold template, context_template and answer_prefix strings")
    tok_bytes = package.files.get(TOKENIZER_FILE)
    raw = package.files.get(HF_CONFIG_FILE)
    if tok_bytes is None or raw is None:
        raise IntegrityError(f"a question-answering package needs {TOKENIZER_FILE} and {HF_CONFIG_FILE}")
    tokenizer = load_tokenizer(tok_bytes)
    hf = json.loads(raw)
    declared = (meta.get("arch_config") or {}).get("model_type")
    if declared is not None and declared != hf.get("model_type"):
        raise IntegrityError(f"{META_FILE} says model_type {declared!r} but {HF_CONFIG_FILE} says "
                             f"{hf.get('model_type')!r}")
    config = hf_lm_config(hf)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if int(config.vocab_size) < vocab:
        raise IntegrityError(f"{TOKENIZER_FILE} has {vocab} tokens but the model's vocab_size is {config.vocab_size}")
    for key in ("eos_token_id", "pad_token_id"):
        if not (isinstance(meta[key], int) and 0 <= meta[key] < vocab):
            raise IntegrityError(f"{META_FILE} {key} {meta[key]!r} is not a token id of {TOKENIZER_FILE}")
    module = build_module(config, 0)
    expected = stored_names(module)
    missing = [n for n in expected if n not in package.tensors]
    unexpected = [n for n in package.tensors if n not in set(expected)]
    if missing or unexpected:
        parts = ([f"missing tensor(s) {format_names(missing)}"] if missing else []) + (
            [f"unexpected tensor(s) {format_names(unexpected)}"] if unexpected else [])
        raise IntegrityError("the package's weights do not match its declared model: " + "; ".join(parts))
    load_tensors(module, package.tensors)
    module.eval()
    return CausalLMModel(module=module, tokenizer=tokenizer, meta=meta, pad_id=int(meta["pad_token_id"]))



__all__ = ["ALLOWED_MODEL_TYPES", "ARCHITECTURES", "CausalLMModel", "EVAL_EXAMPLES", "FAMILY", "IGNORE",
           "MAX_NEW_TOKENS", "PLAIN_TEMPLATE", "QAData", "build", "chat_prompt", "fill_prompt",
           "package_qa_from_config", "package_qa_pretrained", "plain_prompt", "prompt_budget", "stored_names",
           "tied_aliases"]
