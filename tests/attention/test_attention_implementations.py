"""The "xla" and "chunked" paths of dot_product_attention against the reference.

Every path must give the reference's outputs and gradients (float64 NumPy for
outputs, the reference path for gradients), including masks, GQA, causal with
T != S, fully masked rows, bias and low precision. The chunked kernel is also
run with tiny blocks so that padding, several blocks and the skipped causal
blocks are exercised at small shapes (tests/attention/test_attention_variants.py counts the
tiles the kernel computes and checks that it skips the rest).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from jax.test_util import check_grads

import qkv_jax
from qkv_jax import dot_product_attention
from qkv_jax.attention import (
    ACCELERATOR_BYTES,
    CHUNKED_MIN_KEYS,
    FEATURES,
    MATERIALIZE_FRACTION,
    SUPPORTED,
    accelerator_block_sizes,
    check_supported,
    select_implementation,
)
from qkv_jax.attention.chunked import chunked_attention

PATHS = ["xla", "chunked"]
F32_OUT_ATOL = 1e-5  # float32 against the float64 answer
F32_GRAD_TOL = dict(atol=2e-5, rtol=1e-4)  # float32 path against the float32 reference path
LOW_PRECISION_TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}  # against float32 on the same rounded inputs

# (batch, T, S, N, K, H, Hv, masking); "mask" leaves row 1 of the first example fully masked,
# "bias" puts -inf over row 2 of head 0.
CASES = {
    "gqa-causal": ((2,), 6, 6, 4, 2, 8, 8, "causal"),
    "mqa-causal-T<S": ((2,), 3, 7, 4, 1, 8, 8, "causal"),
    "causal-T>S-mask": ((2,), 7, 4, 2, 2, 8, 8, "causal+mask"),
    "mask-bias": ((2,), 5, 6, 4, 2, 8, 8, "mask+bias"),
    "batch2d-bias": ((1, 2), 4, 5, 2, 2, 4, 4, "bias"),
    "unbatched": ((), 4, 4, 2, 1, 8, 8, "none"),
}


def make_inputs(case, dtype=np.float32, seed=0):
    batch, T, S, N, K, H, Hv, masking = case
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(*batch, T, N, H)).astype(dtype)
    key = rng.normal(size=(*batch, S, K, H)).astype(dtype)
    value = rng.normal(size=(*batch, S, K, Hv)).astype(dtype)
    mask = bias = None
    if "mask" in masking:
        mask = rng.random((*batch, 1, T, S)) < 0.7
        mask.reshape(-1, T, S)[0, 1] = False
    if "bias" in masking:
        bias = rng.normal(size=(N, T, S)).astype(np.float32)
        bias[0, 2] = -np.inf
    return query, key, value, mask, bias, "causal" in masking


def numpy_answer(query, key, value, mask, bias, is_causal, scale=None):
    T, S = query.shape[-3], key.shape[-3]
    full_mask = mask
    if is_causal:
        full_mask = ref.causal(T, S) if mask is None else mask & ref.causal(T, S)
    return ref.attention(query, key, value, mask=full_mask, bias=bias, scale=scale)[0]


@functools.cache
def grad_fn(implementation, is_causal, with_bias):
    """Gradients of a fixed scalar loss w.r.t. query, key, value (and bias), jitted once."""

    def loss(query, key, value, bias, mask):
        out = dot_product_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, implementation=implementation
        )
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))  # uneven weights on every output entry

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if with_bias else (0, 1, 2)))


def gradients(implementation, query, key, value, mask, bias, is_causal):
    return grad_fn(implementation, is_causal, bias is not None)(query, key, value, bias, mask)


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("implementation", PATHS)
def test_outputs_and_gradients_match_reference(implementation, case):
    query, key, value, mask, bias, is_causal = make_inputs(CASES[case])
    out = dot_product_attention(
        query, key, value, mask=mask, bias=bias, is_causal=is_causal, implementation=implementation
    )
    assert out.dtype == jnp.float32 and out.shape == (*query.shape[:-1], value.shape[-1])
    want = numpy_answer(query, key, value, mask, bias, is_causal)
    np.testing.assert_allclose(out, want, atol=F32_OUT_ATOL)
    got = gradients(implementation, query, key, value, mask, bias, is_causal)
    expected = gradients("reference", query, key, value, mask, bias, is_causal)
    for name, g, e in zip(("query", "key", "value", "bias")[: len(got)], got, expected, strict=True):
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL, err_msg=name)


LOW_PRECISION = [
    ("xla", jnp.bfloat16),
    ("xla", jnp.float16),
    ("chunked", jnp.bfloat16),
    ("chunked", jnp.float16),
]


@pytest.mark.parametrize("implementation,dtype", LOW_PRECISION)
def test_low_precision_matches_float32(implementation, dtype):
    query, key, value, mask, bias, is_causal = make_inputs(CASES["mask-bias"])
    low = [jnp.asarray(x, dtype) for x in (query, key, value)]
    rounded = [np.asarray(x, np.float32) for x in low]  # the same numbers in float32
    out = dot_product_attention(*low, mask=mask, bias=bias, implementation=implementation)
    assert out.dtype == dtype
    want = dot_product_attention(*rounded, mask=mask, bias=bias, implementation="reference")
    tolerance = LOW_PRECISION_TOL[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=tolerance, rtol=tolerance)
    got = gradients(implementation, *low, mask, bias, False)
    expected = gradients("reference", *rounded, mask, bias, False)
    for g, e in zip(got, expected, strict=True):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, e, atol=4 * tolerance, rtol=4 * tolerance)


@pytest.mark.parametrize("implementation", PATHS)
def test_fully_masked_rows_are_zero_with_finite_gradients(implementation):
    query, key, value, mask, bias, _ = make_inputs(CASES["mask-bias"])
    out = dot_product_attention(query, key, value, mask=mask, bias=bias, implementation=implementation)
    np.testing.assert_array_equal(out[0, 1], 0.0)  # mask row
    np.testing.assert_array_equal(out[:, 2, 0], 0.0)  # -inf bias row of head 0
    query, key, value, mask, _, _ = make_inputs(CASES["causal-T>S-mask"])  # T 7, S 4
    out = dot_product_attention(
        query, key, value, mask=mask, is_causal=True, query_offset=4 - 7, implementation=implementation
    )
    np.testing.assert_array_equal(out[:, :3], 0.0)  # aligned bottom-right, the first T - S queries see no key


def add_non_finite(key, value, attended):
    """Bad entries at keys 4 and 5 (masked out below), and at attended keys when asked."""
    key, value = key.copy(), value.copy()
    key[0, 4, 1] = np.nan
    value[1, 5, 0, 2] = np.inf
    if attended:
        value[0, 3, 1, 1] = np.nan  # poisons channel 1 of the rows of kv head 1 that see key 3
        key[1, 0, 0, 3] = -np.inf  # poisons the whole rows of kv head 0 that see key 0
    return key, value


@pytest.mark.parametrize("implementation", PATHS)
def test_non_finite_keys_and_values_as_in_reference(implementation):
    """Masked-out NaN/inf never leak, into outputs or gradients; attended ones give NaN
    exactly where the reference does."""
    query, key, value, mask, bias, _ = make_inputs(CASES["mask-bias"])
    mask = mask.copy()
    mask[..., 4:] = False  # keys 4 and 5 are masked for every query
    bad_key, bad_value = add_non_finite(key, value, attended=True)
    attend = functools.partial(dot_product_attention, query, bad_key, bad_value, mask=mask, bias=bias)
    out, want = attend(implementation=implementation), attend(implementation="reference")
    assert np.isnan(want).any() and np.isfinite(want).any()
    np.testing.assert_allclose(out, want, atol=F32_OUT_ATOL)  # NaN where want is NaN, and only there
    bad_key, bad_value = add_non_finite(key, value, attended=False)
    got = gradients(implementation, query, bad_key, bad_value, mask, bias, False)
    expected = gradients("reference", query, key, value, mask, bias, False)  # the clean inputs
    for g, e in zip(got, expected, strict=True):  # masked keys get no gradient, clean or not
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL)


@pytest.mark.parametrize("implementation", PATHS)
def test_one_array_as_key_and_value_non_finite_as_in_reference(implementation):
    """One array passed as both key and value (as MLA's absorbed decoding passes its latents):
    the chunked kernel skips its check of the values there, so NaN must still fall exactly
    where the reference puts it for two separate copies, with a bias of -inf and across
    blocks; masked-out bad entries reach neither outputs nor gradients."""
    query, key, _, mask, bias, _ = make_inputs(CASES["mask-bias"])  # H == Hv
    mask = mask.copy()
    mask[..., 4:] = False  # keys 4 and 5 are masked for every query
    both = key.copy()
    both[0, 4, 1, 0] = np.nan
    both[1, 5, 0, 2] = np.inf
    clean = both.copy()
    both[0, 3, 1, 1] = np.nan  # attended by some rows of kv head 1
    both[1, 0, 0, 3] = -np.inf  # attended by some rows of kv head 0
    want = dot_product_attention(query, both, both.copy(), mask=mask, bias=bias, implementation="reference")
    assert np.isnan(want).any() and np.isfinite(want).any()
    out = dot_product_attention(query, both, both, mask=mask, bias=bias, implementation=implementation)
    np.testing.assert_allclose(out, want, atol=F32_OUT_ATOL)  # NaN where want is NaN, and only there
    blocks = jax.jit(functools.partial(chunked_attention, block_q=2, block_k=3))
    np.testing.assert_allclose(blocks(query, both, both, mask=mask, bias=bias), want, atol=F32_OUT_ATOL)

    def loss(query, both):
        attend = dot_product_attention(query, both, both, mask=mask, bias=bias, implementation=implementation)
        return jnp.sum(attend * jnp.cos(attend))

    got = jax.grad(loss, argnums=(0, 1))(query, clean)  # bad entries at masked keys only
    clean[0, 4, 1, 0] = clean[1, 5, 0, 2] = 0.0
    expected = jax.grad(loss, argnums=(0, 1))(query, clean)
    for g, e in zip(got, expected, strict=True):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL)


def test_chunked_non_finite_across_blocks():
    """The chunked kernel's NaN rules hold with several blocks, causal and masked."""
    query, key, value, mask, _, _ = make_inputs(CASES["causal-T>S-mask"])  # T 7, S 4
    key, value = key.copy(), value.copy()
    key[0, 1, 0, 2] = np.nan
    value[1, 3, 1, 0] = np.inf
    value[0, 2, 0, 1] = np.nan
    attend = jax.jit(functools.partial(chunked_attention, is_causal=True, block_q=2, block_k=3))
    out = attend(query, key, value, mask=mask)
    want = dot_product_attention(query, key, value, mask=mask, is_causal=True, implementation="reference")
    assert np.isnan(want).any() and np.isfinite(want).any()
    np.testing.assert_allclose(out, want, atol=F32_OUT_ATOL)


# (T, S, block_q, block_k, is_causal, mask shape, bias shape) with batch 2, N = 4, K = 2.
KERNEL_CASES = [
    (7, 7, 3, 2, True, None, None),
    (5, 9, 2, 4, True, (2, 1, 5, 9), (4, 5, 9)),
    (9, 5, 4, 2, True, (2, 1, 1, 5), (2, 4, 1, 5)),
    (6, 8, 4, 3, False, (2, 4, 6, 8), (1, 4, 6, 8)),
]


@pytest.mark.parametrize("T,S,block_q,block_k,is_causal,mask_shape,bias_shape", KERNEL_CASES)
@pytest.mark.slow
def test_chunked_kernel_with_small_blocks(T, S, block_q, block_k, is_causal, mask_shape, bias_shape):
    rng = np.random.default_rng(T * S)
    query = rng.normal(size=(2, T, 4, 8)).astype(np.float32)
    key = rng.normal(size=(2, S, 2, 8)).astype(np.float32)
    value = rng.normal(size=(2, S, 2, 5)).astype(np.float32)  # Hv != H
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.7
    bias = None if bias_shape is None else rng.normal(size=bias_shape).astype(np.float32)
    scale = 0.3

    def run(attend, q, k, v, b, s):
        return attend(q, k, v, mask=mask, bias=b, is_causal=is_causal, scale=s)

    tiled = functools.partial(chunked_attention, block_q=block_q, block_k=block_k)
    reference = functools.partial(dot_product_attention, implementation="reference")
    want = numpy_answer(query, key, value, mask, bias, is_causal, scale)
    np.testing.assert_allclose(
        jax.jit(run, static_argnums=0)(tiled, query, key, value, bias, scale), want, atol=F32_OUT_ATOL
    )

    def loss(attend, *args):
        return jnp.sum(jnp.sin(run(attend, *args)))

    argnums = (0, 1, 2, 4) if bias is None else (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(functools.partial(loss, tiled), argnums))(query, key, value, bias, scale)
    expected = jax.jit(jax.grad(functools.partial(loss, reference), argnums))(query, key, value, bias, scale)
    for g, e in zip(got, expected, strict=True):
        assert np.shape(g) == np.shape(e)
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL)


