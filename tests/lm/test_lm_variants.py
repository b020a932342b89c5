"""The attention variants of the modules and the language model: RoPE, sliding windows with a
ring-buffer cache, normalize_qk (LayerNorm or RMS), a logits soft cap, learned sinks and packed
sequences, with MHA, GQA, MQA and MLA, in linen and nnx.

The new math is checked against float64 NumPy (the rotation, the segment positions, a whole
attention layer with every option, the ring cache against the full window mask); the rest is
checked by identities the model must keep (cached decoding equals the full pass, nnx equals
linen, a packed row equals its documents run alone, decoding past max_len).
"""

import dataclasses
import functools
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest
from flax import nnx

import qkv_jax
from configs import common
from qkv_jax import lm
from qkv_jax import nnx as qnnx
from qkv_jax.diagnostics import head_diagnostics
from qkv_jax.positions import apply_rope, rotary_dims, segment_positions
from qkv_jax.tasks.transformer import layer_attention, transformer_config
from qkv_jax.training.validate import ConfigError

VOCAB, LAYERS, D, N, MAX_LEN, B = 11, 2, 16, 4, 12, 2
TOKENS = jax.random.randint(jax.random.PRNGKey(0), (B, MAX_LEN), 0, VOCAB)
CHUNK = 5  # decoding: single tokens, then the last 5 at once (more than a 3-slot ring holds)
# The programs below run once each: LLVM's cheapest optimization level halves their compile time.
compile_once = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def random_params(model, seed=1, scale=0.3):
    """Parameters of `model`'s shapes drawn from N(0, scale^2) with NumPy (nothing compiled):
    biases, norm scales and sinks away from their zero or one starts."""
    tokens = TOKENS[:, : model.config.max_len]
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, scale, s.shape), s.dtype), shapes)


# ------------------------------------------------------------------------- the covering design

FACTORS = {
    "positions": ("learned", "rope", "none"),
    "window": (None, (3, None), 4),  # global, local (3) then global, every layer local (4)
    "normalize_qk": (False, "layernorm", "rms"),
    "attn_logits_soft_cap": (None, 5.0),
    "use_sinks": (False, True),
    "layout": ("mha", "gqa", "mqa", "mla"),
}
LAYOUTS = {"mha": {}, "gqa": {"num_kv_heads": 2}, "mqa": {"num_kv_heads": 1}, "mla": {"kv_latent_dim": 8}}


def allowed(case: dict) -> bool:
    """What TransformerConfig defines: RoPE with MLA is not (no decoupled rotary key)."""
    return not (case.get("positions") == "rope" and case.get("layout") == "mla")


def pairs_of(case: dict) -> set:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(FACTORS, 2)}


def allowed_pairs() -> set:
    pairs = set()
    for (a, values_a), (b, values_b) in itertools.combinations(FACTORS.items(), 2):
        pairs |= {((a, x), (b, y)) for x in values_a for y in values_b if allowed({a: x, b: y})}
    return pairs


@functools.cache
def covering_cases() -> tuple[tuple, ...]:
    """A pairwise covering design, built greedily: each case is an allowed combination covering
    the most pairs of option values not yet covered (ties broken by a seeded draw: seed 63 gives
    13 cases, the fewest of the first 300 seeds; at least 12 are needed, 4 layouts x 3 window
    settings), until every allowed pair is covered."""
    everything = [dict(zip(FACTORS, values, strict=True)) for values in itertools.product(*FACTORS.values())]
    candidates = [case for case in everything if allowed(case)]
    uncovered, cases, draw = allowed_pairs(), [], random.Random(63)
    while uncovered:
        gains = [len(pairs_of(case) & uncovered) for case in candidates]
        best = draw.choice([case for case, gain in zip(candidates, gains, strict=True) if gain == max(gains)])
        uncovered -= pairs_of(best)
        cases.append(tuple(best.items()))
    return tuple(cases)


def case_id(case: tuple) -> str:
    return "-".join(f"{value}" for _, value in case).replace(" ", "")


