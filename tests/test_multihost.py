"""The demo on two processes (``--coordinator``, ``--num-processes``, ``--process-id``).

Two ``python -m gradtools.demo`` processes on 127.0.0.1, one CPU device each,
train one epoch of the bundled digits with a global batch of 64; a third
process, alone on one CPU device with the same settings, is the reference.
Each runs the CLI's ``main`` under a small wrapper that records what
``train_and_evaluate`` returned and how many digits the process preprocessed,
and saves both to a file.
"""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from gradtools.demo.checkpoint import Checkpoints

pytestmark = pytest.mark.slow  # CI runs these after the README's command

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARGV = ["--epochs", "1", "--batch-size", "64", "--accum-steps", "1", "--no-progress"]
TIMEOUT_S = 240

# Runs the CLI with argv[2:] and saves the result's params, accuracy and the number
# of digits this process preprocessed to argv[1] (an .npz).
WRAPPER = """
import sys

import jax
import numpy as np

from gradtools.demo.lenet import __main__ as cli
from gradtools.demo.lenet import data

read, results = [], []
preprocess, train_and_evaluate = data.preprocess, cli.train_and_evaluate
data.preprocess = lambda images: read.append(len(images)) or preprocess(images)
cli.train_and_evaluate = lambda config: results.append(train_and_evaluate(config)) or results[0]
code = cli.main(sys.argv[2:])
leaves = jax.tree.leaves(results[0].params)
np.savez(
    sys.argv[1],
    *[np.asarray(x.addressable_data(0)) for x in leaves],
    accuracy=results[0].test_accuracy,
    digits_read=sum(read),
    code=code,
    process=jax.process_index(),
)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leaves(saved) -> list[np.ndarray]:
    return [saved[f"arr_{i}"] for i in range(len([k for k in saved.files if k.startswith("arr_")]))]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Runs the two processes to the end; their outputs, saved results and folder."""
    folder = tmp_path_factory.mktemp("multihost")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("XLA_FLAGS", None)
    hosts = ["--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2"]
    runs = {
        0: [*hosts, "--process-id", "0", "--checkpoint-dir", str(folder / "ckpt")],
        1: [*hosts, "--process-id", "1", "--checkpoint-dir", str(folder / "ckpt")],
        "alone": [],
    }
    procs = {}
    try:
        for name, argv in runs.items():
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", WRAPPER, str(folder / f"{name}.npz"), *ARGV, *argv],
                env=env,
                cwd=folder,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        outputs = {name: p.communicate(timeout=TIMEOUT_S) for name, p in procs.items()}
    finally:
        for p in procs.values():  # after a timeout, or a failure to start one
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs.items():
        out, err = outputs[name]
        assert p.returncode == 0, f"{name}: exit {p.returncode}\n{out}\n{err[-3000:]}"
    saved = {name: np.load(folder / f"{name}.npz") for name in runs}
    return outputs, saved, folder


def test_both_processes_end_with_identical_params(two_processes):
    _, saved, _ = two_processes
    assert [int(saved[i]["process"]) for i in (0, 1)] == [0, 1]
    assert [int(saved[i]["code"]) for i in (0, 1)] == [0, 0]
    first, second = _leaves(saved[0]), _leaves(saved[1])
    assert len(first) == 10  # LeNet-5's kernels and biases
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


def test_each_process_reads_its_half_of_every_batch(two_processes):
    _, saved, _ = two_processes
    # 4,000 digits in 62 batches of 64, then 1,000 test digits: half of each per process.
    assert [int(saved[i]["digits_read"]) for i in (0, 1)] == [(62 * 64 + 1000) // 2] * 2
    assert int(saved["alone"]["digits_read"]) == 62 * 64 + 1000


def test_only_process_0_prints_and_writes_the_checkpoint(two_processes):
    outputs, _, folder = two_processes
    out0, out1 = outputs[0][0], outputs[1][0]
    assert "2 cpu devices in 2 processes; batch 64;" in out0
    assert f"checkpoint: {folder / 'ckpt' / '62'}" in out0
    # gloo, which carries the CPU collectives, reports its connection itself
    assert [line for line in out1.splitlines() if not line.startswith("[Gloo]")] == []
    assert os.listdir(folder / "ckpt") == ["62"]
    ckpt = Checkpoints(folder / "ckpt")
    history = ckpt.restore_meta(62)["history"]
    ckpt.close()
    assert history["step"] == list(range(1, 63))


def test_two_processes_learn_as_one_does(two_processes):
    outputs, saved, _ = two_processes
    assert "1 cpu device; batch 64;" in outputs["alone"][0]
    alone = float(saved["alone"]["accuracy"])
    assert 50.0 < alone <= 100.0  # it learned: chance is 10%
    assert abs(float(saved[0]["accuracy"]) - alone) <= 0.2
    for a, b in zip(_leaves(saved[0]), _leaves(saved["alone"])):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
