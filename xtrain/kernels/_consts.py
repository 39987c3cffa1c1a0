"""Numeric constants the kernels share, each defined once (the base-2 forms of exp and log: the GPU's exp2 and
log2 are single instructions)."""

LOG2E = 1.4426950408889634  # 1 / ln 2: exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln 2: log(x) = log2(x) * LN2
