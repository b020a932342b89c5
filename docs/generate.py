r"""Rebuilds the generated parts of the documentation from measured outputs.

  python -m docs.generate readme       # runs the main job and the static baseline for the README
  python -m docs.generate experiments [--only STUDY ...]   # docs/experiments.md (docs/experiments_doc.py)
  python -m docs.generate reliability  # docs/reliability.md from the tests' reliability marks

Each part is written between `<!-- generated:NAME -->` and
`<!-- end generated:NAME -->` markers, with the command that regenerated it.
Nothing in a generated part is typed by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"


def replace_block(path: pathlib.Path, name: str, body: str) -> None:
    """Replaces the text between the markers for `name` in `path`."""
    text = path.read_text()
    pattern = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- end generated:{name} -->)", re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no <!-- generated:{name} --> markers")
    path.write_text(pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text))


def run_main_job(variant: str = "") -> tuple[str, pathlib.Path, tempfile.TemporaryDirectory]:
    """Runs the flag experiment in a temporary workdir; returns (printed text, workdir, tmp)."""
    tmp = tempfile.TemporaryDirectory()
    workdir = pathlib.Path(tmp.name) / "flag"
    config = "configs/flag_retrieval.py" + (f":{variant}" if variant else "")
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config", config, "--workdir", str(workdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        },
    )
    shown = "runs/flag" + (f"_{variant}" if variant else "")
    return result.stdout.replace(str(workdir), shown).strip(), workdir, tmp


def readme() -> None:
    """Runs the main job (and the static baseline); puts what they printed into the README."""
    printed, workdir, tmp = run_main_job()
    IMAGES.mkdir(parents=True, exist_ok=True)
    for stage in ("before", "after"):
        shutil.copy(workdir / f"attention_{stage}.png", IMAGES / f"flag_attention_{stage}.png")
    tmp.cleanup()
    replace_block(
        ROOT / "README.md",
        "main-job-output",
        "What `python -m experiments.train --config configs/flag_retrieval.py --workdir runs/flag` "
        "printed (regenerate with `python -m docs.generate readme`):\n\n"
        f"```text\n{printed}\n```\n\n"
        "| before training | after training |\n|---|---|\n"
        "| ![attention before](docs/images/flag_attention_before.png) "
        "| ![attention after](docs/images/flag_attention_after.png) |\n",
    )
    printed, _, tmp = run_main_job("static")
    tmp.cleanup()
    replace_block(
        ROOT / "README.md",
        "static-output",
        "`python -m experiments.train --config configs/flag_retrieval.py:static --workdir "
        "runs/flag_static` printed (regenerate with `python -m docs.generate readme`):\n\n"
        f"```text\n{printed}\n```\n",
    )


def experiments(only: list[str] | None = None) -> None:
    from docs.experiments_doc import generate

    generate(only)


def reliability() -> None:
    """Collects the tests (no run) and renders their reliability marks."""
    with tempfile.TemporaryDirectory() as tmp:
        dump = pathlib.Path(tmp) / "cases.json"
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:xdist", "tests"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            env={**os.environ, "QKV_JAX_RELIABILITY_CATALOGUE": str(dump)},
        )
        cases = json.loads(dump.read_text())
    sys.path.insert(0, str(ROOT / "tests"))
    from reliability_catalogue import render

    (ROOT / "docs" / "reliability.md").write_text(render(cases))


PARTS = {"readme": readme, "experiments": experiments, "reliability": reliability}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="+", choices=sorted(PARTS))
    parser.add_argument("--only", nargs="*", help="experiments: only these studies")
    args = parser.parse_args()
    for part in args.parts:
        PARTS[part](args.only) if part == "experiments" else PARTS[part]()
        print(f"regenerated {part}")


if __name__ == "__main__":
    main()
