"""Circuits of the learned matrices: what each head's W_Q, W_K, W_V and W_O compute together.

Pure functions of a `TransformerLM`'s parameters (Elhage et al. 2021, "A
Mathematical Framework for Transformer Circuits"), in the row-vector
convention of the code (a residual vector x is a row; a head reads x W):

  head_weights        every layer's per-head matrices, stacked: W_Q `[L, N, D, H]`,
                      W_K `[L, N, D, H]`, W_V `[L, N, D, Hv]`, W_O `[L, N, Hv, D]` and
                      biases (TransformerLens's layout). Grouped K/V heads are repeated
                      to the N query heads (head n reads kv head n // (N / K)); an MLA
                      latent is folded into W_K and W_V (W_C W_K); LoRA adapters are
                      added to their kernels; optionally the LayerNorm before the
                      attention is folded in.
  embedding_weights   W_E `[V, D]`, W_pos `[max_len, D]`, W_U `[D, V]`, b_U `[V]`
                      (optionally with the final LayerNorm folded into W_U and b_U).
  qk_matrices         W_QK = W_Q W_K^T `[L, N, D, D]`: the bilinear form of the logits
                      (query residual x, key residual y: x W_QK y^T, before the scale;
                      with RoPE the logit is x W_Q R_(t-s) W_K^T y, and W_QK is its form
                      at offset 0 only; QK-norm is refused, its logits are not bilinear).
  ov_matrices         W_OV = W_V W_O `[L, N, D, D]`: what a head writes for a key it reads.
  qk_singular_values, ov_singular_values   their singular values `[L, N, H]` /
                      `[L, N, Hv]`, from the factors (no D x D matrix is built).
  singular_values     of any factored product A B (`[..., m, k]`, `[..., k, n]`).
  effective_rank      exp(entropy of the normalised singular values) (Roy and
                      Vetterli 2007): k for k equal singular values, 1 for rank one.
  composition_scores  Q-, K- and V-composition of every head pair `[L, N, L, N]`:
                      ||W_OV^1 M^2||_F / (||W_OV^1||_F ||M^2||_F) with M^2 = W_QK^2
                      (Q), W_QK^2^T (K) or W_OV^2 (V), as TransformerLens computes
                      them (zero unless the first head's layer comes first).
  token_qk_circuit    E_q W_QK^{l,h} E_k^T `[A, B]`: the head's logits between two
                      sets of residual directions (e.g. token embeddings).
  token_ov_circuit    E W_OV^{l,h} W_U `[A, V]`: the logits a head adds when it
                      attends to each token, through the direct path.
  copying_scores      sum(lambda) / sum(|lambda|) over the eigenvalues of each head's
                      full OV circuit W_E W_OV W_U `[L, N]`: near 1 for a head that
                      raises the logit of the token it attends to.

The token circuits use only the direct path and leave out the LayerNorms'
normalisation (they are exact for a model without MLPs and LayerNorms);
`fold_layer_norm=True` folds the LayerNorms' scale and bias into the weights
and centres the reading weights (TransformerLens's `fold_ln`), which is the
circuit of the normalised residual stream. Every function here is jit-able
(`fold_layer_norm` and `mode` static) and computes its products in full float32
precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from qkv_jax.lora import effective_kernel, has_adapters

Array = jax.Array

__all__ = [
    "HeadWeights",
    "EmbeddingWeights",
    "head_weights",
    "embedding_weights",
    "num_layers",
    "unembedding",
    "qk_matrices",
    "ov_matrices",
    "per_matrix",
    "singular_values",
    "qk_singular_values",
    "ov_singular_values",
    "effective_rank",
    "composition_scores",
    "token_qk_circuit",
    "token_ov_circuit",
    "copying_scores",
]

HIGHEST = lax.Precision.HIGHEST


class HeadWeights(NamedTuple):
    """Every layer's attention matrices per query head (a pytree; L layers, N heads).

    W_Q `[L, N, D, H]`, b_Q `[L, N, H]`; W_K `[L, N, D, H]`, b_K `[L, N, H]`;
    W_V `[L, N, D, Hv]`, b_V `[L, N, Hv]`; W_O `[L, N, Hv, D]`, b_O `[L, D]`.
    Head n of a grouped layer carries its kv head n // (N / K)'s W_K and W_V.
    """

    W_Q: Array
    b_Q: Array
    W_K: Array
    b_K: Array
    W_V: Array
    b_V: Array
    W_O: Array
    b_O: Array


class EmbeddingWeights(NamedTuple):
    """W_E `[V, D]` (token embedding), W_pos `[max_len, D]`, W_U `[D, V]` and b_U `[V]` (a pytree)."""

    W_E: Array
    W_pos: Array
    W_U: Array
    b_U: Array


def _model_params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The parameter tree of a TransformerLM, given it or variables holding it under "params"."""
    params = params.get("params", params)
    if "token_embedding" not in params or "block_0" not in params:
        raise ValueError(
            "params must be a TransformerLM's parameters (token_embedding, block_0, ...), "
            f"got keys {sorted(params)}"
        )
    return params


