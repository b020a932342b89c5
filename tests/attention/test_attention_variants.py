"""The arguments beyond plain masked attention, on every path, against float64 NumPy.

`local_window_size`, `query_offset` (static and per example), segment ids,
`logits_soft_cap`, sinks and `return_residual`, alone and composed with causal
masks, lengths, a mask and a bias, at T != S, with fully masked rows, windows
longer than the sequence and empty segments: outputs, weights and residuals
against tests/numpy_reference.py, gradients of "chunked" (tiny tiles: several
tiles, overlapping last blocks and skipped tiles) and "xla" against the
reference path's, whose own gradients are checked by finite differences.
Also: that the chunked kernel skips the tiles these arguments rule out
(counted as it runs), the drop-in agreement with jax.nn.dot_product_attention
on the arguments both have, and the errors for bad values.
"""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from jax.test_util import check_grads

from qkv_jax import dot_product_attention, select_implementation
from qkv_jax.attention import chunked, visibility
from qkv_jax.attention.chunked import chunked_attention

F32_OUT_ATOL = 1e-5
F32_GRAD_TOL = dict(atol=2e-5, rtol=1e-4)

# name: (batch, T, S, N, K, arguments). Arrays in the arguments are spelled by name and made by
# `make_case`: "mask" (row 1 of the first example fully masked), "bias" (with a -inf entry),
# "segments" (packed ids, an empty id, an id the keys lack), "lengths".
CASES = {
    "window (2, 1), T < S": ((2,), 5, 8, 4, 2, dict(local_window_size=(2, 1))),
    "window 1, T > S: rows past the keys see none": ((2,), 9, 5, 2, 1, dict(local_window_size=1)),
    "window longer than the sequence, causal": ((2,), 6, 6, 2, 2, dict(local_window_size=50, is_causal=True)),
    "causal window (3, 0), offsets per example": (
        (3,),
        5,
        9,
        4,
        2,
        dict(is_causal=True, local_window_size=(3, 0), query_offset=np.array([4, 0, -2])),
    ),
    "causal, static offset S - T, mask": ((2,), 4, 9, 2, 1, dict(is_causal=True, query_offset=5, mask=True)),
    "segments": ((2,), 7, 9, 4, 2, dict(segments=True)),
    "segments, causal, lengths, mask, bias, 2-d batch": (
        (1, 2),
        6,
        6,
        2,
        2,
        dict(segments=True, is_causal=True, lengths=True, mask=True, bias=True),
    ),
    "soft cap, bias": ((2,), 5, 6, 4, 2, dict(logits_soft_cap=1.5, bias=True)),
    "sinks [N], fully masked rows, lengths": ((2,), 4, 6, 4, 2, dict(sinks=(4,), mask=True, lengths=True)),
    "sinks [B, N], causal window, offsets, segments, soft cap": (
        (2,),
        6,
        8,
        4,
        1,
        dict(
            sinks=(2, 4),
            is_causal=True,
            local_window_size=(2, 0),
            query_offset=np.array([2, 1]),
            segments=True,
            logits_soft_cap=2.0,
        ),
    ),
    "unbatched: window, offset, sinks, bias": (
        (),
        5,
        7,
        2,
        1,
        dict(local_window_size=(1, 2), query_offset=1, sinks=(2,), bias=True),
    ),
}
# Every argument on every path in the fast tier; the other cases with `-m slow`.
FAST_CASES = (
    "window 1, T > S: rows past the keys see none",
    "causal window (3, 0), offsets per example",
    "segments, causal, lengths, mask, bias, 2-d batch",
    "sinks [B, N], causal window, offsets, segments, soft cap",
)
SEGMENTS = {  # per T or S: ids of the first and the second example
    6: [[0, 0, 1, 1, 1, 3], [0, 1, 1, 1, 1, 1]],
    7: [[0, 0, 0, 1, 1, 3, 5], [1, 1, 1, 1, 2, 2, 2]],  # id 5: no key holds it; id 2 absent: empty
    8: [[0, 0, 0, 1, 1, 3, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]],
    9: [[0, 0, 0, 1, 1, 1, 3, 3, 4], [1, 1, 2, 2, 2, 2, 2, 3, 3]],
}


