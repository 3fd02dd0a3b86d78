#!/usr/bin/env bash
# H200 box, 2026-12-03, torch 2.11.0+cu130, transformers 5.17: the whole test suite (GPU tests and the CPU ones,
# tensor-parallel tests included) at commit e20b8ad.
# Result (test.log): 478 passed, 9 skipped (SmolLM2 GGUF not on the box; 2-GPU tests), 1 failed:
# test_hf.py::test_num_return_sequences_repeats_the_prompts_before_the_prefill, a sampled exact tie (fixed after).
export ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1 OMP_NUM_THREADS=2
timeout 570 bash .box/box.sh test --maxfail=1000 -n 6 -rfE