def num_layers(params: Mapping[str, Any]) -> int:
    """The number of blocks of a TransformerLM's `params` (`block_0` ... `block_{L-1}`)."""
    return sum(1 for name in _model_params(params) if name.startswith("block_"))


def unembedding(params: Mapping[str, Any]) -> Array:
    """W_U `[D, V]`: the head's kernel, or the token embedding's transpose for a tied head
    (tie_embeddings: no `head` parameter)."""
    params = _model_params(params)
    if "head" in params:
        return params["head"]["kernel"]
    return jnp.transpose(params["token_embedding"]["embedding"])


def _bias(projection: Mapping[str, Any], kernel: Array) -> Array:
    """The projection's bias, zeros of the kernel's output dims without one (qkv_bias, out_bias False)."""
    if "bias" in projection:
        return projection["bias"]
    return jnp.zeros(kernel.shape[1:], kernel.dtype)


def _kernel(projection: Mapping[str, Any], lora_alpha: float | None) -> Array:
    return effective_kernel(projection, 1.0 if lora_alpha is None else lora_alpha)


def _fold_norm(norm: Mapping[str, Any], kernel: Array, bias: Array) -> tuple[Array, Array]:
    """A kernel `[D, ...]` reading LN(x) = x_hat * scale + shift, as one reading x_hat:
    (scale * kernel) centred over D, and bias + shift @ kernel (TransformerLens's fold_ln)."""
    if "bias" not in norm:
        raise ValueError(
            "fold_layer_norm: the norm has no bias (an RMS norm, 'rms' or 'rms_offset', which the "
            "parameters do not tell apart, and whose statistics are not centred): only LayerNorms fold"
        )
    scale, shift = norm["scale"], norm["bias"]  # (D,), (D,)
    bias = bias + jnp.tensordot(shift, kernel, axes=1, precision=HIGHEST)  # (...)
    folded = kernel * scale.reshape(-1, *(1,) * (kernel.ndim - 1))  # (D, ...)
    return folded - jnp.mean(folded, axis=0, keepdims=True), bias


def _layer_weights(block: Mapping[str, Any], lora_alpha: float | None, fold_layer_norm: bool) -> HeadWeights:
    """One block's HeadWeights without the layer axis."""
    attention = block["attention"]
    if "query_ln" in attention or "key_ln" in attention:
        raise ValueError("head_weights: the attention normalises q and k (normalize_qk): W_QK is not linear")
    projections = {}
    for name in ("query", "key", "value"):
        kernel = _kernel(attention[name], lora_alpha)
        projections[name] = (
            kernel,
            _bias(attention[name], kernel),
        )  # query (D, N, H), (N, H); key (D|C, K, H), (K, H); value (D|C, K, Hv), (K, Hv)
    if "kv_latent" in attention:  # K = (x W_C + b_C) W_K + b_K = x (W_C W_K) + (b_C W_K + b_K)
        latent_kernel = _kernel(attention["kv_latent"], lora_alpha)  # (D, C)
        latent_bias = attention["kv_latent"]["bias"]  # (C,)
        for name in ("key", "value"):
            kernel, bias = projections[name]
            projections[name] = (
                jnp.einsum("dc,ckh->dkh", latent_kernel, kernel, precision=HIGHEST),  # (D, K, H)
                bias + jnp.einsum("c,ckh->kh", latent_bias, kernel, precision=HIGHEST),  # (K, H)
            )
    if fold_layer_norm:
        if "attention_norm" not in block:
            raise ValueError(
                "head_weights: fold_layer_norm, and the block has no norm before its attention "
                "(norm_placement='post')"
            )
        projections = {
            name: _fold_norm(block["attention_norm"], kernel, bias)
            for name, (kernel, bias) in projections.items()
        }
    num_heads = projections["query"][0].shape[1]

    def per_query_head(kernel: Array, bias: Array) -> tuple[Array, Array]:
        """`[D, K, H]`, `[K, H]` -> `[N, D, H]`, `[N, H]`: head n gets kv head n // (N / K)."""
        group = num_heads // kernel.shape[1]
        kernel = jnp.repeat(kernel, group, axis=1)  # (D, N, H)
        return jnp.swapaxes(kernel, 0, 1), jnp.repeat(bias, group, axis=0)  # (N, D, H), (N, H)

    W_Q, b_Q = per_query_head(*projections["query"])
    W_K, b_K = per_query_head(*projections["key"])
    W_V, b_V = per_query_head(*projections["value"])
    W_O = _kernel(attention["out"], lora_alpha)  # (N, Hv, D)
    b_O = attention["out"]["bias"] if "bias" in attention["out"] else jnp.zeros(W_O.shape[-1], W_O.dtype)
    return HeadWeights(W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, b_O)


