"""Clipped sum of per-example gradients in one backward pass, without per-example gradients.

DP-SGD needs, for a batch of B examples with losses ``l_b`` (each a function of example b alone)::

    S = sum_b c_b g_b,        g_b = grad_theta l_b,        c_b = min(1, C / ||g_b||)

Every trained parameter here belongs to a layer whose per-example gradient is a sum over the example's positions
t of its input ``a_{b,t}`` and the output gradient ``e_{b,t}`` (the gradient of ``sum_b l_b`` with respect to
the layer's output at t; it is l_b's own, since rows are independent)::

    Linear     y = a W^T + beta      g_b(W) = sum_t e_{b,t} a_{b,t}^T          g_b(beta) = sum_t e_{b,t}
    LayerNorm  y = n(a) * w + beta   g_b(w) = sum_t e_{b,t} * n(a_{b,t})       g_b(beta) = sum_t e_{b,t}
    Embedding  y = E[i]              g_b(E) = sum_t onehot(i_{b,t}) e_{b,t}^T  (no row for padding_idx)
    LoRA       y = a W^T + beta + s a A^T B^T  (adapters on a Linear, :mod:`fedclinic.models.lora`, s = alpha/r)
                                     g_b(B) = s sum_t e_{b,t} (A a_{b,t})^T    g_b(A) = s sum_t (B^T e_{b,t}) a_{b,t}^T

One forward pass records each layer's input and its output's place in the autograd graph (not the output
itself, which autograd may free); one backward pass, ``torch.autograd.grad`` of ``sum_b l_b`` with respect to
those outputs only (no parameter gradient is formed), gives the ``e``.
The squared norms then come per layer without ``g_b`` (ghost norms, Li et al. 2022)::

    ||g_b(W)||^2 = sum_{t,s} (e_{b,t} . e_{b,s}) (a_{b,t} . a_{b,s})       when T (d_in + d_out) <= d_in d_out
                 = ||sum_t e_{b,t} a_{b,t}^T||^2  (the [B, d_out, d_in] per-example gradient) otherwise
    ||g_b(E)||^2 = sum_{t,s: i_{b,t} = i_{b,s} != padding_idx} e_{b,t} . e_{b,s}

The adapters' gradients are Linear weight gradients of the same form (Hu et al. 2021, eq. 3: h = W_0 x + B A x):
``B`` reads the input ``h = s a A^T`` ([T, r]) with output gradient ``e``, ``A`` reads ``a`` with output gradient
``u = s e B`` ([T, r]), so both get the Linear rule above (Gram or direct form, whichever is cheaper; with a small
rank the direct ``[B, out, r]`` and ``[B, r, in]`` products usually are). ``e`` is the gradient of the adapted
output, which is also that of the base output and of the adapter term (they are added).

``||g_b||^2`` is their sum over parameters, which is exact because every trained parameter is used by exactly
one layer call (checked on the autograd graph at the first batch: a tied or re-used parameter, or one read
outside its layer, is refused). Finally ``S`` is formed from the same records with ``e_{b,t}`` rescaled by
``c_b`` ("book-keeping", Bu et al. 2023), e.g. ``S(W) = sum_{b,t} c_b e_{b,t} a_{b,t}^T``: one matmul, the
cost of an ordinary weight gradient. ``S`` adds over examples, so a batch may be processed in parts (each
part's ``S`` is added to ``p.grad``). Compared with two-pass ghost clipping there is no second backward pass
and no retained graph; compared with per-example gradients, memory holds only the layers' inputs (autograd
keeps them anyway) and output gradients until ``S`` is formed.

Groups (per-patient DP)
-----------------------
With ``groups`` (row -> group index, e.g. the patient each row belongs to) the unit is a group G, its gradient
``g_G = sum_{b in G} g_b`` (not a sum of row norms) and ``S = sum_G min(1, C/||g_G||) g_G``. Every rule above is a
sum over an example's positions, so a group is one example whose positions are all of its rows' positions:
:func:`group_records` lays each record out as ``[G, R*T, ...]`` (a group's rows concatenated along the position
axis, groups with fewer than R rows padded with zeros). A zero input and a zero output gradient add nothing to
any of the sums (an Embedding's padded ids meet zero output gradients), so the norms and ``S`` above, applied to
these records, are those of the groups, e.g. ``||g_G(W)||^2 = sum_{t,s in G} (e_t . e_s)(a_t . a_s)`` over all
token pairs of all of G's rows; each row's output gradient is scaled by its group's ``c_G``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from fedclinic.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

HOOKS_HINT = "use mode 'hooks' for this model"


@dataclass
class _Call:
    """One call of a recorded layer in the forward pass: its input and where its output enters the graph."""

    module: "torch.nn.Module"
    inp: "torch.Tensor"
    out: Any  # torch.autograd.graph.GradientEdge


def _layer_types() -> tuple[type, ...]:
    import torch

    return (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Embedding)


def unsupported_parameters(module: "torch.nn.Module", params: Sequence["torch.nn.Parameter"]) -> list[str]:
    """Names of the trained parameters that are not the weight or bias of a plain ``Linear``, ``LayerNorm``
    (affine) or ``Embedding`` (dense, no ``max_norm`` renormalisation, no gradient scaling by frequency)."""
    wanted = {id(p) for p in params}
    owned: set[int] = set()
    for _, sub in module.named_modules():
        if type(sub) not in _layer_types() or not _plain(sub):
            continue
        owned.update(id(p) for p in _owned(sub) if id(p) in wanted)
    return [name for name, p in module.named_parameters() if id(p) in wanted and id(p) not in owned]


def _owned(sub) -> list:
    """The parameters of a supported layer that its rule covers: weight and bias, plus a Linear's LoRA adapters
    when it carries their scaling (:data:`fedclinic.models.lora.SCALING_ATTR`); any other parameter registered on
    the layer is not covered (its gradient would be missed), so it stays unsupported."""
    import torch

    from fedclinic.models.lora import SCALING_ATTR

    own = [getattr(sub, "weight", None), getattr(sub, "bias", None)]
    if isinstance(sub, torch.nn.Linear) and isinstance(getattr(sub, SCALING_ATTR, None), float):
        own += [getattr(sub, "lora_A", None), getattr(sub, "lora_B", None)]
    return [p for p in own if isinstance(p, torch.nn.Parameter)]


def _plain(sub) -> bool:
    import torch

    if isinstance(sub, torch.nn.Embedding):
        return sub.max_norm is None and not sub.scale_grad_by_freq and not sub.sparse
    return True


class GhostClipping:
    """Adds ``S`` (the clipped sum of the module docstring) to ``p.grad`` of the trained ``params`` of ``module``.

    Use::

        clip = GhostClipping(module, params, max_grad_norm)
        with clip.recording():
            losses = per_example_losses(batch)      # [B], l_b of example b alone
        clip.add_clipped_sum(losses)                # p.grad += sum_b c_b g_b;  returns ||g_b||  [B]
        clip.close()                                # removes the hooks

    Raises :class:`~fedclinic.errors.ConfigError` for a parameter outside the supported layers, used twice or
    outside its layer, and for a layer whose batch dimension is not the examples' (e.g. broadcast ids)."""

    def __init__(self, module: "torch.nn.Module", params: Sequence["torch.nn.Parameter"], max_grad_norm: float):
        bad = unsupported_parameters(module, params)
        if bad:
            raise ConfigError(f"ghost clipping covers Linear, LayerNorm and Embedding parameters only, not {bad[:4]} "
                              "(a Linear's LoRA adapters count as its own); "
                              + HOOKS_HINT)
        self.max_grad_norm = float(max_grad_norm)
        self.params = list(params)
        self._names = {id(p): name for name, p in module.named_parameters()}
        wanted = {id(p) for p in self.params}
        self._layers = {id(sub): [p for p in sub.parameters(recurse=False) if id(p) in wanted]
                        for sub in module.modules() if type(sub) in _layer_types()}
        self._layers = {k: v for k, v in self._layers.items() if v}
        self._calls: list[_Call] = []
        self._recording = False
        self._checked = False
        self._handles = [sub.register_forward_hook(self._record) for sub in module.modules()
                         if id(sub) in self._layers]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._calls = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the trained layers' calls during the forward pass inside this block."""
        self._calls = []
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _record(self, module, args, output) -> None:
        import torch
        from torch.autograd.graph import get_gradient_edge

        if self._recording and torch.is_grad_enabled() and output.requires_grad:
            self._calls.append(_Call(module, args[0].detach(), get_gradient_edge(output)))

    def add_clipped_sum(self, losses: "torch.Tensor", groups: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Add ``sum_b min(1, C / ||g_b||) g_b`` to ``p.grad`` of every trained parameter the losses depend on
        (``p.grad`` None counts as zero; a parameter they do not depend on is left as it is) and return the
        per-example gradient norms ``||g_b||`` ``[B]``. With ``groups`` (``[B]`` int64, the group index
        0..G-1 of each row; see "Groups" in the module docstring) the units are the groups: adds
        ``sum_G min(1, C / ||g_G||) g_G`` and returns ``||g_G||`` ``[G]``."""
        import torch

        calls, self._calls = self._calls, []
        if losses.dim() != 1:
            raise ValueError(f"add_clipped_sum needs one loss per example ([B]), got shape {tuple(losses.shape)}")
        batch = int(losses.shape[0])
        if not self._checked:
            self._check_single_use(losses, calls)
            self._checked = True
        for call in calls:
            if call.inp.shape[0] != batch:
                raise ConfigError(f"{type(call.module).__name__} ran on a batch of {call.inp.shape[0]} rows for "
                                  f"{batch} examples (inputs broadcast over the batch?); " + HOOKS_HINT)
        grads = torch.autograd.grad(losses.sum(), [c.out for c in calls], allow_unused=True) if calls else []
        records = [(c.module, c.inp, g) for c, g in zip(calls, grads) if g is not None]
        del calls, grads
        if groups is not None:
            records, batch = group_records(records, groups)
        sq = torch.zeros(batch, dtype=torch.float32, device=losses.device)
        grams: dict = {}  # layers reading the same input (attention's query, key, value) share a a^T
        small: dict = {}  # per-example gradients [B, ...] of the small parameters (biases, LayerNorm)
        for module, a, e in records:
            sq += _squared_norms(module, a, e, self._layers[id(module)], grams, small)
        del grams
        norms = sq.sqrt()
        coef = (self.max_grad_norm / norms.clamp(min=1e-12)).clamp(max=1.0)
        for p, per_example in small.values():
            _add_grad(p, torch.tensordot(coef.to(per_example.dtype), per_example, dims=1))
        del small
        while records:  # popped, so each layer's input and output gradient are freed once used
            module, a, e = records.pop()
            _accumulate(module, a, e, coef, self._layers[id(module)])
            del module, a, e
        return norms

    def _check_single_use(self, losses: "torch.Tensor", calls: list[_Call]) -> None:
        """Every trained parameter is read by exactly as many autograd edges as its layer has recorded calls,
        and by at most one call: otherwise per-layer norms do not add up to the example's norm."""
        uses: dict[int, int] = {}
        # visited nodes by id, each kept alive: a graph node's Python wrapper lives only while referenced (the same
        # one is returned while it lives), so with a bare set of ids a later node could get a freed wrapper's
        # address and be skipped as seen (CPython 3.12 did so: most of a BERT's graph unseen, parameters "read 0 times")
        seen: dict[int, object] = {}
        stack = [losses.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                variable = getattr(nxt, "variable", None)
                if variable is not None:
                    uses[id(variable)] = uses.get(id(variable), 0) + 1
                else:
                    stack.append(nxt)
        layer_calls: dict[int, int] = {}
        for c in calls:
            layer_calls[id(c.module)] = layer_calls.get(id(c.module), 0) + 1
        for layer, params in self._layers.items():
            n_calls = layer_calls.get(layer, 0)
            for p in params:
                n_uses = uses.get(id(p), 0)
                if n_calls > 1 or n_uses != n_calls:
                    name = self._names.get(id(p), tuple(p.shape))
                    raise ConfigError(f"trained parameter {name} is read {n_uses} times in the forward pass by "
                                      f"{n_calls} calls of its layer (tied, re-used or read outside its layer); "
                                      "ghost clipping needs one use per parameter; " + HOOKS_HINT)


def group_records(records: list, groups: "torch.Tensor") -> tuple[list, int]:
    """The ``(module, input, output gradient)`` records of a batch of rows laid out per group: each tensor
    ``[B, positions..., features...]`` becomes ``[G, R*T, features...]`` (group ``k``'s rows in batch order,
    concatenated along the positions, zero-padded to the largest group's R rows; T = the positions of a row,
    1 when a row has none). Returns the records and G. Rows already one per group, in order, are returned as
    they are. ConfigError for a layer kind whose feature axes are not known here."""
    import torch

    groups = groups.to(torch.int64).reshape(-1)
    rows = int(groups.numel())
    if rows == 0:
        return records, 0
    num = int(groups.max()) + 1
    if int(groups.min()) < 0:
        raise ValueError("group indices must be 0..G-1")
    if num == rows and bool((groups == torch.arange(rows, device=groups.device)).all()):
        return records, rows
    # position of each row inside its group (rows of a group keep their batch order)
    order = torch.argsort(groups, stable=True)
    counts = torch.bincount(groups, minlength=num)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(groups)
    pos[order] = torch.arange(rows, device=groups.device) - starts[groups[order]]
    width = int(counts.max())
    memo: dict = {}  # an input read by several layers (attention's query, key, value) is regrouped once

    def lay_out(x: "torch.Tensor", feature_dims: int) -> "torch.Tensor":
        key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, feature_dims)
        if key in memo:
            return memo[key]
        feat = tuple(x.shape[x.dim() - feature_dims:]) if feature_dims else ()
        flat = x.reshape(rows, -1, *feat)
        out = flat.new_zeros((num, width, *flat.shape[1:]))
        out[groups, pos] = flat
        memo[key] = out.reshape(num, width * flat.shape[1], *feat)
        return memo[key]

    out = []
    for module, a, e in records:
        a_dims, e_dims = _feature_dims(module)
        out.append((module, lay_out(a, a_dims), lay_out(e, e_dims)))
    return out, num


def _feature_dims(module) -> tuple[int, int]:
    """How many trailing axes of a layer's input and of its output gradient are features (the rest, after the
    batch axis, are positions)."""
    import torch

    if isinstance(module, torch.nn.Linear):
        return 1, 1
    if isinstance(module, torch.nn.LayerNorm):
        return len(module.normalized_shape), len(module.normalized_shape)
    if isinstance(module, torch.nn.Embedding):
        return 0, 1
    raise ConfigError(f"per-group clipping does not know the feature axes of {type(module).__name__}; "
                      + HOOKS_HINT)


def _squared_norms(module, a: "torch.Tensor", e: "torch.Tensor", params: list, grams: dict,
                   small: dict) -> "torch.Tensor":
    """sum over the layer's trained parameters of ``||g_b(p)||^2``, ``[B]`` (the module docstring). The
    per-example gradients of biases and LayerNorm weights (``[B, d]``) are cheap: they go to ``small`` as
    ``id(p) -> (p, g)``; ``grams`` caches ``a a^T`` per input tensor."""
    import torch
    import torch.nn.functional as F

    wanted = {id(p) for p in params}
    batch = e.shape[0]
    if isinstance(module, torch.nn.Linear):
        a, e = a.to(e.dtype).reshape(batch, -1, a.shape[-1]), e.reshape(batch, -1, e.shape[-1])
        sq = torch.zeros(batch, dtype=torch.float32, device=e.device)
        if id(module.weight) in wanted:
            sq += _outer_squared_norms(a, e, grams)
        if module.bias is not None and id(module.bias) in wanted:
            small[id(module.bias)] = (module.bias, e.sum(1))
        sq += lora_squared_norms(module, a, e, wanted, grams)
        return sq + _small_norms(small, (module.bias,))
    if isinstance(module, torch.nn.LayerNorm):
        dims = tuple(range(1, e.dim() - len(module.normalized_shape)))
        if module.weight is not None and id(module.weight) in wanted:
            prod = e * F.layer_norm(a, module.normalized_shape, eps=module.eps)
            small[id(module.weight)] = (module.weight, prod.sum(dims) if dims else prod)
        if module.bias is not None and id(module.bias) in wanted:
            small[id(module.bias)] = (module.bias, e.sum(dims) if dims else e)
        sq = torch.zeros(batch, dtype=torch.float32, device=e.device)
        return sq + _small_norms(small, (module.weight, module.bias))
    # Embedding: positions with the same id add up in one row of the gradient
    ids = a.reshape(batch, -1)
    e = e.reshape(batch, -1, e.shape[-1])
    if module.padding_idx is not None:
        e = e * (ids != module.padding_idx).unsqueeze(-1).to(e.dtype)
    same = (ids.unsqueeze(2) == ids.unsqueeze(1)).to(e.dtype)
    return torch.linalg.vecdot(torch.bmm(e, e.transpose(1, 2)).flatten(1), same.flatten(1)).float()


def _outer_squared_norms(a: "torch.Tensor", e: "torch.Tensor", grams: dict | None) -> "torch.Tensor":
    """``||sum_t e_{b,t} a_{b,t}^T||^2`` per example, ``[B]`` (float32), for ``a`` ``[B, T, d_in]`` and ``e``
    ``[B, T, d_out]``: from the Gram matrices when ``T (d_in + d_out) <= d_in d_out``, else from the products.
    ``grams`` caches ``a a^T`` by ``a``'s storage (None: no caching, for an ``a`` that is not kept alive)."""
    import torch

    t, d_in, d_out = a.shape[1], a.shape[2], e.shape[2]
    if t == 1:
        return (e.square().sum((1, 2)) * a.square().sum((1, 2))).float()
    if t * (d_in + d_out) <= d_in * d_out:
        key = (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
        gram = grams.get(key) if grams is not None else None
        if gram is None:
            gram = torch.bmm(a, a.transpose(1, 2))
            if grams is not None:
                grams[key] = gram
        return torch.linalg.vecdot(torch.bmm(e, e.transpose(1, 2)).flatten(1), gram.flatten(1)).float()
    return torch.bmm(e.transpose(1, 2), a).square().sum((1, 2)).float()


def _lora_terms(module, a: "torch.Tensor", e: "torch.Tensor", wanted: set) -> tuple:
    """``(h, u)`` of the module docstring for an adapted Linear (``h = s a A^T`` when ``B`` is trained, ``u = s e B``
    when ``A`` is; None otherwise), with ``a``, ``e`` of shape ``[..., d]``."""
    from fedclinic.models.lora import SCALING_ATTR

    lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
    scaling = getattr(module, SCALING_ATTR, None)
    if lora_a is None or lora_b is None or scaling is None:
        return None, None
    h = (a @ lora_a.detach().t().to(a.dtype)) * scaling if id(lora_b) in wanted else None
    u = (e @ lora_b.detach().to(e.dtype)) * scaling if id(lora_a) in wanted else None
    return h, u


def lora_squared_norms(module, a: "torch.Tensor", e: "torch.Tensor", wanted: set, grams: dict) -> "torch.Tensor":
    """``||g_b(A)||^2 + ||g_b(B)||^2`` ``[B]`` for the trained LoRA adapters of a Linear (zero when it has none);
    ``a`` ``[B, T, d_in]``, ``e`` ``[B, T, d_out]`` (the module docstring's LoRA rule)."""
    import torch

    sq = torch.zeros(e.shape[0], dtype=torch.float32, device=e.device)
    h, u = _lora_terms(module, a, e, wanted)
    if h is not None:
        sq += _outer_squared_norms(h, e, None)
    if u is not None:
        sq += _outer_squared_norms(a, u, grams)  # shares a a^T with the base weight's norm
    return sq


def lora_accumulate(module, a: "torch.Tensor", e: "torch.Tensor", coef: "torch.Tensor", wanted: set) -> None:
    """Add ``S(B) = sum_b c_b sum_t e_{b,t} h_{b,t}^T`` and ``S(A) = sum_b c_b sum_t u_{b,t} a_{b,t}^T`` to the
    trained adapters' ``grad`` (nothing for a Linear without adapters)."""
    h, u = _lora_terms(module, a, e, wanted)
    shape = (-1,) + (1,) * (e.dim() - 1)
    if h is not None:
        ce = e * coef.to(e.dtype).reshape(shape)
        _add_grad(module.lora_B, ce.reshape(-1, ce.shape[-1]).t() @ h.reshape(-1, h.shape[-1]))
    if u is not None:
        cu = u * coef.to(u.dtype).reshape(shape)
        _add_grad(module.lora_A, cu.reshape(-1, cu.shape[-1]).t() @ a.reshape(-1, a.shape[-1]).to(u.dtype))


def _small_norms(small: dict, params: tuple) -> "torch.Tensor":
    """sum of ``||g_b(p)||^2`` over those of ``params`` whose per-example gradients are in ``small``."""
    total = 0.0
    for p in params:
        if p is not None and id(p) in small:
            g = small[id(p)][1]
            total = total + g.reshape(len(g), -1).square().sum(1).float()
    return total


def _add_grad(p, g: "torch.Tensor") -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)


def _accumulate(module, a: "torch.Tensor", e: "torch.Tensor", coef: "torch.Tensor", params: list) -> None:
    """Add the layer's part of ``S = sum_b c_b g_b`` for its large parameters (Linear and Embedding weights) to
    ``p.grad``; ``c_b`` rescales whichever of input and output gradient is smaller."""
    import torch

    wanted = {id(p) for p in params}
    if isinstance(module, torch.nn.Linear):
        lora_accumulate(module, a.to(e.dtype), e, coef, wanted)
        if id(module.weight) not in wanted:
            return
        a, e = a.to(e.dtype), e
        shape = (-1,) + (1,) * (e.dim() - 1)
        if a.shape[-1] <= e.shape[-1]:
            a = a * coef.to(a.dtype).reshape(shape)
        else:
            e = e * coef.to(e.dtype).reshape(shape)
        _add_grad(module.weight, e.reshape(-1, e.shape[-1]).t() @ a.reshape(-1, a.shape[-1]))
        return
    if isinstance(module, torch.nn.LayerNorm):
        return
    ids = a.reshape(-1)
    rows = (e * coef.to(e.dtype).reshape((-1,) + (1,) * (e.dim() - 1))).reshape(-1, e.shape[-1])
    if module.padding_idx is not None:
        keep = ids != module.padding_idx
        ids, rows = ids[keep], rows[keep]
    grad = torch.zeros_like(module.weight)
    grad.index_add_(0, ids, rows)
    _add_grad(module.weight, grad)


__all__ = ["GhostClipping", "group_records", "lora_accumulate", "lora_squared_norms", "unsupported_parameters"]
