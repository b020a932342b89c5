"""A Hugging Face config.json as a family file reads it: every field read is recorded.

  HFConfig   the fields of a config.json (or of one nested section, Gemma 3's `text_config`);
             `get`, `require`, `accept`, `refuse`, `section`, and RoPE from either schema
             (`rope`, `rope_fraction`). After a family's `to_config` has read what it computes,
             `check_all_read` refuses every field nobody read that is not in METADATA: a field
             the model does not compute is one ValueError naming it and its value, never a model
             that computes something else.
  METADATA   the fields that do not change what the model computes, each with the reason.

Errors read "<model_type> config: <field>=<value> <why> (<file>)", the value spelled as in the
JSON file; a nested field is named by its path ("rope_parameters.rope_type").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NoReturn

from qkv_jax.positions import RopeScaling

__all__ = ["METADATA", "ROPE_TYPES", "HFConfig"]

# Fields of a config.json that do not change the logits a model computes from its weights.
METADATA: dict[str, str] = {
    "architectures": "the transformers class that wrote the file; qkv_jax builds TransformerLM either way",
    "transformers_version": "the version of transformers that wrote the file",
    "_name_or_path": "where the model was loaded from when it was saved",
    "dtype": "the dtype the weights were saved in (transformers 5); the tensors' own dtypes are read",
    "torch_dtype": "the same, transformers 4's name",
    "bos_token_id": "a token id for tokenizers and generation, not used by the forward pass",
    "eos_token_id": "a token id for tokenizers and generation, not used by the forward pass",
    "pad_token_id": "a token id; transformers' embedding padding_idx only changes gradients",
    "sep_token_id": "a token id for tokenizers, not used by the forward pass",
    "decoder_start_token_id": "a token id for encoder-decoder generation",
    "use_cache": "whether transformers keeps a KV cache; the logits are the same",
    "initializer_range": "the standard deviation of a fresh initialization; loaded weights replace it",
    "output_attentions": "what transformers returns besides the logits",
    "output_hidden_states": "what transformers returns besides the logits",
    "return_dict": "the form of transformers' outputs",
    "torchscript": "a transformers export setting",
    "use_return_dict": "the form of transformers' outputs",
    "chunk_size_feed_forward": "transformers evaluates the MLP in chunks; the result is the same",
    "tokenizer_class": "the tokenizer, not the model",
    "prefix": "a prompt prefix for pipelines",
    "task_specific_params": "pipeline settings",
    "id2label": "labels of classification heads, which a causal LM does not have",
    "label2id": "labels of classification heads, which a causal LM does not have",
    "problem_type": "the loss of classification heads",
    "finetuning_task": "a note on what the model was fine-tuned for",
    "keys_to_ignore_at_inference": "output keys transformers drops",
    "attn_implementation": "transformers' attention kernel (eager, sdpa, flash); the same math",
    "_attn_implementation": "the same, as transformers stores it",
    "_attn_implementation_autoset": "the same, as transformers stores it",
    # Generation defaults that transformers 4 kept in config.json (generation_config.json now).
    **{
        name: "a generation default, not part of the model"
        for name in (
            "max_length",
            "min_length",
            "do_sample",
            "early_stopping",
            "num_beams",
            "num_beam_groups",
            "diversity_penalty",
            "temperature",
            "top_k",
            "top_p",
            "typical_p",
            "repetition_penalty",
            "length_penalty",
            "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size",
            "bad_words_ids",
            "num_return_sequences",
            "output_scores",
            "return_dict_in_generate",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "remove_invalid_values",
            "exponential_decay_length_penalty",
            "suppress_tokens",
            "begin_suppress_tokens",
        )
    },
}

# RoPE variants read by `HFConfig.rope` ("default": no scaling); the others are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The keys each RoPE variant reads besides rope_type (or transformers 4's `type`) and rope_theta.
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
        "mscale",
        "mscale_all_dim",
    ),
}


def _spell(value: Any) -> str:
    """`value` as config.json spells it (true, null, "text"), cut at 120 characters."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _same(value: Any, expected: Any) -> bool:
    """JSON equality: 0 equals 0.0, but a bool equals only a bool."""
    return isinstance(value, bool) == isinstance(expected, bool) and value == expected


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class HFConfig:
    """The fields of a Hugging Face config.json, each read recorded.

    `HFConfig(fields, source="config.json")`; `model_type` is the file's (read by the
    loader to pick the family). A family's `to_config` reads through:

      get(name, default=None)   the value (a stored null is None, not `default`)
      require(name)             the value; ValueError when the field is absent
      accept(name, *values)     a field the model computes only at `values`: the value, or
                                values[0] when absent (list the Hugging Face default first);
                                any other value is a ValueError naming it
      refuse(name, value, why)  raises the ValueError for a value the model does not compute
      section(name)             the HFConfig of a nested object (its fields named "name.field")
      rope(kinds, default_base) {layer kind: (base, RopeScaling | None)} from either schema
      rope_fraction(*legacy)    the fraction of each head's dims that rotate

    `check_all_read()` (the loader calls it after `to_config`) raises one ValueError naming
    every field not read and not in `METADATA`, with its value.
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        *,
        source: str = "config.json",
        prefix: str = "",
        model_type: str | None = None,
    ):
        self._fields = dict(fields)
        self._source = source
        self._prefix = prefix
        self._read: set[str] = set()
        self._sections: dict[str, HFConfig] = {}
        self._pending: dict[str, Any] = {}  # nested keys to be read: "rope_parameters.partial_rotary_factor"
        self._resolved: set[str] = set()
        if model_type is None:
            self._read.add("model_type")
            model_type = str(self._fields.get("model_type"))
        self.model_type = model_type

    @property
    def read(self) -> frozenset[str]:
        """The fields read so far (nested ones by their path)."""
        nested = {f"{name}.{key}" for name, section in self._sections.items() for key in section.read}
        return frozenset(self._read | nested | self._resolved)

    def __contains__(self, name: str) -> bool:
        """Whether the file has field `name` (not recorded as a read)."""
        return name in self._fields

    def _error(self, name: str, why: str) -> ValueError:
        return ValueError(f"{self.model_type} config: {self._prefix}{name} {why} ({self._source})")

    def refuse(self, name: str, value: Any, why: str) -> NoReturn:
        """Raises ValueError "<model_type> config: <name>=<value> <why> (<file>)"."""
        self._read.add(name.split(".")[0])
        raise self._error(f"{name}={_spell(value)}", why)

    def get(self, name: str, default: Any = None) -> Any:
        """Field `name`, or `default` when the file lacks it."""
        self._read.add(name)
        return self._fields.get(name, default)

    def require(self, name: str) -> Any:
        """Field `name`; ValueError naming it when the file lacks it."""
        self._read.add(name)
        if name not in self._fields:
            raise self._error(name, "is missing")
        return self._fields[name]

    def accept(self, name: str, *values: Any) -> Any:
        """Field `name` when it equals one of `values` (or `values[0]` when absent); any other
        value is a ValueError naming the field, its value and the values qkv_jax computes."""
        if not values:
            raise TypeError("HFConfig.accept needs at least one value")
        self._read.add(name)
        if name not in self._fields:
            return values[0]
        value = self._fields[name]
        if any(_same(value, expected) for expected in values):
            return value
        computed = " or ".join(_spell(v) for v in values)
        self.refuse(name, value, f"is not computed by qkv_jax (it computes {computed})")

    def section(self, name: str) -> HFConfig:
        """The nested object `name` (Gemma 3's `text_config`) as an HFConfig of its own, whose
        unread fields `check_all_read` reports as "<name>.<field>"."""
        value = self.require(name)
        if not isinstance(value, dict):
            self.refuse(name, value, "must be a JSON object")
        if name not in self._sections:
            self._sections[name] = HFConfig(
                value, source=self._source, prefix=f"{self._prefix}{name}.", model_type=self.model_type
            )
        return self._sections[name]

    def unread(self) -> dict[str, Any]:
        """Every field neither read nor in METADATA, by its path, with its value."""
        found = {
            f"{self._prefix}{name}": value
            for name, value in self._fields.items()
            if name not in self._read and name not in METADATA
        }
        for section in self._sections.values():
            found.update(section.unread())
        found.update(
            {f"{self._prefix}{key}": v for key, v in self._pending.items() if key not in self._resolved}
        )
        return found

    def check_all_read(self) -> None:
        """ValueError naming every field that no reader read and METADATA does not list."""
        unread = self.unread()
        if unread:
            fields = ", ".join(f"{name}={_spell(value)}" for name, value in sorted(unread.items()))
            verb = "is" if len(unread) == 1 else "are"
            raise ValueError(
                f"{self.model_type} config: {fields} {verb} not read by the {self.model_type} mapping, "
                f"so qkv_jax does not compute {'it' if len(unread) == 1 else 'them'} ({self._source})"
            )

    # ------------------------------------------------------------------------------------ RoPE

    def rope(
        self, kinds: tuple[str, ...] = ("full_attention",), default_base: float = 10000.0
    ) -> dict[str, tuple[float, RopeScaling | None]]:
        """{layer kind: (RoPE base, RopeScaling | None)} for each of `kinds`.

        transformers 5's `rope_parameters` is one dict for every layer, or one per layer type
        (Gemma 3: "full_attention", "sliding_attention"); transformers 4's is `rope_theta`
        (absent: `default_base`, the family's) with `rope_scaling` (`type` or `rope_type`),
        and Gemma 3's `rope_local_base_freq` is the unscaled base of "sliding_attention" layers.
        Scalings other than ROPE_TYPES (dynamic, longrope, ...) and keys a variant does not
        read are ValueErrors naming the field.
        """
        if self.get("rope_parameters") is not None:  # a stored null: transformers 4's fields
            parameters = self.get("rope_parameters")
            if not isinstance(parameters, dict):
                self.refuse("rope_parameters", parameters, "must be a JSON object")
            nested = bool(parameters) and all(isinstance(v, dict) for v in parameters.values())
            if not nested:
                entry = self._rope_entry("rope_parameters", parameters, default_base)
                return {kind: entry for kind in kinds}
            for kind in kinds:
                if kind not in parameters:
                    raise self._error(f"rope_parameters.{kind}", "is missing")
            for kind in sorted(set(parameters) - set(kinds)):
                self.refuse(f"rope_parameters.{kind}", parameters[kind], "is a layer type this model has not")
            return {
                kind: self._rope_entry(f"rope_parameters.{kind}", parameters[kind], default_base)
                for kind in kinds
            }
        scaling = self.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            self.refuse("rope_scaling", scaling, "must be a JSON object or null")
        entry = self._rope_entry("rope_scaling", scaling, self.get("rope_theta", default_base))
        result = {kind: entry for kind in kinds}
        if "sliding_attention" in kinds and "rope_local_base_freq" in self._fields:
            result["sliding_attention"] = (
                self._number("rope_local_base_freq", self.get("rope_local_base_freq")),
                None,
            )
        return result

    def _number(self, name: str, value: Any, *, positive: bool = True) -> float:
        if not _is_number(value) or (positive and value <= 0):
            self.refuse(name, value, "must be a finite number" + (" > 0" if positive else ""))
        return float(value)

    def _rope_entry(self, where: str, given: dict[str, Any], base: Any) -> tuple[float, RopeScaling | None]:
        """(base, scaling) of one RoPE dict `given` (at field path `where`)."""
        parameters = dict(given)
        kind = parameters.pop("rope_type", None)
        legacy = parameters.pop("type", None)
        if kind is not None and legacy is not None and kind != legacy:
            self.refuse(f"{where}.type", legacy, f"contradicts {where}.rope_type={_spell(kind)}")
        kind = kind or legacy or "default"
        if "partial_rotary_factor" in parameters:  # read by rope_fraction
            self._pending[f"{where}.partial_rotary_factor"] = parameters.pop("partial_rotary_factor")
        if where.startswith("rope_parameters") and "rope_theta" in self._fields:  # beside the dict
            top = self.get("rope_theta")
            if "rope_theta" in parameters and not _same(top, parameters["rope_theta"]):
                self.refuse(
                    "rope_theta", top, f"contradicts {where}.rope_theta={_spell(parameters['rope_theta'])}"
                )
            base = top
        base = self._number(f"{where}.rope_theta", parameters.pop("rope_theta", base))
        if kind not in ROPE_TYPES:
            self.refuse(
                f"{where}.rope_type",
                kind,
                f"is a RoPE qkv_jax does not compute (it computes {', '.join(ROPE_TYPES)})",
            )
        for key in sorted(set(parameters) - set(_ROPE_KEYS[kind])):
            self.refuse(f"{where}.{key}", parameters[key], f"is not read with rope_type={_spell(kind)}")
        if kind == "default":
            return base, None
        return base, self._scaling(where, kind, parameters)

    def _scaling(self, where: str, kind: str, parameters: dict[str, Any]) -> RopeScaling:
        """The RopeScaling of a "linear", "llama3" or "yarn" dict, as transformers reads it."""

        def number(key: str) -> float:
            if key not in parameters:
                raise self._error(f"{where}.{key}", f"is missing (rope_type={_spell(kind)} needs it)")
            return self._number(f"{where}.{key}", parameters[key])

        if kind == "linear":
            return RopeScaling("linear", number("factor"))
        original = self._original_length(where, parameters)
        if kind == "llama3":
            return RopeScaling(
                "llama3",
                number("factor"),
                original_max_len=original,
                low_freq_factor=number("low_freq_factor"),
                high_freq_factor=number("high_freq_factor"),
            )
        factor = parameters.get("factor")
        if factor is None:  # transformers: the context extension max_position_embeddings / original
            factor = (
                self._number("max_position_embeddings", self._fields.get("max_position_embeddings"))
                / original
            )
        factor = self._number(f"{where}.factor", factor)
        truncate = parameters.get("truncate", True)
        if not isinstance(truncate, bool):
            self.refuse(f"{where}.truncate", truncate, "must be true or false")
        return RopeScaling(
            "yarn",
            factor,
            original_max_len=original,
            beta_fast=self._number(f"{where}.beta_fast", parameters.get("beta_fast") or 32.0),
            beta_slow=self._number(f"{where}.beta_slow", parameters.get("beta_slow") or 1.0),
            attention_factor=self._yarn_attention_factor(where, factor, parameters),
            truncate=truncate,
        )

    def _original_length(self, where: str, parameters: dict[str, Any]) -> int:
        """llama3's and yarn's pretraining length: a top-level original_max_position_embeddings
        (Phi-3's place, first as in transformers), the dict's, else max_position_embeddings."""
        if "original_max_position_embeddings" in self._fields:
            name, value = "original_max_position_embeddings", self.get("original_max_position_embeddings")
        elif "original_max_position_embeddings" in parameters:
            name = f"{where}.original_max_position_embeddings"
            value = parameters["original_max_position_embeddings"]
        elif "max_position_embeddings" in self._fields:
            name, value = "max_position_embeddings", self._fields["max_position_embeddings"]
        else:
            raise self._error(
                f"{where}.original_max_position_embeddings", "is missing (so is max_position_embeddings)"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self.refuse(name, value, "must be a positive integer (RoPE scaling's pretraining length)")
        return value

    def _yarn_attention_factor(self, where: str, factor: float, parameters: dict[str, Any]) -> float | None:
        """yarn's factor of cos and sin: the dict's attention_factor; else, with mscale and
        mscale_all_dim both set, transformers' ratio of their mscales; else None (RopeScaling's
        0.1 ln(factor) + 1)."""
        if parameters.get("attention_factor") is not None:
            return self._number(f"{where}.attention_factor", parameters["attention_factor"])
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        if not (mscale and mscale_all_dim):
            return None

        def scaled(value: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * value * math.log(factor) + 1.0

        ratio = scaled(self._number(f"{where}.mscale", mscale)) / scaled(
            self._number(f"{where}.mscale_all_dim", mscale_all_dim)
        )
        return float(ratio)

    def rope_fraction(self, *legacy_names: str) -> float:
        """The fraction of each head's dims that rotate: `partial_rotary_factor` in
        `rope_parameters` (each layer type's, which must agree), at the top level, or under one
        of `legacy_names` (GPT-NeoX's transformers 4 `rotary_pct`); 1.0 when none is given."""
        found: dict[str, Any] = {}
        parameters = self._fields.get("rope_parameters")
        if isinstance(parameters, dict):
            nested = bool(parameters) and all(isinstance(v, dict) for v in parameters.values())
            entries = (
                {f"rope_parameters.{kind}": v for kind, v in parameters.items()}
                if nested
                else {"rope_parameters": parameters}
            )
            for path, entry in entries.items():
                if "partial_rotary_factor" in entry:
                    found[f"{path}.partial_rotary_factor"] = entry["partial_rotary_factor"]
                    self._resolved.add(f"{path}.partial_rotary_factor")
        for name in ("partial_rotary_factor", *legacy_names):
            if name in self._fields:
                found[name] = self.get(name)
        if not found:
            return 1.0
        values = {name: self._number(name, value) for name, value in found.items()}
        first, *rest = values.items()
        for name, value in rest:
            if value != first[1]:
                self.refuse(name, found[name], f"contradicts {first[0]}={_spell(found[first[0]])}")
        if not 0 < first[1] <= 1:
            self.refuse(first[0], found[first[0]], "must be in (0, 1]")
        return first[1]
