"""Bytes of English prose for the GPT demo: Python's own help topics, or your text files.

The default needs no download: the standard library ships the text of
``help('topics')`` as ``pydoc_data.topics.topics`` (79 topics, about 466 KB).
:func:`load` joins them in sorted-key order and keeps the last 10% of the
bytes for validation. With ``data_dir`` it reads the directory's ``*.txt``
files instead, in sorted order, as UTF-8 bytes. Tokens are bytes: the
vocabulary is 256, nothing to train or download.

Batches are random windows of ``block_size + 1`` bytes (inputs and the next
bytes as targets) drawn by a NumPy generator seeded with ``(seed, step)``, so
a resumed run trains on exactly the batches an uninterrupted one does.
"""

from __future__ import annotations

import glob
import math
import os
from typing import NamedTuple

import numpy as np

from gradtools.demo.errors import DataError

__all__ = [
    "DataError",
    "Text",
    "eval_windows",
    "load",
    "train_windows",
    "unigram_bits_per_byte",
]

VALID_FRACTION = 0.1


class Text(NamedTuple):
    """The training and validation bytes.

    Attributes:
      train: ``uint8`` array, the first 90% of the bytes.
      valid: ``uint8`` array, the last 10%.
      source: a short description for the log.
    """

    train: np.ndarray
    valid: np.ndarray
    source: str


def load(data_dir: str | os.PathLike[str] | None = None) -> Text:
    """Loads the text: Python's help topics, or the ``*.txt`` files in ``data_dir``.

    Args:
      data_dir: ``None`` for ``pydoc_data.topics``; else a directory whose
        ``*.txt`` files (sorted by name) are joined, each as its UTF-8 bytes.

    Returns:
      A :class:`Text`, split deterministically: the last 10% of the bytes
      (whatever the seed) are the validation split.

    Raises:
      DataError: if ``data_dir`` is not a directory, or its ``*.txt`` files
        hold no text.
    """
    if data_dir is None:
        from pydoc_data.topics import topics

        raw = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        source = f"Python's help topics (pydoc_data, {len(topics)} topics)"
    else:
        if not os.path.isdir(data_dir):
            raise DataError(f"--data-dir {data_dir}: not a directory")
        paths = sorted(glob.glob(os.path.join(glob.escape(os.fspath(data_dir)), "*.txt")))
        raw = b"\n\n".join(_read(p) for p in paths)
        if not raw.strip():
            raise DataError(f"--data-dir {data_dir}: no text in *.txt files ({len(paths)} found)")
        source = f"{len(paths)} text file{'s' * (len(paths) != 1)} in {data_dir}"
    tokens = np.frombuffer(raw, np.uint8)
    cut = len(tokens) - math.ceil(VALID_FRACTION * len(tokens))
    return Text(tokens[:cut], tokens[cut:], source)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e}") from None


def train_windows(
    tokens: np.ndarray, block_size: int, batch_size: int, seed: int, step: int
) -> np.ndarray:
    """The training batch of ``step``: ``int32 (batch_size, block_size + 1)`` windows.

    Each row is ``tokens[s : s + block_size + 1]`` at a start ``s`` drawn
    uniformly by ``np.random.default_rng([seed, step])``: the batch depends on
    ``(seed, step)`` alone.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - block_size, size=batch_size)
    return np.stack([tokens[s : s + block_size + 1] for s in starts]).astype(np.int32)


def eval_windows(tokens: np.ndarray, block_size: int, max_windows: int) -> np.ndarray:
    """Non-overlapping windows of ``block_size + 1`` bytes across ``tokens``, evenly spread.

    All of them when there are at most ``max_windows``; else ``max_windows``
    spaced evenly from the first to the last. Returns ``int32 (n,
    block_size + 1)``.
    """
    n = (len(tokens) - 1) // block_size
    picked = np.unique(np.linspace(0, n - 1, min(n, max_windows)).round().astype(int))
    return np.stack(
        [tokens[i * block_size : i * block_size + block_size + 1] for i in picked]
    ).astype(np.int32)


def unigram_bits_per_byte(train: np.ndarray, valid: np.ndarray) -> float:
    """The byte-unigram entropy of the validation split, in bits per byte: the baseline.

    ``H = -sum_b p(b) log2 p(b)`` with ``p`` the byte frequencies of ``valid``
    itself: the cross-entropy of ``valid`` under its own unigram
    distribution, the lowest any model that ignores context reaches on it (a
    unigram fitted to ``train`` does no better, by Gibbs' inequality). A
    language model that beats it has learnt something from the context.

    Args:
      train: the training bytes; not used by the number, which is the
        validation split's own entropy.
      valid: the validation bytes (``uint8``).

    Returns:
      The entropy in bits per byte.
    """
    del train  # the baseline is valid's own entropy, the bound any unigram meets
    counts = np.bincount(valid, minlength=256)
    p = counts[counts > 0] / len(valid)
    return float(-(p * np.log2(p)).sum())
