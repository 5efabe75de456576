"""The LeNet-5 on MNIST demo: every gradtools transform in one training run.

Run it with ``python -m gradtools.demo.lenet`` or ``python -m gradtools.demo``
(``--help`` lists the options), or from Python::

  from gradtools.demo.lenet import Config, train_and_evaluate
  result = train_and_evaluate(Config(epochs=2, precision="bf16"))

Needs the ``demo`` extra: ``pip install "gradtools[demo]"``.
"""

from gradtools.demo.lenet.config import Config
from gradtools.demo.lenet.model import LeNet5
from gradtools.demo.lenet.train import Result
from gradtools.demo.lenet.train import train_and_evaluate

__all__ = ["Config", "LeNet5", "Result", "train_and_evaluate"]
