"""Errors: one clear line, raised at the next sync point, naming the op and the user's source line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtorch
from dtorch import Replicate, Shard
from dtorch.errors import RemoteOpError
from dtorch.nn import ColwiseParallel, RowwiseParallel, parallelize_module
from dtorch_protocol import messages as m
from dtorch_protocol import wire


def test_worker_op_error_surfaces_at_next_sync_with_source_line(mesh1):
    x = dtorch.distribute_tensor(torch.randn(4, 4), mesh1, [Replicate()])
    idx = dtorch.distribute_tensor(torch.tensor([0, 9]), mesh1, [Replicate()])  # 9 is out of range
    bad = torch.index_select(x, 0, idx)  # noqa: F841  (the failing line)
    line = sys._getframe().f_lineno - 1
    ok = x + 1  # later ops are still accepted without blocking
    with pytest.raises(RemoteOpError) as info:
        ok.to_torch()
    message = str(info.value)
    assert "aten.index_select" in message
    assert f"test_errors.py:{line}" in message and "index_select(x, 0, idx)" in message
    assert "\n" not in message
    # the session keeps working after the error was reported
    assert torch.equal((x * 0).to_torch(), torch.zeros(4, 4))


def test_synchronize_waits_for_the_ops_issued_and_raises_their_error(mesh1):
    x = dtorch.distribute_tensor(torch.randn(4, 4), mesh1, [Replicate()])
    dtorch.synchronize()  # nothing failed: returns
    idx = dtorch.distribute_tensor(torch.tensor([0, 9]), mesh1, [Replicate()])
    bad = torch.index_select(x, 0, idx)  # noqa: F841  (the failing line)
    line = sys._getframe().f_lineno - 1
    with pytest.raises(RemoteOpError, match=rf"aten.index_select.*test_errors.py:{line}"):
        dtorch.synchronize()  # no value read: the error comes all the same
    dtorch.synchronize()  # told once
    assert torch.equal((x * 0).to_torch(), torch.zeros(4, 4))


OUT_OF_RANGE = {  # name -> (what torch raises, a lookup into a [10, 3] table by 3 indices (or labels))
    # an embedding whose table's rows are sharded (vocabulary-parallel, _embedding rule 1)
    "embedding": ("index out of range in self", lambda t, i, y: F.embedding(i, t)),
    # gather and scatter_add along a sharded dim (_gather rules 2 and 3)
    "gather": ("out of bounds", lambda t, i, y: t.gather(0, i[:, None].expand(-1, 3).contiguous())),
    "scatter_add": ("out of bounds", lambda t, i, y: t.scatter_add(0, i[:, None].expand(-1, 3).contiguous(),
                                                                   t[:3] * 0 + 1)),
    # cross_entropy (nll_loss) of class-sharded logits (_losses rule 4); ignore_index -100 stays allowed
    "cross_entropy": ("out of bounds", lambda t, i, y: F.cross_entropy(t.T, y)),
}


@pytest.mark.parametrize("op", OUT_OF_RANGE)
def test_an_index_outside_a_sharded_dim_fails_as_in_torch_and_never_reads_zeros(mesh4, op):
    """A lookup whose rows (or classes) are sharded masks each device's indices to its own rows; an index outside
    every device's rows (a label above the vocabulary, a tokenizer that does not match its table) read zeros and
    the program went on with a wrong value, where torch raises. It now fails at the next sync, naming the op, the
    expected range and the user's line, on every layout these rules serve; the session goes on."""
    message, lookup = OUT_OF_RANGE[op]
    table = torch.randn(10, 3)
    good, labels = torch.tensor([0, 9, 4]), torch.tensor([1, -100, 2])
    for bad, bad_labels in [(torch.tensor([0, 10, 4]), torch.tensor([1, 10, 2])),
                            (torch.tensor([0, -1, 4]), torch.tensor([1, -5, 2]))]:
        with pytest.raises(Exception, match=message):
            lookup(table, bad, bad_labels)  # torch
        d = [dtorch.distribute_tensor(t, mesh4, [p]) for t, p in
             [(table, Shard(0)), (bad, Replicate()), (bad_labels, Replicate())]]
        got = lookup(*d)
        with pytest.raises(RemoteOpError, match=rf"{message}.*expected each in \[0, 10\)") as info:
            got.full_tensor()
        # the user's line is the lookup's (the lambda's, here)
        assert f"test_errors.py:{lookup.__code__.co_firstlineno} " in str(info.value)
        assert "\n" not in str(info.value)
    want = lookup(table, good, labels)
    d = [dtorch.distribute_tensor(t, mesh4, [p]) for t, p in [(table, Shard(0)), (good, Replicate()),
                                                               (labels, Replicate())]]
    torch.testing.assert_close(lookup(*d).full_tensor(), want)


