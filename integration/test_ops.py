"""Ordinary torch code on DTensors, through real workers, compared with plain torch on the full tensors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import dtorch
from _helpers import assert_same, run_scenario, tap
from dtorch import Partial, Replicate, Shard


def dist(t, mesh, *placements):
    return dtorch.distribute_tensor(t, mesh, list(placements))


def test_factories_show_values_mesh_and_placements(mesh1):
    x = dtorch.rand((4, 3), device_mesh=mesh1, placements=[Shard(0)])
    text = repr(x)
    assert "DeviceMesh('cpu', [0, 1])" in text and "Shard(dim=0)" in text and "tensor(" in text
    full = x.to_torch()
    assert full.shape == (4, 3) and (full >= 0).all() and (full < 1).all()
    assert_same(dtorch.zeros(5, 2, device_mesh=mesh1, placements=[Shard(0)]), torch.zeros(5, 2))
    assert_same(dtorch.ones((3, 4), device_mesh=mesh1, placements=[Shard(1)]), torch.ones(3, 4))
    assert_same(dtorch.full((3, 3), 7.5, device_mesh=mesh1, placements=[Replicate()]), torch.full((3, 3), 7.5))
    assert_same(dtorch.arange(10, device_mesh=mesh1, placements=[Shard(0)]), torch.arange(10))
    assert_same(dtorch.arange(1.0, 4.0, 0.5, device_mesh=mesh1, placements=[Shard(0)]), torch.arange(1.0, 4.0, 0.5))
    assert dtorch.empty(2, 2, device_mesh=mesh1).to_torch().shape == (2, 2)


def test_random_values_do_not_depend_on_layout(mesh1, mesh4, mesh2d):
    values = []
    for mesh, placements in [(mesh1, [Shard(0)]), (mesh4, [Shard(1)]), (mesh2d, [Replicate(), Shard(0)])]:
        dtorch.manual_seed(1234)
        values.append(dtorch.randn(6, 5, device_mesh=mesh, placements=placements).to_torch())
    assert torch.equal(values[0], values[1]) and torch.equal(values[0], values[2])
    dtorch.manual_seed(1235)
    assert not torch.equal(values[0], dtorch.randn(6, 5, device_mesh=mesh1).to_torch())


@pytest.mark.parametrize("pa,pb", [(Shard(0), Shard(0)), (Shard(0), Replicate()), (Shard(1), Shard(0)),
                                   (Replicate(), Shard(1)), (Partial(), Replicate())])
def test_elementwise_and_broadcasting(mesh4, pa, pb):
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    x, y = dist(a, mesh4, pa), dist(b, mesh4, pb)
    assert_same(x + y, a + b, exact=False)
    assert_same(x * y - y / 3, a * b - b / 3, exact=False)
    assert_same(torch.exp(x).sin(), torch.exp(a).sin(), exact=False)
    row = torch.randn(5)
    assert_same(x * row, a * row, exact=False)  # a plain tensor mixed in
    assert_same(x + 2.5, a + 2.5, exact=False)  # a Python scalar inline


@pytest.mark.parametrize("pa,pb", [(Shard(1), Shard(0)), (Shard(0), Replicate()), (Replicate(), Shard(1)),
                                   (Shard(0), Shard(1)), (Replicate(), Replicate())])
def test_matmul_family(mesh4, pa, pb):
    a, w = torch.randn(8, 6), torch.randn(6, 10)
    x, wd = dist(a, mesh4, pa), dist(w, mesh4, pb)
    out = x @ wd
    if (pa, pb) == (Shard(1), Shard(0)):
        assert out.placements == (Partial("sum"),)
    assert_same(out, a @ w, exact=False)
    bias = torch.randn(10)
    assert_same(F.linear(x, dist(w.T.contiguous(), mesh4, Shard(0)), dist(bias, mesh4, Replicate())),
                F.linear(a, w.T, bias), exact=False)
    b3, c3 = torch.randn(4, 3, 5), torch.randn(4, 5, 2)
    assert_same(torch.bmm(dist(b3, mesh4, Shard(0)), dist(c3, mesh4, Shard(0))), torch.bmm(b3, c3), exact=False)


@pytest.mark.parametrize("p", [Shard(0), Shard(1), Replicate(), Partial()])
def test_reductions(mesh4, p):
    a = torch.randn(7, 6)
    x = dist(a, mesh4, p)
    assert_same(x.sum(0), a.sum(0), exact=False)
    assert_same(x.sum(1), a.sum(1), exact=False)
    assert_same(x.sum(), a.sum(), exact=False)
    assert_same(x.mean(1), a.mean(1), exact=False)
    assert_same(x.amax(0), a.amax(0), exact=False)
    assert abs(x.sum().item() - a.sum().item()) < 1e-4


@pytest.mark.parametrize("p", [Shard(0), Shard(1), Replicate()])
def test_views_reshapes_transposes(mesh4, p):
    a = torch.randn(8, 6)
    x = dist(a, mesh4, p)
    assert_same(x.view(4, 12), a.view(4, 12))
    assert_same(x.view(48), a.view(48))
    assert_same(x.reshape(2, 4, 6), a.reshape(2, 4, 6))
    assert_same(x.transpose(0, 1), a.transpose(0, 1))
    assert_same(x.t().contiguous(), a.t().contiguous())
    assert_same(x.unsqueeze(0).permute(2, 0, 1), a.unsqueeze(0).permute(2, 0, 1))
    assert_same(x.flatten(), a.flatten())


def test_uneven_view_per_device_sizes(mesh4):
    a = torch.randn(6, 4)  # 6 rows over 4 devices: 2, 2, 2, 0
    x = dist(a, mesh4, Shard(0))
    assert_same(x.view(6, 2, 2), a.view(6, 2, 2))
    assert_same(x.view(6, 2, 2).sum(-1), a.view(6, 2, 2).sum(-1), exact=False)


def test_flattening_a_dim_sharded_twice_unevenly(mesh2d):
    """6 rows sharded on both mesh dims (3 and 3, then 2 and 1): torch's view rule gave every device the local size
    of an even split ([12]); the workers refused it at the next sync point. The local sizes are checked now."""
    a = torch.arange(48.0).view(6, 8)
    x = dist(a.clone(), mesh2d, Shard(0), Shard(0))
    assert_same(x.view(-1), a.view(-1))
    x.view(-1)[5:20].fill_(0)
    a.view(-1)[5:20].fill_(0)
    assert_same(x, a)


@pytest.mark.parametrize("p", [Shard(0), Shard(1), Replicate()])
def test_softmax_family(mesh4, p):
    a = torch.randn(5, 8)
    x = dist(a, mesh4, p)
    assert_same(F.softmax(x, dim=-1), F.softmax(a, dim=-1), exact=False)
    assert_same(F.log_softmax(x, dim=0), F.log_softmax(a, dim=0), exact=False)


def test_cat_stack_slicing_indexing(mesh4):
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    x, y = dist(a, mesh4, Shard(0)), dist(b, mesh4, Shard(1))
    assert_same(torch.cat([x, y], dim=0), torch.cat([a, b], dim=0))
    assert_same(torch.cat([x, y], dim=1), torch.cat([a, b], dim=1))
    assert_same(torch.stack([x, y]), torch.stack([a, b]))
    assert_same(x[1:3], a[1:3])
    assert_same(x[:, 2], a[:, 2])
    assert_same(x[::2, 1:], a[::2, 1:])
    idx = torch.tensor([4, 0, 2])
    assert_same(x[idx], a[idx])


def test_comparisons_where_and_casts(mesh4):
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    x, y = dist(a, mesh4, Shard(0)), dist(b, mesh4, Shard(1))
    assert_same(x > y, a > b)
    assert_same(x == x, a == a)
    assert_same(torch.where(x > 0, x, y), torch.where(a > 0, a, b))
    assert_same(x.double(), a.double())
    assert_same((x * 10).int(), (a * 10).int())
    assert_same(x.to(torch.bfloat16), a.to(torch.bfloat16))


def test_sync_points_item_tolist_bool(mesh4):
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    x = dist(a, mesh4, Shard(0))
    assert x.sum().item() == 10.0
    assert x.tolist() == a.tolist()
    assert bool((x > 0).all()) is True
    assert bool((x > 3).all()) is False
    if x.max() > 3:  # control flow on data
        flag = True
    assert flag
    loss = x.mean()
    assert f"loss {loss:.3f}" == f"loss {a.mean():.3f}" == "loss 2.500"  # a training loop's print
    assert f"{x}" == str(x)
    with pytest.raises(TypeError):
        f"{x:.3f}"  # as with a plain tensor of more than one element


def test_memory_interfaces_copy_the_whole_tensor_or_refuse_in_one_line(mesh1):
    """The wrapper holds no memory: its DLPack capsule pointed at address 0 (`numpy.from_dlpack` read it), and
    `share_memory_()` (`model.share_memory()` before torch.multiprocessing) and `apply_(fn)` crashed the process."""
    import numpy as np

    from dtorch.errors import DTorchError
    from dtorch.nn import replicate_module

    a = torch.randn(4, 3)
    x = dist(a, mesh1, Shard(0))
    assert np.array_equal(np.from_dlpack(x), a.numpy()) and np.array_equal(x.numpy(), a.numpy())
    model = replicate_module(torch.nn.Linear(3, 2), mesh1)
    with pytest.raises(DTorchError, match=r"share_memory_\(\): a DTensor's shards live on the workers"):
        model.share_memory()
    assert x.apply_(lambda v: v * 2 + 1) is x and x.placements == (Shard(0),)  # it crashed the process too
    assert torch.equal(x.full_tensor(), a.apply_(lambda v: v * 2 + 1))


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_nn_init_functions_initialise_sharded_parameters(mesh1, placement):
    """Every `torch.nn.init` function runs on a DTensor as on a tensor: the deterministic ones give torch's values
    (`eye_` writes through `eye.m_out`, which had no functional overload to run instead and was refused on a
    sharded tensor), the random ones finite values of torch's spread, `orthogonal_` an orthogonal matrix."""
    init = torch.nn.init
    exact = {init.zeros_: torch.zeros(6, 4), init.ones_: torch.ones(6, 4), init.eye_: torch.eye(6, 4),
             (lambda t: init.constant_(t, 3.0)): torch.full((6, 4), 3.0)}
    random = (init.normal_, init.uniform_, init.xavier_uniform_, init.xavier_normal_, init.kaiming_uniform_,
              init.kaiming_normal_, lambda t: init.trunc_normal_(t, std=0.02), lambda t: init.sparse_(t, 0.5))
    w = dist(torch.empty(6, 4), mesh1, placement)
    for fill, want in exact.items():
        fill(w)
        assert_same(w, want)
    for fill in random:
        fill(w)
        values = w.to_torch()
        assert torch.isfinite(values).all() and values.std() > 0
    init.orthogonal_(w)
    values = w.to_torch()
    torch.testing.assert_close(values.T @ values, torch.eye(4), rtol=1e-5, atol=1e-5)
    conv = dist(torch.empty(4, 4, 3, 3), mesh1, placement)
    assert_same(init.dirac_(conv), init.dirac_(torch.empty(4, 4, 3, 3)))


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Shard(2)], ids=str)
def test_a_boolean_mask_over_several_dims_reads_and_writes_as_torch(mesh1, placement):
    """`x[mask]` with a 2-d mask of a 3-d x, read and written: torch's rules take each index for one dim, and split
    x on its second dim against a whole mask (the worker refused the shapes at the next sync point)."""
    gen = torch.Generator().manual_seed(0)
    x, mask = torch.randn(4, 6, 5, generator=gen), torch.rand(4, 6, generator=gen) > 0.5
    values = torch.randn(int(mask.sum()), 5, generator=gen)
    dx, dmask = dist(x.clone(), mesh1, placement), dist(mask, mesh1, Replicate())
    assert_same(dx[dmask], x[mask])
    for write in (lambda t, m, v: t.__setitem__(m, 0.5), lambda t, m, v: t.__setitem__(m, v),
                  lambda t, m, v: t.index_put_((m,), v, accumulate=True)):
        write(x, mask, values)
        write(dx, dmask, dist(values, mesh1, Replicate()))
        assert_same(dx, x)


