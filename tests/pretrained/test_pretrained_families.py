"""Every family of `qkv_jax.pretrained.families` against transformers' own model of it.

Each case builds a tiny random model with transformers (torch on CPU, eager attention,
float32), sets EVERY parameter to random values (norm gains and biases too: a fresh
init leaves them at 1 and 0, which hides a swapped or missing one), saves it with
save_pretrained and loads it into qkv_jax. At a length past the sliding windows and past
RoPE scaling's original length:
  - the linen TransformerLM's logits equal transformers' to 1e-5 of the largest logit;
  - greedy decoding with the KV cache gives the tokens of transformers' generate;
  - the NNX model's logits equal the linen model's;
  - save_pretrained writes a directory transformers loads to the same logits.
Then both config schemas (transformers 5's `rope_parameters`, transformers 4's
`rope_theta` + `rope_scaling` and older field names) and every refusal.

One family (Llama with Llama 3's RoPE scaling) runs in the fast tier; the others are slow.
"""

import copy
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import qkv_jax.nnx
from qkv_jax import lm
from qkv_jax.pretrained.families import FAMILIES
from qkv_jax.pretrained.io import load_pretrained
from qkv_jax.pretrained.save import save_pretrained
from qkv_jax.pretrained.schema import HFConfig

VOCAB, T, PROMPT, NEW = 61, 14, 5, 9  # 5 + 9 tokens: past every window (4) and original length (8)
TOLERANCE = 1e-5  # of the largest |logit|
# Each program runs once: LLVM's cheapest optimization level compiles it in a quarter of the time.
compile_once = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})

# Tiny configs, one per case: (transformers config class, its fields).
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=False)
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=50.0,
    factor=4.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8,
)
CASES = {
    "gpt2": (
        transformers.GPT2Config,
        dict(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=24,
            n_layer=2,
            n_head=3,
            n_inner=40,
            layer_norm_epsilon=1e-5,
        ),
    ),
    "gpt_neox": (
        transformers.GPTNeoXConfig,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            rope_parameters=dict(rope_type="default", rope_theta=100.0, partial_rotary_factor=0.5),
        ),
    ),
    "gpt_neox_serial": (
        transformers.GPTNeoXConfig,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            use_parallel_residual=False,
            hidden_act="gelu_new",
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="linear", factor=2.0, rope_theta=100.0, partial_rotary_factor=0.25
            ),
        ),
    ),
    "llama": (
        transformers.LlamaConfig,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=LLAMA3,
        ),
    ),
    "llama_linear": (
        transformers.LlamaConfig,
        dict(
            COMMON,
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            intermediate_size=40,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=100.0, factor=3.0),
        ),
    ),
    "llama_yarn": (
        transformers.LlamaConfig,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=40,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=200.0,
                factor=4.0,
                original_max_position_embeddings=8,
                beta_fast=8.0,
                beta_slow=1.0,
            ),
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            sliding_window=4,
            rope_parameters=dict(rope_type="default", rope_theta=100.0),
        ),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            rope_parameters=dict(rope_type="default", rope_theta=100.0),
        ),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        dict(
            COMMON,
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=40,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=100.0, factor=2.0, original_max_position_embeddings=8
            ),
        ),
    ),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            COMMON,
            hidden_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=40,
            query_pre_attn_scalar=12,
            sliding_window=4,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=100.0),
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            COMMON,
            hidden_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=40,
            query_pre_attn_scalar=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": dict(rope_type="linear", rope_theta=1000.0, factor=2.0),
                "sliding_attention": dict(rope_type="default", rope_theta=20.0),
            },
        ),
    ),
    "olmo2": (
        transformers.Olmo2Config,
        dict(
            COMMON,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            rope_parameters=dict(rope_type="default", rope_theta=100.0),
        ),
    ),
}
FAST = "llama"  # first: the fast tier runs a parametrized test's first case (tests/conftest.py)
PARAMS = [FAST, *(pytest.param(name, marks=pytest.mark.slow) for name in CASES if name != FAST)]


