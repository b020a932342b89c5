"""Padding by sequence lengths on every path, and the "cudnn" path as a GPU runs it, on CPU.

Lengths (jax.nn's `query_seq_lengths` / `key_value_seq_lengths`) must give the
float64 NumPy answer with the equivalent mask, in outputs and gradients, on
every path. The GPU route is checked without a GPU: `jax.default_backend` is
made to say "gpu" and `jax.nn.dot_product_attention` is replaced by a stand-in
that asserts what jax's cuDNN wrapper requires of its arguments (read from
jax/_src/cudnn/fused_attention_stablehlo.py: one bf16/fp16 dtype, a bias
`[B|1, N|1, T, S]` in that dtype, int32 lengths `[B]`, a static scale, even T
and S with a bias, a window only of the kinds jax.nn passes on to cuDNN), then
computes with jax.nn's "xla" kernel, whose causal mask and window mean what
jax.nn's "cudnn" is documented to mean. What cuDNN itself computes is checked
on a GPU by benchmarks/gpu_check.sh.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

from qkv_jax import dot_product_attention, select_implementation
from qkv_jax.attention.chunked import chunked_attention

F32_OUT_ATOL = 1e-5
F32_GRAD_TOL = dict(atol=2e-5, rtol=1e-4)
BF16_TOL = 2e-2  # bf16 path against float32 on the same rounded inputs

# (batch, T, S, N, K, H, query lengths, key lengths, is_causal, with mask and bias)
LENGTH_CASES = {
    "both, a zero query length": ((3,), 5, 6, 4, 2, 8, [5, 2, 0], [6, 3, 4], False, False),
    "keys only, causal T<S, a zero key length": ((3,), 4, 7, 2, 1, 8, None, [7, 0, 2], True, False),
    "queries only, causal": ((2,), 6, 6, 2, 2, 8, [3, 6], None, True, False),
    "with mask and bias, 2-d batch": ((1, 2), 4, 4, 2, 2, 8, [[4, 1]], [[2, 4]], False, True),
}


def lengths_inputs(case, seed=0):
    batch, T, S, N, K, H, q_lengths, k_lengths, is_causal, masked = case
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(*batch, T, N, H)).astype(np.float32)
    key = rng.normal(size=(*batch, S, K, H)).astype(np.float32)
    value = rng.normal(size=(*batch, S, K, H)).astype(np.float32)
    mask = rng.random((*batch, 1, T, S)) < 0.8 if masked else None
    bias = rng.normal(size=(N, T, S)).astype(np.float32) if masked else None
    lengths = dict(
        query_seq_lengths=None if q_lengths is None else np.array(q_lengths),
        key_value_seq_lengths=None if k_lengths is None else np.array(k_lengths),
    )
    return query, key, value, mask, bias, is_causal, lengths


def equivalent_mask(T, S, mask, is_causal, query_seq_lengths, key_value_seq_lengths):
    """The boolean `[batch..., 1, T, S]` mask the lengths stand for, in NumPy."""
    full = np.ones((1, T, S), bool)
    if query_seq_lengths is not None:
        full = full & (np.arange(T)[:, None] < query_seq_lengths[..., None, None, None])
    if key_value_seq_lengths is not None:
        full = full & (np.arange(S) < key_value_seq_lengths[..., None, None, None])
    if is_causal:
        full = full & ref.causal(T, S)
    return full if mask is None else full & mask


@functools.cache
def grad_fn(implementation, is_causal, with_bias, block=None):
    """Gradients of a fixed loss w.r.t. query, key, value (and bias), jitted once per setting."""

    def loss(query, key, value, bias, mask, lengths):
        if block is None:
            attend = functools.partial(dot_product_attention, implementation=implementation)
        else:  # the chunked kernel with tiny tiles: padding, several blocks, skipped blocks
            attend = functools.partial(chunked_attention, block_q=block[0], block_k=block[1])
        out = attend(query, key, value, mask=mask, bias=bias, is_causal=is_causal, **lengths)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))

    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    return jax.jit(jax.grad(loss, argnums=argnums))


PATHS = ["reference", "xla", "chunked", "chunked 2x3 tiles"]


@pytest.mark.parametrize("case", LENGTH_CASES)
@pytest.mark.parametrize("path", PATHS)
def test_lengths_match_the_equivalent_mask(path, case):
    query, key, value, mask, bias, is_causal, lengths = lengths_inputs(LENGTH_CASES[case])
    T, S = query.shape[-3], key.shape[-3]
    full_mask = equivalent_mask(T, S, mask, is_causal, **lengths)
    want = ref.attention(query, key, value, mask=full_mask, bias=bias)[0]
    block = (2, 3) if path == "chunked 2x3 tiles" else None
    implementation = "chunked" if block else path
    grads = grad_fn(implementation, is_causal, bias is not None, block)
    if block:
        out = jax.jit(functools.partial(chunked_attention, block_q=2, block_k=3, is_causal=is_causal))(
            query, key, value, mask=mask, bias=bias, **lengths
        )
    else:
        out = dot_product_attention(
            query, key, value, mask=mask, bias=bias, is_causal=is_causal, implementation=path, **lengths
        )
    np.testing.assert_allclose(out, want, atol=F32_OUT_ATOL)
    if lengths["query_seq_lengths"] is not None:  # padded queries: zero output
        padded = np.arange(T) >= lengths["query_seq_lengths"][..., None]  # (batch..., T)
        assert (np.asarray(out)[padded] == 0).all()
    got = grads(query, key, value, bias, mask, lengths)
    no_lengths = dict(query_seq_lengths=None, key_value_seq_lengths=None)
    expected = grad_fn("reference", False, bias is not None)(query, key, value, bias, full_mask, no_lengths)
    for name, g, e in zip(("query", "key", "value", "bias"), got, expected, strict=False):
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, e, **F32_GRAD_TOL, err_msg=name)


@pytest.mark.parametrize("path", ["xla", "chunked"])
def test_nan_beyond_the_lengths_never_leaks(path):
    query, key, value, _, _, _, lengths = lengths_inputs(LENGTH_CASES["both, a zero query length"])
    bad_key, bad_value = key.copy(), value.copy()
    bad_key[1, 3:] = np.nan  # keys at and after length 3 of example 1
    bad_value[1, 4:, 0, 2] = np.inf
    attend = functools.partial(dot_product_attention, implementation=path, **lengths)
    np.testing.assert_allclose(attend(query, bad_key, bad_value), attend(query, key, value), atol=1e-6)
    grads = grad_fn(path, False, False)(query, bad_key, bad_value, None, None, lengths)
    clean = grad_fn(path, False, False)(query, key, value, None, None, lengths)
    for g, c in zip(grads, clean, strict=True):
        np.testing.assert_allclose(g, c, **F32_GRAD_TOL)


@pytest.mark.parametrize(
    "lengths,message",
    [
        (dict(key_value_seq_lengths=np.array([7, 1])), "key_value_seq_lengths must lie in [0, S=6]"),
        (dict(query_seq_lengths=np.array([-1, 1])), "query_seq_lengths must lie in [0, T=5]"),
        (dict(query_seq_lengths=np.array([1.0, 2.0])), "query_seq_lengths must be integers"),
        (dict(key_value_seq_lengths=np.array([1, 2, 3])), "does not broadcast to the batch dims (2,)"),
    ],
)
def test_bad_lengths_raise(lengths, message):
    query, key, value = np.ones((2, 5, 2, 8), np.float32), np.ones((2, 6, 2, 8)), np.ones((2, 6, 2, 8))
    with pytest.raises((ValueError, TypeError)) as info:
        dot_product_attention(query, key.astype(np.float32), value.astype(np.float32), **lengths)
    assert message in str(info.value)


# ----------------------------------------------------------------------------- the GPU route


class CudnnStandIn:
    """Replaces jax.nn.dot_product_attention: checks cuDNN's preconditions, records the call,
    and computes it with jax.nn's "xla" kernel."""

    def __init__(self, original):
        self.original, self.calls = original, []

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        *,
        scale,
        is_causal,
        implementation,
        local_window_size,
        return_residual,
        **lengths,
    ):
        B, T, N, H = query.shape
        S = key.shape[1]
        assert implementation == "cudnn"
        assert query.dtype == key.dtype == value.dtype and query.dtype in (jnp.bfloat16, jnp.float16)
        assert key.shape == value.shape and H % 8 == 0 and H <= 128
        assert mask is None  # folded into the bias
        assert isinstance(scale, float)  # cuDNN compiles the scale in
        if local_window_size is not None:  # jax.nn passes cuDNN a left window, or one with causal
            left, right = local_window_size
            padded = any(n is not None for n in lengths.values())
            assert left >= 0 and (right == 0 or (is_causal and not padded))
        if bias is not None:
            assert bias.dtype == query.dtype and bias.shape[2:] == (T, S)
            assert bias.shape[0] in (1, B) and bias.shape[1] in (1, N)
            assert T % 2 == 0 and S % 2 == 0  # cuDNN's backward pass with a bias
        for name, value_lengths in lengths.items():
            assert value_lengths is None or (
                value_lengths.dtype == jnp.int32 and value_lengths.shape == (B,)
            ), name
        self.calls.append(
            dict(bias=None if bias is None else bias.shape, is_causal=is_causal, window=local_window_size)
        )
        return self.original(
            query,
            key,
            value,
            bias=bias,
            scale=scale,
            is_causal=is_causal,
            implementation="xla",
            local_window_size=local_window_size,
            return_residual=return_residual,
            **lengths,
        )


