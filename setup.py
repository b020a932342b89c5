"""Packaging for qkv_jax: `pip install -e .` (library), `.[test]` (tests), `.[parity]` (torch only)."""

from setuptools import find_packages, setup

setup(
    name="qkv_jax",
    version="0.1.0",
    description="Learned attention (Q, K, V and O projections) in JAX and Flax, with experiments",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # The Pythons CI tests: 3.11 (the whole suite) and 3.13 (the fast tier). On 3.10 the newest
    # jax is 0.6.2, below the bound here, and pip would backtrack for many minutes before failing.
    python_requires=">=3.11",
    # Only the library: the launchers (experiments/), the studies (studies/), configs/,
    # benchmarks/ and docs/ run from a checkout (`python -m experiments.train ...` from its root)
    # and stay out of site-packages.
    packages=find_packages(include=["qkv_jax", "qkv_jax.*"]),
    package_data={"qkv_jax": ["py.typed", "report/explorer_assets/*"]},
    # The lower bounds are the versions CI installs and tests (`pip list` in CI's environment).
    install_requires=[
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "chex>=0.1.92",
        "absl-py>=2.5.1",
        "ml_collections>=1.1.0",
        "numpy>=2.4.6",
        # bfloat16 checkpoints come as ml_dtypes arrays. 0.7.0 registers its numpy loops in
        # 0.55 s at import (numpy's PyUFunc_AddLoop searches the loops added so far, once per
        # loop), against 0.03 s for 0.6.0: half of `import jax`, and a quarter of the
        # generate command's time to its first token (2.0 s against 1.5 s), on a 2-core Xeon.
        "ml_dtypes>=0.5.0,!=0.7.0",
        "orbax-checkpoint>=0.12.8",
        "matplotlib>=3.11.2",
        "tqdm>=4.70.1",
        "tensorboard>=2.21.0",  # its event-file writer (no TensorFlow needed) and the viewer
        # Hugging Face checkpoints (qkv_jax.pretrained): the weights and the tokenizer files.
        "safetensors>=0.8.0",
        "tokenizers>=0.23.3",
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