@pytest.mark.parametrize("layout", ["dp", "fully_shard", "rowwise", "colwise"])
@pytest.mark.parametrize("options", [{}, {"padding_idx": 0}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}], ids=str)
def test_an_embedding_trains_as_torch_in_every_layout(mesh1, layout, options):
    """Frequency-scaled gradients were each device's own count of its shard of a sharded batch (dtorch._embedding);
    under fully_shard, max_norm renormalised the weight gathered for the forward and the stored shards missed it."""
    from dtorch.nn import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module, replicate_module

    torch.manual_seed(0)
    ref = torch.nn.Embedding(10, 4, **options)
    model = copy.deepcopy(ref)
    ids = torch.tensor([[0, 1, 2, 9], [3, 0, 5, 9], [9, 9, 1, 2]])
    if layout in ("dp", "fully_shard"):
        (replicate_module if layout == "dp" else fully_shard)(model, mesh1)
        dids = dist(ids, mesh1, Shard(0))
    else:
        style = (RowwiseParallel if layout == "rowwise" else ColwiseParallel)(input_layouts=Replicate())
        parallelize_module(model, mesh1, style)
        dids = dist(ids, mesh1, Replicate())
    out, want = model(dids), ref(ids)
    (out * out).sum().backward()
    (want * want).sum().backward()
    torch.testing.assert_close(out.full_tensor(), want)
    torch.testing.assert_close(model.weight.grad.full_tensor(), ref.weight.grad)
    torch.testing.assert_close(model.weight.full_tensor(), ref.weight.detach())


def test_mixed_precision_is_cpu_autocast_and_cuda_autocast_says_so(mesh1, monkeypatch):
    """DTensors are CPU tensors in the client whatever their mesh: torch.autocast("cpu", dtype) casts their ops, as
    torch does on the full tensors; torch.autocast("cuda") never reaches them, so DTorch warns where it is on. (A
    client without CUDA cannot turn it on: torch disables it, so `is_autocast_enabled` stands in for a GPU here.)"""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    dtorch.nn.replicate_module(model, mesh1)
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = model(dist(x, mesh1, Shard(0))), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.full_tensor(), want)
    enabled = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device="cpu": device == "cuda" or enabled(device))
    with pytest.warns(UserWarning, match=r"torch.autocast\('cuda'\) does not reach DTensors.*use "
                                         r"torch.autocast\('cpu', dtype=\.\.\.\)"):
        dist(torch.randn(5, 3), mesh1, Shard(0)).cos()


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
def test_in_place_ops_on_a_plain_tensor_take_the_dtensors_values(mesh1, placement):
    """`buf[i] = x` of a plain `buf` from a factory (generate's beam search does this) brings x's values into buf, as a
    copy to the CPU would (a sync point); it was refused. (A batch norm's plain running statistics still are:
    test_batch_norm_training_updates_its_running_statistics_as_torch.)"""
    a = torch.arange(12.0).view(3, 4)
    x = dist(a, mesh1, placement)
    buf, want = torch.zeros(3, 4), torch.zeros(3, 4)
    for t, src in ((buf, x), (want, a)):
        t[1] = src[0]
        t[:, 0].add_(src[:, 1])
        t.mul_(src)
    assert type(buf) is torch.Tensor and torch.equal(buf, want)


def test_inplace_ops(mesh4):
    a = torch.randn(4, 6)
    x = dist(a, mesh4, Shard(0))
    x.add_(1.0)
    x.mul_(dist(a, mesh4, Shard(0)))
    assert_same(x, (a + 1.0) * a, exact=False)


@pytest.mark.parametrize("dim", [0, 1])
def test_in_place_op_whose_input_had_to_move_is_written_back(mesh4, dim):
    """cumsum_ over a sharded dim: torch's rule runs it on a Replicate copy of x, which is then copied back
    into x: x keeps its tensor id and layout, and a view of x sees the values."""
    a = torch.arange(30.0).reshape(6, 5) - 12.0
    x = dist(a, mesh4, Shard(dim))
    view = x[:, 1:3] if dim == 0 else x[2:5]  # along the unsharded dim: a view of each shard
    tid = x._tid
    assert x.cumsum_(dim) is x
    assert x._tid == tid and x.placements == (Shard(dim),)
    assert_same(x, a.cumsum(dim))
    assert_same(view, a.cumsum(dim)[:, 1:3] if dim == 0 else a.cumsum(dim)[2:5])