def make_case(name, seed=0, value_depth=6):
    """Query, key, value (float32) and dot_product_attention's keyword arguments of a case."""
    batch, T, S, N, K, arguments = CASES[name]
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(*batch, T, N, 8)).astype(np.float32)
    key = rng.normal(size=(*batch, S, K, 8)).astype(np.float32)
    value = rng.normal(size=(*batch, S, K, value_depth)).astype(np.float32)  # Hv != H unless asked
    rng = np.random.default_rng(seed + 1)  # the arguments do not depend on value_depth
    kwargs = {k: v for k, v in arguments.items() if k not in ("mask", "bias", "segments", "lengths", "sinks")}
    if arguments.get("mask"):
        mask = rng.random((*batch, 1, T, S)) < 0.8
        mask.reshape(-1, T, S)[0, 1] = False
        kwargs["mask"] = mask
    if arguments.get("bias"):
        bias = rng.normal(size=(N, T, S)).astype(np.float32)
        bias[0, 0, 1] = -np.inf
        kwargs["bias"] = bias
    if arguments.get("segments"):
        ids = {n: np.array(SEGMENTS[n][: int(np.prod(batch))]).reshape(*batch, n) for n in (T, S)}
        kwargs.update(query_segment_ids=ids[T], key_segment_ids=ids[S])
    if arguments.get("lengths"):
        examples = int(np.prod(batch))
        kwargs["query_seq_lengths"] = np.array([T, T - 2, 1][:examples]).reshape(batch)
        kwargs["key_value_seq_lengths"] = np.array([S - 1, 0, S][:examples]).reshape(batch)
    if "sinks" in arguments:
        kwargs["sinks"] = rng.normal(size=arguments["sinks"]).astype(np.float32)
    return query, key, value, kwargs


def numpy_answer(query, key, value, kwargs):
    """(output, weights, residual) of float64 NumPy for the case's arguments."""
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    allowed = ref.allowed_pairs(
        tuple(batch),
        N,
        T,
        S,
        mask=kwargs.get("mask"),
        is_causal=kwargs.get("is_causal", False),
        window=visibility.window_pair(kwargs.get("local_window_size"), "test"),
        query_offset=kwargs.get("query_offset", 0),
        query_lengths=kwargs.get("query_seq_lengths"),
        key_lengths=kwargs.get("key_value_seq_lengths"),
        query_segments=kwargs.get("query_segment_ids"),
        key_segments=kwargs.get("key_segment_ids"),
    )
    return ref.attention_full(
        query,
        key,
        value,
        allowed,
        kwargs.get("bias"),
        soft_cap=kwargs.get("logits_soft_cap"),
        sinks=kwargs.get("sinks"),
    )


def jax_nn_features_only(kwargs) -> bool:
    return "logits_soft_cap" not in kwargs and "sinks" not in kwargs


def tiled(query, key, value, bias=None, mask=None, **kwargs):
    """The chunked kernel with 2 x 3 tiles, through its own entry point."""
    return chunked_attention(query, key, value, bias, mask, block_q=2, block_k=3, **kwargs)


PATHS = ["reference", "chunked 2x3 tiles", "xla"]


def with_slow(names, fast):
    """`names` as pytest parameters, those not in `fast` marked slow."""
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


def attend_fn(path):
    if path == "chunked 2x3 tiles":
        return tiled
    return functools.partial(dot_product_attention, implementation=path)


def check_residual(got, want):
    """Equal where finite; -inf exactly where the reference's row has no mass."""
    got = np.asarray(got)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], atol=F32_OUT_ATOL)


