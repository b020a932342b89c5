"""The windows study: its arms' decode caches, and the study end to end, shrunk."""

import pytest

import studies.windows
from configs import char_lm
from qkv_jax.lm import kv_cache_bytes, layer_windows
from qkv_jax.training.setup import to_dict
from studies.catalogue import STUDIES
from studies.results import write_study_results
from studies.windows import WINDOW_CELLS, _model, windows


def test_each_arms_cache_holds_its_windows_positions_per_layer():
    """A local layer's ring buffer holds its window's w positions (w keys, the query's own among
    them), a global one max_len (128): the arms' cache bytes are in the ratios of their layers'
    positions."""
    base = to_dict(char_lm.get_config("study"))
    models = {cell["model.window"]: _model(base, cell) for cell in WINDOW_CELLS}
    full = kv_cache_bytes(models["full"])
    for window, model in models.items():
        slots = [128 if w is None else min(w, 128) for w in layer_windows(model.config)]
        assert kv_cache_bytes(model) * 2 * 128 == full * sum(slots), window
    assert kv_cache_bytes(models["16"]) < kv_cache_bytes(models["16,full"]) < full


@pytest.mark.slow
def test_windows_study_pairs_each_arm_with_all_global(tmp_path, monkeypatch):
    # Decode speed at one batch size (each size compiles `generate` once per arm).
    monkeypatch.setattr(studies.windows, "DECODE_BATCHES", (1,))
    corpus = tmp_path / "code.txt"
    corpus.write_text("".join(f"def add_{i}(x):\n    return x + {i % 10}\n\n" for i in range(400)))
    config = char_lm.get_config("study")
    config.data.path = str(corpus)
    config.model.update(num_layers=2, d_model=16, num_heads=2, max_len=32)
    config.task.seq_len = 32
    config.train.update(cpu_optimization_level=0, steps=10, log_every=5, checkpoint_every=10, batch_size=8)
    config.eval.update(num_examples=8, sample_length=8, ablation_examples=0)
    results = windows(to_dict(config), tmp_path, [0, 1])
    arms = [r["arm"] for r in results["rows"]]
    assert arms == ["all global", "all local 64", "all local 32", "all local 16", "alternating 16 / full"]
    assert results["rows"][0]["minus_global"]["mean"] == 0.0
    cache = {r["window"]: r["cache_bytes"] for r in results["rows"]}
    assert results["batches"] == [1] and all(r["decode_tokens_per_s_batch1"] > 0 for r in results["rows"])
    assert cache["16"] < cache["16,full"] < cache["full"]
    record = write_study_results(tmp_path, results, "python -m experiments.study windows", STUDIES["windows"])
    assert (tmp_path / "windows.png").exists() and len(record["table"]) == 2 + 5 + 2
