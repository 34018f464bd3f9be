"""`hf_tp_plan`: transformers' style names become DTorch styles; what none takes stays replicated, said once."""

from __future__ import annotations

import pytest
import torch.nn as nn

from dtorch import Replicate, Shard
from dtorch.nn import ColwiseParallel, RowwiseParallel, SequenceParallel, hf_tp_plan


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.out = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.experts = nn.Module()
        self.experts.gate_up = nn.Parameter(nn.Linear(4, 8).weight)


class Model(nn.Module):
    def __init__(self, tp_plan: dict[str, str]) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.tp_plan = tp_plan


def test_each_transformers_style_becomes_its_dtorch_style():
    plan = hf_tp_plan(Model({"embed": "embedding_rowwise", "layers.*.qkv": "colwise_gather_output",
                             "layers.*.out": "rowwise_split_input", "layers.*.norm": "sequence_parallel",
                             "layers.0.out": "rowwise", "layers.1.qkv": "colwise"}))
    assert plan == {"embed": RowwiseParallel(input_layouts=Replicate()),
                    "layers.*.qkv": ColwiseParallel(output_layouts=Replicate()),
                    "layers.*.out": RowwiseParallel(input_layouts=Replicate()),
                    "layers.*.norm": SequenceParallel(), "layers.0.out": RowwiseParallel(),
                    "layers.1.qkv": ColwiseParallel()}


def test_replicated_styles_and_other_variants_entries_are_dropped_silently(recwarn):
    plan = hf_tp_plan(Model({"layers.*.qkv": "colwise", "layers.*.norm": "replicated_with_grad_allreduce",
                             "layers.*.mlp.up_proj": "colwise", "embed": "replicate"}))
    assert plan == {"layers.*.qkv": ColwiseParallel()}
    assert not [w for w in recwarn if "hf_tp_plan" in str(w.message)]


def test_entries_no_dtorch_style_takes_stay_replicated_and_are_named():
    with pytest.warns(UserWarning) as caught:
        plan = hf_tp_plan(Model({"layers.*.qkv": "mla_kv_a_proj", "layers.*.experts.gate_up": "packed_rowwise",
                                 "layers.*.norm": "colwise", "layers.*.out": "rowwise"}))
    assert plan == {"layers.*.out": RowwiseParallel()}
    assert str(caught[0].message) == (
        "hf_tp_plan: Model keeps these entries of its tp_plan replicated (no DTorch style takes them as they are): "
        "layers.*.qkv (mla_kv_a_proj), layers.*.experts.gate_up (packed_rowwise), layers.*.norm (colwise)")


def test_a_module_without_a_plan_is_refused_in_one_line():
    with pytest.raises(TypeError, match="hf_tp_plan takes a transformers model .* got Linear"):
        hf_tp_plan(nn.Linear(2, 2))


def test_each_of_torchs_styles_is_the_dtorch_style_of_its_name_and_fields():
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S
    from torch.distributed.tensor import parallel as tp

    from dtorch.nn import style as ds
    from dtorch.nn.style import as_style

    assert as_style(tp.ColwiseParallel(input_layouts=S(0), use_local_output=False)) == \
        ds.ColwiseParallel(Shard(0), Shard(-1), False)
    assert as_style(tp.RowwiseParallel(output_layouts=S(1))) == ds.RowwiseParallel(Shard(-1), Shard(1), True)
    assert as_style(tp.SequenceParallel(sequence_dim=2)) == ds.SequenceParallel(2, False)
    assert as_style(tp.PrepareModuleInput(input_layouts=(S(0), None), desired_input_layouts=(R(), None),
                                          input_kwarg_layouts={"mask": S(1)},
                                          desired_input_kwarg_layouts={"mask": R()})) == \
        ds.PrepareModuleInput((Shard(0), None), (Replicate(), None), {"mask": Shard(1)}, {"mask": Replicate()})
    assert as_style(tp.PrepareModuleOutput(output_layouts=S(0), desired_output_layouts=R())) == \
        ds.PrepareModuleOutput((Shard(0),), (Replicate(),), True)
    assert as_style(tp.PrepareModuleInputOutput(input_layouts=S(0), desired_input_layouts=R(), output_layouts=R(),
                                                desired_output_layouts=S(1))) == \
        ds.PrepareModuleInputOutput((Shard(0),), (Replicate(),), {}, {}, True, False, (Replicate(),), (Shard(1),))
    assert as_style("colwise") == "colwise"  # not a style: left for the caller to refuse
