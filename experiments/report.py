r"""Pictures, head diagnostics and the attention explorer page of a finished run or sweep, or
of a Hugging Face checkpoint.

  python -m experiments.report --workdir runs/flag
  python -m experiments.report --workdir runs/char_lm --prompt "def forward(self, x):"
  python -m experiments.report --workdir runs/char_lm \
    --clean "x = f(a); y = f(" --corrupted "x = g(a); y = f("
  python -m experiments.report --pretrained path/to/hf_model --out reports/hf_model \
    --prompt "The keys and the queries" [--clean "The values" --corrupted "The output"] \
    [--mesh 2,4]

A run: loss.png, the experiment's attention pictures of the newest checkpoint,
report.json with the evaluation metrics and per-head diagnostics (entropy,
attention on the flagged position or, for LMs, distance, previous/first
token and induction scores), and report.html: one self-contained page (open
it from disk in any browser) with every layer's and head's attention on a
few inputs, at every saved checkpoint, the diagnostics table, the loss curves
and the config, and the circuits of the learned matrices: each head's W_QK and
W_OV singular values at every checkpoint shown, the heads' composition scores,
and for a language model with --clean and --corrupted a patching heat map.
A sweep: loss_curves.png, the table plots, each cell's report.html (its first
seed) and results.html linking to them.

A fine-tuning run (configs/pretrained_text.py: LoRA or full, GQA-converted too): loss.png and
report.json's evaluation, and with --prompt (and --clean, --corrupted) the Hugging Face report
below of its newest checkpoint, adapters merged, written into the workdir: no export needed.
With --prompt, --mesh DATA,MODEL splits that model as below (each process holds the whole
merged model on its host while placing it); a mesh it cannot be split over is one line (exit
2) before anything is written. A run of another task or a sweep reads on one device (--mesh
is refused).

  python -m experiments.report --workdir runs/ft_lora --prompt "The keys and the queries meet" \
    [--mesh 2,2 --num_cpu_devices 4]

A Hugging Face checkpoint (--pretrained: config.json, model.safetensors and its
tokenizer.json; give --prompt and --out): OUT/report.json with the prompt's tokens, each
head's diagnostics on it (entropy, distance, previous and first token, max weight) and
induction scores on a repeated random sequence, and with --clean and --corrupted the
patching result; OUT/report.html, the same explorer page with the checkpoint's weights as its
one checkpoint (shown as step 0) and no loss curves. OUT is created if missing; report.html
and report.json in it are replaced, nothing else there is touched. Text is read with the
checkpoint's tokenizer (special tokens as it adds them), tokens labelled by their text in its
vocabulary. --mesh DATA,MODEL loads it split over a (data, model) mesh of that many devices
(`load_pretrained(mesh=...)`; --num_cpu_devices simulates them on a CPU): the same report as
on one device, to float32 rounding.

Patching: the two prompts must have as many tokens (a char LM reads characters, the
sequence tasks whitespace-separated token ids, a Hugging Face checkpoint its
tokens). The answer is the model's most likely next token after the clean prompt,
the contrast its most likely one after the corrupted prompt (they must differ); each
head's clean output (its z, before W_O, at every position) replaces its output in
the corrupted run in turn, and the heat map shows the share of logit(answer) -
logit(contrast) at the last position this restores: (patched - corrupted) / (clean -
corrupted).
"""

from typing import Any

from absl import flags

from experiments import common

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "A run's or a sweep's workdir.")
flags.DEFINE_string(
    "pretrained",
    None,
    "A Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer.json).",
)
flags.DEFINE_string("out", None, "With --pretrained: the directory report.html and report.json go into.")
flags.DEFINE_string("prompt", None, "Language models: a text the explorer page shows too.")
flags.DEFINE_string("clean", None, "Language models: the clean prompt of the page's patching heat map.")
flags.DEFINE_string("corrupted", None, "With --clean: the corrupted prompt, as many tokens long.")
common.define_common_flags()
common.define_mesh_flag()


def report_pretrained(patching: tuple[str, str] | None) -> None:
    from qkv_jax.report.pretrained import report_pretrained
    from qkv_jax.training import ConfigError

    for name in ("prompt", "out"):
        if not FLAGS[name].value:
            common.fail(f"--{name}: required with --pretrained (and not empty)", code=2)
    common.initialize_devices()
    mesh = common.mesh_from_flag()
    try:
        report = report_pretrained(FLAGS.pretrained, FLAGS.out, FLAGS.prompt, patching, mesh=mesh)
    except ConfigError as error:
        common.fail(str(error), code=2)
    print(f"{FLAGS.pretrained}: wrote {FLAGS.out}/report.json and report.html")
    print(f"  prompt tokens                {report['prompt_tokens']}")
    if report["patching"] is not None:
        patched = report["patching"]
        print(f"  patching answer, contrast    {patched['answer']!r}, {patched['contrast']!r}")


