"""`torch.distributed.checkpoint.state_dict`'s functions for a program that runs once: the same names, arguments and
`StateDictOptions`.

A ported program changes its import, as with `fully_shard`:

    from dtorch.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict

torch's own functions, given a DTorch model, ask the default process group for the caller's rank where an option
needs one (`broadcast_from_rank0`), and a client has neither; and they gather only torch's DTensors, so a "full"
state dict still held DTorch's handles. These keep torch's handling of everything else (names, submodules, frozen
parameters, strictness, optimizer state's layout) and differ only where a rank would:

| option | torch, on each rank | here, once |
|---|---|---|
| `full_state_dict` (get) | each DTensor's full tensor | a plain tensor on the client, all read in one round |
| `cpu_offload` (get) | full tensors on the CPU | the client's tensors are on the CPU already |
| `broadcast_from_rank0` (set) | rank 0's dict, broadcast, laid out | the one dict given, laid out as the model is |
| anything else | torch's | torch's, unchanged |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict as _torch
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.utils._pytree import tree_flatten, tree_unflatten

from dtorch.dtensor import DTensor

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict", "get_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict", "set_state_dict"]

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def get_model_state_dict(model: torch.nn.Module, *, submodules: set[torch.nn.Module] | None = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """torch's `get_model_state_dict`; with `full_state_dict`, every DTensor as its full plain tensor."""
    return _full(_torch.get_model_state_dict(model, submodules=submodules, options=_once(options)), options)


def get_optimizer_state_dict(model: torch.nn.Module, optimizers: Optimizers, *,
                             submodules: set[torch.nn.Module] | None = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """torch's `get_optimizer_state_dict`; with `full_state_dict`, every DTensor as its full plain tensor."""
    return _full(_torch.get_optimizer_state_dict(model, optimizers, submodules=submodules, options=_once(options)),
                 options)


def get_state_dict(model: torch.nn.Module, optimizers: Optimizers, *, submodules: set[torch.nn.Module] | None = None,
                   options: StateDictOptions | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch's `get_state_dict`: (the model's, the optimizers'), each as the two functions above give it."""
    both = _torch.get_state_dict(model, optimizers, submodules=submodules, options=_once(options))
    return _full(both, options)


def set_model_state_dict(model: torch.nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> Any:
    """torch's `set_model_state_dict`; full tensors are laid out as the model's parameters are."""
    return _torch.set_model_state_dict(model, model_state_dict, options=_once(options))


def set_optimizer_state_dict(model: torch.nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """torch's `set_optimizer_state_dict`; full tensors are laid out as the state of their parameters is."""
    _torch.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=_once(options))


def set_state_dict(model: torch.nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any], options: StateDictOptions | None = None) -> Any:
    """torch's `set_state_dict`: both of the above."""
    return _torch.set_state_dict(model, optimizers, model_state_dict=model_state_dict,
                                 optim_state_dict=optim_state_dict, options=_once(options))


def _once(options: StateDictOptions | None) -> StateDictOptions | None:
    """The options for torch's function, run once: nothing is broadcast (the table's `broadcast_from_rank0`)."""
    if options is None or not options.broadcast_from_rank0:
        return options
    return dataclasses.replace(options, broadcast_from_rank0=False, full_state_dict=True)


def _full(tree: Any, options: StateDictOptions | None) -> Any:
    """`tree` with each DTensor as its full plain tensor where `full_state_dict` asks for it, all read at once."""
    if options is None or not options.full_state_dict:
        return tree
    leaves, spec = tree_flatten(tree)
    reads = {i: leaf.to_torch_async() for i, leaf in enumerate(leaves) if isinstance(leaf, DTensor)}
    for i, read in reads.items():
        leaves[i] = read.result()
    return tree_unflatten(leaves, spec)
