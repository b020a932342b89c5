"""`precision=` reaches every dot, forward and backward, on every path and in every module.

Checked in the StableHLO that `jax.jit(...).lower(...)` prints: each
`stablehlo.dot_general` carries `precision = [LHS, RHS]`. The tests pass
'high' (TF32 on GPUs), which differs from the session's pin to 'highest'
(tests/conftest.py) and from JAX's DEFAULT, so a dot that missed the argument
shows up as one of those. Only lowering runs: no numerics, any backend.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qkv_jax
from qkv_jax import dot_product_attention
from qkv_jax.attention.chunked import chunked_attention

DOT = re.compile(r"stablehlo\.dot_general .*?precision = \[(\w+), (\w+)\]")


def dot_precisions(lowered) -> list[tuple[str, str]]:
    text = lowered.as_text()
    found = DOT.findall(text)
    assert len(found) == text.count("stablehlo.dot_general"), "a dot without a printed precision"
    return found


def forward_and_backward(attend, *arrays):
    """Lowered programs of `attend` and of its gradient with respect to every input."""
    loss = lambda *xs: jnp.sum(jnp.sin(attend(*xs)))
    gradient = jax.grad(loss, argnums=tuple(range(len(arrays))))
    return jax.jit(attend).lower(*arrays), jax.jit(gradient).lower(*arrays)


def inputs(T=6, S=6, N=4, K=2, H=8):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(2, n, heads, H)).astype(np.float32) for n, heads in ((T, N), (S, K), (S, K))]


PATHS = {
    "reference": dict(implementation="reference"),
    "xla": dict(implementation="xla"),
    "chunked": dict(implementation="chunked"),
    "reference, mask and bias": dict(implementation="reference", mask=True, bias=True),
    "xla, mask, bias, lengths": dict(implementation="xla", mask=True, bias=True, lengths=True),
}


def attention_function(precision, implementation, mask=False, bias=False, lengths=False):
    extra = {}
    if mask:
        extra["mask"] = np.tril(np.ones((6, 6), bool))
    if bias:
        extra["bias"] = np.linspace(-1.0, 1.0, 36, dtype=np.float32).reshape(6, 6)
    if lengths:
        extra.update(query_seq_lengths=np.array([6, 3]), key_value_seq_lengths=np.array([4, 6]))
    return functools.partial(
        dot_product_attention, is_causal=True, implementation=implementation, precision=precision, **extra
    )


@pytest.mark.parametrize("path", PATHS)
def test_every_dot_of_every_path_takes_the_precision(path):
    forward, backward = forward_and_backward(attention_function("high", **PATHS[path]), *inputs())
    forward_dots, backward_dots = dot_precisions(forward), dot_precisions(backward)
    assert len(forward_dots) >= 2 and len(backward_dots) > len(forward_dots)
    assert set(forward_dots) == set(backward_dots) == {("HIGH", "HIGH")}


def test_chunked_kernel_dots_take_a_pair_of_precisions_over_several_tiles():
    attend = functools.partial(
        chunked_attention, is_causal=True, block_q=2, block_k=4, precision=("high", "highest")
    )
    forward, backward = forward_and_backward(attend, *inputs(T=7, S=9))
    # The forward pass and the backward pass's recomputation of the tiles (its own dots too).
    assert set(dot_precisions(forward)) == set(dot_precisions(backward)) == {("HIGH", "HIGHEST")}
    assert len(dot_precisions(backward)) >= 6  # Q K^T, P V, then dV, dP, dQ, dK


def test_xla_path_applies_the_higher_of_a_pair_to_both_operands():
    attend = attention_function((lax.Precision.DEFAULT, lax.Precision.HIGHEST), "xla")
    forward, backward = forward_and_backward(attend, *inputs())
    assert set(dot_precisions(forward)) == set(dot_precisions(backward)) == {("HIGHEST", "HIGHEST")}


@pytest.mark.parametrize("path", ["reference", "xla", "chunked"])
def test_none_is_jax_default(path):
    with jax.default_matmul_precision("bfloat16"):  # JAX's spelling of DEFAULT
        forward, backward = forward_and_backward(attention_function(None, path), *inputs())
        assert set(dot_precisions(forward)) | set(dot_precisions(backward)) == {("DEFAULT", "DEFAULT")}


X = np.linspace(-1.0, 1.0, 2 * 6 * 8, dtype=np.float32).reshape(2, 6, 8)
MODULES = {
    "MultiHeadAttention": (
        lambda p: qkv_jax.MultiHeadAttention(num_heads=2, is_causal=True, precision=p),
        (X,),
    ),
    "MultiHeadAttention MLA, GQA": (
        lambda p: qkv_jax.MultiHeadAttention(num_heads=4, num_kv_heads=2, kv_latent_dim=4, precision=p),
        (X,),
    ),
    "SelfAttention": (lambda p: qkv_jax.SelfAttention(d_out=4, precision=p), (X,)),
    "SelfAttentionV1": (lambda p: qkv_jax.SelfAttentionV1(d_out=4, precision=p), (X,)),
    "LearnedQueryAttention": (lambda p: qkv_jax.LearnedQueryAttention(d_k=4, d_v=3, precision=p), (X,)),
    "StaticAttention": (lambda p: qkv_jax.StaticAttention(is_causal=True, precision=p), (X,)),
    "FlagReader multihead": (
        lambda p: qkv_jax.FlagReader(kind="multihead", out_features=3, num_heads=2, d_k=4, precision=p),
        (X,),
    ),
    "FlagReader learned_query": (
        lambda p: qkv_jax.FlagReader(kind="learned_query", out_features=3, precision=p),
        (X,),
    ),
}


@pytest.mark.parametrize("name", MODULES)
def test_modules_pass_the_precision_to_projections_and_attention(name):
    build, args = MODULES[name]
    model = build("high")
    params = model.init(jax.random.PRNGKey(0), *args)

    def loss(params, *args):
        out = model.apply(params, *args)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(out))

    forward = jax.jit(model.apply).lower(params, *args)
    backward = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, *args)
    forward_dots = dot_precisions(forward)
    assert len(forward_dots) >= 2
    assert set(forward_dots) == set(dot_precisions(backward)) == {("HIGH", "HIGH")}
    # And without the argument, the module keeps JAX's default.
    assert ("HIGH", "HIGH") not in set(dot_precisions(jax.jit(build(None).apply).lower(params, *args)))


def test_the_lm_config_field_reaches_every_dot_of_the_training_step():
    """`--config.model.precision=high` -> TransformerConfig -> every projection, attention, MLP and
    head dot of the language model's loss, forward and backward."""
    from configs import sequences
    from qkv_jax.training import build_setup

    config = sequences.get_config("copy")
    config.model.precision = "high"
    setup = build_setup(config)
    assert setup.model.config.precision == "high"
    params = jax.eval_shape(setup.init, jax.random.PRNGKey(0))
    batch = jax.eval_shape(setup.sample_batch, jax.random.PRNGKey(0), setup.data)
    step = jax.jit(jax.grad(lambda p, b: setup.loss(p, b, jax.random.PRNGKey(0))[0]))
    dots = dot_precisions(step.lower(params, batch))
    assert len(dots) >= 2 * 8  # 2 layers: q, k, v, attention (2), out, mlp in/out, and the head
    assert set(dots) == {("HIGH", "HIGH")}
