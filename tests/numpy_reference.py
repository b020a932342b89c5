"""Float64 NumPy attention, written independently of qkv_jax for the tests.

Everything is spelled out the slow, obvious way: a loop over every (batch,
head, query) row and, for the masks, over every key.
"""

import numpy as np


def causal(T, S, query_offset=0):
    """`[T, S]`: query t (at key position t + query_offset) may attend keys s <= t + query_offset."""
    return np.arange(S)[None, :] <= np.arange(T)[:, None] + query_offset


def allowed_pairs(
    batch,
    N,
    T,
    S,
    mask=None,
    is_causal=False,
    window=None,
    query_offset=0,
    query_lengths=None,
    key_lengths=None,
    query_segments=None,
    key_segments=None,
):
    """Boolean `[*batch, N, T, S]`: which keys each query of each head may attend.

    `window` is None or (left, right); `query_offset`, `query_lengths` and
    `key_lengths` are ints or arrays broadcastable to `batch`; segment ids
    broadcast to `[*batch, T]` and `[*batch, S]`.
    """
    offset = np.broadcast_to(query_offset, batch)
    allowed = np.ones((*batch, N, T, S), bool)
    if mask is not None:
        allowed &= np.broadcast_to(mask, allowed.shape)
    for b in np.ndindex(*batch):
        for t in range(T):
            position = t + offset[b]  # the query's key position
            for s in range(S):
                ok = True
                if is_causal and s > position:
                    ok = False
                if window is not None and not (position - window[0] <= s <= position + window[1]):
                    ok = False
                if query_lengths is not None and t >= np.broadcast_to(query_lengths, batch)[b]:
                    ok = False
                if key_lengths is not None and s >= np.broadcast_to(key_lengths, batch)[b]:
                    ok = False
                if query_segments is not None:
                    query_id = np.broadcast_to(query_segments, (*batch, T))[b][t]
                    if query_id != np.broadcast_to(key_segments, (*batch, S))[b][s]:
                        ok = False
                if not ok:
                    allowed[b][:, t, s] = False
    return allowed


def attention_full(query, key, value, allowed=None, bias=None, scale=None, soft_cap=None, sinks=None):
    """query [..., T, N, H], key [..., S, K, H], value [..., S, K, Hv] -> (out, weights, residual).

    `allowed` is a boolean mask broadcastable to `[..., N, T, S]` (a -inf bias
    forbids too), `soft_cap` c turns the scaled, biased logits into
    c * tanh(logits / c), `sinks` `[..., N]` (broadcastable) adds exp(sink) to
    each row's softmax denominator. Loops over heads and rows, repeating kv
    heads explicitly. A row with no allowed key gives zero weights and zero
    output; its residual (log of the denominator) is the sink's logit, or -inf.
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
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    ok_pairs = logits > -np.inf  # a -inf bias forbids like a False mask
    if allowed is not None:
        ok_pairs = ok_pairs & np.broadcast_to(allowed, logits.shape)
    sink = None if sinks is None else np.broadcast_to(np.asarray(sinks, np.float64), (*batch, N))
    weights = np.zeros_like(logits)
    residual = np.full((*batch, T, N), -np.inf)
    for index in np.ndindex(*logits.shape[:-1]):
        *b, n, t = index
        row, ok = logits[index], ok_pairs[index]
        candidates = list(row[ok]) + ([] if sink is None else [sink[(*b, n)]])
        if not candidates:
            continue
        top = max(candidates)
        e = np.exp(row[ok] - top)
        denominator = e.sum() + (0.0 if sink is None else np.exp(sink[(*b, n)] - top))
        weights[index][ok] = e / denominator
        residual[(*b, t, n)] = top + np.log(denominator)
    out = np.zeros((*batch, T, N, value.shape[-1]))
    for n in range(N):
        v = value[..., :, n // group, :]  # (..., S, Hv)
        out[..., :, n, :] = weights[..., n, :, :] @ v
    return out, weights, residual


def attention(query, key, value, mask=None, bias=None, scale=None):
    """`attention_full`'s (out, weights) for a boolean `mask` (True = may attend)."""
    out, weights, _ = attention_full(query, key, value, allowed=mask, bias=bias, scale=scale)
    return out, weights


def slow_rope(x, positions, base, fraction):
    """float64 rotation, pair by pair: dims (i, i + r/2) of the leading r turn by p * base^(-2i/r)."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    H = x.shape[-1]
    r = int(H * fraction)
    positions = np.broadcast_to(np.asarray(positions), x.shape[:-2])
    for index in np.ndindex(*x.shape[:-1]):
        p = positions[index[:-1]]
        for i in range(r // 2):
            angle = p * base ** (-2.0 * i / r)
            rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
            out[(*index, [i, i + r // 2])] = rotation @ x[(*index, [i, i + r // 2])]
    return out
