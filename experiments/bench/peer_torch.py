"""The transformers + torch side of `experiments.bench.peer`, run in an environment that has torch and transformers
(this repository's own does not): it imports neither jax nor this repository, so it runs from any Python.

    /path/to/torch-env/bin/python experiments/bench/peer_torch.py --checkpoint DIR --tokens FILE.npy \
        [--threads 2] [--repeats 5] [--warmup 2] [--attention sdpa] [--compile] [--fused] [--generate N]

Loads the Hugging Face checkpoint in DIR (`AutoModelForCausalLM.from_pretrained`, float32, `--attention`:
transformers' default "sdpa" or "eager"), reads the token batch [B, T + 1] (int32 .npy) and times, each as the
median of `--repeats` calls after `--warmup`:
  forward       the logits of tokens[:, :-1] and their mean cross-entropy against tokens[:, 1:], no autograd
  forward_backward  the same with autograd and loss.backward()
  step          forward_backward, torch.optim.AdamW.step() and zero_grad(set_to_none=True)
with `torch.set_num_threads(--threads)`. `--compile`: the loss (the model's forward and the cross-entropy) is
`torch.compile`d (inductor, its default mode; its backward compiles with it); `--fused`: `AdamW(fused=True)`, one
kernel for the whole update. Prints one JSON object: the medians in seconds, every call's seconds, the loss of the
first forward (so the caller can check both sides compute the same model), the versions, and the allocator the
process runs on ("jemalloc" or "tcmalloc" when preloaded, else "glibc", read from its own memory map: a preload that
did not take is seen).

With `--generate N`, instead: greedy `model.generate` of exactly N new tokens (no end token) for the prompts in
`--tokens` ([B, P], every row a prompt of P tokens, no padding), in eval mode under `torch.inference_mode()`, its
default cache (float32 keys and values, the model's dtype); the JSON holds the median seconds of `--repeats` calls
after `--warmup` and the generated ids [B, N]. `--compile` and `--fused` are refused with `--generate` (generating
under torch.compile needs transformers' static cache, another program than its default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint directory")
    parser.add_argument("--tokens", required=True, help="an int32 .npy of token ids [B, T + 1]")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (>= 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (>= 0)")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa", help="transformers' attention")
    parser.add_argument("--compile", action="store_true", help="torch.compile the loss (training only)")
    parser.add_argument("--fused", action="store_true", help="AdamW(fused=True) (training only)")
    parser.add_argument("--generate", type=int, default=0, help="new tokens of greedy generation (0: time training)")
    args = parser.parse_args(argv)
    for name in ("compile", "fused"):
        if args.generate and getattr(args, name):
            parser.error(f"--{name} with --generate = {args.generate}: --{name} applies to training only")
    for name in ("threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} = {getattr(args, name)}: must be >= 1")
    for name in ("warmup", "generate"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} = {getattr(args, name)}: must be >= 0")

    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.checkpoint, dtype=torch.float32, attn_implementation=args.attention
    )
    tokens = torch.from_numpy(np.load(args.tokens).astype(np.int64))
    setup = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version},
        "threads": torch.get_num_threads(),
        "allocator": allocator(),
        "attention": model.config._attn_implementation,
    }
    if args.generate:
        print(json.dumps({**generate(model, tokens, args), **setup}))
        return
    model.train()
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=args.fused or None
    )

    def uncompiled_loss():
        logits = model(input_ids=inputs, use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    loss = torch.compile(uncompiled_loss) if args.compile else uncompiled_loss

    def forward():
        with torch.no_grad():
            return float(loss())

    def forward_backward():
        value = loss()
        value.backward()
        model.zero_grad(set_to_none=True)

    def step():
        value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    first_loss = forward()
    result: dict = {"loss": first_loss, "seconds": {}, "calls": {}}
    for name, fn in (("forward", forward), ("forward_backward", forward_backward), ("step", step)):
        calls, _ = timed(fn, args)
        result["seconds"][name], result["calls"][name] = statistics.median(calls), calls
    print(json.dumps({**result, **setup}))


def generate(model, prompts, args) -> dict:
    """Greedy generation of exactly `args.generate` tokens per prompt: {"seconds": median, "calls", "ids"}."""
    import torch

    model.eval()
    mask = torch.ones_like(prompts)
    n = args.generate

    def call():
        with torch.inference_mode():
            return model.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )

    calls, out = timed(call, args)
    return {"seconds": statistics.median(calls), "calls": calls, "ids": out[:, prompts.shape[1] :].tolist()}


def allocator() -> str:
    """ "jemalloc" or "tcmalloc" when such a library is mapped into this process (LD_PRELOAD), else "glibc"."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return next((name for name in ("jemalloc", "tcmalloc") if f"lib{name}" in maps), "glibc")


def timed(fn, args) -> tuple[list[float], Any]:
    """(the seconds of `args.repeats` calls of fn after `args.warmup` untimed ones, the last call's result)."""
    for _ in range(args.warmup):
        fn()
    calls, out = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = fn()
        calls.append(time.perf_counter() - start)
    return calls, out


if __name__ == "__main__":
    main()
