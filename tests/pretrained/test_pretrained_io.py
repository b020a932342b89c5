"""qkv_jax.pretrained's files: reading Hugging Face directories (one file or shards, bfloat16,
tensor by tensor, never written), the config schemas and refusals, bad files, and
save_pretrained's directories (transformers loads them to the same logits; atomic; refusals).

The models are tiny random Llama and GPT-2 models that transformers writes itself."""

import dataclasses
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import textwrap
import weakref

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

import qkv_jax
from qkv_jax.lm import TransformerConfig, TransformerLM
from qkv_jax.positions import RopeScaling
from qkv_jax.pretrained import (
    HFConfig,
    PretrainedError,
    load_pretrained,
    load_pretrained_nnx,
    save_pretrained,
)
from qkv_jax.pretrained import checkpoint as checkpoint_module
from qkv_jax.pretrained import io as io_module
from qkv_jax.pretrained.families import FAMILIES
from qkv_jax.pretrained.save import shard_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENS = np.array([[3, 17, 5, 60, 2, 9, 41, 33, 12, 7, 0, 63]], np.int32)
# The one-line errors of bad files, catalogued in docs/reliability.md.
bad_file = pytest.mark.reliability


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter moved off its initialization (norm gains off 1, biases off 0)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model.eval()


def _tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            bos_token_id=1,
            eos_token_id=2,
        )
    else:
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
        )
    return _randomize(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def _logits(model: torch.nn.Module, tokens: np.ndarray = TOKENS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _ours(config: TransformerConfig, params, tokens: np.ndarray = TOKENS) -> np.ndarray:
    return np.asarray(TransformerLM(config).apply({"params": params}, jnp.asarray(tokens)))


def _close(actual: np.ndarray, expected: np.ndarray, tolerance: float = 1e-5) -> None:
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tolerance * np.abs(expected).max())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(directory, torch model) of a tiny float32 Llama saved by transformers as one file."""
    model = _tiny("llama")
    directory = tmp_path_factory.mktemp("llama")
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def llama_sharded(tmp_path_factory, llama):
    directory = tmp_path_factory.mktemp("llama_sharded")
    llama[1].save_pretrained(directory, max_shard_size="20KB")
    return directory


@pytest.fixture(scope="module")
def loaded(llama):
    return load_pretrained(llama[0])


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    model = _tiny("gpt2")
    directory = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(directory)
    return directory, model


def _snapshot(directory: pathlib.Path) -> dict[str, tuple[int, int, str]]:
    """Every file under `directory`: (size, mtime in ns, SHA-256)."""
    return {
        str(path.relative_to(directory)): (
            path.stat().st_size,
            path.stat().st_mtime_ns,
            hashlib.sha256(path.read_bytes()).hexdigest(),
        )
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="numpy") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _copy_with(source: pathlib.Path, target: pathlib.Path, change) -> pathlib.Path:
    """A copy of the one-file directory `source` whose tensors are `change(tensors)`."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    save_file(
        change(_tensors(source / "model.safetensors")), str(target / "model.safetensors"), {"format": "pt"}
    )
    return target


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------ reading


def test_load_matches_transformers(llama, loaded):
    config, params = loaded
    assert config.param_dtype == jnp.float32 and config.dtype == jnp.float32
    _close(_ours(config, params), _logits(llama[1]))


def test_top_level_exports_are_the_loaders():
    assert qkv_jax.load_pretrained is load_pretrained
    assert qkv_jax.save_pretrained is save_pretrained


def test_sharded_directory_loads_the_same_parameters(llama_sharded, loaded):
    assert (llama_sharded / "model.safetensors.index.json").is_file()
    assert len(list(llama_sharded.glob("model-*.safetensors"))) > 1
    config, params = load_pretrained(llama_sharded)
    assert config == loaded[0]
    for (path, ours), (_, reference) in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree_util.tree_leaves_with_path(loaded[1]),
        strict=True,
    ):
        np.testing.assert_array_equal(ours, reference, err_msg=jax.tree_util.keystr(path))


