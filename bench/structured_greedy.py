"""The test suite's 53 held-out JSON schemas at greedy with no penalty (issue 48 §2: a small model's loops are where
runaway output shows): how many outputs are valid JSON that validates, and the finish reason of the others.

    .venv/bin/python bench/structured_greedy.py BUILD [--max-tokens 200]
"""

import argparse
import json
import time
from pathlib import Path

import jsonschema

from kvexport import SamplingParams
from kvexport.runtime.config import EngineConfig
from kvexport.runtime.engine import LLMEngine
from kvexport.runtime.sampling_params import StructuredOutputs

HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "runtime" / "serving" / "schemas" / "heldout.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    schemas = json.loads(HELDOUT.read_text())
    engine = LLMEngine(args.build, EngineConfig(max_num_seqs=64, kv_cache_memory="256MiB", max_num_batched_tokens=1024))

    def chat(text: str) -> list[int]:
        return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False))

    rids = [engine.add_request(chat(f"Give a short example of a {s['name'].replace('_', ' ')} as JSON matching this "
                                    f"schema: {json.dumps(s['schema'])}"),
                               SamplingParams(max_tokens=args.max_tokens, structured=StructuredOutputs(json=s["schema"])))
            for s in schemas]
    t0 = time.time()
    while engine.has_unfinished():
        engine.step()
    bad = []
    for s, rid in zip(schemas, rids):
        out = engine.pop_output(rid)
        try:
            jsonschema.validate(json.loads(out.text), s["schema"])
        except Exception:  # noqa: BLE001 - counted and shown
            bad.append({"name": s["name"], "finish_reason": out.finish_reason, "tail": out.text[-80:]})
    engine.close()
    print(json.dumps({"valid": len(schemas) - len(bad), "of": len(schemas), "seconds": round(time.time() - t0, 1),
                      "max_tokens": args.max_tokens, "invalid": bad}, indent=1))


if __name__ == "__main__":
    main()