WRITES_THROUGH_VIEWS = {  # name -> a write through a view, as torch users write it (t: the tensor, like(v): a value)
    "x[1] = 5": lambda t, like: t.__setitem__(1, 5.0),
    "x[:, 2] = 5": lambda t, like: t.__setitem__((slice(None), 2), 5.0),
    "x[::2] = 5": lambda t, like: t.__setitem__(slice(None, None, 2), 5.0),
    "x[2:5, 1:3] = v": lambda t, like: t.__setitem__((slice(2, 5), slice(1, 3)), like(torch.ones(3, 2))),
    "narrow().add_": lambda t, like: t.narrow(1, 1, 2).add_(1),
    "select().mul_": lambda t, like: t.select(1, 2).mul_(3),
    "chunk()[1].zero_": lambda t, like: t.chunk(2, dim=1)[1].zero_(),
    "unbind()[3].fill_": lambda t, like: t.unbind(0)[3].fill_(7),
    "split()[1].copy_": lambda t, like: t.split(2, dim=0)[1].copy_(like(torch.zeros(2, 4))),
    "diagonal().fill_": lambda t, like: t.diagonal().fill_(9),
    "view(-1)[3:9].fill_": lambda t, like: t.view(-1)[3:9].fill_(9),
    "t()[1:3].mul_": lambda t, like: t.t()[1:3].mul_(2),
    "x[2:4].unsqueeze(0).mul_": lambda t, like: t[2:4].unsqueeze(0).mul_(2),
}


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
@pytest.mark.parametrize("write", WRITES_THROUGH_VIEWS)
def test_a_write_through_a_view_reaches_the_tensor_when_the_view_had_to_move_it(mesh1, placement, write):
    """A view across the sharded dim (`x[1]` of a row-sharded x) is taken of a moved copy of x; a write through
    it stayed in the copy (`x[1] = 5` did nothing, as with torch's DTensor). DTorch copies it back (dtorch._views)."""
    x = torch.arange(24.0).view(6, 4)
    dx = dist(x.clone(), mesh1, placement)
    WRITES_THROUGH_VIEWS[write](x, lambda v: v)
    WRITES_THROUGH_VIEWS[write](dx, lambda v: dist(v, mesh1, Replicate()))
    assert_same(dx, x)


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
def test_views_of_moved_copies_see_writes_to_their_tensor_and_to_each_other(mesh1, placement):
    """Views that had to move x follow later writes to x, to each other, and to views of themselves, as torch's
    views do; the copies they hold go when they go."""
    from dtorch import _views

    x = torch.arange(24.0).view(6, 4)
    dx = dist(x.clone(), mesh1, placement)
    views = [(x[1], dx[1]), (x[:, 2], dx[:, 2])]
    sub, dsub = views[0][0][1:3], views[0][1][1:3]  # a view of a view
    parts, dparts = x.split(2), dx.split(2)
    for write in (lambda t: t.add_(1), lambda t: t[1].mul_(2), lambda t: t[1][1:3].fill_(-1),
                  lambda t: t.__setitem__(slice(2, 5), 7.0), lambda t: t.split(2)[1].zero_()):
        write(x)
        write(dx)
        for v, dv in [*views, (sub, dsub), *zip(parts, dparts)]:
            assert_same(dv, v)
        assert_same(dx, x)
    del views, sub, dsub, parts, dparts, v, dv
    assert not _views.by_root


PROGRAM_STEPS = (  # (x: the tensor, like: a plain value as x's kind, k: a small number) -> a write, as users write them
    lambda x, like, k: x.t().add_(k),
    lambda x, like, k: x.__setitem__(k % x.shape[0], float(k)),
    lambda x, like, k: x[:, k % x.shape[1]].mul_(2),
    lambda x, like, k: x[k % 3:k % 3 + 2, 1:].fill_(-k),
    lambda x, like, k: x.view(-1)[::k % 4 + 2].neg_(),
    lambda x, like, k: x.narrow(1, 0, 2).copy_(like(torch.full((x.shape[0], 2), float(k)))),
    lambda x, like, k: x.cumsum_(k % 2),
    lambda x, like, k: x.__setitem__(x > k, 0.5),
    lambda x, like, k: x.split(2, dim=k % 2)[0].zero_(),
    lambda x, like, k: x.transpose(0, 1)[k % x.shape[1]].add_(3),
    lambda x, like, k: x.index_add_(0, like(torch.tensor([0, x.shape[0] - 1])), like(torch.ones(2, x.shape[1]))),
    lambda x, like, k: x.diagonal().mul_(-1),
    lambda x, like, k: x.copy_(x.roll(1, k % 2)),
)


@pytest.mark.parametrize("seed", range(12))
def test_random_programs_of_writes_through_views_match_torch(mesh2d, seed):
    """Random programs of writes through views (rows, columns, blocks, flat strides, splits, diagonals, masks) on
    random 2-d layouts, with a row view held throughout: the tensor and the view follow torch (before
    dtorch._views, most such programs lost writes)."""
    import random

    rng = random.Random(seed)
    layouts = [Replicate(), Shard(0), Shard(1)]

    def like(t):
        return dist(t, mesh2d, *(rng.choice(layouts[:t.dim() + 1]) for _ in range(2)))

    for _ in range(3):
        a = torch.arange(30.0).view(rng.choice([(5, 6), (6, 5), (3, 10)]))
        x = like(a.clone())
        row, drow = a[1], x[1]
        for step, k in [(rng.choice(PROGRAM_STEPS), rng.randint(0, 9)) for _ in range(4)]:
            step(a, lambda t: t, k)
            step(x, like, k)
        assert_same(x, a)
        assert_same(drow, row)


@pytest.mark.parametrize("style", ["rowwise", "colwise"])
def test_writing_rows_and_columns_of_a_sharded_parameter_under_no_grad(mesh1, style):
    """`emb.weight[pad].fill_(0)`, `weight.data[i] = v`, `weight[:, j] = v` on a vocab- or dim-sharded embedding did
    nothing before dtorch._views (the writes stayed in moved copies)."""
    from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    ref = torch.nn.Embedding(10, 4)
    model = copy.deepcopy(ref)
    layout = RowwiseParallel if style == "rowwise" else ColwiseParallel
    parallelize_module(model, mesh1, layout(input_layouts=Replicate()))
    for m in (model, ref):
        with torch.no_grad():
            m.weight[3].fill_(0)
            m.weight.data[5] = 1.0
            m.weight[:, 1] = 2.0
    assert model.weight.placements == ((Shard(0),) if style == "rowwise" else (Shard(1),))
    assert_same(model.weight.detach(), ref.weight.detach())


ITEM_WRITES = [  # (index, value: "n" a number, "t" a tensor of the region's shape, "row" one that broadcasts to it)
    (5, "n"), (-1, "t"), ((slice(1, 8, 3),), "n"), ((slice(2, 7), slice(0, 6, 2)), "t"), ((Ellipsis, 4), "t"),
    ((4, 5), "n"), ((slice(8, 2),), "n"), ((slice(None), 2), "t"), ((slice(1, None, 2), Ellipsis), "row"),
]


@pytest.mark.parametrize("index,value", ITEM_WRITES, ids=str)
def test_item_assignment_on_a_sharded_dim_writes_where_the_rows_live(cluster, mesh4, mesh2d, index, value):
    """`x[i] = v` on a dim x is sharded on gathered the whole tensor to every device and wrote it back (64 MiB moved
    to set one row of a 64 MiB tensor; torch's DTensor gathers too). Each device now writes its own part of the
    region (_setitem): x never moves, and the values are torch's for numbers, values laid out in any way and plain
    ones, broadcast, on 1-d and 2-d meshes with uneven shards (9 rows over 4 devices)."""
    from dtorch_protocol import messages as m

    g = torch.Generator().manual_seed(0)
    for mesh, at in [(mesh4, [Shard(0)]), (mesh4, [Shard(1)]), (mesh2d, [Shard(0), Shard(1)]),
                     (mesh2d, [Shard(0), Shard(0)])]:
        a = torch.arange(54.0).view(9, 6)
        region = a[index]
        v = {"n": 7.5, "t": torch.randn(region.shape, generator=g), "row": torch.randn(region.shape[-1:], generator=g)}[
            value]
        values = [v] if value == "n" else [v, *(dist(v, mesh, *p) for p in
                                              ([Replicate()] * mesh.ndim, [Shard(0)] * mesh.ndim, at) if
                                              all(q.dim < v.dim() for q in p if q.is_shard()))]
        for dv in values:
            x, want = dist(a.clone(), mesh, *at), a.clone()
            sent: list = []
            with tap(cluster, sent):
                x[index] = dv
            want[index] = v
            assert_same(x, want)
            assert x.placements == tuple(at)
            assert not [i for i in sent if isinstance(i, m.InstrRedistribute) and i.src == x._tid], (mesh, at, dv)


