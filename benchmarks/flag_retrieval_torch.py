"""The flag-retrieval training loop in plain PyTorch (the reference), with timers.

Run by benchmarks/flag_retrieval.py as the peer; prints one JSON line.
  python benchmarks/flag_retrieval_torch.py [--threads N]
"""

import json
import sys
import time

started = time.perf_counter()
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

imported = time.perf_counter()
if "--threads" in sys.argv:
    torch.set_num_threads(int(sys.argv[sys.argv.index("--threads") + 1]))

d_model, d_k, seq_len = 8, 8, 5


def make_batch(batch_size):
    content = torch.randn(batch_size, seq_len, d_model - 1)
    flag_pos = torch.randint(0, seq_len, (batch_size,))
    flags = torch.zeros(batch_size, seq_len, 1)
    for b in range(batch_size):
        flags[b, flag_pos[b], 0] = 1.0
    X = torch.cat([content, flags], dim=-1)
    targets = content[torch.arange(batch_size), flag_pos]
    return X, targets, flag_pos


class LearnedAttention(nn.Module):
    def __init__(self, d_model, d_k):
        super().__init__()
        self.Wq = nn.Linear(d_model, d_k, bias=False)
        self.Wk = nn.Linear(d_model, d_k, bias=False)
        self.Wv = nn.Linear(d_model, d_model - 1, bias=False)
        self.query_vec = nn.Parameter(torch.randn(1, d_model))

    def forward(self, X):
        batch = X.shape[0]
        Q = self.Wq(self.query_vec).expand(batch, -1)
        K = self.Wk(X)
        V = self.Wv(X)
        scores = torch.einsum("bd,bsd->bs", Q, K) / (d_k**0.5)
        weights = F.softmax(scores, dim=-1)
        output = torch.einsum("bs,bsd->bd", weights, V)
        return output, weights


model = LearnedAttention(d_model, d_k)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
loop_started = time.perf_counter()
for _ in range(2000):
    X, targets, flag_pos = make_batch(32)
    output, weights = model(X)
    loss = F.mse_loss(output, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
loop_s = time.perf_counter() - loop_started

X, targets, flag_pos = make_batch(10000)
with torch.no_grad():
    _, weights = model(X)
accuracy = (weights.argmax(-1) == flag_pos).float().mean().item()
print(
    json.dumps(
        {
            "import_s": imported - started,
            "loop_s": loop_s,
            "script_s": time.perf_counter() - started,
            "final_loss": loss.item(),
            "accuracy": accuracy,
            "threads": torch.get_num_threads(),
        }
    )
)
