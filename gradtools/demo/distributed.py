"""Data-parallel training over every device of every process: the mesh and the batches.

* :func:`initialize_distributed` calls ``jax.distributed.initialize`` from the
  ``--coordinator``/``--num-processes``/``--process-id`` options;
* :func:`data_parallel` gives the two shardings a demo uses: parameters and
  optimizer state replicated, batches split along their first axis;
* :func:`global_batch` builds a batch split over the devices from the rows
  each process reads itself;
* :func:`describe_devices` says where a run trains, for its log.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import cast

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradtools.demo.errors import ConfigError

__all__ = ["data_parallel", "describe_devices", "global_batch", "initialize_distributed"]


def initialize_distributed(args: argparse.Namespace) -> None:
    """Calls ``jax.distributed.initialize`` when a multi-host option is given.

    On clusters that JAX recognises (Cloud TPU, SLURM, ...) the options left
    out are found there; elsewhere all three are needed.

    Raises:
      ConfigError: naming the option, for a malformed address or a process
        count or number out of range.
    """
    given = {
        "coordinator_address": args.coordinator,
        "num_processes": args.num_processes,
        "process_id": args.process_id,
    }
    if all(v is None for v in given.values()):
        return
    n, i = args.num_processes, args.process_id
    if args.coordinator is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", args.coordinator):
        raise ConfigError(f"--coordinator {args.coordinator}: expected HOST:PORT")
    if n is not None and n < 1:
        raise ConfigError(f"--num-processes {n}: must be an integer >= 1")
    if i is not None and (i < 0 or n is not None and i >= n):
        upper = "" if n is None else f" to {n - 1}"
        raise ConfigError(f"--process-id {i}: must be an integer from 0{upper}")
    jax.distributed.initialize(**given)


def data_parallel(devices: Sequence[Any]) -> tuple[NamedSharding, NamedSharding]:
    """``(replicated, split)`` over a one-axis mesh of ``devices``, named ``'data'``.

    ``replicated`` puts a copy on every device (parameters, optimizer state);
    ``split`` divides an array along its first axis (batches), so that the
    jitted step is the one-device step and XLA adds the all-reduce.
    """
    mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def global_batch(
    sharding: NamedSharding, indices: np.ndarray, read: Callable[[np.ndarray], np.ndarray]
) -> jax.Array:
    """The rows ``read(indices)``, split over ``sharding``'s devices as one global array.

    Each process reads only the rows its own devices hold.
    """
    n = len(indices)
    held = sharding.addressable_devices_indices_map((n,)).values()  # {device: (slice,)}
    starts, stops = zip(*(cast(tuple, index)[0].indices(n)[:2] for index in held))
    local = read(indices[min(starts) : max(stops)])
    return jax.make_array_from_process_local_data(sharding, local, (n, *local.shape[1:]))


def describe_devices(devices: Sequence[Any]) -> str:
    """``'4 cpu devices'``, or ``'2 cpu devices in 2 processes'`` under ``jax.distributed``."""
    n, hosts = len(devices), jax.process_count()
    where = f"{n} {devices[0].platform} device{'s' * (n > 1)}"
    return where + (f" in {hosts} processes" if hosts > 1 else "")
