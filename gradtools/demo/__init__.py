"""The LeNet-5 on MNIST demo: every gradtools transform in one training run.

Run it with ``python -m gradtools.demo`` (``--help`` lists the options), or
from Python::

  from gradtools.demo import Config, train_and_evaluate
  result = train_and_evaluate(Config(epochs=2, precision="bf16"))

Needs the ``demo`` extra: ``pip install "gradtools[demo]"``.
"""

from gradtools.demo.config import Config
from gradtools.demo.config import ConfigError
from gradtools.demo.data import DataError
from gradtools.demo.model import LeNet5
from gradtools.demo.train import Result
from gradtools.demo.train import train_and_evaluate

__all__ = ["Config", "ConfigError", "DataError", "LeNet5", "Result", "train_and_evaluate"]
