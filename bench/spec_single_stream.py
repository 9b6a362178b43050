"""Single-stream decode tok/s with and without n-gram speculation on one copy-heavy chat prompt
(rewrite a code snippet renaming a variable), greedy, 256 tokens at most. A quick check of the
speculative path; bench/speculative.py and docs/BENCHMARKS.md have the full comparison.

    python bench/spec_single_stream.py BUILD      # a paged build with a tokenizer (smollm2-135m)
"""
import json
import sys

from kvexport import LLM
from kvexport.runtime.sampling_params import SamplingParams

build = sys.argv[1]
CODE = '''def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["amount"]
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}


def report(records, out):
    summary = summarize(records)
    out.write("total: %d\\n" % summary["total"])
    out.write("count: %d\\n" % summary["count"])
    out.write("average: %.2f\\n" % summary["average"])
'''
PROMPT = [{"role": "user", "content": "Rewrite this Python code, renaming the variable `total` to `acc`. "
           "Output only the code.\n\n```python\n" + CODE + "```"}]
res = {}
for mode, k in (("none", 0), ("ngram", 4), ("ngram", 8), ("none", 0)):
    kw = dict(speculative=mode, num_speculative_tokens=k) if mode != "none" else {}
    llm = LLM(build, kv_cache_memory="256MiB", threads=2, **kw)
    params = SamplingParams(max_tokens=256, temperature=0.0)
    o = llm.generate([PROMPT], params, chat=True)[0]
    n = len(o.token_ids)
    dec = (n - 1) / (o.finish_time - o.first_token_time)
    st = llm.engine.spec_stats()
    key = f"{mode}-k{k}"
    res.setdefault(key, []).append(round(dec, 2))
    print(key, n, "decode tok/s", round(dec, 2), st.to_json() if st else "", flush=True)
    if mode == "none":
        ref = o.token_ids
    else:
        print("identical to greedy:", o.token_ids == ref)
print(json.dumps(res))
print(o.text[:400])
