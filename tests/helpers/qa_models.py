"""The toy question-answering set (which drug treats which condition): a word-level tokenizer, tiny GPT-2 and
Llama configs, packages, examples, and a short training run."""

from __future__ import annotations

from fedclinic.data.qa import QAExample
from fedclinic.models.causal_lm import package_qa_from_config
from fedclinic.training import trainer as training
from fedclinic.transport.package import ModelPackage

TREATS = {"headache": "aspirin", "diabetes": "metformin", "depression": "sertraline", "infection": "amoxicillin",
          "reflux": "omeprazole", "hypertension": "lisinopril"}
WORDS = ["question", "answer", "context", ":", "what", "treats", "drug", "is", "the", "for", "a", "patient", "with",
         "needs", *TREATS, *TREATS.values()]
SPECIALS = ["<pad>", "<unk>", "<eos>"]
TINY = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def tokenizer_json(extra_specials: tuple[str, ...] = ()) -> bytes:
    """Word-level, lower-cased, split on whitespace and punctuation; ids 0 <pad>, 1 <unk>, 2 <eos>."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    specials = SPECIALS + list(extra_specials)
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(specials + WORDS)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(specials)
    return tok.to_str().encode()


def package(config=TINY, seed: int = 0, **kw) -> ModelPackage:
    """A seeded tiny QA package (GPT-2 unless ``config`` says otherwise; max_length 32, 6 new tokens by default)."""
    kw.setdefault("max_length", 32)
    kw.setdefault("max_new_tokens", 6)
    return package_qa_from_config(tokenizer_json=tokenizer_json(), config=config, seed=seed, **kw)


def toy_examples() -> list[QAExample]:
    """One question per condition of :data:`TREATS`, answered ``drug <name>``."""
    return [QAExample(f"what treats {cond}", f"drug {drug}") for cond, drug in TREATS.items()]


def train(model, examples, *, epochs: int = 200, lr: float = 5e-3, seed: int = 0):
    """Train every parameter of ``model`` on ``examples`` (long enough for the tiny model to learn them)."""
    data = training.encode(examples, model)
    cfg = training.TrainConfig(local_epochs=epochs, batch_size=8, learning_rate=lr, seed=seed)
    return training.train_local(model, data, cfg, trainable=[n for n, _ in model.module.named_parameters()])
