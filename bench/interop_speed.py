"""Tokens/s of onnxruntime-genai and optimum running a kvexport contiguous build against each
tool's own export of the same model (docs/INTEROP.md, "Speed"). Greedy, batch 1, the same
prompt and number of new tokens for every model, EOS masked until then; the models of one tool
are loaded in one process and timed in turns (A B A B ...), so a busy machine slows all alike.

    # the tools' own exports of the same model, from the GGUF dequantized to fp32 and saved as a
    # Hugging Face folder (main venv; optimum-cli runs in .venv-optimum); under bench/.cache/
    .venv/bin/python bench/interop_speed.py prepare build/smollm2-contig
    # onnxruntime-genai (main venv): our build (its genai_config.json: decoder-pipeline), our
    # build run as a single `decoder` (decode.onnx alone, a config overlay), its builder's export
    .venv/bin/python bench/interop_speed.py genai build/smollm2-contig bench/.cache/interop/ortgenai
    # optimum (.venv-optimum): our decode.onnx, `optimum-cli export onnx` of the same HF folder
    .venv-optimum/bin/python bench/interop_speed.py optimum build/smollm2-contig bench/.cache/interop/optimum

Reports per model: end-to-end tokens/s (new tokens / time of the whole generate call) and
decode tokens/s ((N-1) / (time for N tokens - time for 1 token): the per-token loop without
the prompt), both from median times, and the median over repeats of the tool's own export's time
over this model's in the same repeat (> 1: faster than the tool's export). Prints JSON. The
measuring runs need only the tool (and `tokenizers`), not kvexport.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

PROMPT = ("The old lighthouse keeper climbed the spiral stairs every evening to light the lamp. "
          "One night, as a storm rolled in from the sea, he noticed a small boat struggling against "
          "the waves. Without hesitation, he")


def prompt_ids(build_dir: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(build_dir, "tokenizer.json")).encode(PROMPT).ids


def genai_models(ours: str, theirs: str, threads: int):
    import onnxruntime_genai as og

    def load(path, overlay=None):
        cfg = og.Config(path)
        if threads:
            cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        if overlay:
            cfg.overlay(json.dumps(overlay))
        return og.Model(cfg)

    def run(model, ids, n):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        out = []
        while not gen.is_done():
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        return out

    single = {"model": {"type": _genai_type(ours), "decoder": {"filename": "decode.onnx"}}}
    return {"kvexport (decoder-pipeline)": (load(ours), run),
            "kvexport (decoder, decode.onnx alone)": (load(ours, single), run),
            "onnxruntime-genai builder": (load(theirs), run)}, og.__version__


def _genai_type(build_dir: str) -> str:
    with open(os.path.join(build_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)["model_type"]


def optimum_models(ours: str, theirs: str, threads: int):
    import onnxruntime as ort
    import optimum.version
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
        torch.set_num_threads(threads)

    def run(model, ids, n):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
        return out[0, len(ids):].tolist()

    return {"kvexport decode.onnx": (ORTModelForCausalLM.from_pretrained(ours, file_name="decode.onnx",
                                                                         session_options=so), run),
            "optimum-cli export": (ORTModelForCausalLM.from_pretrained(theirs, session_options=so), run)}, \
        optimum.version.__version__


def prepare(build_dir: str) -> None:
    """The tools' own exports under bench/.cache/interop/: the HF folder (bench/compare_ortgenai.py's
    prepare_hf), onnxruntime-genai's builder (-p fp32 -e cpu), and for optimum a copy of the HF
    folder that transformers 4.57 reads (config.json with rope_theta, the build's tokenizer files)
    exported by `optimum-cli export onnx --task text-generation-with-past` in .venv-optimum."""
    import shutil
    import subprocess
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import compare_ortgenai as c

    c.offline_env()
    cache = Path(__file__).parent / ".cache" / "interop"
    hf = c.prepare_hf(cache / "hf")
    c.build_onnx(hf, cache / "ortgenai", cache / "builder-cache")
    hf4 = cache / "hf-transformers4"
    hf4.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_theta"], cfg["torch_dtype"] = cfg["rope_parameters"]["rope_theta"], "float32"
    (hf4 / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("model.safetensors", "generation_config.json"):
        shutil.copyfile(hf / f, hf4 / f)
    for f in Path(build_dir, "tokenizer").iterdir():
        shutil.copyfile(f, hf4 / f.name)
    cli = Path(__file__).resolve().parents[1] / ".venv-optimum" / "bin" / "optimum-cli"
    cmd = [str(cli), "export", "onnx", "--model", str(hf4), "--task", "text-generation-with-past",
           str(cache / "optimum")]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "prepare":
        prepare(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tool", choices=["genai", "optimum"])
    ap.add_argument("ours", help="a kvexport --layout contiguous build")
    ap.add_argument("theirs", help="the tool's own export of the same model")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0,
                    help="onnxruntime intra-op threads (0: its default, all cores); with 1, CPU seconds "
                         "per token are a fair comparison on a busy machine")
    args = ap.parse_args()
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    ids = prompt_ids(args.ours)
    models, version = (genai_models if args.tool == "genai" else optimum_models)(args.ours, args.theirs, args.threads)
    tokens = {}
    for name, (model, run) in models.items():  # warm-up, and every model must give the same tokens
        tokens[name] = run(model, ids, args.new_tokens)
    times: dict[str, dict[int, list[float]]] = {name: {1: [], args.new_tokens: []} for name in models}
    cpu: dict[str, dict[int, list[float]]] = {name: {1: [], args.new_tokens: []} for name in models}
    for rep in range(args.repeats):
        order = list(models) if rep % 2 == 0 else list(models)[::-1]
        for n in (1, args.new_tokens):
            for name in order:
                model, run = models[name]
                t, c = time.perf_counter(), time.process_time()
                run(model, ids, n)
                times[name][n].append(time.perf_counter() - t)
                cpu[name][n].append(time.process_time() - c)
    n = args.new_tokens
    result = {"tool": args.tool, "version": version, "prompt_tokens": len(ids), "new_tokens": n,
              "intra_op_threads": args.threads or "onnxruntime default",
              "repeats": args.repeats, "machine": f"{platform.processor() or platform.machine()}, "
                                                  f"{os.cpu_count()} logical CPUs (shared: timings are noisy)",
              "same_tokens_as_first": {k: v == next(iter(tokens.values())) for k, v in tokens.items()},
              "models": {}}
    theirs = times[list(models)[-1]][n]  # the tool's own export is listed last
    for name, t in times.items():
        t1, tn = statistics.median(t[1]), statistics.median(t[n])
        result["models"][name] = {
            "end_to_end_tok_s": round(n / tn, 1), "decode_tok_s": round((n - 1) / (tn - t1), 1),
            "first_token_s": round(t1, 4), "runs_s": [round(x, 3) for x in t[n]],
            # paired: the same repeat's run of the tool's own export over this one's (> 1: this is faster)
            "paired_speed_vs_own_export": round(statistics.median(b / a for a, b in zip(t[n], theirs)), 3),
            # CPU seconds of the process per generated token (all threads; robust to other load when threads=1)
            "cpu_s_per_token": round(statistics.median(cpu[name][n]) / n, 4)}
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
