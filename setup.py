"""Packaging for qkv_jax: `pip install -e .` (library), `.[test]` (tests), `.[parity]` (torch only)."""

from setuptools import find_packages, setup

setup(
    name="qkv_jax",
    version="0.1.0",
    description="Learned attention (Q, K, V and O projections) in JAX and Flax, with experiments",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Only the library: the launchers (experiments/), configs/, benchmarks/ and docs/ run from a
    # checkout (`python -m experiments.train ...` from its root) and stay out of site-packages.
    packages=find_packages(include=["qkv_jax", "qkv_jax.*"]),
    package_data={"qkv_jax": ["py.typed", "report/explorer_assets/*"]},
    install_requires=[
        "jax>=0.4.35",
        "flax>=0.10",
        "optax>=0.2.3",
        "chex>=0.1.87",
        "absl-py>=2.0",
        "ml_collections>=0.1.1",
        "numpy>=1.26",
        "orbax-checkpoint>=0.9",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        "tensorboard>=2.14",  # its event-file writer (no TensorFlow needed) and the viewer
    ],
    extras_require={
        "test": [
            "pytest>=7.4",
            "pytest-xdist>=3.5",
            "ruff>=0.6",
            "mypy>=1.10",
            "playwright>=1.40",
            # The PyTorch parity tests and the TransformerLens parity of qkv_jax.interpretability.
            "torch>=2.1",
            "transformer-lens>=4.0,<5",
        ],
        "parity": ["torch>=2.1"],
    },
)