@functools.cache
def results_fn(path, case):
    """One jitted function per path and case: the output, the residual, and the gradients of a
    fixed loss of the output w.r.t. query, key, value, and the bias and sinks when given."""
    _, _, _, kwargs = make_case(case)
    differentiable = sorted(k for k in ("bias", "sinks") if k in kwargs)
    static = {k: v for k, v in kwargs.items() if k not in differentiable}  # compiled in

    def loss(query, key, value, arrays):
        output, residual = attend_fn(path)(query, key, value, return_residual=True, **static, **arrays)
        return jnp.sum(jnp.sin(output)), (output, residual)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    return lambda query, key, value, kwargs: grad(query, key, value, {k: kwargs[k] for k in differentiable})


@pytest.mark.parametrize("case", with_slow(CASES, FAST_CASES))
@pytest.mark.parametrize("path", PATHS)
def test_outputs_residuals_and_gradients(path, case):
    """Outputs and residuals against float64 NumPy; gradients against the reference path's."""
    query, key, value, kwargs = make_case(case, value_depth=8 if path == "xla" else 6)  # jax.nn: Hv = H
    if path == "xla" and not jax_nn_features_only(kwargs):
        pytest.skip("jax.nn has no soft cap and no sinks (test_xla_refuses_soft_cap_and_sinks)")
    want, want_weights, want_residual = numpy_answer(query, key, value, kwargs)
    grads, (output, residual) = results_fn(path, case)(query, key, value, kwargs)
    assert output.shape == want.shape and residual.shape == want_residual.shape
    np.testing.assert_allclose(output, want, atol=F32_OUT_ATOL)
    check_residual(residual, want_residual)
    if path == "reference":
        _, weights = dot_product_attention(
            query, key, value, implementation=path, return_weights=True, **kwargs
        )
        np.testing.assert_allclose(weights, want_weights, atol=F32_OUT_ATOL)
        return
    expected, _ = results_fn("reference", case)(query, key, value, kwargs)
    names = ["query", "key", "value", *sorted(k for k in ("bias", "sinks") if k in kwargs)]
    for g, e, name in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), names, strict=True):
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL, err_msg=name)


@pytest.mark.parametrize(
    "case",
    [
        "segments, causal, lengths, mask, bias, 2-d batch",
        "sinks [B, N], causal window, offsets, segments, soft cap",
    ],
)
def test_the_default_chunked_tiles_through_dot_product_attention(case):
    query, key, value, kwargs = make_case(case)
    want, _, want_residual = numpy_answer(query, key, value, kwargs)
    output, residual = dot_product_attention(
        query, key, value, implementation="chunked", return_residual=True, **kwargs
    )
    np.testing.assert_allclose(output, want, atol=F32_OUT_ATOL)
    check_residual(residual, want_residual)


def test_reference_gradients_by_finite_differences():
    """The reference path's own gradients (forward and reverse mode) in float64, sinks and soft
    cap included, with fully masked rows, segments and a window."""
    query, key, value, kwargs = make_case("sinks [B, N], causal window, offsets, segments, soft cap")
    sinks = kwargs.pop("sinks")
    bias = np.random.default_rng(1).normal(size=(4, 6, 8))
    # int32 ids and offsets: int64 NumPy arrays met jit's cache across the x64 switch
    # ("expected parameter of s64[2] but got s32[2]").
    kwargs = {k: v.astype(np.int32) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}

    def attend(q, k, v, b, s):
        return dot_product_attention(q, k, v, b, implementation="reference", **kwargs, sinks=s)

    with jax.enable_x64(True):
        args = tuple(np.asarray(x, np.float64) for x in (query, key, value, bias, sinks))
        check_grads(attend, args, order=1, modes=["fwd", "rev"], eps=1e-5)


