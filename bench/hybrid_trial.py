"""Hostile trial on hybrid state (issue 48): a tiny qwen3_5_text build through the LLM API and the engine;
prints OK or ERR per input (docs/BAD_INPUTS.md "own trial: hybrid state").

    HF_HUB_OFFLINE=1 .venv/bin/python bench/hybrid_trial.py
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from testkit.families import make_hf_folder  # noqa: E402 - the tests' tiny model maker
from kvexport import LLM, SamplingParams
from kvexport.exporter.build import BuildOptions, build

d = Path(tempfile.mkdtemp(prefix="hybtrial-"))
folder = make_hf_folder("qwen3_5_text", d / "hf", vocab_size=49152)
out, _ = build(str(folder), d / "b", BuildOptions(max_seq_len=128, block_size=4, validate=False))
res = []
def t(name, fn):
    try:
        r = fn(); res.append((name, "ok", str(r)[:160])); print("OK  ", name, str(r)[:160], flush=True)
    except Exception as e:
        res.append((name, type(e).__name__, str(e)[:300])); print("ERR ", name, type(e).__name__, str(e)[:300], flush=True)
P = list(range(5, 45))
base = LLM(out, kv_cache_memory="2MiB")
want = base.generate([P], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
t("plain twice (checkpoint hit)", lambda: [(o.token_ids == want, o.num_cached_prompt_tokens) for o in [base.generate([P], SamplingParams(max_tokens=8, ignore_eos=True))[0]]])
t("n=3 greedy", lambda: [o.token_ids == want for o in base.generate([P], SamplingParams(max_tokens=8, n=3, ignore_eos=True))])
t("n=2 sampled seed", lambda: [o.token_ids for o in base.generate([P], SamplingParams(max_tokens=6, n=2, temperature=0.9, seed=3))])
t("prompt_logprobs", lambda: len(base.generate([P], SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs))
t("echo-like max_tokens 0", lambda: base.generate([P], SamplingParams(max_tokens=0, prompt_logprobs=0))[0].finish_reason)
t("speculative ngram engine", lambda: LLM(out, kv_cache_memory="2MiB", speculative="ngram").generate([P], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids == want)
t("eviction snapkv", lambda: LLM(out, kv_cache_memory="2MiB", kv_eviction="snapkv", kv_budget_tokens=32))
t("eviction streaming", lambda: LLM(out, kv_cache_memory="2MiB", kv_eviction="streaming"))
t("checkpoint_blocks 0 twice", lambda: (lambda l: [l.generate([P], SamplingParams(max_tokens=8, ignore_eos=True))[0].num_cached_prompt_tokens for _ in range(2)])(LLM(out, kv_cache_memory="2MiB", state_checkpoint_blocks=0)))
t("checkpoints 0", lambda: (lambda l: [o.token_ids == want for o in l.generate([P, P], SamplingParams(max_tokens=8, ignore_eos=True))])(LLM(out, kv_cache_memory="2MiB", state_checkpoints=0)))
t("checkpoints 1, 4 prompts sharing", lambda: (lambda l: [o.token_ids == want for o in l.generate([P]*4, SamplingParams(max_tokens=8, ignore_eos=True))])(LLM(out, kv_cache_memory="2MiB", state_checkpoints=1)))
t("tiny pool preemption", lambda: (lambda l: [o.token_ids[:8] == want for o in l.generate([P]*6, SamplingParams(max_tokens=8, ignore_eos=True))])(LLM(out, kv_cache_memory="200KiB", max_num_batched_tokens=16)))
t("max_model_len edge prompt 127", lambda: base.generate([list(range(5, 132))], SamplingParams(max_tokens=1))[0].finish_reason)
t("prompt 128 (= context)", lambda: base.generate([list(range(5, 133))], SamplingParams(max_tokens=1))[0].error)
t("kv offload int8 + hybrid", lambda: (lambda l: [ (o.token_ids == want, o.num_cached_prompt_tokens) for o in [l.generate([P], SamplingParams(max_tokens=8, ignore_eos=True))[0] for _ in range(2)]])(LLM(out, kv_cache_memory="2MiB", kv_offload_memory="4MiB", kv_offload_dtype="int8")))
t("lora on hybrid build", lambda: LLM(out, lora_modules="x=/tmp"))
t("structured on hybrid", lambda: base.generate([P], SamplingParams(max_tokens=10, structured=__import__("kvexport").StructuredOutputs(regex="[0-9]{3}")))[0].text)
t("abort mid-prefill", lambda: (lambda e: (e.add_request(list(range(5, 120)), SamplingParams(max_tokens=4), request_id="x"), e.step(), e.abort("x"), e.has_unfinished()))(LLM(out, kv_cache_memory="2MiB", max_num_batched_tokens=16).engine))
t("after abort same prompt", lambda: (lambda l: (l.engine.add_request(P, SamplingParams(max_tokens=4), request_id="y"), l.engine.step(), l.engine.abort("y"), l.generate([P], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids == want))(LLM(out, kv_cache_memory="2MiB", max_num_batched_tokens=16)))
