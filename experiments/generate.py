r"""Sample text from the newest checkpoint of a run, or from a Hugging Face checkpoint.

  python -m experiments.generate --workdir runs/char_lm --prompt "def " --max_new_tokens 200 \
    [--temperature 0.8] [--top_k 20] [--top_p 0.9] [--num_samples 1] [--seed 0]
  python -m experiments.generate --pretrained path/to/hf_model --prompt "The keys and" \
    --max_new_tokens 20 --temperature 0 [--print_token_ids]

Give one of --workdir and --pretrained. A Hugging Face directory holds config.json,
model.safetensors (or shards) and the tokenizer.json the prompt is encoded with (special
tokens as the tokenizer adds them, e.g. a Llama's "<s>"); each sample prints as the decoded
prompt and new tokens (special tokens dropped). A sample ends at the checkpoint's end-of-text
token (`eos_token_id` of its generation_config.json, else of its config.json), printed among
its token ids, or after --max_new_tokens. --temperature 0 is greedy, the tokens transformers'
`generate(do_sample=False)` picks; --top_k and --top_p (nucleus) filter as transformers does.

One sample streams: its text prints as it is decoded, a few tokens per compiled call, and
Ctrl-C ends the run keeping what was printed. Then a line on stderr gives the time to the
first new token (from the command's start: reading the weights and compiling included) and
the new tokens per second after it. JAX's persistent compilation cache
(`~/.cache/qkv_jax/jax_compilation_cache`; `--compilation_cache=` turns it off) lets the
second run of a command start without compiling. Prompts of lengths in one bucket
(`qkv_jax.generation`) share a compiled program.

Decodes with a KV cache sized to the request; the prompt and the new tokens must fit in the
model's max_len positions. --mesh DATA,MODEL loads a Hugging Face checkpoint split over a
(data, model) mesh of that many devices, the cache split as its K/V weights are
(docs/scaling.md; --num_cpu_devices simulates devices on a CPU); greedy tokens are one
device's. A mesh the model cannot be split over (a model axis that does not divide its heads,
say) is one line (exit 2), before any weight is read.

A fine-tuning run's workdir (configs/pretrained_text.py: LoRA or full, GQA-converted too)
reads as the directory `experiments.export` would write from it: the run's tokenizer.json,
end-of-text ids and its newest checkpoint with the adapters merged, no export needed; with
--mesh, split as the export would be (each process holds the whole merged model on its host
while placing it):

  python -m experiments.generate --workdir runs/ft_lora --prompt "The keys and" --temperature 0
  python -m experiments.generate --workdir runs/ft_lora --prompt "The keys and" --temperature 0 \
    --mesh 2,2 [--num_cpu_devices 4]

A char_lm run's workdir decodes on one device (--mesh is refused with it).

Left out, --max_new_tokens is 200 or the positions the model has left after the prompt,
whichever is fewer (a one-line notice on stderr when fewer).
"""

import sys
import time

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
STARTED = time.perf_counter()  # the command's start, for the time to the first token
flags.DEFINE_string("workdir", None, "Workdir of a char_lm run or of a fine-tuning (pretrained_text) run.")
flags.DEFINE_string(
    "pretrained",
    None,
    "A Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json).",
)
flags.DEFINE_string("prompt", "def ", "Text the samples continue.")
flags.DEFINE_integer(
    "max_new_tokens",
    200,
    "Tokens to generate per sample; left out, 200 or the positions the model has left after the "
    "prompt, whichever is fewer.",
    lower_bound=1,
)
flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", None, "Sample among the k most likely tokens only.", lower_bound=1)
flags.DEFINE_float(
    "top_p",
    None,
    "Nucleus sampling: the most likely tokens whose mass before them is below p.",
    lower_bound=0.0,
)
flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seeds the sampling.", lower_bound=0)
flags.DEFINE_bool("print_token_ids", False, "Print each sample's new token ids on a line of their own.")
common.define_common_flags()
common.define_mesh_flag()


def fit_max_new_tokens(model, prompt_length: int) -> None:
    """Without --max_new_tokens on the command line, its default clipped to the positions `model`
    has left after a prompt of `prompt_length` tokens, with a one-line notice when clipped."""
    from qkv_jax.lm import decode_capacity

    capacity = decode_capacity(model.config)
    if FLAGS["max_new_tokens"].present or capacity is None:
        return
    left = capacity - prompt_length + 1  # the last new token needs no position of its own
    if left < FLAGS.max_new_tokens:
        FLAGS.max_new_tokens = max(left, 1)  # none left: `check` says the prompt is too long
        if left >= 1:
            print(
                f"warning: --max_new_tokens={left}, not {FLAGS['max_new_tokens'].default}: the positions the "
                f"model's max_len={model.config.max_len} leaves after the prompt's {prompt_length} tokens",
                file=sys.stderr,
            )


def check(model, prompt) -> None:
    """`generate`'s checks of the flags (one line, exit 2), before anything is computed."""
    from qkv_jax.generation import check_request

    settings = dict(temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p)
    try:
        check_request(model.config, prompt, FLAGS.max_new_tokens, settings)
    except ValueError as error:
        common.fail(str(error), code=2)


