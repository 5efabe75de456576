"""``python -m gradtools.demo``: the LeNet-5 demo, as ``python -m gradtools.demo.lenet`` runs it."""

import sys

from gradtools.demo.lenet.__main__ import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