def test_chunked_gradients_float64_finite_differences():
    rng = np.random.default_rng(3)
    query, key, value = (rng.normal(size=(2, n, 2, 3)) for n in (5, 6, 6))
    mask = rng.random((2, 1, 5, 6)) < 0.8
    mask[0, 0, 1] = False  # a fully masked row

    @jax.jit
    def attend(q, k, v, b):
        return chunked_attention(q, k, v, mask=mask, bias=b, is_causal=True, block_q=2, block_k=4)

    with jax.enable_x64(True):
        check_grads(attend, (query, key, value, rng.normal(size=(2, 5, 6))), order=1, modes=["rev"], eps=1e-5)


def test_chunked_under_vmap_equals_batched():
    query, key, value, mask, _, _ = make_inputs(CASES["causal-T>S-mask"])
    attend = jax.jit(functools.partial(chunked_attention, is_causal=True, block_q=3, block_k=2))
    batched = attend(query, key, value, mask=mask)
    mapped = jax.vmap(lambda q, k, v, m: attend(q, k, v, mask=m))(query, key, value, mask)
    np.testing.assert_allclose(mapped, batched, atol=1e-6)


def shapes(T, S, H=8, Hv=8, dtype=jnp.float32, key_dtype=None):
    """Query, key, value shape-dtype structs with batch 2, N = 4, K = 2."""
    return (
        jax.ShapeDtypeStruct((2, T, 4, H), dtype),
        jax.ShapeDtypeStruct((2, S, 2, H), key_dtype or dtype),
        jax.ShapeDtypeStruct((2, S, 2, Hv), dtype),
    )