def sample(model, params, prompt, eos_token_id, text_of):
    """Each row's new tokens after `prompt` `[num_samples, P]` (ending at an end-of-text), as NumPy;
    one sample streams its text (`text_of(new tokens)`) as it is decoded. Ctrl-C ends the run,
    keeping what was printed."""
    import jax

    from qkv_jax.generation import stream

    settings = dict(
        temperature=FLAGS.temperature, top_k=FLAGS.top_k, top_p=FLAGS.top_p, eos_token_id=eos_token_id
    )
    chunks = stream(
        model, params, list(prompt), FLAGS.max_new_tokens, rng=jax.random.PRNGKey(FLAGS.seed), **settings
    )
    printer = StreamPrinter(text_of) if len(prompt) == 1 else None
    rows, first = [], None
    try:
        for rows in chunks:
            if first is None and len(rows[0]):
                first = time.perf_counter()
            if printer is not None:
                printer.show(rows[0])
    except KeyboardInterrupt:
        print(flush=True)
        common.fail(f"stopped by Ctrl-C after {len(rows[0]) if rows else 0} new token(s)", code=130)
    if printer is not None:
        printer.show(rows[0], last=True)
    report_speed(first, max(len(row) for row in rows))
    return rows


def report_speed(first: float | None, new_tokens: int) -> None:
    """One line on stderr: the time to the first new token and the new tokens per second after it."""
    if first is None:
        return
    rate = (new_tokens - 1) / max(time.perf_counter() - first, 1e-9)
    print(
        f"speed: first new token {first - STARTED:.2f} s after the start; {new_tokens} new tokens, "
        f"{rate:.1f} tokens/s after the first",
        file=sys.stderr,
    )


class StreamPrinter:
    """Prints a sample's text as it grows: each call writes what `text_of(tokens)` adds to what was
    printed, holding back a trailing U+FFFD (a character whose bytes are still arriving)."""

    def __init__(self, text_of):
        self.text_of, self.printed = text_of, ""

    def show(self, tokens, last: bool = False) -> None:
        text = self.text_of(tokens)
        text = text if last else text.rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text
        if last:
            sys.stdout.write("\n")


def heading(i: int, source: str) -> str:
    return f"--- sample {i} ({source}, temperature {FLAGS.temperature})"


def show(tokens, source: str, text_of) -> None:
    """Each sample's heading, its text (`text_of(row)`) and, with --print_token_ids, its new ids (one
    sample's heading and text were streamed)."""
    for i, row in enumerate(tokens):
        if len(tokens) > 1:
            print(heading(i, source))
            print(text_of(row))
        if FLAGS.print_token_ids:
            print("token ids: " + " ".join(str(int(t)) for t in row))


def decode_and_show(model, params, prompt, source: str, text_of, eos_token_id=None) -> None:
    """Samples after `prompt` and prints them (`sample`, `show`)."""
    if len(prompt) == 1:
        print(heading(0, source), flush=True)
    try:
        tokens = sample(model, params, prompt, eos_token_id, text_of)
    except ValueError as error:
        common.fail(str(error), code=2)
    show(tokens, source, text_of)


def from_run() -> None:
    import numpy as np

    from qkv_jax.tasks.char_lm import read_run

    try:  # every check that needs no computation comes first
        config, tokenizer, model = read_run(FLAGS.workdir)
        prompt = np.tile(tokenizer.encode(FLAGS.prompt), (FLAGS.num_samples, 1))
    except ValueError as error:
        common.fail(str(error), code=2)
    fit_max_new_tokens(model, prompt.shape[1])
    check(model, prompt)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    import jax

    from qkv_jax.tasks.transformer import init_params
    from qkv_jax.training import read_params

    seq_len = config["task"]["seq_len"]
    like = jax.eval_shape(lambda key: init_params(model, seq_len, key), jax.random.PRNGKey(0))
    try:
        saved = read_params(FLAGS.workdir, like=like)
    except ValueError as error:
        common.fail(str(error), code=2)
    text_of = lambda row: FLAGS.prompt + tokenizer.decode(row)  # noqa: E731
    decode_and_show(model, saved.tree, prompt, f"checkpoint step {saved.step}", text_of)


def from_pretrained() -> None:
    import numpy as np

    from qkv_jax.generation import end_of_text_of
    from qkv_jax.report.pretrained import checkpoint_files, load_params, open_pretrained, read_text

    try:  # config.json, tokenizer.json and the prompt before any tensor is read
        shape, tokenizer = open_pretrained(FLAGS.pretrained)
        ids, _ = read_text(tokenizer, shape, FLAGS.prompt, "--prompt")
        eos_token_id = end_of_text_of(checkpoint_files(FLAGS.pretrained))
    except ValueError as error:
        common.fail(str(error), code=2)
    prompt = np.tile(ids, (FLAGS.num_samples, 1))
    fit_max_new_tokens(shape, prompt.shape[1])
    check(shape, prompt)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    common.initialize_devices()
    mesh = common.mesh_from_flag()
    try:
        model, params = load_params(FLAGS.pretrained, mesh=mesh)
    except ValueError as error:
        common.fail(str(error), code=2)
    text_of = lambda row: tokenizer.decode(np.concatenate([ids, row]))  # noqa: E731
    decode_and_show(model, params, prompt, FLAGS.pretrained, text_of, eos_token_id)


def is_finetuning_run() -> bool:
    """Whether --workdir is a fine-tuning run (configs/pretrained_text.py): it reads as the
    directory its export would write (the run's tokenizer, its newest checkpoint merged)."""
    from qkv_jax.tasks.pretrained_text import is_run

    return is_run(FLAGS.workdir)


def main(argv):
    del argv  # run_main refuses positional arguments
    source = common.one_source()
    if source == "workdir" and is_finetuning_run():
        FLAGS.pretrained, source = FLAGS.workdir, "pretrained"
    if not FLAGS.prompt:
        common.fail("--prompt: must not be empty", code=2)
    if source == "workdir":
        if FLAGS.mesh is not None:
            common.fail(
                "--mesh: only with --pretrained or a fine-tuning run's --workdir (a char_lm run "
                "decodes on one device)",
                code=2,
            )
        from_run()
    else:
        from_pretrained()


if __name__ == "__main__":
    common.run_main(main)
