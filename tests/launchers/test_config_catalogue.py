"""The configs made discoverable: `--list_configs` names every config file and variant, and `--check`
shows every field of the resolved config with its value and comment, overrides marked."""

import importlib
import re

from in_process import launch_train
from launch import ROOT

CONFIG_FILES = sorted(p for p in (ROOT / "configs").glob("*.py") if "\ndef get_config(" in p.read_text())


def leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_list_configs_names_every_file_and_variant():
    result = launch_train("--list_configs")
    assert (result.code, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert len(CONFIG_FILES) >= 4
    for path in CONFIG_FILES:
        module = importlib.import_module(f"configs.{path.stem}")
        (heading,) = [line for line in lines if line.startswith(f"configs/{path.name} ")]
        assert module.__doc__.strip().splitlines()[0] in heading
        for variant in getattr(module, "VARIANTS", ()):
            module.get_config(variant)  # each listed variant is one get_config accepts
            described = [line for line in lines if re.match(rf"  :{variant} +\S", line)]
            assert described, f"{path.name}:{variant} is not listed with a line"


def test_check_prints_every_field_of_the_resolved_config(tmp_path):
    from configs import flag_retrieval

    result = launch_train(
        "--config",
        "configs/flag_retrieval.py:multihead",
        "--workdir",
        str(tmp_path / "w"),
        "--check",
        "--config.model.d_k=4",
        "--config.train.steps=7",
    )
    assert (result.code, result.stderr) == (0, ""), result.stderr
    assert result.stdout.startswith("ok: flag_retrieval would train 7 steps")
    config = flag_retrieval.get_config("multihead")
    config.model.d_k, config.train.steps = 4, 7
    shown = {line[2:].split()[0]: line for line in result.stdout.splitlines()[2:]}
    expected = dict(leaves(config.to_dict()))
    assert set(shown) == set(expected)
    for path, value in expected.items():
        line = shown[path]
        assert re.match(
            rf"[ *] {re.escape(path)} +{re.escape('unset' if value is None else repr(value))}", line
        ), line
        assert line.startswith("*") == (path in ("model.d_k", "train.steps")), line
        assert "  # " in line, f"{path}: no comment"  # every field of this file has one
    assert "# Total query/key width, split evenly over the heads." in shown["model.d_k"]
    assert "# Optimizer steps." in shown["train.steps"]  # from configs/common.py
    assert not (tmp_path / "w").exists()