@pytest.mark.slow  # the chunked path's gradients equal the reference path's in the fast tier
def test_chunked_gradients_by_finite_differences():
    query, key, value, kwargs = make_case("unbatched: window, offset, sinks, bias")
    bias, sinks = kwargs.pop("bias"), kwargs.pop("sinks")
    bias = np.where(np.isfinite(bias), bias, -1.0)  # finite differences need finite logits

    @jax.jit
    def attend(q, k, v, b, s):
        return tiled(q, k, v, b, logits_soft_cap=1.0, sinks=s, **kwargs)

    with jax.enable_x64(True):
        args = tuple(np.asarray(x, np.float64) for x in (query, key, value, bias, sinks))
        check_grads(attend, args, order=1, modes=["rev"], eps=1e-5)


def test_sinks_take_the_mass_of_rows_without_keys():
    """A row that sees no key puts all its weight on the sink: zero output, zero weights, the
    sink's logit as residual; a row that sees keys gives them 1 - its sink's weight."""
    query, key, value, kwargs = make_case("sinks [N], fully masked rows, lengths")
    output, residual, weights = dot_product_attention(
        query, key, value, implementation="reference", return_residual=True, return_weights=True, **kwargs
    )
    empty = ~np.asarray(weights).any(axis=-1)  # (B, N, T)
    assert empty.any() and not empty.all()
    np.testing.assert_array_equal(np.swapaxes(np.asarray(output), 1, 2)[empty], 0.0)
    sink_logit = np.broadcast_to(kwargs["sinks"][None, :, None], empty.shape)
    np.testing.assert_allclose(np.swapaxes(np.asarray(residual), 1, 2)[empty], sink_logit[empty], atol=1e-6)
    sink_weight = np.exp(sink_logit - np.swapaxes(np.asarray(residual), 1, 2))  # (B, N, T)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0 - sink_weight, atol=1e-6)


def test_return_order_and_traced_offset_under_jit_and_vmap():
    """(output, residual, weights) in that order; an offset traced under jit (a KV cache's fill
    index) and mapped by vmap gives the per-example answer."""
    query, key, value, _ = make_case("causal window (3, 0), offsets per example")
    offsets = np.array([4, 0, -2])

    @jax.jit
    def decode(q, k, v, offset):
        return dot_product_attention(q, k, v, is_causal=True, query_offset=offset, return_residual=True)

    output, residual = decode(query, key, value, offsets)
    mapped, mapped_residual = jax.vmap(decode)(query, key, value, offsets)
    want, _, want_residual = numpy_answer(query, key, value, dict(is_causal=True, query_offset=offsets))
    for got in (output, mapped):
        np.testing.assert_allclose(got, want, atol=F32_OUT_ATOL)
    for got in (residual, mapped_residual):
        check_residual(got, want_residual)
    result = dot_product_attention(
        query, key, value, is_causal=True, query_offset=offsets, return_residual=True, return_weights=True
    )
    assert [x.shape for x in result] == [want.shape, want_residual.shape, (3, 4, 5, 9)]


# ----------------------------------------------------------------------------- tiles skipped


def live_tiles(allowed, block_q, block_k):
    """How many (query block, key block) tiles hold an allowed pair in some example or head."""
    any_pair = allowed.reshape(-1, *allowed.shape[-2:]).any(axis=0)  # (T, S)
    T, S = any_pair.shape
    return sum(
        any_pair[i : i + block_q, j : j + block_k].any()
        for i in range(0, T, block_q)
        for j in range(0, S, block_k)
    )


def count_tiles(monkeypatch, function, *args):
    """Tiles the chunked kernel computes while `function(*args)` runs (forward tiles and the
    backward pass's recomputed ones): a host callback in every tile's logits, at run time."""
    counted = []
    original = chunked._tile_logits

    def counting(*tile_args, **tile_kwargs):
        jax.debug.callback(lambda: counted.append(1))
        return original(*tile_args, **tile_kwargs)

    monkeypatch.setattr(chunked, "_tile_logits", counting)
    jax.block_until_ready(jax.jit(function)(*args))
    jax.effects_barrier()
    monkeypatch.undo()
    return len(counted)