@pytest.fixture
def gpu_route(monkeypatch):
    """The "cudnn" path as it runs on a GPU, with `CudnnStandIn` for cuDNN."""
    stand_in = CudnnStandIn(jax.nn.dot_product_attention)
    jax.clear_caches()  # traces made for the CPU must not be reused
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    yield stand_in
    monkeypatch.undo()
    jax.clear_caches()


def bf16_inputs(batch, T, S, N, K, H=8, seed=0):
    rng = np.random.default_rng(seed)
    arrays = [rng.normal(size=(*batch, n, heads, H)) for n, heads in ((T, N), (S, K), (S, K))]
    low = [jnp.asarray(x, jnp.bfloat16) for x in arrays]
    return low, [np.asarray(x, np.float32) for x in low]


# name: (batch, T, S, N, K, arguments) with bf16 inputs and H = 8, every one dispatched to cuDNN.
# "bottom-right": query_offset = S - T, which cuDNN gets as a bias.
GPU_CASES = {
    "causal T == S": ((2,), 6, 6, 4, 2, dict(is_causal=True)),
    "causal T < S": ((2,), 4, 8, 4, 2, dict(is_causal=True)),
    "causal T > S": ((2,), 8, 4, 2, 1, dict(is_causal=True)),
    "causal T < S, bottom-right": ((2,), 4, 8, 4, 2, dict(is_causal=True, bottom_right=True)),
    "mask, a fully masked row": ((2,), 4, 6, 2, 2, dict(mask="random")),
    "bias with -inf": ((2,), 4, 6, 4, 2, dict(bias="random")),
    "lengths, causal": ((3,), 6, 6, 2, 2, dict(is_causal=True, lengths=([6, 3, 2], [6, 0, 5]))),
    "mask + bias + lengths + causal T < S, bottom-right": (
        (2,),
        4,
        6,
        2,
        1,
        dict(mask="random", bias="random", is_causal=True, bottom_right=True, lengths=([4, 2], [5, 6])),
    ),
}


