"""Installing qkv_jax puts the library, and only the library, into site-packages."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_install_puts_only_qkv_jax_into_site_packages(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # What `pip install .` does, offline: build the wheel, install it (not editable; the
    # dependencies are left out, they are not what this test is about).
    pip = [sys.executable, "-m", "pip", "-q"]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("qkv_jax-*.whl")
    install = subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    installed = {path.name for path in pathlib.Path(purelib).iterdir()}
    assert "qkv_jax" in installed, (
        purelib,
        sorted(installed),
        install.stdout[-2000:],
        install.stderr[-2000:],
    )
    assert not installed & {"configs", "experiments", "benchmarks", "docs", "tests"}, sorted(installed)
    package = pathlib.Path(purelib) / "qkv_jax"
    assert (package / "py.typed").exists()
    assert sorted(p.name for p in (package / "report" / "explorer_assets").iterdir())  # the page's assets
