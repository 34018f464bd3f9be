"""The class `fully_shard` gives the module it shards: a subclass of torch's `FSDPModule`, as FSDP2 makes it.

FSDP2 swaps the module's class for `FSDP<Class>`, a subclass of `FSDPModule` and of the module's own class. Code
written for it asks `isinstance(model, FSDPModule)`: torch's FSDP2 example asserts it, and training loops call
`FSDPModule`'s methods only on modules that pass. DTorch makes the same class (transformers' `save_pretrained`
strips the prefix). `FSDPModule`'s own methods reach into FSDP2's state, which a DTorch module does not have, so the
class answers each of them itself:

Rules:
  1. `unshard`, `reshard`, `set_requires_gradient_sync` and `set_reshard_after_forward` are DTorch's (`api.py`).
  2. Hints about when to communicate and where FSDP2 keeps its buffers, which change no value (table ACCEPTED:
     prefetching, the last backward, a CUDA event, resharding after backward, NCCL's memory) are taken, and there is
     nothing to do: the client issues each gather as the program reaches it, and each worker runs it while the work
     queued before it still computes.
  3. Every other method of `FSDPModule` (a gradient divide factor, custom collectives or hooks, sum reductions) is
     refused in one line that names it: each changes what is computed, and DTorch has no such setting.
  4. `_apply` (`model.to_empty(...)`, `.to(...)`, `.float()`) is `nn.Module`'s. `copy.deepcopy` builds the copy
     without FSDP2's constructor, which calls the module's `__init__` again (FSDP2 refuses deepcopy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

ACCEPTED = frozenset({"set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "set_is_last_backward",
                      "set_post_optim_event", "reset_iter_state", "set_reshard_after_backward",
                      "set_unshard_in_backward", "set_allocate_memory_from_process_group_for_comm",
                      "set_symm_mem_for_comm", "set_reduce_scatter_max_input_buffers",
                      "set_separate_reduce_scatter_group", "_set_unshard_async_op"})
_classes: dict[type, type] = {}  # the module's class -> its FSDP class


def adopt(module: nn.Module, own: dict[str, Callable[..., Any]]) -> None:
    """`module` becomes an instance of its FSDP class; `own` are DTorch's methods of rule 1, by name."""
    cls = type(module)
    if issubclass(cls, FSDPModule):
        return
    if cls not in _classes:
        methods = {name: _refusal(name) for name in vars(FSDPModule)
                   if not name.startswith("__") and callable(getattr(FSDPModule, name))}
        methods.update({name: _accepted(name) for name in ACCEPTED}, **own, _apply=nn.Module._apply,
                       __reduce_ex__=_reduce_ex)
        _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), methods)
    module.__class__ = _classes[cls]


def _accepted(name: str) -> Callable[..., None]:
    def hint(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        modules = args[0] if args and name.startswith("set_modules_to") else ()
        strays = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
        if strays:
            raise TypeError(f"{name}: {strays[0]} was not given to fully_shard; pass modules that were")

    hint.__name__ = name
    hint.__doc__ = f"FSDP2's `{name}`: taken, with nothing to do (each gather runs while earlier work computes)."
    return hint


def _refusal(name: str) -> Callable[..., None]:
    def refuse(self: nn.Module, *_args: Any, **_kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__}.{name}: DTorch's fully_shard has no such setting (it "
                                  "changes what FSDP2 computes); leave it out")

    refuse.__name__ = name
    return refuse


def _blank(cls: type) -> nn.Module:
    """An empty instance of `cls`'s FSDP class."""
    return object.__new__(_classes[cls])


def _reduce_ex(self: nn.Module, protocol: Any) -> Any:
    """As `object`'s, but the copy is made without `FSDPModule.__new__` (rule 4), and named by the module's own
    class (pickle finds it; `torch.save(model)` then meets the layout's refusal, `api._SaveGuard`)."""
    rv = object.__reduce_ex__(self, protocol)
    return (_blank, (type(self).__mro__[2],), *rv[2:])
