r"""Sample text from the newest checkpoint of a run, or from a Hugging Face checkpoint.

  python -m experiments.generate --workdir runs/char_lm --prompt "def " --max_new_tokens 200 \
    [--temperature 0.8] [--top_k 20] [--num_samples 1] [--seed 0]
  python -m experiments.generate --pretrained path/to/hf_model --prompt "The keys and" \
    --max_new_tokens 20 --temperature 0 [--print_token_ids]

Give one of --workdir and --pretrained. A Hugging Face directory holds config.json,
model.safetensors (or shards) and the tokenizer.json the prompt is encoded with (special
tokens as the tokenizer adds them, e.g. a Llama's "<s>"); each sample prints as the decoded
prompt and new tokens (special tokens dropped). Decoding does not stop at an end-of-text
token: it always adds --max_new_tokens. --temperature 0 is greedy, the tokens transformers'
`generate(do_sample=False)` picks. --print_token_ids adds a line of the new tokens' ids.

Decodes with the KV cache; the prompt and the new tokens must fit in the model's max_len
positions.

A fine-tuning run's workdir (configs/pretrained_text.py: LoRA or full, GQA-converted too)
reads as the directory `experiments.export` would write from it: the run's tokenizer.json and
its newest checkpoint with the adapters merged, no export needed:

  python -m experiments.generate --workdir runs/ft_lora --prompt "The keys and" --temperature 0

Left out, --max_new_tokens is 200 or the positions the model has left after the prompt,
whichever is fewer (a one-line notice on stderr when fewer).
"""

import sys

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
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
flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seeds the sampling.", lower_bound=0)
flags.DEFINE_bool("print_token_ids", False, "Print each sample's new token ids on a line of their own.")
common.define_common_flags()


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
    from qkv_jax.lm import check_generate_args

    try:
        check_generate_args(model, prompt.shape, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k)
    except ValueError as error:
        common.fail(str(error), code=2)


def sample(model, params, prompt):
    """`[num_samples, max_new_tokens]` tokens after `prompt` `[num_samples, P]`, as NumPy."""
    import jax
    import numpy as np

    from qkv_jax.lm import generate

    tokens = generate(
        model,
        params,
        prompt,
        FLAGS.max_new_tokens,
        rng=jax.random.PRNGKey(FLAGS.seed),
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
    )
    return np.asarray(tokens)


def show(tokens, source: str, text_of) -> None:
    """Each sample's heading, its text (`text_of(row)`) and, with --print_token_ids, its new ids."""
    for i, row in enumerate(tokens):
        print(f"--- sample {i} ({source}, temperature {FLAGS.temperature})")
        print(text_of(row))
        if FLAGS.print_token_ids:
            print("token ids: " + " ".join(str(int(t)) for t in row))


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
    tokens = sample(model, saved.tree, prompt)
    show(tokens, f"checkpoint step {saved.step}", lambda row: FLAGS.prompt + tokenizer.decode(row))


def from_pretrained() -> None:
    import numpy as np

    from qkv_jax.report.pretrained import load_params, open_pretrained, read_text

    try:  # config.json, tokenizer.json and the prompt before any tensor is read
        shape, tokenizer = open_pretrained(FLAGS.pretrained)
        ids, _ = read_text(tokenizer, shape, FLAGS.prompt, "--prompt")
    except ValueError as error:
        common.fail(str(error), code=2)
    prompt = np.tile(ids, (FLAGS.num_samples, 1))
    fit_max_new_tokens(shape, prompt.shape[1])
    check(shape, prompt)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    try:
        model, params = load_params(FLAGS.pretrained)
    except ValueError as error:
        common.fail(str(error), code=2)
    tokens = sample(model, params, prompt)
    show(tokens, FLAGS.pretrained, lambda row: tokenizer.decode(np.concatenate([ids, row])))


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
        from_run()
    else:
        from_pretrained()


if __name__ == "__main__":
    common.run_main(main)