def test_bfloat16_stays_bfloat16_unless_asked(tmp_path, llama):
    model = _tiny("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    config, params = load_pretrained(tmp_path)
    assert config.param_dtype == jnp.bfloat16 and config.dtype == jnp.bfloat16
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    wide_config, wide = load_pretrained(tmp_path, dtype=jnp.float32)
    assert wide_config.param_dtype == jnp.float32 and wide_config.dtype == jnp.float32
    for narrow, widened in zip(jax.tree.leaves(params), jax.tree.leaves(wide), strict=True):
        assert widened.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(narrow).astype(np.float32), widened)
    torch_weight = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(
        np.asarray(params["token_embedding"]["embedding"]).astype(np.float32), torch_weight
    )
    with pytest.raises(ValueError, match="dtype=.*int32.* must be a floating dtype"):
        load_pretrained(tmp_path, dtype=jnp.int32)


def test_nnx_model_equals_linen_and_holds_the_same_arrays(llama, loaded):
    model = load_pretrained_nnx(llama[0])
    _close(np.asarray(model(jnp.asarray(TOKENS))), _logits(llama[1]))
    config, params = loaded
    from flax import nnx

    built = io_module.nnx_model(config, params)
    state = nnx.to_pure_dict(nnx.state(built, nnx.Param))
    for ours, given in zip(jax.tree.leaves(state), jax.tree.leaves(params), strict=True):
        assert ours is given  # the linen arrays themselves: no second copy


def test_blocks_converted_on_the_device_and_read_into_huge_pages_load_the_same(llama, loaded, monkeypatch):
    """Every tensor through the large-tensor path (on-device layout conversion and cast, an
    anonymous huge-page mapping as the read buffer): the same params, in bfloat16 too."""
    from qkv_jax.pretrained import placement

    monkeypatch.setattr(placement, "ON_DEVICE_BYTES", 0)
    monkeypatch.setattr(placement, "HOST_TRANSPOSES", False)  # the accelerators' path
    monkeypatch.setattr(checkpoint_module, "HUGE_PAGE_BYTES", 0)
    for dtype in (None, jnp.bfloat16):
        _, params = load_pretrained(llama[0], dtype=dtype)
        for ours, reference in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[1]), strict=True):
            expected = (
                np.asarray(reference) if dtype is None else np.asarray(reference).astype(ml_dtypes.bfloat16)
            )
            np.testing.assert_array_equal(np.asarray(ours), expected)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.float16, np.int8, np.complex64])
def test_tiled_transposed_copies_equal_numpy_transposes(dtype):
    """Shapes that fill no tile, a part of one and many with a remainder, and a strided view (a
    block of columns): contiguous, 64-byte aligned, equal to numpy's transpose."""
    from qkv_jax.pretrained.placement import transposed

    rng = np.random.default_rng(0)
    for shape in [(1, 1), (3, 700), (130, 1030), (64, 512)]:
        matrix = (rng.standard_normal(shape) * 50).astype(dtype)
        for view in (matrix, matrix[:, 1:-1] if shape[1] > 2 else matrix):
            result = transposed(view)
            assert result.flags.c_contiguous and result.ctypes.data % 64 == 0
            assert result.dtype == view.dtype
            np.testing.assert_array_equal(result, view.T)


def test_tiled_transposed_copies_widen_bfloat16_to_float32_exactly():
    """bfloat16 -> float32 (its bits moved up) equals numpy's cast, infinities and NaNs kept;
    a cast that rounds is refused (the device does those)."""
    from qkv_jax.pretrained.placement import transposed

    matrix = (np.random.default_rng(1).standard_normal((130, 1030)) * 1e3).astype(ml_dtypes.bfloat16)
    matrix[0, :3] = [np.inf, -np.inf, np.nan]
    for view in (matrix, matrix[:, 5:-7]):
        result = transposed(view, np.float32)
        assert result.dtype == np.float32 and result.flags.c_contiguous
        np.testing.assert_array_equal(result, view.T.astype(np.float32))  # NaNs equal in place
    with pytest.raises(ValueError, match="float32 -> bfloat16 is not a widening"):
        transposed(matrix.astype(np.float32), ml_dtypes.bfloat16)


def test_transposed_layouts_on_a_cpu_are_copied_on_the_host(llama, loaded, monkeypatch):
    """On a CPU, the kernels that a layout transposes are copied in tiles on the host, from the
    mapped file (the same params as the devices' path); a cast takes the devices' path."""
    from qkv_jax.pretrained import placement

    copied = []
    tiled = placement.transposed
    monkeypatch.setattr(
        placement, "transposed", lambda matrix, dtype: copied.append(matrix.shape) or tiled(matrix, dtype)
    )
    _, params = load_pretrained(llama[0])
    leaves = jax.tree_util.tree_leaves_with_path(params)
    kernels = [leaf for path, leaf in leaves if "kernel" in jax.tree_util.keystr(path)]
    # every kernel, as torch's Linear stores them ([out, in]; the heads' kernels flattened)
    assert sorted(int(np.prod(shape)) for shape in copied) == sorted(kernel.size for kernel in kernels)
    for ours, reference in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))
    copied.clear()
    load_pretrained(llama[0], dtype=jnp.bfloat16)
    assert copied == []


