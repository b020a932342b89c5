"""Head ablation: the head mask equals removing the head from W_O, the char LM's eval_head_ablation
equals the loss with that head's W_O rows zeroed, and the report draws it."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_char_lm import small_config as char_lm_small_config

import qkv_jax
from qkv_jax import lm
from qkv_jax.finetune import head_ablation_masks
from qkv_jax.report.run import report_run
from qkv_jax.tasks.char_lm import NATS_PER_BIT, CharLM, load_corpus
from qkv_jax.tasks.transformer import cross_entropy, make_model
from qkv_jax.training import build_setup, train_and_evaluate

B, T, D, N = 2, 6, 8, 4
X = jax.random.normal(jax.random.PRNGKey(0), (B, T, D))
TEXT = "".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400))


def without_head(params, layer_path, head):
    """`params` with head `head`'s rows of W_O (`out/kernel` `[N, Hv, D]`) at `layer_path` zeroed."""
    params = jax.tree.map(lambda x: x, params)
    node = params
    for name in layer_path:
        node = node[name]
    node["out"]["kernel"] = node["out"]["kernel"].at[head].set(0.0)
    return params


@pytest.mark.parametrize("variant", [dict(), dict(num_kv_heads=2), dict(num_kv_heads=2, kv_latent_dim=3)])
def test_a_zero_in_the_head_mask_removes_the_head_from_w_o(variant):
    module = qkv_jax.MultiHeadAttention(num_heads=N, is_causal=True, **variant)
    variables = module.init(jax.random.PRNGKey(1), X, decode=True)
    params = variables["params"]
    full = module.apply({"params": params}, X)
    np.testing.assert_array_equal(module.apply({"params": params}, X, head_mask=jnp.ones(N)), full)
    mask = jnp.ones(N).at[2].set(0.0)
    masked = module.apply({"params": params}, X, head_mask=mask)
    np.testing.assert_allclose(masked, module.apply({"params": without_head(params, (), 2)}, X), atol=1e-6)
    assert np.abs(np.asarray(masked) - np.asarray(full)).max() > 1e-3
    # Per example masks [B, N], and the decode path (for MLA: the absorbed one) takes the mask too.
    per_example = module.apply({"params": params}, X, head_mask=jnp.stack([mask, jnp.ones(N)]))
    np.testing.assert_allclose(per_example, jnp.stack([masked[0], full[1]]), atol=1e-6)
    cache, pieces = variables["cache"], []
    for t in range(T):
        output, state = module.apply(
            {"params": params, "cache": cache},
            X[:, t : t + 1],
            decode=True,
            head_mask=mask,
            mutable=["cache"],
        )
        cache = state["cache"]
        pieces.append(output)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), masked, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_lm_head_mask_is_per_layer_and_head():
    model = lm.TransformerLM(
        lm.TransformerConfig(vocab_size=11, num_layers=2, d_model=16, num_heads=4, max_len=8)
    )
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 0, 11)
    params = model.init(jax.random.PRNGKey(1), tokens)["params"]
    masks = head_ablation_masks(2, 4)
    assert masks.shape == (8, 2, 4) and float(masks[5].sum()) == 7.0 and float(masks[5, 1, 1]) == 0.0
    expected = model.apply({"params": without_head(params, ("block_1", "attention"), 1)}, tokens)
    np.testing.assert_allclose(
        model.apply({"params": params}, tokens, head_mask=masks[5]), expected, atol=1e-5
    )
    expected_shape = r"head_mask has shape \(4, 2\).*\(num_layers, num_heads\) = \(2, 4\)"
    with pytest.raises(ValueError, match=expected_shape):
        model.apply({"params": params}, tokens, head_mask=jnp.ones((4, 2)))


def small_config(path, **overrides):
    """test_char_lm's small config with 2 layers of 2 heads, 2 steps, the head ablation on 6 windows."""
    fields = dict(
        model__num_layers=2,
        model__d_model=16,
        model__num_heads=2,
        model__max_len=24,
        task__seq_len=16,
        train__steps=2,
        train__log_every=1,
        train__checkpoint_every=2,
        eval__num_examples=8,
        eval__sample_length=4,
        eval__ablation_examples=6,
    )
    return char_lm_small_config(path, **{**fields, **overrides})


@pytest.mark.slow
def test_char_lm_ablation_is_the_loss_without_each_heads_w_o_rows(tmp_path):
    text = tmp_path / "code.txt"
    text.write_text(TEXT)
    config = small_config(text).to_dict()
    tokenizer, _, validation = load_corpus(config["data"])
    model = make_model(config["model"], tokenizer.vocab_size)
    task = CharLM(model, tokenizer, seq_len=16, batch_size=4, evaluation=config["eval"])
    params = task.init(jax.random.PRNGKey(0))
    batch = task.windows(jax.random.PRNGKey(1), jnp.asarray(validation), 8)
    ablation = jax.jit(task.head_ablation)(params, batch)

    @jax.jit
    def bits(weights):
        logits = model.apply({"params": weights}, batch["inputs"][:6])
        return cross_entropy(logits, batch["targets"][:6]) / NATS_PER_BIT

    expected = [
        [
            bits(without_head(params, (f"block_{layer}", "attention"), head)) - bits(params)
            for head in range(2)
        ]
        for layer in range(2)
    ]
    np.testing.assert_allclose(ablation, expected, atol=1e-5)
    assert np.abs(np.asarray(expected)).max() > 1e-4
    # The task's evaluation reports it as head_ablation [L, N], unless eval.ablation_examples is 0.
    setup = build_setup(config)
    metrics, _ = jax.eval_shape(setup.evaluate, params, jax.random.PRNGKey(2), setup.data)
    assert metrics["head_ablation"].shape == (2, 2)
    off = build_setup(small_config(text, eval__ablation_examples=0))
    assert "head_ablation" not in jax.eval_shape(off.evaluate, params, jax.random.PRNGKey(2), off.data)[0]


@pytest.mark.slow
def test_summary_report_and_explorer_show_the_ablation(tmp_path):
    text = tmp_path / "code.txt"
    text.write_text(TEXT)
    summary = train_and_evaluate(small_config(text), tmp_path / "run")
    assert np.shape(summary["eval_head_ablation"]) == (2, 2)
    report = report_run(tmp_path / "run")
    assert (tmp_path / "run" / "head_ablation.png").stat().st_size > 1000
    assert "ablation" in report["page"]["diagnostics"]["columns"]
    row = report["page"]["diagnostics"]["rows"][3]
    assert (row["layer"], row["head"]) == (1, 1)
    assert row["ablation"] == pytest.approx(report["eval_head_ablation"][1][1])
    assert json.loads(pathlib.Path(tmp_path / "run" / "summary.json").read_text())["trainable_params"] > 0
