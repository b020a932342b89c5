r"""The language model's attention variants, side by side: RoPE's cost, packed sequences' worth.

  python benchmarks/variants.py [--steps 10] [--rounds 7]

positions  The training step a library user writes (`TransformerLM` with 2 layers,
           d_model 128, 4 heads, T 128, batch 32, vocabulary 256, AdamW, one
           `jax.jit` step with its state donated) with `positions` "learned"
           (the table), "rope" (rotary embeddings of every head's queries and
           keys) and "none": interleaved rounds of --steps steps per timed
           region, medians. RoPE's cost is its step time over the learned
           step's, minus 1 (the target is at most 5%).
packing    Training throughput in tokens of real text per second on a corpus of
           varied-length documents: 1000 of the standard library's functions,
           methods and classes (a seeded draw, from tens of characters to
           thousands; those longer than T + 1 split in pieces of T + 1), with
           the same model at T = 512, batch 8 (the same 4096 targets per
           batch), as rows of T + 1 characters either one document per row
           padded with zeros (the
           padding's targets weigh 0), or packed back to back with
           `segment_ids` (attention stays inside a document, positions restart;
           the last target of each document, which would predict the next one,
           weighs 0; pieces go first-fit into the rows). The same step, the
           same shapes: the difference is how much of each batch is text.
Writes benchmarks/results/lm_variants.json.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import random
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, median, write_results  # noqa: E402

SHAPE = {"vocab_size": 256, "num_layers": 2, "d_model": 128, "num_heads": 4, "max_len": 128}
BATCH = 32
POSITIONS = ("learned", "rope", "none")
# Packing: the same 4096 targets per batch in rows of 512, a context longer than most documents.
PACKED_LENGTH, PACKED_BATCH = 512, 8
# A new document starts at every `def` or `class`, nested ones included (and at the top of a file).
DOCUMENT_START = re.compile(r"\n(?=[ \t]*(?:def|class|async def) )")


def training_step(config, weighted: bool):
    """(run(n, batch): n donated AdamW steps on one batch then a sync, the step): a user's step.
    A batch is `{"tokens": [B, T + 1]}`, plus with `weighted` the targets' `weights` `[B, T]`
    and `segment_ids` `[B, T]` (None in the dict: one sequence per row)."""
    import jax
    import jax.numpy as jnp
    import optax

    from qkv_jax.lm import TransformerLM
    from qkv_jax.tasks.transformer import token_cross_entropy

    model = TransformerLM(config)
    dummy = jnp.zeros((1, config.max_len), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(1), dummy)["params"]
    tx = optax.adamw(3e-4, weight_decay=0.01)

    def loss_fn(params, batch):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1], segment_ids=batch.get("segment_ids"))
        losses = token_cross_entropy(logits, tokens[:, 1:])  # (B, T)
        if not weighted:
            return losses.mean()
        return jnp.sum(losses * batch["weights"]) / jnp.maximum(jnp.sum(batch["weights"]), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = [params, tx.init(params)]

    def run(n: int, batch) -> None:
        for _ in range(n):
            state[0], state[1], loss = step(state[0], state[1], batch)
        loss.block_until_ready()

    return run


def interleaved(runs: dict, steps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each `run()` (n steps), rounds in a shuffled order, after a warm-up."""
    for run in runs.values():
        run(2)  # compiles, warms up
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = random.Random(0)
    for _ in range(rounds):
        for name in order.sample(list(runs), len(runs)):
            started = time.perf_counter()
            runs[name](steps)
            times[name].append((time.perf_counter() - started) / steps)
    return times


def positions_run(steps: int, rounds: int) -> tuple[list[str], dict, dict]:
    import jax

    from qkv_jax.lm import TransformerConfig

    tokens = jax.random.randint(jax.random.PRNGKey(0), (BATCH, SHAPE["max_len"] + 1), 0, SHAPE["vocab_size"])
    runs = {
        positions: functools.partial(
            training_step(TransformerConfig(**SHAPE, positions=positions), weighted=False),
            batch={"tokens": tokens},
        )
        for positions in POSITIONS
    }
    times = interleaved(runs, steps, rounds)
    step_s = {name: median(t) for name, t in times.items()}
    cost = step_s["rope"] / step_s["learned"] - 1
    lines = [
        f"TransformerLM {SHAPE}, batch {BATCH}, AdamW, float32, one `jax.jit` step; median of {rounds} "
        f"interleaved rounds of {steps} steps per timed region.",
        "",
        "| positions | ms / step | step / learned step |",
        "|---|---|---|",
        *(f"| {name} | {1e3 * s:.1f} | {s / step_s['learned']:.3f} |" for name, s in step_s.items()),
        "",
        f"RoPE's cost: {cost:+.1%} of the learned-positions step (target: at most +5%).",
    ]
    ratios = {
        "rope step / learned step": step_s["rope"] / step_s["learned"],
        "none step / learned step": step_s["none"] / step_s["learned"],
        "RoPE's cost, share of the learned step": cost,
    }
    return lines, ratios, times


