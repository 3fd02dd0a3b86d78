"""Save a few layers of real SmolLM2 KV cache as a small .pt file to carry to a GPU machine.

The full cache of a 2048-token prefill is ~47 MB and producing it needs transformers and
the GGUF weights; a handful of layers is a few MB and needs only torch to read back:

    data = torch.load(path)   # {"kv", "model", "tokens", "page_size", "layers", "layout"}

``data["kv"]`` has shape ``[len(layers), num_pages, 2, page_size, num_kv_heads, head_dim]``,
bf16, the per-layer layout of ``examples/smollm2.py's real_kv``.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # smollm2.py: real KV

import smollm2 as realkv  # noqa: E402


def _layer_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prefill length (default 2048)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument(
        "--layers", type=_layer_list, default=[0, 7, 15, 29],
        help="comma-separated layer indices to keep (default 0,7,15,29)",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=None,
        help="output file (default smollm2_kv_<tokens>t_p<page-size>_L<layers>.pt in the current directory)",
    )
    args = parser.parse_args()

    try:
        kv = realkv.real_kv(args.tokens, page_size=args.page_size)
    except ValueError as error:
        parser.error(str(error))
    num_layers = kv.shape[0]
    bad = [layer for layer in args.layers if not 0 <= layer < num_layers]
    if bad:
        parser.error(f"layers {bad} out of range: the model has layers 0..{num_layers - 1}")

    out = args.out or pathlib.Path(
        f"smollm2_kv_{args.tokens}t_p{args.page_size}_L{'-'.join(map(str, args.layers))}.pt"
    )
    # Indexing with a list copies, so only the chosen layers' storage is saved, not the
    # whole cache a view would drag along.
    subset = kv[args.layers]
    torch.save(
        {
            "kv": subset,
            "model": realkv.MODEL_NAME,
            "tokens": args.tokens,
            "page_size": args.page_size,
            "layers": args.layers,
            "layout": "[layer, page, K/V, slot, kv_head, head_dim]; token t -> page t // page_size, "
            "slot t % page_size; K post-RoPE",
        },
        out,
    )
    print(
        f"wrote {out}: kv {tuple(subset.shape)} {subset.dtype}, layers {args.layers}, "
        f"{out.stat().st_size / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
