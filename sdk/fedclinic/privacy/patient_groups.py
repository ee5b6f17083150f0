"""Per-patient DP-SGD: which rows belong to which patient, Poisson sampling of whole patients, and parts of whole
patients.

With ``privacy.unit = "patient"`` the unit of privacy is a patient (a *group*: every row of the site's dataset
that carries the same patient id, the column the site names with ``group_field``), not a row. DP-SGD then
runs on groups exactly as it runs on examples (Abadi et al. 2016, Algorithm 1, with "example" read as
"group")::

    B   = Poisson sample of the site's G groups, each kept with probability q (all of its rows with it)
    g_k = grad of sum_{i in group k} loss(x_i)                  (one gradient per group; NOT a sum of row norms)
    g   = ( sum_{k in B} g_k * min(1, C / ||g_k||) + N(0, (sigma C)^2 I) ) / (q G)

Adding or removing one patient (all of their rows) changes the sample and the clipped sum exactly as adding or
removing one example does in row-level DP-SGD, so the sampled Gaussian mechanism's accounting (Mironov et al.
2019) holds with q over groups and the same steps. A patient with many rows moves the model more than one with
few *before* clipping; after clipping each patient's total contribution to a step is at most C, whatever their
row count.

:class:`PatientGroups` maps each row to its group (ids are data: they stay in memory at the site and are never
logged or sent), draws the rows of a Poisson sample of groups, and splits a sample into parts of whole groups of
at most ``part_size`` rows (a group larger than that is a part on its own), so that a group's gradient is
always formed from all of its rows at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Iterator, Sequence

from fedclinic.errors import DatasetError

if TYPE_CHECKING:  # pragma: no cover
    import torch


class PatientGroups:
    """The patient (group) of each row of a site's dataset, as indices ``0..G-1`` (first appearance order)."""

    def __init__(self, ids: Sequence[Hashable]) -> None:
        import torch

        if len(ids) == 0:
            raise DatasetError("no training rows; the site's dataset is empty", rule="the dataset is empty")
        index: dict[Hashable, int] = {}
        row_group = [index.setdefault(v, len(index)) for v in ids]
        self.num_groups = len(index)
        self.row_group = torch.tensor(row_group, dtype=torch.int64)
        #: rows ordered by group (stable: a group's rows keep their file order)
        self._by_group = torch.argsort(self.row_group, stable=True)

    def __len__(self) -> int:
        return int(self.row_group.numel())

    def sample(self, keep: "torch.Tensor") -> "torch.Tensor":
        """The rows of the kept groups (``keep``: bool ``[G]``), each group's rows together, groups in index
        order."""
        if keep.shape != (self.num_groups,):
            raise ValueError(f"keep must have one entry per group ({self.num_groups}), got {tuple(keep.shape)}")
        rows = self._by_group
        return rows[keep[self.row_group[rows]]]

    def parts(self, idx: "torch.Tensor", part_size: int) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
        """Split a sample ``idx`` (rows, each group's rows contiguous, as :meth:`sample` returns them) into parts
        of whole groups of at most ``part_size`` rows (a larger group is a part alone); yields ``(rows,
        local_group)`` with ``local_group`` the part's group index ``0..g-1`` of each row."""
        import torch

        if len(idx) == 0:
            return
        groups = self.row_group[idx]
        change = torch.ones(len(idx), dtype=torch.bool)
        change[1:] = groups[1:] != groups[:-1]
        starts = change.nonzero().flatten().tolist() + [len(idx)]
        begin = 0
        for k in range(1, len(starts)):
            # close the part before group k-1 when adding it would exceed part_size (and the part is not empty)
            if starts[k] - begin > part_size and starts[k - 1] > begin:
                yield self._part(idx, groups, begin, starts[k - 1])
                begin = starts[k - 1]
        yield self._part(idx, groups, begin, len(idx))

    @staticmethod
    def _part(idx, groups, begin: int, end: int) -> tuple["torch.Tensor", "torch.Tensor"]:
        import torch

        rows, g = idx[begin:end], groups[begin:end]
        local = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64), (g[1:] != g[:-1]).long()]), 0)
        return rows, local


__all__ = ["PatientGroups"]
