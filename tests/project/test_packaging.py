"""Installing qkv_jax puts the library, and only the library, into site-packages, and asks for
the Pythons and dependency versions the suite runs on."""

import ast
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What a checkout holds beside the library; the wheel carries none of it.
CHECKOUT = {"studies", "configs", "experiments", "benchmarks", "docs", "tests"}


def setup_arguments() -> dict:
    """The literal keyword arguments of setup.py's `setup(...)` call."""
    (call,) = [
        node
        for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"
    ]
    return {
        keyword.arg: ast.literal_eval(keyword.value)
        for keyword in call.keywords
        if isinstance(keyword.value, ast.List | ast.Constant | ast.Dict)
    }


def test_the_suites_python_and_dependencies_meet_what_setup_asks_for():
    """The interpreter running the suite is one python_requires admits, and every dependency's
    installed version is one install_requires admits: the bounds claim nothing the suite does not
    run on (a bound raised past what is installed, or a Python left out, fails here). Only where
    qkv_jax was installed: a checkout put on PYTHONPATH (as on the GPU machine, whose image
    cannot install packages) never had pip check its dependencies against these bounds."""
    try:
        importlib.metadata.version("qkv_jax")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("qkv_jax is not installed here (a checkout on PYTHONPATH)")
    arguments = setup_arguments()
    python = ".".join(map(str, sys.version_info[:3]))
    assert SpecifierSet(arguments["python_requires"]).contains(python), (arguments["python_requires"], python)
    assert not SpecifierSet(arguments["python_requires"]).contains("3.10.13")  # jax for 3.10 stops at 0.6.2
    unmet = []
    for line in arguments["install_requires"]:
        requirement = Requirement(line)
        installed = importlib.metadata.version(requirement.name)
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} (installed: {installed})")
        assert any(spec.operator == ">=" for spec in requirement.specifier), f"{line}: no lower bound"
    assert not unmet, unmet


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
    assert not installed & CHECKOUT, sorted(installed)
    package = site_packages / "qkv_jax"
    assert not (package / "studies").exists(), sorted(p.name for p in package.iterdir())
    assert not [path for path in package.rglob("*.py") if "studies" in path.relative_to(package).parts]
    assert (package / "py.typed").exists()
    assert sorted(p.name for p in (package / "report" / "explorer_assets").iterdir())  # the page's assets
