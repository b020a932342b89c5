r"""Sample text from the newest checkpoint of a char_lm run.

  python -m experiments.generate --workdir runs/char_lm --prompt "def " --max_new_tokens 200 \
    [--temperature 0.8] [--top_k 20] [--num_samples 1] [--seed 0]

Decodes with the KV cache; the prompt and the new characters must fit in the
model's max_len positions.
"""

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Workdir of a char_lm run (config.json, tokenizer.json, checkpoints/).")
flags.DEFINE_string("prompt", "def ", "Text the samples continue.")
flags.DEFINE_integer("max_new_tokens", 200, "Characters to generate per sample.", lower_bound=1)
flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.", lower_bound=0.0)
flags.DEFINE_integer("top_k", None, "Sample among the k most likely characters only.", lower_bound=1)
flags.DEFINE_integer("num_samples", 1, "Independent samples.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seeds the sampling.", lower_bound=0)
common.define_common_flags()


def main(argv):
    del argv  # run_main refuses positional arguments
    if not FLAGS.prompt:
        common.fail("--prompt: must not be empty", code=2)
    import numpy as np

    from qkv_jax.lm import check_generate_args
    from qkv_jax.tasks.char_lm import read_run

    try:  # every check that needs no computation comes first
        config, tokenizer, model = read_run(FLAGS.workdir)
        prompt = np.tile(tokenizer.encode(FLAGS.prompt), (FLAGS.num_samples, 1))
        check_generate_args(model, prompt.shape, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k)
    except ValueError as error:
        common.fail(str(error), code=2)
    common.enable_compilation_cache(FLAGS.compilation_cache)
    import jax

    from qkv_jax.lm import generate
    from qkv_jax.tasks.transformer import init_params
    from qkv_jax.training import read_params

    seq_len = config["task"]["seq_len"]
    like = jax.eval_shape(lambda key: init_params(model, seq_len, key), jax.random.PRNGKey(0))
    try:
        saved = read_params(FLAGS.workdir, like=like)
    except ValueError as error:
        common.fail(str(error), code=2)
    params, step = saved.tree, saved.step
    tokens = generate(
        model,
        params,
        prompt,
        FLAGS.max_new_tokens,
        rng=jax.random.PRNGKey(FLAGS.seed),
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
    )
    for i, row in enumerate(np.asarray(tokens)):
        print(f"--- sample {i} (checkpoint step {step}, temperature {FLAGS.temperature})")
        print(FLAGS.prompt + tokenizer.decode(row))


if __name__ == "__main__":
    common.run_main(main)
