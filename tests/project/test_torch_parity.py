"""Parity with PyTorch (skipped when torch is not installed; CI installs it)."""

import jax
import numpy as np
import pytest

import qkv_jax
from qkv_jax.interop import from_torch_multihead_attention, to_torch_multihead_attention

torch = pytest.importorskip("torch")
F = torch.nn.functional


def to_torch_layout(x):  # (B, L, N, H) -> (B, N, L, H)
    return torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2)))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_scaled_dot_product_attention(is_causal, num_kv_heads):
    rng = np.random.default_rng(0)
    B, T, N, H, Hv = 2, 7, 4, 8, 5
    query = rng.normal(size=(B, T, N, H)).astype(np.float32)
    key = rng.normal(size=(B, T, num_kv_heads, H)).astype(np.float32)
    value = rng.normal(size=(B, T, num_kv_heads, Hv)).astype(np.float32)
    want = F.scaled_dot_product_attention(
        to_torch_layout(query),
        to_torch_layout(key),
        to_torch_layout(value),
        is_causal=is_causal,
        enable_gqa=num_kv_heads != N,
    )
    got = qkv_jax.dot_product_attention(query, key, value, is_causal=is_causal)
    np.testing.assert_allclose(got, np.swapaxes(want.numpy(), 1, 2), atol=1e-5)


def test_scaled_dot_product_attention_with_mask_and_scale():
    rng = np.random.default_rng(1)
    query, key, value = (rng.normal(size=(2, 5, 2, 4)).astype(np.float32) for _ in range(3))
    mask = rng.random((2, 1, 5, 5)) < 0.7
    mask[..., 0] = True  # torch gives NaN for fully masked rows on this path
    want = F.scaled_dot_product_attention(
        *(to_torch_layout(x) for x in (query, key, value)),
        attn_mask=torch.from_numpy(mask),
        scale=0.3,
    )
    got = qkv_jax.dot_product_attention(query, key, value, mask=mask, scale=0.3)
    np.testing.assert_allclose(got, np.swapaxes(want.numpy(), 1, 2), atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_weights_convert(bias):
    torch.manual_seed(0)
    embed_dim, num_heads = 8, 2
    mha = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=True)
    assert sum(p.numel() for p in mha.parameters()) == (288 if bias else 256)
    query = torch.randn(3, 4, embed_dim)
    memory = torch.randn(3, 6, embed_dim)
    key_padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] + [True] * 5])
    want, _ = mha(query, memory, memory, key_padding_mask=key_padding)

    variables = from_torch_multihead_attention(mha, num_heads)
    ours = qkv_jax.MultiHeadAttention(num_heads=num_heads, use_bias=bias)
    assert jax.tree.map(np.shape, variables) == jax.tree.map(
        np.shape, ours.init(jax.random.PRNGKey(0), query.numpy(), memory.numpy())
    )
    mask = ~key_padding.numpy()[:, None, None, :]  # torch: True = ignore; ours: True = attend
    got = ours.apply(variables, query.numpy(), memory.numpy(), mask=mask)
    np.testing.assert_allclose(got, want.detach().numpy(), atol=1e-5)

    # Causal self-attention: torch's bool attn_mask is True where attending is *not* allowed.
    causal = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)
    want_causal, _ = mha(query, query, query, attn_mask=causal)
    got_causal = qkv_jax.MultiHeadAttention(num_heads, use_bias=bias, is_causal=True).apply(
        variables, query.numpy()
    )
    np.testing.assert_allclose(got_causal, want_causal.detach().numpy(), atol=1e-5)


def test_round_trip_to_torch_and_back():
    module = qkv_jax.MultiHeadAttention(num_heads=4)
    x = np.random.default_rng(2).normal(size=(2, 5, 8)).astype(np.float32)
    variables = module.init(jax.random.PRNGKey(0), x)
    mha = torch.nn.MultiheadAttention(8, 4, batch_first=True)
    mha.load_state_dict(to_torch_multihead_attention(variables))
    want, _ = mha(*(torch.from_numpy(x),) * 3)
    np.testing.assert_allclose(module.apply(variables, x), want.detach().numpy(), atol=1e-5)
    back = from_torch_multihead_attention(mha.state_dict(), num_heads=4)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), back, variables)


def test_state_dict_with_separate_kv_projections():
    mha = torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=6, batch_first=True)
    query, memory = torch.randn(2, 3, 8), torch.randn(2, 4, 6)
    want, _ = mha(query, memory, memory)
    variables = from_torch_multihead_attention(mha.state_dict(), num_heads=2)
    got = qkv_jax.MultiHeadAttention(num_heads=2).apply(variables, query.numpy(), memory.numpy())
    np.testing.assert_allclose(got, want.detach().numpy(), atol=1e-5)


def test_converter_errors():
    with pytest.raises(ValueError, match="num_heads=3 does not divide embed_dim=8"):
        from_torch_multihead_attention(torch.nn.MultiheadAttention(8, 2), 3)
    with pytest.raises(ValueError, match="add_bias_kv=True is not supported"):
        from_torch_multihead_attention(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True), 2)
    gqa = qkv_jax.MultiHeadAttention(num_heads=4, num_kv_heads=2)
    variables = gqa.init(jax.random.PRNGKey(0), np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="torch needs num_kv_heads == num_heads"):
        to_torch_multihead_attention(variables)