def test_item_assignment_on_a_sharded_dim_is_replayed_and_bumps_the_version(cluster, mesh1):
    """A sequence-sharded KV cache written at a position in an automatically captured loop (one `.item()` a step)
    gives torch's values, replayed; a write under no_grad into a tensor autograd saved makes backward refuse, as
    torch does. `x[:, 3] = 3.0` (a fill_ with a 0-dim tensor through a view of an unsharded dim) keeps the shards
    where they are too (torch has no rule for it: the view was gathered and written back)."""
    from dtorch_protocol import messages as m

    g = torch.Generator().manual_seed(0)
    cache, w, x = torch.zeros(2, 4, 12, 8), torch.randn(8, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    dcache, dw, dx = dist(cache.clone(), mesh1, Shard(2)), dist(w, mesh1, Replicate()), dist(x, mesh1, Replicate())
    dtorch.auto_compile(False)
    capture = dtorch.auto_compile(True)
    with torch.no_grad():
        for _ in range(8):
            for c, t, v in ((cache, x, w), (dcache, dx, dw)):
                c[:, :, 9] = torch.tanh(t @ v) * 0.5 + 0.25
            x, dx = (torch.tanh(c[:, :, 9] @ v) - 0.5 * t for c, t, v in ((cache, x, w), (dcache, dx, dw)))
            assert dx.sum().item() == pytest.approx(x.sum().item(), abs=1e-5)
    assert capture.replays >= 3 and capture.fallbacks == 0
    torch.testing.assert_close(dcache.full_tensor(), cache)
    assert dcache.placements == (Shard(2),)

    y = dist(torch.randn(6, 4, generator=g), mesh1, Shard(0)).requires_grad_() * 2
    loss = (y * y).sum()
    with torch.no_grad():
        y[3] = 0.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

    sent = []
    t = dist(torch.zeros(6, 4), mesh1, Shard(0))
    with tap(cluster, sent):
        t[:, 3] = 3.0
    want = torch.zeros(6, 4)
    want[:, 3] = 3.0
    assert_same(t, want)
    assert not [i for i in sent if isinstance(i, m.InstrRedistribute)]


REGION_READS = {  # name -> (a view of part of a dim, the shape of the part that moves)
    "x[3]": (lambda t: t[3], (1, 6)), "x[-1]": (lambda t: t[-1], (1, 6)), "x[2:4]": (lambda t: t[2:4], (2, 6)),
    "x[1::4]": (lambda t: t[1::4], (3, 6)), "x.narrow(0, 7, 2)": (lambda t: t.narrow(0, 7, 2), (2, 6)),
    "x[:, 2]": (lambda t: t[:, 2], (10, 1)), "x[:, -3:]": (lambda t: t[:, -3:], (10, 3)),
}


@pytest.mark.parametrize("read", REGION_READS)
def test_a_view_of_part_of_a_sharded_dim_moves_only_that_part(cluster, mesh4, mesh2d, read):
    """`x[3]` of a row-sharded x (`print(x[0])`, the last position of sequence-sharded hidden states) gathered the
    whole of x on every device. Only the part moves now (_slices, _regions rule 3): one reduction of its bytes.
    The view still aliases x as torch's does: writes through it reach x, writes to x reach it (_views), also in a
    replayed step; integers, -0.0 and NaN arrive as they are."""
    from dtorch_protocol import messages as m

    take, moved_shape = REGION_READS[read]
    a = torch.arange(60.0).view(10, 6) - 20.0
    a[3, 1], a[9, 5], a[2, 2] = -0.0, float("nan"), float("inf")
    dim = 1 if ":, " in read else 0
    for mesh, at in [(mesh4, [Shard(dim)]), (mesh2d, [Shard(dim), Shard(1 - dim)]), (mesh2d, [Shard(dim)] * 2)]:
        for values in (a, a.nan_to_num().long()):
            x, want = dist(values.clone(), mesh, *at), values.clone()
            sent: list = []
            with tap(cluster, sent):
                view = take(x)
            torch.testing.assert_close(view.full_tensor(), take(want), equal_nan=True)
            assert torch.equal(view.full_tensor().signbit(), take(want).signbit())
            moves = [i for i in sent if isinstance(i, m.InstrRedistribute)]
            assert moves and all(tuple(i.src_spec.shape) == moved_shape for i in moves), (mesh, at)
            view.mul_(2)  # through the view, into x
            take(want).mul_(2)
            torch.testing.assert_close(x.full_tensor(), want, equal_nan=True)
            x.add_(1)  # into x, seen by the view
            want.add_(1)
            torch.testing.assert_close(view.full_tensor(), take(want), equal_nan=True)


def test_writes_through_views_of_parts_of_a_sharded_dim_are_replayed(mesh1):
    """A step that reads and writes through `x[1]` of a row-sharded x, replayed by automatic capture, gives torch's
    values (a replayed view's origin is the region its recording moved)."""
    a = torch.arange(24.0).view(6, 4)
    x = dist(a.clone(), mesh1, Shard(0))
    dtorch.auto_compile(False)
    capture = dtorch.auto_compile(True)
    for k in range(7):
        for t in (a, x):
            row = t[1]
            row.mul_(0.5)
            t[4].add_(row * 0.25 + float(k))
            t.sub_(0.125)
            t[:, 2].clamp_(max=40.0)
        assert x[4].sum().item() == pytest.approx(a[4].sum().item())
    assert capture.replays >= 3 and capture.fallbacks == 0
    assert_same(x, a)
    row.fill_(-1.0)  # x's row, made by the last replayed step: eager writes through it and into x
    a[1].fill_(-1.0)
    assert_same(x, a)
    x.add_(1.0)
    a.add_(1.0)
    assert_same(row, a[1])


@pytest.mark.parametrize("placement", [Shard(0), Shard(1)], ids=str)
def test_gradients_through_item_assignment_on_a_sharded_dim(mesh1, placement):
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    dw = dist(w.detach(), mesh1, placement).requires_grad_()
    for t in (w, dw):
        y = t * 2
        y[1] = y[2] * 3
        y[:, 0] = 0
        (y * y).sum().backward()
    assert_same(dw.grad, w.grad)


@pytest.mark.parametrize("layout", [Replicate(), Shard(0), Shard(1)])
def test_batch_norm_training_updates_its_running_statistics_as_torch(mesh4, layout):
    """native_batch_norm writes running_mean and running_var in place without saying so in its schema
    (dtorch_protocol.writes): with the channels sharded (Shard(1)) the statistics that had to move are copied back,
    so they follow torch's; with them still plain tensors the op refuses, rather than updating a copy."""
    torch.manual_seed(0)
    ref = torch.nn.BatchNorm1d(6)
    mean, var = dist(torch.zeros(6), mesh4, Replicate()), dist(torch.ones(6), mesh4, Replicate())
    for i in range(3):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(i))
        want = ref(x)
        got = F.batch_norm(dist(x, mesh4, layout), mean, var, training=True, momentum=0.1)
        assert_same(got, want, exact=False)
    assert_same(mean, ref.running_mean, exact=False)
    assert_same(var, ref.running_var, exact=False)
    with torch.no_grad():  # evaluation reads the statistics only: plain ones are fine there
        assert_same(F.batch_norm(dist(x, mesh4, layout), ref.running_mean, ref.running_var, training=False),
                    F.batch_norm(x, ref.running_mean, ref.running_var, training=False), exact=False)
    with pytest.raises(NotImplementedError, match="would write into the plain torch.Tensor 'running_mean'"):
        F.batch_norm(dist(x, mesh4, layout), torch.zeros(6), torch.ones(6), training=True)


def test_a_small_cnn_trains_data_parallel_as_torch(mesh1):
    """Conv2d, BatchNorm2d, max pooling and a Linear head, batch Shard(0), SGD with momentum: losses, parameters,
    running statistics and the eval-mode output equal torch's. The first conv's backward leaves the input's
    gradient undefined (`convolution_backward` with output_mask [False, True, True]): it keeps its place among the
    op's outputs on the worker."""
    from dtorch.nn import replicate_module

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 10))
    model = replicate_module(copy.deepcopy(ref), mesh1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        loss = F.cross_entropy(ref(x), y)
        dloss = F.cross_entropy(model(dist(x, mesh1, Shard(0))), dist(y, mesh1, Shard(0)))
        for one, o in ((loss, opt), (dloss, dopt)):
            one.backward()
            o.step()
            o.zero_grad()
        torch.testing.assert_close(dloss.item(), loss.item(), rtol=1e-5, atol=1e-6)
    for (name, t), d in zip([*ref.named_parameters(), *ref.named_buffers()], [*model.parameters(), *model.buffers()]):
        torch.testing.assert_close(d.full_tensor(), t.detach(), rtol=1e-5, atol=1e-5, msg=name)
    ref.eval(), model.eval()
    x = torch.randn(4, 3, 8, 8, generator=g)
    assert_same(model(dist(x, mesh1, Shard(0))), ref(x), exact=False)


@pytest.mark.parametrize("convert", ["bfloat16", "double"])
def test_module_dtype_conversion_converts_the_shards(mesh1, convert):
    """`nn.Module.to(dtype)`, `.double()`: torch sets `param.data` (and the gradient's) to the converted tensor, which
    a DTensor's `data` setter adopts whole; before, the wrapper said the new dtype while its shards kept the old one
    ("mat1 and mat2 must have the same dtype" at the next forward)."""
    from dtorch.nn import replicate_module

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = replicate_module(copy.deepcopy(ref), mesh1)
    x = torch.randn(6, 8)
    model(dist(x, mesh1, Shard(0))).sum().backward()  # a gradient to convert as well
    ref(x).sum().backward()
    getattr(ref, convert)(), getattr(model, convert)()
    dtype = getattr(torch, convert)
    for p, d in zip(ref.parameters(), model.parameters()):
        assert d.dtype == dtype and d.full_tensor().dtype == dtype and d.grad.full_tensor().dtype == dtype
        assert torch.equal(d.full_tensor(), p.detach())
        torch.testing.assert_close(d.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6)  # summed over the batch
    assert_same(model(dist(x.to(dtype), mesh1, Shard(0))), ref(x.to(dtype)), exact=False)
    fresh = torch.arange(16 * 9, dtype=dtype).reshape(16, 9)  # a plain one, of another shape (an initializer's, or
    model[0].weight.data = fresh  # transformers' resize_token_embeddings'): laid out as the parameter is (refused)
    assert model[0].weight.placements == (Replicate(),) and torch.equal(model[0].weight.full_tensor(), fresh)


def test_half_precision_scalars_go_to_and_from_the_workers(mesh1):
    """A 0-d bfloat16 tensor could not be turned into bytes, so a scalar argument (`torch.where(mask, x, zero)`,
    `clamp(min=t)`, the masked ops), a distributed scalar and a gradient through clamp failed in bfloat16."""
    x = torch.randn(4, 3, dtype=torch.bfloat16)
    d = dist(x, mesh1, Shard(0)).requires_grad_()
    zero = torch.tensor(0.5, dtype=torch.bfloat16)
    assert torch.equal(torch.where(d > 0, d, zero).full_tensor(), torch.where(x > 0, x, zero))
    d.clamp(min=zero).sum().backward()
    assert torch.equal(d.grad.full_tensor(), (x >= zero).to(torch.bfloat16))
    assert torch.equal(dist(zero, mesh1, Replicate()).full_tensor(), zero)


NORMS = {  # name -> (module, input shape)
    "layer_norm": (lambda: torch.nn.LayerNorm(8), (6, 3, 8)),
    "layer_norm without weight": (lambda: torch.nn.LayerNorm(8, elementwise_affine=False), (6, 3, 8)),
    "batch_norm": (lambda: torch.nn.BatchNorm1d(3), (6, 3, 8)),
    "group_norm": (lambda: torch.nn.GroupNorm(1, 3), (6, 3, 8)),
}


@pytest.mark.parametrize("placement", [Shard(0), Replicate()], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", list(NORMS))
def test_norms_train_in_half_precision_as_torch(mesh1, norm, dtype, placement):
    """A CPU kernel keeps a half-precision norm's statistics (mean, rstd) in the input's dtype where the meta kernel
    says float32; DTorch took the meta kernel's word, and the backward failed on the workers ("expected scalar type
    BFloat16 but found Float"): no bfloat16 model with LayerNorm or BatchNorm trained on a sharded batch."""
    from dtorch.nn import replicate_module

    make, shape = NORMS[norm]
    torch.manual_seed(0)
    ref = make().to(dtype)
    model = replicate_module(copy.deepcopy(ref), mesh1)
    x = torch.randn(shape).to(dtype)
    xr, xd = x.clone().requires_grad_(), dist(x, mesh1, placement).requires_grad_()
    out, want = model(xd), ref(xr)
    want.float().pow(2).sum().backward()
    out.float().pow(2).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out.full_tensor(), want, **tol)
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, **tol)
    for p, r in zip(model.parameters(), ref.parameters()):  # sums over the batch: rounded apart, relative to it
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=tol["rtol"],
                                   atol=tol["atol"] * r.grad.abs().max())


