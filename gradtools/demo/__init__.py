"""Two demos of gradtools: LeNet-5 on MNIST (``lenet``) and a byte-level GPT (``gpt``).

``python -m gradtools.demo`` (or ``python -m gradtools.demo.lenet``) trains
LeNet-5 with every gradtools transform in one run; ``python -m
gradtools.demo.gpt`` trains the GPT (``--help`` lists each one's options).
The package's names are the LeNet-5 demo's::

  from gradtools.demo import Config, train_and_evaluate
  result = train_and_evaluate(Config(epochs=2, precision="bf16"))

Each demo is a package of its own (config, data, model, optim, train and its
``__main__``); the plumbing they share is one module per job beside them:
``cli``, ``distributed``, ``interrupt``, ``checkpoint``, ``history``,
``plot`` and ``errors``. Needs the ``demo`` extra: ``pip install "gradtools[demo]"``.
"""

from gradtools.demo.errors import ConfigError
from gradtools.demo.errors import DataError
from gradtools.demo.lenet import Config
from gradtools.demo.lenet import LeNet5
from gradtools.demo.lenet import Result
from gradtools.demo.lenet import train_and_evaluate

__all__ = ["Config", "ConfigError", "DataError", "LeNet5", "Result", "train_and_evaluate"]
