"""The FedNER architecture ("cnn-bilstm-crf") of the token-classification family: packaging, building, the char
table derived from the tokenizer, packed vs unpacked LSTM, learning the toy NER task, and the simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedclinic.training import trainer as training
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models import build_model
from fedclinic.models import fedner
from fedclinic.models.token_classification import package_ner_from_config, package_ner_pretrained
from fedclinic.transport.package import META_FILE, ModelPackage
from fedclinic.federation.simulate import simulate

from tests.helpers.fedner_models import ARCH, PRIVATE, SHARED, TINY, package
from tests.helpers.ner_models import LABELS, assert_learns_the_entities, make_examples, tokenizer


def test_package_holds_the_documented_tensors_and_builds():
    pkg = package()
    assert sorted(pkg.tensors) == sorted(SHARED + PRIVATE)
    assert set(pkg.files) == {META_FILE, "tokenizer.json"}  # no HF config.json for this architecture
    arch = pkg.meta["arch_config"]
    assert arch == {**fedner.FEDNER_DEFAULTS, **TINY, "vocab_size": 23, "pad_token_id": 0,
                    "char_vocab": fedner.CHAR_VOCAB}
    assert pkg.tensors["word_embedding.weight"].shape == (23, 16)
    assert pkg.tensors["char_embedding.weight"].shape == (fedner.CHAR_VOCAB_SIZE, 8)
    assert pkg.tensors["word_cnn.weight"].shape == (16, 16 + 16, 3)
    assert pkg.tensors["classifier.weight"].shape == (5, 32)
    assert not pkg.tensors["word_embedding.weight"][0].any()  # the padding row
    model = build_model(pkg)
    assert model.has_crf and model.architecture == ARCH
    import torch

    ids = torch.tensor([[2, 4, 8, 3], [2, 5, 3, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        em = model.logits(ids, mask)
    assert em.shape == (2, 4, 5)
    assert model.decode(ids, mask).shape == (2, 4)
    # the shared/private split of the paper, as patterns over the names
    from fedclinic.spec.selection import select_names

    assert select_names(list(pkg.tensors), private=fedner.PAPER_PRIVATE_PATTERNS) == [
        n for n in pkg.tensors if n in SHARED]
    assert select_names(list(pkg.tensors), fedner.PAPER_SHARED_PATTERNS) == [n for n in pkg.tensors if n in SHARED]


def test_defaults_are_the_papers_sizes():
    pkg = package(config={})
    t = pkg.tensors
    assert t["word_embedding.weight"].shape == (23, 300)          # D_w = 300
    assert t["char_embedding.weight"].shape == (256, 100)         # D_c = 100
    assert t["char_cnn.weight"].shape == (200, 100, 3)            # 200 filters, kernel 3
    assert t["word_cnn.weight"].shape == (200, 300 + 200, 3)      # 200 filters, kernel 3
    assert t["lstm.weight_hh_l0"].shape == (4 * 200, 200)         # 2 x 200 hidden states
    assert t["classifier.weight"].shape == (5, 400)
    assert pkg.meta["arch_config"]["dropout"] == 0.2


def test_same_seed_same_package_and_a_rebuild_round_trips():
    a, b, c = package(seed=3), package(seed=3), package(seed=4)
    assert a.manifest().model_hash == b.manifest().model_hash
    assert a.manifest().model_hash != c.manifest().model_hash
    from fedclinic.models import module_tensors

    rebuilt = module_tensors(build_model(a).module)
    assert sorted(rebuilt) == sorted(a.tensors)
    assert all(np.array_equal(rebuilt[k], a.tensors[k]) for k in a.tensors)


@pytest.mark.parametrize("config, match", [
    ({"hidden_size": 8}, r"unknown cnn-bilstm-crf config key\(s\) \['hidden_size'\]; allowed: \['char_dim'"),
    ({"lstm_hidden": 0}, "lstm_hidden must be a positive integer, got 0"),
    ({"embedding_dim": 8.0}, "embedding_dim must be a positive integer, got 8.0"),
    ({"char_filters": True}, "char_filters must be a positive integer, got True"),
    ({"word_kernel": 2}, "word_kernel must be odd"),
    ({"char_kernel": 4}, "char_kernel must be odd"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ({"dropout": "0.1"}, r"dropout must be in \[0, 1\)"),
    ({"char_vocab": "unicode/2"}, "char_vocab 'unicode/2' is not this fedclinic's character mapping"),
])
def test_bad_config_is_refused_with_the_allowed_values(config, match):
    with pytest.raises(ConfigError, match=match):
        package(config={**TINY, **config})


def test_derived_keys_come_from_the_tokenizer():
    pkg = package(config={**TINY, "vocab_size": 999, "pad_token_id": 7})  # a stored arch_config passed back in
    assert pkg.meta["arch_config"]["vocab_size"] == 23 and pkg.meta["arch_config"]["pad_token_id"] == 0


def test_build_refuses_a_package_that_does_not_describe_its_model():
    pkg = package()

    def with_arch(**changes):
        meta = json.loads(pkg.files[META_FILE])
        meta["arch_config"].update(changes)
        for key in [k for k, v in changes.items() if v is None]:
            del meta["arch_config"][key]
        return ModelPackage(pkg.tensors, {**pkg.files, META_FILE: json.dumps(meta).encode()})

    with pytest.raises(IntegrityError, match=r"arch_config lacks \['lstm_hidden'\]"):
        build_model(with_arch(lstm_hidden=None))
    with pytest.raises(IntegrityError, match="declares vocab_size 30 but tokenizer.json has 23 tokens"):
        build_model(with_arch(vocab_size=30))
    with pytest.raises(IntegrityError, match="arch_config: cnn-bilstm-crf word_kernel must be odd"):
        build_model(with_arch(word_kernel=2))
    with pytest.raises(IntegrityError, match="shape mismatch|do not match"):
        build_model(with_arch(lstm_hidden=8))
    with pytest.raises(IntegrityError, match=r"missing tensor\(s\) 'crf.transitions'"):
        build_model(ModelPackage({k: v for k, v in pkg.tensors.items() if k != "crf.transitions"}, pkg.files))


# --------------------------------------------------------------------------------------------------------------
# characters


def test_char_table_is_derived_from_the_tokenizer_and_never_travels():
    tok = tokenizer()
    one, two = build_model(package(seed=1)).module, build_model(package(seed=2)).module
    assert np.array_equal(one.char_table.numpy(), two.char_table.numpy())
    assert np.array_equal(one.char_table.numpy(), fedner.char_table(tok, 20))
    assert "char_table" not in one.state_dict() and "char_table" not in package().tensors
    assert "char_table" in dict(one.named_buffers())
    table = one.char_table.numpy()
    assert table.shape == (23, 20) and table.dtype == np.int64
    assert not table[:4].any()  # [PAD] [UNK] [CLS] [SEP]: special tokens have no characters
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(tok.decode()).get_vocab()
    row = table[vocab["aspirin"]]
    assert list(row[:7]) == [fedner.char_id(c) for c in "aspirin"] and not row[7:].any()


def test_char_ids_are_a_fixed_mapping():
    assert fedner.char_id(" ") == 1 and fedner.char_id("a") == 1 + ord("a") - 0x20 and fedner.char_id("~") == 95
    assert fedner.char_id("A") != fedner.char_id("a")
    latin1 = {fedner.char_id(chr(cp)) for cp in range(0xA0, 0x100)}
    assert len(latin1) == 0x60 and min(latin1) >= 96  # each Latin-1 letter has a bucket of its own
    assert all(96 <= fedner.char_id(c) < fedner.CHAR_VOCAB_SIZE for c in "µ°→中\x00\x7f")
    # long tokens keep their head and tail (suffixes carry the type: -itis, -olol)
    ids = fedner.char_ids("gastroenteritis", 8)
    assert ids == [fedner.char_id(c) for c in "gast" + "itis"]
    assert fedner.char_ids("abc", 1) == [fedner.char_id("a")]


def _wordpiece() -> bytes:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "head": 4, "##ache": 5, "##": 6, "é": 7}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    return tok.to_str().encode()


def test_surface_forms_strip_subword_markers():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    assert fedner.token_surface_forms(_wordpiece()) == ["", "", "", "", "head", "ache", "##", "é"]

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "Ġ": 3, "h": 4, "e": 5, "Ġh": 6, "Ġhe": 7,
             "Ã": 8, "©": 9, "Ã©": 10}
    bpe = Tokenizer(models.BPE(vocab, merges=[("Ġ", "h"), ("Ġh", "e"), ("Ã", "©")]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(["<s>", "<pad>", "</s>"])
    forms = fedner.token_surface_forms(bpe.to_str())
    assert forms == ["", "", "", "", "h", "e", "h", "he", "\ufffd", "\ufffd", "é"]  # lone UTF-8 bytes: U+FFFD

    uni = Tokenizer(models.Unigram([("<unk>", 0.0), ("\u2581head", -1.0), ("ache", -2.0), ("\u2581", -3.0)], 0))
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    uni.decoder = decoders.Metaspace()
    uni.add_special_tokens(["<unk>"])
    assert fedner.token_surface_forms(uni.to_str()) == ["", "head", "ache", ""]


def test_a_wordpiece_model_reads_the_characters_without_markers():
    pkg = package_ner_from_config(labels=LABELS, tokenizer_json=_wordpiece(), config=TINY, architecture=ARCH)
    table = build_model(pkg).module.char_table.numpy()
    assert list(table[5][:4]) == [fedner.char_id(c) for c in "ache"] and not table[5][4:].any()


# --------------------------------------------------------------------------------------------------------------
# forward passes


def test_packed_and_unpacked_forwards_agree_with_padding():
    """The unpacked forward (what ONNX export traces) equals the packed one at every position, padding included."""
    import torch

    module = build_model(package(seed=5, config={**TINY, "dropout": 0.5})).module.eval()
    with torch.no_grad():  # a trained-looking model: larger weights make differences visible
        for p in module.parameters():
            p.mul_(3.0)
    gen = torch.Generator().manual_seed(0)
    for lengths, width in (([9, 3, 1, 6], 9), ([2, 2], 5), ([7], 7), ([4, 1, 8, 8, 3], 12)):
        ids = torch.randint(1, 23, (len(lengths), width), generator=gen)
        mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
        ids = ids * mask  # pad id 0 at padding
        with torch.no_grad():
            packed = module(ids, mask)
            unpacked = module.forward_unpacked(ids, mask)
        assert packed.shape == (len(lengths), width, 5)
        np.testing.assert_allclose(unpacked.numpy(), packed.numpy(), atol=1e-5, rtol=0)
        # a sentence's emissions do not depend on its batch's padding
        with torch.no_grad():
            alone = module(ids[:1, :lengths[0]], mask[:1, :lengths[0]])
        np.testing.assert_allclose(packed[0, :lengths[0]].numpy(), alone[0].numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme", ["BIO", "BIOES"])
def test_training_learns_the_entities(scheme):
    model = build_model(package(scheme=scheme))
    assert_learns_the_entities(model, learning_rate=1e-2)


def test_pretrained_folder_gives_only_its_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer())
    (tmp_path / "tokenizer_config.json").write_text("{}")
    pkg = package_ner_pretrained(tmp_path, labels=LABELS, architecture=ARCH, config=TINY, max_length=32, seed=2)
    assert set(pkg.files) == {META_FILE, "tokenizer.json", "tokenizer_config.json"}
    assert pkg.meta["base_model"] == tmp_path.name
    assert pkg.manifest().model_hash != package(seed=0).manifest().model_hash
    assert all(np.array_equal(pkg.tensors[k], package(seed=2).tensors[k]) for k in pkg.tensors)
    build_model(pkg)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="has no tokenizer.json; the cnn-bilstm-crf architecture"):
        package_ner_pretrained(tmp_path, labels=LABELS, architecture=ARCH)


def test_simulator_trains_fedner_with_private_lstm_and_crf():
    """Two sites, two rounds, the paper's split: embeddings and CNNs aggregated, BiLSTM + emissions + CRF kept."""
    sites = [make_examples(32, seed=20 + i) for i in range(2)]
    result = simulate(package(seed=1), sites, rounds=2, private_patterns=fedner.PAPER_PRIVATE_PATTERNS,
                      train=training.TrainConfig(local_epochs=8, batch_size=8, learning_rate=1e-2),
                      site_eval_data=[make_examples(16, seed=90 + i) for i in range(2)])
    # in manifest order (sorted by name), the order of an agent's send list (issue 15: one site round)
    assert result.trainable == sorted(n for n in package().tensors if n in SHARED)
    assert sorted(result.private) == [0, 1] and all(sorted(p) == sorted(PRIVATE) for p in result.private.values())
    assert np.isfinite([r.train_loss for r in result.rounds]).all()
    f1 = [r.metrics["sites/strict_f1"] for r in result.rounds]
    assert result.initial_metrics["sites/strict_f1"] < 0.5
    assert f1[-1] > 0.9, f1
