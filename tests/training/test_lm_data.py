"""The char LM's data (tokenizer, corpora, split, windows) and the synthetic sequence tasks."""

import collections
import math
import sysconfig

import jax
import numpy as np
import pytest

from qkv_jax import text
from qkv_jax.tasks.sequences import BRACKET_EQUALS, BRACKET_PAD, bracket_batch, copy_batch


class TestCharTokenizer:
    def test_round_trip_and_unknown_characters(self):
        tokenizer = text.CharTokenizer("abc\n")
        assert tokenizer.vocab_size == 5 and tokenizer.chars == text.UNKNOWN + "\nabc"
        ids = tokenizer.encode("cab\nz")
        np.testing.assert_array_equal(ids, [4, 2, 3, 1, 0])
        assert ids.dtype == np.int32
        assert tokenizer.decode(ids) == "cab\n" + text.UNKNOWN
        with pytest.raises(ValueError, match=r"ids must lie in \[0, 5\), got min 0 and max 5"):
            tokenizer.decode([0, 5])

    def test_from_text_keeps_the_most_frequent_characters(self):
        tokenizer = text.CharTokenizer.from_text("aaaabbbccd" + "xy", max_vocab_size=4)
        assert tokenizer.chars == text.UNKNOWN + "abc"  # d, x, y (1 each) fall out
        ties = text.CharTokenizer.from_text("zyxw", max_vocab_size=3)
        assert ties.chars == text.UNKNOWN + "wx"  # equal counts: lower code points first

    def test_save_and_load(self, tmp_path):
        tokenizer = text.CharTokenizer('é\t"λ\\')
        tokenizer.save(tmp_path / "tokenizer.json")
        loaded = text.CharTokenizer.load(tmp_path / "tokenizer.json")
        assert loaded.chars == tokenizer.chars
        sample = 'λé\t"\\?'
        np.testing.assert_array_equal(loaded.encode(sample), tokenizer.encode(sample))


def test_split_documents_is_deterministic_and_keeps_files_whole():
    documents = [(f"pkg/module_{i}.py", f"# file {i}\n") for i in range(200)]
    train, validation = text.split_documents(documents, 0.1)
    assert (train, validation) == text.split_documents(list(documents), 0.1)
    held_out = [name for name, body in documents if body.rstrip("\n") in validation.split("\n")]
    assert 5 <= len(held_out) <= 40  # about 10% of 200
    more = documents + [("pkg/new.py", "# new\n")]
    _, validation_more = text.split_documents(more, 0.1)
    assert all(body in validation_more for name, body in documents if name in held_out)
    single_train, single_validation = text.split_documents([("book.txt", "0123456789" * 10)], 0.1)
    assert single_train == "0123456789" * 9 and single_validation == "0123456789"
    with pytest.raises(ValueError, match="validation_fraction must be in"):
        text.split_documents(documents, 0.0)


def test_unigram_bits_per_char_against_a_direct_count():
    train, validation = "aaab", "abc"
    tokenizer = text.CharTokenizer("abc")
    counts = collections.Counter(train)
    total = len(train) + tokenizer.vocab_size  # add-one smoothing over the 4 ids
    want = -sum(math.log2((counts[c] + 1) / total) for c in validation) / len(validation)
    got = text.unigram_bits_per_char(
        tokenizer.encode(train), tokenizer.encode(validation), tokenizer.vocab_size
    )
    assert got == pytest.approx(want, rel=1e-12)


def test_random_windows_are_slices_of_the_corpus():
    tokens = np.arange(1000, dtype=np.int32)
    windows = np.asarray(
        jax.jit(text.random_windows, static_argnums=(2, 3))(jax.random.PRNGKey(0), tokens, 64, 9)
    )
    assert windows.shape == (64, 9)
    np.testing.assert_array_equal(windows, windows[:, :1] + np.arange(9))  # consecutive tokens
    assert windows[:, -1].max() < 1000 and len(set(windows[:, 0])) > 50


def test_stdlib_corpus_is_library_code_in_path_order():
    documents = text.stdlib_documents()
    names = [name for name, _ in documents]
    assert names == sorted(names) and len(names) > 100
    assert any(name == "json/__init__.py" for name in names)
    assert not any({"site-packages", "test", "tests"} & set(name.split("/")[:-1]) for name in names)
    root = sysconfig.get_paths()["stdlib"]
    with open(f"{root}/json/__init__.py", encoding="utf-8") as f:
        assert dict(documents)["json/__init__.py"] == f.read()


class TestSequenceTasks:
    def test_copy_second_half_repeats_the_first(self):
        batch = jax.tree.map(np.asarray, copy_batch(jax.random.PRNGKey(0), 32, 5, 7))
        inputs, targets, mask = batch["inputs"], batch["targets"], batch["answer_mask"]
        assert inputs.shape == targets.shape == mask.shape == (32, 10)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # a shift by one
        np.testing.assert_array_equal(inputs[:, 5], 0)  # the separator
        sequence = np.concatenate([inputs[:, :1], targets], axis=1)  # (32, 11)
        np.testing.assert_array_equal(sequence[:, 6:], sequence[:, :5])
        assert ((sequence[:, :5] >= 1) & (sequence[:, :5] < 7)).all()
        np.testing.assert_array_equal(mask, np.arange(10)[None, :].repeat(32, 0) >= 5)

    @pytest.mark.slow
    def test_bracket_completion_against_a_stack(self):
        num_types, prefix_len = 3, 10
        batch = jax.tree.map(np.asarray, bracket_batch(jax.random.PRNGKey(1), 200, prefix_len, num_types))
        sequences = np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)  # (B, 2P + 1)
        depths = []
        for sequence, mask in zip(sequences, batch["answer_mask"], strict=True):
            stack = []
            for token in sequence[:prefix_len]:
                if 2 <= token < 2 + num_types:
                    stack.append(token - 2)
                else:
                    assert stack and token == 2 + num_types + stack.pop()  # closes the innermost
            assert sequence[prefix_len] == BRACKET_EQUALS
            completion = [2 + num_types + kind for kind in reversed(stack)]
            expected = completion + [BRACKET_PAD] * (prefix_len - len(completion))
            np.testing.assert_array_equal(sequence[prefix_len + 1 :], expected)
            answers = np.zeros(2 * prefix_len, bool)
            answers[prefix_len : prefix_len + min(len(stack) + 1, prefix_len)] = True
            np.testing.assert_array_equal(mask, answers)
            depths.append(len(stack))
        assert min(depths) == 0 and max(depths) >= 4  # the walk reaches both ends

    def test_bad_arguments(self):
        with pytest.raises(ValueError, match="need length >= 1 and vocab_size >= 2, got 3, 1"):
            copy_batch(jax.random.PRNGKey(0), 2, 3, 1)
        with pytest.raises(ValueError, match="need prefix_len >= 1 and num_types >= 1, got 0, 2"):
            bracket_batch(jax.random.PRNGKey(0), 2, 0, 2)
