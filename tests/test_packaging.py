"""Installing qkv_jax puts the library, and only the library, into site-packages."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_install_puts_only_qkv_jax_into_site_packages(tmp_path):
    # What `pip install .` does, offline: build the wheel, install it (not editable; the
    # dependencies are left out, they are not what this test is about) into a folder of its own
    # with --target, so the check sees exactly what the wheel puts into site-packages whatever
    # environment runs the suite (a venv or the system interpreter, qkv_jax editable or not).
    pip = [sys.executable, "-m", "pip"]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [*pip, "-q", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("qkv_jax-*.whl")
    site_packages = tmp_path / "site-packages"
    install = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site_packages), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    installed = {path.name for path in site_packages.iterdir()}
    assert "qkv_jax" in installed, (sorted(installed), install.stdout[-2000:], install.stderr[-2000:])
    assert not installed & {"configs", "experiments", "benchmarks", "docs", "tests"}, sorted(installed)
    package = site_packages / "qkv_jax"
    assert (package / "py.typed").exists()
    assert sorted(p.name for p in (package / "report" / "explorer_assets").iterdir())  # the page's assets