LONG = CHUNKED_MIN_KEYS
BF16 = jnp.bfloat16
MASK = jax.ShapeDtypeStruct((LONG, LONG), jnp.bool_)
BIAS = jax.ShapeDtypeStruct((2, 1, LONG, LONG), jnp.float32)
SELECTIONS = [
    ("cpu short", shapes(8, LONG - 1), {}, "cpu", "reference"),
    ("cpu long", shapes(8, LONG), {}, "cpu", "chunked"),
    ("cpu long float64", shapes(4, LONG, dtype=jnp.float64), {}, "cpu", "chunked"),
    ("cpu long float16 masked", shapes(4, LONG, dtype=jnp.float16), dict(mask=True), "cpu", "chunked"),
    ("cpu long bf16 masked", shapes(LONG, LONG, dtype=BF16), dict(mask=MASK), "cpu", "chunked"),
    ("cpu weights", shapes(LONG, LONG), dict(return_weights=True), "cpu", "reference"),
    ("cpu dropout", shapes(LONG, LONG), dict(dropout_rate=0.1), "cpu", "reference"),
    # GPU, step 2: cuDNN wherever it applies, masks, bias and causal with an offset included.
    ("gpu cudnn", shapes(LONG, LONG, dtype=BF16), dict(is_causal=True), "gpu", "cudnn"),
    ("gpu cudnn short", shapes(8, 8, dtype=BF16), {}, "gpu", "cudnn"),
    ("gpu cudnn float16", shapes(LONG, LONG, dtype=jnp.float16), {}, "gpu", "cudnn"),
    ("gpu cudnn H 128", shapes(LONG, LONG, H=128, Hv=128, dtype=BF16), {}, "gpu", "cudnn"),
    ("gpu causal T < S", shapes(8, LONG, dtype=BF16), dict(is_causal=True), "gpu", "cudnn"),
    ("gpu causal T > S", shapes(LONG, 8, dtype=BF16), dict(is_causal=True), "gpu", "cudnn"),
    (
        "gpu causal, offset S - T",
        shapes(8, LONG, dtype=BF16),
        dict(is_causal=True, query_offset=LONG - 8),
        "gpu",
        "cudnn",
    ),
    ("gpu masked", shapes(LONG, LONG, dtype=BF16), dict(mask=MASK), "gpu", "cudnn"),
    ("gpu bias", shapes(LONG, LONG, dtype=BF16), dict(bias=BIAS), "gpu", "cudnn"),
    (
        "gpu mask+bias+causal",
        shapes(LONG, LONG, dtype=BF16),
        dict(mask=MASK, bias=BIAS, is_causal=True),
        "gpu",
        "cudnn",
    ),
    # ... and not where it does not: a bias (masks and causal offsets become one) needs even T and
    # S for cuDNN's backward, H is a multiple of 8 up to 128 and equal to Hv, the inputs bf16/fp16.
    ("gpu masked odd T", shapes(LONG - 1, LONG, dtype=BF16), dict(mask=True), "gpu", "xla"),
    (
        "gpu causal with an offset, odd S",
        shapes(8, LONG + 1, dtype=BF16),
        dict(is_causal=True, query_offset=LONG + 1 - 8),
        "gpu",
        "xla",
    ),
    ("gpu causal, odd S", shapes(8, LONG + 1, dtype=BF16), dict(is_causal=True), "gpu", "cudnn"),
    ("gpu unmasked odd T", shapes(LONG - 1, LONG + 1, dtype=BF16), dict(is_causal=False), "gpu", "cudnn"),
    ("gpu H 256", shapes(LONG, LONG, H=256, Hv=256, dtype=BF16), {}, "gpu", "xla"),
    ("gpu H 12", shapes(LONG, LONG, H=12, Hv=12, dtype=BF16), {}, "gpu", "xla"),
    ("gpu Hv != H", shapes(LONG, LONG, Hv=16, dtype=BF16), {}, "gpu", "reference"),
    ("gpu bf16 query, f32 key", shapes(LONG, LONG, dtype=BF16, key_dtype=jnp.float32), {}, "gpu", "xla"),
    ("gpu float32 long", shapes(LONG, LONG), {}, "gpu", "xla"),
    ("gpu float32 short", shapes(8, 8), {}, "gpu", "xla"),
    ("gpu Hv != H short", shapes(8, 8, Hv=4), {}, "gpu", "reference"),
    ("gpu weights", shapes(8, 8, dtype=BF16), dict(return_weights=True), "gpu", "reference"),
    ("gpu dropout", shapes(LONG, LONG, dtype=BF16), dict(dropout_rate=0.1), "gpu", "reference"),
    ("tpu", shapes(8, 8, dtype=BF16), {}, "tpu", "xla"),
    ("tpu masked long", shapes(LONG, LONG, dtype=BF16), dict(mask=MASK), "tpu", "xla"),
    # Accelerators, step 3: a materialised path while the logits fit in a quarter of the device's
    # memory (16 GiB assumed for a platform this process does not run on), the scan beyond.
    ("gpu float32 32k keys", shapes(32768, 32768), dict(is_causal=True), "gpu", "chunked"),
    ("gpu soft cap 32k keys", shapes(32768, 32768), dict(logits_soft_cap=5.0), "gpu", "chunked"),
    ("tpu float32 16k keys", shapes(16384, 16384), {}, "tpu", "chunked"),
    ("tpu float32 4k keys", shapes(4096, 4096), {}, "tpu", "xla"),
]