def head_weights(
    params: Mapping[str, Any], *, lora_alpha: float | None = None, fold_layer_norm: bool = False
) -> HeadWeights:
    """Every layer's per-head attention matrices of a TransformerLM, stacked over layers.

    Args:
      params: the TransformerLM's parameters (or variables with "params").
      lora_alpha: the model's `lora_alpha`, needed when the parameters hold
        LoRA adapters (each kernel is then `effective_kernel`'s W + (alpha/r) A B).
      fold_layer_norm: fold each block's attention LayerNorm (scale and bias)
        into W_Q, W_K, W_V and their biases and centre those over D, so that
        they read the normalised residual (x - mean) / std.

    Returns:
      `HeadWeights` (W_Q `[L, N, D, H]` ... W_O `[L, N, Hv, D]`, b_O `[L, D]`);
      grouped K/V heads repeated to the N query heads, an MLA latent folded
      into W_K and W_V (`[D, C] @ [C, H]`) and into their biases.
    """
    params = _model_params(params)
    if lora_alpha is None and has_adapters(params):
        raise ValueError(
            "head_weights: params hold LoRA adapters (lora_a/lora_b); pass lora_alpha "
            "(the model's TransformerConfig.lora_alpha)"
        )
    layers = [
        _layer_weights(params[f"block_{layer}"], lora_alpha, fold_layer_norm)
        for layer in range(num_layers(params))
    ]
    return HeadWeights(*(jnp.stack(arrays) for arrays in zip(*layers, strict=True)))


def embedding_weights(
    params: Mapping[str, Any], *, fold_layer_norm: bool = False, embedding_scale: float | None = None
) -> EmbeddingWeights:
    """W_E `[V, D]`, W_pos `[max_len, D]`, W_U `[D, V]` and b_U `[V]` of a TransformerLM.

    The head has no bias: b_U is zero, unless `fold_layer_norm` folds the final
    LayerNorm into the unembedding (W_U scaled by its scale and centred over D,
    b_U = its bias @ W_U), so that W_U reads the normalised final residual
    (ValueError for an RMS final norm). A tied head's W_U is the token
    embedding's transpose. Without a `position_embedding` (RoPE or no
    positions) W_pos is `[0, D]`. `embedding_scale`: the model's
    TransformerConfig.embedding_scale, which the parameters do not hold; W_E is
    then the scaled embedding the residual stream receives (W_U stays unscaled).
    """
    params = _model_params(params)
    W_U = unembedding(params)  # (D, V)
    b_U = jnp.zeros(W_U.shape[-1], W_U.dtype)  # (V,)
    if fold_layer_norm:
        W_U, b_U = _fold_norm(params["final_norm"], W_U, b_U)
    W_E = params["token_embedding"]["embedding"]  # (V, D)
    W_pos = params.get("position_embedding", jnp.zeros((0, W_E.shape[-1]), W_E.dtype))  # (max_len | 0, D)
    if embedding_scale is not None:
        W_E = W_E * jnp.asarray(embedding_scale, W_E.dtype)
    return EmbeddingWeights(W_E, W_pos, W_U, b_U)


def qk_matrices(weights: HeadWeights) -> Array:
    """W_QK = W_Q W_K^T `[L, N, D, D]` per head (query residual on the left, key residual on the right)."""
    return jnp.einsum("lnqh,lnkh->lnqk", weights.W_Q, weights.W_K, precision=HIGHEST)  # (L, N, D, D)


def ov_matrices(weights: HeadWeights) -> Array:
    """W_OV = W_V W_O `[L, N, D, D]` per head (read residual on the left, written residual on the right)."""
    return jnp.einsum("lndv,lnve->lnde", weights.W_V, weights.W_O, precision=HIGHEST)  # (L, N, D, D)


