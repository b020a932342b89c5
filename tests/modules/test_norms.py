"""qkv_jax.norms against float64 NumPy: each kind's numbers, parameters, hook points, both faces."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qkv_jax import norms
from qkv_jax.modules import LayerNorm
from qkv_jax.nnx import norms as nnx_norms

EPSILON = 1e-5


def reference(x, kind, epsilon, scale, bias=None):
    """The norm in float64, written from its definition."""
    x, scale = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    if kind == "layernorm":
        centred = x - x.mean(-1, keepdims=True)
        y = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + epsilon) * scale
    else:
        y = x / np.sqrt((x**2).mean(-1, keepdims=True) + epsilon)
        y = y * (1.0 + scale if kind == "rms_offset" else scale)
    return y if bias is None else y + np.asarray(bias, np.float64)


def random(seed, *shape):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("kind", norms.NORMS)
def test_normalize_matches_float64_numpy(kind):
    x, scale, bias = random(0, 2, 5, 16) * 3 + 1, random(1, 16), random(2, 16)
    bias = bias if kind == "layernorm" else None
    got = norms.normalize(jnp.asarray(x), kind=kind, epsilon=EPSILON, scale=jnp.asarray(scale), bias=bias)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    np.testing.assert_allclose(got, reference(x, kind, EPSILON, scale, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", norms.NORMS)
def test_hook_points_carry_the_denominator_and_the_normalised_input(kind):
    x, scale = random(3, 4, 8), random(4, 8)
    seen = {}

    def hook(name, value):
        seen[name] = np.asarray(value, np.float64)
        return value

    norms.normalize(jnp.asarray(x), kind=kind, epsilon=EPSILON, scale=jnp.asarray(scale), hook=hook)
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(-1, keepdims=True) if kind == "layernorm" else x64
    std = np.sqrt((centred**2).mean(-1, keepdims=True) + EPSILON)
    assert seen["hook_scale"].shape == (4, 1)
    np.testing.assert_allclose(seen["hook_scale"], std, rtol=1e-5)
    np.testing.assert_allclose(seen["hook_normalized"], centred / std, rtol=1e-5, atol=1e-5)


def test_a_patched_scale_freezes_the_norm():
    """Replacing hook_scale by a constant makes the norm linear in x (TransformerLens's trick)."""
    x, scale = random(5, 3, 8), np.ones(8, np.float32)

    def freeze(name, value):
        return jnp.full_like(value, 2.0) if name == "hook_scale" else value

    got = norms.normalize(jnp.asarray(x), kind="rms", epsilon=EPSILON, scale=jnp.asarray(scale), hook=freeze)
    np.testing.assert_allclose(got, x / 2.0, rtol=1e-6)


def test_layernorm_kind_is_todays_layernorm_bit_for_bit_and_flax_s_to_rounding():
    x = jnp.asarray(random(6, 2, 7, 12) * 4 - 2)
    variables = LayerNorm().init(jax.random.PRNGKey(0), x)
    variables = jax.tree.map(lambda p: p + jnp.asarray(random(7, 12)), variables)
    today = LayerNorm().apply(variables, x)
    got = norms.Norm().apply(variables, x)
    np.testing.assert_array_equal(got, today)
    np.testing.assert_allclose(got, nn.LayerNorm().apply(variables, x), rtol=1e-5, atol=1e-5)


def test_rms_kind_equals_flax_rmsnorm():
    x = jnp.asarray(random(8, 3, 10))
    variables = {"params": {"scale": jnp.asarray(random(9, 10))}}
    got = norms.Norm(kind="rms", epsilon=EPSILON).apply(variables, x)
    np.testing.assert_allclose(got, nn.RMSNorm(epsilon=EPSILON).apply(variables, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kind, names, init",
    [("layernorm", {"scale", "bias"}, (1, 0)), ("rms", {"scale"}, (1,)), ("rms_offset", {"scale"}, (0,))],
)
def test_parameters_and_their_initial_values(kind, names, init):
    params = norms.Norm(kind=kind).init(jax.random.PRNGKey(0), jnp.ones((2, 6)))["params"]
    assert set(params) == names
    assert params["scale"].shape == (6,) and float(params["scale"][0]) == init[0]
    if "bias" in names:
        assert float(jnp.abs(params["bias"]).max()) == init[1]
    module = nnx_norms.Norm(6, kind=kind)
    assert set(nnx.to_pure_dict(nnx.state(module, nnx.Param))) == names


def test_layernorm_without_bias_has_only_a_scale():
    params = norms.Norm(use_bias=False).init(jax.random.PRNGKey(0), jnp.ones((2, 6)))["params"]
    assert set(params) == {"scale"}
    assert nnx_norms.Norm(6, use_bias=False).bias is None


@pytest.mark.parametrize("kind", norms.NORMS)
def test_nnx_face_equals_linen_face_with_the_same_parameters(kind):
    x = jnp.asarray(random(10, 2, 4, 8))
    params = {"scale": jnp.asarray(random(11, 8))}
    if kind == "layernorm":
        params["bias"] = jnp.asarray(random(12, 8))
    linen = norms.Norm(kind=kind, epsilon=EPSILON).apply({"params": params}, x)
    module = nnx_norms.Norm(8, kind=kind, epsilon=EPSILON)
    nnx.update(module, nnx.State(jax.tree.map(lambda p: nnx.Param(p), params)))
    np.testing.assert_array_equal(module(x), linen)


def test_rms_offset_computes_in_float32_then_casts():
    """Gemma's RMSNorm in bfloat16: the product in float32, one rounding at the end."""
    x = jnp.asarray(random(13, 3, 16) * 5).astype(jnp.bfloat16)
    scale = jnp.asarray(random(14, 16)).astype(jnp.bfloat16)
    got = norms.normalize(x, kind="rms_offset", epsilon=EPSILON, scale=scale)
    assert got.dtype == jnp.bfloat16
    want = reference(np.asarray(x, np.float32), "rms_offset", EPSILON, np.asarray(scale, np.float32))
    np.testing.assert_array_equal(
        np.asarray(got, np.float32),
        np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16), np.float32),
    )


def test_dtype_sets_the_output_dtype():
    x = jnp.asarray(random(15, 2, 8))
    got = norms.Norm(kind="rms", dtype=jnp.bfloat16).init_with_output(jax.random.PRNGKey(0), x)[0]
    assert got.dtype == jnp.bfloat16


@pytest.mark.parametrize("kind", ["RMS", "batchnorm", None])
def test_an_unknown_kind_is_a_value_error_naming_it(kind):
    with pytest.raises(ValueError, match=r"kind=.* must be one of layernorm, rms, rms_offset"):
        norms.normalize(jnp.ones((2, 3)), kind=kind, epsilon=EPSILON, scale=jnp.ones(3))
    with pytest.raises(ValueError, match=r"^Norm: kind="):
        norms.Norm(kind=kind)
    with pytest.raises(ValueError, match=r"^Norm: kind="):
        nnx_norms.Norm(3, kind=kind)
    with pytest.raises(ValueError, match=r"^TransformerConfig: norm="):
        norms.check_norm("TransformerConfig", kind)
