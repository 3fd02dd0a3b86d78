#!/usr/bin/env bash
# Session 15, call 4 (carry .box/box.sh, .box/gg_a): build this commit and park the SmolLM2 GGUF's first half in
# /tmp for call 5 on the same warm machine (the GGUF and the wheels do not fit one call's 64 MiB carry).
set -uo pipefail
bash .box/box.sh build && cp .box/gg_a/part /tmp/gguf_a && ls -la /tmp/gguf_a