# name: (T, S, arguments); blocks of 8 x 8, batch 2, N = K = 1.
SKIPPING = {
    "none": (64, 64, {}),
    "causal": (64, 64, dict(is_causal=True)),
    "causal window (8, 0)": (64, 64, dict(is_causal=True, local_window_size=(8, 0))),
    "causal window (8, 0), T 128": (128, 128, dict(is_causal=True, local_window_size=(8, 0))),
    "window (5, 3), offset S - T": (32, 64, dict(local_window_size=(5, 3), query_offset=32)),
    "causal window (5, 0), offsets per example": (
        32,
        64,
        dict(is_causal=True, local_window_size=(5, 0), query_offset=np.array([32, 24])),
    ),
    "lengths": (64, 64, dict(key_value_seq_lengths=np.array([20, 33]), query_seq_lengths=np.array([40, 40]))),
    "packed segments": (64, 64, dict(segments=[0] * 12 + [1] * 20 + [2] * 9 + [3] * 23)),
}


@pytest.mark.parametrize("case", with_slow(SKIPPING, set(SKIPPING) - {"none", "causal window (8, 0)"}))
def test_chunked_computes_only_the_tiles_it_needs(monkeypatch, case):
    """Forward and backward, the kernel computes exactly the tiles that hold a pair some query
    may attend: cost T x window under a window, not T x S."""
    T, S, arguments = SKIPPING[case]
    kwargs = dict(arguments)
    if "segments" in kwargs:
        ids = np.array(kwargs.pop("segments"))
        kwargs.update(query_segment_ids=ids, key_segment_ids=ids)
    rng = np.random.default_rng(5)
    query, key, value = (rng.normal(size=(2, n, 1, 8)).astype(np.float32) for n in (T, S, S))
    attend = functools.partial(chunked_attention, block_q=8, block_k=8, **kwargs)
    allowed = ref.allowed_pairs(
        (2,),
        1,
        T,
        S,
        is_causal=kwargs.get("is_causal", False),
        window=kwargs.get("local_window_size"),
        query_offset=kwargs.get("query_offset", 0),
        query_lengths=kwargs.get("query_seq_lengths"),
        key_lengths=kwargs.get("key_value_seq_lengths"),
        query_segments=kwargs.get("query_segment_ids"),
        key_segments=kwargs.get("key_segment_ids"),
    )
    live = live_tiles(allowed, 8, 8)
    assert count_tiles(monkeypatch, attend, query, key, value) == live
    gradient = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
    assert count_tiles(monkeypatch, gradient, query, key, value) == 2 * live  # forward, then backward
    if case == "causal window (8, 0), T 128":
        assert live == 2 * 128 // 8 - 1  # two key blocks per query block: linear in T
    elif case == "causal":
        assert live == 8 * 9 // 2


# ----------------------------------------------------------------------------- drop-in for jax.nn

# (T, S, N, K, jax.nn keyword arguments, with bias and mask): calls that leave no row without
# keys (jax.nn gives such a row the mean of the values, qkv_jax zeros).
DROP_IN = {
    "causal T < S": (5, 8, 4, 2, dict(is_causal=True)),
    "causal T > S, bias, mask": (8, 5, 4, 4, dict(is_causal=True, bias=True, mask=True)),
    "window 2": (6, 6, 2, 1, dict(local_window_size=2)),
    "causal window (3, 1), T > S": (7, 5, 2, 2, dict(is_causal=True, local_window_size=(3, 1))),
    "lengths, causal, window (4, 0)": (
        6,
        7,
        2,
        2,
        dict(is_causal=True, local_window_size=(4, 0), lengths=True),
    ),
}


