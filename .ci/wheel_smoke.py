"""A built wheel, installed into a fresh virtual environment, works without the source tree: run from outside it.

    python .ci/wheel_smoke.py WHEEL SOURCE_DIR     # with the fresh environment's python, cwd outside SOURCE_DIR

Checks that the wheel holds every .py file under SOURCE_DIR/torch_zipkv, that torch_zipkv comes from that
environment's site-packages (not the source tree), that torch_zipkv, torch_zipkv.engine and
torch_zipkv.integrations.transformers import, and that a compress / decompress round trip is bit-exact and a decode
matches a float64 reference on CPU. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import pathlib
import sys
import zipfile


def fail(message: str) -> None:
    raise SystemExit(f"wheel smoke test: {message}")


def main(wheel: str, source: str) -> None:
    src = pathlib.Path(source).resolve()
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    wanted = {p.relative_to(src).as_posix() for p in (src / "torch_zipkv").rglob("*.py")}
    missing = sorted(wanted - shipped)
    if missing:
        fail(f"{wheel} lacks {missing}")

    import torch

    import torch_zipkv
    import torch_zipkv.engine  # noqa: F401
    import torch_zipkv.integrations.transformers  # noqa: F401

    where = pathlib.Path(torch_zipkv.__file__).resolve()
    if where.parent == src / "torch_zipkv" or "site-packages" not in where.parts:
        fail(f"torch_zipkv was imported from {where}, not from the installed wheel's site-packages")

    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(8, 2, 16, 2, 64, generator=gen).to(torch.bfloat16)
    ckv = torch_zipkv.compress(kv)
    if not torch.equal(torch_zipkv.decompress(ckv).view(torch.int16), kv.view(torch.int16)):
        fail("the round trip is not bit-exact")
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16)
    indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    indices = torch.tensor([5, 0, 7, 1, 2, 3, 4, 6], dtype=torch.int32)
    last = torch.tensor([9, 16], dtype=torch.int32)
    out = torch_zipkv.paged_decode(q, ckv, indptr, indices, last).double()
    for b in range(2):  # float64 reference: each row's tokens, GQA group 4
        pages = indices[indptr[b]: indptr[b + 1]].long()
        k, v = (kv[pages, i].reshape(-1, 2, 64)[: (len(pages) - 1) * 16 + int(last[b])].double() for i in (0, 1))
        qb = q[b].double().view(2, 4, 64)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qb, k) / 8.0, -1)
        ref = torch.einsum("hgt,thd->hgd", p, v).reshape(8, 64)
        err = (out[b] - ref).abs().max().item()
        if err > 2e-2:
            fail(f"decode row {b} is {err:.3g} from the float64 reference")
    print(f"wheel smoke test: {len(wanted)} modules shipped; torch_zipkv {where.parent}; round trip and decode OK")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