def test_an_index_outside_a_vocabulary_parallel_table_fails_in_a_graph_step_too(mesh4):
    """A compiled step replays its recorded commands, the index check among them: the call with a bad id fails at
    its sync, and the next call goes on."""
    torch.manual_seed(0)
    plain = torch.randn(10, 3)
    table = dtorch.distribute_tensor(plain, mesh4, [Shard(0)])
    step = dtorch.compile(lambda ids: F.embedding(ids, table).sum(), mode="graph")
    for ids in ([1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [0, 1]):
        got = step(dtorch.distribute_tensor(torch.tensor(ids), mesh4, [Replicate()]))
        if 10 in ids:
            with pytest.raises(RemoteOpError, match=r"index out of range in self.*expected each in \[0, 10\)"):
                got.item()
        else:
            torch.testing.assert_close(got.item(), F.embedding(torch.tensor(ids), plain).sum().item())
    assert step.replays >= 3  # the bad call was a replay, not a Python run


def test_bad_placements_and_meshes_are_one_line_errors(mesh1):
    with pytest.raises(ValueError, match="placements for a 1-d mesh"):
        dtorch.zeros(4, device_mesh=mesh1, placements=[Shard(0), Shard(0)])
    with pytest.raises(ValueError, match="out of range"):
        dtorch.zeros(4, device_mesh=mesh1, placements=[Shard(1)])
    with pytest.raises(ValueError, match="distinct"):
        dtorch.DeviceMesh("cpu", [0, 0])
    with pytest.raises(ValueError, match="device_type"):
        dtorch.DeviceMesh("tpu", [0])
    with pytest.raises(ValueError, match="needs device_mesh"):
        dtorch.zeros(4)
    with pytest.raises(ValueError, match="reduce_op"):
        dtorch.Partial("prod")


def test_to_local_is_refused_in_one_line_pointing_at_to_torch(mesh1):
    x = dtorch.distribute_tensor(torch.arange(4.0), mesh1, [Shard(0)])
    with pytest.raises(dtorch.DTorchError, match=r"to_local\(\): the client holds no shard.*\.to_torch\(\)") as info:
        x.to_local()  # torch's DTensor gives its rank's shard; here the code runs once
    assert "\n" not in str(info.value)


def test_a_tensor_parallel_module_under_torch_func_grad_is_refused_in_one_line(mesh1):
    """torch.func.grad wraps the module's outputs; a parallel style's hook took the wrapper for a plain tensor and
    uploaded it, which failed in the sender thread with "Cannot access data pointer". The error now says what to do.
    Replicated modules, with no hooks, take torch.func.grad."""
    from dtorch.nn import ColwiseParallel, parallelize_module, replicate_module

    x = dtorch.distribute_tensor(torch.randn(5, 4), mesh1, [Replicate()])
    plain = replicate_module(torch.nn.Linear(4, 2), mesh1)
    grads = torch.func.grad(lambda p: torch.func.functional_call(plain, p, (x,)).sum())(
        {k: v.detach() for k, v in plain.named_parameters()})
    torch.testing.assert_close(grads["bias"].full_tensor(), torch.full((2,), 5.0))
    tp = parallelize_module(torch.nn.Linear(4, 2), mesh1, ColwiseParallel(output_layouts=Replicate()))
    with pytest.raises(NotImplementedError, match="torch.func transform .* loss.backward"):
        torch.func.grad(lambda p: torch.func.functional_call(tp, p, (x,)).sum())(
            {k: v.detach() for k, v in tp.named_parameters()})


def test_a_mesh_placed_on_workers_of_another_device_type_says_so(cluster):
    mesh = dtorch.DeviceMesh("cuda", [0, 1])  # the test cluster's workers are CPU ones
    with pytest.warns(RuntimeWarning, match=r"DeviceMesh\('cuda', \[0, 1\]\) was placed on cpu workers") as info:
        x = dtorch.distribute_tensor(torch.ones(4), mesh, [Shard(0)])  # it ran on the CPU workers, silently
    assert len(info) == 1 and "\n" not in str(info[0].message)
    assert info[0].filename == __file__  # it points at the user's line, not into dtorch
    assert torch.equal((x * 2).to_torch(), torch.full((4,), 2.0))  # and runs there (a GPU script tried on CPUs)


def test_mixing_meshes_moves_to_the_first_operands_mesh(mesh1, mesh4):
    a = dtorch.arange(4, device_mesh=mesh1, placements=[Shard(0)])
    b = dtorch.ones(4, device_mesh=mesh4, dtype=torch.int64, placements=[Shard(0)])
    c = a + b
    assert c.device_mesh == mesh1
    assert torch.equal(c.to_torch(), torch.arange(4) + 1)


def test_wrong_key_is_refused(cluster):
    stub = wire.Stub("dtorch.Controller", cluster.address, "not-a-key")
    with pytest.raises(PermissionError, match="malformed API key"):
        stub.call("OpenSession", m.OpenSession(hello=wire.hello("client")))
    with pytest.raises(PermissionError):
        dtorch.session.Session(cluster.address, "not-a-key")


def test_protocol_major_mismatch_names_both_versions(cluster):
    stub = wire.Stub("dtorch.Controller", cluster.address, cluster.api_key)
    old = m.Hello(protocol_version="0.9", package_version="0.0.1", role="client")
    with pytest.raises(wire.ProtocolError, match=rf"client speaks 0\.9 \(package 0\.0\.1\).*{m.PROTOCOL_VERSION}"):
        stub.call("OpenSession", m.OpenSession(hello=old))
    major, minor = m.PROTOCOL_VERSION.split(".")
    older_minor = m.Hello(protocol_version=f"{major}.0", package_version="0.0.9", role="client")
    assert stub.call("OpenSession", m.OpenSession(hello=older_minor)).session
    newer_minor = m.Hello(protocol_version=f"{major}.{int(minor) + 1}", package_version="0.9", role="client")
    with pytest.raises(wire.ProtocolError, match="upgrade dtorch-controller"):
        stub.call("OpenSession", m.OpenSession(hello=newer_minor))


def test_unreachable_controller_is_one_line_and_bounded():
    code = "import dtorch; dtorch.connect('127.0.0.1:9')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DTORCH_API_KEY": "x"})
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ConnectionError: cannot reach the DTorch controller at 127.0.0.1:9")


