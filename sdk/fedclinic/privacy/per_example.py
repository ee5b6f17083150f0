"""The DP-SGD objective of each model family: one loss per example, averaged over the batch.

DP-SGD bounds what one example can do to a step by clipping *that example's* gradient to norm C. Opacus
computes per-sample gradients per row of the batch (the leading dimension of every layer's input) and, with
``loss_reduction="mean"``, multiplies each layer's output gradient by the batch size ``B``. So the batch loss
must be::

    L = (1/B) sum_b l_b        with l_b a function of example b alone

Then Opacus' per-sample gradient of row ``b`` is exactly ``grad l_b``, whatever the other rows hold. A loss
that normalises by a batch-wide count (e.g. cross-entropy averaged over all tokens of the batch) is not of
this form: row b's gradient would be scaled by ``(tokens of b) / (tokens of the batch)``, so removing one
example would rescale every other example's gradient before clipping, and the sensitivity of the clipped sum
would no longer be C. The privacy unit of each family and its ``l_b``:

``text-classification`` / ``feature-classification``
    one text (one feature row): cross-entropy of its label (multi-label: mean over labels of the binary
    cross-entropy). Same objective as non-private training.
``token-classification`` ``transformer``
    one sentence/review: the mean token cross-entropy over *its own* tagged tokens (non-private training
    averages over all tokens of the batch instead, which weights long sentences more).
``token-classification`` ``transformer-crf``
    one sentence/review: its CRF negative log-likelihood (as in non-private training). The CRF's parameters
    are plain ``nn.Parameter`` tensors read by indexing, which no Opacus grad sampler covers; each sequence
    reads its own copy of them (:meth:`fedclinic.models.crf.CRF.nll` ``per_example``), and the gradient of
    copy b is sequence b's gradient (written to ``grad_sample`` after the backward pass).
``image-text-classification``
    one image and its report: the mean over labels of the binary cross-entropy (multi-label), as in
    non-private training; batch normalisation runs in inference mode in a private round (see
    :mod:`fedclinic.privacy.per_example_clipping`).
``question-answering`` ``causal-lm``
    one question/answer pair: the mean next-token cross-entropy over *its own* answer tokens (and the EOS);
    the prompt is context, never a target. The output layer runs on each row's answer positions gathered into
    ``[B, A, H]`` (not on the flattened ``[tokens, H]`` the non-private loss uses, whose rows would be
    tokens). A tied output embedding (GPT-2, SmolLM2) is one parameter used by two layers: Opacus adds both
    layers' per-sample gradients before the parameter's per-sample gradient is read (its forward counter),
    so the clipped norm is that of the whole tied gradient.

Every family's model keeps its rows independent (attention is masked within a row; there is no batch
normalisation in training mode), which the per-row bound also needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedclinic.errors import ConfigError
from fedclinic.models.causal_lm import IGNORE as ANSWER_IGNORE
from fedclinic.models.token_classification import IGNORE as TOKEN_IGNORE

if TYPE_CHECKING:  # pragma: no cover
    import torch

_CRF_PARAMS = ("transitions", "start_transitions", "end_transitions")


class PerExampleObjective:
    """``objective(inputs, targets)`` -> the batch mean of the per-example losses (the module docstring);
    :meth:`per_example` -> the losses ``[B]``; call :meth:`after_backward` after each ``backward()``.

    ``module`` is the model's own ``torch.nn.Module`` (not an Opacus wrapper): the objective reaches its
    submodules (the CRF, the causal LM's base model and output layer) directly."""

    def __init__(self, loaded, module: "torch.nn.Module", multi_label: bool) -> None:
        self.loaded = loaded
        self.module = module
        self.multi_label = multi_label
        family = loaded.family
        if family == "question-answering":
            self._losses = self._answer_losses
        elif family == "token-classification":
            self._losses = self._crf_losses if getattr(module, "crf", None) is not None else self._token_losses
        elif family in ("text-classification", "feature-classification", "image-text-classification"):
            self._losses = self._classification_losses
        else:
            raise ConfigError(f"no per-example DP-SGD objective for the {family!r} family")
        self._crf_copies: list[tuple["torch.Tensor", "torch.Tensor"]] = []

    def __call__(self, inputs: tuple["torch.Tensor", ...], targets: "torch.Tensor") -> "torch.Tensor":
        return self.per_example(inputs, targets).mean()

    def per_example(self, inputs: tuple["torch.Tensor", ...], targets: "torch.Tensor") -> "torch.Tensor":
        return self._losses(inputs, targets)

    def after_backward(self) -> None:
        """Write the CRF parameters' per-sample gradients (``B`` x the gradient of copy b of the mean loss, the
        convention of Opacus' ``loss_reduction="mean"``) where Opacus' optimizer reads them."""
        for param, copies in self._crf_copies:
            if copies.grad is None:
                raise RuntimeError("the CRF's per-example parameter copies got no gradient; was backward() run?")
            param.grad_sample = copies.grad * copies.shape[0]
        self._crf_copies = []

    def take_parameter_copies(self) -> dict[int, "torch.Tensor"]:
        """``id(parameter) -> its per-example copies [B, ...]`` made by the last :meth:`per_example` call (the
        CRF's trained parameters; empty for other models), which then stand for the parameters in autograd;
        forgets them (a caller that reads the copies' gradients itself does not call :meth:`after_backward`)."""
        copies = {id(p): c for p, c in self._crf_copies}
        self._crf_copies = []
        return copies

    # the families -------------------------------------------------------------------------------------------

    def _classification_losses(self, inputs, y):
        import torch.nn.functional as F

        logits = self.loaded.logits(*inputs).float()
        if self.multi_label:
            return F.binary_cross_entropy_with_logits(logits, y, reduction="none").mean(dim=1)
        return F.cross_entropy(logits, y, reduction="none")

    def _token_losses(self, inputs, y):
        import torch.nn.functional as F

        ids, mask = inputs
        em = self.loaded.emissions(ids, mask).float()
        ce = F.cross_entropy(em.transpose(1, 2), y, ignore_index=TOKEN_IGNORE, reduction="none")  # [B, L], 0 if ignored
        return ce.sum(dim=1) / (y != TOKEN_IGNORE).sum(dim=1).clamp(min=1)

    def _crf_losses(self, inputs, y):
        ids, mask = inputs
        em = self.loaded.emissions(ids, mask)
        crf = self.module.crf
        batch = em.shape[0]
        per_example = []
        self._crf_copies = []
        for name in _CRF_PARAMS:
            p = getattr(crf, name)
            if p.requires_grad:
                copies = p.detach().unsqueeze(0).repeat(batch, *([1] * p.dim())).requires_grad_(True)
                self._crf_copies.append((p, copies))
            else:
                copies = p.expand(batch, *p.shape)
            per_example.append(copies)
        return crf.nll(em, y, mask, per_example=tuple(per_example))

    def _answer_losses(self, inputs, targets):
        import torch
        import torch.nn.functional as F

        ids, mask = inputs
        hidden = self.module.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        gold = targets[:, 1:]  # position t predicts token t + 1
        on = gold != ANSWER_IGNORE
        counts = on.sum(dim=1)
        width = max(1, int(counts.max()))
        # each row's answer positions, in order, packed to the left of a [B, A] grid
        order = torch.sort(on.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
        valid = torch.arange(width, device=ids.device).unsqueeze(0) < counts.unsqueeze(1)
        h = hidden.gather(1, order.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        logits = self.module.get_output_embeddings()(h).float()  # [B, A, vocab]
        tokens = gold.gather(1, order).masked_fill(~valid, ANSWER_IGNORE)
        ce = F.cross_entropy(logits.transpose(1, 2), tokens, ignore_index=ANSWER_IGNORE, reduction="none")
        return ce.sum(dim=1) / counts.clamp(min=1)


__all__ = ["PerExampleObjective"]