def per_matrix(fn: Callable[[Array], Any], a: Array) -> Any:
    """`fn` (one LAPACK decomposition of one matrix `[m, n]`) over the leading dims of `a`
    `[..., m, n]`, one matrix per call (`jax.lax.map`).

    Why not one batched call: jaxlib's CPU LAPACK kernels split a large batch over
    XLA:CPU's intra-op thread pool and block until its pieces are done. Two such
    calls running at once in one program (the QK and the OV spectra, say) can
    each hold one of a 2-core machine's two workers while waiting for the
    other's pieces, and the program never finishes (seen: the explorer page's
    circuits of a char LM hung in `gesdd`). A single matrix per call runs
    inline on the worker. The matrices here are small (head depth at most the
    model width), so the loop costs little; under `jax.vmap` each call takes
    the mapped axis as its batch.
    """
    batch = a.shape[:-2]
    flat = a.reshape(-1, *a.shape[-2:])  # (prod(batch), m, n)
    out = lax.map(fn, flat)
    return jax.tree.map(lambda x: x.reshape(*batch, *x.shape[1:]), out)


def _triangle(a: Array) -> Array:
    """R `[..., k, k]` of the reduced QR of `a` `[..., m, k]` (m >= k): a = Q R with Q's columns
    orthonormal, so ||a M||_F = ||R M||_F and a M has a's singular structure in R."""
    return per_matrix(lambda m: jnp.linalg.qr(m, mode="r"), a)  # (..., k, k)


def singular_values(a: Array, b: Array) -> Array:
    """Singular values of the product a b, descending, from its factors.

    `a` `[..., m, k]`, `b` `[..., k, n]` with k <= m, n; returns `[..., k]`.
    With a = Q_a R_a and b^T = Q_b R_b (reduced QR), a b = Q_a (R_a R_b^T) Q_b^T,
    so only the k x k matrix R_a R_b^T is decomposed.
    """
    core = jnp.einsum(
        "...ij,...kj->...ik", _triangle(a), _triangle(jnp.swapaxes(b, -1, -2)), precision=HIGHEST
    )  # (..., k, k)
    return per_matrix(lambda m: jnp.linalg.svd(m, compute_uv=False), core)  # (..., k)


def qk_singular_values(weights: HeadWeights) -> Array:
    """Singular values of each head's W_QK, `[L, N, H]` (descending)."""
    return singular_values(weights.W_Q, jnp.swapaxes(weights.W_K, -1, -2))


def ov_singular_values(weights: HeadWeights) -> Array:
    """Singular values of each head's W_OV, `[L, N, Hv]` (descending)."""
    return singular_values(weights.W_V, weights.W_O)


def effective_rank(values: Array) -> Array:
    """exp(entropy) of singular values `[..., k]` normalised to sum 1 -> `[...]` (Roy and Vetterli 2007).

    Between 1 (one non-zero value) and k (k equal values); zeros count as
    absent. All-zero values give 1.
    """
    total = jnp.sum(values, axis=-1, keepdims=True)  # (..., 1)
    p = values / jnp.where(total > 0, total, 1.0)  # (..., k)
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)  # (...)
    return jnp.exp(entropy)


def composition_scores(weights: HeadWeights, mode: Literal["Q", "K", "V"]) -> Array:
    """Composition of every earlier head's output with every later head's input, `[L, N, L, N]`.

    scores[l1, h1, l2, h2] = ||W_OV^1 M^2||_F / (||W_OV^1||_F ||M^2||_F), where
    W_OV^1 is head (l1, h1)'s and M^2 of head (l2, h2) is W_QK^2 for mode "Q"
    (its queries read head 1's output), W_QK^2^T for "K" (its keys do) and
    W_OV^2 for "V" (its values do); zero unless l1 < l2 (Elhage et al. 2021;
    TransformerLens's `all_composition_scores`). LayerNorms are not included.
    Computed from the factors: with W_V^1 = Q_1 R_1 and B_2^T = Q_2 R_2 for
    M^2 = A_2 B_2, ||W_V^1 W_O^1 A_2 B_2|| = ||R_1 (W_O^1 A_2) R_2^T||.
    """
    if mode == "Q":
        right_a, right_b = weights.W_Q, jnp.swapaxes(weights.W_K, -1, -2)  # (L, N, D, H), (L, N, H, D)
    elif mode == "K":
        right_a, right_b = weights.W_K, jnp.swapaxes(weights.W_Q, -1, -2)
    elif mode == "V":
        right_a, right_b = weights.W_V, weights.W_O  # (L, N, D, Hv), (L, N, Hv, D)
    else:
        raise ValueError(f"composition_scores: mode must be 'Q', 'K' or 'V', got {mode!r}")
    left_r = _triangle(weights.W_V)  # (L, N, Hv, Hv)
    right_r = _triangle(jnp.swapaxes(right_b, -1, -2))  # (L, N, m, m)
    left = jnp.einsum("lnav,lnvd->lnad", left_r, weights.W_O, precision=HIGHEST)  # (L, N, Hv, D)
    right = jnp.einsum("kmdb,kmcb->kmdc", right_a, right_r, precision=HIGHEST)  # (L, N, D, m)
    product = jnp.einsum("lnad,kmdc->lnkmac", left, right, precision=HIGHEST)  # (L, N, L, N, Hv, m)
    norm_product = jnp.sqrt(jnp.sum(jnp.square(product), axis=(-2, -1)))  # (L, N, L, N)
    norm_left = jnp.sqrt(jnp.sum(jnp.square(left), axis=(-2, -1)))  # (L, N)
    norm_right = jnp.sqrt(jnp.sum(jnp.square(right), axis=(-2, -1)))  # (L, N)
    scores = norm_product / (norm_left[:, :, None, None] * norm_right[None, None, :, :])  # (L, N, L, N)
    layers = jnp.arange(weights.W_Q.shape[0])  # (L,)
    earlier = layers[:, None, None, None] < layers[None, None, :, None]  # (L, 1, L, 1)
    return jnp.where(earlier, scores, 0.0)