def gpu_case_arguments(batch, T, S, N, arguments, seed=1):
    rng = np.random.default_rng(seed)
    kwargs = dict(is_causal=arguments.get("is_causal", False), query_offset=0)
    if arguments.get("bottom_right"):
        kwargs["query_offset"] = S - T
    if "mask" in arguments:
        mask = rng.random((*batch, 1, T, S)) < 0.7
        mask.reshape(-1, T, S)[0, 1] = False  # a fully masked row
        kwargs["mask"] = mask
    if "bias" in arguments:
        bias = rng.normal(size=(N, T, S)).astype(np.float32)
        bias[0, 2] = -np.inf  # a fully forbidden row of head 0
        bias[1, 0, 1] = -np.inf
        kwargs["bias"] = bias
    if "lengths" in arguments:
        q_lengths, k_lengths = arguments["lengths"]
        kwargs.update(query_seq_lengths=np.array(q_lengths), key_value_seq_lengths=np.array(k_lengths))
    return kwargs


def matches_the_reference(attend, low, rounded, kwargs):
    """`attend`'s bf16 outputs and gradients against the reference path's on the rounded inputs."""

    def loss(attend, query, key, value):
        return jnp.sum(jnp.sin(attend(query, key, value, **kwargs).astype(jnp.float32)))

    reference = functools.partial(dot_product_attention, implementation="reference")
    out = attend(*low, **kwargs)
    assert out.dtype == jnp.bfloat16
    want = reference(*rounded, **kwargs)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=BF16_TOL, rtol=BF16_TOL)
    got = jax.jit(jax.grad(functools.partial(loss, attend), (0, 1, 2)))(*low)
    expected = jax.jit(jax.grad(functools.partial(loss, reference), (0, 1, 2)))(*rounded)
    for name, g, e in zip(("query", "key", "value"), got, expected, strict=True):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all(), name
        np.testing.assert_allclose(g, e, atol=4 * BF16_TOL, rtol=4 * BF16_TOL, err_msg=name)


