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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models.base import (
    EncodedData,
    HF_CONFIG_FILE,
    LoadedModel,
    TOKENIZER_FILE,
    check_max_length,
    format_names,
    hf_config_bytes,
    load_tensors,
    load_tokenizer,
    max_positions,
    module_tensors,
    read_checkpoint,
    seeded,
)
from fedclinic.transport.package import META_FILE, WEIGHTS_FILE, ModelPackage, meta_bytes
from fedclinic.data.qa_prompt import (
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

FAMILY = "question-answering"
FORMAT = 1
ARCHITECTURES = ("causal-lm",)
#: HF ``model_type`` values whose causal-LM classes may be built (GPT-2 family; Llama, e.g. SmolLM2).
ALLOWED_MODEL_TYPES = ("gpt2", "llama")
#: label of positions that are not scored (prompt and padding)
IGNORE = -100
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: plain-JSON/text tokenizer side files copied from a pretrained folder (the package stays a usable HF folder)
_SIDE_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json", CHAT_TEMPLATE_FILE, "generation_config.json")
#: how many evaluation examples get a generated answer by default (generation dominates evaluation time)
EVAL_EXAMPLES = 32
#: default cap on generated tokens per answer
MAX_NEW_TOKENS = 64
PLAIN_TEMPLATE = "Question: {question}\nAnswer:"
PLAIN_CONTEXT_TEMPLATE = "Context: {context}\nQuestion: {question}\nAnswer:"
CHAT_USER_CONTENT = "{question}"
CHAT_USER_CONTENT_WITH_CONTEXT = "Context: {context}\nQuestion: {question}"
PROMPT_CHOICES = ("auto", "chat", "plain")
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<|end_of_text|>", "[EOS]", "<EOS>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<PAD>", "<|pad|>")


# ------------------------------------------------------------------------------------------------------------
# prompt (fill_prompt, prompt_budget and the token layout live in fedclinic.data.qa_prompt, shared with the
# onnxruntime generation loop of an exported model)


def plain_prompt() -> dict[str, Any]:
    return {"source": "plain", "template": PLAIN_TEMPLATE, "context_template": PLAIN_CONTEXT_TEMPLATE,
            "answer_prefix": " "}


def chat_prompt(chat_template: str, special_tokens: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Render ``chat_template`` once for a user turn holding the placeholders, plus the generation prompt.

    Uses transformers' sandboxed jinja2 renderer (nothing is fetched). Raises ConfigError when the template
    does not render or does not keep the user's text verbatim (then package with ``prompt="plain"``)."""
    out = {"source": "chat_template", "answer_prefix": ""}
    for key, content, needed in (("template", CHAT_USER_CONTENT, ("{question}",)),
                                 ("context_template", CHAT_USER_CONTENT_WITH_CONTEXT, ("{context}", "{question}"))):
        try:
            text = _render_chat(chat_template, [{"role": "user", "content": content}], dict(special_tokens or {}))
        except Exception as exc:  # jinja2 template and sandbox errors, a missing jinja2
            raise ConfigError(f"the tokenizer's chat template does not render ({type(exc).__name__}: {exc}); "
                              "package the model with prompt=\"plain\"") from None
        for ph in needed:
            if text.count(ph) != 1:
                raise ConfigError(f"the tokenizer's chat template does not keep the user's message verbatim "
                                  f"({ph} appears {text.count(ph)} times in {text!r}); package the model with "
                                  "prompt=\"plain\"")
        out[key] = text
    return out


def _render_chat(chat_template: str, messages: list[dict[str, str]], special_tokens: dict[str, str]) -> str:
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # transformers < 4.49: the compiled template is there, the wrapper is not
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(chat_template).render(messages=messages, add_generation_prompt=True,
                                                             **special_tokens)
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=chat_template,
                                        add_generation_prompt=True, **special_tokens)
    return rendered[0]


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
# packaging and building


def _check_architecture(architecture: Any) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; "
                          f"choose one of: {', '.join(ARCHITECTURES)}")
    return str(architecture)