LOSSES = {  # name -> loss(input, float target, class target, class weight), as torch users call them
    "mse": lambda x, t, y, w: F.mse_loss(x, t),
    "smooth_l1": lambda x, t, y, w: F.smooth_l1_loss(x, t, beta=0.5),
    "huber": lambda x, t, y, w: F.huber_loss(x, t),
    "bce": lambda x, t, y, w: F.binary_cross_entropy(torch.sigmoid(x), t),
    "bce_with_logits": lambda x, t, y, w: F.binary_cross_entropy_with_logits(x, t),
    "soft_margin": lambda x, t, y, w: F.soft_margin_loss(x, t * 2 - 1),
    "cross_entropy ignore_index": lambda x, t, y, w: F.cross_entropy(x, y, ignore_index=1),
    "cross_entropy weight": lambda x, t, y, w: F.cross_entropy(x, y, weight=w, label_smoothing=0.1),
}


@pytest.mark.parametrize("rows", [5, 6])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_mean_losses_of_a_sharded_batch_are_the_whole_batchs_mean(mesh1, loss, rows):
    """reduction="mean" over a batch sharded on 2 devices: 5 rows (3 and 2) and 6 rows with ignored targets or class
    weights. torch's rule averaged the shards' means (dtorch._losses): the loss and the input's gradient were off."""
    g = torch.Generator().manual_seed(rows)
    x, t = torch.randn(rows, 4, generator=g), torch.rand(rows, 4, generator=g)
    y, w = torch.randint(0, 4, (rows,), generator=g), torch.rand(4, generator=g)
    dx = dist(x, mesh1, Shard(0)).requires_grad_()
    x.requires_grad_()
    want = LOSSES[loss](x, t, y, w)
    got = LOSSES[loss](dx, dist(t, mesh1, Shard(0)), dist(y, mesh1, Shard(0)), dist(w, mesh1, Replicate()))
    want.backward()
    got.backward()
    torch.testing.assert_close(got.full_tensor(), want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad, rtol=1e-5, atol=1e-6)


EVERY_DIM = {  # reductions over dim=[], which torch reads as every dim
    "sum": lambda a: torch.ops.aten.sum.dim_IntList(a, []),
    "mean": lambda a: torch.ops.aten.mean.dim(a, []),
    "nansum": lambda a: torch.ops.aten.nansum.default(a, []),
    "var": lambda a: torch.ops.aten.var.correction(a, []),
    "std_mean": lambda a: torch.ops.aten.std_mean.correction(a, [])[0],
    "vector_norm": lambda a: torch.ops.aten.linalg_vector_norm.default(a, 2, []),
    "count_nonzero": lambda a: torch.ops.aten.count_nonzero.dim_IntList(a > 0, []),
}


@pytest.mark.parametrize("placement", [Shard(0), Shard(2), Replicate()], ids=str)
def test_reductions_over_an_empty_dim_list_reduce_every_dim(mesh1, placement):
    """torch's rules read dim=[] as no dim (dtorch._reductions): planning crashed with an IndexError on sharded
    tensors, nansum failed on any layout, and `x.amax()`'s gradient was wrong with the last dim sharded."""
    x = torch.randn(5, 6, 4, generator=torch.Generator().manual_seed(0))
    dx = dist(x, mesh1, placement)
    for name, reduce in EVERY_DIM.items():
        want, got = reduce(x), reduce(dx).full_tensor()
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    xr, dxr = x.clone().requires_grad_(), dist(x, mesh1, placement).requires_grad_()
    xr.amax().backward()
    dxr.amax().backward()
    assert torch.equal(dxr.grad.full_tensor(), xr.grad)


@pytest.mark.parametrize("placements", [(Shard(0), Shard(0)), (Shard(0), Replicate()), (Replicate(), Shard(0))],
                         ids=str)
def test_gather_with_an_index_shorter_than_its_input_and_scatter_adds_gradient(mesh1, placements):
    """An index with fewer rows than the input on a dim it does not gather along pairs rows from the top
    (dtorch._gather): torch's rule sharded both alike and paired the shards' rows, giving wrong values and a wrong
    `scatter_add` gradient."""
    gen = torch.Generator().manual_seed(0)
    x, src = torch.randn(10, 5, generator=gen), torch.randn(5, 5, generator=gen)
    index = torch.randint(0, 5, (5, 5), generator=gen)
    dx, dindex = dist(x, mesh1, placements[0]), dist(index, mesh1, placements[1])
    torch.testing.assert_close(dx.gather(1, dindex).full_tensor(), x.gather(1, index))
    xr, srcr = x.clone().requires_grad_(), src.clone().requires_grad_()
    dxr, dsrc = dist(x, mesh1, placements[0]).requires_grad_(), dist(src, mesh1, placements[0]).requires_grad_()
    weight = torch.randn(10, 5, generator=gen)
    (xr.scatter_add(1, index, srcr) * weight).sum().backward()
    (dxr.scatter_add(1, dindex, dsrc) * dist(weight, mesh1, Replicate())).sum().backward()
    torch.testing.assert_close(dsrc.grad.full_tensor(), srcr.grad)
    torch.testing.assert_close(dxr.grad.full_tensor(), xr.grad)


