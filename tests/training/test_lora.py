"""LoRA adapters: the layer against a float64 reference, fresh adapters change nothing, merged
adapters load into the plain modules and decode with the KV cache, only the adapters train."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qkv_jax import lm
from qkv_jax.lora import LoRADenseGeneral, adapter_labels, count_params, effective_kernel, merge_lora
from qkv_jax.training.loop import only_adapters_train

VOCAB, LAYERS, D, N, MAX_LEN = 11, 2, 16, 4, 12
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, MAX_LEN), 0, VOCAB)
ALL_TARGETS = ("query", "key", "value", "out", "mlp")

LAYER_SHAPES = {  # features, axis, input shape: a Dense, a [D, N, H] projection, W_O [N, H, D]
    "dense": (6, -1, (2, 5, 3)),
    "heads": ((4, 3), -1, (2, 5, 3)),
    "out": (7, (-2, -1), (2, 5, 4, 3)),
}


def make_model(**overrides):
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
    return lm.TransformerLM(lm.TransformerConfig(**{**fields, **overrides}))


def perturbed(params, scale=0.3, seed=7):
    """Every leaf plus noise: adapters that do something (B != 0), biases that are not zero."""
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(params)))
    leaves = [
        p + scale * jax.random.normal(k, p.shape) for p, k in zip(jax.tree.leaves(params), keys, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


@pytest.mark.parametrize("shape", sorted(LAYER_SHAPES))
def test_layer_equals_a_float64_reference_and_starts_as_dense_general(shape):
    features, axis, input_shape = LAYER_SHAPES[shape]
    x = jax.random.normal(jax.random.PRNGKey(1), input_shape)
    plain = nn.DenseGeneral(features, axis=axis, precision="highest")
    adapted = LoRADenseGeneral(features, axis=axis, rank=2, alpha=3.0, precision="highest")
    plain_params = plain.init(jax.random.PRNGKey(0), x)["params"]
    params = adapted.init(jax.random.PRNGKey(0), x)["params"]
    # The same key gives DenseGeneral's kernel and bias, and B = 0 leaves the output as it was.
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(params[name], plain_params[name])
    np.testing.assert_array_equal(np.asarray(params["lora_b"]), 0.0)
    np.testing.assert_array_equal(
        adapted.apply({"params": params}, x), plain.apply({"params": plain_params}, x)
    )
    # With B != 0: x W + b + (alpha / r) (x A) B, against float64 NumPy.
    params = perturbed(params)
    n_in = 1 if axis == -1 else 2
    x64 = np.asarray(x, np.float64).reshape(*input_shape[: x.ndim - n_in], -1)
    as64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
    kernel = as64["kernel"].reshape(x64.shape[-1], -1)
    update = as64["lora_a"].reshape(x64.shape[-1], 2) @ as64["lora_b"].reshape(2, -1)
    expected = x64 @ (kernel + 1.5 * update) + as64["bias"].reshape(-1)
    output = adapted.apply({"params": params}, x)
    np.testing.assert_allclose(np.asarray(output).reshape(expected.shape), expected, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(output) - np.asarray(plain.apply({"params": plain_params}, x))).max() > 0.1
    np.testing.assert_allclose(
        effective_kernel(params, 3.0).reshape(kernel.shape), kernel + 1.5 * update, atol=1e-6
    )


def test_fresh_adapters_leave_the_lm_unchanged():
    """A TransformerLM with adapters on every target, from the same key as the plain one: the same
    kernels and biases, adapters beside them, and the same logits."""
    plain, adapted = make_model(), make_model(lora_rank=3, lora_targets=ALL_TARGETS)
    plain_params = plain.init(jax.random.PRNGKey(1), TOKENS)["params"]
    params = adapted.init(jax.random.PRNGKey(1), TOKENS)["params"]
    attention = params["block_0"]["attention"]
    assert set(attention["query"]) == {"kernel", "bias", "lora_a", "lora_b"}
    assert attention["query"]["lora_a"].shape == (D, 3) and attention["query"]["lora_b"].shape == (
        3,
        N,
        D // N,
    )
    assert attention["out"]["lora_a"].shape == (N, D // N, 3) and attention["out"]["lora_b"].shape == (3, D)
    assert params["block_1"]["mlp_in"]["lora_b"].shape == (3, 4 * D)
    np.testing.assert_equal(jax.device_get(merge_lora(params, 16.0)), jax.device_get(plain_params))
    np.testing.assert_array_equal(
        adapted.apply({"params": params}, TOKENS), plain.apply({"params": plain_params}, TOKENS)
    )


VARIANTS = {
    "mha_query_value": dict(lora_targets=("query", "value")),
    "gqa_all": dict(num_kv_heads=2, lora_targets=ALL_TARGETS),
    "mla_latent_key_value": dict(kv_latent_dim=8, lora_targets=("kv_latent", "key", "value", "out")),
}


@pytest.mark.reliability(
    "Decoding",
    "LoRA adapters (on W_Q/W_V; on every projection with GQA; on MLA's latent, key and value "
    "up-projections) merged into plain kernels",
    "the merged parameters load into the model without adapters: logits and cached decoding equal "
    "the adapted model's full pass within 1e-5 (float32); the adapted MLA model's absorbed decoding too",
)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.slow
def test_merged_adapters_load_into_the_plain_model_and_decode_with_the_cache(variant):
    adapted = make_model(lora_rank=2, lora_alpha=4.0, **VARIANTS[variant])
    plain = adapted.clone(config=dataclasses.replace(adapted.config, lora_rank=0))
    params = perturbed(adapted.init(jax.random.PRNGKey(1), TOKENS)["params"], scale=0.2)
    full = adapted.apply({"params": params}, TOKENS)
    merged = merge_lora(params, 4.0)
    assert "lora_a" not in str(jax.tree_util.tree_structure(merged))
    np.testing.assert_allclose(plain.apply({"params": merged}, TOKENS), full, atol=1e-5, rtol=1e-5)
    decoders = [(plain, merged)] + [(adapted, params)] * (variant.startswith("mla"))  # absorbed MLA
    for model, weights in decoders:
        step = jax.jit(
            lambda cache, tokens, model=model, weights=weights: model.apply(
                {"params": weights, "cache": cache}, tokens, decode=True, mutable=["cache"]
            )
        )
        logits, state = step(lm.init_cache(model, 2), TOKENS[:, :3])
        pieces = [logits]
        for t in range(3, MAX_LEN):
            logits, state = step(state["cache"], TOKENS[:, t : t + 1])
            pieces.append(logits)
        np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_only_the_adapters_train_with_optax_masking():
    """adapter_labels by path; a step of the wrapped AdamW (weight decay, clipping) leaves every
    frozen leaf bit-identical and moves the adapters."""
    model = make_model(lora_rank=2, lora_targets=("query", "value"))
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    labels = adapter_labels(params)
    assert labels["block_0"]["attention"]["query"] == {
        "kernel": "frozen",
        "bias": "frozen",
        "lora_a": "adapter",
        "lora_b": "adapter",
    }
    total, trainable = count_params(params)
    assert trainable == LAYERS * 2 * (D * 2 + 2 * D) and total > 10 * trainable
    tx = only_adapters_train(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)), params
    )

    def loss(p):
        logits = model.apply({"params": p}, TOKENS[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:]).mean()

    updates, _ = tx.update(jax.grad(loss)(params), tx.init(params), params)
    new = optax.apply_updates(params, updates)
    for (path, old), value, label in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(new),
        jax.tree.leaves(labels),
        strict=True,
    ):
        if label == "frozen":
            np.testing.assert_array_equal(value, old, err_msg=jax.tree_util.keystr(path))
        else:
            assert np.abs(np.asarray(value) - np.asarray(old)).max() > 0, jax.tree_util.keystr(path)
    plain = make_model().init(jax.random.PRNGKey(1), TOKENS)["params"]
    assert count_params(plain) == (sum(x.size for x in jax.tree.leaves(plain)),) * 2
    assert only_adapters_train(tx, plain) is tx


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(lora_rank=-1), "lora_rank=-1 must be an int >= 0"),
        (dict(lora_rank=2, lora_alpha=0.0), "lora_alpha=0.0 must be a number > 0"),
        (dict(lora_targets=("query", "ffn")), "lora_targets=('query', 'ffn') must be a tuple of"),
        (dict(lora_rank=2, lora_targets=("kv_latent",)), "has 'kv_latent' but kv_latent_dim=None"),
    ],
)
def test_bad_lora_arguments(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_model(**overrides)
    with pytest.raises(ValueError, match="rank=0 must be a positive int"):
        LoRADenseGeneral(4, rank=0)