def test_one_device_params_are_uncommitted_so_a_step_fed_its_own_outputs_compiles_once(llama):
    """As jnp's arrays and a model's init are: committed params made a jitted step's outputs
    committed, and the step, fed them back (its optimizer state, adapters), compiled again."""
    _, params = load_pretrained(llama[0])
    assert not any(leaf.committed for leaf in jax.tree.leaves(params))
    step = jax.jit(lambda state, frozen: state + jax.tree.leaves(frozen)[0].sum())
    state = step(jnp.zeros(3), params)
    state = step(state, params)
    assert step._cache_size() == 1


def test_a_file_system_that_cannot_map_files_loads_the_same(llama, loaded, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap gives where the file system has no mmap

    monkeypatch.setattr(checkpoint_module.mmap, "mmap", refuse)
    _, params = load_pretrained(llama[0])
    for ours, reference in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))


def test_a_file_cut_short_after_it_was_opened_is_refused_before_it_is_mapped(tmp_path, llama):
    """A file shorter than its header says is refused in one line, never mapped past its end
    (touching such a page would kill the process)."""
    directory = tmp_path / "model"
    shutil.copytree(llama[0], directory)
    with checkpoint_module.TensorSource(directory) as tensors:
        name = max(tensors.names, key=lambda n: np.prod(tensors.shape(n)))
        rows = tensors.shape(name)[0]
        np.testing.assert_array_equal(tensors.map_rows(name, 0, rows), tensors.read_rows(name, 0, rows))
        with open(directory / "model.safetensors", "r+b") as file:
            file.truncate(8 + int.from_bytes(file.read(8), "little"))  # the header, no data
        with pytest.raises(PretrainedError) as error:
            tensors.map_rows(name, 0, rows)
    assert _one_line(error).endswith(f"tensor {name!r} cannot be read (the file ends early)")


def test_strided_views_from_a_family_load_the_same(llama, loaded, monkeypatch):
    """A family may yield a view in another memory order (a transpose): the same params."""
    family = FAMILIES["llama"]
    read = family.from_hf

    def strided(config, tensors):
        for path, array in read(config, tensors):
            yield path, np.asarray(array).T.copy().T  # the values, in transposed memory order

    monkeypatch.setattr(family, "from_hf", strided)
    _, params = load_pretrained(llama[0], dtype=jnp.bfloat16)
    for ours, reference in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[1]), strict=True):
        assert ours.dtype == jnp.bfloat16
        np.testing.assert_array_equal(ours, np.asarray(reference).astype(ml_dtypes.bfloat16))


def test_loads_never_write_the_directory(llama, llama_sharded):
    for directory in (llama[0], llama_sharded):
        before = _snapshot(directory)
        load_pretrained(directory)
        load_pretrained_nnx(directory, dtype=jnp.bfloat16)
        assert _snapshot(directory) == before
        assert sorted(p.name for p in directory.iterdir()) == sorted(before)


