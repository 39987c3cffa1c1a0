"""Which device a command runs on: ``resolve_device``, the one check every command (train, sample, serve, the
data-parallel launcher) uses for its ``--device`` flag."""

from __future__ import annotations

import torch


def resolve_device(spec: str | None) -> str:
    """The device to run on: ``spec`` checked against what this torch build and machine have (ValueError with
    one line saying why not), or cuda when available, else cpu."""
    if spec is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {spec}: not a device name; use cpu or cuda (cuda:N)") from None
    if dev.type == "cpu":
        return str(dev)
    if dev.type != "cuda":
        raise ValueError(f"--device {spec}: xtrain runs on cpu or cuda only")
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) was built without CUDA"
            if torch.version.cuda is None
            else "no CUDA GPU is visible (driver missing, or CUDA_VISIBLE_DEVICES empty)"
        )
        raise ValueError(f"--device {spec}: {why}; use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return str(dev)