def test_an_op_torch_refuses_raises_at_once_with_torchs_message_the_op_and_the_line(mesh1, monkeypatch, capfd):
    a = dtorch.randn(4, 3, device_mesh=mesh1, placements=[Shard(0)])
    b = dtorch.randn(5, 2, device_mesh=mesh1, placements=[Replicate()])
    a.to_torch()
    capfd.readouterr()
    session = a._session
    monkeypatch.setattr(session, "fetch", lambda *args: pytest.fail("a refused op fetched its inputs"))
    with pytest.raises(RuntimeError) as info:
        a @ b  # the failing line
    line = sys._getframe().f_lineno - 1
    message = str(info.value)
    assert message.startswith(f"aten.mm.default at {__file__}:{line} (`a @ b  # the failing line`): ")
    assert message.endswith("a and b must have same reduction dim, but got [4, 3] X [5, 2].")
    with pytest.raises(IndexError, match="aten.index_select.default at .*test_errors.py"):
        torch.index_select(a, 7, dtorch.zeros(2, device_mesh=mesh1, dtype=torch.long))  # no dim 7
    assert capfd.readouterr().err == ""  # none of torch's internal logging


@pytest.mark.parametrize("case", ["float += complex", "long *= 0.5", "long /= long", "bool += long"])
def test_an_in_place_op_whose_result_type_self_cannot_hold_raises_at_once_and_leaves_self_as_torch_does(mesh1, case):
    """torch's rule for in-place pointwise ops (`_sharding.check_inplace_cast`): meta kernels do not check it, so
    the op failed on the workers at the next sync point, and self was poisoned for good (every later read raised the
    same error); torch raises at the call and leaves self as it was."""
    dtypes = {"float += complex": (torch.float32, torch.complex64), "long *= 0.5": (torch.int64, None),
              "long /= long": (torch.int64, torch.int64), "bool += long": (torch.bool, torch.int64)}[case]
    full = torch.arange(8).reshape(4, 2).to(dtypes[0])
    other = torch.ones(4, 2, dtype=dtypes[1]) if dtypes[1] is not None else 0.5

    def step(t, o):
        return t.div_(o) if case == "long /= long" else t.mul_(o) if case == "long *= 0.5" else t.add_(o)

    with pytest.raises(RuntimeError) as expected:
        step(full.clone(), other)
    x = dtorch.distribute_tensor(full, mesh1, [Shard(0)])
    o = dtorch.distribute_tensor(other, mesh1, [Replicate()]) if isinstance(other, torch.Tensor) else other
    with pytest.raises(RuntimeError) as info:
        step(x, o)
    assert str(info.value).endswith(str(expected.value)) and " at " in str(info.value)
    assert torch.equal(x.to_torch(), full)  # self is as it was, and readable


