"""The CRF against brute force: log Z and the best path by enumerating every tag sequence."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fedclinic.models.crf import CRF


def _path_score(crf: CRF, em: torch.Tensor, path: tuple[int, ...]) -> torch.Tensor:
    s = crf.start_transitions[path[0]] + em[0, path[0]]
    for t in range(1, len(path)):
        s = s + crf.transitions[path[t - 1], path[t]] + em[t, path[t]]
    return s + crf.end_transitions[path[-1]]


def _random_case(seed: int, batch: int, seq: int, tags: int):
    gen = torch.Generator().manual_seed(seed)
    crf = CRF(tags)
    with torch.no_grad():
        for p in crf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    em = torch.randn(batch, seq, tags, generator=gen)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    mask = (torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)).long()
    gold = torch.randint(0, tags, (batch, seq), generator=gen)
    return crf, em, mask, gold, lengths


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), seq=st.integers(1, 4), tags=st.integers(1, 4))
def test_nll_and_viterbi_equal_brute_force(seed, batch, seq, tags):
    crf, em, mask, gold, lengths = _random_case(seed, batch, seq, tags)
    with torch.no_grad():
        nll = crf.nll(em, gold, mask)
    best = crf.viterbi(em, mask)
    for b in range(batch):
        n = int(lengths[b])
        paths = list(itertools.product(range(tags), repeat=n))
        with torch.no_grad():
            scores = torch.stack([_path_score(crf, em[b, :n], p) for p in paths])
            expect_nll = torch.logsumexp(scores, dim=0) - _path_score(crf, em[b, :n], tuple(int(x) for x in gold[b, :n]))
        assert float(nll[b]) == pytest.approx(float(expect_nll), abs=1e-4)
        assert tuple(best[b, :n].tolist()) == paths[int(scores.argmax())]
        assert best[b, n:].eq(0).all()  # padded positions are 0


def test_padding_does_not_change_the_result():
    crf, em, mask, gold, _ = _random_case(3, 1, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    short = crf.nll(em[:, :3], gold[:, :3], mask[:, :3])
    garbage = em.clone()
    garbage[:, 3:] = 1e3  # huge scores at padded positions must not leak in
    assert torch.allclose(crf.nll(garbage, gold, mask), short, atol=1e-5)
    assert crf.viterbi(garbage, mask)[0, :3].tolist() == crf.viterbi(em[:, :3], mask[:, :3])[0].tolist()


def test_ignore_ids_at_padding_are_accepted():
    crf, em, mask, gold, _ = _random_case(4, 2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with_ignore = gold.clone()
    with_ignore[1, 2:] = -100
    assert torch.allclose(crf.nll(em, with_ignore, mask), crf.nll(em, gold, mask))


def test_nll_is_differentiable_and_positive():
    crf, em, mask, gold, _ = _random_case(5, 3, 6, 5)
    em.requires_grad_(True)
    loss = crf.nll(em, gold, mask)
    assert (loss > 0).all()
    loss.sum().backward()
    assert crf.transitions.grad is not None and torch.isfinite(crf.transitions.grad).all()
    assert em.grad is not None and em.grad[mask == 0].abs().max() == 0  # padding gets no gradient


def test_bad_shapes_and_empty_sequences_are_refused():
    crf = CRF(3)
    with pytest.raises(ValueError, match="emissions must be"):
        crf.viterbi(torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="at least one position"):
        crf.viterbi(torch.zeros(1, 2, 3), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="at least one tag"):
        CRF(0)