@pytest.mark.parametrize("case", DROP_IN)
@pytest.mark.parametrize("implementation", with_slow(["reference", "xla", "chunked"], {"chunked"}))
def test_drop_in_for_jax_nn(implementation, case):
    """The same positional call (query, key, value, bias, mask) and keywords give jax.nn's
    output, residual and gradients."""
    T, S, N, K, arguments = DROP_IN[case]
    rng = np.random.default_rng(7)
    query = rng.normal(size=(2, T, N, 8)).astype(np.float32)
    key, value = (rng.normal(size=(2, S, K, 8)).astype(np.float32) for _ in range(2))
    bias = rng.normal(size=(1, N, T, S)).astype(np.float32) if arguments.get("bias") else None
    mask = (
        np.tril(np.ones((T, S), bool))[None, None] | (rng.random((2, 1, T, S)) < 0.5)
        if arguments.get("mask")
        else None
    )
    kwargs = {k: v for k, v in arguments.items() if k not in ("bias", "mask", "lengths")}
    if arguments.get("lengths"):
        kwargs.update(
            query_seq_lengths=np.array([T, 3], np.int32), key_value_seq_lengths=np.array([S, 4], np.int32)
        )
    ours = functools.partial(dot_product_attention, implementation=implementation, query_offset=0, **kwargs)
    theirs = functools.partial(jax.nn.dot_product_attention, **kwargs)

    def run(attend, q, k, v, b):
        output, residual = attend(q, k, v, b, mask, return_residual=True)
        return jnp.sum(jnp.sin(output)), (output, residual)

    grads, (output, residual) = jax.jit(jax.grad(functools.partial(run, ours), (0, 1, 2, 3), has_aux=True))(
        query, key, value, bias
    )
    want_grads, (want, want_residual) = jax.jit(
        jax.grad(functools.partial(run, theirs), (0, 1, 2, 3), has_aux=True)
    )(query, key, value, bias)
    np.testing.assert_allclose(output, want, atol=F32_OUT_ATOL)
    padded = np.zeros((2, T, 1), bool)
    if "query_seq_lengths" in kwargs:
        padded = (np.arange(T) >= kwargs["query_seq_lengths"][:, None])[..., None]
    np.testing.assert_array_equal(np.isneginf(residual), np.broadcast_to(padded, residual.shape))
    np.testing.assert_allclose(
        np.where(padded, 0, residual), np.where(padded, 0, want_residual), atol=F32_OUT_ATOL
    )
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN may be there")
def test_cudnn_without_a_gpu_raises_what_jax_nn_raises():
    x = np.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(Exception) as theirs:
        jax.nn.dot_product_attention(x, x, x, implementation="cudnn")
    with pytest.raises(type(theirs.value)) as ours:
        dot_product_attention(x, x, x, implementation="cudnn")
    assert str(ours.value).startswith(str(theirs.value).split("\n")[0])


# ----------------------------------------------------------------------------- dispatch and errors


def test_xla_refuses_soft_cap_and_sinks():
    x = np.ones((2, 4, 2, 8), np.float32)
    for implementation in ("xla", "cudnn"):
        with pytest.raises(ValueError, match=f"implementation='{implementation}' has no logits_soft_cap"):
            dot_product_attention(x, x, x, implementation=implementation, logits_soft_cap=5.0)
        with pytest.raises(ValueError, match=f"implementation='{implementation}' has no sinks"):
            dot_product_attention(x, x, x, implementation=implementation, sinks=np.zeros(2, np.float32))