def test_a_fully_sharded_models_state_dict_keeps_the_models_names(mesh1):
    """fully_shard keeps each parameter under its name, as torch's FSDP2 does (it stored them behind a
    parametrization, and state_dict() named them `0.parametrizations.weight.original`): the names and their order are
    the model's, either checkpoint loads into the other, and a CNN step follows torch."""
    import io

    from dtorch.nn import fully_shard

    def cnn():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))

    ref, model = cnn(), fully_shard(cnn(), mesh1)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    for m, xx, yy in ((ref, x, y), (model, dist(x, mesh1, Shard(0)), dist(y, mesh1, Shard(0)))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        F.cross_entropy(m(xx), yy).backward()
        opt.step()
    for (key, want), got in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-6, msg=key)
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    saved.seek(0)
    plain = cnn()
    plain.load_state_dict(torch.load(saved))  # the sharded model's checkpoint into the plain model
    again = fully_shard(cnn(), mesh1)
    again.load_state_dict(plain.state_dict())  # and a plain checkpoint into a sharded model
    for key, want in ref.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], want, rtol=1e-5, atol=1e-6, msg=key)
        torch.testing.assert_close(again.state_dict()[key].full_tensor(), want, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("layout", [Shard(0), Shard(1)], ids=str)
@pytest.mark.parametrize("norm", ["batch_norm_eval", "layer_norm", "group_norm"])
def test_a_norm_layers_weights_get_gradients_when_its_input_needs_none(mesh1, norm, layout):
    """A first layer's input needs no gradient: its backward's output_mask turns the input's gradient off and the
    kernel leaves it undefined, where torch's rule for batch norm still described a tensor, which no worker could
    store ("output 0 is a NoneType"). Such outputs are None in the plan (`_planner._masked_outputs`)."""
    from dtorch.nn import replicate_module

    torch.manual_seed(0)
    ref = {"batch_norm_eval": lambda: torch.nn.BatchNorm1d(4).eval(), "layer_norm": lambda: torch.nn.LayerNorm(4),
           "group_norm": lambda: torch.nn.GroupNorm(2, 4)}[norm]()
    model = replicate_module(copy.deepcopy(ref), mesh1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    ref(x).square().mean().backward()
    model(dist(x, mesh1, layout)).square().mean().backward()
    for p, d in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(d.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-6)


def test_training_resumes_from_a_checkpoint_of_model_and_optimizer(mesh1):
    """torch.save of the model's and the optimizer's state dicts, then a new model and optimizer load them and go on:
    the loaded optimizer state is plain tensors, laid out like their parameters before the next step (factories,
    `_lay_out_loaded_state`); AdamW's update refused to write into them. The result equals an uninterrupted run."""
    import io

    from dtorch.nn import replicate_module

    def linear():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(4)]
    ref = linear()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for x, y in batches:
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def train(model, opt, part):
        for x, y in part:
            F.cross_entropy(model(dist(x, mesh1, Shard(0))), dist(y, mesh1, Shard(0))).backward()
            opt.step()
            opt.zero_grad()

    model = replicate_module(linear(), mesh1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt, batches[:2])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed = replicate_module(linear(), mesh1)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    resumed_opt.load_state_dict(checkpoint["opt"])
    train(resumed, resumed_opt, batches[2:])
    for p, d in zip(ref.parameters(), resumed.parameters()):
        torch.testing.assert_close(d.full_tensor(), p.detach(), rtol=1e-5, atol=1e-6)


def test_random_in_place_op_is_written_back_into_x_and_its_base(mesh4):
    """Random in-place ops draw into a fresh copy that is copied into x; draws of one value are not random."""
    base = dist(torch.zeros(4, 6), mesh4, Shard(0))
    row = base[:, 2]
    assert row.uniform_(3.0, 3.0) is row
    assert_same(row, torch.full((4,), 3.0))
    want = torch.zeros(4, 6)
    want[:, 2] = 3.0
    assert_same(base, want)
    base.bernoulli_(1.0)
    assert_same(base, torch.ones(4, 6))


def test_mlp_forward_matches_torch(mesh4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    inp = torch.randn(12, 16)
    expected = model(inp)
    w1, b1 = dist(model[0].weight.detach(), mesh4, Shard(0)), dist(model[0].bias.detach(), mesh4, Shard(0))
    w2, b2 = dist(model[2].weight.detach(), mesh4, Shard(1)), dist(model[2].bias.detach(), mesh4, Replicate())
    x = dist(inp, mesh4, Replicate())
    out = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    assert_same(out, expected.detach(), exact=False)


def test_a_cuda_mesh_runs_and_trains_from_a_client_without_cuda():
    """The client needs no GPU for a "cuda" mesh: a DTensor's `.device` is the client's CPU (torch's autograd engine
    aborted the client here on a "cuda" one), the mesh says where the shards live. This is test_gpu's `ops`
    scenario, on a CPU worker, in a process and cluster of its own."""
    info = run_scenario("_gpu_run.py", "ops", env={"DTORCH_LOCAL_DEVICE": "cpu"}, timeout=240)
    assert (info["device"], info["mesh"], info["device_types"]) == ("cpu", "cuda", ["cpu"]), info
    for key in ("matmul", "softmax", "sum", "gather", "train"):
        assert info[key] < 1e-5, info



def test_a_transformer_encoders_inference_with_a_padding_mask_takes_the_padded_path(mesh1):
    """In eval mode under no_grad, nn.TransformerEncoder packs a padded batch into a nested tensor, which a DTensor
    cannot hold ("NestedTensorImpl doesn't support sizes"). DTorch answers its left-alignment check with False, so
    the encoder takes its padded path: torch's values wherever the mask keeps a position."""
    from dtorch.nn import replicate_module

    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                          2).eval()
    dencoder = replicate_module(copy.deepcopy(encoder), mesh1)
    x, pad = torch.randn(4, 7, 8), torch.zeros(4, 7, dtype=torch.bool)
    pad[0, 5:] = pad[2, 6:] = True
    with torch.no_grad():
        want = encoder(x, src_key_padding_mask=pad)
        got = dencoder(dist(x, mesh1, Shard(0)), src_key_padding_mask=dist(pad, mesh1, Shard(0))).full_tensor()
    torch.testing.assert_close(got[~pad], want[~pad])
    unchecked = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1,
                                            mask_check=False).eval()
    replicate_module(unchecked, mesh1)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
        unchecked(dist(x, mesh1, Shard(0)), src_key_padding_mask=dist(pad, mesh1, Shard(0)))


