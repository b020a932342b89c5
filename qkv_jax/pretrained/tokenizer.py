"""The tokenizer a Hugging Face checkpoint ships (`tokenizer.json`), read with `tokenizers`.

  tok = load_tokenizer(directory, vocab_size=config.vocab_size)
  ids = tok.encode("The keys and the queries")    # int32 [T], special tokens as the file adds them
  text = tok.decode(ids)                          # special tokens dropped

Every id an encoding gives is checked against the model's vocabulary: a tokenizer whose
vocabulary is larger than the model's embedding (a mismatched directory, or added tokens the
model never saw) is a ValueError naming the token, not an out-of-range gather (which JAX clamps
silently on the accelerator).
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

import numpy as np

__all__ = ["TOKENIZER_FILE", "PretrainedTokenizer", "has_tokenizer", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"


def has_tokenizer(directory: str | pathlib.Path) -> bool:
    return (pathlib.Path(directory) / TOKENIZER_FILE).is_file()


class PretrainedTokenizer:
    """A `tokenizers.Tokenizer` with the model's vocabulary size: encode to int32 ids, decode."""

    def __init__(self, tokenizer: object, vocab_size: int | None, path: pathlib.Path):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.path = path

    def encode(self, text: str, *, add_special_tokens: bool = True) -> np.ndarray:
        """The ids of `text` (int32 `[T]`); ValueError when one lies outside the model's vocabulary
        or when the text gives no token at all."""
        encoding = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]
        ids = np.asarray(encoding.ids, dtype=np.int32)
        if ids.size == 0:
            raise ValueError(f"{text[:40]!r}: {self.path} encodes it to no tokens")
        if self.vocab_size is not None and (ids >= self.vocab_size).any():
            position = int(np.argmax(ids >= self.vocab_size))
            raise ValueError(
                f"{text[:40]!r}: token {encoding.tokens[position]!r} (id {int(ids[position])}) of "
                f"{self.path} lies outside the model's vocabulary of {self.vocab_size}"
            )
        return ids

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool = True) -> list[np.ndarray]:
        return [self.encode(text, add_special_tokens=add_special_tokens) for text in texts]

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(  # type: ignore[attr-defined]
            [int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=skip_special_tokens
        )

    def token_strings(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """Each id's own token text (`id_to_token`), for labels on a page or a plot."""
        return [self.tokenizer.id_to_token(int(i)) or f"<{int(i)}>" for i in np.asarray(ids).reshape(-1)]  # type: ignore[attr-defined]

    @property
    def tokenizer_vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))  # type: ignore[attr-defined]

    def token_id(self, token: str) -> int | None:
        value = self.tokenizer.token_to_id(token)  # type: ignore[attr-defined]
        return None if value is None else int(value)


def load_tokenizer(directory: str | pathlib.Path, *, vocab_size: int | None = None) -> PretrainedTokenizer:
    """`directory`/tokenizer.json as a PretrainedTokenizer; `vocab_size`: the model's (ids at or
    past it are refused when encoding). ValueError, one line naming the file, when it is missing
    or does not parse."""
    from tokenizers import Tokenizer

    path = pathlib.Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(
            f"{pathlib.Path(directory)}: has no {TOKENIZER_FILE}; text in and out needs the tokenizer the "
            "checkpoint was trained with (copy it beside config.json)"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the tokenizers package raises its own Exception
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"{path}: not a tokenizers tokenizer.json ({first})") from None
    return PretrainedTokenizer(tokenizer, vocab_size, path)