def config_of(case: tuple, **overrides) -> lm.TransformerConfig:
    options = dict(case)
    layout = LAYOUTS[options.pop("layout")]
    if "kv_latent_dim" in layout and options["normalize_qk"]:
        layout = {**layout, "absorb_latent": False}  # a norm of the keys does not fold into the query
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
    return lm.TransformerConfig(**fields, **options, **layout, **overrides)


def test_the_covering_design_meets_every_allowed_pair_of_options():
    cases = [dict(case) for case in covering_cases()]
    covered = set().union(*(pairs_of(case) for case in cases))
    assert covered == allowed_pairs()
    assert all(allowed(case) for case in cases)
    assert len(cases) == 13  # of the full product's 432 (RoPE x MLA left out: 396)


def decode_in_chunks(step, cache, tokens):
    """Logits `[B, T, V]` of `tokens` decoded by `step(cache, chunk) -> (logits, cache)`: single
    tokens inside `lax.scan` (one trace of the model), then the last CHUNK at once."""

    def one(cache, token):  # token: (B,)
        logits, cache = step(cache, token[:, None])
        return cache, logits[:, 0]

    cache, singles = jax.lax.scan(one, cache, tokens[:, :-CHUNK].T)  # (T - CHUNK, B, V)
    rest, _ = step(cache, tokens[:, -CHUNK:])
    return jnp.concatenate([jnp.swapaxes(singles, 0, 1), rest], axis=1)


def case_program(case: tuple):
    """(a jitted function of (params, tokens) giving linen and nnx logits, full and decoded, for
    one case, its linen model). The nnx model is built inside it and given the linen parameters."""
    linen = lm.TransformerLM(config_of(case))

    def linen_step(params, cache, chunk):
        logits, variables = linen.apply(
            {"params": params, "cache": cache}, chunk, decode=True, mutable=["cache"]
        )
        return logits, variables["cache"]

    @compile_once
    def run(params, tokens):
        twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(linen.config, rngs=nnx.Rngs(0)))
        twin_full = twin(tokens)
        twin.init_cache(B)
        graphdef, cache, rest = nnx.split(twin, nnx.Cache, ...)

        def nnx_step(cache, chunk):
            decoder = nnx.merge(graphdef, cache, rest)
            return decoder(chunk, decode=True), nnx.state(decoder, nnx.Cache)

        return {
            "linen": linen.apply({"params": params}, tokens),
            "linen_decoded": decode_in_chunks(
                functools.partial(linen_step, params), lm.init_cache(linen, B), tokens
            ),
            "nnx": twin_full,
            "nnx_decoded": decode_in_chunks(nnx_step, cache, tokens),
        }

    return run, linen


@functools.cache
def case_outputs(case: tuple) -> dict:
    run, linen = case_program(case)
    return jax.device_get(run(random_params(linen), TOKENS))


@pytest.mark.parametrize("case", covering_cases(), ids=case_id)
@pytest.mark.slow
def test_cached_decoding_equals_the_full_pass_for_every_pair_of_options(case):
    """Every pair of option values meets in at least one case (the covering design above); each
    case decodes 7 single tokens, then 5 at once (more than a 3-slot ring holds)."""
    outputs = case_outputs(case)
    np.testing.assert_allclose(outputs["linen_decoded"], outputs["linen"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", covering_cases(), ids=case_id)
@pytest.mark.slow
def test_nnx_equals_linen_for_every_pair_of_options(case):
    """The nnx TransformerLM with the linen parameters gives the linen logits, full and decoded,
    over the same covering design."""
    outputs = case_outputs(case)
    np.testing.assert_allclose(outputs["nnx"], outputs["linen"], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(outputs["nnx_decoded"], outputs["linen_decoded"], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.75])
@pytest.mark.parametrize("per_example", [False, True], ids=["shared", "per_example"])
def test_rope_rotates_as_the_slow_numpy_rotation(fraction, per_example):
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, 3, 8))  # (B, T, heads, H)
    positions = jnp.array([[0, 1, 2, 7, 100], [3, 0, 1, 2, 50]]) if per_example else jnp.arange(5) + 4
    rotated = apply_rope(x, positions, base=10000.0, fraction=fraction)
    np.testing.assert_allclose(rotated, ref.slow_rope(x, positions, 10000.0, fraction), atol=1e-5, rtol=1e-5)
    r = int(8 * fraction)
    np.testing.assert_array_equal(rotated[..., r:], x[..., r:])  # the rest passes unchanged


