#!/usr/bin/env bash
# H200, 2026-12-02 (main at 6160e2d): the escape-rebuild streaming probe, kept in history at commit 392ae90.
set -euo pipefail
git show 392ae90:benchmarks/probe_escape_rebuild.cu > /tmp/probe_escape_rebuild.cu
sed -i 's#"../csrc/cuda/block_io.cuh"#"'"$PWD"'/csrc/cuda/block_io.cuh"#' /tmp/probe_escape_rebuild.cu
nvcc -O3 -arch=sm_90a -std=c++20 --expt-relaxed-constexpr -o /tmp/probe /tmp/probe_escape_rebuild.cu
/tmp/probe > probe.json