@pytest.mark.parametrize(
    "inputs,kwargs,platform,expected", [s[1:] for s in SELECTIONS], ids=[s[0] for s in SELECTIONS]
)
def test_select_implementation_rule(inputs, kwargs, platform, expected):
    assert select_implementation(*inputs, platform=platform, **kwargs) == expected


@pytest.mark.parametrize("S", [1, LONG - 1, LONG])
def test_default_runs_the_selected_path(S):
    """implementation=None traces to exactly the program of the path the rule names."""
    inputs = shapes(4, S)
    expected = select_implementation(*inputs)

    def program(implementation):
        return str(
            jax.make_jaxpr(
                functools.partial(dot_product_attention, is_causal=True, implementation=implementation)
            )(*inputs)
        )

    assert program(None) == program(expected)
    assert program(None) != program("reference" if expected == "chunked" else "chunked")


def test_multi_head_attention_takes_the_chunked_path_on_long_inputs():
    model = qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True)
    inputs = jax.ShapeDtypeStruct((1, LONG, 8), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), inputs)
    program = str(jax.make_jaxpr(model.apply)(params, inputs))
    assert "custom_vjp_call" in program  # the chunked kernel's custom VJP


@pytest.mark.slow
def test_modules_pass_the_implementation_through_and_sowing_takes_the_reference():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 11)
    logits = {}
    for implementation in ("reference", "chunked"):
        config = qkv_jax.lm.TransformerConfig(
            vocab_size=11,
            num_layers=1,
            d_model=16,
            num_heads=4,
            num_kv_heads=2,
            max_len=12,
            attention_implementation=implementation,
        )
        model = qkv_jax.TransformerLM(config)
        params = model.init(jax.random.PRNGKey(0), tokens)
        logits[implementation] = model.apply(params, tokens)
    np.testing.assert_allclose(logits["chunked"], logits["reference"], atol=1e-5)
    program = str(jax.make_jaxpr(lambda p: model.apply(p, tokens))(params))
    assert "custom_vjp_call" in program  # the chunked kernel, asked for at only 12 keys
    sowing = qkv_jax.MultiHeadAttention(num_heads=2, sow_weights=True, attention_implementation="chunked")
    inputs = jnp.ones((1, 4, 8))
    variables = sowing.init(jax.random.PRNGKey(0), inputs)
    _, state = sowing.apply(variables, inputs, mutable=["intermediates"])  # no "cannot return weights"
    np.testing.assert_allclose(state["intermediates"]["attention_weights"][0].sum(-1), 1.0, rtol=1e-6)


