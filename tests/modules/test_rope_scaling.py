"""RoPE scaling (`qkv_jax.positions.RopeScaling`): the inverse frequencies and attention factors
of "linear", "llama3" and "yarn" against transformers' own `ROPE_INIT_FUNCTIONS`, the rotation
against its `apply_rotary_pos_emb`, and every refusal of a bad rule. torch and transformers
(seconds to import) are imported by the tests that use them, not at collection.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from qkv_jax.positions import RopeScaling, apply_rope, rope_frequencies

HEAD_DIM, BASE = 32, 500.0

# (qkv_jax's rule, transformers' rope_parameters for the same rule)
RULES = {
    "linear": (RopeScaling("linear", factor=4.0), {"rope_type": "linear", "factor": 4.0}),
    "llama3": (
        RopeScaling("llama3", factor=8.0, original_max_len=64, low_freq_factor=1.0, high_freq_factor=4.0),
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    "llama3-bands": (
        RopeScaling("llama3", factor=2.0, original_max_len=200, low_freq_factor=2.0, high_freq_factor=8.0),
        {
            "rope_type": "llama3",
            "factor": 2.0,
            "original_max_position_embeddings": 200,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
        },
    ),
    "yarn": (
        RopeScaling("yarn", factor=4.0, original_max_len=64),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "yarn-options": (
        RopeScaling(
            "yarn",
            factor=3.0,
            original_max_len=100,
            beta_fast=16.0,
            beta_slow=2.0,
            attention_factor=1.25,
            truncate=False,
        ),
        {
            "rope_type": "yarn",
            "factor": 3.0,
            "original_max_position_embeddings": 100,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "attention_factor": 1.25,
            "truncate": False,
        },
    ),
}


def hf_config(parameters, fraction=1.0):
    """A Llama config of head_dim HEAD_DIM whose RoPE is `parameters` (rope_theta BASE)."""
    from transformers import LlamaConfig

    rope = {"rope_theta": BASE, **parameters}
    if fraction != 1.0:
        rope["partial_rotary_factor"] = fraction
    return LlamaConfig(
        hidden_size=2 * HEAD_DIM,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=256,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(RULES))
def test_frequencies_equal_transformers(name, fraction):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, parameters = RULES[name]
    rotated = int(HEAD_DIM * fraction)
    theirs, their_factor = ROPE_INIT_FUNCTIONS[parameters["rope_type"]](
        hf_config(parameters, fraction), "cpu"
    )
    ours, factor = rope_frequencies(rotated, BASE, scaling)
    assert ours.dtype == np.float32 and ours.shape == (rotated // 2,)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=2e-6, atol=0)
    assert factor == pytest.approx(their_factor, rel=1e-12)


def test_rules_change_the_frequencies():
    """Each rule's numbers differ from the unscaled ones where it says they do: llama3 keeps the
    short wavelengths and divides the long ones, yarn the same at its ramp's ends."""
    plain, factor = rope_frequencies(HEAD_DIM, BASE)
    assert factor == 1.0
    np.testing.assert_allclose(plain, BASE ** -(np.arange(0, HEAD_DIM, 2) / HEAD_DIM), rtol=1e-6)
    for name in ("llama3-bands", "yarn"):
        scaling = RULES[name][0]
        scaled, _ = rope_frequencies(HEAD_DIM, BASE, scaling)
        assert scaled[0] == pytest.approx(plain[0], rel=1e-6), name  # the fastest pair is kept
        assert scaled[-1] == pytest.approx(plain[-1] / scaling.factor, rel=1e-6), name  # the slowest divided
        blended = (scaled < plain * (1 - 1e-6)) & (scaled > plain / scaling.factor * (1 + 1e-6))
        assert blended.any(), name  # and some pairs between the two
    assert rope_frequencies(HEAD_DIM, BASE, RULES["yarn"][0])[1] == pytest.approx(0.1 * math.log(4.0) + 1)
    assert rope_frequencies(HEAD_DIM, BASE, RopeScaling("yarn", 1.0, original_max_len=8))[1] == 1.0


@pytest.mark.parametrize("name", [None, *sorted(RULES)])
def test_rotation_equals_transformers(name):
    """apply_rope with a rule rotates queries as transformers' Llama rotary embedding and
    apply_rotary_pos_emb do (yarn's attention factor included); None is the unscaled RoPE.
    transformers rounds each step of the frequencies to float32, qkv_jax only the result: at
    angles up to 40 rad the rotations differ by ~1e-5 of |x|."""
    import torch
    from transformers.models.llama import modeling_llama

    scaling, parameters = RULES[name] if name else (None, {"rope_type": "default"})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 40, 3, HEAD_DIM)).astype(np.float32)  # (B, T, N, H)
    positions = np.arange(40)
    rotary = modeling_llama.LlamaRotaryEmbedding(hf_config(parameters))
    cos, sin = rotary(torch.zeros(1), torch.as_tensor(positions)[None])  # (1, T, H)
    q = torch.as_tensor(x).transpose(1, 2)  # (B, N, T, H)
    theirs, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
    ours = apply_rope(jnp.asarray(x), positions, base=BASE, scaling=scaling)
    np.testing.assert_allclose(ours, theirs.transpose(1, 2).numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(kind="dynamic", factor=2.0), "kind='dynamic'"),
        (dict(kind="linear", factor=0.0), "factor=0.0"),
        (dict(kind="linear", factor=True), "factor=True"),
        (dict(kind="linear", factor=math.inf), "factor=inf"),
        (dict(kind="llama3", factor=8.0), "original_max_len, a positive int"),
        (dict(kind="yarn", factor=8.0, original_max_len=0), "got 0"),
        (dict(kind="yarn", factor=8.0, original_max_len=16.0), "got 16.0"),
        (dict(kind="llama3", factor=8.0, original_max_len=16, low_freq_factor=4.0), "high_freq_factor=4.0"),
        (dict(kind="llama3", factor=8.0, original_max_len=16, low_freq_factor=-1.0), "low_freq_factor=-1.0"),
        (dict(kind="yarn", factor=2.0, original_max_len=16, beta_fast=0), "beta_fast=0"),
        (dict(kind="yarn", factor=2.0, original_max_len=16, attention_factor=-1.0), "attention_factor=-1.0"),
        (dict(kind="yarn", factor=2.0, original_max_len=16, truncate=1), "truncate=1"),
    ],
)
def test_bad_rules_are_refused(fields, message):
    with pytest.raises(ValueError, match=f"RopeScaling: .*{message}" if "=" in message else message):
        RopeScaling(**fields)