@dataclasses.dataclass
class Built:
    """A tiny transformers model, its saved directory and what qkv_jax loaded from it."""

    torch_model: transformers.PreTrainedModel
    directory: pathlib.Path
    config: lm.TransformerConfig
    params: dict
    tokens: np.ndarray  # (2, T)
    logits: np.ndarray  # (2, T, V), transformers' model run in float64

    @functools.cached_property
    def linen_logits(self) -> jax.Array:
        """The loaded linen TransformerLM's logits of `tokens` (2, T, V), computed once."""
        apply = compile_once(lm.TransformerLM(self.config).apply)
        return apply({"params": self.params}, jnp.asarray(self.tokens))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: 1-D gains around 1, everything else around 0, all different."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            gain = parameter.ndim == 1 and name.endswith("weight")
            parameter.copy_(1.0 + 0.3 * noise if gain else 0.4 * noise)


def torch_logits(model: transformers.PreTrainedModel, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


def build(name: str, root: pathlib.Path) -> Built:
    config_class, fields = CASES[name]
    hf_config = config_class(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = (
        transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").float().eval()
    )
    randomize(model, seed=len(name))
    directory = root / name
    model.save_pretrained(directory)
    config, params = load_pretrained(directory)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, T))
    # The reference logits come from a float64 copy of transformers' model: transformers' own
    # float32 logits are a float32 rounding of them too, and on Gemma 2 (soft caps) theirs
    # differ from float64 by 1.0e-5 of the largest logit while ours differ by 5.3e-6.
    reference = copy.deepcopy(model).double()
    return Built(model, directory, config, params, tokens, torch_logits(reference, tokens))


@pytest.fixture(scope="module", params=PARAMS)
def built(request, tmp_path_factory) -> Built:
    return build(request.param, tmp_path_factory.mktemp("families"))


def relative_error(ours, theirs) -> float:
    """Largest |difference| over the largest |logit|."""
    return float(np.max(np.abs(np.asarray(ours) - theirs)) / np.max(np.abs(theirs)))


def test_logits_equal_transformers(built):
    ours = built.linen_logits
    error = relative_error(ours, built.logits)
    print(f"{built.directory.name}: logits max|diff|/max|logit| = {error:.2e}")
    assert error <= TOLERANCE


def test_greedy_decoding_equals_transformers_generate(built):
    prompt = built.tokens[:, :PROMPT]
    with torch.no_grad():
        theirs = built.torch_model.generate(
            torch.as_tensor(prompt), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
        )[:, PROMPT:]
    model = lm.TransformerLM(built.config)
    ours = lm.generate(model, built.params, prompt, NEW, rng=jax.random.PRNGKey(0), temperature=0.0)
    np.testing.assert_array_equal(np.asarray(ours), theirs.numpy())


def test_nnx_equals_linen(built):
    linen = built.linen_logits
    graph, state = nnx.split(qkv_jax.nnx.load_pretrained(built.directory))
    logits = compile_once(lambda state, tokens: nnx.merge(graph, state)(tokens))(
        state, jnp.asarray(built.tokens)
    )
    np.testing.assert_allclose(logits, linen, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(linen))))


