"""The image-text family's network and its configuration: the ResNet + (Bi)LSTM late-fusion classifier.

The contract (the network's layers, tensor names and batch-norm rules are stated in
:mod:`fedclinic.models.image_text`, the family's module):

- :data:`IMAGE_TEXT_DEFAULTS` are the ``arch_config`` keys a task may set; :func:`image_text_arch_config` returns
  the full, validated ``arch_config`` (defaults or ``base`` updated with ``config``, plus the tokenizer's
  ``vocab_size`` and ``pad_token_id``) or raises one ConfigError naming every bad key;
- :func:`build_module` builds the torch module for an ``arch_config`` and a label count, seeded, in float32
  (``num_batches_tracked`` is never a tensor of it), so every site and the aggregator build the same initial
  weights from the same seed;
- :func:`check_architecture` accepts only :data:`ARCHITECTURES`.

Packaging, building a package's model, its training step and evaluation are :mod:`fedclinic.models.image_text`.
Importing this module imports neither torch nor transformers; they load when a module is built.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from fedclinic.errors import ConfigError
from fedclinic.models.base import seeded
from fedclinic.models.text_classification import lstm_final_states_unpacked

FAMILY = "image-text-classification"
FORMAT = 1
ARCHITECTURE = "resnet-bilstm"
ARCHITECTURES = (ARCHITECTURE,)

#: architecture settings (``[model_config]`` of a task); see the module doc
IMAGE_TEXT_DEFAULTS: dict[str, Any] = {
    "image_size": 224,
    "image_mean": 0.5,
    "image_std": 0.5,
    "resnet_embedding_size": 64,
    "resnet_hidden_sizes": [256, 512, 1024, 2048],
    "resnet_depths": [3, 4, 6, 3],
    "resnet_layer_type": "bottleneck",
    "resnet_downsample_in_first_stage": False,
    "resnet_downsample_in_bottleneck": False,
    "embedding_dim": 128,
    "lstm_hidden": 128,
    "lstm_layers": 1,
    "bidirectional": True,
    "branch_hidden": 128,
    "branch_dim": 64,
    "fusion_hidden": 128,
    "dropout": 0.5,
}
#: grayscale normalisation used with a pretrained (ImageNet) ResNet: the means of ImageNet's RGB mean and std
PRETRAINED_IMAGE_MEAN = 0.449
PRETRAINED_IMAGE_STD = 0.226
_RESNET_KEYS = ("resnet_embedding_size", "resnet_hidden_sizes", "resnet_depths", "resnet_layer_type",
                "resnet_downsample_in_first_stage", "resnet_downsample_in_bottleneck")
_POSITIVE_INTS = ("image_size", "resnet_embedding_size", "embedding_dim", "lstm_hidden", "lstm_layers",
                  "branch_hidden", "branch_dim", "fusion_hidden")



# ------------------------------------------------------------------------------------------------------------
# the torch module


def _net_class():
    import torch
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence
    from transformers import ResNetConfig, ResNetModel

    def projection(n_in: int, hidden: int, out: int, dropout: float) -> nn.Sequential:
        return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, out), nn.ReLU())

    class ImageTextNet(nn.Module):
        """ResNet image branch + (Bi)LSTM text branch, late fusion, one logit per label (module doc)."""

        def __init__(self, arch: Mapping[str, Any], num_labels: int) -> None:
            super().__init__()
            config = ResNetConfig(
                num_channels=1, embedding_size=arch["resnet_embedding_size"],
                hidden_sizes=list(arch["resnet_hidden_sizes"]), depths=list(arch["resnet_depths"]),
                layer_type=arch["resnet_layer_type"], hidden_act="relu",
                downsample_in_first_stage=arch["resnet_downsample_in_first_stage"],
                downsample_in_bottleneck=arch["resnet_downsample_in_bottleneck"])
            self.image_encoder = ResNetModel(config)
            for m in self.image_encoder.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.num_batches_tracked = None  # never read with a fixed momentum; keeps every tensor float
            dropout = float(arch["dropout"])
            self.image_proj = projection(config.hidden_sizes[-1], arch["branch_hidden"], arch["branch_dim"], dropout)
            self.bidirectional = bool(arch["bidirectional"])
            self.text_embedding = nn.Embedding(arch["vocab_size"], arch["embedding_dim"],
                                               padding_idx=arch["pad_token_id"])
            layers = int(arch["lstm_layers"])
            self.text_lstm = nn.LSTM(arch["embedding_dim"], arch["lstm_hidden"], num_layers=layers, batch_first=True,
                                     bidirectional=self.bidirectional, dropout=dropout if layers > 1 else 0.0)
            text_out = arch["lstm_hidden"] * (2 if self.bidirectional else 1)
            self.text_proj = projection(text_out, arch["branch_hidden"], arch["branch_dim"], dropout)
            self.fusion = nn.Sequential(nn.Linear(2 * arch["branch_dim"], arch["fusion_hidden"]), nn.ReLU(),
                                        nn.Dropout(dropout))
            self.classifier = nn.Linear(arch["fusion_hidden"], num_labels)

        def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
            """``[B, 1, S, S]`` -> the ResNet's globally average-pooled features ``[B, H_img]``."""
            return self.image_encoder(pixel_values).pooler_output.flatten(1)

        def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """``[B, L]`` ids and mask -> the last LSTM layer's final hidden state(s) ``[B, H_txt]``.

            Exported to ONNX through :func:`~fedclinic.models.text_classification.lstm_final_states_unpacked`
            (the same states without packing; the export's parity check compares the two)."""
            if torch.compiler.is_exporting():
                return lstm_final_states_unpacked(self.text_embedding(input_ids), attention_mask, self.text_lstm,
                                                  self.bidirectional)
            lengths = attention_mask.sum(dim=1).clamp(min=1).to("cpu", torch.int64)
            packed = pack_padded_sequence(self.text_embedding(input_ids), lengths, batch_first=True,
                                          enforce_sorted=False)
            _, (h_n, _) = self.text_lstm(packed)  # [layers * dirs, B, hidden], in input order
            return torch.cat([h_n[-2], h_n[-1]], dim=-1) if self.bidirectional else h_n[-1]

        def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> torch.Tensor:
            text = self.text_proj(self.text_features(input_ids, attention_mask))
            image = self.image_proj(self.image_features(pixel_values))
            return self.classifier(self.fusion(torch.cat([text, image], dim=-1)))

        def train(self, mode: bool = True) -> "ImageTextNet":
            """As nn.Module.train, except that batch norm whose weight is not trained stays in inference mode.
            A private (DP-SGD) round puts every batch norm in inference mode, trained weight or not
            (:func:`fedclinic.privacy.dp_sgd.freeze_batch_norm`: in training mode it mixes the batch's examples)."""
            super().train(mode)
            if mode:
                for m in self.modules():
                    if (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None
                            and not m.weight.requires_grad):
                        m.eval()
            return self

    return ImageTextNet


