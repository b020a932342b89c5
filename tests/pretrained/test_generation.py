"""`qkv_jax.generation` against transformers' `generate`, on tiny random models written by
transformers (Llama, Gemma 2 with windows and soft caps, GPT-2, Qwen2 with 32,768 positions):
  - three ragged prompts with an end-of-text id that stops one row early: the greedy tokens
    equal transformers' for each row alone and for the left-padded batch with attention_mask;
    the nnx face gives the same tokens, and the log-probabilities are transformers' scores;
  - the cache holds the request's bucket, not the model's positions;
  - another prompt length in the same bucket compiles nothing;
  - 2,000 first tokens drawn under temperature, top_k and top_p follow transformers' filtered
    distribution (chi-square);
  - bad input is one ValueError naming the row or the value;
  - `stream` yields growing prefixes of what `generate` returns.
"""

import dataclasses
import functools
import pathlib
import tempfile

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from scipy import stats
from test_pretrained_families import CASES as FAMILIES
from transformers.generation import logits_process

import qkv_jax.nnx
from qkv_jax import generation, lm
from qkv_jax.pretrained.io import load_pretrained

VOCAB, NEW, LENGTHS = 61, 9, (3, 7, 5)
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=False)
CASES = {
    "llama": (
        transformers.LlamaConfig,
        dict(
            COMMON,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=24,
            rope_parameters=dict(rope_type="default", rope_theta=100.0),
        ),
    ),
    "gemma2": FAMILIES["gemma2"],  # windows of 4, soft caps, sandwich norms
    "gpt2": (
        transformers.GPT2Config,
        dict(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, n_inner=24),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        dict(
            COMMON,
            max_position_embeddings=32768,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=24,
            rope_parameters=dict(rope_type="default", rope_theta=1000.0),
        ),
    ),
}
FAST = "llama"  # the fast tier runs a parametrized test's first case (tests/conftest.py)
PARAMS = [FAST, *(pytest.param(name, marks=pytest.mark.slow) for name in CASES if name != FAST)]


@dataclasses.dataclass
class Built:
    torch_model: transformers.PreTrainedModel
    model: lm.TransformerLM
    params: dict
    prompts: list[np.ndarray]


@functools.cache
def build(name: str) -> Built:
    """The tiny transformers model `name`, saved and loaded into qkv_jax, once per session."""
    root = pathlib.Path(tempfile.mkdtemp())
    config_class, fields = CASES[name]
    torch.manual_seed(0)
    hf_config = config_class(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch_model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in torch_model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    torch_model = torch_model.float().eval()
    torch_model.save_pretrained(root / name)
    config, params = load_pretrained(root / name)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, VOCAB, length) for length in LENGTHS]
    return Built(torch_model, lm.TransformerLM(config), params, prompts)


@pytest.fixture(scope="module", params=PARAMS)
def built(request) -> Built:
    return build(request.param)


def theirs_alone(built: Built, prompt: np.ndarray, eos: int | None, **extra):
    with torch.no_grad():
        return built.torch_model.generate(
            torch.as_tensor(prompt[None]),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0 if eos is None else eos,
            **extra,
        )


def theirs_left_padded(built: Built, eos: int) -> list[np.ndarray]:
    """transformers' batch of the left-padded prompts with attention_mask, each row cut after its
    first end-of-text."""
    width = max(LENGTHS)
    ids = np.zeros((len(LENGTHS), width), np.int64)
    mask = np.zeros_like(ids)
    for i, prompt in enumerate(built.prompts):
        ids[i, width - len(prompt) :], mask[i, width - len(prompt) :] = prompt, 1
    with torch.no_grad():
        out = built.torch_model.generate(
            torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )[:, width:].numpy()
    return [row[: list(row).index(eos) + 1] if eos in row else row for row in out]


def early_end_of_text(built: Built) -> int:
    """An id that row 1 produces 4th when nothing stops it, and that no row produces earlier."""
    free = [theirs_alone(built, p, None)[0, len(p) :].numpy() for p in built.prompts]
    candidates = [t for t in free[1][:4] if all(t not in row[:4] for row in (free[0], free[2]))]
    return int(free[1][3]) if free[1][3] not in free[1][:3] else int(candidates[-1])


def test_ragged_greedy_equals_transformers_alone_and_left_padded(built):
    eos = early_end_of_text(built)
    ours = generation.generate(
        built.model, built.params, built.prompts, NEW, temperature=0.0, eos_token_id=eos
    )
    alone = [theirs_alone(built, p, eos)[0, len(p) :].numpy() for p in built.prompts]
    assert min(len(row) for row in alone) < NEW  # the end-of-text stops a row early
    for mine, reference in zip(ours, alone, strict=True):
        np.testing.assert_array_equal(mine, reference)
    for mine, reference in zip(ours, theirs_left_padded(built, eos), strict=True):
        np.testing.assert_array_equal(mine, reference)


@pytest.mark.slow
def test_nnx_tokens_and_logprobs_equal_transformers():
    built = build("gemma2")
    twin = qkv_jax.nnx.linen_to_nnx(
        {"params": built.params}, qkv_jax.nnx.TransformerLM(built.model.config, rngs=nnx.Rngs(0))
    )
    prompt = built.prompts[1]
    tokens, logprobs = qkv_jax.nnx.generate(twin, [prompt], NEW, temperature=0.0, return_logprobs=True)
    out = theirs_alone(built, prompt, None, output_logits=True, return_dict_in_generate=True)
    np.testing.assert_array_equal(tokens[0], out.sequences[0, len(prompt) :].numpy())
    scores = torch.log_softmax(torch.stack(out.logits, 1)[0], -1).numpy()  # (NEW, V)
    expected = scores[np.arange(NEW), tokens[0]]
    np.testing.assert_allclose(logprobs[0], expected, atol=2e-4)