def documents(length: int, count: int = 1000) -> list[list[int]]:
    """`count` of the standard library's functions, methods and classes (a seeded draw) as
    character ids (of their 255 most frequent characters), in pieces of at most `length`."""
    from qkv_jax.text import CharTokenizer, stdlib_documents

    texts = [piece for _, text in stdlib_documents() for piece in DOCUMENT_START.split(text) if piece.strip()]
    texts = random.Random(0).sample(texts, count)
    tokenizer = CharTokenizer.from_text("".join(texts), SHAPE["vocab_size"])
    pieces = []
    for text in texts:
        ids = [int(i) for i in tokenizer.encode(text)]
        pieces += [ids[start : start + length] for start in range(0, len(ids), length)]
    return pieces


def padded_batches(pieces: list[list[int]], length: int, batch: int):
    """Rows of `length` ids, one piece each, zero-padded; the weights of real targets are 1."""
    import numpy as np

    for start in range(0, len(pieces) - batch + 1, batch):
        tokens = np.zeros((batch, length), np.int32)
        weights = np.zeros((batch, length - 1), np.float32)
        for row, piece in enumerate(pieces[start : start + batch]):
            tokens[row, : len(piece)] = piece
            weights[row, : len(piece) - 1] = 1.0
        yield {"tokens": tokens, "weights": weights}


def packed_batches(pieces: list[list[int]], length: int, batch: int):
    """Rows of `length` ids filled with pieces back to back (each in the first row with room for
    it, a new row when none has), `segment_ids` numbering them; a target in another piece than
    its input weighs 0, and so does the zero padding at a row's end."""
    import numpy as np

    rows: list[list[tuple[int, int]]] = []  # (id, piece number) per position
    for number, piece in enumerate(pieces):  # first fit: the first row with room for the piece
        row = next((row for row in rows if len(row) + len(piece) <= length), None)
        if row is None:
            rows.append(row := [])
        row += [(token, number) for token in piece]
    for start in range(0, len(rows) - batch + 1, batch):
        tokens = np.zeros((batch, length), np.int32)
        segments = np.full((batch, length), -1, np.int32)  # padding: a segment of its own
        for row, filled in enumerate(rows[start : start + batch]):
            tokens[row, : len(filled)] = [token for token, _ in filled]
            segments[row, : len(filled)] = [number for _, number in filled]
        same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] >= 0)  # (B, T)
        yield {
            "tokens": tokens,
            "weights": same.astype(np.float32),
            "segment_ids": segments[:, :-1],
        }


def packing_run(steps: int, rounds: int) -> tuple[list[str], dict, dict]:
    import numpy as np

    from qkv_jax.lm import TransformerConfig

    length = PACKED_LENGTH + 1
    pieces = documents(length)
    sizes = np.array([len(p) for p in pieces])
    every = {
        "padded": list(padded_batches(pieces, length, PACKED_BATCH)),
        "packed": list(packed_batches(pieces, length, PACKED_BATCH)),
    }
    # Real-text targets per step over the whole corpus's batches; the step is timed on the first.
    text = {name: float(np.mean([b["weights"].sum() for b in batches])) for name, batches in every.items()}
    batches = {name: batches[0] for name, batches in every.items()}
    config = TransformerConfig(**{**SHAPE, "max_len": PACKED_LENGTH}, positions="rope")
    runs = {
        name: functools.partial(training_step(config, weighted=True), batch=batch)
        for name, batch in batches.items()
    }
    times = interleaved(runs, steps, rounds)
    step_s = {name: median(t) for name, t in times.items()}
    rate = {name: text[name] / step_s[name] for name in runs}
    lines = [
        f"The same model with positions='rope' and max_len {PACKED_LENGTH}, batch {PACKED_BATCH} x "
        f"{PACKED_LENGTH} targets, on 1000 of the standard library's functions, methods and classes "
        f"(a seeded draw; {len(sizes)} pieces of at most {length} characters, median "
        f"{np.median(sizes):.0f}, mean {sizes.mean():.0f}) in {len(every['padded'])} padded or "
        f"{len(every['packed'])} packed batches: real-text targets per step are their mean; the step "
        f"is timed on the first batch of each kind, median of {rounds} interleaved rounds of {steps} steps.",
        "",
        "| batches | ms / step | real-text targets / step | real-text tokens/s |",
        "|---|---|---|---|",
        *(f"| {name} | {1e3 * step_s[name]:.1f} | {text[name]:.0f} | {rate[name]:.0f} |" for name in runs),
    ]
    ratios = {
        "packed real-text tokens/s / padded": rate["packed"] / rate["padded"],
        "packed step / padded step": step_s["packed"] / step_s["padded"],
    }
    return lines, ratios, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed region")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (medians over them)")
    args = parser.parse_args()
    position_lines, position_ratios, position_times = positions_run(args.steps, args.rounds)
    packing_lines, packing_ratios, packing_times = packing_run(args.steps, args.rounds)
    lines = ["### Positions: learned, RoPE, none", "", *position_lines, "", "### Packed against padded"]
    lines += ["", *packing_lines]
    ratios = {**position_ratios, **packing_ratios}
    print("\n".join(lines))
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    path = write_results(
        "lm_variants",
        "python benchmarks/variants.py " + " ".join(sys.argv[1:]),
        {
            "title": "LM attention variants: RoPE's cost, packed sequences (CPU)",
            "table": lines,
            "ratios": ratios,
            "times_s": {"positions": position_times, "packing": packing_times},
        },
    )
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