@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.slow
def test_gpu_route_hands_cudnn_valid_arguments_and_matches_the_reference(gpu_route, case):
    batch, T, S, N, K, arguments = GPU_CASES[case]
    low, rounded = bf16_inputs(batch, T, S, N, K)
    kwargs = gpu_case_arguments(batch, T, S, N, arguments)
    has_bias = "mask" in kwargs or "bias" in kwargs or arguments.get("bottom_right", False)
    selected = select_implementation(
        *low,
        kwargs.get("bias"),
        kwargs.get("mask"),
        is_causal=kwargs["is_causal"],
        query_offset=kwargs["query_offset"],
    )
    assert selected == "cudnn"
    matches_the_reference(functools.partial(dot_product_attention, implementation=None), low, rounded, kwargs)
    assert gpu_route.calls, "cuDNN was not called"
    assert (gpu_route.calls[-1]["bias"] is not None) == has_bias
    assert gpu_route.calls[-1]["is_causal"] == (kwargs["is_causal"] and not arguments.get("bottom_right"))


# name: (T, S, arguments, the window jax.nn gets). select_implementation sends none of these to
# cuDNN (its meaning of windows is not yet checked on a GPU); asked for, "cudnn" hands jax.nn the
# windows it passes on to cuDNN and folds the rest, and segment ids, into the bias.
EXPLICIT_CUDNN = {
    "window (2, 0)": (6, 8, dict(local_window_size=(2, 0)), (2, 0)),
    "causal window (3, 1)": (8, 6, dict(is_causal=True, local_window_size=(3, 1)), (3, 1)),
    "window (1, 2): a bias": (6, 6, dict(local_window_size=(1, 2)), None),
    "causal window (2, 1), lengths: a bias": (
        6,
        6,
        dict(is_causal=True, local_window_size=(2, 1), query_seq_lengths=np.array([6, 4])),
        None,
    ),
    "segments, causal": (
        6,
        6,
        dict(
            is_causal=True,
            query_segment_ids=np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]]),
            key_segment_ids=np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]]),
        ),
        None,
    ),
}


