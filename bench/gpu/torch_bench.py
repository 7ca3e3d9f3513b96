#!/usr/bin/env python3
"""PyTorch + transformers baseline for bench/gpu/gpu_bench.cc.

Loads the same synthetic checkpoint (config.json + model.safetensors written
by make_synthetic_checkpoint) into transformers' LlamaForCausalLM in bf16
with SDPA attention, and measures, on the same GPU as gpu_bench:
  * full prefill time per prompt length (logits for the last row only, like
    the engine; median of --reps after a warm-up);
  * greedy decode tokens/s after each prefill (KV cache, one token per step);
  * with --batch_sizes, `generate` over a static batch of B random prompts
    of --batch_prompt_tokens tokens, --batch_new_tokens new tokens each
    (greedy, EOS ignored): output tokens/s of the whole batch (the anchor
    of tools/gpu/run_stack_bench.sh's concurrent-streams table).
Prompts are random token ids from --seed, like gpu_bench (not the same ids;
speed does not depend on them).

  python3 bench/gpu/torch_bench.py --model DIR [--prompt_lens 4096,...]
      [--decode_tokens 32] [--reps 3] [--batch_sizes 1,16,64,128]
      [--batch_prompt_tokens 256] [--batch_new_tokens 128] [--json_out FILE]
"""

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt_lens", default="4096,8192,16384,32768")
    p.add_argument("--decode_tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_sizes", default="",
                   help="static-batch generate at these batch sizes")
    p.add_argument("--batch_prompt_tokens", type=int, default=256)
    p.add_argument("--batch_new_tokens", type=int, default=128)
    p.add_argument("--json_out", default="")
    args = p.parse_args()

    import torch
    import transformers
    from transformers import LlamaForCausalLM

    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    t0 = time.time()
    kwargs = dict(attn_implementation="sdpa")
    try:
        model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 **kwargs)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = LlamaForCausalLM.from_pretrained(
            args.model, torch_dtype=torch.bfloat16, **kwargs)
    model = model.to(dev).eval()
    load_s = time.time() - t0
    cfg = model.config
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; loaded {args.model} in "
          f"{load_s:.1f} s ({cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size})")

    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def forward(ids, cache=None):
        try:
            return model(input_ids=ids, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        except TypeError:  # older transformers
            return model(input_ids=ids, past_key_values=cache, use_cache=True,
                         num_logits_to_keep=1)

    def sync_time(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t, out

    rows = []
    with torch.inference_mode():
        warm = torch.randint(0, cfg.vocab_size, (1, 512), generator=gen).to(dev)
        forward(warm)
        for n in [int(x) for x in args.prompt_lens.split(",") if x]:
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=gen).to(dev)
            times = []
            out = None
            for _ in range(max(1, args.reps)):
                out = None
                torch.cuda.empty_cache()
                t, out = sync_time(lambda: forward(ids))
                times.append(t)
            prefill_s = statistics.median(times)
            cache = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.decode_tokens):
                o = forward(tok, cache)
                cache = o.past_key_values
                tok = o.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            decode_s = (time.perf_counter() - t) / args.decode_tokens
            del out, cache
            row = {"prompt_len": n, "full_prefill_s": prefill_s,
                   "decode_tok_s": 1.0 / decode_s}
            rows.append(row)
            print(f"prompt {n:6d}: full prefill {prefill_s:.4f} s, "
                  f"decode {1.0 / decode_s:.1f} tok/s")

        batch_rows = []
        batches = [int(x) for x in args.batch_sizes.split(",") if x]
        if batches:
            print("| batch | output tok/s | x batch 1 |")
            print("|---|---|---|")
        first = None
        for b in batches:
            ids = torch.randint(3, cfg.vocab_size, (b, args.batch_prompt_tokens),
                                generator=gen).to(dev)
            mask = torch.ones_like(ids)
            kwargs = dict(attention_mask=mask, do_sample=False,
                          max_new_tokens=args.batch_new_tokens,
                          min_new_tokens=args.batch_new_tokens,
                          pad_token_id=0)
            model.generate(ids[:, :8], attention_mask=mask[:, :8],
                           do_sample=False, max_new_tokens=2,
                           pad_token_id=0)  # warm-up at this batch
            t, out = sync_time(lambda: model.generate(ids, **kwargs))
            new = int(out.shape[1] - ids.shape[1]) * b
            rate = new / t
            first = first or rate
            batch_rows.append({"batch": b, "output_tok_s": rate,
                               "secs": t})
            print(f"| {b} | {rate:.1f} | {rate / first:.1f}x |", flush=True)
            del out
            torch.cuda.empty_cache()

    result = {"device": torch.cuda.get_device_name(0),
              "torch": torch.__version__,
              "transformers": transformers.__version__,
              "attn_implementation": "sdpa", "dtype": "bfloat16",
              "model": args.model, "load_s": load_s,
              "command": " ".join(sys.argv), "rows": rows,
              "batch_rows": batch_rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
