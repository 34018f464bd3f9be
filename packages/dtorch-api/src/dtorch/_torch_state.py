"""The client's global torch settings that its ops run under on the workers.

Today one: the default dtype (`torch.set_default_dtype`), which decides what an op on integers that makes floats
gives (`x / 3`, `x.sqrt()`, `x * 0.5` of an integer x). The workers ran such ops under their own default, float32,
while the client planned them under its own: a float64 program got float32 values labelled float64, and the next op
mixing them failed on the worker. Now each op carries the client's default where it is not float32
(`InstrCall.default_dtype`, protocol 1.10), every plan made under another one is dropped when it changes
(`_dispatch.torch_dispatch` compares it per op, one C call), and a captured step records again.
"""

from __future__ import annotations

import torch

from dtorch_protocol.values import dtype_name

default_dtype = ""  # the wire name of the default dtype the client's plans were made under; "" for float32


def update() -> torch.dtype:
    """Take the current default dtype as the one plans are made under; returns it."""
    global default_dtype
    now = torch.get_default_dtype()
    default_dtype = "" if now is torch.float32 else dtype_name(now)
    return now
