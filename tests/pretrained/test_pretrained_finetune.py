"""Fine-tuning a Hugging Face checkpoint through the launcher (configs/pretrained_text.py): LoRA and
MHA -> GQA uptraining on a text file, `experiments.export` back to a directory transformers loads with
the logits qkv_jax computes, packed documents that attention never crosses, and each bad input as
one line (exit 2)."""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tiny_checkpoints
from in_process import launch_train
from launch import cache_flag, free_port, launcher_env, run_together, two_processes
from page_payload import page_payload

from qkv_jax import load_pretrained
from qkv_jax.finetune import convert_kv_heads
from qkv_jax.lm import TransformerLM
from qkv_jax.lora import merge_lora
from qkv_jax.tasks.pretrained_text import (
    PRETRAINED_DIR,
    pack_documents,
    read_merged,
    read_run,
    split_documents,
    without_adapters,
)
from qkv_jax.training import read_params

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "pretrained" / "two_process_worker.py"
PARAGRAPHS = tiny_checkpoints.TEXT.strip().split("\n\n")
# Documents separated by blank lines: the tiny checkpoints' text, each paragraph with a line of its own.
DOCUMENTS = [f"{PARAGRAPHS[i % 2]}\nHead {i} reads layer {i % 3}." for i in range(30)]
# A few steps of batch 2 on rows of 16 tokens, at a learning rate that moves the logits.
SMALL = [
    "--config.task.seq_len=16",
    "--config.train.steps=4",
    "--config.train.batch_size=2",
    "--config.train.log_every=2",
    "--config.train.checkpoint_every=4",
    "--config.train.warmup_steps=0",
    "--config.train.learning_rate=0.01",
    "--config.eval.num_examples=4",
    "--config.train.cpu_optimization_level=0",  # a tiny model: compile time is most of each run
]
PROBE = np.arange(2, 42, dtype=np.int64).reshape(2, 20) % 90 + 3  # token ids of both vocabularies
# The report's prompt, and its patching prompts (as many tokens, the answers differing) per model.
PROMPT = "The keys and the queries meet"
PATCHING = {"llama": ("The values", "The output"), "gpt2": ("Each head reads the", "The layer copies it")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{"llama": dir, "gpt2": dir} tiny Hugging Face checkpoints, and the text file to fine-tune on."""
    root = tmp_path_factory.mktemp("pretrained")
    directories = {kind: tiny_checkpoints.checkpoint(root / kind, kind) for kind in tiny_checkpoints.KINDS}
    text = root / "text.txt"
    text.write_text("\n\n".join(DOCUMENTS))
    return directories, text


def train(workdir, source, text, *extra):
    return launch_train(
        "--config",
        "configs/pretrained_text.py",
        "--workdir",
        str(workdir),
        f"--config.train.init_from={source}",
        f"--config.data.path={text}",
        *SMALL,
        *extra,
    )


def launch(module, *args):
    return subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", cache_flag(), *args],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def export(workdir, out):
    return launch("export", "--workdir", str(workdir), "--out", str(out))


def assert_close(actual, expected, where=""):
    """Nested dicts and lists equal, their floats and arrays to float32 rounding (attention to
    the page's 1/255 steps)."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), where
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, np.ndarray)) and np.asarray(expected).dtype.kind in "fiu":
        np.testing.assert_allclose(
            np.asarray(actual), np.asarray(expected), rtol=1e-5, atol=1e-6, err_msg=where
        )
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, f"{where}[{i}]")
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected, rel=1e-5, abs=1e-6), where
    else:
        assert actual == expected, where


def read_in_place_and_exported(workdir, exported, out):
    """(config, prompt ids, parameters, the report page's data) of the run's workdir read in
    place, and of the directory its export wrote."""
    from qkv_jax.report.pretrained import load_params, open_pretrained, report_pretrained

    found = []
    for name, directory in (("in place", workdir), ("exported", exported)):
        shape, tok = open_pretrained(directory)
        model, params = load_params(directory)
        config = dataclasses.replace(model.config, dtype=None)  # config.json names float32, a run None
        assert dataclasses.replace(shape.config, dtype=None) == config
        report_pretrained(directory, out / name, PROMPT)
        page = page_payload(out / name / "report.html")
        shown = {key: page[key] for key in page if key not in ("title", "subtitle", "config", "notes")}
        found.append((config, tok.encode(PROMPT).tolist(), params, shown))
    return found