def test_a_packed_sequence_of_a_dtensor_batch_trains_a_recurrent_model_as_torch(mesh1):
    """`pack_padded_sequence` of a DTensor batch gave DTensor batch sizes, which torch's RNN kernels read in the
    user's process ("data is not allocated yet"). The batch sizes stay plain (dtorch._sequences), and a
    bidirectional GRU over unsorted lengths trains as in torch, padded back by `pad_packed_sequence`."""
    from dtorch.nn import replicate_module

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(8, 6, num_layers=2, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(12, 3)

        def forward(self, x, lengths):
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, last = self.rnn(packed)
            out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
            return self.head(out), last

    torch.manual_seed(0)
    ref = Tagger()
    model = replicate_module(copy.deepcopy(ref), mesh1)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    g, lengths = torch.Generator().manual_seed(1), torch.tensor([3, 7, 2, 5])
    for _ in range(2):
        x = torch.randn(4, 7, 8, generator=g)
        want, want_last = ref(x, lengths)
        (want.pow(2).mean() + want_last.sum()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got, got_last = model(dist(x, mesh1, Shard(0)), lengths)
        (got.pow(2).mean() + got_last.sum()).backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(got.full_tensor(), want)
        torch.testing.assert_close(got_last.full_tensor(), want_last)
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.full_tensor(), want)


def test_an_op_across_meshes_writes_its_out_tensor_where_it_lives(cluster):
    """Ops across meshes run where their first DTensor lives, the others moved there; an out= tensor on another mesh
    was moved too, and the result went into the copy. An op that writes runs on the written tensor's mesh."""
    stage0, stage1 = dtorch.DeviceMesh("cpu", [0]), dtorch.DeviceMesh("cpu", [1])
    a, b = dist(torch.ones(3), stage0, Replicate()), dist(torch.full((3,), 2.0), stage0, Replicate())
    out = dist(torch.zeros(3), stage1, Replicate())
    torch.add(a, b, out=out)
    assert out.device_mesh == stage1 and out.full_tensor().tolist() == [3.0, 3.0, 3.0]


def test_an_op_between_a_mesh_and_a_named_slice_of_it_runs_on_the_whole_mesh(cluster, mesh2d):
    """A DTensor on `mesh["tp"]` (a ported SPMD program's) meeting one on the whole mesh: the op ran on the slice,
    the other operand replicated onto it (a model's weight gathered whole at each use). It now runs on the whole
    mesh, the slice's operand keeping its placement on "tp" and replicated over "dp"."""
    from dtorch_protocol import messages as m

    x, w = torch.randn(8, 6), torch.randn(8, 6)
    on_slice = dist(x, mesh2d["tp"], Shard(0))
    whole = dist(w, mesh2d, Replicate(), Shard(0))
    sent: list = []
    with tap(cluster, sent):
        got = on_slice * whole
    assert got.device_mesh == mesh2d and got.placements == (Replicate(), Shard(0))
    torch.testing.assert_close(got.full_tensor(), x * w)
    (move,) = [i for i in sent if isinstance(i, m.InstrRedistribute)]
    assert move.src_spec.placements == ["S0"] and move.dst_spec.placements == ["R", "S0"]


@pytest.mark.parametrize("layout", ["classes", "rows_and_classes"])
def test_cross_entropy_over_sharded_classes_reduces_rows_not_logits(cluster, mesh4, mesh2d, layout):
    """A vocabulary-parallel head's logits (classes sharded): log-softmax and nll_loss reduce one maximum, one sum
    and one picked value per row (dtorch._softmax, _losses rule 4), where torch's rules gathered the logits whole
    on every device; values and gradients are torch's for every reduction, class weights, label smoothing and
    ignored targets."""
    from dtorch_protocol import messages as m

    mesh, x_at, y_at = {"classes": (mesh4, [Shard(1)], [Replicate()]),
                        "rows_and_classes": (mesh2d, [Shard(0), Shard(1)], [Shard(0), Replicate()])}[layout]
    replicated = [Replicate()] * mesh.ndim
    g = torch.Generator().manual_seed(0)
    for reduction, weighted, smoothing in [("mean", False, 0.0), ("sum", True, 0.0), ("none", True, 0.1),
                                           ("mean", True, 0.1)]:
        x, y = torch.randn(8, 11, generator=g) * 3, torch.randint(0, 11, (8,), generator=g)
        y[1] = -100
        weight = torch.rand(11, generator=g) if weighted else None
        xr, dx = x.clone().requires_grad_(), dist(x, mesh, *x_at).requires_grad_()
        want = F.cross_entropy(xr, y, weight=weight, reduction=reduction, label_smoothing=smoothing)
        sent, eager_emit = [], cluster.emit
        cluster.emit = lambda item, sent=sent, eager_emit=eager_emit: (sent.append(item), eager_emit(item))[1]
        try:
            got = F.cross_entropy(dx, dist(y, mesh, *y_at), reduction=reduction, label_smoothing=smoothing,
                                  weight=None if weight is None else dist(weight, mesh, *replicated))
            upstream = torch.randn(want.shape, generator=g)
            (got * dist(upstream, mesh, *replicated)).sum().backward()
        finally:
            cluster.emit = eager_emit
        (want * upstream).sum().backward()
        torch.testing.assert_close(got.full_tensor(), want)
        torch.testing.assert_close(dx.grad.full_tensor(), xr.grad)
        # what communicates is a value per row at most (Replicate -> Shard is a local slice: the class indices)
        talks = [(i.src_spec.shape, i.src_spec.placements) for i in sent if isinstance(i, m.InstrRedistribute) and
                 any(a not in ("R", b) for a, b in zip(i.src_spec.placements, i.dst_spec.placements))]
        assert talks and all(math.prod(shape) <= 8 for shape, _ in talks), talks


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Shard(2)], ids=str)
def test_attention_with_a_mask_of_any_rank_on_every_layout(mesh1, placement):
    """A mask's dims align with the query's from the right, so a 2-d mask is query rows x keys; with the query
    rows sharded (context parallelism) such a mask was given whole to each device's rows ("The expanded size of the
    tensor (3) must match the existing size (6)"). Each mask is now sharded like the query where it has that dim."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(3))
    masks = [torch.rand(6, 6, generator=gen) > 0.3, torch.randn(4, 6, 6, generator=gen),
             torch.randn(2, 1, 6, 6, generator=gen), torch.rand(2, 1, 1, 6, generator=gen) > 0.2]
    for mask in masks:
        if mask.dtype == torch.bool:
            mask[..., 0] = True  # every row attends somewhere
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*inputs, attn_mask=mask)
        want.pow(2).sum().backward()
        dinputs = [dist(t, mesh1, placement).requires_grad_() for t in (q, k, v)]
        got = F.scaled_dot_product_attention(*dinputs, attn_mask=dist(mask, mesh1, Replicate()))
        got.pow(2).sum().backward()
        torch.testing.assert_close(got.full_tensor(), want, msg=str(mask.shape))
        for d, t in zip(dinputs, inputs):
            torch.testing.assert_close(d.grad.full_tensor(), t.grad, msg=str(mask.shape))


@pytest.mark.parametrize("layout", ["vocab", "batch_and_vocab"])
def test_a_vocabulary_parallel_embedding_never_gathers_its_table(cluster, mesh4, mesh2d, layout):
    """`RowwiseParallel` on an `nn.Embedding` (Megatron's vocabulary-parallel embedding: the table's rows sharded):
    the whole table was gathered on every device at every forward (torch's rule answers with a private placement).
    Each device now looks up the indices in its own rows (_embedding rule 1) and the output is reduced once; the
    table's gradient, computed whole on every device before, is computed by each device for its rows (rule 3);
    values and gradients are torch's, uneven shards and padding_idx included."""
    from dtorch_protocol import messages as m

    mesh, at = {"vocab": (mesh4, [Shard(0)]), "batch_and_vocab": (mesh2d, [Replicate(), Shard(0)])}[layout]
    ids_at = [Replicate()] if layout == "vocab" else [Shard(0), Replicate()]
    g = torch.Generator().manual_seed(0)
    ref = torch.nn.Embedding(10, 6, padding_idx=3)  # 10 rows over 4 devices: 3, 3, 3, 1
    ids = torch.randint(0, 10, (4, 5), generator=g)
    ids[0, :4] = torch.tensor([0, 9, 3, 5])
    table = dist(ref.weight.detach(), mesh, *at).requires_grad_()
    sent, backward_sent = [], []
    with tap(cluster, sent):
        got = F.embedding(dist(ids, mesh, *ids_at), table, padding_idx=3)
    want = ref(ids)
    upstream = torch.randn(want.shape, generator=g)
    (want * upstream).sum().backward()
    dupstream = dist(upstream, mesh, *[Replicate()] * mesh.ndim)
    with tap(cluster, backward_sent):
        (got * dupstream).sum().backward()
    assert got.placements[-1] == Partial()
    torch.testing.assert_close(got.full_tensor(), want)
    torch.testing.assert_close(table.grad.full_tensor(), ref.weight.grad)
    assert not [i for i in sent if isinstance(i, m.InstrRedistribute)]  # the table stays where it is
    # each device computes its own rows of the table's gradient (rule 3), none the whole table's to keep a part
    assert table.grad.placements[-1] == Shard(0)
    assert not [i for i in backward_sent if isinstance(i, m.InstrRedistribute) and list(i.src_spec.shape) == [10, 6]]


ALONG_SHARDS = {  # name -> op on logits [rows, vocab] (and labels [rows, 1]) along the vocabulary, as users write it
    "argmax": lambda x, y: x.argmax(-1), "argmin": lambda x, y: x.argmin(1, keepdim=True),
    "max": lambda x, y: x.max(-1), "min": lambda x, y: x.min(1), "logsumexp": lambda x, y: x.logsumexp(-1),
    "logsumexp keepdim": lambda x, y: torch.logsumexp(x, [1], keepdim=True),
    "label log-probabilities": lambda x, y: F.log_softmax(x, -1).gather(-1, y).squeeze(-1),
    "argmax of integers": lambda x, y: (x > 0).long().argmax(-1),  # (a classifier's pooling: ties everywhere)
    "min of integers": lambda x, y: (x * 4).nan_to_num(0.0).clamp(-50, 50).int().min(1),
    "cumsum": lambda x, y: x.nan_to_num(0.0, 9.0, -9.0).cumsum(-1),
    "cumsum of a mask": lambda x, y: (x > 0).cumsum(1) - 1,  # (position ids from a sequence-sharded mask)
}


@pytest.mark.parametrize("op", ALONG_SHARDS)
def test_ops_along_a_sharded_vocabulary_move_only_their_output(cluster, mesh4, mesh2d, op):
    """argmax / max / logsumexp / gather along the vocabulary of vocabulary-parallel logits (greedy decoding, the
    labels' log-probabilities of every RL and DPO loss) gathered the whole logits on every device. Each device now
    works on its part and a few reductions of the output's size combine them (_arg_reductions, _softmax rule 3,
    _gather rule 2, _scans): torch's values and first-occurrence indices, with ties across devices, NaN, and
    infinities, on uneven shards (10 over 4 devices) and 2-d meshes; the gradient of the gathered log-probabilities
    is torch's."""
    from dtorch_protocol import messages as m

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 10, generator=g)
    x[1, 2] = x[1, 8] = 9.0  # a tie across devices: the first one counts
    x[2, 9], x[2, 1] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4, 5] = float("inf")
    x[5, 0] = x[5, 4] = -7.0
    labels = torch.randint(0, 10, (6, 1), generator=g)
    for mesh, at, width in [(mesh4, [Shard(1)], 10), (mesh2d, [Shard(0), Shard(1)], 10),
                            (mesh2d, [Shard(1), Shard(1)], 10), (mesh4, [Shard(1)], 5)]:  # 5: 2, 2, 1, 0
        want = ALONG_SHARDS[op](x[:, :width], labels % width)
        dx = dist(x[:, :width].contiguous(), mesh, *at)
        sent: list = []
        with tap(cluster, sent):
            got = ALONG_SHARDS[op](dx, dist(labels % width, mesh, *[Replicate()] * mesh.ndim))
        for w, d in zip(*((want, got) if isinstance(want, tuple) else ((want,), (got,)))):
            torch.testing.assert_close(d.full_tensor(), w, equal_nan=True, msg=f"{op} {at}")
        moved = [i for i in sent if isinstance(i, m.InstrRedistribute) and list(i.src_spec.shape) == [6, width]]
        assert bool(moved) == (width == 5)  # (an empty shard has no part to work on: torch's rule gathers)
    if op == "label log-probabilities":  # its backward: the log-softmax's output is not gathered either
        w = x.nan_to_num(0.0, 5.0, -5.0).requires_grad_()
        ALONG_SHARDS[op](w, labels).sum().backward()
        dw = dist(w.detach(), mesh4, Shard(1)).requires_grad_()
        loss = ALONG_SHARDS[op](dw, dist(labels, mesh4, Replicate())).sum()
        sent = []
        with tap(cluster, sent):
            loss.backward()
        torch.testing.assert_close(dw.grad.full_tensor(), w.grad)
        assert not [i for i in sent if isinstance(i, m.InstrRedistribute) and i.src_spec.placements == ["S1"]]
        # nor is anything of the logits' size made whole on every device: the gradient's zeros and the scatter
        # into them are each device's part (_gather rules 3-4; they were replicated, twice the logits per device)
        made = {i.op: i.outs[0].spec.placements for i in sent
                if isinstance(i, m.InstrCall) and i.op in ("aten.new_zeros.default", "aten.scatter_add.default")}
        assert made == {"aten.new_zeros.default": ["S1"], "aten.scatter_add.default": ["S1"]}


