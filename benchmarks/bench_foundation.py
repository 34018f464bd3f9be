"""Foundation figures, measured side by side in one run (printed, never asserted).

(a) user-thread time per op of a 10,000-iteration loop of a shape-(1,) add on a 2-device mesh,
    against the same loop in plain torch;
(b) end-to-end time (values back on the client) of a 4-layer 1024x1024 MLP forward, batch 64,
    on one worker and tensor-parallel on two workers, against plain torch;
(c) a 1 GiB tensor uploaded with distribute_tensor and fetched back with to_torch (chunked transfers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard


def per_op_loop(iters: int) -> tuple[float, float, float]:
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    x = dtorch.zeros(1, device_mesh=mesh, placements=[Replicate()])
    one = dtorch.ones(1, device_mesh=mesh, placements=[Replicate()])
    y = x + one
    y.to_torch()  # warm: mesh placed, plan cached
    t0 = time.perf_counter()
    y = x
    for _ in range(iters):
        y = y + one
    issued = time.perf_counter() - t0
    assert y.to_torch().item() == iters
    total = time.perf_counter() - t0
    a, b = torch.zeros(1), torch.ones(1)
    t0 = time.perf_counter()
    for _ in range(iters):
        a = a + b
    plain = time.perf_counter() - t0
    return issued / iters * 1e6, total / iters * 1e6, plain / iters * 1e6


def mlp_weights(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1024, 1024, generator=g) / 32, torch.randn(1024, generator=g) / 32) for _ in range(4)]


def plain_mlp(weights, inp) -> torch.Tensor:
    h = inp
    for i, (w, b) in enumerate(weights):
        h = F.linear(h, w, b)
        if i < 3:
            h = F.relu(h)
    return h


def timed(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def dtorch_mlp(weights, inp, mesh: dtorch.DeviceMesh, tensor_parallel: bool):
    """Megatron-style TP: column-parallel then row-parallel pairs; without TP everything is replicated."""
    layers = []
    for i, (w, b) in enumerate(weights):
        if not tensor_parallel:
            layers.append((dtorch.distribute_tensor(w, mesh, [Replicate()]),
                           dtorch.distribute_tensor(b, mesh, [Replicate()])))
        elif i % 2 == 0:
            layers.append((dtorch.distribute_tensor(w, mesh, [Shard(0)]),
                           dtorch.distribute_tensor(b, mesh, [Shard(0)])))
        else:
            layers.append((dtorch.distribute_tensor(w, mesh, [Shard(1)]),
                           dtorch.distribute_tensor(b, mesh, [Replicate()])))
    x = dtorch.distribute_tensor(inp, mesh, [Replicate()])

    def forward() -> torch.Tensor:
        return plain_mlp(layers, x).to_torch()

    return forward


def one_gib_round_trip() -> tuple[float, float]:
    mesh = dtorch.DeviceMesh("cpu", [0, 1])
    big = torch.rand(1 << 28)  # 2**28 float32 = 1 GiB
    t0 = time.perf_counter()
    x = dtorch.distribute_tensor(big, mesh, [Shard(0)])
    y = x.redistribute(placements=[Replicate()])  # worker to worker: each pulls the other half
    y._session.sync()
    up = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = y.to_torch()
    down = time.perf_counter() - t0
    assert torch.equal(back, big)
    return up, down


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-big", dest="big", action="store_false", help="skip the 1 GiB transfer")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    weights, inp = mlp_weights(), torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
    expected = plain_mlp(weights, inp)
    plain_ms = timed(lambda: plain_mlp(weights, inp), args.repeats)

    dtorch.connect(workers=1)
    one = dtorch_mlp(weights, inp, dtorch.DeviceMesh("cpu", [0]), tensor_parallel=False)
    torch.testing.assert_close(one(), expected, rtol=1e-4, atol=1e-4)
    one_ms = timed(one, args.repeats)
    dtorch.shutdown()

    # 1 GiB copies keep a 2-core machine so busy that a worker can miss the default 1 s heartbeat deadline
    os.environ.setdefault("DTORCH_HEARTBEAT_TIMEOUT", "10")
    dtorch.connect(workers=2)
    issued_us, total_us, plain_us = per_op_loop(args.iters)
    tp = dtorch_mlp(weights, inp, dtorch.DeviceMesh("cpu", [0, 1]), tensor_parallel=True)
    torch.testing.assert_close(tp(), expected, rtol=1e-4, atol=1e-4)
    tp_ms = timed(tp, args.repeats)
    up_s, down_s = one_gib_round_trip() if args.big else (float("nan"), float("nan"))
    dtorch.shutdown()

    print(f"\nDTorch foundation benchmark (torch {torch.__version__}, {threads} client threads)")
    print(f"(a) shape-(1,) add, {args.iters} iterations, 2-device mesh")
    print(f"    dtorch user thread per op   {issued_us:8.2f} us   (target <= 15 us)")
    print(f"    dtorch incl. execution      {total_us:8.2f} us")
    print(f"    plain torch per op          {plain_us:8.2f} us")
    print("(b) 4-layer 1024x1024 MLP forward, batch 64, values back on the client (median)")
    print(f"    plain torch                 {plain_ms:8.2f} ms")
    print(f"    dtorch, 1 worker            {one_ms:8.2f} ms   ({one_ms / plain_ms:.2f}x plain; target <= 1.2x)")
    print(f"    dtorch, TP on 2 workers     {tp_ms:8.2f} ms   ({tp_ms / plain_ms:.2f}x plain)")
    print("(c) 1 GiB tensor, Shard(0) on 2 workers")
    print(f"    upload + all-gather         {up_s:8.2f} s")
    print(f"    to_torch                    {down_s:8.2f} s")


if __name__ == "__main__":
    main()
