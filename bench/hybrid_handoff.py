"""The disaggregated prefill -> decode hand-off of a gated DeltaNet hybrid (issue 34 §3): what moves and
what it saves. Two engines of one build in one process (no Dynamo, no NIXL: the bytes are handed over in
memory, as `--kv-transfer request-plane` does over the wire): a "prefill" engine runs the prompt with
max_tokens 1 and offers its blocks (runtime/serving/dynamo_disagg.py `offer_blocks`: the KV blocks and the
recurrent state after the last one, io.STATE_GROUP); a "decode" engine imports them and generates. Per
prompt length: the bytes offered (KV, state), the export and import times, and the decode engine's time
to its first token with the hand-off against computing the prompt itself; the tokens must be equal.

    .venv/bin/python bench/hybrid_handoff.py BUILD [--prompts 256,512,1000] [--threads 1] [--json OUT]

BUILD: a hybrid build (bench/hybrid_decode.py's build_one makes a Qwen3.5-0.8B-shaped one).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _first_token_s(engine, prompt, params) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    rid = engine.add_request(list(prompt), params)
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None and engine.output(rid).token_ids:
            first = time.perf_counter() - t0
    return first, list(engine.pop_output(rid).token_ids)


def one(build: str, n: int, threads: int, vocab: int) -> dict:
    from kvexport import io
    from kvexport.runtime.config import EngineConfig
    from kvexport.runtime.engine import LLMEngine
    from kvexport.runtime.sampling_params import SamplingParams
    from kvexport.runtime.serving import dynamo_disagg as dd

    cfg = EngineConfig(kv_cache_memory="256MiB", threads=threads, max_num_seqs=2)
    prompt = np.random.default_rng(n).integers(3, vocab, size=n).tolist()
    gen = SamplingParams(max_tokens=4, ignore_eos=True)
    prefill, decode, alone = (LLMEngine(build, cfg) for _ in range(3))
    _first_token_s(prefill, prompt, SamplingParams(max_tokens=1))
    kv = prefill.kv_connector
    t = time.perf_counter()
    entries, payload = dd.offer_blocks(kv, kv.prompt_blocks(prompt, None))
    export_s = time.perf_counter() - t
    by_group = {}
    for g, *_ in entries:
        by_group[g] = by_group.get(g, 0) + kv.block_bytes[g]
    dkv = decode.kv_connector
    t = time.perf_counter()
    want = dd.wanted(dkv.prompt_blocks(prompt, None), entries)
    data = np.concatenate([payload[off:off + dkv.block_bytes[g]] for g, _, _, off in want])
    holds = dkv.import_blocks(dd.to_load(want, want, prompt, dkv.block_size, dkv.block_bytes), data)
    import_s = time.perf_counter() - t
    ttft_handed, toks = _first_token_s(decode, prompt, gen)
    dkv.release(holds)
    ttft_alone, ref = _first_token_s(alone, prompt, gen)
    return {"prompt_tokens": n, "kv_bytes": by_group.get(io.FULL_GROUP, 0),
            "state_bytes": by_group.get(io.STATE_GROUP, 0),
            "export_ms": round(1e3 * export_s, 2), "import_ms": round(1e3 * import_s, 2),
            "decode_ttft_handed_over_s": round(ttft_handed, 4), "decode_ttft_recomputed_s": round(ttft_alone, 4),
            "tokens_equal": toks == ref}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--prompts", default="256,512,1000")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    from kvexport import manifest as mf
    from pathlib import Path

    vocab = mf.load(Path(a.build)).model.vocab_size
    rows = [one(a.build, int(n), a.threads, vocab) for n in a.prompts.split(",")]
    for r in rows:
        print(r)
    if a.json:
        Path(a.json).write_text(json.dumps({"bench": "hybrid_handoff", "date": time.strftime("%Y-%m-%d %H:%M"),
                                            "build": a.build, "threads": a.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