def token_qk_circuit(
    weights: HeadWeights, layer: int | Array, head: int | Array, query_side: Array, key_side: Array
) -> Array:
    """Head (layer, head)'s QK circuit between residual directions: `[A, B]`.

    (query_side W_Q) (key_side W_K)^T for `query_side` `[A, D]` and `key_side`
    `[B, D]`, e.g. W_E for both (Elhage et al.'s full QK circuit W_E W_QK W_E^T,
    token to token) or W_pos for positional attention. Biases and the 1/sqrt(H)
    scale are left out. `layer` and `head` may be traced (vmap over them).
    """
    queries = jnp.matmul(query_side, weights.W_Q[layer, head], precision=HIGHEST)  # (A, H)
    keys = jnp.matmul(key_side, weights.W_K[layer, head], precision=HIGHEST)  # (B, H)
    return jnp.matmul(queries, keys.T, precision=HIGHEST)  # (A, B)


def token_ov_circuit(
    weights: HeadWeights, layer: int | Array, head: int | Array, source: Array, unembedding: Array
) -> Array:
    """Head (layer, head)'s OV circuit from residual directions to logits: `[A, V]`.

    source W_V W_O W_U for `source` `[A, D]` (e.g. W_E: Elhage et al.'s full OV
    circuit, attended token to output logit) and `unembedding` W_U `[D, V]`:
    the direct-path logits the head adds when it attends fully to each row.
    """
    values = jnp.matmul(source, weights.W_V[layer, head], precision=HIGHEST)  # (A, Hv)
    written = jnp.matmul(values, weights.W_O[layer, head], precision=HIGHEST)  # (A, D)
    return jnp.matmul(written, unembedding, precision=HIGHEST)  # (A, V)


def copying_scores(weights: HeadWeights, embedding: Array, unembedding: Array) -> Array:
    """Copying score of every head, `[L, N]`: sum(lambda) / sum(|lambda|) (Elhage et al. 2021).

    lambda are the eigenvalues of the head's full OV circuit W_E W_V W_O W_U
    (`embedding` W_E `[V, D]`, `unembedding` W_U `[D, V]`), which are those of
    the small `[Hv, Hv]` matrix W_O W_U W_E W_V plus zeros. The score is 1 when
    every eigenvalue is positive (the head raises the logits of the tokens it
    attends to), -1 when all are negative. `jnp.linalg.eigvals` computes them:
    CPU and GPU backends (on GPU through LAPACK on the host), not TPU.
    """
    read = jnp.einsum("vd,lndh->lnvh", embedding, weights.W_V, precision=HIGHEST)  # (L, N, V, Hv)
    written = jnp.einsum("lnhd,dv->lnhv", weights.W_O, unembedding, precision=HIGHEST)  # (L, N, Hv, V)
    small = jnp.einsum("lnhv,lnvg->lnhg", written, read, precision=HIGHEST)  # (L, N, Hv, Hv)
    eigenvalues = per_matrix(jnp.linalg.eigvals, small)  # (L, N, Hv), complex
    return jnp.sum(eigenvalues.real, axis=-1) / jnp.sum(jnp.abs(eigenvalues), axis=-1)
