"""A tiny 'pretrained' BERT folder like a hub download (config.json, model.safetensors, tokenizer), and the words of
its tokenizer."""

from __future__ import annotations

import json

import numpy as np
import torch

from tests.helpers.symptom_models import TINY_BERT

WORDS = "fever cough chills rash itch hives nausea vomit the patient reports mild severe".split()


def pretrained_bert_folder(tmp_path, tok_json, *, prefix=False, legacy_ln=False, drop=None, bin_only=False):
    """A tiny 'pretrained' BertModel folder like a hub download: config.json, model.safetensors, tokenizer."""
    from safetensors.numpy import save_file
    from transformers import BertConfig, BertModel

    folder = tmp_path / "pretrained"
    folder.mkdir()
    cfg = BertConfig(**{k: v for k, v in TINY_BERT.items() if k != "model_type"}, vocab_size=len(WORDS) + 4)
    torch.manual_seed(0)
    enc = BertModel(cfg)
    cfg.save_pretrained(folder)
    weights = {k: v.numpy().copy() for k, v in enc.state_dict().items()}
    if legacy_ln:
        weights = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                   for k, v in weights.items()}
    if prefix:
        weights = {f"bert.{k}": v for k, v in weights.items()}
    if drop:
        weights = {k: v for k, v in weights.items() if drop not in k}
    weights["embeddings.position_ids"] = np.arange(64, dtype=np.int64)[None]  # a non-persistent buffer in old files
    if bin_only:
        (folder / "pytorch_model.bin").write_bytes(b"pickle would be here")
    else:
        save_file(weights, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_bytes(tok_json)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    return folder, {k: v.numpy() for k, v in enc.state_dict().items()}


def declare_pooling(folder, **modes) -> None:
    """Make ``folder`` a sentence-transformers folder whose Pooling module sets ``pooling_mode_<k> = v``."""
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    config = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False}
    config.update({f"pooling_mode_{k}": v for k, v in modes.items()})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
