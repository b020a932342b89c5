"""Tiny Hugging Face checkpoint directories, built offline, for the workflow tests.

`checkpoint(directory, kind)` writes what a downloaded checkpoint holds: config.json and
model.safetensors saved by transformers (a random model of a few thousand parameters, every
parameter moved off its initialization so that a swapped norm or bias shows), and the
tokenizer.json of a BPE tokenizer trained here with the `tokenizers` package's trainer on
`TEXT`:
  - "llama": a Llama with grouped K/V heads and a SentencePiece-like tokenizer (Metaspace
    pre-tokenizer, an <unk> token, "<s>" prepended to every text);
  - "gpt2": a GPT-2 with a byte-level tokenizer (every text encodes; no BOS is added).
The model's vocabulary is the tokenizer's size. `TEXT` doubles as the fine-tuning text.
"""

from __future__ import annotations

import pathlib

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXT = (
    "The keys and the queries meet in the attention of every head.\n"
    "A head that attends to the previous token copies it forward.\n"
    "An induction head finds the token after the last copy of this one.\n\n"
    "The values carry what the keys found, and the output projection writes it back.\n"
    "Each layer reads the residual stream and adds to it.\n\n"
)
KINDS = ("llama", "gpt2")


def tokenizer(kind: str, text: str = TEXT) -> Tokenizer:
    """A BPE tokenizer of about 100 (llama) or 300 (gpt2, byte-level) tokens, trained on `text`."""
    if kind == "llama":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
        tok.train_from_iterator([text], trainer)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        return tok
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer)
    return tok


def _randomized(model):
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def hf_config(kind: str, vocab_size: int):
    """The transformers config of a tiny model of `kind`."""
    import transformers

    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
    return transformers.GPT2Config(
        vocab_size=vocab_size, n_embd=16, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )


def checkpoint(directory: str | pathlib.Path, kind: str, seed: int = 0) -> pathlib.Path:
    """Writes the tiny `kind` checkpoint (config.json, model.safetensors, tokenizer.json) into
    `directory`, which must not exist yet; returns its path."""
    import torch
    import transformers

    directory = pathlib.Path(directory)
    tok = tokenizer(kind)
    torch.manual_seed(seed)
    config = hf_config(kind, tok.get_vocab_size())
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _randomized(model).save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def load_transformers(directory: str | pathlib.Path):
    """transformers' float32 eager model of a directory (the reference)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def logits(model, ids) -> np.ndarray:
    """transformers' logits `[B, T, V]` of int token ids `[B, T]`, as NumPy float32."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def greedy(directory: str | pathlib.Path, ids: np.ndarray, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids` `[P]` (all `new_tokens`: no stop at EOS)."""
    import torch

    model = load_transformers(directory)
    model.generation_config.eos_token_id = None
    prompt = torch.as_tensor(ids[None], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def until_end_of_text(directory: str | pathlib.Path, tokens: list[int]) -> list[int]:
    """`tokens` up to and including the first end-of-text id of `directory`'s config.json (where
    the command line's decoding stops)."""
    import json

    eos = json.loads((pathlib.Path(directory) / "config.json").read_text()).get("eos_token_id")
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
