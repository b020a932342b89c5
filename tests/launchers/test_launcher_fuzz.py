"""The training launcher, fuzzed: random command lines over every field of every shipped config.

Each case is `python -m experiments.train --config <a shipped config> --workdir <W> --check
<overrides>` run through the launcher's real parsing (absl flags, ml_collections' config
overrides), the trainer's validation and the task's build, which `--check` stops after. The
overrides set random fields to values of the wrong type, empty strings, zero, negative, huge,
NaN and infinite values, name unknown sections and fields, and break the override syntax.
Every case must end in exit 0 (one `ok:` line on stdout, nothing on stderr) or exit 2 with
exactly one `error:` line on stderr, never a traceback, and must write nothing: an existing
workdir keeps its files byte for byte and a new one is not created.

Cases run in this process (a few milliseconds each), a handful through real subprocesses,
and those the in-process launch refused again without --check (a real launch, refused before
it writes). The seed is new each run (QKV_JAX_FUZZ_SEED fixes it) and printed with any
failing case; QKV_JAX_FUZZ_CASES sets the number of cases (default 2,000). With
QKV_JAX_FUZZ_RECORD=<file> the run's counts go to that file (docs/launcher_fuzz.json is what
docs/reliability.md shows: `QKV_JAX_FUZZ_CASES=20000 QKV_JAX_FUZZ_RECORD=docs/launcher_fuzz.json
python -m pytest -p no:xdist tests/launchers/test_launcher_fuzz.py`).

char_lm cases train on a small text file (`--config.data.path`, unless a case sets that field
itself): its build would otherwise read and encode the whole standard library, seconds a case.
"""

import dataclasses
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import pytest
from in_process import Launched, launch_train
from launch import cache_flag, launcher_env
from ml_collections import ConfigDict

from configs import char_lm, flag_retrieval, sequences
from qkv_jax.training.workdir import write_json

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CASES = 2000
CASES = int(os.environ.get("QKV_JAX_FUZZ_CASES", str(DEFAULT_CASES)))
SEED = int(os.environ.get("QKV_JAX_FUZZ_SEED", str(random.SystemRandom().randrange(2**32))))
RECORD = os.environ.get("QKV_JAX_FUZZ_RECORD")
SHARDS = 1 if RECORD else 4  # xdist spreads the shards over its workers
SUBPROCESS_CASES = 3

