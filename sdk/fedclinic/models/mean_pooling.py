"""Mean pooling for transformer sequence classifiers: ``logits = W · mean_{i: mask_i = 1} h_i + b``.

Hugging Face's ``*ForSequenceClassification`` for BERT reads the last layer at ``[CLS]`` only, through a
pretrained ``pooler`` (dense + tanh, trained on next-sentence prediction). Sentence encoders such as
``all-MiniLM-L6-v2`` were trained with mean pooling instead (their ``1_Pooling/config.json`` says so) and never
trained that pooler. With ``pooling = "mean"`` the classifier is

    h = encoder(input_ids, attention_mask).last_hidden_state            [batch, seq, hidden]
    p = sum_i mask_i h_i / max(1, sum_i mask_i)                          [batch, hidden]
    logits = classifier(dropout(p))                                      [batch, labels]

The encoder is built without a pooler (``add_pooling_layer=False`` where the class has one), so the model has no
tensor that does not train: every tensor a site sends carries information (issue #6 counts bytes). Tensor names
keep Hugging Face's layout (``bert.encoder.layer.{i}...``, ``classifier.weight``), so trainable, SAFL, LoRA and
private patterns read the same as for the ``[CLS]`` form. The sentence-transformers L2 normalisation is left out:
the head learns its own scale.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from fedclinic.spec.capabilities import POOLINGS, pooling_problem  # noqa: F401  (re-exported)

#: model types whose base class takes ``add_pooling_layer``
_WITH_POOLER_FLAG = ("bert", "roberta")


def sentence_transformers_pooling(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers folder declares (``"mean"`` or ``"cls"``), None when it declares none.

    Reads ``modules.json`` and the Pooling module's ``config.json`` (plain JSON). Other modes (max, sqrt-length)
    return None: this package implements only the two forms in :data:`POOLINGS`."""
    folder = Path(folder)
    try:
        modules = json.loads((folder / "modules.json").read_text())
        pooling = next(m for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = json.loads((folder / str(pooling.get("path", "")) / "config.json").read_text())
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None
    modes = {k for k, v in config.items() if k.startswith("pooling_mode_") and v is True}
    return {frozenset({"pooling_mode_mean_tokens"}): "mean",
            frozenset({"pooling_mode_cls_token"}): "cls"}.get(frozenset(modes))


def pooling_notice(folder: str | Path, chosen: str) -> str | None:
    """A sentence saying that ``folder`` declares another pooling (its sentence-transformers config) than the
    task's ``chosen`` one (``"cls"`` or ``"mean"``) and how to switch; None when it declares none or the same."""
    declared = sentence_transformers_pooling(folder)
    if declared is None or declared == chosen:
        return None
    why = " (the task's default)" if chosen == "cls" else ""
    return (f"{folder} was trained with {declared} pooling (its sentence-transformers config) but the task uses "
            f"{chosen} pooling{why}; set [model_config] pooling = \"{declared}\" to use the pooling it was trained "
            f"with, or keep {chosen}")


@functools.cache
def mean_pooled_classifier_class():
    """The torch module class (built once, lazily, so importing fedclinic does not import torch)."""
    import torch
    from torch import nn
    from transformers import AutoModel
    from transformers.modeling_outputs import SequenceClassifierOutput

    class MeanPooledClassifier(nn.Module):
        """``encoder -> masked mean over positions -> dropout -> linear``; see the module docstring.

        Looks like a Hugging Face classifier to the rest of fedclinic: ``config``, ``base_model_prefix``,
        ``set_attn_implementation`` and ``forward(input_ids, attention_mask, output_attentions=...)`` returning
        ``.logits`` and ``.attentions``. ``attention_mask`` may be the usual ``[batch, seq]`` 0/1 mask or the 4-D
        additive mask ``(1 - mask) * c`` (c < 0) of :func:`fedclinic.export.encoder_fusion.encoder_export_forward`;
        the encoder gets it as given, the pooling reads the padding positions back from it."""

        def __init__(self, config: Any) -> None:
            super().__init__()
            extra = {"add_pooling_layer": False} if config.model_type in _WITH_POOLER_FLAG else {}
            encoder = AutoModel.from_config(config, **extra)
            self.base_model_prefix = encoder.base_model_prefix
            self.add_module(self.base_model_prefix, encoder)
            dropout = getattr(config, "classifier_dropout", None)
            if dropout is None:
                dropout = getattr(config, "hidden_dropout_prob", 0.1)
            self.dropout = nn.Dropout(float(dropout))
            self.classifier = nn.Linear(int(config.hidden_size), int(config.num_labels))
            std = float(getattr(config, "initializer_range", 0.02))
            nn.init.normal_(self.classifier.weight, mean=0.0, std=std)  # what HF's _init_weights does to a head
            nn.init.zeros_(self.classifier.bias)

        @property
        def encoder(self) -> nn.Module:
            return getattr(self, self.base_model_prefix)

        @property
        def config(self) -> Any:
            return self.encoder.config

        def set_attn_implementation(self, implementation: str) -> None:
            self.encoder.set_attn_implementation(implementation)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    output_attentions: bool = False) -> SequenceClassifierOutput:
            out = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                               output_attentions=output_attentions)
            keep = (attention_mask[:, 0, 0, :] == 0 if attention_mask.dim() == 4 else attention_mask != 0)
            weights = keep.to(out.last_hidden_state.dtype).unsqueeze(-1)          # [batch, seq, 1]
            pooled = (out.last_hidden_state * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
            return SequenceClassifierOutput(logits=self.classifier(self.dropout(pooled)),
                                            attentions=out.attentions if output_attentions else None)

    return MeanPooledClassifier
