# Copyright 2019 The JAX Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""jax.nn.dot_product_attention's own tests, run against qkv_jax.dot_product_attention.

Ported from jax-ml/jax, tests/nn_test.py at commit 990e6a0b84138346e6a38785412f36356e0e5dc3
(the jax-v0.10.2 tag, the installed jax): every dot_product_attention test of
NNFunctionsTest, with only the call sites changed (`nn.dot_product_attention` and
`jax.nn.dot_product_attention` -> `qkv_jax.dot_product_attention`, the `sdpa` helpers
included); assertions, tolerances, skips and jax's test harness (`jax._src.test_util`:
rank promotion "raise", `jax_enable_checks`) are jax's. The code keeps jax's formatting so
that it diffs line by line against the source, hence no ruff here.

On CPU jax's own tests skip the 'cudnn' cases ("Needs compute capability 8.0 or higher.").
Two things are added for this suite. A fixture: its persistent compilation cache
(tests/conftest.py) appears with the first compilation, and jax's harness fails a test during
which the cache object changes, so the fixture compiles once before the tests run. And the
`slow` mark: at jax's sizes each test compiles several forward and backward programs (5-13 s
each on 2 CPU cores, about 3 minutes in all), too long for the fast tier; run them with
`python -m pytest tests/peers`.
"""
# ruff: noqa
# fmt: off

from functools import partial
import unittest

from absl.testing import absltest
from absl.testing import parameterized

from jax._src import config
from jax._src import test_util as jtu
from jax import random
import jax
import jax.numpy as jnp

import pytest

import qkv_jax

config.parse_flags_with_absl()


pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def compilation_cache_in_place(compilation_cache):
  jax.jit(lambda x: x + 1)(jnp.zeros(()))

def _check_cudnn_backend(fn, *args, **kwargs):
  lowered = jax.jit(fn).lower(*args, **kwargs)
  hlo = lowered.as_text('stablehlo', debug_info=True)
  return '__cudnn$fmha' in hlo

_cudnn_dbias_error = 'cuDNN only supports bias gradient'


@jtu.with_config(jax_legacy_prng_key="allow",
                 jax_numpy_dtype_promotion="standard")
class NNFunctionsTest(jtu.JaxTestCase):
  @parameterized.product(
      dtype=[jnp.bfloat16, jnp.float16],
      group_num=[1, 2, 4],
      use_vmap=[False, True],
      impl=['cudnn', 'xla'],
  )
  def testDotProductAttention(self, dtype, group_num, use_vmap, impl):
    if impl == 'cudnn' and jtu.is_device_rocm():
      raise unittest.SkipTest("cuDNN not available on ROCm.")
    if impl == 'cudnn' and not jtu.is_cuda_compute_capability_at_least("8.0"):
      raise unittest.SkipTest("Needs compute capability 8.0 or higher.")
    if impl == 'cudnn' and dtype == jnp.float32:
      raise unittest.SkipTest("cuDNN only supports fp16 or bf16.")
    if impl == 'cudnn' and jtu.is_cuda_version_at_least(13, 0):
      raise unittest.SkipTest("cuDNN creates no execution plans on CUDA 13.0.")

    B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
    keys = random.split(random.PRNGKey(0), 5)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N // G, H), dtype)
    V = random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    lse_grad = random.normal(keys[4], (B, T, N), dtype)
    bias, mask = None, None

    sdpa = qkv_jax.dot_product_attention
    sdpa_ref = partial(sdpa, implementation=None)
    sdpa_ans = partial(sdpa, implementation=impl)
    sdpa_ref_lse = partial(sdpa, implementation=None, return_residual=True)
    sdpa_ans_lse = partial(sdpa, implementation=impl, return_residual=True)
    if use_vmap:
      sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)

    # For testing purposes, we call the non-GQA version without vmap in the
    # reference code
    K_ref = jnp.repeat(K, G, axis=2)
    V_ref = jnp.repeat(V, G, axis=2)
    out_ref, sdpa_vjp_ref = jax.vjp(sdpa_ref, Q, K_ref, V_ref, bias, mask)
    out_ans, sdpa_vjp_ans = jax.vjp(sdpa_ans, Q, K, V, bias, mask)

    out_ref_lse, sdpa_vjp_ref_lse = jax.vjp(sdpa_ref_lse, Q, K_ref, V_ref, bias, mask)
    out_ans_lse, sdpa_vjp_ans_lse = jax.vjp(sdpa_ans_lse, Q, K, V, bias, mask)

    dQ_ref, dK_ref, dV_ref = sdpa_vjp_ref(grad)[:3]
    dQ_ans, dK_ans, dV_ans = sdpa_vjp_ans(grad)[:3]
    dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)

    dQ_ref_lse, dK_ref_lse, dV_ref_lse = sdpa_vjp_ref_lse((grad, lse_grad))[:3]
    dQ_ans_lse, dK_ans_lse, dV_ans_lse = sdpa_vjp_ans_lse((grad, lse_grad))[:3]
    dK_ref_lse = dK_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref_lse = dV_ref_lse.reshape(B, S, N // G, G, H).sum(axis=3)

    if impl == 'cudnn':
      self.assertTrue(_check_cudnn_backend(sdpa_ans, Q, K, V, bias, mask))
      self.assertTrue(_check_cudnn_backend(sdpa_vjp_ans, grad))
      self.assertTrue(_check_cudnn_backend(sdpa_ans_lse, Q, K, V, bias, mask))
      self.assertTrue(_check_cudnn_backend(sdpa_vjp_ans_lse, (grad, lse_grad)))

    self.assertAllClose(out_ref, out_ans, atol=.01, rtol=.01)
    self.assertAllClose(dQ_ref, dQ_ans, rtol=.01, atol=.01)
    self.assertAllClose(dK_ref, dK_ans, rtol=.01, atol=.01)
    self.assertAllClose(dV_ref, dV_ans, rtol=.01, atol=.01)

    self.assertAllClose(out_ref_lse[0], out_ans_lse[0], atol=.01, rtol=.01)
    self.assertAllClose(out_ref_lse[1], out_ans_lse[1], atol=.01, rtol=.01)
    self.assertAllClose(dQ_ref_lse, dQ_ans_lse, rtol=.01, atol=.01)
    self.assertAllClose(dK_ref_lse, dK_ans_lse, rtol=.01, atol=.01)
    self.assertAllClose(dV_ref_lse, dV_ans_lse, rtol=.01, atol=.01)

  @parameterized.product(
      mask_mode=['bias', 'causal', 'padding', 'custom', ('causal', 'padding'),
                 ('custom', 'padding'), ('bias', 'causal'),
                 ('causal', 'sliding_window')],
  )
  def testDotProductAttentionMask(self, mask_mode):
    if isinstance(mask_mode, str):
      mask_mode = (mask_mode,)
    # ROCm: use XLA implementation instead of cuDNN
    use_cudnn = jtu.is_device_cuda()
    if use_cudnn:
      if not jtu.is_cuda_compute_capability_at_least("8.0"):
        raise unittest.SkipTest("Requires compute capability 8.0 or higher.")
      if jtu.is_cuda_version_at_least(13, 0):
        raise unittest.SkipTest("cuDNN creates no execution plans on CUDA 13.0.")

    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 4)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)
    grad = random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask = None, None
    q_seqlen, kv_seqlen = None, None
    window_size = None

    is_causal = 'causal' in mask_mode
    if 'padding' in mask_mode:
      q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
      kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if 'custom' in mask_mode:
      # Use a generated causal mask as the custom mask.
      custom_mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))
      mask = custom_mask[None, None, :, :]
    if 'bias' in mask_mode:
      bias = random.normal(keys[4], (1, N, T, S), dtype)
    if 'sliding_window' in mask_mode:
      window_size = (3, 2) if is_causal else (3, 0)

    sdpa = qkv_jax.dot_product_attention
    impl = 'cudnn' if use_cudnn else 'xla'
    sdpa_ref = partial(sdpa, is_causal=is_causal, implementation=None)
    sdpa_ans = partial(sdpa, is_causal=is_causal, implementation=impl)

    args = (Q, K, V, bias, mask)
    kwargs = {'query_seq_lengths': q_seqlen, 'key_value_seq_lengths': kv_seqlen}

    # Convert the kargs to positional args for the jax.vjp.
    fn_ref = lambda q, k, v, b, m, qs, kvs: sdpa_ref(
        q, k, v, b, m, query_seq_lengths=qs, key_value_seq_lengths=kvs,
        local_window_size=window_size,
    )
    fn_ans = lambda q, k, v, b, m, qs, kvs: sdpa_ans(
        q, k, v, b, m, query_seq_lengths=qs, key_value_seq_lengths=kvs,
        local_window_size=window_size,
    )
    out_ref, sdpa_vjp_ref = jax.vjp(fn_ref, *args, q_seqlen, kv_seqlen)
    out_ans, sdpa_vjp_ans = jax.vjp(fn_ans, *args, q_seqlen, kv_seqlen)
    dQ_ref, dK_ref, dV_ref, dbias_ref = sdpa_vjp_ref(grad)[:4]
    dQ_ans, dK_ans, dV_ans, dbias_ans = sdpa_vjp_ans(grad)[:4]

    # Check if cudnn backend is called (only on CUDA).
    if use_cudnn:
      self.assertTrue(_check_cudnn_backend(sdpa_ans, *args, **kwargs))
      self.assertTrue(_check_cudnn_backend(sdpa_vjp_ans, grad))

    self.assertAllClose(out_ref, out_ans, atol=.01, rtol=.01)
    self.assertAllClose(dQ_ref, dQ_ans, rtol=.02, atol=.02)
    self.assertAllClose(dK_ref, dK_ans, rtol=.02, atol=.02)
    self.assertAllClose(dV_ref, dV_ans, rtol=.01, atol=.01)
    self.assertAllClose(dbias_ref, dbias_ans, rtol=.02, atol=.02)

  def testDotProductAttentionFloat64MaskDebugInfs(self):
    # Regression test for https://github.com/jax-ml/jax/issues/37422
    with jax.enable_x64():
      T, S, K, N, H = 5, 7, 3, 6, 11
      mask = jnp.arange(S) <= S // 2
      with self.assertNoWarnings():
        with jax.debug_infs(True):
          out = qkv_jax.dot_product_attention(
              jnp.zeros((T, N, H), dtype=jnp.float64),
              jnp.zeros((S, K, H), dtype=jnp.float64),
              jnp.zeros((S, K, H), dtype=jnp.float64),
              mask=mask,
          )
          out.block_until_ready()

  @parameterized.product(
      batch_size=[1, 16],
      use_vmap=[False, True],
  )
  def testDotProductAttentionBiasGradient(self, batch_size, use_vmap):
    # ROCm: use XLA implementation instead of cuDNN
    use_cudnn = jtu.is_device_cuda()
    if use_cudnn:
      if not jtu.is_cuda_compute_capability_at_least("8.0"):
        raise unittest.SkipTest("Requires compute capability 8.0 or higher.")
      if jtu.is_cuda_version_at_least(13, 0):
        raise unittest.SkipTest("cuDNN creates no execution plans on CUDA 13.0.")

    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 2)
    x = random.normal(keys[0], (B, S, N, H), dtype)
    bias = random.normal(keys[1], (B, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def attention(x, bias, mask, impl):
      return qkv_jax.dot_product_attention(
          query=x,
          key=x,
          value=x,
          bias=bias,
          mask=mask,
          is_causal=False,
          implementation=impl,
      )
    attn_ref = partial(attention, impl=None)
    attn_ans = partial(attention, impl='cudnn' if use_cudnn else 'xla')
    if use_vmap:
      attn_batched_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
      attn_batched_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
    else:
      attn_batched_ref = attn_ref
      attn_batched_ans = attn_ans

    fwd_ref = jax.jit(attn_batched_ref)
    fwd_ans = jax.jit(attn_batched_ans)
    y_ref = fwd_ref(x, bias, mask)
    y_ans = fwd_ans(x, bias, mask)
    self.assertAllClose(y_ref, y_ans)

    @jax.jit
    def bwd_ref(x, bias, mask):
      _, f_vjp = jax.vjp(attn_ref, x, bias, mask)
      return f_vjp(x)
    @jax.jit
    def bwd_ans(x, bias, mask):
      _, f_vjp = jax.vjp(attn_ans, x, bias, mask)
      return f_vjp(x)

    _, dbias_ref, _ = bwd_ref(x, bias, mask)
    _, dbias_ans, _ = bwd_ans(x, bias, mask)
    self.assertAllClose(dbias_ans, dbias_ref, rtol=0.1, atol=0.1)

  def testDotProductAttention_localWindowSizeWithoutMask(self):
    dtype = jnp.float32
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = random.split(random.PRNGKey(0), 3)
    Q = random.normal(keys[0], (B, T, N, H), dtype)
    K = random.normal(keys[1], (B, S, N, H), dtype)
    V = random.normal(keys[2], (B, S, N, H), dtype)

    output_large_window = qkv_jax.dot_product_attention(
        Q, K, V, mask=None, local_window_size=(32, 32)
    )

    output_small_window = qkv_jax.dot_product_attention(
        Q, K, V, mask=None, local_window_size=(1, 1)
    )

    self.assertFalse(
        jnp.allclose(output_large_window, output_small_window),
        "Attention output should differ with different local_window_size, even without a mask.",
    )


if __name__ == "__main__":
  absltest.main(testLoader=jtu.JaxTestLoader())