def _check_model_type(model_type: Any) -> str:
    if model_type not in ALLOWED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not allowed for the causal-lm architecture; allowed: "
                          f"{', '.join(ALLOWED_MODEL_TYPES)} (classes built into transformers; no remote code is "
                          "ever run)")
    return str(model_type)


def _hf_lm_config(config_dict: Mapping[str, Any]):
    from transformers import AutoConfig

    d = dict(config_dict)
    model_type = _check_model_type(d.pop("model_type", None))
    for key in ("_name_or_path", "auto_map", "trust_remote_code", "architectures", "quantization_config",
                "id2label", "label2id", "num_labels", "problem_type"):
        d.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, **d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {model_type} config: {exc}") from None


def _build_module(config, seed: int):
    from transformers import AutoModelForCausalLM

    with seeded(seed):
        module = AutoModelForCausalLM.from_config(config)
    return module.float()


def tied_aliases(module) -> list[str]:
    """State-dict names that are the same tensor as an earlier name (tied output embeddings): not stored."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases = []
    for name, t in module.state_dict().items():
        if t.numel() == 0:
            continue
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            aliases.append(name)
        else:
            seen[key] = name
    return aliases


def stored_names(module) -> list[str]:
    """The tensors a package holds: every state-dict entry except tied aliases."""
    aliases = set(tied_aliases(module))
    return [n for n in module.state_dict() if n not in aliases]


def _token_name(value: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_ids(tokenizer, tokenizer_config: Mapping[str, Any], hf_config: Mapping[str, Any],
                 eos_token: str | None) -> dict[str, Any]:
    """EOS (required), BOS (only when the tokenizer adds one) and the padding id."""
    def tid(name: str | None) -> int | None:
        return None if name is None else tokenizer.token_to_id(name)

    if eos_token is not None:
        if tid(eos_token) is None:
            raise ConfigError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
        eos = eos_token
    else:
        eos = _token_name(tokenizer_config.get("eos_token"))
        if eos is None or tid(eos) is None:
            cfg_eos = hf_config.get("eos_token_id")
            cfg_eos = cfg_eos[0] if isinstance(cfg_eos, list) and cfg_eos else cfg_eos
            eos = tokenizer.id_to_token(cfg_eos) if isinstance(cfg_eos, int) else None
        if eos is None or tid(eos) is None:
            eos = next((c for c in _EOS_CANDIDATES if tid(c) is not None), None)
        if eos is None:
            raise ConfigError("cannot tell the tokenizer's end-of-sequence token (no eos_token in "
                              f"{TOKENIZER_CONFIG_FILE}, no eos_token_id in {HF_CONFIG_FILE}, none of "
                              f"{', '.join(_EOS_CANDIDATES)} in the vocabulary); pass eos_token=")
    eos_id = int(tid(eos))
    bos_id = None
    if tokenizer_config.get("add_bos_token"):
        bos = _token_name(tokenizer_config.get("bos_token"))
        if bos is None or tid(bos) is None:
            raise ConfigError(f"{TOKENIZER_CONFIG_FILE} sets add_bos_token but its bos_token is not in the vocabulary")
        bos_id = int(tid(bos))
    pad = _token_name(tokenizer_config.get("pad_token"))
    pad_id = tid(pad) if pad else None
    if pad_id is None:
        pad_id = next((tid(c) for c in _PAD_CANDIDATES if tid(c) is not None), None)
    return {"eos_token": eos, "eos_token_id": eos_id, "bos_token_id": bos_id,
            "pad_token_id": int(eos_id if pad_id is None else pad_id)}


def _resolve_prompt(prompt: str, chat_template: str | None, tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    if prompt not in PROMPT_CHOICES:
        raise ConfigError(f"prompt must be one of {', '.join(PROMPT_CHOICES)}, got {prompt!r}")
    if prompt == "plain" or (prompt == "auto" and not chat_template):
        return plain_prompt()
    if not chat_template:
        raise ConfigError(f"prompt=\"chat\" but the tokenizer has no chat template ({TOKENIZER_CONFIG_FILE} "
                          f"chat_template or {CHAT_TEMPLATE_FILE}); use prompt=\"plain\"")
    specials = {k: name for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                if (name := _token_name(tokenizer_config.get(k))) is not None}
    return chat_prompt(chat_template, specials)


def _check_generation(max_new_tokens: int, eval_examples: int) -> dict[str, int]:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(eval_examples, int) or isinstance(eval_examples, bool) or eval_examples < 0:
        raise ConfigError(f"eval_examples must be an integer >= 0 (0 = no generation in evaluation), got "
                          f"{eval_examples!r}")
    return {"max_new_tokens": max_new_tokens, "eval_examples": eval_examples}


def _check_fits(config, vocab_size: int, max_length: int) -> None:
    if int(config.vocab_size) < vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {config.vocab_size}; "
                          "use the tokenizer the model was trained with or raise vocab_size")
    limit = max_positions(config)
    if limit is not None and max_length > limit:
        raise ConfigError(f"max_length {max_length} exceeds what the model supports ({limit} positions); "
                          "lower max_length")


def _meta(max_length: int, base_model: str, model_type: str, specials: Mapping[str, Any],
          prompt: Mapping[str, Any], generation: Mapping[str, int]) -> dict[str, Any]:
    return {"format": FORMAT, "family": FAMILY, "architecture": "causal-lm", "labels": [], "multi_label": False,
            "max_length": int(max_length), "base_model": base_model, "arch_config": {"model_type": model_type},
            **dict(specials), "prompt": dict(prompt), "generation": dict(generation)}


def package_qa_from_config(*, tokenizer_json: bytes | str, config: Mapping[str, Any], max_length: int = 128,
                           seed: int = 0, base_model: str = "from-config", eos_token: str | None = None,
                           chat_template: str | None = None, prompt: str = "auto",
                           max_new_tokens: int = MAX_NEW_TOKENS, eval_examples: int = EVAL_EXAMPLES) -> ModelPackage:
    """A freshly initialised (seeded) causal LM from an HF config dict with ``model_type`` — tiny test models.

    ``vocab_size`` defaults to the tokenizer's, ``bos_token_id``/``eos_token_id``/``pad_token_id`` to the
    tokenizer's EOS (``eos_token``, else a conventional name such as ``</s>``) and padding token. ``prompt``:
    ``"auto"`` uses ``chat_template`` when given, else the plain template.
    """
    check_max_length(max_length)
    if isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    tokenizer = load_tokenizer(tokenizer_json)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    specials = _special_ids(tokenizer, {}, {}, eos_token)
    cfg = dict(config)
    cfg.setdefault("vocab_size", vocab)
    for key in ("bos_token_id", "eos_token_id"):
        cfg.setdefault(key, specials["eos_token_id"])
    cfg.setdefault("pad_token_id", specials["pad_token_id"])
    hf_config = _hf_lm_config(cfg)
    _check_fits(hf_config, vocab, max_length)
    prompt_meta = _resolve_prompt(prompt, chat_template, {"eos_token": specials["eos_token"]})
    generation = _check_generation(max_new_tokens, eval_examples)
    module = _build_module(hf_config, seed)
    meta = _meta(max_length, base_model, hf_config.model_type, specials, prompt_meta, generation)
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: bytes(tokenizer_json),
             HF_CONFIG_FILE: hf_config_bytes(module)}
    return ModelPackage(tensors=module_tensors(module, stored_names(module)), files=files)


def package_qa_pretrained(path: str | Path, *, max_length: int = 128, prompt: str = "auto",
                          eos_token: str | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                          eval_examples: int = EVAL_EXAMPLES, config: Mapping[str, Any] | None = None) -> ModelPackage:
    """Package a local Hugging Face causal-LM folder for a question-answering task.

    Reads only ``config.json``, safetensors weights (``model.safetensors`` or a sharded index),
    ``tokenizer.json`` and, when present, ``tokenizer_config.json`` / ``chat_template.jinja`` (EOS/BOS tokens and
    the chat template; ``prompt="auto"`` uses the chat template when there is one). Nothing is downloaded and no
    code from the folder runs. ``config`` overrides HF config fields that do not change shapes.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"pretrained model folder {folder} does not exist; give a local folder with "
                          f"{HF_CONFIG_FILE}, {WEIGHTS_FILE} and {TOKENIZER_FILE}")
    for name in (HF_CONFIG_FILE, TOKENIZER_FILE):
        if not (folder / name).is_file():
            raise ConfigError(f"{folder} has no {name}; a causal LM folder needs its Hugging Face config and a "
                              "fast tokenizer's tokenizer.json (save them once with save_pretrained)")
    check_max_length(max_length)
    hf_cfg = _read_json(folder / HF_CONFIG_FILE)
    tok_cfg = _read_json(folder / TOKENIZER_CONFIG_FILE) if (folder / TOKENIZER_CONFIG_FILE).is_file() else {}
    chat_template = tok_cfg.get("chat_template")
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        chat_template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if chat_template is not None and not isinstance(chat_template, str):  # a list of named templates
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default")
    tokenizer_json = (folder / TOKENIZER_FILE).read_bytes()
    tokenizer = load_tokenizer(tokenizer_json)
    specials = _special_ids(tokenizer, tok_cfg, hf_cfg, eos_token)
    hf_config = _hf_lm_config({**hf_cfg, **dict(config or {})})
    _check_fits(hf_config, tokenizer.get_vocab_size(with_added_tokens=True), max_length)
    prompt_meta = _resolve_prompt(prompt, chat_template, tok_cfg)
    generation = _check_generation(max_new_tokens, eval_examples)
    module = _build_module(hf_config, 0)
    load_tensors(module, _map_checkpoint(module, read_checkpoint(folder)))
    meta = _meta(max_length, str(hf_cfg.get("_name_or_path") or folder.name), hf_config.model_type, specials,
                 prompt_meta, generation)
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: tokenizer_json, HF_CONFIG_FILE: hf_config_bytes(module),
             **{n: (folder / n).read_bytes() for n in _SIDE_FILES if (folder / n).is_file()}}
    return ModelPackage(tensors=module_tensors(module, stored_names(module)), files=files)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return doc