@pytest.mark.parametrize("case", EXPLICIT_CUDNN)
@pytest.mark.slow
def test_explicit_cudnn_with_windows_and_segments(gpu_route, case):
    T, S, kwargs, window = EXPLICIT_CUDNN[case]
    low, rounded = bf16_inputs((2,), T, S, 4, 2)
    assert select_implementation(*low, **{k: v for k, v in kwargs.items() if "lengths" not in k}) != "cudnn"
    matches_the_reference(
        functools.partial(dot_product_attention, implementation="cudnn"), low, rounded, kwargs
    )
    assert gpu_route.calls[-1]["window"] == window
    assert (gpu_route.calls[-1]["bias"] is not None) == (window is None)


# name: (arguments, (is_causal, window) jax.nn gets for cuDNN). cuDNN applies a window's right
# bound only through its causal mask: a window (left, 0) without one would attend future keys,
# so it goes as is_causal=True with the window (the same keys). A window with a right bound > 0
# and no causal mask, or at an offset, becomes the bias.
CUDNN_WINDOWS = {
    "(2, 0)": (dict(local_window_size=(2, 0)), (True, (2, 0))),
    "(2, 0), causal": (dict(local_window_size=(2, 0), is_causal=True), (True, (2, 0))),
    "(2, 0), key lengths": (
        dict(local_window_size=(2, 0), key_value_seq_lengths=np.array([6, 3])),
        (True, (2, 0)),
    ),
    "(2, 1)": (dict(local_window_size=(2, 1)), (False, None)),
    "(2, 1), causal": (dict(local_window_size=(2, 1), is_causal=True), (True, (2, 1))),
    "(3, -1), causal: the window a bias": (dict(local_window_size=(3, -1), is_causal=True), (True, None)),
    "(2, 0), query_offset 2": (dict(local_window_size=(2, 0), query_offset=2), (False, None)),
    "(2, 1), causal, query_offset 2": (
        dict(local_window_size=(2, 1), is_causal=True, query_offset=2),
        (False, None),
    ),
}


@pytest.mark.parametrize("case", CUDNN_WINDOWS)
def test_cudnn_gets_windows_only_with_their_causal_mask(gpu_route, case):
    kwargs, (is_causal, window) = CUDNN_WINDOWS[case]
    low, rounded = bf16_inputs((2,), 6, 6, 2, 1)
    out = dot_product_attention(*low, implementation="cudnn", **kwargs)
    assert gpu_route.calls, "cuDNN was not called"
    for call in gpu_route.calls:  # the kernel's call, and those of the branch that fixes NaN
        assert (call["is_causal"], call["window"]) == (is_causal, window)
        assert (call["bias"] is not None) == (window is None)
    want = dot_product_attention(*rounded, implementation="reference", **kwargs)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=BF16_TOL, rtol=BF16_TOL)


def test_gpu_route_keeps_masked_nan_out_and_zeroes_empty_rows(gpu_route):
    batch, T, S, N, K, arguments = GPU_CASES["mask + bias + lengths + causal T < S, bottom-right"]
    (query, key, value), rounded = bf16_inputs(batch, T, S, N, K)
    kwargs = gpu_case_arguments(batch, T, S, N, arguments)  # key lengths 5 and 6

    def attend(key):
        return np.asarray(dot_product_attention(query, key, value, **kwargs), np.float32)

    clean = attend(key)
    np.testing.assert_array_equal(clean[0, 1], 0.0)  # the fully masked row
    np.testing.assert_array_equal(clean[:, 2, 0], 0.0)  # the -inf bias row of head 0
    np.testing.assert_array_equal(attend(key.at[0, 5].set(jnp.nan)), clean)  # beyond key length 5
    attended = key.at[1, 0].set(jnp.nan)  # within key length 6, attended by some queries
    want = dot_product_attention(
        rounded[0], np.asarray(attended, np.float32), rounded[2], implementation="reference", **kwargs
    )
    assert np.isnan(want).any() and np.isfinite(want).any()
    np.testing.assert_allclose(attend(attended), want, atol=BF16_TOL, rtol=BF16_TOL)  # NaN where want is