def build_module(arch: Mapping[str, Any], num_labels: int, seed: int):
    with seeded(seed):
        return _net_class()(arch, num_labels).float()



# ------------------------------------------------------------------------------------------------------------
# configuration


def image_text_arch_config(config: Mapping[str, Any] | None, *, vocab_size: int, pad_token_id: int,
                           base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The full, validated ``arch_config``: :data:`IMAGE_TEXT_DEFAULTS` (or ``base``) updated with ``config``,
    plus the tokenizer's ``vocab_size`` and ``pad_token_id``. ConfigError names every bad key."""
    config = dict(config or {})
    config.pop("vocab_size", None)
    config.pop("pad_token_id", None)
    unknown = sorted(set(config) - set(IMAGE_TEXT_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown {FAMILY} config key(s) {unknown}; allowed: {sorted(IMAGE_TEXT_DEFAULTS)}")
    out = {**dict(base or IMAGE_TEXT_DEFAULTS), **config, "vocab_size": int(vocab_size), "pad_token_id": int(pad_token_id)}
    p: list[str] = []

    def positive_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    for key in _POSITIVE_INTS:
        if not positive_int(out[key]):
            p.append(f"{key} must be a positive integer, got {out[key]!r}")
    if positive_int(out["image_size"]) and out["image_size"] < 8:
        p.append(f"image_size must be >= 8 (the ResNet stem alone downsamples by 4), got {out['image_size']}")
    for key in ("resnet_hidden_sizes", "resnet_depths"):
        v = out[key]
        if not isinstance(v, (list, tuple)) or not v or not all(positive_int(x) for x in v):
            p.append(f"{key} must be a non-empty list of positive integers, got {v!r}")
        else:
            out[key] = [int(x) for x in v]
    if (isinstance(out["resnet_hidden_sizes"], list) and isinstance(out["resnet_depths"], list)
            and len(out["resnet_hidden_sizes"]) != len(out["resnet_depths"])):
        p.append(f"resnet_hidden_sizes and resnet_depths need one entry per stage; got "
                 f"{len(out['resnet_hidden_sizes'])} and {len(out['resnet_depths'])}")
    if out["resnet_layer_type"] not in ("basic", "bottleneck"):
        p.append(f"resnet_layer_type must be 'basic' or 'bottleneck', got {out['resnet_layer_type']!r}")
    for key in ("bidirectional", "resnet_downsample_in_first_stage", "resnet_downsample_in_bottleneck"):
        if not isinstance(out[key], bool):
            p.append(f"{key} must be true or false, got {out[key]!r}")
    if not isinstance(out["dropout"], (int, float)) or isinstance(out["dropout"], bool) or \
            not 0.0 <= float(out["dropout"]) < 1.0:
        p.append(f"dropout must be in [0, 1), got {out['dropout']!r}")
    for key in ("image_mean", "image_std"):
        v = out[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            p.append(f"{key} must be a finite number, got {v!r}")
    if isinstance(out["image_std"], (int, float)) and not out["image_std"] > 0:
        p.append(f"image_std must be > 0, got {out['image_std']!r}")
    if p:
        raise ConfigError(f"invalid {FAMILY} config: " + "; ".join(p))
    out["dropout"] = float(out["dropout"])
    out["image_mean"] = float(out["image_mean"])
    out["image_std"] = float(out["image_std"])
    return out


def check_architecture(architecture: Any) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; "
                          f"choose one of: {', '.join(ARCHITECTURES)}")
    return str(architecture)



__all__ = ["ARCHITECTURE", "ARCHITECTURES", "FAMILY", "FORMAT", "IMAGE_TEXT_DEFAULTS", "PRETRAINED_IMAGE_MEAN",
           "PRETRAINED_IMAGE_STD", "build_module", "check_architecture", "image_text_arch_config"]
