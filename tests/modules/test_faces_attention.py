"""The linen and the nnx `MultiHeadAttention`: one core (`qkv_jax.modules.multi_head_attention`), two faces.

The same options give both faces the same outputs (the nnx module's parameters,
noised, loaded into the linen one), in a full pass and in cached decoding; the
new options match a float64 NumPy reference; the same bad input gives the same
exception type with the same message from both; and the linen fields, the nnx
constructor's keywords and `AttentionOptions` carry the same names and defaults.
"""

import dataclasses
import inspect

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx

import qkv_jax
from qkv_jax import positions
from qkv_jax.modules import OPTION_NAMES, AttentionOptions, InputWidthError
from qkv_jax.nnx import MultiHeadAttention as NNXAttention
from qkv_jax.nnx import linen_to_nnx, nnx_to_linen
from qkv_jax.nnx.attention import OptionKeywords

B, S, D = 2, 5, 8
X = jax.random.normal(jax.random.PRNGKey(0), (B, S, D))
MEMORY = jax.random.normal(jax.random.PRNGKey(1), (B, S + 1, D))
PIECES = (3, 1, 1)  # decoding: a 3-token prompt, then one token at a time


def noisy(params, seed=1):
    """Every leaf plus noise: biases, norm gains and sinks that are not their initial values."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)]
    )


def twins(fields, seed=2):
    """(linen module, nnx module, linen params): the same options and the same (noised) parameters."""
    model = NNXAttention(in_features=D, decode=False, rngs=nnx.Rngs(seed), **fields)
    params = noisy(nnx_to_linen(model)["params"], seed)
    return qkv_jax.MultiHeadAttention(**fields), linen_to_nnx({"params": params}, model), params


def linen_decode(linen, params, inputs):
    cache = linen.init(jax.random.PRNGKey(0), inputs, decode=True)["cache"]
    pieces, start = [], 0
    for length in PIECES:
        variables = {"params": params, "cache": cache}
        out, state = linen.apply(variables, inputs[:, start : start + length], decode=True, mutable=["cache"])
        pieces.append(out)
        cache, start = state["cache"], start + length
    return jnp.concatenate(pieces, axis=1)


def nnx_decode(model, inputs):
    model.init_cache(inputs.shape)
    bounds = np.cumsum((0, *PIECES))
    return jnp.concatenate(
        [model(inputs[:, a:b], decode=True) for a, b in zip(bounds, bounds[1:], strict=False)], axis=1
    )


# ------------------------------------------------------------------------- good inputs

GOOD = {
    "mha": dict(num_heads=2, is_causal=True),
    "gqa_window_sinks": dict(
        num_heads=4, num_kv_heads=2, is_causal=True, local_window_size=(2, 0), use_sinks=True
    ),
    "rope_soft_cap": dict(num_heads=2, is_causal=True, rope_base=100.0, attn_logits_soft_cap=5.0),
    "mla": dict(num_heads=2, num_kv_heads=1, kv_latent_dim=3, is_causal=True),
    "qk_norm_full_no_out_bias": dict(
        num_heads=2, is_causal=True, normalize_qk="rms", qk_norm_width="full", out_bias=False
    ),
}


@pytest.mark.parametrize("variant", sorted(GOOD))
def test_faces_give_equal_outputs_and_decode_alike(variant):
    linen, model, params = twins(GOOD[variant])
    full = linen.apply({"params": params}, X)
    np.testing.assert_allclose(model(X), full, atol=1e-6, rtol=0)
    decoded = linen_decode(linen, params, X)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(nnx_decode(model, X), decoded, atol=1e-6, rtol=0)


def test_faces_give_equal_cross_attention_with_head_mask_and_padding():
    linen, model, params = twins(dict(num_heads=2))
    padding = jnp.arange(S + 1)[None, None, None, :] < jnp.array([S + 1, 2])[:, None, None, None]
    head_mask = jnp.array([[1.0, 0.0], [0.5, 2.0]])  # (B, N)
    arguments = dict(mask=padding, head_mask=head_mask)
    full = linen.apply({"params": params}, X, MEMORY, **arguments)
    np.testing.assert_allclose(model(X, MEMORY, **arguments), full, atol=1e-6, rtol=0)
    ablated = linen.apply({"params": params}, X, MEMORY, mask=padding, head_mask=jnp.zeros((B, 2)))
    np.testing.assert_allclose(ablated, jnp.broadcast_to(params["out"]["bias"], ablated.shape), atol=1e-6)


# ------------------------------------------------------- the new options against float64


def norm64(x, scale, kind, width, epsilon):
    """normalize_qk's norm of `x` `[..., T, heads, H]` in float64, over H or over heads * H."""
    shape = x.shape
    if width == "full":
        x = x.reshape(*shape[:-2], -1)
    if kind == "layernorm":
        x = x - x.mean(-1, keepdims=True)
    x = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + epsilon)
    return (x * (1.0 + scale if kind == "rms_offset" else scale)).reshape(shape)