def assert_read_in_place_as_exported(workdir, exported, out):
    """experiments.generate and experiments.report read a fine-tuning run's workdir as the
    directory its export wrote: the same model, tokenizer, weights and report page; returns the
    exported page's data."""
    import jax

    from qkv_jax.report.pretrained import checkpoint_files

    for name in ("tokenizer.json", "generation_config.json"):  # the end-of-text ids among them
        assert (checkpoint_files(workdir) / name).read_bytes() == (
            checkpoint_files(exported) / name
        ).read_bytes()
    in_place, from_export = read_in_place_and_exported(workdir, exported, out)
    assert in_place[:2] == from_export[:2]  # the model's config, the prompt's ids
    assert jax.tree.structure(in_place[2]) == jax.tree.structure(from_export[2])
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7), in_place[2], from_export[2]
    )
    assert_close(in_place[3], from_export[3])
    return from_export[3]


def qkv_logits(workdir):
    """(the trained model's logits, the merged model's) on PROBE, from the newest checkpoint."""
    config, _ = read_run(workdir)
    params = read_params(workdir).tree
    adapted = TransformerLM(config).apply({"params": params}, PROBE.astype(np.int32))
    merged = TransformerLM(without_adapters(config)).apply(
        {"params": merge_lora(params, config.lora_alpha)}, PROBE.astype(np.int32)
    )
    return np.asarray(adapted), np.asarray(merged)


def assert_same_logits(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


# --- Fast checks ------------------------------------------------------------------------------


def test_documents_split_in_order_and_pack_into_rows_with_segment_ids():
    train, validation = split_documents("a\n\n\n\nb\n\nc\n\nd", "\n\n", 0.3)
    assert (train, validation) == (["a", "b"], ["c", "d"])  # ceil(0.3 * 4) = 2 validate; blanks dropped
    assert split_documents("0123456789", "\n\n", 0.2) == (["01234567"], ["89"])
    tokens, segments = pack_documents([np.array([5, 6, 7]), np.array([8, 9]), np.array([10, 11, 12])], 3)
    # 8 tokens in rows of 4 overlapping by one: rows start at 0, 3, 6; the last padded with 0.
    np.testing.assert_array_equal(tokens, [[5, 6, 7, 8], [8, 9, 10, 11], [11, 12, 0, 0]])
    np.testing.assert_array_equal(segments, [[1, 1, 1, 2], [2, 2, 3, 3], [3, 3, 0, 0]])


def test_packed_rows_attend_within_their_documents(sources):
    """A packed row's logits are each document's own logits (positions restart, no attention
    across the boundary), and the loss counts only the pairs within one document."""
    from qkv_jax.tasks.pretrained_text import _targets_of

    directories, _ = sources
    config, params = load_pretrained(directories["llama"])
    model = TransformerLM(config)
    first, second = np.array([[1, 7, 9, 11, 4]]), np.array([[1, 20, 5]])
    row = np.concatenate([first, second], axis=1).astype(np.int32)
    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2]], np.int32)
    packed = np.asarray(model.apply({"params": params}, row, segment_ids=segments))
    for document, start in ((first, 0), (second, 5)):
        alone = np.asarray(model.apply({"params": params}, document.astype(np.int32)))
        assert_same_logits(packed[:, start : start + document.shape[1]], alone)
    batch = _targets_of(np.concatenate([row, [[0]]], 1), np.concatenate([segments, [[0]]], 1))
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 1, 0, 1, 1, 0]])


def test_a_mesh_the_run_cannot_be_split_over_is_refused_before_its_checkpoint(sources, tmp_path):
    """A fine-tuning run's workdir read onto a mesh whose model axis (3) divides neither its 4
    heads nor its 4 K/V heads: one line, before the checkpoint is looked for (there is none)."""
    import jax
    from jax.sharding import Mesh

    from qkv_jax.report.pretrained import load_params
    from qkv_jax.training import ConfigError

    directories, _ = sources
    workdir = tmp_path / "W"
    (workdir / PRETRAINED_DIR).mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"model": {}}))
    shutil.copy(directories["llama"] / "config.json", workdir / PRETRAINED_DIR / "config.json")
    # The check reads the mesh's shape only: this process's one device three times over.
    mesh = Mesh(np.asarray(jax.devices()[:1] * 3).reshape(1, 3), ("data", "model"))
    with pytest.raises(ConfigError) as refused:
        load_params(workdir, mesh=mesh)
    assert str(refused.value) == (
        "mesh model axis=3: must divide num_heads=4 and divide (or be a multiple of) num_kv_heads=4"
    )