# Every shipped config: (config file argument, module, variant).
CONFIGS = (
    [(f"configs/flag_retrieval.py:{v}", flag_retrieval, v) for v in flag_retrieval.VARIANTS]
    + [(f"configs/char_lm.py:{v}", char_lm, v) for v in char_lm.VARIANTS]
    + [(f"configs/sequences.py:{v}", sequences, v) for v in sequences.VARIANTS]
)
# --config arguments that name no config: missing, a directory, an unknown or empty variant, not Python.
BROKEN_CONFIGS = ["configs/nope.py", "configs", "configs/flag_retrieval.py:nope", "configs/char_lm.py:"]
BROKEN_CONFIGS += ["README.md"]
# Values a command line can carry, by what they are.
WRONG = ["abc", "", " ", "1.5", "1e3", "0x10", "None", "True", "[1, 2]", "{}", "3 4", "=3", "-", "é", "٣"]
NUMBERS = ["0", "-0", "-1", "-7", "1", "2", "3", "7", "64", "2147483647", "2147483648", "9" * 30, "-9" * 15]
FLOATS = ["0.0", "-0.5", "1e-3", "0.5", "1.0", "nan", "-nan", "inf", "-inf", "1e308", "1e999", "-1e999"]
FLOATS += ["5e-324"]
BOOLS = ["True", "False", "true", "0", "1", "yes", "maybe"]
STRINGS = ["", " ", "nope", "None", "x" * 300, "../..", "/", "a,b", "float32", "bfloat16", "query,value,mlp"]
# Fields whose values are names: the valid ones and wrong ones. task.module only ever names
# modules that are safe to import here.
CHOICES = {
    "model.kind": ["learned_query", "static", "multihead", "lstm"],
    "model.precision": ["default", "high", "highest", "fast"],
    "model.dtype": ["float32", "bfloat16", "float16", "int8", "complex64", "nope"],
    "model.attention_implementation": ["reference", "xla", "chunked", "cudnn", "flash"],
    "model.lora_targets": ["query", "query,value", "key,out,mlp", "kv_latent", "nope", ","],
    "task.module": [
        "qkv_jax.tasks.flag_retrieval",
        "qkv_jax.tasks.char_lm",
        "qkv_jax.tasks.sequences",
        "no_such_package.task",
        "json",
        ".relative",
        "qkv_jax",
    ],
    "task.name": ["copy", "brackets", "repeat", "flag_retrieval", "char_lm", "nope"],
    "train.optimizer": ["adam", "adamw", "sgd", "lion"],
    "train.schedule": ["constant", "cosine", "linear"],
    "experiment": ["flag_retrieval", "char_lm", "lm_copy", "other"],
}
MALFORMED = [
    "--config.",
    "--config..steps=3",
    "--config.=3",
    "--config.train.=1",
    "--config.train.steps==3",
    "--config.train",
    "--config.train=3",
    "--config.model={}",
    "--config.train.steps.x=1",
    "--config.seed.x.y=2",
    "--config.train.steps",
    "--noconfig.train.steps",
    "--noconfig.model.scaled",
    "--config-train.steps=3",
    "--confg.train.steps=3",
    "-config.seed=1",
    "--config.1x=3",
    "--config.train steps=3",
    "--config.train.steps=3=4",
    "--check=maybe",
    "positional",
]
# Overrides given before --config (ml_collections refuses them).
EARLY = ["--config.seed=1", "--config.train.steps=10"]


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: type | None  # int, float, bool, str; None for a section


def fields_of(config: ConfigDict, prefix: str = "") -> list[Field]:
    """Every field and section of `config`, with the type a field holds (a placeholder's too)."""
    found = []
    for key in config.keys():
        if isinstance(config[key], ConfigDict):
            found.append(Field(prefix + key, None))
            found += fields_of(config[key], f"{prefix}{key}.")
        else:
            found.append(Field(prefix + key, config.get_type(key)))
    return found


def typo(name: str, rng: random.Random) -> str:
    """`name` with one of its parts misspelt (a letter dropped, doubled or two swapped)."""
    parts = name.split(".")
    i = rng.randrange(len(parts))
    word = parts[i]
    j = rng.randrange(len(word))
    kind = rng.choice(["drop", "double", "swap"])
    if kind == "drop" and len(word) > 1:
        word = word[:j] + word[j + 1 :]
    elif kind == "swap" and j + 1 < len(word) and word[j] != word[j + 1]:
        word = word[:j] + word[j + 1] + word[j] + word[j + 2 :]
    else:
        word = word[:j] + word[j] + word[j:]
    parts[i] = word
    return ".".join(parts)


def value_for(field: Field, rng: random.Random, corpus: str) -> str:
    """A value for `field`: half the time one of its own kind, else anything."""
    own = {int: NUMBERS, float: FLOATS + NUMBERS, bool: BOOLS, str: STRINGS}.get(field.kind, WRONG)
    if field.name in CHOICES:
        own = CHOICES[field.name] + STRINGS[:3]
    if field.name == "data.path":
        own = [corpus, "/nonexistent.txt", "/", "x" * 300, ""]
    if field.name == "train.init_from":
        own = ["/nonexistent", "/", "x" * 300, "", str(ROOT / "configs")]
    pool = own if rng.random() < 0.5 else rng.choice([WRONG, NUMBERS, FLOATS, BOOLS, STRINGS])
    return rng.choice(pool)


