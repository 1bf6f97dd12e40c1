"""Where the Triton kernel tests run, chosen before `triton` is first imported.

By default (and in CI) on CPU tensors under Triton's interpreter. With `KVPACK_TEST_DEVICE=cuda` the same
tests run the kernels compiled for a GPU: inputs are moved to it, outputs come back to the CPU, and every
comparison is made there against the same pure-torch references (docs/guide/gpu.md).
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("KVPACK_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"KVPACK_TEST_DEVICE must be 'cpu' (Triton's interpreter) or 'cuda' (compiled kernels), got {DEVICE!r}")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import torch  # noqa: E402


def to_device(x):
    """A tensor (or a dict of arguments) on the test device; anything else unchanged. `.to` keeps a tensor
    already there as it is, so views narrowed on the device (strided codes) stay views."""
    if isinstance(x, dict):
        return {k: to_device(v) for k, v in x.items()}
    if isinstance(x, list):  # an op's `Tensor[]` argument
        return [to_device(v) for v in x]
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def on_device(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with its tensor arguments on the test device; its output (a tensor or a tuple of them) back
    on the CPU."""
    out = fn(*(to_device(a) for a in args), **{k: to_device(v) for k, v in kwargs.items()})
    return out.cpu() if isinstance(out, torch.Tensor) else tuple(o.cpu() for o in out)