def rope64(x, base, scaling):
    """GPT-NeoX's rotation of `x` `[..., T, heads, H]` at positions 0..T-1, in float64."""
    H = x.shape[-1]
    inverse, factor = positions.rope_frequencies(H, base, scaling)
    angles = np.arange(x.shape[-3])[:, None] * np.asarray(inverse, np.float64)[None, :]  # (T, H/2)
    cos, sin = (factor * f(angles)[:, None, :] for f in (np.cos, np.sin))  # (T, 1, H/2)
    first, second = x[..., : H // 2], x[..., H // 2 :]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def reference(params, x, fields):
    """The causal multi-head attention of `fields` in float64, from the linen `params`."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)

    def project(name):
        y = np.einsum("bsd,dnh->bsnh", x, p[name]["kernel"])
        return y + p[name]["bias"] if "bias" in p[name] else y

    query, key, value = project("query"), project("key"), project("value")
    kind = {True: "layernorm"}.get(fields.get("normalize_qk"), fields.get("normalize_qk"))
    if kind:
        width, epsilon = fields.get("qk_norm_width", "head"), fields.get("qk_norm_epsilon", 1e-6)
        query = norm64(query, p["query_ln"]["scale"], kind, width, epsilon)
        key = norm64(key, p["key_ln"]["scale"], kind, width, epsilon)
    if fields.get("rope_base"):
        query = rope64(query, fields["rope_base"], fields.get("rope_scaling"))
        key = rope64(key, fields["rope_base"], fields.get("rope_scaling"))
    heads, _ = ref.attention(query, key, value, mask=ref.causal(S, S))  # (B, T, N, Hv)
    out = np.einsum("btnh,nhd->btd", heads, p["out"]["kernel"])
    return out + p["out"]["bias"] if "bias" in p["out"] else out


NEW_OPTIONS = {
    "out_bias": dict(num_heads=2, out_bias=False),
    "qkv_without_bias_out_with": dict(num_heads=2, use_bias=False, out_bias=True),
    "rms_offset_head": dict(num_heads=2, normalize_qk="rms_offset", qk_norm_epsilon=1e-5),
    "layernorm_full_gqa": dict(num_heads=4, num_kv_heads=2, normalize_qk=True, qk_norm_width="full"),
    "rms_offset_full": dict(num_heads=2, normalize_qk="rms_offset", qk_norm_width="full"),
    "rope_linear": dict(num_heads=2, rope_base=50.0, rope_scaling=positions.RopeScaling("linear", 4.0)),
    "rope_yarn": dict(
        num_heads=2,
        rope_base=50.0,
        rope_scaling=positions.RopeScaling("yarn", 4.0, original_max_len=4),
    ),
}


@pytest.mark.parametrize("variant", sorted(NEW_OPTIONS))
def test_new_options_match_float64_in_both_faces_and_in_decoding(variant):
    fields = dict(is_causal=True, **NEW_OPTIONS[variant])
    linen, model, params = twins(fields)
    want = reference(params, X, fields)
    full = linen.apply({"params": params}, X)
    np.testing.assert_allclose(full, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(model(X), full, atol=1e-6, rtol=0)
    np.testing.assert_allclose(linen_decode(linen, params, X), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(nnx_decode(model, X), full, atol=1e-5, rtol=1e-5)


def test_new_options_shape_the_parameters():
    shapes = {
        name: jax.tree.map(jnp.shape, twins(dict(is_causal=True, **fields))[2])
        for name, fields in NEW_OPTIONS.items()
    }
    assert "bias" not in shapes["out_bias"]["out"] and "bias" in shapes["out_bias"]["query"]
    assert "bias" in shapes["qkv_without_bias_out_with"]["out"]
    assert "bias" not in shapes["qkv_without_bias_out_with"]["key"]
    assert shapes["rms_offset_head"]["query_ln"] == {"scale": (4,)}  # H
    assert shapes["layernorm_full_gqa"]["query_ln"] == {"scale": (8,)}  # N * H
    assert shapes["layernorm_full_gqa"]["key_ln"] == {"scale": (4,)}  # K * H
    # Gemma's offset norm starts as the identity gain: scale zeros.
    model = NNXAttention(2, D, normalize_qk="rms_offset", rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model.query_ln.scale[...], np.zeros(4))


# ------------------------------------------------------------------------- bad inputs


def linen_run(fields, inputs, call, decode):
    module = qkv_jax.MultiHeadAttention(**fields)
    variables = module.init(jax.random.PRNGKey(0), X, decode=decode, deterministic=True)
    if not decode:
        return module.apply({"params": variables["params"]}, *inputs, **call)
    return module.apply(variables, *inputs, decode=True, mutable=["cache"], **call)


def nnx_run(fields, inputs, call, decode):
    model = NNXAttention(in_features=D, decode=False, rngs=nnx.Rngs(0), **fields)
    if decode:
        model.init_cache(X.shape)
        call = dict(call, decode=True)
    return model(*inputs, **call)


def outcome(run, fields, inputs, call, decode):
    """(exception type, message) of the run; it must raise."""
    with pytest.raises(Exception) as info:
        run(fields, inputs, call, decode)
    return type(info.value), str(info.value)


# (fields, inputs, call keywords, decode, expected type, a part of the message)
BAD = {
    "query of rank 1": ({}, (X[0, 0],), {}, False, ValueError, "inputs_q must have shape [batch..., length"),
    "key of rank 1": ({}, (X, X[0, 0]), {}, False, ValueError, "inputs_k must have shape"),
    "key of another width": ({}, (X, X[..., :6]), {}, False, InputWidthError, "inputs_k has 6 features"),
    "value of another width": ({}, (X, X, X[..., :6]), {}, False, InputWidthError, "inputs_v has 6 features"),
    "query of another width": ({}, (X[..., :6],), {}, False, InputWidthError, "inputs_q has 6 features"),
    "batch dims differ": ({}, (X, X[:1]), {}, False, ValueError, "batch dims differ"),
    "mask of the wrong shape": (
        {},
        (X,),
        dict(mask=np.ones((4, 4), bool)),
        False,
        ValueError,
        "mask of shape (4, 4)",
    ),
    "mask longer than the keys": (
        dict(is_causal=True),
        (X,),
        dict(mask=np.ones((B, 1, 1, S + 1), bool)),
        False,
        ValueError,
        "mask of shape (2, 1, 1, 6)",
    ),
    "a boolean mask as inputs_v": ({}, (X, X, np.ones((S, S), bool)), {}, False, TypeError, "pass mask=..."),
    "head_mask of the wrong width": (
        {},
        (X,),
        dict(head_mask=np.ones((B, 3))),
        False,
        ValueError,
        "head_mask of shape (2, 3)",
    ),
    "head_mask of another batch": (
        {},
        (X,),
        dict(head_mask=np.ones((3, 2))),
        False,
        ValueError,
        "head_mask of shape (3, 2)",
    ),
    "segment_ids at decode": (
        dict(is_causal=True),
        (X[:, :1],),
        dict(segment_ids=np.zeros((B, 1), np.int32)),
        True,
        ValueError,
        "segment_ids with decode=True",
    ),
    "segment_ids of floats": (
        {},
        (X,),
        dict(segment_ids=np.zeros((B, S))),
        False,
        ValueError,
        "segment_ids must be integers",
    ),
    "decoding past the cache": (
        dict(is_causal=True),
        (jnp.concatenate([X, X[:, :1]], axis=1),),
        {},
        True,
        ValueError,
        "decoding 6 position(s) from position 0 overflows the cache of max length 5",
    ),
    "two inputs with MLA": (
        dict(kv_latent_dim=3),
        (X, X, X * 2),
        {},
        False,
        ValueError,
        "keys and values are rebuilt from one latent",
    ),
    "num_heads not dividing the width": (
        dict(num_heads=3),
        (X,),
        {},
        False,
        ValueError,
        "num_heads=3 does not divide",
    ),
    "num_kv_heads not dividing num_heads": (
        dict(num_heads=4, num_kv_heads=3),
        (X,),
        {},
        False,
        ValueError,
        "num_kv_heads=3 must divide num_heads=4",
    ),
    "num_heads zero": (dict(num_heads=0), (X,), {}, False, ValueError, "num_heads=0 must be a positive int"),
    "normalize_qk unknown": (
        dict(normalize_qk="l2"),
        (X,),
        {},
        False,
        ValueError,
        "normalize_qk='l2' must be",
    ),
    "qk_norm_width unknown": (
        dict(normalize_qk=True, qk_norm_width="wide"),
        (X,),
        {},
        False,
        ValueError,
        "qk_norm_width='wide'",
    ),
    "qk_norm_epsilon zero": (
        dict(normalize_qk=True, qk_norm_epsilon=0.0),
        (X,),
        {},
        False,
        ValueError,
        "qk_norm_epsilon=0.0",
    ),
    "rope_scaling not a RopeScaling": (
        dict(rope_base=100.0, rope_scaling=4.0),
        (X,),
        {},
        False,
        ValueError,
        "rope_scaling=4.0",
    ),
    "dropout without deterministic": (
        dict(dropout_rate=0.5),
        (X,),
        {},
        False,
        ValueError,
        '"deterministic" must be passed',
    ),
    "soft cap on jax.nn's path": (
        dict(attn_logits_soft_cap=5.0, attention_implementation="xla"),
        (X,),
        {},
        False,
        ValueError,
        "has no logits soft cap",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_faces_give_the_same_error(case):
    fields, inputs, call, decode, error, message = BAD[case]
    fields = dict(dict(num_heads=2), **fields)
    linen = outcome(linen_run, fields, inputs, call, decode)
    assert linen == outcome(nnx_run, fields, inputs, call, decode)
    assert linen[0] is error and message in linen[1], linen


def test_a_key_of_another_width_names_both_widths():
    """flax raises a ScopeParamShapeError (linen) and a dot_general TypeError (nnx); both faces
    raise an InputWidthError, a ValueError that is also flax's ScopeParamShapeError."""
    assert issubclass(InputWidthError, ValueError)
    assert issubclass(InputWidthError, flax.errors.ScopeParamShapeError)
    _, message = outcome(nnx_run, dict(num_heads=2), (X, X[..., :6]), {}, False)
    assert message == (
        "MultiHeadAttention: inputs_k has 6 features (shape (2, 5, 6)), but its projection was built "
        "for in_kv_features=8"
    )


def test_a_mask_as_inputs_v_warns_as_flax_then_names_the_widths():
    """flax.linen's DeprecationWarning for a square `inputs_v` (a mask passed positionally), then
    the width error (flax's peer test of this expects its ScopeParamShapeError, which it is too)."""
    module = qkv_jax.MultiHeadDotProductAttention(num_heads=1)
    query = jax.random.normal(jax.random.PRNGKey(2), (1, 10, 1))
    variables = module.init(jax.random.PRNGKey(3), query, query)
    mask = nn.make_causal_mask(jnp.ones((1, 10)))  # (1, 1, 10, 10)
    with pytest.warns(DeprecationWarning, match="the function signature of MultiHeadDotProductAttention"):
        with pytest.raises(ValueError, match=r"inputs_v has 10 features .* built for in_kv_features=1"):
            module.apply(variables, query, query, mask)


# ------------------------------------------------------------------ one options declaration

# What one face has and the options do not: parameter creation, and flax's per-face state.
LINEN_ONLY = {
    "kernel_init",
    "out_kernel_init",
    "bias_init",
    "out_bias_init",
    "deterministic",
    "decode",
    "qkv_dot_general",
    "out_dot_general",
    "qkv_dot_general_cls",
    "out_dot_general_cls",
    "parent",
    "name",
}
NNX_ONLY = LINEN_ONLY - {"parent", "name"} | {
    "in_features",
    "in_kv_features",
    "qkv_promote_dtype",
    "out_promote_dtype",
    "ln_promote_dtype",
    "rngs",
    "keep_rngs",
    "kernel_metadata",
    "out_kernel_metadata",
    "bias_metadata",
    "out_bias_metadata",
    "query_ln_scale_metadata",
    "key_ln_scale_metadata",
}


def test_linen_fields_nnx_keywords_and_options_agree():
    defaults = {f.name: f.default for f in dataclasses.fields(AttentionOptions)}
    linen = {name: f.default for name, f in qkv_jax.MultiHeadAttention.__dataclass_fields__.items()}
    parameters = inspect.signature(NNXAttention.__init__).parameters
    assert parameters["options"].kind is inspect.Parameter.VAR_KEYWORD
    flax_keywords = {name: p.default for name, p in parameters.items() if name not in ("self", "options")}
    # qkv_jax's own options: typed keywords (`**options: Unpack[OptionKeywords]`), whose defaults
    # are AttentionOptions'.
    own = set(OptionKeywords.__annotations__)
    assert not own & set(flax_keywords)
    keywords = {**flax_keywords, **{name: defaults[name] for name in own}}
    assert set(linen) - set(defaults) == LINEN_ONLY
    assert set(defaults) - set(linen) == set()
    assert set(keywords) - set(defaults) == NNX_ONLY
    assert set(defaults) - set(keywords) == set()
    for name, default in defaults.items():
        assert linen[name] == default, name
        if name in keywords and name != "num_heads":
            assert keywords[name] == default, name
    assert OPTION_NAMES == tuple(defaults)
    # flax's positional order is kept: linen's fields, nnx's leading positional parameters.
    assert list(linen)[:4] == ["num_heads", "dtype", "param_dtype", "qkv_features"]
    assert list(keywords)[:6] == [
        "num_heads",
        "in_features",
        "qkv_features",
        "out_features",
        "num_kv_heads",
        "in_kv_features",
    ]


def test_an_unknown_nnx_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_heds'"):
        NNXAttention(2, 8, num_heds=2, rngs=nnx.Rngs(0))


def test_the_faces_declare_the_options_python_m_docs_generate_faces_writes():
    """qkv_jax's own options are written into both faces from AttentionOptions; a new option
    declared there fails here until `python -m docs.generate faces` has run."""
    from docs import faces

    assert faces.stale() == []
    own = [field.name for field in faces.own_options()]
    assert own[:3] == ["num_kv_heads", "head_dim", "v_head_dim"] and "num_heads" not in own


def test_both_faces_read_one_options_object():
    fields = dict(num_heads=2, is_causal=True, rope_base=100.0, qk_norm_epsilon=1e-5)
    want = AttentionOptions(**fields)
    assert qkv_jax.MultiHeadAttention(**fields).options() == want
    assert NNXAttention(in_features=D, rngs=nnx.Rngs(0), **fields).options == want
    with pytest.raises(dataclasses.FrozenInstanceError):
        want.is_causal = False  # type: ignore[misc]


def test_renamed_nnx_attention_function_warns_and_still_works():
    with pytest.warns(DeprecationWarning, match="renamed qkv_jax.nnx.flax_dot_product_attention"):
        old = qkv_jax.nnx.dot_product_attention
    assert old is qkv_jax.nnx.flax_dot_product_attention is qkv_jax.modules.flax_dot_product_attention
