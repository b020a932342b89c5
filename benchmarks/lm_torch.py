"""The char LM's architecture in eager PyTorch, the peer of benchmarks/lm.py's training speed.

Same shapes as qkv_jax.lm.TransformerLM (num_kv_heads = num_heads, no dropout):
token and position embeddings, pre-LayerNorm blocks (causal multi-head
attention with biased Q/K/V/O projections, a tanh-GELU MLP of width 4 d_model),
a final LayerNorm and a bias-free head. Same parameter count.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x):
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x))  # (B, T, 3D)
        qkv = qkv.view(batch, length, 3, self.num_heads, width // self.num_heads)  # (B, T, 3, N, H)
        query, key, value = qkv.permute(2, 0, 3, 1, 4)  # each (B, N, T, H)
        heads = F.scaled_dot_product_attention(query, key, value, is_causal=True)  # (B, N, T, H)
        x = x + self.out(heads.transpose(1, 2).reshape(batch, length, width))  # (B, T, D)
        return x + self.mlp(self.mlp_norm(x))


class TorchLM(nn.Module):
    def __init__(self, vocab_size: int, num_layers: int, d_model: int, num_heads: int, max_len: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))  # (B, T, V)


def train_step(model, optimizer, corpus, batch_size, seq_len, clip_norm, generator):
    """One AdamW step on random windows of `corpus` (int64 [N]); returns the loss."""
    starts = torch.randint(0, len(corpus) - seq_len, (batch_size,), generator=generator)
    windows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()])  # (B, T + 1)
    logits = model(windows[:, :-1])  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    return loss.item()
