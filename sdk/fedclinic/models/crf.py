"""A linear-chain conditional random field over per-token emission scores (the NER families' output layer).

For one sequence of length ``n`` with emissions ``E[t, y]`` (from the encoder) and tags ``y_1..y_n``::

    score(y) = start[y_1] + sum_{t=1..n} E[t, y_t] + sum_{t=2..n} trans[y_{t-1}, y_t] + end[y_n]
    log Z    = logsumexp over all tag sequences of score(y)      (forward algorithm, O(n T^2))
    NLL(y)   = log Z - score(y)                                   (the training loss per sequence)
    decode   = argmax_y score(y)                                  (Viterbi, O(n T^2))

``trans[i, j]`` scores a move from tag ``i`` to tag ``j``. Sequences are right-padded: ``mask[b, t] = 1`` for
the first ``n_b`` positions and 0 after, with ``n_b >= 1``. Everything is vectorised over the batch; the
loops run over time only. The arithmetic is float32 whatever the emissions' dtype (mixed precision safe).

Tensor names in a model's state: ``crf.transitions``, ``crf.start_transitions``, ``crf.end_transitions``.
The ONNX bundle computes the same Viterbi path (see :mod:`fedclinic.export.onnx_export`); parity is tested.
"""

from __future__ import annotations

import torch
from torch import nn


class CRF(nn.Module):
    def __init__(self, num_tags: int) -> None:
        super().__init__()
        if num_tags < 1:
            raise ValueError(f"a CRF needs at least one tag, got {num_tags}")
        self.num_tags = int(num_tags)
        self.transitions = nn.Parameter(torch.empty(num_tags, num_tags))
        self.start_transitions = nn.Parameter(torch.empty(num_tags))
        self.end_transitions = nn.Parameter(torch.empty(num_tags))
        for p in (self.transitions, self.start_transitions, self.end_transitions):
            nn.init.uniform_(p, -0.1, 0.1)

    @staticmethod
    def _check(emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if emissions.dim() != 3 or mask.shape != emissions.shape[:2]:
            raise ValueError(f"emissions must be [batch, seq, tags] and mask [batch, seq]; got "
                             f"{tuple(emissions.shape)} and {tuple(mask.shape)}")
        mask = mask.bool()
        if emissions.shape[1] == 0 or not bool(mask[:, 0].all()):
            raise ValueError("every sequence needs at least one position (mask[:, 0] must be 1)")
        return mask

    def nll(self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor,
            per_example: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Negative log-likelihood per sequence, ``[batch]``. Tags at masked positions are ignored.

        ``per_example``: ``(transitions [B, T, T], start [B, T], end [B, T])``, one copy of the parameters per
        sequence, used instead of the module's own (sequence ``b`` reads only copy ``b``, so the gradient of
        the copies is the per-sequence gradient that DP-SGD clips). Default: the module's parameters, shared.
        """
        mask = self._check(emissions, mask)
        em = emissions.float()
        batch, _, num_tags = em.shape
        if per_example is None:
            trans = self.transitions.expand(batch, num_tags, num_tags)
            start = self.start_transitions.expand(batch, num_tags)
            end = self.end_transitions.expand(batch, num_tags)
        else:
            trans, start, end = per_example
            if (trans.shape != (batch, num_tags, num_tags) or start.shape != (batch, num_tags)
                    or end.shape != (batch, num_tags)):
                raise ValueError(f"per-example CRF parameters must be [{batch}, {num_tags}, {num_tags}], "
                                 f"[{batch}, {num_tags}] and [{batch}, {num_tags}]")
        tags = tags.clamp(min=0)  # padding may carry an ignore id; its positions are masked out
        b_idx = torch.arange(batch, device=em.device)
        # score of the given path
        score = start[b_idx, tags[:, 0]] + em[b_idx, 0, tags[:, 0]]
        last = tags[:, 0]
        # partition function (forward algorithm)
        alpha = start + em[:, 0]  # [B, T]
        for t in range(1, em.shape[1]):
            on = mask[:, t]
            step = trans[b_idx, last, tags[:, t]] + em[b_idx, t, tags[:, t]]
            score = score + step * on
            last = torch.where(on, tags[:, t], last)
            nxt = torch.logsumexp(alpha.unsqueeze(2) + trans, dim=1) + em[:, t]
            alpha = torch.where(on.unsqueeze(1), nxt, alpha)
        score = score + end[b_idx, last]
        log_z = torch.logsumexp(alpha + end, dim=1)
        return log_z - score

    @torch.no_grad()
    def viterbi(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The best tag path per sequence, ``[batch, seq]`` int64 (0 at padded positions).

        Ties go to the lowest tag index (``argmax`` semantics), at every step and at the end.
        """
        mask = self._check(emissions, mask)
        em = emissions.float()
        batch, seq, tags = em.shape
        score = self.start_transitions.unsqueeze(0) + em[:, 0]  # [B, T]
        identity = torch.arange(tags, device=em.device).expand(batch, tags)
        backpointers = []
        for t in range(1, seq):
            cand = score.unsqueeze(2) + self.transitions.unsqueeze(0)  # [B, prev, next]
            best, arg = cand.max(dim=1)
            on = mask[:, t].unsqueeze(1)
            score = torch.where(on, best + em[:, t], score)
            backpointers.append(torch.where(on, arg, identity))  # padded steps keep the tag in place
        tag = (score + self.end_transitions.unsqueeze(0)).argmax(dim=1)
        path = [tag]
        for bp in reversed(backpointers):
            tag = bp.gather(1, tag.unsqueeze(1)).squeeze(1)
            path.append(tag)
        path.reverse()
        out = torch.stack(path, dim=1)
        return out * mask.long()


__all__ = ["CRF"]
