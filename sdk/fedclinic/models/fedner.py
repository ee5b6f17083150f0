"""The FedNER tagger (architecture ``"cnn-bilstm-crf"`` of the token-classification family).

The network of Ge et al., "FedNER: Privacy-preserving Medical Named Entity Recognition with Federated
Learning" (§3.1, Figure 1; spec ``specs/fedner_shared_private.md`` §1), without its pretrained parts::

    e_i = [ word_embedding(x_i) ; maxpool_chars relu(char_cnn(char_embedding(chars(x_i)))) ]   word representation
    m_i = relu(word_cnn([e_1..e_k]))_i                                     local context (1-D conv over tokens)
    r_i = BiLSTM([m_1..m_k])_i                                             long-range context (packed sequences)
    emissions_i = classifier(r_i)  ->  CRF (negative log-likelihood; Viterbi)

Dropout (rate ``dropout``) is applied to ``e_i``, to ``m_i`` and to ``r_i`` (the spec's suggested placement,
§1.5). Both CNNs use same-padding, stride 1 and ReLU (spec §1.1/§1.2 suggestions); kernels must be odd.
The word embedding is trained from a seeded random initialisation over the task tokenizer's vocabulary
(the paper starts from GloVe-300 and adds ELMo; neither is part of this architecture, so no pretrained
vectors are read and nothing is downloaded).

Hyperparameters (``arch_config`` of ``fedclinic_model.json``; defaults in :data:`FEDNER_DEFAULTS`):

==============  =======  ===========================================================================
key             default  source
==============  =======  ===========================================================================
embedding_dim   300      paper §3.1: GloVe dimension D_w = 300 (spec §1.1)
char_dim        100      paper §3.1: character embedding D_c = 100, randomly initialised (spec §1.1)
char_filters    200      paper §3.1: char-CNN with 200 filters (spec §1.1)
char_kernel     3        paper §3.1: char-CNN kernel size 3 (spec §1.1)
word_filters    200      paper §3.1: word-level CNN with 200 filters (spec §1.2)
word_kernel     3        paper §3.1: word-level CNN kernel size 3 (spec §1.2)
lstm_hidden     200      paper §3.1: Bi-LSTM with "2x200 hidden states", 200 per direction (spec §1.2)
dropout         0.2      paper §4.1: dropout rate 0.2 (spec §1.5)
max_chars       20       not in the paper: characters kept per token (longer tokens keep their first
                         ceil(max_chars/2) and last floor(max_chars/2) characters, so suffixes such
                         as "-itis" or "-olol" survive)
==============  =======  ===========================================================================

``arch_config`` also records ``vocab_size`` and ``pad_token_id`` (from the tokenizer) and ``char_vocab``
(:data:`CHAR_VOCAB`, the character mapping below) so a package built under another mapping is refused.

Characters of a token
---------------------
The model's only inputs are ``input_ids`` and ``attention_mask``. A token's characters come from the
tokenizer's vocabulary: :func:`char_table` turns every token string into a row of character ids, giving a
``[vocab_size, max_chars]`` int64 table that the module holds as a **non-persistent** buffer ``char_table``.
It is derived deterministically from ``tokenizer.json`` at build time, so it is never in the package's
tensors, never aggregated and never sent. The surface form of a token (:func:`token_surface_forms`):

- special tokens (``[CLS]``, ``[PAD]``, ``<s>``, ... : added tokens marked special) -> no characters;
- WordPiece/BPE continuation prefixes (``##ing`` -> ``ing``) and BPE end-of-word suffixes (``</w>``) are
  removed;
- byte-level tokenizers (RoBERTa/GPT-2 style ``ByteLevel``): the byte alphabet is mapped back to bytes
  and decoded as UTF-8 (invalid sequences of a partial character become U+FFFD), so ``Ġheadache`` ->
  ``headache``;
- SentencePiece ``Metaspace`` (``▁head``): the replacement character becomes a space;
- leading and trailing whitespace is stripped (a token that is only a space marker has no characters).

Character ids (:data:`CHAR_VOCAB` ``"ascii95+bucket160/1"``, :data:`CHAR_VOCAB_SIZE` = 256, no file needed):
``0`` is padding; printable ASCII U+0020..U+007E is ``1 + (cp - 0x20)`` (ids 1..95, case kept); every other
code point ``cp`` is folded into one of 160 buckets, ``96 + cp % 160`` (Latin-1 letters such as é, µ, °
each get a bucket of their own).

Tensor names (stable; FedNER's shared/private split is written as patterns over them)
--------------------------------------------------------------------------------------
``h`` = lstm_hidden, ``T`` = number of tags; "paper" is the module the paper puts the tensor in (§3.2)::

    word_embedding.weight        [vocab_size, embedding_dim]                         shared
    char_embedding.weight        [256, char_dim]                                     shared
    char_cnn.weight, .bias       [char_filters, char_dim, char_kernel], [char_filters]  shared
    word_cnn.weight, .bias       [word_filters, embedding_dim + char_filters, word_kernel], [word_filters]  shared
    lstm.weight_ih_l0            [4h, word_filters]                                  private
    lstm.weight_hh_l0            [4h, h]                                             private
    lstm.bias_ih_l0, .bias_hh_l0 [4h]                                                private
    lstm.*_l0_reverse            the same four for the backward direction            private
    classifier.weight, .bias     [T, 2h], [T]  (the emission layer)                  private
    crf.transitions              [T, T]                                              private
    crf.start_transitions, crf.end_transitions   [T]                                 private

:data:`PAPER_SHARED_PATTERNS` / :data:`PAPER_PRIVATE_PATTERNS` are the paper's split (§3.2: shared = all
embeddings + word-level CNN; private = Bi-LSTM + CRF, the emission layer with the CRF since tag sets differ
between sites) as full-match regular expressions for ``private_patterns`` of the simulator and tasks.
The emission layer is named ``classifier`` as in the ``transformer``/``transformer-crf`` architectures, so
``(classifier|crf)\\..*`` selects the tag-set-specific head of every NER architecture.

Training runs the LSTM over packed sequences (padding never enters the recurrence); ONNX export
(``torch.compiler.is_exporting()``) traces :meth:`forward_unpacked`, which computes the same outputs at every
position without packing (tested equal to 1e-5). Padded positions carry zero features into the word CNN (as
its own zero padding) and a zero LSTM output, so a sentence's emissions do not depend on how much padding its
batch has.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Mapping

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.base import load_tokenizer

ARCHITECTURE = "cnn-bilstm-crf"

FEDNER_DEFAULTS: dict[str, Any] = {
    "embedding_dim": 300,
    "char_dim": 100,
    "char_filters": 200,
    "char_kernel": 3,
    "word_filters": 200,
    "word_kernel": 3,
    "lstm_hidden": 200,
    "dropout": 0.2,
    "max_chars": 20,
}
#: name and version of the fixed character mapping (recorded in arch_config; see the module docstring)
CHAR_VOCAB = "ascii95+bucket160/1"
CHAR_VOCAB_SIZE = 256
_ASCII_FIRST, _ASCII_LAST = 0x20, 0x7E
_BUCKETS = 160
#: arch_config keys derived from the tokenizer and the code, not chosen by the user
DERIVED_KEYS = ("vocab_size", "pad_token_id", "char_vocab")

#: the paper's split (§3.2) as full-match patterns over the tensor names
PAPER_SHARED_PATTERNS = (r"(word_embedding|char_embedding|char_cnn|word_cnn)\..*",)
PAPER_PRIVATE_PATTERNS = (r"(lstm|classifier|crf)\..*",)


# ------------------------------------------------------------------------------------------------------------
# configuration


def fedner_arch_config(config: Mapping[str, Any], *, vocab_size: int, pad_token_id: int) -> dict[str, Any]:
    """Validate user keys (those of :data:`FEDNER_DEFAULTS`), fill the defaults, add the derived keys.

    ``vocab_size`` and ``pad_token_id`` given in ``config`` are replaced by the tokenizer's (so a stored
    arch_config can be passed back in); ``char_vocab`` must be :data:`CHAR_VOCAB` when given.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{ARCHITECTURE} config must be a mapping of hyperparameters, got {type(config).__name__}")
    cfg = dict(config)
    cfg.pop("vocab_size", None)
    cfg.pop("pad_token_id", None)
    chars = cfg.pop("char_vocab", CHAR_VOCAB)
    if chars != CHAR_VOCAB:
        raise ConfigError(f"{ARCHITECTURE} char_vocab {chars!r} is not this fedclinic's character mapping "
                          f"{CHAR_VOCAB!r}; re-package the model")
    unknown = sorted(set(cfg) - set(FEDNER_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown {ARCHITECTURE} config key(s) {unknown}; allowed: {sorted(FEDNER_DEFAULTS)}")
    out = {**FEDNER_DEFAULTS, **cfg}
    for key in ("embedding_dim", "char_dim", "char_filters", "word_filters", "lstm_hidden", "max_chars",
                "char_kernel", "word_kernel"):
        v = out[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{ARCHITECTURE} {key} must be a positive integer, got {v!r}")
    for key in ("char_kernel", "word_kernel"):
        if out[key] % 2 == 0:
            raise ConfigError(f"{ARCHITECTURE} {key} must be odd (same padding keeps one output per input), "
                              f"got {out[key]}")
    d = out["dropout"]
    if not isinstance(d, (int, float)) or isinstance(d, bool) or not 0.0 <= float(d) < 1.0:
        raise ConfigError(f"{ARCHITECTURE} dropout must be in [0, 1), got {d!r}")
    out["dropout"] = float(d)
    out.update(vocab_size=int(vocab_size), pad_token_id=int(pad_token_id), char_vocab=CHAR_VOCAB)
    return out


def stored_arch_config(arch: Mapping[str, Any], *, vocab_size: int, pad_token_id: int) -> dict[str, Any]:
    """A package's recorded arch_config, checked: every key present, valid, and matching the tokenizer.
    IntegrityError otherwise (the package does not describe a model this code can build)."""
    missing = [k for k in (*FEDNER_DEFAULTS, *DERIVED_KEYS) if k not in arch]
    if missing:
        raise IntegrityError(f"fedclinic_model.json arch_config lacks {missing} for architecture {ARCHITECTURE!r}; "
                             "re-package the model")
    if int(arch["vocab_size"]) != int(vocab_size):
        raise IntegrityError(f"fedclinic_model.json declares vocab_size {arch['vocab_size']} but tokenizer.json "
                             f"has {vocab_size} tokens")
    if int(arch["pad_token_id"]) != int(pad_token_id):
        raise IntegrityError(f"fedclinic_model.json declares pad_token_id {arch['pad_token_id']} but tokenizer.json "
                             f"pads with {pad_token_id}")
    try:
        return fedner_arch_config(arch, vocab_size=vocab_size, pad_token_id=pad_token_id)
    except ConfigError as exc:
        raise IntegrityError(f"fedclinic_model.json arch_config: {exc}") from None


# ------------------------------------------------------------------------------------------------------------
# characters of the vocabulary


def char_id(ch: str) -> int:
    """The id of one character under :data:`CHAR_VOCAB` (never 0: 0 is padding)."""
    cp = ord(ch)
    if _ASCII_FIRST <= cp <= _ASCII_LAST:
        return 1 + cp - _ASCII_FIRST
    return 1 + (_ASCII_LAST - _ASCII_FIRST + 1) + cp % _BUCKETS


@functools.lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
    """Character -> byte of the byte-level (GPT-2/RoBERTa) alphabet: printable bytes stand for themselves,
    the other 68 bytes (controls, space, ...) are shifted to U+0100 onwards in byte order."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {chr(b): b for b in visible}
    shifted = 0
    for b in range(256):
        if b not in out.values():
            out[chr(0x100 + shifted)] = b
            shifted += 1
    return out


def _component_types(node: Any, found: dict[str, dict]) -> None:
    """Collect the pre-tokenizer/decoder components (``{"type": ...}``), walking Sequence nesting."""
    if isinstance(node, dict):
        kind = node.get("type")
        if isinstance(kind, str):
            found.setdefault(kind, node)
        for value in node.values():
            if isinstance(value, (dict, list)):
                _component_types(value, found)
    elif isinstance(node, list):
        for value in node:
            _component_types(value, found)


def token_surface_forms(tokenizer_json: bytes | str) -> list[str]:
    """The characters each token id stands for (``""`` for special tokens); see the module docstring."""
    text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, (bytes, bytearray)) else tokenizer_json
    doc = json.loads(text)
    tok = load_tokenizer(text)
    size = tok.get_vocab_size(with_added_tokens=True)
    model = doc.get("model") or {}
    prefix = model.get("continuing_subword_prefix") or ""
    suffix = model.get("end_of_word_suffix") or ""
    components: dict[str, dict] = {}
    _component_types([doc.get("pre_tokenizer"), doc.get("decoder")], components)
    byte_level = "ByteLevel" in components
    metaspace = components.get("Metaspace", {}).get("replacement", "\u2581") if "Metaspace" in components else None
    special_ids = {int(t["id"]) for t in doc.get("added_tokens") or [] if t.get("special")}
    decode_bytes = _byte_level_decoding()
    forms = [""] * size
    for token, idx in tok.get_vocab(with_added_tokens=True).items():
        if not 0 <= idx < size or idx in special_ids:
            continue
        s = token
        if prefix and s.startswith(prefix) and len(s) > len(prefix):
            s = s[len(prefix):]
        if suffix and s.endswith(suffix) and len(s) > len(suffix):
            s = s[:-len(suffix)]
        if byte_level:
            raw = b"".join(bytes([decode_bytes[c]]) if c in decode_bytes else c.encode("utf-8") for c in s)
            s = raw.decode("utf-8", errors="replace")
        if metaspace:
            s = s.replace(metaspace, " ")
        forms[idx] = s.strip()
    return forms


def char_ids(form: str, max_chars: int) -> list[int]:
    """Character ids of one surface form, at most ``max_chars`` (head and tail of a longer one)."""
    ids = [char_id(c) for c in form]
    if len(ids) > max_chars:
        tail = max_chars // 2
        ids = ids[:max_chars - tail] + (ids[len(ids) - tail:] if tail else [])
    return ids


def char_table(tokenizer_json: bytes | str, max_chars: int) -> np.ndarray:
    """``[vocab_size, max_chars]`` int64: each token's character ids, right-padded with 0."""
    forms = token_surface_forms(tokenizer_json)
    table = np.zeros((len(forms), int(max_chars)), dtype=np.int64)
    for i, form in enumerate(forms):
        ids = char_ids(form, max_chars)
        table[i, :len(ids)] = ids
    return table


# ------------------------------------------------------------------------------------------------------------
# the module


@functools.lru_cache(maxsize=1)
def tagger_class():
    """The :class:`FedNERTagger` nn.Module class (made on first use, so this module imports without torch)."""
    import torch
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    # lazy: fedclinic.models.crf imports torch; importing fedclinic.models must not
    from fedclinic.models.crf import CRF

    class FedNERTagger(nn.Module):
        """Word embedding + char-CNN -> word CNN -> BiLSTM -> linear emissions -> CRF (``self.crf``).

        ``forward(input_ids, attention_mask)`` returns the emissions ``[batch, seq, num_tags]``; the CRF's loss
        and Viterbi decoding are applied by :class:`~fedclinic.models.token_classification.TokenModel`.
        """

        def __init__(self, *, vocab_size: int, num_tags: int, embedding_dim: int, char_dim: int, char_filters: int,
                     char_kernel: int, word_filters: int, word_kernel: int, lstm_hidden: int, dropout: float,
                     max_chars: int, pad_token_id: int, char_table: np.ndarray) -> None:
            super().__init__()
            table = torch.as_tensor(np.asarray(char_table, dtype=np.int64))
            if tuple(table.shape) != (vocab_size, max_chars):
                raise IntegrityError(f"char table {tuple(table.shape)} does not match vocab_size {vocab_size} x "
                                     f"max_chars {max_chars}")
            self.register_buffer("char_table", table, persistent=False)
            self.word_embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_token_id)
            self.char_embedding = nn.Embedding(CHAR_VOCAB_SIZE, char_dim, padding_idx=0)
            self.char_cnn = nn.Conv1d(char_dim, char_filters, char_kernel, padding=char_kernel // 2)
            self.word_cnn = nn.Conv1d(embedding_dim + char_filters, word_filters, word_kernel,
                                      padding=word_kernel // 2)
            self.lstm = nn.LSTM(word_filters, lstm_hidden, num_layers=1, batch_first=True, bidirectional=True)
            self.dropout = nn.Dropout(dropout)
            self.classifier = nn.Linear(2 * lstm_hidden, num_tags)
            self.crf = CRF(num_tags)
            with torch.no_grad():  # uniform(+-sqrt(3/dim)): unit-norm-scale vectors [not in the paper]
                for emb, pad in ((self.word_embedding, pad_token_id), (self.char_embedding, 0)):
                    bound = math.sqrt(3.0 / emb.embedding_dim)
                    emb.weight.uniform_(-bound, bound)
                    emb.weight[pad].zero_()

        # --- shared part: word representation and local context -----------------------------------------
        def word_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """``[B, L, word_filters]``: the word-CNN output m_i (zero features enter it at padding)."""
            batch, seq = input_ids.shape
            chars = self.char_table[input_ids].reshape(batch * seq, -1)          # [B*L, C]
            h = self.char_cnn(self.char_embedding(chars).transpose(1, 2))      # [B*L, F_c, C]
            h = torch.relu(h).masked_fill((chars == 0).unsqueeze(1), 0.0)       # >= 0: padding never wins the max
            char_feat = h.amax(dim=2).reshape(batch, seq, -1)                  # a token without chars gives 0
            e = torch.cat([self.word_embedding(input_ids), char_feat], dim=-1)
            e = self.dropout(e) * attention_mask.unsqueeze(-1).to(e.dtype)
            m = torch.relu(self.word_cnn(e.transpose(1, 2))).transpose(1, 2)
            return self.dropout(m)

        # --- private part: context and emissions ----------------------------------------------------------
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_exporting():
                return self.forward_unpacked(input_ids, attention_mask)
            m = self.word_features(input_ids, attention_mask)
            lengths = attention_mask.sum(dim=1).clamp(min=1).to("cpu", torch.int64)
            packed = pack_padded_sequence(m, lengths, batch_first=True, enforce_sorted=False)
            out, _ = self.lstm(packed)
            r, _ = pad_packed_sequence(out, batch_first=True, total_length=input_ids.shape[1])  # zeros at padding
            return self.classifier(self.dropout(r))

        def forward_unpacked(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """The same emissions without packed sequences (for ONNX export: packing by dynamic lengths cannot
            be traced). The forward direction runs over the padded batch; the reverse direction runs forward
            over each sequence reversed *within its length* (padding stays in place behind it), so no valid
            position sees padding. Outputs at padded positions are zeroed, as ``pad_packed_sequence`` does."""
            m = self.word_features(input_ids, attention_mask)
            lengths = attention_mask.sum(dim=1).clamp(min=1)
            steps = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            inside = steps < lengths.unsqueeze(1)
            rev = torch.where(inside, lengths.unsqueeze(1) - 1 - steps, steps)  # an involution on each row

            def gather(t: torch.Tensor) -> torch.Tensor:
                return torch.gather(t, 1, rev.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

            def run(x: torch.Tensor, suffix: str) -> torch.Tensor:
                weights = [getattr(self.lstm, f"{kind}_l0{suffix}")
                           for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
                zeros = x.new_zeros(1, x.shape[0], self.lstm.hidden_size)
                out, _, _ = torch.lstm(x, (zeros, zeros), weights, True, 1, 0.0, False, False, True)
                return out

            r = torch.cat([run(m, ""), gather(run(gather(m), "_reverse"))], dim=-1)
            r = r * inside.unsqueeze(-1).to(r.dtype)
            return self.classifier(self.dropout(r))

    return FedNERTagger


def build_tagger(arch_config: Mapping[str, Any], num_tags: int, tokenizer_json: bytes | str):
    """The module for a validated ``arch_config`` (:func:`fedner_arch_config`), with its char table built from
    ``tokenizer_json``. Parameters are initialised from torch's global RNG (seed it, e.g. ``seeded``)."""
    table = char_table(tokenizer_json, arch_config["max_chars"])
    if table.shape[0] != int(arch_config["vocab_size"]):
        raise IntegrityError(f"tokenizer.json has {table.shape[0]} tokens but arch_config vocab_size is "
                             f"{arch_config['vocab_size']}")
    kw = {k: arch_config[k] for k in FEDNER_DEFAULTS}
    return tagger_class()(vocab_size=int(arch_config["vocab_size"]), num_tags=int(num_tags),
                          pad_token_id=int(arch_config["pad_token_id"]), char_table=table, **kw)


__all__ = ["ARCHITECTURE", "CHAR_VOCAB", "CHAR_VOCAB_SIZE", "FEDNER_DEFAULTS", "PAPER_PRIVATE_PATTERNS",
           "PAPER_SHARED_PATTERNS", "build_tagger", "char_id", "char_ids", "char_table", "fedner_arch_config",
           "stored_arch_config", "tagger_class", "token_surface_forms"]
