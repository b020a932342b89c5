"""Activation patching: the hooks, the sweeps against a loop of single patched runs and against
TransformerLens's own patching functions on the converted model, nnx against linen, refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_interpretability_circuits import CONFIGS, model_params, tokens_for

from qkv_jax import nnx as qkv_nnx
from qkv_jax.interpretability import ablate, patching_sweep, replace, run_with_cache, run_with_hooks
from qkv_jax.interpretability.patching import activation_axes
from qkv_jax.lm import TransformerLM

ANSWER, CONTRAST = 3, 5


def logit_difference(logits):
    """Mean over the batch of logit(ANSWER) - logit(CONTRAST) at the last position."""
    return jnp.mean(logits[:, -1, ANSWER] - logits[:, -1, CONTRAST])


@pytest.fixture(scope="module")
def gqa():
    """The grouped model, its variables, a clean and a corrupted batch, and the clean cache."""
    config = CONFIGS["gqa"]
    model, variables = TransformerLM(config), {"params": model_params(config)}
    clean, corrupted = tokens_for(2), tokens_for(3)
    _, cache = jax.jit(functools.partial(run_with_cache, model))(variables, clean)
    return config, model, variables, clean, corrupted, cache


def one_at_a_time(model, variables, corrupted, cache, hook, over, num_layers, size):
    """The sweep's matrix from one patched run per (layer, index): a jitted run per layer with the
    index traced, looped in Python."""
    rows = []
    for layer in range(num_layers):
        name = f"blocks.{layer}.{hook}"

        @jax.jit
        def run(index, name=name):
            hooks = {name: replace(cache[name], **{over: index})}
            return logit_difference(run_with_hooks(model, variables, corrupted, hooks=hooks))

        rows.append([run(index) for index in range(size)])
    return np.array(rows)


def test_head_sweep_equals_one_patched_run_per_head_vmapped_or_batched(gqa):
    config, model, variables, _, corrupted, cache = gqa
    want = one_at_a_time(
        model, variables, corrupted, cache, "attn.hook_z", "heads", config.num_layers, config.num_heads
    )
    vmapped = patching_sweep(model, variables, corrupted, cache, logit_difference)
    batched = patching_sweep(model, variables, corrupted, cache, logit_difference, batch_size=3)
    assert vmapped.shape == (config.num_layers, config.num_heads)
    np.testing.assert_allclose(vmapped, want, atol=1e-5)
    np.testing.assert_allclose(batched, want, atol=1e-5)
    assert np.ptp(want) > 1e-3  # the heads matter differently: the comparison can fail


def test_position_sweep_equals_one_patched_run_per_position(gqa):
    """Over (layer, position) of the residual stream entering each block; patching block 0's whole
    residual stream is the clean run."""
    config, model, variables, clean, corrupted, cache = gqa
    sweep = patching_sweep(
        model, variables, corrupted, cache, logit_difference, hook="hook_resid_pre", over="positions"
    )
    want = one_at_a_time(
        model, variables, corrupted, cache, "hook_resid_pre", "positions", config.num_layers, clean.shape[1]
    )
    np.testing.assert_allclose(sweep, want, atol=1e-5)
    everything = run_with_hooks(
        model,
        variables,
        corrupted,
        hooks={"blocks.0.hook_resid_pre": replace(cache["blocks.0.hook_resid_pre"])},
    )
    np.testing.assert_allclose(
        logit_difference(everything), logit_difference(model.apply(variables, clean)), atol=1e-5
    )


def test_sweeps_equal_transformer_lens_patching_on_the_converted_model(gqa):
    """TransformerLens's get_act_patch_attn_head_out_all_pos and get_act_patch_resid_pre on the
    same model (converted with qkv_jax.interpretability.tl) give the same matrices."""
    torch = pytest.importorskip("torch")
    tl_patching = pytest.importorskip("transformer_lens.patching")
    from qkv_jax.interpretability.tl import to_transformer_lens

    config, model, variables, clean, corrupted, cache = gqa
    bridge = to_transformer_lens(config, variables["params"])
    with torch.no_grad():
        _, tl_cache = bridge.run_with_cache(torch.from_numpy(clean).long())
        corrupted_t = torch.from_numpy(corrupted).long()
        heads = tl_patching.get_act_patch_attn_head_out_all_pos(
            bridge, corrupted_t, tl_cache, logit_difference_t
        )
        positions = tl_patching.get_act_patch_resid_pre(bridge, corrupted_t, tl_cache, logit_difference_t)
    ours_heads = patching_sweep(model, variables, corrupted, cache, logit_difference)
    ours_positions = patching_sweep(
        model, variables, corrupted, cache, logit_difference, hook="hook_resid_pre", over="positions"
    )
    np.testing.assert_allclose(ours_heads, heads.numpy(), atol=1e-5)
    np.testing.assert_allclose(ours_positions, positions.numpy(), atol=1e-5)


def logit_difference_t(logits):
    return (logits[:, -1, ANSWER] - logits[:, -1, CONTRAST]).mean()


@pytest.mark.slow
def test_nnx_sweep_equals_linen(gqa):
    config, model, variables, _, corrupted, cache = gqa
    nnx_model = qkv_nnx.linen_to_nnx(variables, qkv_nnx.TransformerLM(config, rngs=nnx.Rngs(0)))
    ours = patching_sweep(nnx_model, None, corrupted, cache, logit_difference)
    np.testing.assert_allclose(
        ours, patching_sweep(model, variables, corrupted, cache, logit_difference), atol=1e-5
    )


def test_replace_selects_heads_and_positions_by_int_array_or_mask():
    x = jnp.zeros((2, 5, 3, 4))  # [B, T, N, H], hook_z's layout
    source = jnp.ones_like(x)
    name = "blocks.0.attn.hook_z"
    np.testing.assert_array_equal(replace(source, heads=1)(x, name)[0, :, :, 0], [[0, 1, 0]] * 5)
    got = replace(source, heads=jnp.array([0, 2]), positions=np.array([False, True, False, False, True]))(
        x, name
    )
    want = np.zeros((5, 3))
    want[[1, 4]] = [1, 0, 1]
    np.testing.assert_array_equal(got[1, :, :, 2], want)
    np.testing.assert_array_equal(replace(source, heads=7)(x, name), x)  # outside [0, N): nothing
    pattern = jnp.zeros((2, 3, 5, 5))  # [B, N, T, S]
    got = replace(jnp.ones_like(pattern), heads=2, positions=4)(pattern, "blocks.1.attn.hook_pattern")
    assert float(got.sum()) == 2 * 5 and float(got[:, 2, 4].sum()) == 2 * 5
    assert activation_axes("blocks.0.hook_resid_pre") == (-2, None)


def test_ablate_zero_and_mean_where_selected():
    x = jnp.arange(2 * 4 * 3 * 2, dtype=jnp.float32).reshape(2, 4, 3, 2)  # [B, T, N, H]
    zeroed = ablate("zero", heads=1, positions=0)(x, "blocks.0.attn.hook_q")
    np.testing.assert_array_equal(zeroed[:, 0, 1], 0.0)
    assert float(jnp.abs(zeroed - x).sum()) == float(jnp.abs(x[:, 0, 1]).sum())
    mean = ablate("mean", heads=0)(x, "blocks.0.attn.hook_q")
    np.testing.assert_allclose(mean[:, :, 0], jnp.broadcast_to(x[:, :, 0].mean(0), (2, 4, 2)))
    np.testing.assert_array_equal(mean[:, :, 1:], x[:, :, 1:])


def test_zero_ablating_every_head_leaves_only_the_attention_bias(gqa):
    """hook_z zeroed for every head of layer 0: its attention output is the output projection's
    bias, so the residual after attention is the residual before it plus that bias."""
    _, model, variables, _, corrupted, _ = gqa
    hooks = {"blocks.0.attn.hook_z": ablate("zero")}
    _, acts = run_with_cache(
        model, variables, corrupted, hooks=hooks, names_filter=lambda n: n.startswith("blocks.0.hook_resid")
    )
    bias = variables["params"]["block_0"]["attention"]["out"]["bias"]
    np.testing.assert_allclose(
        acts["blocks.0.hook_resid_mid"], acts["blocks.0.hook_resid_pre"] + bias[None, None], atol=1e-6
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(over="layers"), "over='layers' must be 'heads' or 'positions'"),
        (dict(batch_size=0), "batch_size=0 must be a positive int or None"),
        (dict(hook="attn.hook_nothing"), "clean_cache has no 'attn.hook_nothing' activation"),
        (dict(hook="hook_resid_pre"), "hook_resid_pre has no head axis; use over='positions'"),
    ],
)
def test_sweep_refusals_name_the_argument(gqa, call, message):
    _, model, variables, _, corrupted, cache = gqa
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        patching_sweep(model, variables, corrupted, cache, logit_difference, **call)


def test_hook_refusals_name_the_argument():
    x = jnp.zeros((5, 3, 4))
    with pytest.raises(ValueError, match="no head axis"):
        replace(jnp.ones((5, 4)), heads=0)(jnp.zeros((5, 4)), "blocks.0.hook_resid_pre")
    with pytest.raises(ValueError, match=r"source of shape \(2,\)"):
        replace(jnp.ones(2))(x, "blocks.0.attn.hook_z")
    with pytest.raises(ValueError, match="kind='max' must be 'zero' or 'mean'"):
        ablate("max")
    with pytest.raises(ValueError, match="has none"):
        ablate("mean")(x, "blocks.0.attn.hook_z")
    with pytest.raises(TypeError, match="dtype float32"):
        replace(jnp.ones_like(x), heads=jnp.array([0.5]))(x, "blocks.0.attn.hook_z")
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        replace(jnp.ones_like(x), heads=jnp.array([True, False]))(x, "blocks.0.attn.hook_z")