def test_the_local_route_is_bounded_and_names_the_op_and_the_size(mesh1, monkeypatch):
    x = dtorch.distribute_tensor(torch.tensor([0.0, 1.0, 0.0, 2.0] * 4), mesh1, [Shard(0)])
    assert torch.equal(torch.nonzero(x).to_torch(), torch.nonzero(torch.tensor([0.0, 1.0, 0.0, 2.0] * 4)))
    monkeypatch.setenv("DTORCH_LOCAL_MAX_BYTES", "32")
    with pytest.raises(dtorch.DTorchError, match=r"aten.nonzero.default has output shapes that depend on the "
                                                 r"values.* 64 bytes: above the local-route limit of 32 bytes"):
        torch.nonzero(x)
    with pytest.raises(dtorch.DTorchError, match=r"aten.equal.default returns a Python value.* 128 bytes"):
        torch.equal(x, x * 2)  # both fetched
    monkeypatch.setenv("DTORCH_LOCAL_MAX_BYTES", "64")
    assert torch.nonzero(x).shape == (8, 1)  # at the limit: allowed


def test_a_sparse_gradient_is_refused_at_the_op_in_one_line(mesh1):
    """nn.Embedding(sparse=True) makes a sparse gradient: refused when the backward plans it, naming the layout, not
    an error from a worker at a later sync ("nbytes is not defined for sparse tensors")."""
    from dtorch.nn import replicate_module

    emb = replicate_module(torch.nn.Embedding(10, 4, sparse=True), mesh1)
    out = emb(dtorch.distribute_tensor(torch.tensor([1, 2]), mesh1, [Replicate()])).sum()
    with pytest.raises(NotImplementedError, match=r"returns a torch.sparse_coo tensor; DTensors hold strided tensors "
                                                  r"only \(nn.Embedding: sparse=False\)") as info:
        out.backward()
    assert "\n" not in str(info.value)
    assert torch.equal((emb.weight * 0).to_torch(), torch.zeros(10, 4))  # the session goes on


