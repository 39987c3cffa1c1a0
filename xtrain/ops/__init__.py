"""Differentiable ops on ``Var``. Public signatures here are relied on by outside code.

basic: add, add_cast, sub, mul, div, scale, neg, matmul, linear, add_bias, sum, mean, reshape, transpose,
       contiguous, cast, cast_as
nn:    embedding, rms_norm, silu, swiglu, softmax, cross_entropy, rope, dropout
attention: attention (composed), math_attention (one node, hand-written backward), auto_attention (the form the
           device rule picks), attention_rows (row layout in and out), cached_attention (over KV cache rows,
           inference), repeat_kv, causal_mask, doc_mask; flash_attention (fused, xtrain.ops.flash); each takes
           a mask (xtrain.mask)
fused: linear_cross_entropy, lm_head_loss (the form the device rule picks), qk_norm_rope, qkv_norm_rope_linear
       (training: q/k/v in one product), qkv_norm_rope (decode), rows_linear and rows_linear_weight (decode),
       rope_table, swiglu_linear, add_rms_norm (xtrain.ops.fused)
"""

from xtrain.ops.attention import (
    attention,
    attention_rows,
    auto_attention,
    cached_attention,
    causal_mask,
    doc_mask,
    math_attention,
    repeat_kv,
)
from xtrain.ops.basic import (
    add,
    add_bias,
    add_cast,
    cast,
    cast_as,
    contiguous,
    div,
    linear,
    matmul,
    mean,
    mul,
    neg,
    reshape,
    scale,
    sub,
    sum,
    transpose,
    value_checks_off,
)
from xtrain.ops.nn import cross_entropy, dropout, embedding, rms_norm, rope, silu, softmax, swiglu

__all__ = [
    "add",
    "add_cast",
    "add_bias",
    "add_rms_norm",
    "attention",
    "attention_rows",
    "auto_attention",
    "cached_attention",
    "cast",
    "cast_as",
    "causal_mask",
    "doc_mask",
    "contiguous",
    "cross_entropy",
    "div",
    "dropout",
    "embedding",
    "flash_attention",
    "linear",
    "linear_cross_entropy",
    "lm_head_loss",
    "math_attention",
    "matmul",
    "mean",
    "mul",
    "neg",
    "qk_norm_rope",
    "qkv_norm_rope",
    "repeat_kv",
    "reshape",
    "rms_norm",
    "rope",
    "rope_table",
    "rows_linear",
    "rows_linear_weight",
    "scale",
    "silu",
    "softmax",
    "sub",
    "sum",
    "swiglu",
    "swiglu_linear",
    "transpose",
    "value_checks_off",
]


def __getattr__(name):
    # fused ops live in their own modules (owned by the kernel work) and are imported on first use, then kept
    # here (a decode step looks them up many times)
    if name == "flash_attention":
        from xtrain.ops.flash import flash_attention as fn
    elif name in (
        "add_rms_norm",
        "linear_cross_entropy",
        "lm_head_loss",
        "qk_norm_rope",
        "qkv_norm_rope",
        "qkv_norm_rope_linear",
        "rope_table",
        "rows_linear",
        "rows_linear_weight",
        "swiglu_linear",
    ):
        from xtrain.ops import fused

        fn = getattr(fused, name)
    else:
        raise AttributeError(f"module 'xtrain.ops' has no attribute {name!r}")
    globals()[name] = fn
    return fn
