"""A byte-level GPT (Flax NNX) trained with gradtools, and a mixed-precision study.

Run it with ``python -m gradtools.demo.gpt`` (``--help`` lists the options;
``--study`` runs the precision study), or from Python::

  from gradtools.demo.gpt import Config, train_and_evaluate
  result = train_and_evaluate(Config(size="tiny", steps=100, precision="fp16"))

Needs the ``demo`` extra: ``pip install "gradtools[demo]"``.
"""

from gradtools.demo.gpt.config import Config
from gradtools.demo.gpt.model import GPT
from gradtools.demo.gpt.model import SIZES
from gradtools.demo.gpt.model import GPTConfig
from gradtools.demo.gpt.train import Result
from gradtools.demo.gpt.train import train_and_evaluate

__all__ = ["GPT", "SIZES", "Config", "GPTConfig", "Result", "train_and_evaluate"]
