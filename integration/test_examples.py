"""Every example runs as `python3 examples/NAME.py` on its own embedded cluster, at small size."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ENV = {k: v for k, v in os.environ.items() if k != "DTORCH_CONTROLLER"}


def run(name: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                         timeout=300, env=ENV, cwd=EXAMPLES.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_tensor_parallel_llama_inference_matches_torch():
    assert run("tp_llama_inference.py", "--new-tokens", "4").strip().endswith("identical")


@pytest.mark.parametrize("graph", [(), ("--graph",)], ids=["eager", "graph"])
def test_dp_tp_training_losses_match_torch(graph):
    out = run("dp_tp_training.py", "--steps", "5" if graph else "4", *graph)
    lines = [line.split() for line in out.splitlines() if line.startswith("step")]
    assert len(lines) == (5 if graph else 4)
    for fields in lines:
        assert abs(float(fields[4]) - float(fields[6])) < 1e-5, fields
    if graph:  # 1 warm-up, 2 recorded, 3 verified, 4-5 without their Python
        assert out.strip().endswith("2 of 5 steps ran as a graph")


def test_rl_role_handoff_generates_with_the_trained_weights():
    out = run("rl_role_handoff.py")
    assert "DeviceMesh('cpu', [4, 5])" in out and out.strip().endswith("matches plain torch")


def test_moe_expert_parallel_matches_torch_with_one_ep_th_of_the_experts_per_worker():
    out = run("moe_expert_parallel.py", "--steps", "2", "--new-tokens", "2")
    assert "greedy tokens identical" in out
    (line,) = [line for line in out.splitlines() if line.startswith("expert weight bytes per worker")]
    held, total = line.split(": ", 1)[1].rsplit(" of ", 1)
    assert set(eval_dict(held).values()) == {int(total.split()[0]) // 2}  # EP=2: one device per worker
    for fields in [line.split() for line in out.splitlines() if line.startswith("step")]:
        assert abs(float(fields[4]) - float(fields[6])) < 1e-5 and abs(float(fields[9]) - float(fields[11])) < 1e-5


def test_diffusion_sequence_parallel_matches_torch():
    out = run("diffusion_sequence_parallel.py", "--model", "flux", "--plan", "sp", "--steps", "1")
    (line,) = [line for line in out.splitlines() if line.startswith("flux sp")]
    assert float(line.rsplit(" ", 1)[1]) < 1e-5, line


def eval_dict(text: str) -> dict[str, int]:
    """{'w0': 1, 'w1': 2} as printed, without eval."""
    return {k.strip(" '{"): int(v.strip(" }")) for k, v in (item.split(":") for item in text.split(","))}