# ----------------------------------------------------------------------------- no overhead


def primitives(jaxpr) -> list[str]:
    return [str(eqn.primitive) for eqn in jaxpr.eqns]


def test_the_finite_case_runs_jax_nn_alone_after_one_check():
    """Around jax.nn's own program, the default path adds only a finiteness check of K and V
    and a conditional: no copies, casts, scaling or masking of Q, K, V or the output."""
    query = jax.ShapeDtypeStruct((2, 8, 4, 8), jnp.float32)
    key = jax.ShapeDtypeStruct((2, 8, 2, 8), jnp.float32)
    ours = jax.make_jaxpr(functools.partial(dot_product_attention, is_causal=True, implementation="xla"))
    (call,) = ours(query, key, key).jaxpr.eqns  # the jitted function
    (guard,) = call.params["jaxpr"].jaxpr.eqns  # nothing outside the custom VJP
    inner = guard.params["call_jaxpr"].jaxpr
    assert primitives(inner) == [
        "is_finite",
        "reduce_and",
        "is_finite",
        "reduce_and",
        "and",
        "convert_element_type",
        "cond",
    ]
    _, fast = inner.eqns[-1].params["branches"]
    theirs = jax.make_jaxpr(
        functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla")
    )
    assert primitives(fast.jaxpr) == primitives(theirs(query, key, key).jaxpr)


def test_windows_and_segments_reach_cudnn_only_once_a_gpu_check_passed_them(monkeypatch):
    """The rule reads benchmarks/gpu_check.sh's record (qkv_jax/attention/gpu_checked.py): a
    feature whose cuDNN cases all passed there goes to cuDNN; one with a failed case, or none
    run, stays away."""
    from qkv_jax.attention import dispatch

    record = {"cudnn": {"passed": ["causal window (w, 0)", "mask [T, S], causal"], "failed": []}}
    monkeypatch.setattr(dispatch, "CHECKED", record)
    assert dispatch._cudnn_unchecked() == {"query_segment_ids", "key_segment_ids"}
    record["cudnn"]["failed"] = ["window (w, w): a bias"]
    assert dispatch._cudnn_unchecked() == {"local_window_size", "query_segment_ids", "key_segment_ids"}
    monkeypatch.setattr(dispatch, "CHECKED", {})
    assert dispatch._cudnn_unchecked() == set(dispatch._CUDNN_CHECK_CASES)


def test_the_fused_kernels_take_long_gpu_calls_only_once_a_gpu_check_passed_them(monkeypatch):
    from qkv_jax.attention import dispatch

    long = tuple(jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16) for _ in range(3))
    short = tuple(jax.ShapeDtypeStruct((1, 16, 8, 64), jnp.bfloat16) for _ in range(3))
    soft_cap = dict(is_causal=True, logits_soft_cap=30.0)
    monkeypatch.setattr(dispatch, "CHECKED", {})
    assert select_implementation(*long, platform="gpu", **soft_cap) == "reference"
    monkeypatch.setattr(dispatch, "CHECKED", {"pallas": {"passed": ["causal"], "failed": ["sinks"]}})
    assert select_implementation(*long, platform="gpu", **soft_cap) == "reference"
    monkeypatch.setattr(dispatch, "CHECKED", {"pallas": {"passed": ["causal", "sinks"], "failed": []}})
    assert select_implementation(*long, platform="gpu", **soft_cap) == "pallas"
    assert select_implementation(*long, platform="gpu", is_causal=True) == "cudnn"  # cuDNN first
    assert select_implementation(*short, platform="gpu", **soft_cap) == "reference"
    assert select_implementation(*long, platform="tpu", **soft_cap) == "reference"
    assert select_implementation(*long, platform="cpu", **soft_cap) == "chunked"
