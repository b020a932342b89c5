"""implementation="splash" (jax's splash attention, Pallas Mosaic TPU) against the reference path.

On CPU the kernels run in Pallas' interpret mode, which compiles slowly (seconds a case), so
each case combines several options and checks outputs and gradients (query, key, value and
sinks) from one compiled program per path; T and S are tiny (splash's blocks are padded to 128
inside the wrapper), except in the case that spans several key blocks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkv_jax import dot_product_attention
from qkv_jax.attention import select_implementation

F32_TOL = dict(atol=2e-5, rtol=1e-4)  # float32 against the float32 reference path
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # bfloat16 against float32 on the same rounded inputs

# name: (batch, T, S, N, K, H, Hv, dtype, options); "segments": each example's query and key
# ids, "sinks", "lengths": (query lengths, key lengths) per example.
CASES = {
    # GQA, causal with an offset and T != S, packed (example 1's query segment 2 has no key:
    # its rows see nothing), sinks.
    "gqa-causal-offset-packed-sinks": (
        (2,),
        5,
        7,
        4,
        2,
        8,
        8,
        jnp.float32,
        dict(
            is_causal=True,
            query_offset=2,
            segments=([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]]),
            sinks=True,
        ),
    ),
    # MQA, a left window under the causal triangle, soft cap, padded queries and keys, bfloat16
    # (float32 sinks).
    "mqa-left-window-soft-cap-lengths-bf16": (
        (2,),
        6,
        6,
        2,
        1,
        8,
        8,
        jnp.bfloat16,
        dict(
            is_causal=True,
            local_window_size=(2, 0),
            logits_soft_cap=1.5,
            lengths=([6, 4], [5, 6]),
            sinks=True,
        ),
    ),
    # Two batch dims, a two-sided window whose negative offset leaves queries 0 and 1 without
    # keys (no sinks), value depth unequal to the query's, a static scale.
    "two-sided-window-empty-rows-mla": (
        (1, 2),
        4,
        9,
        2,
        2,
        8,
        4,
        jnp.float32,
        dict(local_window_size=(1, 2), query_offset=-4, scale=0.5),
    ),
    # Several query and key blocks (T 130 -> 256, S 300 -> 384 in 3 blocks), no static mask,
    # packed with key lengths (the padded keys get an id no query has), sinks.
    "blocks-packed-lengths-sinks": (
        (1,),
        130,
        300,
        2,
        1,
        8,
        8,
        jnp.float32,
        dict(segments=([[0] * 60 + [1] * 70], [[0] * 100 + [1] * 200]), lengths=([130], [250]), sinks=True),
    ),
}


def case_inputs(name):
    """`(differentiable arrays, other keywords)` of one case, in the case's dtype."""
    batch, T, S, N, K, H, Hv, dtype, options = CASES[name]
    rng = np.random.default_rng(0)
    arrays = dict(
        query=rng.normal(size=(*batch, T, N, H)),
        key=rng.normal(size=(*batch, S, K, H)),
        value=rng.normal(size=(*batch, S, K, Hv)),
    )
    arrays = {name: jnp.asarray(x, dtype) for name, x in arrays.items()}
    if options.get("sinks"):
        arrays["sinks"] = jnp.asarray(rng.normal(size=(*batch, N)), jnp.float32)  # parameters in float32
    statics = ("is_causal", "query_offset", "local_window_size", "logits_soft_cap", "scale")
    keywords = {k: options[k] for k in statics if k in options}
    if "segments" in options:
        query_ids, key_ids = (np.asarray(ids, np.int32).reshape(*batch, -1) for ids in options["segments"])
        keywords.update(query_segment_ids=query_ids, key_segment_ids=key_ids)
    if "lengths" in options:
        query_lengths, key_lengths = (np.asarray(n, np.int32).reshape(batch) for n in options["lengths"])
        keywords.update(query_seq_lengths=query_lengths, key_value_seq_lengths=key_lengths)
    return arrays, keywords


@functools.cache
def outputs_and_gradients(name, implementation, as_float32=False):
    """The output and the gradients of `sum(sin(output))` w.r.t. the case's arrays, as float32, and
    the gradients' dtypes."""
    arrays, keywords = case_inputs(name)
    if as_float32:
        arrays = {k: x.astype(jnp.float32) for k, x in arrays.items()}

    def loss(arrays):
        out = dot_product_attention(**arrays, **keywords, implementation=implementation)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out  # uneven weights on every output entry

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(arrays)
    dtypes = {k: g.dtype for k, g in grads.items()}
    return np.asarray(out, np.float32), {k: np.asarray(g, np.float32) for k, g in grads.items()}, dtypes


@pytest.fixture(scope="module")
def reference():
    """The reference path's outputs and gradients per case, in float32 (on inputs rounded to the
    case's dtype)."""
    return lambda name: outputs_and_gradients(name, "reference", as_float32=True)


@pytest.mark.parametrize("name", CASES)
def test_splash_matches_the_reference_path(name, reference):
    out, grads, dtypes = outputs_and_gradients(name, "splash")
    want, want_grads, _ = reference(name)
    assert dtypes == {k: x.dtype for k, x in case_inputs(name)[0].items()}
    tolerance = F32_TOL if CASES[name][7] == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(out, want, **tolerance)
    for array in want_grads:
        assert np.isfinite(grads[array]).all(), array
        np.testing.assert_allclose(grads[array], want_grads[array], **tolerance, err_msg=array)
    rows_without_keys = np.abs(want).max(axis=(-2, -1)) == 0  # (batch..., T)
    np.testing.assert_array_equal(out[rows_without_keys], 0.0)


@pytest.mark.slow
def test_the_cases_reach_rows_without_keys(reference):
    """The splash test's zero-row check meets rows that see no key (where splash alone would
    average the values) in the packed and the window cases."""
    for name in ("gqa-causal-offset-packed-sinks", "two-sided-window-empty-rows-mla"):
        out, _, _ = reference(name)
        assert (np.abs(out).max(axis=(-2, -1)) == 0).any(), name


REFUSED = [
    pytest.param(dict(bias=np.zeros((4, 5, 7), np.float32)), "has no bias", id="bias"),
    pytest.param(dict(mask=np.ones((5, 7), bool)), "has no mask", id="mask"),
    pytest.param(dict(query_offset=jnp.asarray([1, 2])), "static query_offset only", id="traced offset"),
    pytest.param(dict(return_residual=True), "does not return the residual", id="residual"),
    pytest.param(dict(precision="highest"), "takes no matmul precision", id="precision"),
    pytest.param(dict(dtype=jnp.float16), "float32 and bfloat16 only, got float16", id="float16"),
    pytest.param(dict(return_weights=True), "cannot return attention weights", id="weights"),
]


@pytest.mark.parametrize("override,message", REFUSED)
def test_splash_refuses_what_it_cannot_compute_in_one_line(override, message):
    dtype = override.pop("dtype", jnp.float32)
    query, key = jnp.ones((2, 5, 4, 8), dtype), jnp.ones((2, 7, 2, 8), dtype)
    with pytest.raises(ValueError) as info:
        dot_product_attention(query, key, key, implementation="splash", **override)
    assert str(info.value).startswith("dot_product_attention: implementation='splash' ")
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_the_rule_never_chooses_splash(platform):
    query = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    for keywords in (
        dict(is_causal=True, local_window_size=(1024, 0)),
        dict(query_segment_ids=ids, key_segment_ids=ids, logits_soft_cap=30.0),
        dict(sinks=jax.ShapeDtypeStruct((8,), jnp.float32)),
    ):
        assert select_implementation(query, query, query, platform=platform, **keywords) != "splash"