def test_live_arrays_stay_near_the_model_size(llama, monkeypatch):
    """While loading, the JAX arrays and the numpy tensors alive at once never exceed the
    model's bytes plus two of its tensors (the one read and its converted copy)."""
    baseline = {id(a) for a in jax.live_arrays()}
    alive: list[weakref.ref] = []
    peaks = []
    read = checkpoint_module.TensorSource.read_slice

    def live_bytes() -> int:
        device = sum(a.nbytes for a in jax.live_arrays() if id(a) not in baseline)
        return device + sum(ref().nbytes for ref in alive if ref() is not None)

    def read_slice(self, name, index, **options):
        peaks.append(live_bytes())
        value = read(self, name, index, **options)
        alive.append(weakref.ref(value))
        peaks.append(live_bytes())
        return value

    monkeypatch.setattr(checkpoint_module.TensorSource, "read_slice", read_slice)
    config, params = load_pretrained(llama[0])
    model_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    largest = max(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert 2 * largest < model_bytes / 2  # so that holding the model twice would fail below
    assert len(peaks) >= 2 * len(jax.tree.leaves(params))
    assert max(peaks) <= model_bytes + 2 * largest, (max(peaks), model_bytes, largest)


@pytest.mark.slow
def test_resident_memory_while_loading_stays_near_the_checkpoint(tmp_path):
    """A 125M-parameter float32 Llama-shaped checkpoint (500 MB, 32 layers, tied embeddings):
    peak resident memory above the baseline of a process that has imported qkv_jax and started
    JAX stays under 1.3x the checkpoint's bytes (benchmarks/pretrained_load.py measures a 1B
    bfloat16 one written by transformers, against transformers)."""
    layers, width, hidden, vocab = 32, 512, 2048, 8000
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    config.save_pretrained(tmp_path)
    shapes = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,)}
    for i in range(layers):
        block = f"model.layers.{i}"
        shapes.update(
            {
                f"{block}.input_layernorm.weight": (width,),
                f"{block}.post_attention_layernorm.weight": (width,),
            }
        )
        shapes.update({f"{block}.self_attn.{p}_proj.weight": (width, width) for p in "qo"})
        shapes.update({f"{block}.self_attn.{p}_proj.weight": (width // 2, width) for p in "kv"})
        shapes.update({f"{block}.mlp.{p}_proj.weight": (hidden, width) for p in ("gate", "up")})
        shapes[f"{block}.mlp.down_proj.weight"] = (width, hidden)
    save_file(
        {name: np.full(shape, 0.01, np.float32) for name, shape in shapes.items()},
        str(tmp_path / "model.safetensors"),
        {"format": "pt"},
    )
    stored = (tmp_path / "model.safetensors").stat().st_size
    code = textwrap.dedent(
        f"""
        import jax, qkv_jax
        def status(field):
            return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024
        jax.devices()
        before = status("VmRSS")
        config, params = qkv_jax.load_pretrained({str(tmp_path)!r})
        print(status("VmHWM") - before, sum(leaf.nbytes for leaf in jax.tree.leaves(params)))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    above, loaded = map(int, result.stdout.split()[-2:])
    assert loaded > 0.99 * stored  # the whole model is held
    assert above <= 1.3 * stored, (above / stored, above, stored)


# ------------------------------------------------------------------------------------ bad files


@bad_file("Checkpoints", "a Hugging Face directory without config.json", "PretrainedError naming the file")
def test_missing_config(tmp_path, llama):
    shutil.copy(llama[0] / "model.safetensors", tmp_path)
    with pytest.raises(PretrainedError) as error:
        load_pretrained(tmp_path)
    assert f"{tmp_path / 'config.json'}: no such file" in _one_line(error)


@bad_file("Checkpoints", "a config.json that is not JSON", "PretrainedError naming the file, line and column")
def test_invalid_config_json(tmp_path, llama):
    shutil.copy(llama[0] / "model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(PretrainedError) as error:
        load_pretrained(tmp_path)
    assert f"{tmp_path / 'config.json'}: not valid JSON" in _one_line(error)
    assert "line 2 column" in str(error.value)


@bad_file("Checkpoints", "a Hugging Face directory without weights", "PretrainedError naming the directory")
def test_missing_weights(tmp_path, llama):
    shutil.copy(llama[0] / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(PretrainedError) as error:
        load_pretrained(tmp_path)
    message = _one_line(error)
    assert f"{tmp_path}: holds neither model.safetensors nor model.safetensors.index.json" in message
    assert "PyTorch .bin weights are not read" in message


@bad_file("Checkpoints", "a truncated model.safetensors", "PretrainedError naming the file")
def test_truncated_safetensors(tmp_path, llama):
    shutil.copy(llama[0] / "config.json", tmp_path)
    data = (llama[0] / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(PretrainedError) as error:
        load_pretrained(tmp_path)
    assert f"{tmp_path / 'model.safetensors'}: not a readable safetensors file" in _one_line(error)


@bad_file("Checkpoints", "a model.safetensors with a corrupt header", "PretrainedError naming the file")
def test_corrupt_safetensors_header(tmp_path, llama):
    shutil.copy(llama[0] / "config.json", tmp_path)
    data = bytearray((llama[0] / "model.safetensors").read_bytes())
    data[8:20] = b"#" * 12  # the JSON header's first bytes
    (tmp_path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(PretrainedError) as error:
        load_pretrained(tmp_path)
    message = _one_line(error)
    assert f"{tmp_path / 'model.safetensors'}: not a readable safetensors file" in message
    assert "JSON" in message


@bad_file(
    "Checkpoints",
    "a shard that model.safetensors.index.json names is absent",
    "PretrainedError naming the index and the shard, before any tensor is read",
)
def test_missing_shard(tmp_path, llama_sharded):
    directory = tmp_path / "model"
    shutil.copytree(llama_sharded, directory)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(PretrainedError) as error:
        load_pretrained(directory)
    assert f"{directory / 'model.safetensors.index.json'}: names shard {shard.name!r}, which is missing" in (
        _one_line(error)
    )


@bad_file(
    "Checkpoints",
    "a tensor of the wrong shape",
    "PretrainedError naming the file, the tensor and both shapes",
)
def test_tensor_of_the_wrong_shape(tmp_path, llama):
    name = "model.layers.1.self_attn.q_proj.weight"

    def change(tensors):
        tensors[name] = np.zeros((32, 24), np.float32)
        return tensors

    directory = _copy_with(llama[0], tmp_path / "model", change)
    with pytest.raises(PretrainedError) as error:
        load_pretrained(directory)
    message = _one_line(error)
    assert f"{directory / 'model.safetensors'}: tensor {name!r}" in message
    assert "(32, 24)" in message


@bad_file(
    "Checkpoints", "a tensor missing from the checkpoint", "PretrainedError naming the file and the tensor"
)
def test_missing_tensor(tmp_path, llama):
    name = "model.layers.0.mlp.up_proj.weight"
    directory = _copy_with(llama[0], tmp_path / "model", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(PretrainedError) as error:
        load_pretrained(directory)
    assert f"{directory / 'model.safetensors'}: has no tensor {name!r}" in _one_line(error)


@bad_file("Checkpoints", "an unexpected extra tensor", "PretrainedError naming the file and the tensor")
def test_unexpected_tensor(tmp_path, llama):
    name = "model.layers.0.mlp.extra_proj.weight"
    directory = _copy_with(llama[0], tmp_path / "model", lambda t: {**t, name: np.ones((4, 4), np.float32)})
    with pytest.raises(PretrainedError) as error:
        load_pretrained(directory)
    message = _one_line(error)
    assert f"{directory / 'model.safetensors'}: unexpected tensor {name!r}" in message
    assert "which the llama mapping does not read" in message


def test_index_and_shards_must_agree(tmp_path, llama_sharded):
    directory = tmp_path / "model"
    shutil.copytree(llama_sharded, directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != shard)
    index["weight_map"][name] = other
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PretrainedError, match=f"assigns tensor '{name}' to {other}, which does not hold it"):
        load_pretrained(directory)


# ------------------------------------------------------------------------------------ config refusals


def _with_config(tmp_path: pathlib.Path, source: pathlib.Path, **changes) -> pathlib.Path:
    directory = tmp_path / "model"
    directory.mkdir()
    shutil.copy(source / "model.safetensors", directory)
    fields = json.loads((source / "config.json").read_text())
    fields.update(changes)
    (directory / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not ...}))
    return directory


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "gpt_oss", "no_such_model"])
def test_model_types_without_a_family_are_refused(tmp_path, llama, model_type):
    directory = _with_config(tmp_path, llama[0], model_type=model_type)
    with pytest.raises(ValueError) as error:
        load_pretrained(directory)
    message = _one_line(error)
    assert f"model_type={model_type!r} has no qkv_jax family" in message
    assert "supported: " in message and "llama" in message and "gpt2" in message
    assert ("mixture of experts" in message) == (model_type != "no_such_model")


def test_an_unread_field_is_refused_with_its_value(tmp_path, llama):
    directory = _with_config(tmp_path, llama[0], frobnicate_heads=3, use_cache=False)
    with pytest.raises(ValueError) as error:
        load_pretrained(directory)
    message = _one_line(error)
    assert "llama config: frobnicate_heads=3 is not read by the llama mapping" in message
    assert "use_cache" not in message  # metadata


def test_a_rope_scaling_qkv_jax_lacks_is_refused(tmp_path, llama):
    directory = _with_config(
        tmp_path,
        llama[0],
        rope_parameters=...,
        rope_theta=500000.0,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    )
    with pytest.raises(ValueError, match=r'llama config: rope_scaling.rope_type="dynamic" is a RoPE qkv_jax'):
        load_pretrained(directory)


def test_a_missing_model_type_is_a_bad_file(tmp_path, llama):
    directory = _with_config(tmp_path, llama[0], model_type=...)
    with pytest.raises(PretrainedError, match="config.json: has no model_type string"):
        load_pretrained(directory)


# ------------------------------------------------------------------------------------ HFConfig


def test_get_require_accept_and_refusals_name_the_field():
    hf = HFConfig(
        {"model_type": "llama", "hidden_size": 32, "attention_bias": 1, "pad_token_id": 0}, source="c.json"
    )
    assert hf.get("hidden_size") == 32 and hf.get("absent", 7) == 7
    with pytest.raises(ValueError, match=r"llama config: num_heads is missing \(c.json\)"):
        hf.require("num_heads")
    assert hf.accept("mlp_bias", False, True) is False  # absent: the first value
    with pytest.raises(
        ValueError, match=r"llama config: attention_bias=1 is not computed by qkv_jax \(it computes"
    ):
        hf.accept("attention_bias", False, True)  # 1 is not true in JSON
    hf.check_all_read()  # pad_token_id is metadata
    hf = HFConfig({"model_type": "x", "text_config": {"hidden_size": 8, "weird": None}, "dtype": "float32"})
    assert hf.section("text_config").get("hidden_size") == 8
    with pytest.raises(ValueError, match="x config: text_config.weird=null is not read"):
        hf.check_all_read()


def test_metadata_holds_only_fields_that_do_not_change_the_logits():
    from qkv_jax.pretrained.schema import METADATA

    for changes_the_model in (
        "tie_word_embeddings",
        "model_type",
        "rope_scaling",
        "quantization_config",
        "vocab_size",
    ):
        assert changes_the_model not in METADATA
    assert all(isinstance(why, str) and why for why in METADATA.values())


def _transformers5(cls, fields: dict) -> dict:
    """What transformers 5 writes for a transformers 4 config: its config.json fields."""
    return cls(**fields).to_diff_dict()


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
ROPE_CASES = {
    "none": {},
    "linear": {"rope_scaling": {"type": "linear", "factor": 4.0}},
    "llama3": {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 64}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    "yarn mscale": {
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        }
    },
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_both_rope_schemas_read_the_same(case):
    """A transformers 4 config (rope_theta + rope_scaling) and what transformers 5 makes of it
    (rope_parameters) give the same RoPE; yarn's attention factor is transformers' own."""
    old = {"model_type": "llama", "max_position_embeddings": 128, "rope_theta": 50000.0, **ROPE_CASES[case]}
    new = _transformers5(transformers.LlamaConfig, old)
    assert "rope_parameters" in new and "rope_scaling" not in new
    read_old, read_new = HFConfig(old).rope(), HFConfig(new).rope()
    assert read_old == read_new
    base, scaling = read_old["full_attention"]
    assert base == 50000.0
    if case == "none":
        assert scaling is None
        return
    assert scaling.kind == ROPE_CASES[case]["rope_scaling"].get(
        "type", ROPE_CASES[case]["rope_scaling"].get("rope_type")
    )
    if scaling.kind == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**old), "cpu")
        expected = 0.1 * np.log(4.0) + 1 if scaling.attention_factor is None else scaling.attention_factor
        assert expected == pytest.approx(attention_factor)
        assert (scaling.attention_factor is None) == (case == "yarn")


def test_llama3_scaling_reads_every_number():
    hf = HFConfig(
        {
            "model_type": "llama",
            "rope_parameters": {**LLAMA3, "rope_theta": 5e5, "original_max_position_embeddings": 8192},
        }
    )
    assert hf.rope() == {
        "full_attention": (
            5e5,
            RopeScaling("llama3", 8.0, original_max_len=8192, low_freq_factor=1.0, high_freq_factor=4.0),
        )
    }
    hf.check_all_read()


def test_gemma3_rope_per_layer_type_from_both_schemas():
    old = {
        "model_type": "gemma3_text",
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    new = _transformers5(transformers.Gemma3TextConfig, old)
    kinds = ("full_attention", "sliding_attention")
    expected = {"full_attention": (1e6, RopeScaling("linear", 8.0)), "sliding_attention": (1e4, None)}
    assert HFConfig(old).rope(kinds) == expected
    assert HFConfig(new).rope(kinds) == expected
    with pytest.raises(ValueError, match="rope_parameters.chunked_attention is missing"):
        HFConfig(new).rope(("full_attention", "chunked_attention"))


def test_rope_fraction_and_unknown_rope_keys():
    neox = _transformers5(transformers.GPTNeoXConfig, {"rotary_pct": 0.25, "rotary_emb_base": 10000})
    hf = HFConfig(neox)
    hf.rope()
    assert "rope_parameters.partial_rotary_factor" in hf.unread()  # refused unless read
    assert hf.rope_fraction("rotary_pct") == 0.25
    assert "rope_parameters.partial_rotary_factor" not in hf.unread()
    assert HFConfig({"model_type": "gpt_neox", "rotary_pct": 0.5}).rope_fraction("rotary_pct") == 0.5
    assert HFConfig({"model_type": "llama"}).rope_fraction() == 1.0
    with pytest.raises(ValueError, match=r'rope_parameters.beta_fast=2 is not read with rope_type="linear"'):
        HFConfig(
            {"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2, "beta_fast": 2}}
        ).rope()
    with pytest.raises(ValueError, match=r"rope_scaling.low_freq_factor is missing"):
        HFConfig(
            {
                "model_type": "llama",
                "max_position_embeddings": 64,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
            }
        ).rope()
    with pytest.raises(ValueError, match=r"rope_scaling.original_max_position_embeddings is missing"):
        HFConfig({"model_type": "llama", "rope_scaling": LLAMA3}).rope()


# ------------------------------------------------------------------------------------ saving


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_save_round_trip_loads_in_transformers(tmp_path, request, kind):
    source, model = request.getfixturevalue(kind)
    config, params = load_pretrained(source)
    target = save_pretrained(tmp_path / "saved", config, params)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager")
    _close(_logits(reloaded), _logits(model))
    again_config, again = load_pretrained(target)
    assert again_config == config
    _close(_ours(again_config, again), _logits(model))


def test_sharded_save(tmp_path, llama, loaded):
    config, params = loaded
    limit = 6000
    target = save_pretrained(tmp_path / "saved", config, params, max_shard_size=limit)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(target.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    stored = 0
    for shard in shards:
        tensors = _tensors(shard)
        size = sum(t.nbytes for t in tensors.values())
        assert size <= limit or len(tensors) == 1
        assert {n for n, s in index["weight_map"].items() if s == shard.name} == set(tensors)
        stored += size
    assert index["metadata"]["total_size"] == stored
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager")
    _close(_logits(reloaded), _logits(llama[1]))


def test_bfloat16_save(tmp_path, loaded, llama):
    config, params = loaded
    narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    narrow_config = dataclasses.replace(config, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    target = save_pretrained(tmp_path / "saved", narrow_config, narrow)
    assert json.loads((target / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(target / "model.safetensors"), framework="numpy") as handle:
        assert {handle.get_slice(n).get_dtype() for n in handle.keys()} == {"BF16"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(target, dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    np.testing.assert_array_equal(
        reloaded.model.embed_tokens.weight.detach().float().numpy(),
        np.asarray(narrow["token_embedding"]["embedding"]).astype(np.float32),
    )
    assert ml_dtypes.bfloat16 == np.asarray(narrow["head"]["kernel"]).dtype


def test_save_refuses_a_non_empty_directory_unless_overwrite(tmp_path, llama, loaded):
    config, params = loaded
    directory = tmp_path / "model"
    shutil.copytree(llama[0], directory)
    before = _snapshot(directory)
    with pytest.raises(
        ValueError, match=r"is not empty \(config.json, generation_config.json, model.safetensors\)"
    ):
        save_pretrained(directory, config, params)
    assert _snapshot(directory) == before
    (tmp_path / "empty").mkdir()
    save_pretrained(tmp_path / "empty", config, params)  # an empty directory is filled
    save_pretrained(directory, config, params, overwrite=True, max_shard_size=10_000)
    assert "generation_config.json" not in {p.name for p in directory.iterdir()}  # replaced whole
    assert (directory / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model"]  # nothing left beside
    _close(_ours(*load_pretrained(directory)), _logits(llama[1]))


def test_a_failed_save_leaves_nothing_and_damages_nothing(tmp_path, loaded, monkeypatch):
    config, params = loaded
    family = FAMILIES["llama"]
    written = family.to_hf

    def failing(config, params):
        for count, item in enumerate(written(config, params)):
            if count == 5:
                raise OSError("disk on fire")
            yield item

    monkeypatch.setattr(family, "to_hf", failing)
    with pytest.raises(OSError, match="disk on fire"):
        save_pretrained(tmp_path / "new", config, params, model_type="llama")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(family, "to_hf", written)
    existing = save_pretrained(tmp_path / "existing", config, params)
    before = _snapshot(existing)
    monkeypatch.setattr(family, "to_hf", failing)
    with pytest.raises(OSError, match="disk on fire"):
        save_pretrained(existing, config, params, overwrite=True)
    assert _snapshot(existing) == before
    assert [p.name for p in tmp_path.iterdir()] == ["existing"]


def test_save_reads_a_config_by_what_it_computes(tmp_path, loaded, llama):
    """A config written another way (explicit kv heads, a window pattern over the layers) that
    reads back canonicalized is saved, and transformers computes the same logits."""
    config, params = loaded
    spelled = dataclasses.replace(
        config, num_kv_heads=config.num_kv_heads or config.num_heads, window=(None,)
    )
    target = save_pretrained(tmp_path / "saved", spelled, params)
    _close(_logits(transformers.AutoModelForCausalLM.from_pretrained(target)), _logits(llama[1]))


def test_save_refuses_what_no_family_writes(tmp_path, loaded):
    config, params = loaded
    with pytest.raises(ValueError, match="lora_rank=2: merge the adapters"):
        save_pretrained(tmp_path / "a", dataclasses.replace(config, lora_rank=2), params)
    with pytest.raises(ValueError, match="no family writes this config exactly"):
        save_pretrained(tmp_path / "b", dataclasses.replace(config, causal=False), params)
    with pytest.raises(ValueError, match="model_type='mixtral' has no qkv_jax family"):
        save_pretrained(tmp_path / "c", config, params, model_type="mixtral")
    assert list(tmp_path.iterdir()) == []


def test_shard_sizes_read_as_transformers_spells_them():
    assert shard_bytes("500MB") == 500 * 10**6
    assert shard_bytes("2GiB") == 2 * 2**30
    assert shard_bytes("5GB") == 5 * 10**9
    assert shard_bytes(1234) == 1234
    for bad in ("lots", "0", -1, "5 parsecs"):
        with pytest.raises(ValueError, match="max_shard_size"):
            shard_bytes(bad)


# ------------------------------------------------------------------- pieces of the workflows


def test_save_copies_files_inside_the_atomic_write(tmp_path, loaded):
    config, params = loaded
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0"}\n')
    target = save_pretrained(tmp_path / "saved", config, params, files=[tokenizer])
    assert (target / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    refused = ((tmp_path / "absent.json", "is not a file"), (target / "config.json", "writes config.json"))
    for bad, message in refused:
        with pytest.raises(ValueError, match=message):
            save_pretrained(tmp_path / "refused", config, params, files=[bad])
        assert not (tmp_path / "refused").exists()  # refused before any work


def test_load_config_reads_no_tensor_and_agrees_with_load_pretrained(llama, loaded):
    from qkv_jax.pretrained.io import is_pretrained_directory, load_config

    config, model_type = load_config(llama[0])
    assert model_type == "llama"
    assert config == dataclasses.replace(loaded[0], dtype=config.dtype, param_dtype=config.param_dtype)
    assert is_pretrained_directory(llama[0]) and not is_pretrained_directory(llama[0].parent)


def test_init_from_reads_a_checkpoint_directory(llama, loaded, tmp_path):
    from qkv_jax.training.init_from import read_source
    from qkv_jax.training.validate import ConfigError

    saved = read_source({"train": {"init_from": str(llama[0])}})
    assert saved.step == 0
    chex.assert_trees_all_equal(saved.tree, loaded[1])
    with pytest.raises(ConfigError, match=r"nor is it a Hugging Face checkpoint"):
        read_source({"train": {"init_from": str(tmp_path)}})


def test_a_model_section_changes_a_checkpoint_config_field_by_field(loaded):
    from qkv_jax.tasks.transformer import transformer_config

    base = loaded[0]
    changed = transformer_config(
        {"num_kv_heads": 1, "lora_rank": 4, "norm": None}, base.vocab_size, base=base
    )
    assert changed == dataclasses.replace(base, num_kv_heads=1, lora_rank=4)
