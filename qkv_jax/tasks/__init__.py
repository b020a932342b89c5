"""The built-in tasks: each module holds a task's data generator and its `build(config) -> Setup`.

  flag_retrieval  a learned query finds the flagged token among random ones
                  (`flag_retrieval_batch`; FlagReader models)
  sequences       next-token tasks with a known answer: copy, brackets, repeat
                  (`copy_batch`, `bracket_batch`, `repeat_batch`; a TransformerLM)
  char_lm         a character-level language model on a text corpus
  transformer     what the TransformerLM tasks share: the model from a config's
                  `model` section, the loss, attention read-outs

A config names its task by module path (`config.task.module`), so a task in
your own package trains the same way (docs/adding_a_task.md).
"""
