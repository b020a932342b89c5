"""`experiments.generate --pretrained` and `experiments.report --pretrained`, as a user types them.

On the tiny Llama and GPT-2 directories of tests/tiny_checkpoints.py (trained BPE tokenizers):
  - generate at temperature 0 prints the token ids transformers' greedy `generate` picks, and
    the decoded prompt and tokens;
  - report writes report.json and report.html: the head diagnostics of the prompt against
    transformers' own attention weights (`output_attentions`), the page's attention
    against them too, and the patching share of every head against a patched run of
    transformers' model (a forward pre-hook on the output projection swaps one head's
    clean output in), so nothing qkv_jax computes checks itself;
  - each bad input is one line on stderr and exit code 2, and so is --mesh with a run that reads
    on one device (a char_lm run, a sweep) or, for report, a fine-tuning run without --prompt.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tiny_checkpoints
from launch import ROOT, cache_flag, launcher_env
from page_payload import page_payload

PROMPT = "The keys and the queries meet"
# (clean, corrupted): as many tokens, and the two most likely next tokens differ, for each model.
# Prompts whose greedy continuation is more than one token repeated, for each model.
CONTINUED = {"llama": "The keys and", "gpt2": "A head"}
PATCHING = {"llama": ("The values", "The output"), "gpt2": ("Each head reads the", "The layer copies it")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {kind: tiny_checkpoints.checkpoint(root / kind, kind) for kind in tiny_checkpoints.KINDS}


def launch(module, *args):
    return subprocess.run(  # noqa: PLW1510 - the tests read returncode
        [sys.executable, "-m", f"experiments.{module}", cache_flag(), *args],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def tokenizer(directory):
    from qkv_jax.pretrained import load_tokenizer

    return load_tokenizer(directory)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,mesh",
    [
        ("llama", ()),
        ("gpt2", ()),
        # Loaded onto a (2, 2) mesh of 4 simulated devices: the same tokens.
        ("llama", ("--mesh=2,2", "--num_cpu_devices=4")),
    ],
    ids=["llama", "gpt2", "llama-mesh"],
)
def test_generate_at_temperature_zero_is_transformers_greedy(checkpoints, kind, mesh):
    """The greedy tokens; the Llama (64 positions, as docs/pretrained.md's stand-in) without
    --max_new_tokens: 200 clipped to the positions left after the prompt, with a one-line notice."""
    directory = checkpoints[kind]
    ids = tokenizer(directory).encode(CONTINUED[kind])
    args = ["--pretrained", str(directory), "--prompt", CONTINUED[kind], "--temperature", "0", *mesh]
    length = ["--max_new_tokens", "12"] if kind == "gpt2" else []
    result = launch("generate", *args, *length, "--num_samples", "2", "--print_token_ids")
    assert result.returncode == 0, result.stderr
    left = 64 - len(ids) + 1  # the last new token needs no position of its own
    notice = f"warning: --max_new_tokens={left}, not 200: the positions the model's max_len=64 leaves after"
    notices = [line for line in error_lines(result) if not line.startswith("speed: ")]
    assert notices == ([f"{notice} the prompt's {len(ids)} tokens"] if not length else [])
    lines = result.stdout.splitlines()
    assert lines[0] == f"--- sample 0 ({directory}, temperature 0.0)"
    samples = [
        [int(t) for t in line.split(": ", 1)[1].split()] for line in lines if line.startswith("token ids")
    ]
    greedy = tiny_checkpoints.greedy(directory, ids, 12 if length else left)
    expected = tiny_checkpoints.until_end_of_text(directory, greedy)
    assert samples == [expected, expected]
    assert len(set(expected)) > 2  # a continuation, not one token repeated
    text = tokenizer(directory).decode(np.concatenate([ids, expected]))
    first_ids = next(i for i, line in enumerate(lines) if line.startswith("token ids"))
    assert "\n".join(lines[1:first_ids]) == text


@pytest.mark.slow
def test_generate_streams_and_stops_at_the_directorys_end_of_text(checkpoints, tmp_path):
    """The end-of-text id of generation_config.json (here the greedy continuation's third token)
    ends the sample there; the heading comes out before the decoding ends, and a line on stderr
    gives the time to the first token and the tokens per second."""
    directory = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], directory)
    ids = tokenizer(directory).encode(CONTINUED["llama"])
    greedy = tiny_checkpoints.greedy(directory, ids, 12)
    end = greedy[2]
    assert end not in greedy[:2]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 0]}))
    args = ["--pretrained", str(directory), "--prompt", CONTINUED["llama"], "--temperature", "0"]
    with subprocess.Popen(
        [sys.executable, "-m", "experiments.generate", cache_flag(), *args, "--print_token_ids"],
        cwd=ROOT,
        env=launcher_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        heading = process.stdout.readline()
        running_after_heading = process.poll() is None
        rest, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors
    assert heading == f"--- sample 0 ({directory}, temperature 0.0)\n" and running_after_heading
    assert rest.splitlines()[-1] == "token ids: " + " ".join(map(str, greedy[:3]))
    text = "\n".join(rest.splitlines()[:-1])
    assert text == tokenizer(directory).decode(np.concatenate([ids, greedy[:3]]))
    speed = [line for line in errors.splitlines() if line.startswith("speed: ")]
    assert len(speed) == 1 and "first new token" in speed[0] and "tokens/s" in speed[0]


@pytest.mark.slow
def test_generate_past_the_models_positions_is_one_line(checkpoints):
    result = launch(
        "generate",
        "--pretrained",
        str(checkpoints["llama"]),
        "--prompt",
        "The keys",
        "--max_new_tokens",
        "62",
    )
    assert result.returncode == 2 and error_lines(result) == [
        "error: generate: a prompt of 4 tokens and max_new_tokens=62 decode 65 positions, past the "
        "model's max_len=64"
    ]


def hf_attention(directory, ids):
    """transformers' attention weights `[L, N, T, T]` (float64) on `ids` `[T]`."""
    import torch

    model = tiny_checkpoints.load_transformers(directory)
    with torch.no_grad():
        out = model(torch.as_tensor(ids[None], dtype=torch.long), output_attentions=True)
    return np.stack([a[0].double().numpy() for a in out.attentions])


def hf_patching(directory, clean, corrupted):
    """(answer, contrast, clean and corrupted logit differences, restored `[L, N]`) with each
    head's input to transformers' output projection (its z) taken from the clean run."""
    import torch

    model = tiny_checkpoints.load_transformers(directory)
    config = model.config
    if config.model_type == "llama":
        projections = [layer.self_attn.o_proj for layer in model.model.layers]
    else:
        projections = [block.attn.c_proj for block in model.transformer.h]
    heads, width = config.num_attention_heads, config.hidden_size // config.num_attention_heads

    def logits(ids, hook=None, layer=None):
        handle = None if hook is None else projections[layer].register_forward_pre_hook(hook)
        try:
            with torch.no_grad():
                return model(torch.as_tensor(ids[None], dtype=torch.long)).logits[0, -1].double().numpy()
        finally:
            if handle is not None:
                handle.remove()

    captured = {}

    def capture(layer):
        def hook(module, inputs):
            captured[layer] = inputs[0].clone()

        return hook

    for layer in range(len(projections)):
        logits(clean, capture(layer), layer)
    clean_logits, corrupted_logits = logits(clean), logits(corrupted)
    answer, contrast = int(clean_logits.argmax()), int(corrupted_logits.argmax())
    difference = lambda values: values[answer] - values[contrast]  # noqa: E731
    restored = np.zeros((len(projections), heads))
    for layer in range(len(projections)):
        for head in range(heads):

            def patch(module, inputs, layer=layer, head=head):
                z = inputs[0].clone()
                z[..., head * width : (head + 1) * width] = captured[layer][
                    ..., head * width : (head + 1) * width
                ]
                return (z,)

            patched = difference(logits(corrupted, patch, layer))
            restored[layer, head] = (patched - difference(corrupted_logits)) / (
                difference(clean_logits) - difference(corrupted_logits)
            )
    return answer, contrast, difference(clean_logits), difference(corrupted_logits), restored


def run_report(directory, out, kind, *extra):
    clean, corrupted = PATCHING[kind]
    args = ["--pretrained", str(directory), "--out", str(out), "--prompt", PROMPT, *extra]
    return launch("report", *args, "--clean", clean, "--corrupted", corrupted)


@pytest.mark.parametrize(
    "kind,mesh",
    [
        pytest.param("llama", (), marks=pytest.mark.slow, id="llama"),
        pytest.param("gpt2", (), marks=pytest.mark.slow, id="gpt2"),
        # Loaded onto a (2, 2) mesh of 4 simulated devices: the same report.
        pytest.param("llama", ("--mesh=2,2", "--num_cpu_devices=4"), marks=pytest.mark.slow, id="llama-mesh"),
    ],
)
def test_report_matches_transformers(checkpoints, tmp_path, kind, mesh):
    directory, out = checkpoints[kind], tmp_path / "report"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = run_report(directory, out, kind, *mesh)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "report.html", "report.json"]
    assert (out / "notes.txt").read_text() == "mine"
    report = json.loads((out / "report.json").read_text())
    assert set(report) == {
        "checkpoint",
        "model_type",
        "prompt",
        "prompt_ids",
        "prompt_tokens",
        "head_distance",
        "head_entropy",
        "head_first_token",
        "head_induction",
        "head_max_weight",
        "head_previous_token",
        "patching",
    }
    tok = tokenizer(directory)
    ids = tok.encode(PROMPT)
    assert report["model_type"] == kind and report["prompt_ids"] == ids.tolist()
    assert report["prompt_tokens"] == tok.token_strings(ids)

    # The head diagnostics of the prompt, from transformers' attention weights.
    weights = hf_attention(directory, ids)  # (L, N, T, T)
    positions = np.arange(len(ids))
    entropy = -np.sum(np.where(weights > 0, weights * np.log(np.where(weights > 0, weights, 1)), 0), -1)
    previous = np.concatenate(
        [np.zeros_like(weights[..., :1, 0]), weights[..., positions[1:], positions[:-1]]], -1
    )
    distance = np.sum(weights * np.abs(positions[:, None] - positions[None, :]), -1)
    expected = {
        "head_entropy": entropy.mean(-1),
        "head_previous_token": previous.mean(-1),
        "head_first_token": weights[..., 0].mean(-1),
        "head_distance": distance.mean(-1),
        "head_max_weight": weights.max(-1).mean(-1),
    }
    for name, values in expected.items():
        np.testing.assert_allclose(report[name], values, rtol=1e-4, atol=1e-6, err_msg=name)
    induction = np.asarray(report["head_induction"])
    assert induction.shape == weights.shape[:2] and np.all((induction >= 0) & (induction <= 1))

    # Patching, against transformers' model with one head's clean output swapped in at a time.
    answer, contrast, clean_difference, corrupted_difference, restored = hf_patching(
        directory, *(tok.encode(text) for text in PATCHING[kind])
    )
    patching = report["patching"]
    assert patching["answer"] == tok.token_strings([answer])[0]
    assert patching["contrast"] == tok.token_strings([contrast])[0]
    assert patching["clean"] == tok.token_strings(tok.encode(PATCHING[kind][0]))
    np.testing.assert_allclose(
        [patching["clean_difference"], patching["corrupted_difference"]],
        [clean_difference, corrupted_difference],
        rtol=1e-4,
    )
    np.testing.assert_allclose(patching["restored"], restored, atol=2e-4)
    assert np.abs(restored).max() > 0.05  # some head restores something

    # The page: the prompt's attention as transformers computes it (within the 1/255 steps),
    # token labels from the tokenizer, one checkpoint, no curves.
    data = page_payload(out / "report.html")
    assert [e["name"] for e in data["examples"]] == ["prompt"]
    assert data["examples"][0]["query_tokens"] == tok.token_strings(ids)
    assert len(data["checkpoints"]) == 1 and data["curves"] == {}
    np.testing.assert_allclose(data["checkpoints"][0]["attention"][0], weights, atol=0.5 / 255 + 1e-6)
    assert data["circuits"]["patching"]["restored"] == patching["restored"]
    assert data["config"] == json.loads((directory / "config.json").read_text())


@pytest.mark.slow
def test_report_page_in_the_browser(checkpoints, tmp_path):
    from browser import check_page, launch_browser, missing_reason

    reason = missing_reason()
    if reason is not None:
        if os.environ.get("QKV_JAX_REQUIRE_BROWSER"):
            pytest.fail(f"browser tests required, but {reason}")
        pytest.skip(reason)
    result = run_report(checkpoints["llama"], tmp_path, "llama")
    assert result.returncode == 0, result.stderr
    data = page_payload(tmp_path / "report.html")
    with launch_browser() as browser:
        check_page(browser, tmp_path / "report.html", data)


def copy_without(directory, destination, *left_out):
    shutil.copytree(directory, destination, ignore=shutil.ignore_patterns(*left_out))
    return destination


@pytest.fixture(scope="module")
def broken(checkpoints, tmp_path_factory):
    """Directories that are not what --pretrained needs."""
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("broken")
    extra = copy_without(checkpoints["llama"], root / "extra_token")
    tok = Tokenizer.from_file(str(extra / "tokenizer.json"))
    tok.add_tokens(["<extra>"])  # the id past the model's vocabulary
    tok.save(str(extra / "tokenizer.json"))
    (root / "not_a_checkpoint").mkdir()
    (root / "not_a_checkpoint" / "notes.txt").write_text("hello")
    return {
        "extra_token": extra,
        "no_tokenizer": copy_without(checkpoints["llama"], root / "no_tokenizer", "tokenizer.json"),
        "not_a_checkpoint": root / "not_a_checkpoint",
    }


def bad(name, module, args, expected):
    return pytest.param(module, args, expected, id=f"{module}: {name}")


LLAMA, OUT = "{llama}", "{out}"
BAD_INPUTS = [
    bad(
        "--mesh that is not DATA,MODEL",
        "report",
        ["--pretrained", LLAMA, "--out", OUT, "--prompt", "The", "--mesh", "2"],
        "error: --mesh='2': must be DATA,MODEL, two positive integers (e.g. 2,4)",
    ),
    bad(
        "token outside the vocabulary",
        "generate",
        ["--pretrained", "{extra_token}", "--prompt", "The <extra>"],
        "error: --prompt: 'The <extra>': token '<extra>' (id {vocab}) of {extra_token}/tokenizer.json lies "
        "outside the model's vocabulary of {vocab}",
    ),
    bad(
        "token outside the vocabulary",
        "report",
        ["--pretrained", "{extra_token}", "--out", OUT, "--prompt", "The keys", "--clean", "The <extra>"]
        + ["--corrupted", "The keys"],
        "error: --clean: 'The <extra>': token '<extra>' (id {vocab}) of {extra_token}/tokenizer.json lies "
        "outside the model's vocabulary of {vocab}",
    ),
    bad(
        "no tokenizer.json",
        "generate",
        ["--pretrained", "{no_tokenizer}", "--prompt", "The keys"],
        "error: {no_tokenizer}: has no tokenizer.json; text in and out needs the tokenizer the checkpoint "
        "was trained with (copy it beside config.json)",
    ),
    bad(
        "no tokenizer.json",
        "report",
        ["--pretrained", "{no_tokenizer}", "--out", OUT, "--prompt", "The keys"],
        "error: {no_tokenizer}: has no tokenizer.json; text in and out needs the tokenizer the checkpoint "
        "was trained with (copy it beside config.json)",
    ),
    bad(
        "not a checkpoint",
        "generate",
        ["--pretrained", "{not_a_checkpoint}", "--prompt", "The keys"],
        "error: --pretrained='{not_a_checkpoint}': not a Hugging Face checkpoint (no config.json beside "
        "model.safetensors or model.safetensors.index.json)",
    ),
    bad(
        "not a checkpoint",
        "report",
        ["--pretrained", "{not_a_checkpoint}", "--out", OUT, "--prompt", "The keys"],
        "error: --pretrained='{not_a_checkpoint}': not a Hugging Face checkpoint (no config.json beside "
        "model.safetensors or model.safetensors.index.json)",
    ),
    bad(
        "no such directory",
        "generate",
        ["--pretrained", "{not_a_checkpoint}/missing", "--prompt", "The keys"],
        "error: --pretrained='{not_a_checkpoint}/missing': no such directory",
    ),
    bad(
        "clean and corrupted of different lengths",
        "report",
        ["--pretrained", LLAMA, "--out", OUT, "--prompt", "The keys", "--clean", "The keys"]
        + ["--corrupted", "The heads"],
        "error: --corrupted='The heads': 5 tokens, but --clean has 4; patching replaces each position's "
        "activation, so the two must be the same length",
    ),
    bad(
        "empty prompt",
        "generate",
        ["--pretrained", LLAMA, "--prompt", ""],
        "error: --prompt: must not be empty",
    ),
    bad(
        "empty prompt",
        "report",
        ["--pretrained", LLAMA, "--out", OUT, "--prompt", ""],
        "error: --prompt: required with --pretrained (and not empty)",
    ),
    bad(
        "empty clean prompt",
        "report",
        ["--pretrained", LLAMA, "--out", OUT, "--prompt", "The", "--clean", "", "--corrupted", "The"],
        "error: --clean: empty; give a text",
    ),
    bad(
        "both sources",
        "generate",
        ["--pretrained", LLAMA, "--workdir", OUT, "--prompt", "The"],
        "error: give --workdir (a run) or --pretrained (a Hugging Face checkpoint directory), not both",
    ),
    bad(
        "neither source",
        "report",
        ["--prompt", "The"],
        "error: give --workdir (a run) or --pretrained (a Hugging Face checkpoint directory), one is "
        "required",
    ),
    bad(
        "--out without --pretrained",
        "report",
        ["--workdir", OUT, "--out", OUT],
        "error: --out: only with --pretrained (a run's report is written into its workdir)",
    ),
]


@pytest.mark.slow
@pytest.mark.reliability(
    "Pretrained checkpoints",
    "experiments.generate / experiments.report --pretrained with a prompt whose tokens lie outside the "
    "model's vocabulary, a directory without tokenizer.json, one that is not a checkpoint or is missing, "
    "--clean and --corrupted of different token lengths, an empty prompt, both or neither of --workdir "
    "and --pretrained",
    "exit 2, one line naming the cause; nothing written",
)
@pytest.mark.parametrize(("module", "args", "expected"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(checkpoints, broken, tmp_path, module, args, expected):
    out = tmp_path / "out"
    names = {**{k: str(v) for k, v in broken.items()}, "llama": str(checkpoints["llama"]), "out": str(out)}
    names["vocab"] = str(tokenizer(checkpoints["llama"]).tokenizer_vocab_size)
    result = launch(module, *(arg.format(**names) for arg in args))
    assert result.returncode == 2, result.stderr
    assert error_lines(result) == [expected.format(**names)]
    assert result.stdout == "" and not out.exists()  # nothing written


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Workdirs holding only the config files the launchers write when a run starts: a char_lm
    run (config.json), a sweep of char_lm cells (sweep.json) and a fine-tuning run of a tiny Llama
    (config.json, pretrained/config.json). None has a checkpoint: a command that looked for one
    would stop at that instead."""
    from small_char_lm import small_config

    from configs import pretrained_text
    from qkv_jax.tasks.pretrained_text import PRETRAINED_DIR

    root = tmp_path_factory.mktemp("runs")
    char_lm = small_config(root / "text.txt").to_dict()
    (root / "char_lm").mkdir()
    (root / "char_lm" / "config.json").write_text(json.dumps(char_lm))
    (root / "sweep" / "cells").mkdir(parents=True)
    (root / "sweep" / "sweep.json").write_text(json.dumps({"config": char_lm, "seeds": [0, 1]}))
    finetuning = pretrained_text.get_config()
    finetuning.train.init_from, finetuning.data.path = str(root / "llama"), str(root / "text.txt")
    (root / "finetuning" / PRETRAINED_DIR).mkdir(parents=True)
    (root / "finetuning" / "config.json").write_text(finetuning.to_json())
    llama = tiny_checkpoints.hf_config("llama", 120).to_json_string()
    (root / "finetuning" / PRETRAINED_DIR / "config.json").write_text(llama)
    return root


def files_under(root):
    return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}


ON_ONE_DEVICE = "error: --mesh: only with --pretrained or a fine-tuning run's --workdir"
MESH_WITH_A_RUN_IT_DOES_NOT_SPLIT = [
    bad(
        "char_lm run",
        "generate",
        ["--workdir", "{char_lm}", "--prompt", "def "],
        f"{ON_ONE_DEVICE} (a char_lm run decodes on one device)",
    ),
    bad("char_lm run", "report", ["--workdir", "{char_lm}"], ON_ONE_DEVICE),
    bad("sweep", "report", ["--workdir", "{sweep}"], ON_ONE_DEVICE),
    bad(
        "fine-tuning run without --prompt",
        "report",
        ["--workdir", "{finetuning}"],
        "error: --mesh: splits the model of a fine-tuning run's page, which needs --prompt too",
    ),
]


@pytest.mark.slow
@pytest.mark.reliability(
    "Pretrained checkpoints",
    "experiments.generate --mesh with a char_lm run's --workdir; experiments.report --mesh with a "
    "char_lm run or a sweep, or with a fine-tuning run but no --prompt",
    "exit 2, one line naming the cause, before any checkpoint is read; nothing written",
)
@pytest.mark.parametrize(("module", "args", "expected"), MESH_WITH_A_RUN_IT_DOES_NOT_SPLIT)
def test_mesh_with_a_run_it_does_not_split_is_one_line_and_exit_2(runs, module, args, expected):
    before = files_under(runs)
    names = {name: str(runs / name) for name in ("char_lm", "sweep", "finetuning")}
    result = launch(module, *(arg.format(**names) for arg in args), "--mesh=2,2", "--num_cpu_devices=4")
    assert result.returncode == 2, result.stderr
    assert error_lines(result) == [expected]
    assert result.stdout == "" and files_under(runs) == before  # nothing written
