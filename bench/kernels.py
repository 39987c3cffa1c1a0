"""``xtrain bench kernels``: fused Triton kernels vs their plain-torch references (see xtrain.bench.kernels).

The benchmark itself lives in the package (``xtrain/bench/kernels.py``: it uses no baseline that library
code may not import, only xtrain's own references), so ``python -m xtrain.bench.kernels`` runs it from an
installed package too; this file makes it reachable as ``xtrain bench kernels`` from a checkout.
"""

from xtrain.bench.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