class _Attention(nn.Module):
    """pytorch/examples' Llama 2 attention, cut down: its heads are the `n_heads` attribute a TP recipe patches."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def test_a_ported_recipes_local_head_count_is_refused_saying_to_keep_the_models_own(mesh1):
    """torch's tensor-parallel recipes (pytorch/examples' fsdp_tp_example) divide each attention's head count by the
    TP size, since each SPMD rank's module sees its local shard; DTorch's modules see global shapes. Ported as
    written, the first view failed with torch's bare "shape '[2, 6, 2, 8]' is invalid for input of size 192"."""
    torch.manual_seed(0)
    model, full = _Attention(16, 4), torch.randn(2, 6, 16)
    expected = model(full)
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
    parallelize_module(model, mesh1, plan)
    x = dtorch.distribute_tensor(full, mesh1, [Replicate()])
    torch.testing.assert_close(model(x).to_torch(), expected)  # the model's own counts: one device's result
    model.n_heads //= mesh1.size()  # the recipe's patch
    with pytest.raises(RuntimeError, match=r"aten.view.default at .*test_errors.py.* is invalid for input of size 192 "
                                           r"\(this shape holds 1/2 of the tensor, .* keep the model's own counts\)$"):
        model(x)


def test_quantized_sparse_and_nested_tensors_are_refused_in_one_line_where_they_would_enter(mesh4):
    """DTensors hold dense tensors of plain dtypes. A quantized dtype got in (a factory, an upload, `.to`, a quantize
    op) and failed on a worker at the next sync point (`zero_` has no QuantizedCPU kernel), or became a DTensor whose
    dtype said float32 for a qint8 shard; printing a quantized DTensor crashed the client. Sparse and nested uploads
    failed with torch's own "Cannot access storage" or "do not have strides"."""
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    refused = {
        "dtorch.zeros asks for quantized dtype torch.qint8; DTensors hold unquantized dtypes only":
            lambda: dtorch.zeros(4, device_mesh=mesh4, placements=[Replicate()], dtype=torch.qint8),
        "distribute_tensor asks for quantized dtype torch.qint8":
            lambda: dtorch.distribute_tensor(q, mesh4, [Replicate()]),
        "from_local asks for quantized dtype torch.qint8": lambda: dtorch.DTensor.from_local(q, mesh4, [Shard(0)]),
        r"distribute_tensor got a torch.sparse_coo tensor; DTensors hold strided tensors \(convert it first: "
        r"\.to_dense\(\)\)": lambda: dtorch.distribute_tensor(torch.eye(4).to_sparse(), mesh4, [Replicate()]),
        "distribute_tensor got a torch.sparse_csr tensor":
            lambda: dtorch.distribute_tensor(torch.eye(4).to_sparse_csr(), mesh4, [Shard(0)]),
        "distribute_tensor got a nested tensor.*to_padded_tensor": lambda: dtorch.distribute_tensor(
            torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), mesh4, [Replicate()]),
    }
    for match, make in refused.items():
        with pytest.raises(NotImplementedError, match=match) as info:
            make()
        assert "\n" not in str(info.value)
    x = dtorch.distribute_tensor(torch.arange(8.0), mesh4, [Shard(0)])
    ops = {"quantize_per_tensor(x, 0.1, 0, torch.qint8)": lambda: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
           "quantize_per_tensor_dynamic(x": lambda: torch.quantize_per_tensor_dynamic(x, torch.quint8, False),
           "x.to(torch.qint8)": lambda: x.to(torch.qint8),
           "empty_like(x, dtype=torch.qint8)": lambda: torch.empty_like(x, dtype=torch.qint8)}
    for src, op in ops.items():
        with pytest.raises(NotImplementedError, match=r"quantized dtype torch\.q?u?int8; DTensors hold") as info:
            op()
        assert "test_errors.py:" in str(info.value) and src in str(info.value) and "\n" not in str(info.value)
    fake = torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)  # float in, float out: runs
    torch.testing.assert_close(fake.full_tensor(), torch.fake_quantize_per_tensor_affine(torch.arange(8.0), 0.1, 0,
                                                                                         -128, 127))
    torch.testing.assert_close(x.full_tensor(), torch.arange(8.0))  # the session goes on