def bad(tmp_path, sources, **changes):
    """The error lines of a run whose `changes` ({"path": file, "source": dir, flag: value})
    are bad; nothing is compiled or written."""
    directories, text = sources
    source, path = changes.pop("source", directories["gpt2"]), changes.pop("path", text)
    extra = [f"--config.{name}={value}" for name, value in changes.items()]
    launched = train(tmp_path / "W", source, path, *extra)
    assert launched.code == 2, launched.stderr[-2000:]
    assert not (tmp_path / "W").exists()
    return launched.error_lines


@pytest.mark.reliability(
    "Pretrained checkpoints",
    "fine-tuning a pretrained model on an empty or non-UTF-8 text file, with task.seq_len past the model's "
    "positions, from an init_from that is neither a model directory nor a run, or from a model directory "
    "without tokenizer.json",
    "exit 2, one line naming the cause; nothing written",
)
def test_bad_inputs_are_one_line_each(sources, tmp_path):
    directories, _ = sources
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    assert bad(tmp_path, sources, path=empty) == [
        f"error: data.path={str(empty)!r}: the file is empty; the task trains on its text"
    ]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("The keys meet the queries at the café.".encode("latin-1"))
    assert bad(tmp_path, sources, path=latin) == [
        f"error: data.path={str(latin)!r}: not UTF-8 text (byte 0xe9 at offset 36)"
    ]
    assert bad(tmp_path, sources, **{"task.seq_len": 65}) == [
        "error: task.seq_len=65: longer than the model's 64 positions (max_position_embeddings of "
        f"{directories['gpt2'] / 'config.json'})"
    ]
    neither = tmp_path / "neither"
    neither.mkdir()
    (neither / "notes.txt").write_text("not a model")
    assert bad(tmp_path, sources, source=neither) == [
        f"error: train.init_from={str(neither)!r}: neither a Hugging Face model directory (config.json "
        "beside model.safetensors) nor a run's workdir or checkpoint"
    ]
    untokenized = tmp_path / "untokenized"
    shutil.copytree(directories["gpt2"], untokenized)
    (untokenized / "tokenizer.json").unlink()
    [line] = bad(tmp_path, sources, source=untokenized)
    assert line.startswith(
        f"error: train.init_from={str(untokenized)!r}: {untokenized}: has no tokenizer.json"
    )


@pytest.mark.slow
@pytest.mark.reliability(
    "Pretrained checkpoints",
    "experiments.export into an --out that already holds a file, or from a workdir without checkpoints",
    "exit 2, one line; the file in --out is untouched",
)
def test_export_refuses_an_occupied_out_and_a_workdir_without_checkpoints(sources, tmp_path):
    directories, _ = sources
    workdir = tmp_path / "W"
    (workdir / PRETRAINED_DIR).mkdir(parents=True)
    (workdir / "config.json").write_text(json.dumps({"model": {}}))
    shutil.copy(directories["gpt2"] / "config.json", workdir / PRETRAINED_DIR / "config.json")
    occupied = tmp_path / "saved"
    occupied.mkdir()
    (occupied / "mine.txt").write_text("a user's file")
    done = export(workdir, occupied)
    assert (done.returncode, done.stderr.splitlines()) == (
        2,
        [
            f"error: --out={occupied}: already exists and is not an empty directory; nothing was written "
            "(choose a new directory)"
        ],
    )
    assert sorted(p.name for p in occupied.iterdir()) == ["mine.txt"]
    done = export(workdir, tmp_path / "new")
    assert (done.returncode, done.stderr.splitlines()) == (
        2,
        [f"error: --workdir={str(workdir)!r}: has no checkpoints/ to export"],
    )
    assert not (tmp_path / "new").exists()