BAD_REQUESTS = [
    pytest.param(dict(implementation="flash"), "implementation must be None or one of", id="unknown"),
    pytest.param(
        dict(implementation="chunked", return_weights=True), "cannot return attention weights", id="weights"
    ),
    pytest.param(
        dict(implementation="xla", return_weights=True), "cannot return attention weights", id="weights xla"
    ),
    pytest.param(
        dict(implementation="cudnn", return_weights=True),
        "cannot return attention weights",
        id="weights cudnn",
    ),
    pytest.param(
        dict(implementation="chunked", dropout_rate=0.1, dropout_rng=jax.random.PRNGKey(0)),
        "does not implement dropout (dropout_rate=0.1",
        id="dropout",
    ),
    pytest.param(
        dict(implementation="xla", value=np.ones((2, 5, 2, 3), np.float32)), "Hv=3 and H=4", id="value depth"
    ),
]


@pytest.mark.parametrize("override,message", BAD_REQUESTS)
def test_ineligible_requests_raise(override, message):
    args = dict(
        query=np.ones((2, 4, 4, 4), np.float32),
        key=np.ones((2, 5, 2, 4), np.float32),
        value=np.ones((2, 5, 2, 4), np.float32),
    )
    args.update(override)
    with pytest.raises(ValueError) as info:
        dot_product_attention(**args)
    assert message in str(info.value)