def test_rope_logits_depend_on_the_distance_only():
    q, k = jax.random.normal(jax.random.PRNGKey(4), (2, 1, 1, 6))
    rope = functools.partial(apply_rope, base=100.0)
    logits = [jnp.sum(rope(q, jnp.array([p + 3])) * rope(k, jnp.array([p]))) for p in (0, 5, 40)]
    np.testing.assert_allclose(logits[1:], [logits[0]] * 2, rtol=1e-5)
    assert not np.isclose(jnp.sum(rope(q, jnp.array([4])) * rope(k, jnp.array([0]))), logits[0])


def test_rotary_dims_must_be_an_even_number_of_at_least_two():
    assert rotary_dims(16, 0.25) == 4
    for head_dim, fraction in ((16, 0.1), (10, 0.5)):  # 1 dim, then 5 dims
        with pytest.raises(ValueError, match=f"rope_fraction={fraction} of head_dim={head_dim}"):
            rotary_dims(head_dim, fraction)


def test_segment_positions_restart_where_the_id_changes():
    ids = np.array([[7, 7, 7, 2, 2, 7, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    expected = np.zeros_like(ids)
    for b, t in np.ndindex(*ids.shape):
        expected[b, t] = 0 if t == 0 or ids[b, t] != ids[b, t - 1] else expected[b, t - 1] + 1
    np.testing.assert_array_equal(segment_positions(ids), expected)


# -------------------------------------------------------------- one layer against float64 NumPy


def numpy_layer(params, x, *, window, rope_base, soft_cap, rms, positions):
    """float64 attention layer: projections, RMS norm of q and k, RoPE, the window, soft cap, sinks."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)

    def project(name):
        return np.einsum("btd,dnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]

    def rms_norm(v, scale):
        return v / np.sqrt(np.mean(v**2, axis=-1, keepdims=True) + 1e-6) * scale

    query, key, value = project("query"), project("key"), project("value")
    if rms:
        query, key = rms_norm(query, p["query_ln"]["scale"]), rms_norm(key, p["key_ln"]["scale"])
    query, key = (ref.slow_rope(x, positions, rope_base, 1.0) for x in (query, key))
    T = x.shape[1]
    allowed = ref.allowed_pairs((x.shape[0],), N, T, T, is_causal=True, window=window)
    heads, _, _ = ref.attention_full(query, key, value, allowed=allowed, soft_cap=soft_cap, sinks=p["sinks"])
    return np.einsum("btnh,nhd->btd", heads, p["out"]["kernel"]) + p["out"]["bias"]


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_attention_layer_with_every_option_equals_float64_numpy(num_kv_heads):
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 7, D))
    options = dict(rope_base=50.0, attn_logits_soft_cap=2.0, use_sinks=True, normalize_qk="rms")
    module = qkv_jax.MultiHeadAttention(
        num_heads=N, num_kv_heads=num_kv_heads, is_causal=True, local_window_size=(2, 0), **options
    )
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), x)["params"]
    rng = np.random.default_rng(6)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.5, s.shape), s.dtype), shapes)
    assert set(params) == {"query", "key", "value", "out", "query_ln", "key_ln", "sinks"}
    assert params["sinks"].shape == (N,) and params["query_ln"]["scale"].shape == (D // N,)
    expected = numpy_layer(
        params, x, window=(2, 0), rope_base=50.0, soft_cap=2.0, rms=True, positions=np.arange(7)
    )
    np.testing.assert_allclose(module.apply({"params": params}, x), expected, atol=1e-5, rtol=1e-5)


def test_sinks_start_at_zero_and_take_weight_from_the_keys():
    x = jax.random.normal(jax.random.PRNGKey(7), (1, 4, D))
    module = qkv_jax.MultiHeadAttention(num_heads=N, is_causal=True, use_sinks=True)
    params = module.init(jax.random.PRNGKey(8), x)["params"]
    np.testing.assert_array_equal(params["sinks"], np.zeros(N))
    params = {**params, "sinks": jnp.array([-50.0, 0.0, 1.0, 50.0])}
    _, state = module.apply({"params": params}, x, sow_weights=True, mutable=["intermediates"])
    on_keys = np.asarray(state["intermediates"]["attention_weights"][0]).sum(axis=-1)  # (1, N, T)
    np.testing.assert_allclose(on_keys[0, 0], 1.0, rtol=1e-6)  # a sink of -50 takes nothing
    np.testing.assert_allclose(on_keys[0, 3], 0.0, atol=1e-6)  # one of +50 takes everything
    assert np.all(on_keys[0, 1] > on_keys[0, 2])  # a larger sink takes more


# ------------------------------------------------------------------------- the ring-buffer cache


@pytest.mark.parametrize("lengths", [(1,) * 9, (4, 1, 4), (9,)], ids=["tokens", "chunks", "prefill"])
@pytest.mark.parametrize(
    "variant", [{}, {"num_kv_heads": 1}, {"kv_latent_dim": 5}], ids=["mha", "mqa", "mla"]
)
def test_ring_cache_decodes_as_the_full_window_mask_in_float64(lengths, variant):
    """A window of 3 keys keeps 3 slots; decoding 9 positions (wrapping the ring three times) gives
    float64 NumPy attention under the full [T, S] window mask."""
    x = jax.random.normal(jax.random.PRNGKey(9), (2, 9, D))
    module = qkv_jax.MultiHeadAttention(num_heads=N, is_causal=True, local_window_size=(2, 0), **variant)
    variables = module.init(jax.random.PRNGKey(10), x, decode=True)
    params, cache = variables["params"], variables["cache"]
    assert all(c.shape[1] == 3 for name, c in cache.items() if name != "cache_index")
    pieces, start = [], 0
    for length in lengths:
        output, state = module.apply(
            {"params": params, "cache": cache}, x[:, start : start + length], decode=True, mutable=["cache"]
        )
        pieces.append(output)
        cache, start = state["cache"], start + length
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x64 = np.asarray(x, np.float64)
    latent = x64 @ p["kv_latent"]["kernel"] + p["kv_latent"]["bias"] if variant.get("kv_latent_dim") else x64
    key = np.einsum("btc,ckh->btkh", latent, p["key"]["kernel"]) + p["key"]["bias"]
    value = np.einsum("btc,ckh->btkh", latent, p["value"]["kernel"]) + p["value"]["bias"]
    query = np.einsum("btd,dnh->btnh", x64, p["query"]["kernel"]) + p["query"]["bias"]
    allowed = ref.allowed_pairs((2,), N, 9, 9, is_causal=True, window=(2, 0))
    heads, _ = ref.attention(query, key, value, mask=allowed)
    expected = np.einsum("btnh,nhd->btd", heads, p["out"]["kernel"]) + p["out"]["bias"]
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), expected, atol=1e-5, rtol=1e-5)
    assert int(cache["cache_index"]) == 9


def model(**options):
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
    return lm.TransformerLM(lm.TransformerConfig(**{**fields, **options}))


def cached_bytes(cache) -> dict:
    return {
        block: sum(v.nbytes for name, v in layer["attention"].items() if name.startswith("cached_"))
        for block, layer in cache.items()
        if block.startswith("block_")
    }


def test_local_layers_cache_their_window_and_global_layers_max_len():
    def kv_bytes(positions, kv_heads):  # batch 2, keys and values of depth D // N in float32
        return 2 * positions * kv_heads * (D // N) * 2 * 4

    for max_len in (MAX_LEN, 4 * MAX_LEN):
        mixed = lm.init_cache(model(window=(3, None), num_kv_heads=2, max_len=max_len), 2)
        assert cached_bytes(mixed) == {"block_0": kv_bytes(3, 2), "block_1": kv_bytes(max_len, 2)}
        local = model(window=3, positions="rope", max_len=max_len)
        assert cached_bytes(lm.init_cache(local, 2)) == {"block_0": kv_bytes(3, N), "block_1": kv_bytes(3, N)}
        assert lm.kv_cache_bytes(local, 2) == 2 * kv_bytes(3, N)  # the same for every max_len
    wide = lm.init_cache(model(window=100), 2)  # a window wider than max_len: an ordinary cache
    assert cached_bytes(wide)["block_0"] == kv_bytes(MAX_LEN, N)


@pytest.mark.slow
def test_local_only_models_without_learned_positions_decode_past_max_len():
    short, long_tokens = model(window=3, positions="rope", max_len=4), jnp.tile(TOKENS, (1, 2))  # (B, 24)
    assert lm.decode_capacity(short.config) is None
    params = random_params(short)

    @compile_once
    def full_and_decoded(params, tokens):
        def step(cache, chunk):
            logits, variables = short.apply(
                {"params": params, "cache": cache}, chunk, decode=True, mutable=["cache"]
            )
            return logits, variables["cache"]

        return short.apply({"params": params}, tokens), decode_in_chunks(
            step, lm.init_cache(short, B), tokens
        )

    full, decoded = full_and_decoded(params, long_tokens)  # 24 positions through a cache of 3 per layer
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=1e-5)
    sampled = lm.generate(short, params, TOKENS[:, :3], 10, rng=jax.random.PRNGKey(0), temperature=0.0)
    assert sampled.shape == (B, 10)  # 12 positions through a model of max_len 4
    for bounded in (model(window=3, max_len=4), model(window=(3, None), positions="rope", max_len=4)):
        assert lm.decode_capacity(bounded.config) == 4
        with pytest.raises(ValueError, match="past the model's max_len=4"):
            lm.generate(bounded, random_params(bounded), TOKENS[:, :3], 10, rng=jax.random.PRNGKey(0))


# ------------------------------------------------------------------------- packed sequences


@pytest.mark.parametrize("positions", ["learned", "rope", "none"])
def test_a_packed_row_equals_its_documents_run_alone(positions):
    """Documents of 5, 4 and 3 tokens packed in one row of 12: each one's logits are those of the
    document alone (no attention across segments, positions restarting at 0), in linen and nnx.
    Alone, each document starts a row of its own (a causal model's later tokens cannot reach it)."""
    packed = model(positions=positions, window=(3, None), use_sinks=True, num_kv_heads=2)
    ids = jnp.array([[0] * 5 + [1] * 4 + [2] * 3, [4] * 12])
    bounds = ((0, 5), (5, 9), (9, 12))
    alone = jnp.stack([jnp.roll(TOKENS[0], -start) for start, _ in bounds])  # (3, 12)

    @compile_once
    def run(params):
        twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(packed.config, rngs=nnx.Rngs(0)))
        return (
            packed.apply({"params": params}, TOKENS, segment_ids=ids),  # (B, 12, V)
            packed.apply({"params": params}, jnp.concatenate([alone, TOKENS[1:]])),  # (4, 12, V)
            twin(TOKENS, segment_ids=ids),
        )

    logits, separate, from_nnx = run(random_params(packed))
    for document, (start, stop) in enumerate(bounds):
        np.testing.assert_allclose(
            logits[0, start:stop], separate[document, : stop - start], atol=1e-5, rtol=1e-5
        )
    np.testing.assert_allclose(logits[1], separate[3], atol=1e-5, rtol=1e-5)  # one segment: the row
    np.testing.assert_allclose(from_nnx, logits, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_attention_scale_multiplies_the_logits_in_the_full_pass_the_cache_and_nnx():
    """attention_scale=s is the default model (1/sqrt(head_dim)) with W_q and b_q multiplied by
    s * sqrt(head_dim): the logits are linear in the query (RoPE too). Checked in the full pass,
    in cached decoding and in the nnx twin, with grouped K/V and RoPE."""
    fields = dict(vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=N, max_len=MAX_LEN)
    scaled = lm.TransformerConfig(**fields, num_kv_heads=2, positions="rope", attention_scale=1.0)
    plain = lm.TransformerLM(dataclasses.replace(scaled, attention_scale=None))
    model = lm.TransformerLM(scaled)
    params = random_params(model)
    factor = 1.0 * (D // N) ** 0.5

    def fold(name, block):  # W_q and b_q of every block times `factor`
        if not name.startswith("block_"):
            return block
        query = jax.tree.map(lambda x: x * factor, block["attention"]["query"])
        return {**block, "attention": {**block["attention"], "query": query}}

    folded = {name: fold(name, block) for name, block in params.items()}

    def step(cache, chunk):
        logits, variables = model.apply(
            {"params": params, "cache": cache}, chunk, decode=True, mutable=["cache"]
        )
        return logits, variables["cache"]

    @compile_once
    def run():
        twin = qnnx.linen_to_nnx({"params": params}, qnnx.TransformerLM(scaled, rngs=nnx.Rngs(0)))
        return (
            model.apply({"params": params}, TOKENS),
            plain.apply({"params": folded}, TOKENS),
            decode_in_chunks(step, lm.init_cache(model, B), TOKENS),
            twin(TOKENS),
        )

    logits, plain_logits, decoded, from_nnx = run()
    np.testing.assert_allclose(logits, plain_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(decoded, logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(from_nnx, logits, atol=1e-6, rtol=1e-6)
    assert not np.allclose(logits, plain.apply({"params": params}, TOKENS), atol=1e-3)  # it matters


# ----------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(positions="rope", kv_latent_dim=8), "RoPE with MLA is not defined without DeepSeek-V2"),
        (dict(positions="alibi"), "positions='alibi' must be one of learned, rope, none"),
        (dict(positions="rope", rope_base=0), "rope_base=0 must be a finite number > 0"),
        (dict(positions="rope", rope_fraction=0.1), "rope_fraction=0.1 of head_dim=4 rotates 0 dims"),
        (dict(window=0), "window=0 must be None, an int >= 1"),
        (dict(window=(3, "full")), r"window=\(3, 'full'\) must be None"),
        (dict(window=()), r"window=\(\) must be None"),
        (
            dict(normalize_qk="l2"),
            "normalize_qk='l2' must be False, True, 'layernorm', 'rms' or 'rms_offset'",
        ),
        (dict(normalize_qk="rms", kv_latent_dim=8), "normalize_qk='rms' with kv_latent_dim=8 needs"),
        (dict(attn_logits_soft_cap=-1.0), "attn_logits_soft_cap=-1.0 must be a finite number > 0"),
        (dict(use_sinks=1), "use_sinks=1 must be True or False"),
        (dict(attention_scale=0.0), "attention_scale=0.0 must be a finite number > 0"),
        (dict(attention_scale=True), "attention_scale=True must be a finite number > 0"),
        (
            dict(use_sinks=True, attention_implementation="xla"),
            "attention_implementation='xla' .jax.nn's. has no",
        ),
    ],
)
def test_config_refuses_undefined_variants_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as caught:
        model(**options)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(rope_base=10000.0, kv_latent_dim=4), "RoPE with MLA is not defined without DeepSeek-V2"),
        (dict(local_window_size=(-1, 0)), r"local_window_size=\(-1, 0\) must not be negative"),
        (dict(rope_fraction=1.5), "rope_fraction=1.5 must be a number in"),
        (dict(attention_fn=lambda q, k, v, mask=None: q, use_sinks=True), "takes no `sinks` argument"),
    ],
)
def test_modules_refuse_undefined_variants_linen_and_nnx(fields, message):
    with pytest.raises(ValueError, match=message):
        qkv_jax.MultiHeadAttention(num_heads=N, **fields)
    with pytest.raises(ValueError, match=message):
        qnnx.MultiHeadAttention(num_heads=N, in_features=D, rngs=nnx.Rngs(0), **fields)


def test_segment_ids_are_refused_when_decoding():
    packed = model()
    params = random_params(packed)
    with pytest.raises(ValueError, match="segment_ids with decode=True"):
        packed.apply(
            {"params": params, "cache": lm.init_cache(packed, B)},
            TOKENS,
            decode=True,
            segment_ids=jnp.zeros_like(TOKENS),
            mutable=["cache"],
        )
    with pytest.raises(ValueError, match="segment_ids must be integers of the tokens' shape"):
        packed.apply({"params": params}, TOKENS, segment_ids=jnp.zeros((B, 3), jnp.int32))


# ------------------------------------------------------------------------------- the config


def test_the_model_section_spells_every_variant():
    section = common.transformer(num_layers=3, d_model=D, num_heads=N, max_len=MAX_LEN).to_dict()
    section.update(positions="rope", rope_fraction=0.5, window="5, full", normalize_qk="rms", use_sinks=True)
    section.update(attn_logits_soft_cap=30.0, attention_scale=1.0)
    config = transformer_config(section, VOCAB)
    assert config.attention_scale == 1.0 and lm.attention_options(config)["scale"] == 1.0
    assert (config.positions, config.rope_base, config.rope_fraction) == ("rope", 10000.0, 0.5)
    assert config.window == (5, None) and lm.layer_windows(config) == (5, None, 5)
    assert (config.normalize_qk, config.attn_logits_soft_cap, config.use_sinks) == ("rms", 30.0, True)
    assert lm.attention_options(config, 2)["local_window_size"] == (4, 0)
    defaults = transformer_config(common.transformer(num_layers=2, d_model=D, num_heads=N, max_len=8), VOCAB)
    assert (defaults.positions, defaults.window, defaults.normalize_qk, defaults.use_sinks) == (
        "learned",
        None,
        False,
        False,
    )
    assert transformer_config({**section, "window": "7"}, VOCAB).window == 7
    assert transformer_config({**section, "window": "full"}, VOCAB).window is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("window", "64,global", r"model.window='64,global': expected comma-separated window sizes"),
        ("window", "²", r"model.window='²': expected"),
        ("window", "0,full", r"model.window=\(0, None\) must be None"),
        ("normalize_qk", "l2", "model.normalize_qk='l2': unknown; choose one of none, layernorm, rms"),
        ("positions", "alibi", "model.positions='alibi' must be one of learned, rope, none"),
        ("rope_base", float("inf"), "model.rope_base=inf must be a finite number > 0"),
        ("attn_logits_soft_cap", float("nan"), "model.attn_logits_soft_cap=nan must be a finite number"),
        ("attention_scale", -1.0, "model.attention_scale=-1.0 must be a finite number > 0"),
    ],
)
def test_the_model_section_refuses_in_one_line_naming_the_field(field, value, message):
    section = common.transformer(num_layers=2, d_model=D, num_heads=N, max_len=8).to_dict()
    section.update({"positions": "rope", field: value})
    with pytest.raises(ConfigError, match=message) as caught:
        transformer_config(section, VOCAB)
    assert "\n" not in str(caught.value)


def test_diagnostics_show_a_windows_reach_and_the_sinks_share():
    windowed = model(window=(3, None), use_sinks=True)
    local, full = (
        head_diagnostics(w, sinks=True) for w in layer_attention(windowed, random_params(windowed), TOKENS)
    )
    assert np.all(np.asarray(local["distance"]) <= 2)  # a window of 3 keys: 2 positions back at most
    assert np.all(np.asarray(full["distance"]) > np.asarray(local["distance"]) + 0.5)
    logits = np.random.default_rng(11).normal(size=(2, N, 5, 5))  # (B, N, T, S)
    sinks = np.array([-1.0, 0.0, 0.5, 2.0])
    denominators = np.exp(logits).sum(axis=-1) + np.exp(sinks)[None, :, None]  # (B, N, T)
    weights = np.exp(logits) / denominators[..., None]
    expected = (np.exp(sinks)[None, :, None] / denominators).mean(axis=(0, 2))  # (N,)
    np.testing.assert_allclose(head_diagnostics(weights, sinks=True)["sink_mass"], expected, rtol=1e-5)
    assert "sink_mass" not in head_diagnostics(weights)
