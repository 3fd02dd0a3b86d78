"""The serving engine under tensor parallelism on 2 GPUs: NCCL, and decode steps captured as CUDA Graphs with the
model's all-reduces inside. The same worker and checks as test_engine_tp.py (which runs them on CPU with gloo);
skipped without 2 GPUs."""

from __future__ import annotations


import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

import test_engine_tp as cpu  # noqa: E402
from test_tp import launch_2_ranks, save_model  # noqa: E402

SCENARIOS = ["staggered", "follower"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_tp_cuda")
    models, out = root / "models", root / "out"
    out.mkdir()
    save_model(models / "llama", 3)
    cpu.choose_prompts(models)
    return models, out, launch_2_ranks("engine_tp_worker.py", models, out, *SCENARIOS, gpus="0,1")


reference = cpu.reference  # the CPU reference: every choice leads by > 2%, more than a GPU's different rounding moves
test_staggered_arrivals_and_chunked_prefill_give_the_single_process_tokens = \
    cpu.test_staggered_arrivals_and_chunked_prefill_give_the_single_process_tokens
test_each_rank_holds_and_compresses_its_own_kv_heads = cpu.test_each_rank_holds_and_compresses_its_own_kv_heads
test_requests_and_aborts_from_rank_0_reach_every_rank = cpu.test_requests_and_aborts_from_rank_0_reach_every_rank


def test_decode_steps_ran_as_cuda_graphs(run):
    for rec in cpu.scenario(run, "staggered"):
        assert rec["cuda_graphs"] > 0
