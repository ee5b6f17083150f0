"""Metrics of generated answers against reference answers: ROUGE-L, BLEU, METEOR and exact match.

All scores are in [0, 1] (BLEU too; sacrebleu's 0-100 is divided by 100) and are computed on the same tokens:

    tokens(s) = lower-cased runs of letters/digits of ``s``; each CJK ideograph, kana or hangul syllable is a
                token of its own (character-level, as CancersQA scores Chinese); punctuation is dropped.

One tokenization for the three metrics keeps them comparable, and it does not depend on any downloadable
resource, so every site computes the very same numbers.

``rougeL``
    Mean over examples of the sentence-level ROUGE-L F-measure (Lin 2004), from Google's ``rouge-score``
    with the tokenizer above: ``P = LCS/|hyp|``, ``R = LCS/|ref|``, ``F = 2PR/(P+R)`` (0 when LCS = 0).
``bleu``
    Corpus BLEU (Papineni et al. 2002) from ``sacrebleu`` over the pre-tokenized texts (``tokenize="none"``):
    ``BP * exp(mean_{n=1..N} log p_n)`` with clipped n-gram precisions ``p_n`` over the whole set, brevity
    penalty ``BP = min(1, exp(1 - ref_len/hyp_len))`` and sacrebleu's default ``exp`` smoothing for orders
    without matches. ``N = 4``, or less when no hypothesis has ``N`` tokens (sacrebleu's ``effective_order``):
    short answers such as "drug y" would otherwise score 0 whatever their words.
``meteor``
    Mean over examples of NLTK's METEOR (Lavie & Agarwal 2007; alpha 0.9, beta 3, gamma 0.5)::

        m = matched unigrams (aligned by exact match, then Porter-stem match)
        P = m/|hyp|, R = m/|ref|, Fmean = P*R / (alpha*P + (1-alpha)*R)
        penalty = gamma * (chunks/m)^beta,  METEOR = Fmean * (1 - penalty)     (0 when m = 0)

    **Deviation from standard METEOR:** the WordNet synonym stage is switched off (NLTK gets a WordNet stand-in
    with no synsets). WordNet is a corpus download, which fedclinic never makes at run time, and a score that
    depended on whether a site happens to have it installed would differ between sites. Synonyms that are not
    exact or stem matches (e.g. "drug" / "medication") therefore do not count; scores are equal to or below
    NLTK's with WordNet.
``exact_match``
    Fraction of examples whose hypothesis tokens equal the reference tokens.
"""

from __future__ import annotations

import re
from typing import Sequence

from fedclinic.errors import ConfigError

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_TOKEN = re.compile(rf"[{_CJK}]|[^\W_{_CJK}]+")

METRICS = ("rougeL", "bleu", "meteor", "exact_match")


def metric_tokens(text: str) -> list[str]:
    """The tokens every metric here compares (see the module docstring)."""
    return _TOKEN.findall(text.lower())


class _Tokenizer:
    """The ``tokenize(text) -> list[str]`` object rouge-score accepts."""

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return metric_tokens(text)


class _NoWordNet:
    """Stands in for NLTK's WordNet reader: no word has synonyms (see "Deviation" in the module docstring)."""

    @staticmethod
    def synsets(word: str) -> list:
        return []


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean sentence-level ROUGE-L F-measure."""
    from rouge_score.rouge_scorer import RougeScorer

    _check(predictions, references)
    scorer = RougeScorer(["rougeL"], tokenizer=_Tokenizer())
    scores = [scorer.score(ref, hyp)["rougeL"].fmeasure for hyp, ref in zip(predictions, references)]
    return sum(scores) / len(scores)


def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU in [0, 1] (one reference per example)."""
    from sacrebleu.metrics import BLEU

    _check(predictions, references)
    hyps = [" ".join(metric_tokens(p)) for p in predictions]
    refs = [" ".join(metric_tokens(r)) for r in references]
    return min(1.0, float(BLEU(tokenize="none", effective_order=True).corpus_score(hyps, [refs]).score) / 100.0)


def meteor(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean METEOR with exact + Porter-stem matching (no WordNet synonyms; see the module docstring)."""
    from nltk.stem.porter import PorterStemmer
    from nltk.translate.meteor_score import single_meteor_score

    _check(predictions, references)
    stemmer = PorterStemmer()
    total = 0.0
    for hyp, ref in zip(predictions, references):
        total += single_meteor_score(metric_tokens(ref), metric_tokens(hyp), stemmer=stemmer, wordnet=_NoWordNet(),
                                     alpha=0.9, beta=3.0, gamma=0.5)
    return total / len(predictions)


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of hypotheses whose tokens equal their reference's."""
    _check(predictions, references)
    return sum(metric_tokens(p) == metric_tokens(r) for p, r in zip(predictions, references)) / len(predictions)


def generation_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """``{"rougeL", "bleu", "meteor", "exact_match"}`` of ``predictions`` against ``references``."""
    return {"rougeL": rouge_l(predictions, references), "bleu": bleu(predictions, references),
            "meteor": meteor(predictions, references), "exact_match": exact_match(predictions, references)}


def _check(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise ConfigError(f"{len(predictions)} predictions for {len(references)} references; give one each")
    if not predictions:
        raise ConfigError("no predictions to score")


__all__ = ["METRICS", "bleu", "exact_match", "generation_scores", "meteor", "metric_tokens", "rouge_l"]