def test_the_cache_holds_the_requests_bucket_not_the_models_positions():
    model = build("qwen2").model
    assert model.config.max_len == 32768
    request = generation.prepare(model.config, lm.decode_capacity(model.config), [[1, 2, 3]] * 8, 64, None)
    # prompt width 16, output width 64, a chunk of 4: 84 positions, bucketed to 128
    assert request.cache_length == 128 == generation.bucket(16 + 64 + generation.CHUNK_STEPS)
    cache = jax.eval_shape(lambda: lm.init_cache(model, 8, request.cache_length))
    lengths = {leaf.shape[1] for leaf in jax.tree.leaves(cache) if leaf.ndim == 4}
    assert lengths == {128}


@pytest.mark.slow
def test_another_prompt_length_in_the_bucket_compiles_nothing():
    built = build("qwen2")
    greedy = functools.partial(generation.generate, built.model, built.params, temperature=0.0)
    programs = (generation._compiled_start, generation._compiled_finish)  # the prefill and the loop
    before = [program._cache_size() for program in programs]
    greedy(np.ones((2, 17), np.int32), 5)
    compiled = [program._cache_size() for program in programs]
    # each compiled at most once (not at all where another test compiled this signature), and
    # the first call's own compile is the one the call uses
    assert compiled[0] >= 1 and compiled[1] >= 1
    assert compiled[0] - before[0] <= 1 and compiled[1] - before[1] <= 1
    greedy(np.ones((2, 20), np.int32), 6)  # prompt width 32, output 16, prefill 16, batch 2: one bucket
    greedy([np.ones(18, np.int32), np.ones(30, np.int32)], 7)
    assert [program._cache_size() for program in programs] == compiled


def filtered_distribution(built: Built, prompt: np.ndarray, temperature: float, top_k, top_p) -> np.ndarray:
    """transformers' sampling distribution of the first token: its logits through its warpers."""
    with torch.no_grad():
        scores = built.torch_model(torch.as_tensor(prompt[None])).logits[:, -1].double()
    warpers = [logits_process.TemperatureLogitsWarper(temperature)]
    warpers += [logits_process.TopKLogitsWarper(top_k)] if top_k else []
    warpers += [logits_process.TopPLogitsWarper(top_p)] if top_p else []
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores, -1)[0].numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, 0.8), (1.5, 7, None)])
def test_sampled_first_tokens_follow_transformers_filtered_distribution(temperature, top_k, top_p):
    built = build("llama")
    draws, prompt = 2000, built.prompts[1]
    tokens = generation.generate(
        built.model,
        built.params,
        np.tile(prompt, (draws, 1)),
        1,
        rng=jax.random.PRNGKey(0),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    counts = np.bincount(np.asarray(tokens)[:, 0], minlength=VOCAB)
    expected = filtered_distribution(built, prompt, temperature, top_k, top_p)
    assert counts[expected == 0].sum() == 0  # nothing outside the filters
    kept = expected > 0
    assert 1 < kept.sum() < VOCAB  # the filter removed some tokens and left a choice
    p_value = stats.chisquare(counts[kept], draws * expected[kept] / expected[kept].sum()).pvalue
    assert p_value > 0.001, (counts[kept], draws * expected[kept])


@pytest.mark.parametrize(
    "prompts, max_new_tokens, message",
    [
        ([[1, 2], []], 3, "prompt row 1 is empty"),
        ([[1, 2], [3, VOCAB]], 3, f"prompt row 1 holds token {VOCAB}, outside [0, {VOCAB})"),
        ([[1, 2]], 0, "max_new_tokens=0 must be a positive int"),
        (
            [[1] * 20],
            14,
            "a prompt of 20 tokens and max_new_tokens=14 decode 33 positions, past the model's max_len=32",
        ),
    ],
)
def test_bad_input_is_one_value_error_naming_it(prompts, max_new_tokens, message):
    config = lm.TransformerConfig(vocab_size=VOCAB, num_layers=1, d_model=8, num_heads=2, max_len=32)
    with pytest.raises(ValueError) as info:
        generation.generate(lm.TransformerLM(config), None, prompts, max_new_tokens, temperature=0.0)
    assert message in str(info.value)


@pytest.mark.slow
def test_stream_yields_growing_prefixes_of_the_generated_tokens():
    built = build("llama")
    eos = int(generation.generate(built.model, built.params, [built.prompts[0]], NEW, temperature=0.0)[0][6])
    greedy = dict(temperature=0.0, eos_token_id=eos)
    final = generation.generate(built.model, built.params, built.prompts, NEW, **greedy)
    chunks = list(generation.stream(built.model, built.params, built.prompts, NEW, **greedy))
    assert len(chunks) > 2  # the prefill, then a few steps at a time
    for before, after in zip(chunks, chunks[1:], strict=False):
        for row_before, row_after in zip(before, after, strict=True):
            np.testing.assert_array_equal(row_after[: len(row_before)], row_before)
    for row, expected in zip(chunks[-1], final, strict=True):
        np.testing.assert_array_equal(row, expected)
