"""Hugging Face checkpoints in and out of qkv_jax's TransformerLM.

  load_pretrained(directory, *, dtype=None, mesh=None)      -> (TransformerConfig, linen params)
  load_pretrained_nnx(directory, *, dtype=None, mesh=None)  -> qkv_jax.nnx.TransformerLM
  save_pretrained(directory, config, params, ...) a directory transformers loads
  load_tokenizer(directory, *, vocab_size=None)  the checkpoint's tokenizer.json: encode, decode
  PretrainedError                                 a bad file: one line naming the file and tensor
  HFConfig, METADATA                              config.json as the family files read it

A directory holds config.json and model.safetensors, or shards listed by
model.safetensors.index.json. Tensors are read one at a time; bfloat16 stays bfloat16 unless
`dtype` says otherwise. With `mesh` (axes "data" and "model") the parameters come back split
by `qkv_jax.sharding.PARTITION_RULES`, each process reading only its devices' slices. Each
model family's mapping (its config translation, tensor names and layouts) is one file in
`qkv_jax.pretrained.families`; a config.json field that no family reads, at a value other
than the one qkv_jax computes, is a ValueError naming the field and its value.
"""

from qkv_jax.pretrained.checkpoint import PretrainedError, TensorSource
from qkv_jax.pretrained.io import load_pretrained, load_pretrained_nnx
from qkv_jax.pretrained.save import save_pretrained
from qkv_jax.pretrained.schema import METADATA, HFConfig
from qkv_jax.pretrained.tokenizer import PretrainedTokenizer, load_tokenizer

__all__ = [
    "load_pretrained",
    "load_pretrained_nnx",
    "save_pretrained",
    "load_tokenizer",
    "PretrainedTokenizer",
    "PretrainedError",
    "TensorSource",
    "HFConfig",
    "METADATA",
]