def report_finetuning_run(patching: tuple[str, str] | None) -> None:
    """A fine-tuning run: the run's report (loss.png, report.json's evaluation), then with --prompt
    the Hugging Face page of its newest checkpoint, adapters merged (as its export would read),
    split over --mesh when given."""
    from qkv_jax.report.pretrained import open_pretrained, read_text, report_pretrained
    from qkv_jax.report.run import report_run
    from qkv_jax.training import ConfigError

    if patching is not None and not FLAGS.prompt:
        common.fail("--clean and --corrupted: a fine-tuning run's page needs --prompt too", code=2)
    if FLAGS.mesh is not None and not FLAGS.prompt:
        common.fail("--mesh: splits the model of a fine-tuning run's page, which needs --prompt too", code=2)
    common.initialize_devices()
    mesh = None
    try:
        if FLAGS.prompt:  # each text and the mesh checked before anything is computed or written
            shape, tokenizer = open_pretrained(FLAGS.workdir)
            for flag in ("prompt", "clean", "corrupted"):
                if FLAGS[flag].value is not None:
                    read_text(tokenizer, shape, FLAGS[flag].value, f"--{flag}")
            mesh = checked_mesh(shape)
        report = report_run(FLAGS.workdir)
        if FLAGS.prompt:
            report = report_pretrained(
                FLAGS.workdir, FLAGS.workdir, FLAGS.prompt, patching, extra=report, mesh=mesh
            )
    except ConfigError as error:
        common.fail(str(error), code=2)
    page = " and report.html" if FLAGS.prompt else " (--prompt adds report.html)"
    print(f"checkpoint step {report['step']}; wrote {FLAGS.workdir}/loss.png, report.json{page}")
    for name, value in report.items():
        if name.startswith("eval_"):
            print(f"  {name:28s} {value:.4g}")


def checked_mesh(model) -> Any:
    """The mesh --mesh names (None without it), checked against `model`'s heads: one line (exit
    2) for a mesh it cannot be split over."""
    from qkv_jax.sharding import check_mesh

    mesh = common.mesh_from_flag()
    if mesh is not None:
        try:
            check_mesh(mesh, model.config)
        except ValueError as error:
            common.fail(str(error), code=2)
    return mesh


def main(argv):
    del argv  # run_main refuses positional arguments
    source = common.one_source()
    common.enable_compilation_cache(FLAGS.compilation_cache)
    from qkv_jax.report.run import is_sweep, report_run
    from qkv_jax.training import ConfigError
    from studies.results import report_sweep

    if (FLAGS.clean is None) != (FLAGS.corrupted is None):
        given = "--clean" if FLAGS.clean is not None else "--corrupted"
        common.fail(f"{given} needs the other of --clean and --corrupted", code=2)
    patching = None if FLAGS.clean is None else (FLAGS.clean, FLAGS.corrupted)
    if source == "pretrained":
        report_pretrained(patching)
        return
    if FLAGS.out is not None:
        common.fail("--out: only with --pretrained (a run's report is written into its workdir)", code=2)
    from qkv_jax.tasks.pretrained_text import is_run

    if is_run(FLAGS.workdir):
        report_finetuning_run(patching)
        return
    if FLAGS.mesh is not None:
        common.fail("--mesh: only with --pretrained or a fine-tuning run's --workdir", code=2)
    try:
        if is_sweep(FLAGS.workdir):
            if patching is not None:
                common.fail(
                    f"--workdir={FLAGS.workdir}: a sweep; --clean and --corrupted patch one run (report it "
                    "without them, or give a run's workdir)",
                    code=2,
                )
            result = report_sweep(FLAGS.workdir, FLAGS.prompt)
            print(
                f"{FLAGS.workdir}: loss_curves.png ({result['plotted']} cells), the table plots, "
                f"results.html and {result['pages']} cell pages"
            )
            return
        report = report_run(FLAGS.workdir, FLAGS.prompt, patching)
    except ConfigError as error:
        common.fail(str(error), code=2)
    page = " and report.html" if "page" in report else ""
    print(f"checkpoint step {report['step']}; wrote {FLAGS.workdir}/loss.png, report.json, pictures{page}")
    for name, value in report.items():
        if name.startswith("eval_"):
            shown = value if isinstance(value, list) else f"{value:.4g}"
            print(f"  {name:28s} {shown}")


if __name__ == "__main__":
    common.run_main(main)