def _map_checkpoint(module, checkpoint: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint names -> the module's stored names (with or without the base-model prefix, e.g.
    ``transformer.`` for original GPT-2 files). Every stored tensor must be there with its shape; extra
    checkpoint entries (old attention-mask buffers, a saved copy of a tied head) are ignored."""
    state = module.state_dict()
    prefix = getattr(module, "base_model_prefix", "") or ""
    mapped: dict[str, np.ndarray] = {}
    for name in stored_names(module):
        if name in checkpoint:
            mapped[name] = checkpoint[name]
        elif prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in checkpoint:
            mapped[name] = checkpoint[name[len(prefix) + 1:]]
    missing = [n for n in stored_names(module) if n not in mapped]
    if missing:
        raise IntegrityError(f"the pretrained weights lack tensor(s) {format_names(missing)}; the folder does not match "
                             "its config.json (wrong model_type or a different model)")
    bad = [f"{n} {tuple(a.shape)} != model {tuple(state[n].shape)}" for n, a in mapped.items()
           if tuple(a.shape) != tuple(state[n].shape)]
    if bad:
        raise IntegrityError(f"pretrained tensor shape mismatch: {format_names(bad)}")
    return mapped


def build(package: ModelPackage) -> CausalLMModel:
    """Build the causal LM of a question-answering package and load its tensors strictly."""
    meta = package.meta
    _check_architecture(meta.get("architecture"))
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
    config = _hf_lm_config(hf)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if int(config.vocab_size) < vocab:
        raise IntegrityError(f"{TOKENIZER_FILE} has {vocab} tokens but the model's vocab_size is {config.vocab_size}")
    for key in ("eos_token_id", "pad_token_id"):
        if not (isinstance(meta[key], int) and 0 <= meta[key] < vocab):
            raise IntegrityError(f"{META_FILE} {key} {meta[key]!r} is not a token id of {TOKENIZER_FILE}")
    module = _build_module(config, 0)
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