@pytest.mark.parametrize("layout", ["vocab", "batch_and_vocab"])
def test_scatter_add_into_a_sharded_dim_adds_on_the_devices_holding_the_rows(cluster, mesh4, mesh2d, layout):
    """`scatter_add` along a dim the target is sharded on (the gradient of gathered log-probabilities, a histogram
    over a sharded vocabulary): torch's rule gathered the target; each device now adds the sources whose indices
    fall in its rows (_gather rule 3). Repeated indices, uneven shards (10 over 4), a 2-d mesh."""
    from dtorch_protocol import messages as m

    mesh, at = {"vocab": (mesh4, [Shard(1)]), "batch_and_vocab": (mesh2d, [Shard(0), Shard(1)])}[layout]
    g = torch.Generator().manual_seed(3)
    target, src = torch.randn(6, 10, generator=g), torch.randn(6, 4, generator=g)
    index = torch.randint(0, 10, (6, 4), generator=g)
    index[0] = torch.tensor([9, 9, 0, 0])
    want = target.scatter_add(1, index, src)
    replicated = [Replicate()] * mesh.ndim
    sent: list = []
    with tap(cluster, sent):
        got = dist(target, mesh, *at).scatter_add(1, dist(index, mesh, *replicated), dist(src, mesh, *replicated))
    torch.testing.assert_close(got.full_tensor(), want)
    assert got.placements == tuple(at)
    assert not [i for i in sent if isinstance(i, m.InstrRedistribute) and i.src_spec.shape == [6, 10]]


@pytest.mark.parametrize("scan", ["cumsum", "cumprod", "logcumsumexp"])
def test_a_scan_over_a_sharded_dim_written_negative_is_torchs(mesh4, scan):
    """`x.cumsum(-1)` of a tensor sharded on its last dim ran on each shard alone (torch's rule compares the scan's
    dim, -1, with the placements' non-negative dims, and kept the shards; torch's DTensor too): wrong values from the
    second shard on. Even and uneven shards, one of them empty (5 over 4 devices: 2, 2, 1, 0)."""
    for width in (8, 10, 5):
        x = torch.linspace(0.5, 1.5, 3 * width).view(3, width)
        want = getattr(x, scan)(-1)
        assert_same(getattr(dist(x, mesh4, Shard(1)), scan)(-1), want, exact=False)
        assert_same(getattr(dist(x.t().contiguous(), mesh4, Shard(0)), scan)(-2), want.t(), exact=False)


@pytest.mark.parametrize("kv_heads,stays", [(2, True), (1, False)], ids=["even", "uneven"])
def test_grouped_query_attention_stays_sharded_on_heads(mesh1, kv_heads, stays):
    """Grouped-query attention (`enable_gqa`, transformers' SDPA path for Llama 3, Mistral, Qwen: fewer key/value
    heads than query heads) with the heads sharded ran replicated: the rule refused head counts that differ, so every
    device gathered q, k and v and computed the whole attention, and q/k/v projections' gradients came back whole.
    Where the key/value heads split evenly, each device holds the ones its query heads read and the heads stay
    sharded; where they do not (one kv head on two devices), it still computes right, replicated."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen)
    k, v = (torch.randn(2, kv_heads, 6, 8, generator=gen) for _ in range(2))
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True)
    want.pow(2).sum().backward()
    dinputs = [dist(t, mesh1, Shard(1)).requires_grad_() for t in (q, k, v)]
    got = F.scaled_dot_product_attention(*dinputs, is_causal=True, enable_gqa=True)
    assert (got.placements == (Shard(1),)) == stays
    got.pow(2).sum().backward()
    torch.testing.assert_close(got.full_tensor(), want)
    for d, t in zip(dinputs, inputs):
        torch.testing.assert_close(d.grad.full_tensor(), t.grad)


def test_ops_run_under_the_clients_default_dtype(mesh1):
    """`torch.set_default_dtype(torch.float64)`: an op on integers that makes floats gives float64 values, as torch's,
    also where the op was planned before the change and in a compiled step recorded before it. The workers ran
    such ops under their own default: float32 values labelled float64, and the next op mixing them failed on the
    worker ("expected m1 and m2 to have the same dtype, but got: float != double")."""
    ints = torch.arange(12).reshape(3, 4)
    x = dtorch.distribute_tensor(ints, mesh1, [Shard(0)])
    step = dtorch.compile(lambda x: (x * 0.1).sqrt())

    def check() -> None:
        assert torch.equal((x / 3).full_tensor(), ints / 3)  # the bits of torch's under this default
        assert torch.equal(x.sqrt().full_tensor(), ints.sqrt())
        for _ in range(3):  # eager, recorded, replayed
            got = step(x)
            assert got.dtype == torch.get_default_dtype() and torch.equal(got.full_tensor(), (ints * 0.1).sqrt())
        ones = torch.ones(4, 2)
        assert torch.equal(((x / 3) @ dtorch.distribute_tensor(ones, mesh1, [Replicate()])).full_tensor(),
                          (ints / 3) @ ones)

    before = torch.get_default_dtype()
    try:
        check()  # float32: planned and recorded under it
        torch.set_default_dtype(torch.float64)
        check()
    finally:
        torch.set_default_dtype(before)
    check()


def test_backward_with_a_plain_gradient_gives_dtensor_gradients(mesh1):
    """`y.backward(gradient=plain)`: the plain gradient is laid out as y is, as an op lays out the plain tensors it
    mixes in; the leaf's gradient was a plain tensor (whatever the leaf's layout)."""
    full, weights = torch.randn(4, 3), torch.randn(4, 3)
    ref = full.clone().requires_grad_()
    (ref * 3).backward(gradient=weights)
    x = dtorch.distribute_tensor(full, mesh1, [Shard(0)]).requires_grad_()
    (x * 3).backward(gradient=weights)
    assert isinstance(x.grad, dtorch.DTensor) and x.grad.placements == (Shard(0),)
    assert torch.equal(x.grad.full_tensor(), ref.grad)


def test_a_plain_parameter_mixed_with_dtensors_is_pointed_out_once(mesh1):
    """A module left plain (never laid out, or put in after: transformers' resize_token_embeddings replaces the
    output layer) computes right, uploads its parameters at each use, and its optimizer then fails at the step
    ("would write into the plain torch.Tensor 'self'"), far from the cause: the first use now warns, once, at the
    user's line."""
    import warnings

    linear = torch.nn.Linear(4, 3)
    x = dist(torch.randn(6, 4), mesh1, Shard(0))
    with pytest.warns(UserWarning, match=r"a plain nn.Parameter of shape \[3\] takes part in an op on DTensors") as got:
        out = linear(x)
    assert got[0].filename == __file__
    torch.testing.assert_close(out.full_tensor(), linear(x.full_tensor()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear(x)  # once per parameter


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Replicate()], ids=str)
def test_pin_memory_of_a_dtensor_keeps_its_values_and_counts_as_pinned(mesh4, placement):
    """A DTensor's shards live on the workers: nothing of it is in the client's memory to pin (dtorch._pinned).
    `pin_memory()` was refused ("NYI: aten._pin_memory"); `is_pinned()` fetched the whole tensor to answer False.
    Now it counts as pinned, as torch's `t.pin_memory()` is: `pin_memory()` returns it as torch returns a pinned
    tensor, and torch's `_pin_memory` (always a copy) gives the same values and layout, all without a sync point."""
    full = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    x = dist(full, mesh4, placement)
    reads = dict(x._session.reads)
    assert x.is_pinned() is True
    pinned = x.pin_memory()
    copied = torch.ops.aten._pin_memory.default(x)
    assert x._session.reads == reads  # nothing fetched
    assert pinned is x and pinned.is_pinned()
    assert isinstance(copied, dtorch.DTensor) and copied is not x and copied.is_pinned()
    assert copied.placements == x.placements and copied.device_mesh == x.device_mesh
    assert_same(pinned, full)
    assert_same(copied, full)
