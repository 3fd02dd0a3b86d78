"""README.md's Python snippets run as pasted, in order, in one Python process on a CPU; a snippet that cannot (it needs
torchrun, a GPU) says so on its first line ("# needs ...")."""

from __future__ import annotations

import pathlib
import re

import torch

from conftest import require_smollm2

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def check_ops(scope):
    out, kv = scope["out"], scope["kv"]
    assert out.shape == (2, 32, 128) and out.dtype == torch.bfloat16 and out.isfinite().all()
    # request 1 reads pages 0-2 whole: its first head against a plain float64 softmax over those 48 tokens
    k, v = (kv[:3, i].reshape(48, 8, 128)[:, 0].double() for i in (0, 1))
    q = scope["q"][1, 0].double()
    ref = torch.softmax(k @ q / 128 ** 0.5, 0) @ v
    assert (out[1, 0].double() - ref).abs().max() < 2e-2


def check_cache(scope):
    cache = scope["cache"]
    assert scope["out"].shape == (1, 32, 128) and cache.stats()["tokens"] == 32 * (100 + 4)
    assert cache.stats()["ratio"] < 1  # the full pages compressed


def check_transformers(scope):
    out, cache = scope["out"], scope["cache"]
    assert out.shape[0] == 2 and out.shape[1] > len(scope["tok"](scope["prompts"][1]).input_ids)
    assert cache.stats()["tokens"] > 0  # generate ran on the ZipKVCache


def check_engine(scope):
    outs = scope["outs"]
    assert [o.finished for o in outs] == [True, True] and isinstance(outs[0].text, str)
    assert all(1 <= len(o.token_ids) <= 16 for o in outs)


CHECKS = [check_ops, check_cache, check_transformers, check_engine]


def test_readme_snippets_run_as_pasted():
    require_smollm2()  # the transformers and engine snippets load the shipped SmolLM2
    run = [b for b in snippets() if not b.startswith("# needs ")]
    assert len(run) == len(CHECKS), "a snippet was added or removed: give it its check here"
    scope: dict = {}
    for block, check in zip(run, CHECKS):
        exec(compile(block, str(README), "exec"), scope)  # the README's own code, as a reader pastes it
        check(scope)


def test_every_snippet_that_does_not_run_says_why():
    for block in snippets():
        first = block.splitlines()[0]
        if first.startswith("# needs "):
            assert len(first) > len("# needs ") + 5, first