def override(fields: list[Field], rng: random.Random, corpus: str) -> list[str]:
    """One override: a field set to a drawn value, or a misspelt, unknown or malformed one."""
    roll = rng.random()
    field = rng.choice(fields)
    if roll < 0.7:
        if field.kind is None:  # a section given a value
            return [f"--config.{field.name}={rng.choice(WRONG + NUMBERS)}"]
        if rng.random() < 0.05:  # the two-argument form
            return [f"--config.{field.name}", value_for(field, rng, corpus)]
        return [f"--config.{field.name}={value_for(field, rng, corpus)}"]
    if roll < 0.85:
        return [f"--config.{typo(field.name, rng)}={rng.choice(NUMBERS + STRINGS)}"]
    if roll < 0.9:
        return [f"--config.{field.name}.{rng.choice(['x', 'steps', 'd_k'])}={rng.choice(NUMBERS)}"]
    return [rng.choice(MALFORMED)]


def config_argument(rng: random.Random) -> tuple[str, object, str | None]:
    """A shipped config, or now and then a broken --config argument."""
    argument, module, variant = rng.choice(CONFIGS)
    if rng.random() < 0.04:
        return rng.choice(BROKEN_CONFIGS), module, variant
    return argument, module, variant


def snapshot(directory: pathlib.Path) -> dict:
    """Every file under `directory` with its bytes and modification time."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
    }


@dataclasses.dataclass
class Tally:
    cases: int = 0
    codes: dict = dataclasses.field(default_factory=dict)
    messages: set = dataclasses.field(default_factory=set)

    def add(self, code: int, line: str) -> None:
        self.cases += 1
        self.codes[code] = self.codes.get(code, 0) + 1
        if code:
            self.messages.add(line)


def template(line: str) -> str:
    """An error line with its values replaced: how many distinct kinds of message there are."""
    line = re.sub(r"'[^']*'|\"[^\"]*\"", "'S'", line)
    line = re.sub(r"(?<=[=:(\s])[^\s;,()]+", "V", line)
    return re.sub(r"\d+", "N", line)


@pytest.fixture(autouse=True)
def in_the_repository(monkeypatch):
    """Config files are named as a user in the repository names them."""
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A small text for char_lm, and one existing workdir per config holding a run trained to step
    100 (its config.json, summary.json and checkpoint directory; the checks read no more) and a
    file of the user's: what a refused launch must leave as it is."""
    root = tmp_path_factory.mktemp("fuzz")
    corpus = root / "corpus.txt"
    corpus.write_text("def forward(self, x):\n    return self.scale * x + self.bias\n" * 400)
    workdirs = {}
    for argument, module, variant in CONFIGS:
        workdir = root / f"existing-{argument.replace('/', '_').replace(':', '_')}"
        workdir.mkdir()
        write_json(workdir / "config.json", module.get_config(variant).to_dict())
        write_json(workdir / "summary.json", {"steps": 100})
        (workdir / "checkpoints" / "100").mkdir(parents=True)
        (workdir / "notes.txt").write_text("the user's own file\n")
        workdirs[argument] = workdir
    return {"root": root, "corpus": str(corpus), "workdirs": workdirs}


def draw_case(rng: random.Random, places: dict, index: int) -> tuple[list[str], pathlib.Path]:
    """The arguments of case `index` and its workdir (an existing one or a new path)."""
    argument, module, variant = config_argument(rng)
    fields = fields_of(module.get_config(variant))
    existing = places["workdirs"].get(argument)
    if existing is not None and rng.random() < 0.5:
        workdir = existing
    else:
        workdir = places["root"] / f"new-{index}"
    args = ["--config", argument, "--workdir", str(workdir), "--check"]
    if rng.random() < 0.01:
        args = [rng.choice(EARLY), *args]
    if module is char_lm:
        args.append(f"--config.data.path={places['corpus']}")
    for _ in range(rng.choice([1, 1, 2, 2, 3, 4])):
        args += override(fields, rng, places["corpus"])
    return args, workdir