# --- End to end -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", tiny_checkpoints.KINDS)
def test_lora_fine_tune_exports_to_transformers_with_the_merged_logits(kind, sources, tmp_path):
    directories, text = sources
    workdir = tmp_path / "W"
    launched = train(workdir, directories[kind], text, "--config.model.lora_rank=4")
    assert launched.code == 0, launched.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["trainable_params"] * 10 < summary["params"]
    assert summary["eval_val_loss"] < summary["untrained"]["eval_val_loss"]
    # Only the adapters trained: the source's kernels are in the checkpoint bit for bit.
    _, original = load_pretrained(directories[kind])
    trained = read_params(workdir).tree["block_1"]["attention"]
    np.testing.assert_array_equal(
        trained["query"]["kernel"], original["block_1"]["attention"]["query"]["kernel"]
    )
    assert np.abs(np.asarray(trained["value"]["lora_b"])).max() > 1e-3

    done = export(workdir, tmp_path / "hf")
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    # The source's tokenizer and end-of-text ids, in the run's pretrained/ and in the export.
    for name in ("tokenizer.json", "generation_config.json"):
        source = (directories[kind] / name).read_bytes()
        assert (workdir / PRETRAINED_DIR / name).read_bytes() == source
        assert (tmp_path / "hf" / name).read_bytes() == source
    adapted, merged = qkv_logits(workdir)
    assert_same_logits(merged, adapted)
    exported = tiny_checkpoints.logits(tiny_checkpoints.load_transformers(tmp_path / "hf"), PROBE)
    assert_same_logits(exported, merged)
    before = tiny_checkpoints.logits(tiny_checkpoints.load_transformers(directories[kind]), PROBE)
    assert np.abs(exported - before).max() > 1e-3 * np.abs(before).max()
    if kind == "llama":  # experiments.generate and experiments.report read the workdir as its export
        assert_read_in_place_as_exported(workdir, tmp_path / "hf", tmp_path / "reports")


