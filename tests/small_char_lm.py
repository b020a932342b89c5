"""A char LM config small enough for tests: one layer, width 32, 60 steps on a given text file,
compiled for compile speed (train.cpu_optimization_level=0: its runs are mostly compilation)."""

from configs import char_lm as char_lm_config


def small_config(path, **overrides):
    config = char_lm_config.get_config()
    config.data.path = str(path)
    config.model.num_layers = 1
    config.model.d_model = 32
    config.model.max_len = 48
    config.task.seq_len = 32
    config.train.steps = 60
    config.train.batch_size = 16
    config.train.learning_rate = 1e-2
    config.train.warmup_steps = 5
    config.train.log_every = 20
    config.train.checkpoint_every = 30
    config.train.cpu_optimization_level = 0
    config.eval.num_examples = 32
    config.eval.sample_length = 20
    for field, value in overrides.items():
        section, name = field.split("__")
        config[section][name] = value
    return config