def test_save_pretrained_round_trip_loads_in_transformers(built, tmp_path):
    saved = save_pretrained(tmp_path / "saved", built.config, built.params)
    written = json.loads((saved / "config.json").read_text())
    assert written["model_type"] == json.loads((built.directory / "config.json").read_text())["model_type"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager").eval()
    original = torch_logits(built.torch_model, built.tokens)  # float32, as reloaded runs
    np.testing.assert_allclose(
        torch_logits(reloaded, built.tokens), original, rtol=0, atol=1e-6 * np.abs(original).max()
    )


# ------------------------------------------------------------------------------ config schemas


def transformers4_config(fields: dict) -> dict:
    """A transformers 5 config.json rewritten as transformers 4 wrote it: `rope_theta` and
    `rope_scaling` (with the old `type` key) instead of `rope_parameters`, GPT-NeoX's
    `rotary_emb_base` / `rotary_pct`, Gemma 3's `rope_local_base_freq` and
    `sliding_window_pattern`, no `layer_types` where the old defaults give the same layers,
    and `torch_dtype`."""
    fields = dict(fields)
    fields["torch_dtype"] = fields.pop("dtype", "float32")
    rope = fields.pop("rope_parameters", None)
    if rope is None:
        return fields
    if fields["model_type"] == "gemma3_text":
        fields["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        fields["sliding_window_pattern"] = 2  # sliding, full, sliding
        del fields["layer_types"], fields["_sliding_window_pattern"]
        rope = rope["full_attention"]
    if fields["model_type"] in ("gemma2", "qwen2", "qwen3"):
        del fields["layer_types"]  # every other layer from the first; Qwen's from max_window_layers
    rope = dict(rope)
    theta, kind, fraction = (
        rope.pop("rope_theta"),
        rope.pop("rope_type"),
        rope.pop("partial_rotary_factor", None),
    )
    neox = fields["model_type"] == "gpt_neox"
    fields["rotary_emb_base" if neox else "rope_theta"] = theta
    if fraction is not None:
        fields["rotary_pct" if neox else "partial_rotary_factor"] = fraction
    if kind != "default":  # Gemma 3's files say rope_type (transformers 5 ignores its `type`)
        fields["rope_scaling"] = {
            "rope_type" if fields["model_type"] == "gemma3_text" else "type": kind,
            **rope,
        }
    return fields


def test_transformers4_config_reads_the_same(built, tmp_path):
    """The same checkpoint with a transformers 4 config.json: the same TransformerConfig in
    qkv_jax, and (transformers reading the file too) the same logits in transformers."""
    old = tmp_path / "transformers4"
    old.mkdir()
    for file in built.directory.iterdir():
        (old / file.name).write_bytes(file.read_bytes())
    fields = transformers4_config(json.loads((built.directory / "config.json").read_text()))
    assert "rope_parameters" not in fields
    (old / "config.json").write_text(json.dumps(fields))
    config, params = load_pretrained(old)
    assert config == built.config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(old, attn_implementation="eager").eval()
    original = torch_logits(built.torch_model, built.tokens)  # float32, as reloaded runs
    np.testing.assert_allclose(
        torch_logits(reloaded, built.tokens), original, rtol=0, atol=1e-6 * np.abs(original).max()
    )


# ---------------------------------------------------------------------------------- refusals


def config_json(case: str) -> dict:
    """The config.json transformers writes for `case` (no model built)."""
    config_class, fields = CASES[case]
    return json.loads(
        config_class(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None).to_json_string()
    )


def read(fields: dict) -> lm.TransformerConfig:
    """The TransformerConfig of a config.json's fields, as the loader reads them."""
    hf = HFConfig(fields)
    config = FAMILIES[hf.model_type].to_config(hf)
    hf.check_all_read()
    return config


def nested(case: str, **rope) -> dict:
    """`case`'s flat rope_parameters with `rope`'s keys changed."""
    return {"rope_parameters": {**config_json(case)["rope_parameters"], **rope}}


REFUSALS = [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
    ("gpt2", {"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=true"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=true"),
    ("gpt2", {"activation_function": "quick_gelu"}, 'activation_function="quick_gelu"'),
    ("gpt2", {"scale_attn_weights": None}, "scale_attn_weights=null"),
    ("gpt_neox", {"hidden_act": "quick_gelu"}, 'hidden_act="quick_gelu"'),
    ("gpt_neox", {"use_parallel_residual": None}, "use_parallel_residual=null"),
    ("gpt_neox", {"attention_bias": None}, "attention_bias=null"),
    ("gpt_neox", nested("gpt_neox", rope_type="dynamic", factor=2.0), 'rope_type="dynamic"'),
    ("llama", {"pretraining_tp": 2}, "pretraining_tp=2"),
    ("llama", {"mlp_bias": "yes"}, 'mlp_bias="yes"'),
    ("llama", {"attention_bias": None}, "attention_bias=null"),
    ("llama", nested("llama", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("llama", nested("llama", rope_type="longrope"), 'rope_type="longrope"'),
    ("mistral", {"hidden_act": "gelu_fast"}, 'hidden_act="gelu_fast"'),
    ("qwen2", {"num_experts": 4}, "num_experts=4"),
    ("qwen2", {"use_sliding_window": None}, "use_sliding_window=null"),
    ("qwen3", {"attention_bias": None}, "attention_bias=null"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ("gemma2", {"hidden_activation": "gelu_fast"}, 'hidden_activation="gelu_fast"'),
    ("gemma2", {"attention_bias": None}, "attention_bias=null"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    (
        "gemma3",
        {
            "rope_parameters": {
                **config_json("gemma3")["rope_parameters"],
                "sliding_attention": dict(rope_type="linear", rope_theta=20.0, factor=2.0),
            }
        },
        "rope_parameters=.*the local layers' RoPE is unscaled",
    ),
    ("olmo2", {"hidden_act": "quick_gelu"}, 'hidden_act="quick_gelu"'),
    ("olmo2", {"attention_bias": "true"}, 'attention_bias="true"'),
    ("olmo2", nested("olmo2", partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
]


@pytest.mark.parametrize(
    "case, change, message", REFUSALS, ids=[f"{c}-{next(iter(d))}" for c, d, _ in REFUSALS]
)
def test_fields_qkv_jax_does_not_compute_are_refused(case, change, message):
    """The unchanged config.json reads; the changed field is one ValueError naming it."""
    fields = config_json(case)
    read(fields)
    model_type = fields["model_type"]
    with pytest.raises(ValueError, match=f"^{model_type} config: .*{message}"):
        read({**fields, **change})


def test_every_family_is_registered():
    """FAMILIES maps each model_type to the file whose MODEL_TYPES names it."""
    expected = {"gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2"}
    assert set(FAMILIES) == expected
    for model_type, family in FAMILIES.items():
        assert model_type in family.MODEL_TYPES
        for function in ("to_config", "from_hf", "to_hf", "hf_config"):
            assert callable(getattr(family, function)), (model_type, function)


def test_hub_layouts_of_old_checkpoints_load(built, tmp_path):
    """Files as older tools wrote them load to the same parameters: GPT-2 without the
    `transformer.` prefix and with its causal-mask buffers, GPT-NeoX and Llama with their
    `inv_freq` / mask buffers, and a tied model's stored copy of the head."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(built.directory / "model.safetensors")
    model_type = json.loads((built.directory / "config.json").read_text())["model_type"]
    mask = np.tril(np.ones((1, 1, 32, 32), bool))
    for i in range(built.config.num_layers):
        if model_type == "gpt2":
            tensors = {name.removeprefix("transformer."): value for name, value in tensors.items()}
            tensors[f"h.{i}.attn.bias"], tensors[f"h.{i}.attn.masked_bias"] = mask, np.float32(-1e4)
        elif model_type == "gpt_neox":
            tensors[f"gpt_neox.layers.{i}.attention.bias"] = mask
            tensors[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = np.ones(2, np.float32)
        else:
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    if built.config.tie_embeddings:
        head = {"gpt2": "wte.weight", "gpt_neox": "gpt_neox.embed_in.weight"}.get(
            model_type, "model.embed_tokens.weight"
        )
        tensors["embed_out.weight" if model_type == "gpt_neox" else "lm_head.weight"] = tensors[head]
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_bytes((built.directory / "config.json").read_bytes())
    save_file(
        {name: np.ascontiguousarray(value) for name, value in tensors.items()}, old / "model.safetensors"
    )
    config, params = load_pretrained(old)
    assert config == built.config
    jax.tree.map(np.testing.assert_array_equal, params, built.params)


# transformers 4 config.json files as the Hub's original GPT-2 and Pythia checkpoints carry them.
HUB_CONFIGS = {
    "gpt2": {
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12,
        "n_layer": 12, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "vocab_size": 50257,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    },
    "pythia": {
        "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
        "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
        "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8,
        "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
        "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
        "use_parallel_residual": True, "vocab_size": 50304,
    },
}  # fmt: skip


def test_hub_configs_read():
    gpt2 = read(HUB_CONFIGS["gpt2"])
    assert (gpt2.num_layers, gpt2.d_model, gpt2.max_len, gpt2.mlp_activation) == (12, 768, 1024, "gelu_tanh")
    assert gpt2.tie_embeddings and gpt2.positions == "learned" and gpt2.attention_scale is None
    pythia = read(HUB_CONFIGS["pythia"])
    assert (pythia.rope_base, pythia.rope_fraction, pythia.parallel_block) == (10000.0, 0.25, True)
    assert (pythia.mlp_activation, pythia.norm_epsilon, pythia.tie_embeddings) == ("gelu", 1e-05, False)
