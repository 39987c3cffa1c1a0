"""microGPT: a scalar autograd engine (``Value``) and a tiny GPT built from nothing else.

The smallest complete picture of the algorithm that the tensor stack runs at scale, and a second oracle
for it (tests/test_micro.py checks the microGPT's loss and every gradient against ``xtrain.ops``).
"""

from xtrain.micro.engine import Value, dot, vsum

__all__ = ["Value", "dot", "vsum"]
