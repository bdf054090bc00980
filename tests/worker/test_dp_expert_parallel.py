"""DP attention + EP MoE: data-parallel engine cores whose workers form one expert-parallel
group and step together (an idle core runs dummy steps so the MoE collectives meet)."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tokenmill.distributed.device_communicator import ALL2ALL_BACKENDS, DeviceCommunicator
from tokenmill.distributed.parallel_state import (
    destroy_distributed_environment,
    init_distributed_environment,
)
from tokenmill.worker.multiproc_executor import get_open_port
from worker.test_pipeline_parallel import moe_layer


def _core_rank(core: int, port: int, out: str) -> None:
    """Core 0 runs the layer on 1, 7 and 16 tokens; core 1 on none (dummy steps), then on
    5 tokens while core 0 runs 16 (unequal counts)."""
    torch.set_num_threads(1)
    results = {}
    for backend in ALL2ALL_BACKENDS:
        init_distributed_environment(
            "gloo", f"tcp://127.0.0.1:{port}", 0, 1, 1, DeviceCommunicator, torch.device("cpu"),
            backend, expert_parallel_cores=2, core_index=core,
        )
        layer, inputs = moe_layer(expert_parallel=True)
        got = []
        for x, logits in inputs:
            if core == 0:
                got.append(layer(x, logits))
            else:
                layer.dummy_forward(torch.float32, torch.device("cpu"))
        x, logits = inputs[-1]
        got.append(layer(x, logits) if core == 0 else layer(x[:5], logits[:5]))
        results[backend] = got
        destroy_distributed_environment()
        port += 1
    torch.save(results, f"{out}.{core}")


def test_moe_across_two_cores_with_one_idle_then_unequal_token_counts(tmp_path):
    """Two engine cores of one rank each, 4 of 8 experts each: the busy core's MoE output
    equals one process's while the idle core runs dummy steps, and both cores' outputs do
    when they bring 16 and 5 tokens, with every all-to-all backend."""
    layer, inputs = moe_layer(expert_parallel=False)
    expected = [layer(x, logits) for x, logits in inputs]
    out = str(tmp_path / "ep")
    mp.spawn(_core_rank, args=(get_open_port(), out), nprocs=2)
    results = [torch.load(f"{out}.{core}") for core in (0, 1)]
    for backend in ALL2ALL_BACKENDS:
        busy, idle = results[0][backend], results[1][backend]
        for got, want in zip(busy, expected + [expected[-1]]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=backend)
        assert len(idle) == 1
        torch.testing.assert_close(idle[0], expected[-1][:5], rtol=1e-5, atol=1e-5, msg=backend)
