"""Which path computes a call: what each path supports (one table), the automatic choice, and
the check of an explicit choice."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from qkv_jax.attention.gpu_checked import CHECKED
from qkv_jax.attention.jax_nn import cudnn_applies
from qkv_jax.attention.options import CallOptions, check_soft_cap
from qkv_jax.attention.visibility import is_int, window_pair

__all__ = [
    "IMPLEMENTATIONS",
    "FEATURES",
    "SUPPORTED",
    "CHUNKED_MIN_KEYS",
    "MATERIALIZE_FRACTION",
    "ACCELERATOR_BYTES",
    "accelerator_block_sizes",
    "materialized_bytes",
    "check_supported",
    "select_implementation",
]

IMPLEMENTATIONS = ("reference", "xla", "cudnn", "chunked", "pallas", "splash")
# The arguments of dot_product_attention beyond query, key and value, by their keyword names.
FEATURES = (
    "bias",
    "mask",
    "scale",
    "is_causal",
    "query_seq_lengths",
    "key_value_seq_lengths",
    "local_window_size",
    "return_residual",
    "query_offset",
    "query_segment_ids",
    "key_segment_ids",
    "logits_soft_cap",
    "sinks",
    "dropout_rate",
    "return_weights",
    "precision",
)
# What each implementation computes: a call using any other feature cannot run there. jax.nn
# has neither a soft cap nor sinks; only the reference path materialises the attention
# weights, so only it returns them or drops them out. The Pallas kernels take no dense bias or
# mask (their masks are the rules of visibility.py, computed per tile).
SUPPORTED: dict[str, frozenset[str]] = {
    "reference": frozenset(FEATURES),
    "chunked": frozenset(FEATURES) - {"dropout_rate", "return_weights"},
    "xla": frozenset(FEATURES) - {"dropout_rate", "return_weights", "logits_soft_cap", "sinks"},
    "cudnn": frozenset(FEATURES) - {"dropout_rate", "return_weights", "logits_soft_cap", "sinks"},
    "pallas": frozenset(FEATURES) - {"bias", "mask", "dropout_rate", "return_weights"},
    # jax's splash attention (Pallas, Mosaic TPU): a static query_offset only, float32 and
    # bfloat16 only (qkv_jax.attention.splash.splash_refusal); never chosen by the rule.
    "splash": frozenset(FEATURES)
    - {"bias", "mask", "dropout_rate", "return_weights", "return_residual", "precision"},
}
# Supported on "cudnn", but chosen for it automatically only once benchmarks/gpu_check.sh has
# shown on a GPU that cuDNN's window and its top-left alignment for T != S (cases named
# "window"), and segment ids as a bias (cases named "segments"), mean the same as here: the
# record `qkv_jax.attention.gpu_checked.CHECKED` says which passed.
_CUDNN_CHECK_CASES = {
    "local_window_size": "window",
    "query_segment_ids": "segments",
    "key_segment_ids": "segments",
}


def _cudnn_unchecked() -> frozenset[str]:
    """The features of `_CUDNN_CHECK_CASES` whose GPU check cases have not all passed."""
    record = CHECKED.get("cudnn", {})
    passed, failed = set(record.get("passed", ())), set(record.get("failed", ()))
    return frozenset(
        feature
        for feature, word in _CUDNN_CHECK_CASES.items()
        if not any(word in case for case in passed) or any(word in case for case in failed)
    )


# On CPU, from this many keys on, "chunked"; below, "reference" (forward-mode differentiable).
CHUNKED_MIN_KEYS = 64
# On an accelerator a materialised path ("xla", else "reference") takes a call whose
# `materialized_bytes` are at most this share of the device's memory; beyond it the tiled scan,
# with key blocks that fill the same share (`accelerator_block_sizes`). On an H200 at
# B4 T4096 N16 H128 bf16, forward and backward: jax.nn's XLA path 15.2 ms, the scan with its
# CPU tiles 32.6 to 63.4 ms (benchmarks/gpu_probe.py).
MATERIALIZE_FRACTION = 0.25
# The device memory assumed for a platform this process does not run on (where it does, the
# runtime's own figure): a GPU's is an H100's 80 GiB (the H200 has 141, the A100 40 or 80), a
# TPU's a v5e's 16 GiB. With them, B4 T4096 N16 H128 (12.9 GB materialised) goes to the
# materialised path on a GPU and to the tiled scan on a TPU, where it would not fit.
ACCELERATOR_BYTES = {"gpu": 80 * 2**30, "tpu": 16 * 2**30}
MIN_ACCELERATOR_KEY_BLOCK = 128
# On a GPU, calls cuDNN does not take go to the fused Pallas kernels ("pallas") from this many
# queries and keys on, once benchmarks/gpu_check.sh has passed them there (`checked_on_gpu`);
# shorter ones (a decoding step, say) to a materialised path.
FUSED_MIN_LENGTH = 128

# How a path that lacks a feature says so.
_LACKS = {
    "return_weights": "cannot return attention weights",
    "dropout_rate": "does not implement dropout",
}


def _unknown(owner: str, argument: str, implementation: Any) -> ValueError:
    return ValueError(
        f"{owner}: {argument} must be None or one of {', '.join(IMPLEMENTATIONS)} (None: "
        f"the dispatch rule), got {implementation!r}"
    )


def check_supported(
    owner: str,
    implementation: Any,
    features: Mapping[str, str] | Iterable[str],
    *,
    argument: str = "implementation",
) -> None:
    """ValueError naming `owner`, the implementation and a feature unless `implementation` is
    None (the dispatch rule, which picks a path that takes them) or one of `IMPLEMENTATIONS`
    that takes every one of `features` (`SUPPORTED`).

    `features`: keyword names of `dot_product_attention` the caller will use; a mapping
    from those names to how the caller's own settings spell them (e.g.
    `{"sinks": "use_sinks=True"}`), which the message quotes. `argument`: the caller's
    name of the implementation setting (a module's `attention_implementation`).
    """
    if implementation is None:
        return
    if implementation not in IMPLEMENTATIONS:
        raise _unknown(owner, argument, implementation)
    spelled = dict(features) if isinstance(features, Mapping) else {name: name for name in features}
    unknown = sorted(set(spelled) - set(FEATURES))
    if unknown:
        raise ValueError(f"check_supported: {unknown} are not arguments of dot_product_attention")
    missing = [name for name in FEATURES if name in spelled and name not in SUPPORTED[implementation]]
    if missing:
        feature = missing[0]
        takers = " or ".join(repr(name) for name in IMPLEMENTATIONS if feature in SUPPORTED[name])
        lacks = _LACKS.get(feature, f"has no {feature}")
        raise ValueError(
            f"{owner}: {argument}={implementation!r} {lacks} ({spelled[feature]}): use {takers}, "
            "or None (the dispatch rule)"
        )


def _shape_refusal(implementation: str, query, key, value) -> str | None:
    """Why `implementation` cannot take these arrays (beyond `SUPPORTED`), or None."""
    if implementation == "pallas" and jnp.result_type(query, key, value) == jnp.float64:
        return "accumulates in float32, so it cannot serve float64 inputs"
    if implementation == "xla":
        H, Hv = key.shape[-1], value.shape[-1]
        if H != Hv:
            return f"needs value depth Hv equal to key depth H (jax.nn), got Hv={Hv} and H={H}"
        if jnp.result_type(query, key, value) == jnp.float64:
            return "computes the softmax in float32 (jax.nn), so it cannot serve float64 inputs"
    return None


def check_call(implementation: Any, query, key, value, features: Mapping[str, str]) -> None:
    """`check_supported` for one `dot_product_attention` call, and the arrays' limits."""
    check_supported("dot_product_attention", implementation, features)
    reason = _shape_refusal(implementation, query, key, value)
    if reason is not None:
        raise ValueError(f"dot_product_attention: implementation={implementation!r} {reason}")


def call_features(options: CallOptions, arrays: Mapping[str, Any]) -> dict[str, str]:
    """The features a call uses, as keyword names mapped to how the call spells them (for the
    messages): the static options that are on, and the `arrays` (keyword -> array or None)
    that are given."""
    statics = dict(
        is_causal=options.is_causal or None,
        local_window_size=options.window,
        query_offset=options.offset or None,  # None: 0, or an array (in `arrays`)
        logits_soft_cap=options.soft_cap,
        dropout_rate=options.dropout_rate or None,
        return_weights=options.return_weights or None,
    )
    used = {name: f"{name}={value!r}" for name, value in statics.items() if value is not None}
    used.update({name: f"{name} given" for name, x in arrays.items() if x is not None})
    return used


def accelerator_bytes(platform: str) -> int:
    """The memory of one device of `platform`: the runtime's own figure when this process runs on
    it (`memory_stats()["bytes_limit"]`), else the platform's `ACCELERATOR_BYTES` (a TPU's for
    another accelerator)."""
    if platform != "cpu" and jax.default_backend() == platform:
        stats = jax.devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    return ACCELERATOR_BYTES.get(platform, ACCELERATOR_BYTES["tpu"])


def materialized_bytes(query, key) -> int:
    """What the materialised paths keep of one call: three float32 `[batch..., N, T, S]` arrays
    (the logits or weights kept for the backward pass, their cotangent, one more in flight)."""
    *batch, T, N, _ = query.shape
    return 3 * 4 * math.prod(batch) * N * T * key.shape[-3]


def _materialized(takes: Mapping[str, bool], query, key, value) -> str | None:
    """ "xla" (jax.nn's) where it computes the call, else "reference" (qkv_jax's own, which also
    has the soft cap and sinks), else None."""
    if takes["xla"] and _shape_refusal("xla", query, key, value) is None:
        return "xla"
    return "reference" if takes["reference"] else None


def accelerator_block_sizes(query, key, platform: str) -> tuple[int, int]:
    """`(block_q, block_k)` for the tiled scan on an accelerator: every query in one block, and
    key blocks as wide as `MATERIALIZE_FRACTION` of the device's memory allows (a power of two,
    at least `MIN_ACCELERATOR_KEY_BLOCK`): a scan on an accelerator pays per step, not per cache
    miss, so it takes as few steps as fit."""
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    per_key = 3 * 4 * math.prod(batch) * N * T
    budget = accelerator_bytes(platform) * MATERIALIZE_FRACTION
    block_k = MIN_ACCELERATOR_KEY_BLOCK
    while block_k * 2 <= S and per_key * block_k * 2 <= budget:
        block_k *= 2
    return T, min(block_k, S)


def checked_on_gpu(kernel: str) -> bool:
    """Whether benchmarks/gpu_check.sh has run `kernel`'s cases on a GPU and all passed (the
    record `qkv_jax.attention.gpu_checked.CHECKED`)."""
    record = CHECKED.get(kernel, {})
    return bool(record.get("passed")) and not record.get("failed")


def _fused_applies(query, key, value) -> bool:
    """Whether the rule sends a call cuDNN does not take to the fused Pallas kernels: once the
    GPU check has passed them, from `FUSED_MIN_LENGTH` queries and keys on, not float64."""
    return (
        checked_on_gpu("pallas")
        and min(query.shape[-3], key.shape[-3]) >= FUSED_MIN_LENGTH
        and jnp.result_type(query, key, value) != jnp.float64
    )


def choose(query, key, value, features: Iterable[str], *, platform: str) -> str:
    """The rule of `select_implementation` for a call using `features` (keyword names)."""
    used = frozenset(features)
    takes = {name: used <= SUPPORTED[name] for name in IMPLEMENTATIONS}
    has_bias = bool(used & {"bias", "mask"}) or used >= {"is_causal", "query_offset"}
    if (
        takes["cudnn"]
        and not used & _cudnn_unchecked()
        and cudnn_applies(query, key, value, has_bias, platform)
    ):
        return "cudnn"
    if platform == "cpu":
        return "chunked" if takes["chunked"] and key.shape[-3] >= CHUNKED_MIN_KEYS else "reference"
    if platform == "gpu" and takes["pallas"] and _fused_applies(query, key, value):
        return "pallas"
    materialized = _materialized(takes, query, key, value)
    fits = materialized_bytes(query, key) <= accelerator_bytes(platform) * MATERIALIZE_FRACTION
    if materialized is not None and (fits or not takes["chunked"]):
        return materialized
    return "chunked"


def select_implementation(query, key, value, bias=None, mask=None, *, platform=None, **keywords) -> str:
    """The path `dot_product_attention(..., implementation=None)` takes.

    Arguments as for `dot_product_attention`, by its keyword names (`FEATURES`,
    `implementation` and `dropout_rng`; any other is a TypeError); arrays need
    only `.shape` and `.dtype` (`jax.ShapeDtypeStruct` will do), and of the optional ones only
    whether they are given matters (and of `query_offset` whether it is a
    static 0; sequence lengths, `scale`, `return_residual` and `precision` do
    not change the path). `platform` defaults to `jax.default_backend()`. The
    rule takes the first of these paths that supports every feature of the
    call (`SUPPORTED`):

    1. On a GPU where cuDNN's fused kernel applies: "cudnn". That is bf16/fp16
       with H = Hv a multiple of 8 up to 128, with or without causal masking
       and lengths; a mask, a bias or causal with a query offset (all passed
       to cuDNN as one additive bias `[batch, N|1, T, S]`) need even T and S.
       Padding given as lengths costs no bias. A local window or segment ids
       only once benchmarks/gpu_check.sh has shown on a GPU that cuDNN's window
       (and its top-left alignment for T != S) and segments as a bias mean the
       same as here (`qkv_jax.attention.gpu_checked`); until then they go on.
    2. On CPU: "chunked" from `CHUNKED_MIN_KEYS` keys on. It is the fastest
       path there, forward and backward, and its tiles keep every buffer a call
       allocates small, under glibc's mmap threshold, where pages do not fault
       in afresh on every call; with a window or segment ids it skips the
       tiles they rule out. Below that, or for what it lacks (weights,
       dropout), "reference".
    3. On a GPU, once benchmarks/gpu_check.sh has passed the fused Pallas
       kernels there (`checked_on_gpu("pallas")`), "pallas" for what it takes
       from `FUSED_MIN_LENGTH` queries and keys on (no bias, mask, dropout,
       weights or float64).
    4. On an accelerator (GPU, TPU), a materialised path wherever its
       `materialized_bytes` fit in `MATERIALIZE_FRACTION` of the device's
       memory (`accelerator_bytes`): "xla" (H = Hv, not float64), else
       "reference" (soft cap, sinks, MLA's unequal widths, float64, weights,
       dropout). Beyond that, "chunked" with tiles sized for the device
       (`accelerator_block_sizes`: all queries, key blocks filling the same
       share); never its CPU tiles, which cost 2 to 4 times XLA's time on a
       GPU.

    The measurements behind these steps are in docs/benchmarks.md, each
    beside its command: `python benchmarks/attention.py --library-user` and
    `--window` on CPU, benchmarks/gpu_probe.py and benchmarks/gpu.sh on a GPU;
    benchmarks/gpu_check.sh checks every case of steps 1 and 3 against the
    reference on the GPU.
    """
    unknown = sorted(set(keywords) - set(FEATURES) - {"implementation", "dropout_rng"})
    if unknown:
        raise TypeError(f"select_implementation() got an unexpected keyword argument {unknown[0]!r}")
    given = dict(keywords, bias=bias, mask=mask)
    query_offset = given.get("query_offset")
    offset = query_offset if query_offset is None or is_int(query_offset) else None
    options = CallOptions(
        is_causal=bool(given.get("is_causal", False)),
        window=window_pair(given.get("local_window_size"), "select_implementation"),
        offset=offset,
        soft_cap=check_soft_cap("select_implementation", given.get("logits_soft_cap")),
        dropout_rate=given.get("dropout_rate", 0.0),
        return_weights=bool(given.get("return_weights", False)),
    )
    arrays = {
        name: given.get(name) for name in ("bias", "mask", "query_segment_ids", "key_segment_ids", "sinks")
    }
    arrays["query_offset"] = query_offset if offset is None else None  # a traced offset
    platform = jax.default_backend() if platform is None else platform
    return choose(query, key, value, call_features(options, arrays), platform=platform)