def test_check_supported_reads_the_table_and_names_owner_implementation_and_feature():
    check_supported("Block", None, FEATURES)  # the dispatch rule picks a path that takes them
    for implementation, supported in SUPPORTED.items():
        check_supported("Block", implementation, supported)
        for feature in set(FEATURES) - supported:
            with pytest.raises(ValueError) as info:
                check_supported("Block", implementation, {feature: f"{feature} on"})
            message = str(info.value)
            assert message.startswith(f"Block: implementation={implementation!r} ")
            assert f"({feature} on): use 'reference'" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"^Block: attention_implementation='xla' has no sinks \(use_sinks"):
        check_supported("Block", "xla", {"sinks": "use_sinks=True"}, argument="attention_implementation")
    with pytest.raises(ValueError, match="^Block: attention_implementation must be None or one of"):
        check_supported("Block", "flash", (), argument="attention_implementation")
    with pytest.raises(ValueError, match="not arguments of dot_product_attention"):
        check_supported("Block", "xla", ["sink"])


def test_xla_refuses_float64():
    with jax.enable_x64(True):
        query = np.ones((4, 2, 4))
        with pytest.raises(ValueError, match="cannot serve float64"):
            dot_product_attention(query, query, query, implementation="xla")


LONG_CALLS = {
    "causal left window": dict(is_causal=True, local_window_size=(1024, 0)),
    "two-sided window": dict(local_window_size=(512, 512)),
    "packed": dict(
        query_segment_ids=jax.ShapeDtypeStruct((1, 4096), jnp.int32),
        key_segment_ids=jax.ShapeDtypeStruct((1, 4096), jnp.int32),
    ),
    "sinks": dict(is_causal=True, sinks=jax.ShapeDtypeStruct((8,), jnp.float32)),
    "soft cap": dict(is_causal=True, logits_soft_cap=50.0),
    "float32": dict(is_causal=True),
}


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerators_take_no_cpu_scan_at_4096_keys(platform):
    """A model's attention at 4,096 positions (batch 1, 8 heads): the materialised paths' logits
    fit, so no option sends it to the scan tuned for CPU caches."""
    for name, kwargs in LONG_CALLS.items():
        dtype = jnp.float32 if name == "float32" else BF16
        inputs = tuple(jax.ShapeDtypeStruct((1, 4096, 8, 64), dtype) for _ in range(3))
        assert select_implementation(*inputs, platform=platform, **kwargs) != "chunked", name


