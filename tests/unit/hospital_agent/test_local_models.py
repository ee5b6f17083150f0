"""hospital_agent.local_models: a task's tensors taken from the site's pretrained folders by content, never trusted
because an index says so."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import ModelPackage

from hospital_agent.local_models import INDEX_FILE, LocalModelFolders

from tests.helpers.agent_toml import AGENT_TOML


def _folder(tmp_path):
    """A pretrained folder (fp16 encoder, float32 layer norm) and the package a task would build on it: the encoder
    as float32 under prefixed names, plus a new head no folder holds."""
    folder = tmp_path / "pretrained"
    folder.mkdir()
    rng = np.random.default_rng(0)
    weights = {"encoder.w": rng.normal(size=(16, 8)).astype(np.float16),
               "encoder.norm": rng.normal(size=8).astype(np.float32)}
    save_file(weights, str(folder / "model.safetensors"))
    package = ModelPackage(tensors={"bert.encoder.w": weights["encoder.w"].astype(np.float32),
                                    "bert.encoder.norm": weights["encoder.norm"],
                                    "classifier.weight": rng.normal(size=(3, 8)).astype(np.float32)}, files={})
    return folder, package.manifest(), package


def test_the_tensors_a_folder_holds_are_copied_in_by_content_and_indexed_once(tmp_path):
    folder, manifest, package = _folder(tmp_path)
    cache = BlobStore(tmp_path / "cache")
    local = LocalModelFolders([folder], tmp_path / INDEX_FILE)
    assert local.seed(cache, manifest.tensors) == (2, 16 * 8 * 4 + 8 * 4)
    held = {t.name for t in manifest.tensors if cache.has(t.sha256)}
    assert held == {"bert.encoder.w", "bert.encoder.norm"}  # the new head is downloaded
    entry = manifest.tensor("bert.encoder.w")
    # the fp16 checkpoint tensor, as the package holds it (float32)
    np.testing.assert_array_equal(cache.array(entry.sha256, "float32", entry.shape), package.tensors["bert.encoder.w"])
    index = json.loads((tmp_path / INDEX_FILE).read_text())["files"]
    assert set(index[str(folder / "model.safetensors")]["tensors"]) == {"encoder.w", "encoder.norm"}
    # a second agent process with an empty cache takes them from the index, without hashing the file again
    again = BlobStore(tmp_path / "cache-2")
    assert LocalModelFolders([folder], tmp_path / INDEX_FILE).seed(again, manifest.tensors)[0] == 2
    assert local.seed(cache, manifest.tensors) == (0, 0)  # nothing missing: nothing read


def test_an_index_that_lies_costs_a_download_never_a_wrong_tensor(tmp_path):
    folder, manifest, _ = _folder(tmp_path)
    index_path = tmp_path / INDEX_FILE
    LocalModelFolders([folder], index_path).seed(BlobStore(tmp_path / "first"), manifest.tensors)
    # the index says the file's encoder.norm is the head (same size and time: the index is believed at first)
    doc = json.loads(index_path.read_text())
    entry = doc["files"][str(folder / "model.safetensors")]
    entry["tensors"]["encoder.norm"] = manifest.tensor("classifier.weight").sha256
    index_path.write_text(json.dumps(doc))
    cache = BlobStore(tmp_path / "cache")
    LocalModelFolders([folder], index_path).seed(cache, [manifest.tensor("classifier.weight")])
    assert not cache.has(manifest.tensor("classifier.weight").sha256)  # its bytes did not hash to the name
    # the lying entry is dropped: the file is hashed afresh the next time
    assert str(folder / "model.safetensors") not in json.loads(index_path.read_text())["files"]
    assert LocalModelFolders([folder], index_path).seed(cache, manifest.tensors)[0] == 2


def _config(tmp_path, models: str):
    from hospital_agent.config import AgentConfig

    (tmp_path / "agent.toml").write_text(AGENT_TOML + models)
    return AgentConfig.load(tmp_path / "agent.toml")


def test_the_models_table_lists_existing_folders_relative_to_the_config(tmp_path):
    from fedclinic.errors import ConfigError

    assert _config(tmp_path, "").model_folders == ()
    (tmp_path / "minilm").mkdir()
    assert _config(tmp_path, '[models]\nfolders = ["minilm"]\n').model_folders == (tmp_path / "minilm",)
    with pytest.raises(ConfigError, match="missing-model is not a folder"):
        _config(tmp_path, '[models]\nfolders = ["missing-model"]\n')
    with pytest.raises(ConfigError, match="folders must be a list"):
        _config(tmp_path, '[models]\nfolders = "minilm"\n')
    with pytest.raises(ConfigError, match="folder"):
        _config(tmp_path, '[models]\nfolder = ["minilm"]\n')