BF16 = jnp.bfloat16
GPU_SHAPES = tuple(jax.ShapeDtypeStruct(s, BF16) for s in ((2, 64, 4, 64), (2, 64, 2, 64), (2, 64, 2, 64)))
CPU_SHORT = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 8, 4, 8), (2, 8, 2, 8), (2, 8, 2, 8)))
SEGMENT_IDS = jax.ShapeDtypeStruct((2, 64), jnp.int32)
NEW_ARGUMENT_SELECTIONS = [
    ("gpu window: not yet checked on cuDNN", GPU_SHAPES, dict(local_window_size=(16, 0)), "gpu", "xla"),
    (
        "gpu segments: not yet checked on cuDNN",
        GPU_SHAPES,
        dict(query_segment_ids=SEGMENT_IDS, key_segment_ids=SEGMENT_IDS),
        "gpu",
        "xla",
    ),
    ("gpu soft cap", GPU_SHAPES, dict(logits_soft_cap=30.0), "gpu", "reference"),
    ("gpu sinks", GPU_SHAPES, dict(sinks=jax.ShapeDtypeStruct((4,), jnp.float32)), "gpu", "reference"),
    ("gpu causal, offset 0", GPU_SHAPES, dict(is_causal=True, query_offset=0), "gpu", "cudnn"),
    ("gpu causal, offset as a bias", GPU_SHAPES, dict(is_causal=True, query_offset=3), "gpu", "cudnn"),
    ("gpu short window", CPU_SHORT, dict(local_window_size=2), "gpu", "xla"),
    ("gpu short soft cap", CPU_SHORT, dict(logits_soft_cap=30.0), "gpu", "reference"),
    ("cpu short sinks", CPU_SHORT, dict(sinks=jax.ShapeDtypeStruct((4,), jnp.float32)), "cpu", "reference"),
]


@pytest.mark.parametrize(
    "inputs,kwargs,platform,expected",
    [s[1:] for s in NEW_ARGUMENT_SELECTIONS],
    ids=[s[0] for s in NEW_ARGUMENT_SELECTIONS],
)
def test_select_implementation_with_the_new_arguments(inputs, kwargs, platform, expected):
    assert select_implementation(*inputs, platform=platform, **kwargs) == expected


X = np.ones((2, 4, 2, 8), np.float32)
BAD_VALUES = [
    (dict(local_window_size=(1, 2, 3)), "local_window_size must be None, an int or a pair of ints"),
    (dict(local_window_size=1.5), "local_window_size must be None, an int or a pair of ints"),
    (dict(query_offset=np.array([0.5, 1.0])), "query_offset must be integers"),
    (
        dict(query_offset=np.array([1, 2, 3])),
        "query_offset of shape (3,) does not broadcast to the batch dims (2,)",
    ),
    (dict(query_segment_ids=np.zeros((2, 4), np.int32)), "must be given together, got an array and None"),
    (
        dict(query_segment_ids=np.zeros((2, 4), np.int32), key_segment_ids=np.zeros((2, 5), np.int32)),
        "key_segment_ids of shape (2, 5) does not broadcast to [batch..., S] = (2, 4)",
    ),
    (
        dict(query_segment_ids=np.zeros((2, 4)), key_segment_ids=np.zeros((2, 4))),
        "query_segment_ids must be integers",
    ),
    (dict(sinks=np.zeros(2, np.int32)), "sinks must be floating point"),
    (dict(sinks=np.zeros(3, np.float32)), "sinks of shape (3,) does not broadcast to [batch..., N] = (2, 2)"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap must be None or a positive number, got 0.0"),
    (dict(logits_soft_cap=np.ones(2)), "logits_soft_cap must be None or a positive number"),
]


@pytest.mark.parametrize("override,message", BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_bad_values_of_the_new_arguments_raise(override, message):
    with pytest.raises((ValueError, TypeError)) as info:
        dot_product_attention(X, X, X, **override)
    assert message in str(info.value)


def test_jax_nn_signature_then_the_extras():
    """jax.nn's parameters first, in its order, of its kinds and defaults (bias, mask
    positional); qkv_jax's own after them, keyword-only."""
    ours = inspect.signature(dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, parameter in theirs.items():
        assert (ours[name].kind, ours[name].default) == (parameter.kind, parameter.default), name
    extras = list(ours.values())[len(theirs) :]
    assert extras and all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in extras)
    query, key, value, kwargs = make_case("segments, causal, lengths, mask, bias, 2-d batch")
    bias, mask = kwargs.pop("bias"), kwargs.pop("mask")
    positional = dot_product_attention(query, key, value, bias, mask, **kwargs)
    np.testing.assert_array_equal(
        positional, dot_product_attention(query, key, value, mask=mask, bias=bias, **kwargs)
    )