def test_gpus_take_no_cpu_scan_at_the_benchmark_shape():
    """B4 T4096 N16 H128 (benchmarks/gpu_probe.py's shape): its 12.9 GB materialised fit a GPU of
    the assumed 80 GiB, not a 16 GiB TPU, where the scan takes the widest tiles that fit."""
    for name, kwargs in LONG_CALLS.items():
        batch = {
            key: jax.ShapeDtypeStruct((4, 4096), jnp.int32) for key in kwargs if key.endswith("segment_ids")
        }
        kwargs = {
            **kwargs,
            **batch,
            **({"sinks": jax.ShapeDtypeStruct((16,), jnp.float32)} if "sinks" in kwargs else {}),
        }
        dtype = jnp.float32 if name == "float32" else BF16
        inputs = tuple(jax.ShapeDtypeStruct((4, 4096, 16, 128), dtype) for _ in range(3))
        assert select_implementation(*inputs, platform="gpu", **kwargs) != "chunked", name
        assert select_implementation(*inputs, platform="tpu", **kwargs) == "chunked", name


def test_the_scan_on_an_accelerator_takes_the_widest_tiles_that_fit():
    query = jax.ShapeDtypeStruct((1, 32768, 8, 64), jnp.float32)
    block_q, block_k = accelerator_block_sizes(query, query, "tpu")
    per_key = 3 * 4 * 8 * 32768
    assert block_q == 32768 and block_k & (block_k - 1) == 0
    assert per_key * block_k <= ACCELERATOR_BYTES["tpu"] * MATERIALIZE_FRACTION < per_key * block_k * 2
    short = jax.ShapeDtypeStruct((1, 100, 2, 8), jnp.float32)
    assert accelerator_block_sizes(short, short, "gpu") == (100, 100)