def assert_placed_on_two_processes(workdir, out):
    """tests/pretrained/two_process_worker.py reads `workdir` on 2 processes x 4 CPU devices onto a
    (2, 4) mesh: each process's parameters are global arrays split by `param_shardings`, it holds
    only its own devices' blocks (half of every matrix split over "data"), the logits on PROBE
    equal one process's `read_merged(workdir)` (1e-5 of the largest), and a mesh over some of
    each process's devices is refused."""
    import jax

    out.mkdir()
    spec = {"workdir": str(workdir), "tokens": PROBE.tolist(), "out": str(out)}
    processes, outputs = two_processes(WORKER, spec, timeout=600)
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    config, params, _ = read_merged(workdir)
    expected = np.asarray(TransformerLM(config).apply({"params": params}, PROBE.astype(np.int32)))
    names = ["/".join(k.key for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    for i in range(2):
        result = json.loads((out / f"process_{i}.json").read_text())
        assert result["devices"] == 8 and sorted(result["held"]) == sorted(names)
        held = result["held"]
        misplaced = [
            name
            for name, leaf in held.items()
            if (leaf["owners"], leaf["global"], leaf["as_rules"]) != ([i], True, True)
        ]
        assert not misplaced, misplaced
        query = held["block_0/attention/query/kernel"]  # d_model split over "data" (2): half here
        assert query["bytes"] * 2 == query["whole"]
        assert result["refused"] == (
            "mesh of 4 devices over 2 processes: a mesh across processes must hold all 8 devices of "
            "the 2 processes"
        )
        assert_same_logits(np.asarray(result["logits"]), expected)


@pytest.mark.slow
def test_lora_fine_tune_on_two_processes_ends_at_the_one_device_loss(sources, tmp_path):
    """The launcher on 2 processes x 2 CPU devices (jax.distributed over gloo), a (2, 2) mesh,
    reading the checkpoint onto it: the one-device run's losses (1e-5), and its export (read by
    one process) loads in transformers to the one-device export's logits. Its workdir read by 2
    processes x 4 CPU devices onto a (2, 4) mesh (`read_merged(mesh=...)`): every parameter a
    global array split as `param_shardings` splits it, each process holding only its own
    devices' blocks, with the logits of the workdir read by one process."""
    directories, text = sources
    one = train(tmp_path / "one", directories["llama"], text, "--config.model.lora_rank=4")
    assert one.code == 0, one.stderr[-3000:]
    port, args = (
        free_port(),
        [f"--config.train.init_from={directories['llama']}", f"--config.data.path={text}"],
    )
    mesh = ["--config.mesh.data=2", "--config.mesh.model=2", "--config.model.lora_rank=4", *SMALL, *args]
    commands = [
        [sys.executable, "-m", "experiments.train", cache_flag(), "--config", "configs/pretrained_text.py"]
        + ["--workdir", str(tmp_path / "two"), "--num_cpu_devices=2", f"--coordinator=127.0.0.1:{port}"]
        + ["--num_processes=2", f"--process_id={i}", *mesh]
        for i in range(2)
    ]
    processes, outputs = run_together(commands, 600)
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    losses = {
        name: [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").open()) if "loss" in r]
        for name in ("one", "two")
    }
    assert len(losses["one"]) == len(losses["two"]) > 0
    np.testing.assert_allclose(losses["two"], losses["one"], rtol=1e-5, atol=1e-5)
    assert_placed_on_two_processes(tmp_path / "two", tmp_path / "placed")
    for name in ("one", "two"):
        done = export(tmp_path / name, tmp_path / f"{name}_hf")
        assert done.returncode == 0, done.stderr[-2000:]
    exported = {
        name: tiny_checkpoints.logits(tiny_checkpoints.load_transformers(tmp_path / f"{name}_hf"), PROBE)
        for name in ("one", "two")
    }
    assert_same_logits(exported["two"], exported["one"])


@pytest.mark.slow
def test_mha_converted_to_gqa_uptrains_and_exports_with_the_new_kv_heads(sources, tmp_path):
    directories, text = sources
    workdir = tmp_path / "W"
    launched = train(
        workdir,
        directories["llama"],
        text,
        "--config.train.convert_kv_heads=True",
        "--config.model.num_kv_heads=2",
    )
    assert launched.code == 0, launched.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["trainable_params"] == summary["params"]
    # The uptraining started from the mean-pooled heads: its key kernel is [D, 2, H].
    assert read_params(workdir).tree["block_0"]["attention"]["key"]["kernel"].shape == (16, 2, 4)

    done = export(workdir, tmp_path / "hf")
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        "llama",
        4,
        2,
    )
    _, merged = qkv_logits(workdir)
    model = tiny_checkpoints.load_transformers(tmp_path / "hf")
    assert model.config.num_key_value_heads == 2
    assert_same_logits(tiny_checkpoints.logits(model, PROBE), merged)
    # Uptraining moved the pooled heads: the exported logits are not those of the converted source.
    source_config, source_params = load_pretrained(directories["llama"])
    pooled = TransformerLM(dataclasses.replace(source_config, num_kv_heads=2)).apply(
        {"params": convert_kv_heads(source_params, 2)}, PROBE.astype(np.int32)
    )
    assert np.abs(merged - np.asarray(pooled)).max() > 1e-3 * np.abs(merged).max()
    # The launchers on the workdir itself: what they print and write is the export's.
    page = assert_read_in_place_as_exported(workdir, tmp_path / "hf", tmp_path / "reports")
    prompt = ["--workdir", str(workdir), "--prompt", PROMPT]
    generated = launch(
        "generate", *prompt, "--temperature", "0", "--max_new_tokens", "12", "--print_token_ids"
    )
    assert generated.returncode == 0, generated.stderr
    ids = tiny_checkpoints.tokenizer("llama").encode(PROMPT).ids
    greedy = tiny_checkpoints.greedy(tmp_path / "hf", np.asarray(ids), 12)
    expected = tiny_checkpoints.until_end_of_text(tmp_path / "hf", greedy)
    assert generated.stdout.splitlines()[-1] == "token ids: " + " ".join(map(str, expected))
    # On a (2, 2) mesh of 4 simulated devices, the 2 K/V heads split over the model axis: the
    # one-device tokens, and (report) the one-device page.
    mesh = ["--mesh=2,2", "--num_cpu_devices=4"]
    on_mesh = launch(
        "generate", *prompt, "--temperature", "0", "--max_new_tokens", "12", "--print_token_ids", *mesh
    )
    assert on_mesh.returncode == 0, on_mesh.stderr
    assert on_mesh.stdout.splitlines()[-1] == generated.stdout.splitlines()[-1]
    reported = launch("report", *prompt, *mesh)
    assert reported.returncode == 0, reported.stderr
    report = json.loads((workdir / "report.json").read_text())
    assert report["prompt_ids"] == ids and report["eval_val_loss"] == pytest.approx(summary["eval_val_loss"])
    shown = page_payload(workdir / "report.html")
    assert_close({key: shown[key] for key in page}, page)
    # A run of this task as init_from: its model (2 K/V heads) and weights, no conversion asked.
    launched = train(tmp_path / "W2", workdir, text, "--config.train.steps=1")
    assert launched.code == 0, launched.stderr[-3000:]
    continued = json.loads((tmp_path / "W2" / "summary.json").read_text())
    assert continued["untrained"]["eval_val_loss"] == pytest.approx(summary["eval_val_loss"], abs=1e-5)
