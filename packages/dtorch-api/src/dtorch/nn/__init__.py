"""Parallelism as configuration for unmodified nn.Modules (names follow torch.distributed.tensor.parallel)."""

from dtorch.nn.api import (
    copy_weights,
    distribute_module,
    fully_shard,
    loss_parallel,
    microbatch_forward,
    parallelize_module,
    place_on_mesh,
    replicate_module,
    to_layout,
)
from dtorch.nn.plans import hf_tp_plan, llama_tp_plan, moe_ep_plan
from dtorch.nn.style import (
    ColwiseParallel,
    ExpertParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["distribute_module", "parallelize_module", "replicate_module", "fully_shard", "place_on_mesh",
           "microbatch_forward", "loss_parallel", "copy_weights", "to_layout", "hf_tp_plan", "llama_tp_plan",
           "moe_ep_plan", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
           "PrepareModuleInput", "PrepareModuleInputOutput", "PrepareModuleOutput", "ExpertParallel"]
