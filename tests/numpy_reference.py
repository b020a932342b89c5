"""Float64 NumPy attention, written independently of qkv_jax for the tests."""

import numpy as np


def attention(query, key, value, mask=None, bias=None, scale=None):
    """query [..., T, N, H], key [..., S, K, H], value [..., S, K, Hv] -> (out, weights).

    Loops over heads and repeats kv heads explicitly; a row with no allowed key
    gives zero weights and zero output.
    """
    query, key, value = (np.asarray(x, np.float64) for x in (query, key, value))
    *batch, T, N, H = query.shape
    S, K = key.shape[-3], key.shape[-2]
    group = N // K
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    logits = np.empty((*batch, N, T, S))
    for n in range(N):
        q = query[..., :, n, :]  # (..., T, H)
        k = key[..., :, n // group, :]  # (..., S, H)
        logits[..., n, :, :] = q @ np.swapaxes(k, -1, -2) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = logits > -np.inf  # a -inf bias forbids like a False mask
    if mask is not None:
        allowed = allowed & np.broadcast_to(mask, logits.shape)
    weights = np.zeros_like(logits)
    for index in np.ndindex(*logits.shape[:-1]):
        row, ok = logits[index], allowed[index]
        if ok.any():
            e = np.exp(row[ok] - row[ok].max())
            weights[index][ok] = e / e.sum()
    out = np.zeros((*batch, T, N, value.shape[-1]))
    for n in range(N):
        v = value[..., :, n // group, :]  # (..., S, Hv)
        out[..., :, n, :] = weights[..., n, :, :] @ v
    return out, weights


def causal(T, S):
    """Queries are the last T of S positions."""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