def check_result(result, args, workdir, before, seed) -> str:
    """The assertions every case meets; returns its error line ('' for exit 0)."""
    shown = f"seed {seed}: python -m experiments.train {' '.join(args)}"
    text = result.stdout + result.stderr
    assert "Traceback" not in text, f"{shown}\n{text}"
    assert result.code in (0, 2), f"{shown}\nexit {result.code}\n{text}"
    if result.code == 0:
        assert result.stderr == "" and result.stdout.startswith("ok: "), f"{shown}\n{text}"
        table = result.stdout.splitlines()[1:]  # the resolved config, one field a line
        assert table and table[0].endswith("fields (* = set on the command line)"), f"{shown}\n{text}"
    else:
        (line,) = result.error_lines or [""]
        assert len(result.error_lines) == 1 and line.startswith("error: "), f"{shown}\n{text}"
        assert result.stdout == "", f"{shown}\n{text}"
    if before is None:
        assert not workdir.exists(), f"{shown}\nwrote {workdir}"
    else:
        assert snapshot(workdir) == before, f"{shown}\nchanged {workdir}"
    return result.error_lines[0] if result.code else ""


@pytest.mark.reliability(
    "Config and command line",
    "random command lines: every field of every shipped config set to a wrong type, an empty "
    "string, zero, a negative, huge, NaN or infinite value, unknown sections and fields, broken "
    f"override syntax, broken --config arguments ({DEFAULT_CASES:,} cases a run, a new seed each run)",
    "exit 0 with an `ok:` line and the resolved config, or exit 2 with exactly one `error:` line; "
    "never a traceback; an existing "
    "workdir keeps every byte, a new one is not created",
)
@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.slow
def test_fuzzed_command_lines(shard, places):
    seed = SEED + shard
    rng = random.Random(seed)
    tally = Tally()
    started = time.perf_counter()
    snapshots = {path: snapshot(path) for path in places["workdirs"].values()}
    for index in range(shard, CASES, SHARDS):
        args, workdir = draw_case(rng, places, index)
        result = launch_train(*args)
        tally.add(result.code, check_result(result, args, workdir, snapshots.get(workdir), seed))
    print(f"launcher fuzz, seed {seed}: {tally.cases} cases, exit codes {tally.codes}")
    if RECORD:
        record = {
            "cases": tally.cases,
            "seed": seed,
            "seconds": round(time.perf_counter() - started, 1),
            "exit_codes": {str(code): count for code, count in sorted(tally.codes.items())},
            "distinct_error_lines": len(tally.messages),
            "distinct_error_kinds": len({template(line) for line in tally.messages}),
            "tracebacks": 0,
            "machine": f"{os.cpu_count()} CPU cores, one process",
            "default_cases": DEFAULT_CASES,
        }
        pathlib.Path(RECORD).write_text(json.dumps(record, indent=1) + "\n")
    assert tally.codes.get(0, 0) and tally.codes.get(2, 0), tally.codes  # both outcomes were reached


def test_refused_launches_write_nothing(places):
    """Cases the check refused, launched for real (no --check): refused before anything is written."""
    rng = random.Random(SEED + 1000)
    launched = 0
    snapshots = {path: snapshot(path) for path in places["workdirs"].values()}
    while launched < 30:
        args, workdir = draw_case(rng, places, 10_000 + launched)
        if launch_train(*args).code != 2:
            continue
        real = [a for a in args if a != "--check"] + [cache_flag()]  # this session's JAX cache
        launched += 1
        check_result(launch_train(*real), real, workdir, snapshots.get(workdir), SEED + 1000)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(SUBPROCESS_CASES))
def test_fuzzed_command_lines_in_a_subprocess(index, places):
    """A few cases through `python -m experiments.train` itself (absl's app, the interpreter's exit)."""
    rng = random.Random(SEED + 2000 + index)
    args, workdir = draw_case(rng, places, 20_000 + index)
    before = snapshot(workdir) if workdir.exists() else None
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=launcher_env(),
    )
    launched = Launched(result.returncode, result.stdout, result.stderr)
    check_result(launched, args, workdir, before, SEED + 2000 + index)
