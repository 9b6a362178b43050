"""`kvexport bench --chat`: a multi-turn chat benchmark of the KV tiers (runtime/core/kv_tiers.py).

N conversations share one long system prompt; each turn sends the whole conversation so far
(system prompt, then every earlier user message and answer) plus a new user message, and the
answer is generated greedily (so every run sends the same tokens). The turns interleave: every
conversation's first turn is queued at t=0, and a conversation's next turn is queued when its
previous answer is complete, while the engine runs at most `pool_conversations` sequences and
its KV pool holds the shared system prompt plus about that many conversations' own parts. So
between two turns of a conversation the others evict its history from the pool, and turn t+1
either recomputes it or finds it in a tier below the pool.

It runs the same conversations four times, each on a fresh engine:

    off         no KV tiers (prefix caching in the pool only)
    host        --kv-offload-memory large enough for every conversation
    host+disk   a host tier of one conversation, the rest on disk (--kv-offload-dir)
    restart     a new engine on host+disk's folder (after its close()): warm from disk

and reports, per run, TTFT p50/p99 (from when a turn is queued), output and total tokens/s,
cached prompt tokens (the prefix-cache hit rate) and tier hits, and whether every answer equals the
`off` run's.

A hybrid build (gated DeltaNet layers: runtime/core/state_pool.py) resumes from recurrent-state
checkpoints, which go to the tiers with the KV blocks (io.STATE_GROUP); its engine keeps the checkpoint
slots of as many conversations as the pool holds (`hybrid_checkpoints`), so the tiers hold the rest,
and it runs one more: `recompute` (no prefix caching), whose answers every run's must equal too. Pool
sizes count the KV of the layers that hold KV (`io.kv_bytes_per_token_layers`: a hybrid's attention
layers, a shared cache once); the host tier's sizes add the checkpoints (`checkpoint_bytes`).
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from kvexport import io, manifest as mf
from kvexport.errors import ConfigError

from ..config import EngineConfig
from ..core.memory import parse_size
from ..engine import LLMEngine
from ..sampling_params import SamplingParams

MODES = ("off", "host", "host+disk", "restart")
HYBRID_MODES = MODES + ("recompute",)  # a hybrid build: and recomputation (module doc)


def kv_bytes_per_token(manifest) -> int:
    """KV bytes per token of the layers that hold KV (the engine's sizing: io.kv_bytes_per_token_layers)."""
    kv = manifest.kv
    kv_layers, dims = io.kv_layout(manifest.model.spec, kv.num_kv_heads, kv.head_dim)
    return sum(io.kv_bytes_per_token_layers((io.FULL_GROUP,) * kv.num_layers, dims, kv_layers, io.DType(kv.dtype),
                                            kv.latent).values())


def is_hybrid(manifest) -> bool:
    return manifest.model.spec.get("linear_attn") is not None


def conversation_checkpoints(manifest, config: EngineConfig, shape: "ChatShape") -> int:
    """The recurrent-state checkpoints one conversation leaves (0: not a hybrid): each turn's prompt end
    and answer, and one every state_checkpoint_blocks blocks of its own part (core/state_pool.py)."""
    if io.state_dims(manifest.model.spec) is None:
        return 0
    return 2 * shape.turns + shape.private_tokens // (config.state_checkpoint_blocks * manifest.kv.block_size)


def hybrid_checkpoints(manifest, config: EngineConfig, shape: "ChatShape") -> int:
    """A hybrid's checkpoint slots in these runs, sized as the pool is: the shared system prompt's, and every
    checkpoint of the conversations the pool holds (the tiers hold the others')."""
    return 1 + shape.pool_conversations * conversation_checkpoints(manifest, config, shape)


def checkpoint_bytes(manifest, config: EngineConfig, shape: "ChatShape") -> int:
    """Bytes of the checkpoints one conversation leaves (0: not a hybrid)."""
    n = conversation_checkpoints(manifest, config, shape)
    return n * io.state_bytes_per_sequence(*io.state_dims(manifest.model.spec)) if n else 0


@dataclass(frozen=True, slots=True)
class ChatShape:
    conversations: int = 8  # conversations, all interleaved
    turns: int = 4  # turns per conversation
    system_tokens: int = 512  # the shared system prompt, tokens
    user_tokens: int = 32  # each user message, tokens
    answer_tokens: int = 16  # each answer, tokens (generated, greedy, ignore_eos)
    pool_conversations: int = 4  # the pool holds the system prompt + this many conversations' own parts; max_num_seqs
    seed: int = 0  # the prompts' token ids

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_tokens", "user_tokens", "answer_tokens", "pool_conversations"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"chat bench: {name} must be an integer >= 1, got {v!r}")

    @property
    def conversation_tokens(self) -> int:
        """Tokens of a whole conversation (its last turn's prompt and answer)."""
        return self.system_tokens + self.turns * (self.user_tokens + self.answer_tokens)

    @property
    def private_tokens(self) -> int:
        """Tokens of a whole conversation after the shared system prompt."""
        return self.turns * (self.user_tokens + self.answer_tokens)

    @classmethod
    def parse(cls, text: str, **kw) -> "ChatShape":
        """'8x4x512' -> 8 conversations x 4 turns, a 512-token system prompt; '8x4x256x128': and
        128-token user messages."""
        try:
            parts = [int(x) for x in text.lower().split("x")]
            if len(parts) not in (3, 4):
                raise ValueError
        except ValueError:
            raise ConfigError(f"--chat {text!r}: give CONVERSATIONSxTURNSxSYSTEM_TOKENS[xUSER_TOKENS], e.g. "
                              f"8x4x512 or 8x4x256x128") from None
        return cls(*parts[:3], **({"user_tokens": parts[3]} if len(parts) == 4 else {}), **kw)


def _pct(xs: list[float], q: float) -> float:
    return round(float(np.percentile(xs, q)), 3) if xs else float("nan")


def run_chat(build_dir: str | Path, config: EngineConfig, shape: ChatShape, progress=None) -> dict:
    """The four runs (module doc) and what each measured."""
    manifest = mf.load(Path(build_dir))
    per_token = kv_bytes_per_token(manifest)
    hybrid = is_hybrid(manifest)
    conv_bytes = shape.conversation_tokens * per_token
    if shape.conversation_tokens + 1 > manifest.kv.max_seq_len:
        raise ConfigError(f"chat bench: a conversation of {shape.conversation_tokens} tokens does not fit the "
                          f"build's context of {manifest.kv.max_seq_len}; fewer turns or a shorter system prompt")
    block = manifest.kv.block_size
    # NOTE: the shared system prompt once, each conversation's own part (+2 blocks: partial blocks and the
    # next token's), the pad block: so the other conversations' turns evict a conversation's history
    pool = (shape.system_tokens + shape.pool_conversations * (shape.private_tokens + 2 * block) + block) * per_token
    base = replace(config, kv_cache_memory=int(pool), max_num_seqs=shape.pool_conversations,
                   kv_offload_memory="0", kv_offload_dir="", kv_offload_dtype="auto")
    tier = config.kv_offload_dtype  # the tiers' precision (--kv-offload-dtype) in the modes that have tiers
    if hybrid:
        base = replace(base, state_checkpoints=hybrid_checkpoints(manifest, config, shape))
    conv_bytes += checkpoint_bytes(manifest, config, shape)  # a hybrid's checkpoints go to the tiers too
    host_all = parse_size(config.kv_offload_memory) or int(1.25 * shape.conversations * conv_bytes)
    own_dir = not config.kv_offload_dir
    folder = Path(config.kv_offload_dir or tempfile.mkdtemp(prefix="kvexport-chat-bench-")) / "kv"
    if folder.exists():
        raise ConfigError(f"chat bench: {folder} exists; give a --kv-offload-dir whose 'kv' subfolder is new")
    runs = {}
    try:
        configs = {"off": base, "host": replace(base, kv_offload_memory=host_all, kv_offload_dtype=tier),
                   "host+disk": replace(base, kv_offload_memory=int(conv_bytes), kv_offload_dir=str(folder),
                                        kv_offload_disk=config.kv_offload_disk, kv_offload_dtype=tier),
                   "recompute": replace(base, enable_prefix_caching=False)}
        configs["restart"] = configs["host+disk"]
        answers = {}
        for mode in (HYBRID_MODES if hybrid else MODES):
            runs[mode], answers[mode] = _run(build_dir, configs[mode], shape, mode, progress)
            runs[mode]["answers_equal_off"] = answers[mode] == answers["off"]
            same = [a == b for ca, cb in zip(answers[mode], answers["off"]) for a, b in zip(ca, cb)]
            # turns whose answer is off's, token for token
            runs[mode]["answers_same_as_off"] = f"{sum(same)}/{len(same)}"
    finally:
        if own_dir:
            shutil.rmtree(folder.parent, ignore_errors=True)
    return {"bench": "chat", "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "build": str(build_dir),
            "model": manifest.model.family, "dtype": manifest.dtype, "kv_dtype": manifest.kv.dtype,
            "hybrid": hybrid, "kv_bytes_per_token": per_token,
            "state_checkpoint_blocks": config.state_checkpoint_blocks if hybrid else None,
            "state_checkpoints": base.state_checkpoints if hybrid else None,
            "shape": {f.name: getattr(shape, f.name) for f in fields(ChatShape)},
            "kv_offload_dtype": config.kv_offload_dtype, "kv_cache_memory_bytes": int(pool),
            "host_tier_bytes": {"host": host_all, "host+disk": int(conv_bytes)},
            "disk_tier_bytes": parse_size(config.kv_offload_disk), "threads": config.threads, "runs": runs}


def _run(build_dir, config: EngineConfig, shape: ChatShape, mode: str, progress) -> tuple[dict, list]:
    engine = LLMEngine(build_dir, config)
    vocab = engine.manifest.model.vocab_size
    rng = np.random.default_rng(shape.seed)
    system = rng.integers(3, vocab, size=shape.system_tokens).tolist()
    users = rng.integers(3, vocab, size=(shape.conversations, shape.turns, shape.user_tokens)).tolist()
    params = SamplingParams(max_tokens=shape.answer_tokens, ignore_eos=True, temperature=0.0)
    history = [list(system) for _ in range(shape.conversations)]
    turn = [0] * shape.conversations
    live: dict[str, int] = {}  # request id -> conversation
    ttft, cached, turn2, answers = [], [], [], [[] for _ in range(shape.conversations)]

    def submit(c: int) -> None:
        history[c] += users[c][turn[c]]
        live[engine.add_request(list(history[c]), params)] = c

    t0 = time.perf_counter()
    for c in range(shape.conversations):
        submit(c)
    done = prompt_tokens = 0
    while live:
        engine.step()
        for rid, c in list(live.items()):
            o = engine.output(rid)
            if not o.finished:
                continue
            if o.error:
                raise ConfigError(f"chat bench ({mode}): a turn failed: {o.error}")
            del live[rid]
            engine.pop_output(rid)
            ttft.append(o.first_token_time - o.arrival_time)
            if turn[c] == 1:
                turn2.append(ttft[-1])
            cached.append(o.num_cached_prompt_tokens)
            prompt_tokens += len(history[c])
            answers[c].append(list(o.token_ids))
            history[c] += list(o.token_ids)
            turn[c] += 1
            done += 1
            if progress:
                progress(mode, done, shape.conversations * shape.turns)
            if turn[c] < shape.turns:
                submit(c)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    tiers = stats.tiers
    engine.close()  # host+disk: the pool's blocks to disk, for the restart
    out_tokens = shape.conversations * shape.turns * shape.answer_tokens
    return {"ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99)}, "wall_s": round(wall, 2),
            "output_tokens_per_s": round(out_tokens / wall, 2),
            "total_tokens_per_s": round((out_tokens + prompt_tokens) / wall, 2),
            "prompt_tokens": prompt_tokens, "cached_prompt_tokens": int(sum(cached)),
            "hit_rate": round(sum(cached) / prompt_tokens, 4) if prompt_tokens else 0.0,
            "turn2_ttft_s": {"p50": _pct(turn2, 50)},
            "preemptions": stats.num_preemptions,
            "tier_hits": {"host": tiers.host_hits, "disk": tiers.disk_hits},
            "tier_bytes": {"host_write": tiers.host_write_bytes, "host_read": tiers.host_read_bytes,
                           "disk_write": tiers.disk_write_bytes, "disk_read": tiers.disk_read_bytes},
            "load_ms_per_block": round(1e3 * tiers.load_seconds_per_block, 3)
            if tiers.load_seconds_per_block is not None else None}, answers


def markdown(result: dict) -> str:
    """The table docs/BENCHMARKS.md shows."""
    rows = ["| run | TTFT p50 (s) | TTFT p99 (s) | turn-2 TTFT p50 (s) | output tok/s | total tok/s | "
            "cached prompt tokens (hit rate) | tier hits host / disk (blocks) | answers = off |",
            "|---|---|---|---|---|---|---|---|---|"]
    for mode, r in result["runs"].items():
        rows.append(f"| {mode} | {r['ttft_s']['p50']} | {r['ttft_s']['p99']} | {r['turn2_ttft_s']['p50']} | "
                    f"{r['output_tokens_per_s']} | {r['total_tokens_per_s']} | {r['cached_prompt_tokens']} / "
                    f"{r['prompt_tokens']} ({r['hit_rate']:.1%}) | {r['tier_hits']['host']} / "
                    f"{r['tier_hits']['disk']} | {r.get('answers_same_as_off', r['answers_equal_off'])} |")
    return "\n".join(rows) + "\n"


def turn2_ttft(build_dir: str | Path, config: EngineConfig, shape: ChatShape, repeats: int = 3) -> dict:
    """TTFT of a lone turn 2 whose conversation's blocks were evicted from the pool (by the other
    conversations' first turns), with offload off / host / disk only / after a restart on that
    disk folder: no queueing, the median of `repeats` conversations, each on the same engine."""
    manifest = mf.load(Path(build_dir))
    per_token, block = kv_bytes_per_token(manifest), manifest.kv.block_size
    pool = (shape.system_tokens + 2 * (shape.private_tokens + 2 * block) + block) * per_token
    base = replace(config, kv_cache_memory=int(pool), kv_offload_memory="0", kv_offload_dir="", kv_offload_dtype="auto")
    folder = Path(tempfile.mkdtemp(prefix="kvexport-turn2-")) / "kv"
    tier = config.kv_offload_dtype
    disk = replace(base, kv_offload_dir=str(folder), kv_offload_disk=config.kv_offload_disk, kv_offload_dtype=tier)
    host = int(4 * shape.conversations * (pool + checkpoint_bytes(manifest, config, shape)))
    configs = {"off": base, "host": replace(base, kv_offload_memory=host, kv_offload_dtype=tier),
               "disk": disk, "restart": disk}
    if is_hybrid(manifest):  # checkpoint slots for what the pool holds; the tiers hold the rest (module doc)
        slots = hybrid_checkpoints(manifest, config, replace(shape, pool_conversations=2))
        configs = {m: replace(c, state_checkpoints=slots) for m, c in configs.items()}
        configs["recompute"] = replace(base, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=shape.answer_tokens, ignore_eos=True)
    out = {}
    try:
        for mode, cfg in configs.items():
            engine = LLMEngine(build_dir, cfg)
            vocab = engine.manifest.model.vocab_size
            rng = np.random.default_rng(shape.seed)
            system = rng.integers(3, vocab, size=shape.system_tokens).tolist()
            user = lambda: rng.integers(3, vocab, size=shape.user_tokens).tolist()  # noqa: E731
            ttfts, cached = [], []
            for _ in range(repeats):
                first = system + user()
                answer = _one(engine, first, params).token_ids
                for _ in range(shape.conversations - 1):  # the others' first turns evict it
                    _one(engine, system + user(), params)
                o = _one(engine, first + list(answer) + user(), params)
                ttfts.append(o.first_token_time - o.arrival_time)
                cached.append(o.num_cached_prompt_tokens)
            engine.close()
            tiers = engine.stats().tiers
            out[mode] = {"ttft_s_median": round(float(np.median(ttfts)), 3), "cached_prompt_tokens": cached,
                         "tier_hits": {"host": tiers.host_hits, "disk": tiers.disk_hits}}
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    return {"bench": "chat-turn2", "date": time.strftime("%Y-%m-%d %H:%M"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "build": str(build_dir),
            "shape": {f.name: getattr(shape, f.name) for f in fields(ChatShape)}, "repeats": repeats, "runs": out}


def _one(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_output(rid)
