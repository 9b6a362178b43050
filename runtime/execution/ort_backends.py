"""The onnxruntime backends: run a `paged` build's prefill/decode graphs on one step's
`ModelInput` and keep the KV block pools (numpy, host memory). One small class per way the
attention runs:

    OnnxAttentionBackend   `--attention onnx`: standard ops; the graph reads the pools and
                           returns this step's K/V, which the backend stores at slot_mapping
    NativeOpBackend        `--attention plugin` with the native CPU PagedAttention op: each
                           pool is bound as the op's input and its aliased output (in place)
    ReferenceOpBackend     `--attention plugin` with the float64 torch reference as an
                           onnxruntime-extensions PyOp (slow: copies the pools; proves the
                           plugin graphs anywhere)

`ort_backend()` picks one for a build.

NOTE (weights once per process): onnxruntime pre-packs every MatMul weight into a private
copy per session (as large as the fp32 weights; measured 525 MiB per session on smollm2),
and its Python API cannot share pre-packed weights between sessions. So serving opens ONE
session, on the prefill graph, and runs decode steps through it too: the two graphs take
the same inputs and differ only in selecting the last token's logits, which a decode step
(one token per sequence) does not need. onnxruntime loads `weights.data` itself and drops
the file pages once packed. `both_graphs=True` (build validation) opens the decode graph
as a second session, so each graph is checked on the steps it is exported for. Block-wise
quantized builds may open one more for large steps, in another form of their weights: which,
from how many tokens, is session_plan.plan_sessions (of the build and weight_matmul_accuracy).
Peak RSS of `kvexport generate` (smollm2-135m): 2.20 GB with two sessions sharing a
memory-mapped weights file -> 1.01 GB; Qwen2.5-0.5B 6.35 -> 2.42 GB
(bench/results/runtime_core_rss.json).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvexport import io
from kvexport.errors import KvExportError
from kvexport.manifest import Manifest

from .model_input import ModelInput, select_rows
from .state_store import StateStore
from .session_plan import ACCURACY_LEVELS, LARGE_STEP_TOKENS, Rewrite, SessionPlan, plan_sessions, resolve_accuracy

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

ORT_KINDS = ("auto", "onnx", "native", "reference")
# Which sessions a build opens, each with the rewrites it derives (runtime/execution/session_plan.py,
# where the whole table is; tests/runtime/execution/test_session_plan.py). Measured on smollm2-135m:
#   MatMulNBits accuracy level (ACCURACY_LEVELS: "int8" = 4, int8 activations per block of K;
#       "float" = 0): int4 perplexity 55.64 at level 4 vs 54.617 at 0 (= the Q4_1 source); decode
#       ~14x slower with float (its int8 LM head dequantizes in full each step). Level 4 is ~2.3x
#       faster than fp32 at M = 1 but slower from M ~ 32 on; level 0 is 1.1-1.3x slower than fp32
#       from M = 32 on (576x1536 at M = 512: 3.5-3.8 ms against 3.0-3.2 fp32; scratch timings).
#   "auto", fp32 builds (int4 and block-wise int8), steps of 8+: "pair": every block-wise matmul but
#       the LM head as int8 x int8 products carrying ~15 bits of activations and weights
#       (ort_quant.blocks_to_int8_pair); the head (int8 blocks) at level 4. smollm2 int4
#       perplexity 54.575 against 54.572 exact and 54.617 for its Q4_1 source (level 4 alone:
#       55.64); block int8 54.623. ms per step of M tokens, smollm2 int4 (bench/step_sizes.py,
#       level 4 vs pair): 18.9 vs 25.9 at M=4, 27.3 vs 27.2 at 8, 44.5 vs 39.0 at 16, 138.1 vs
#       90.8 at 64; in one process against fp32 and the float form (scratch, medians of 5, fp32 /
#       float / pair): 107.8 / 145.2 / 118.1 at 64, 571.6 / 748.7 / 522.0 at 512. Mixed-64 trace:
#       int4 at fp32's throughput (0.999x over six turns; docs/BENCHMARKS.md), float form 0.94x.
#   "auto", fp16 int4 builds, steps of 32+: "float", level 0, exact, the int8 LM head kept at
#       level 4 as an explicit node (ort_quant.int8_blocks_to_matmulnbits); the pair form takes
#       float32 only.
#   "int8", block-wise fp32 builds, steps of 4+: "int8": the blocks as per-channel int8 codes with
#       per-token int8 activations (ort_quant.blocks_to_int8_channel + int8_dynamic), the LM head
#       still per block at level 4; int8 activations throughout. int4 int8 x int8 20.0 vs 13.4 ms
#       at M=4, 14.5 vs 13.1 at 2, 12.7 vs 13.6 at 1; block-wise int8 18.6 vs 18.3 at M=4, 26.8 vs
#       21.0 at 8 (bench/results/step_sizes.json).
# A large-step session costs a second copy of the weights in its form (see the module NOTE;
# pair: 2 bytes per weight).


def _providers() -> list[str]:
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]


def _zeros_small_pages(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """np.zeros without transparent huge pages. NOTE: numpy advises huge pages for arrays
    of 4 MiB and more, so the first write to a pool faults in 2 MiB at a time: a lightly
    used 2 GiB pool then held +240 MiB of RSS on smollm2. The pool is touched sparsely
    (blocks are handed out one by one), so small pages are what it wants."""
    # NOTE: by version, not by attribute: numpy 1.26 has a numpy._core stub (no multiarray) that
    # pybind11 imports in Triton's Python-backend stub
    core = np.core if int(np.__version__.split(".")[0]) < 2 else np._core  # numpy 1 (the Triton environment) / 2
    toggle = getattr(core.multiarray, "_set_madvise_hugepage", None)
    prev = toggle(False) if toggle is not None else None
    try:
        return np.zeros(shape, dtype)
    finally:
        if toggle is not None:
            toggle(prev)


def _spill(model: onnx.ModelProto, store: dict[str, np.ndarray] | None = None) -> tuple[bytes, dict[str, np.ndarray]]:
    """A derived graph as (bytes, the initializers the derivation made): those (ort_quant:
    per-channel int8 codes, int8 pairs, re-laid-out head blocks) are out of the graph, which
    keeps a placeholder external reference (ort_quant.DERIVED_DATA) for each, and are handed to
    onnxruntime from memory (SessionOptions.add_external_initializers). The derivation leaves
    them in `store` (the arrays the graph still names are taken); large ones embedded in the
    graph (no store) are moved out here.
    NOTE: embedded in the bytes instead, they were held for the session's lifetime twice over
    (the Python InferenceSession keeps the bytes it was made from, beside onnxruntime's pre-packed
    copy): Qwen2.5-0.5B int4 with weight_matmul_accuracy int8 peaked at 2707 MiB RSS (fp32: 2365),
    2020 MiB this way; smollm2 int4 (auto) 673 -> 643 MiB. No way out: a file in a temporary
    folder (onnxruntime refuses external data outside the model's folder, links resolved), or
    files in memory (then every external file must be)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import set_external_data

    from .ort_quant import DERIVED_DATA

    arrays = {}
    for t in model.graph.initializer:
        if store is not None and t.name in store:
            arrays[t.name] = store[t.name]
        elif t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= SPILL_BYTES:
            arrays[t.name] = numpy_helper.to_array(t)
            set_external_data(t, DERIVED_DATA, 0, len(t.raw_data))
            t.ClearField("raw_data")
    return model.SerializeToString(), arrays


SPILL_BYTES = 1 << 16  # smaller initializers (scales, constants) stay in the graph


def _release(a: np.ndarray) -> None:
    """Free a derived array's memory once its session is made, though the session options still
    hold it (the InferenceSession keeps them): onnxruntime copies external initializers while
    the session is made and reads its copies (pre-packed) after. Measured: 106 MB of int8
    weights handed over this way raised RSS by 113 MB when the session was made, and freeing
    them after took RSS back down by 102 MB; zeroing every derived array after its session was
    made left smollm2's int4 and int8 perplexity unchanged. tests/exporter/
    test_quantized_weights.py compares a released session's logits with those of one whose
    arrays were kept. Frees 2 bytes per weight of the int8 pairs (212 MB on smollm2)."""
    if a.flags.owndata:
        a.resize(0, refcheck=False)


class _OrtBackend:
    """What every onnxruntime backend shares: weights, sessions, pools, the logits rows."""

    full_block_tables = False  # plugin attention: block tables cover this step's blocks too
    pads_queries = False  # a call costs its longest query chunk times its sequences
    attention_impl = ""

    def __init__(self, build_dir: str | Path, manifest: Manifest, num_blocks: int, threads: int | None = None,
                 providers: list[str] | None = None, profile_prefix: str | None = None, both_graphs: bool = False,
                 accuracy: str | None = None, local_num_blocks: int | None = None):
        if manifest.kv.layout != io.KVLayout.PAGED.value:
            raise KvExportError(f"the runtime serves paged builds; {build_dir} has layout "
                                f"{manifest.kv.layout!r}: rebuild with `--layout paged`")
        if num_blocks < 2:
            raise KvExportError(f"the KV pool needs at least 2 blocks (one is the pad block), got {num_blocks}")
        self.build_dir, self.manifest, self.num_blocks = Path(build_dir), manifest, num_blocks
        self._takes: dict[int, bool] = {}  # id(session) -> its graph takes io.LOGITS_INDICES
        self.kv = kv = manifest.kv
        self.threads = threads
        # "auto" | "int8" | "float": the setting, else the build's recorded one (session_plan.resolve_accuracy)
        self.accuracy = resolve_accuracy(manifest.weights.quantization, accuracy)
        self.profile_prefix = profile_prefix  # onnxruntime profiling of every run, to files with this prefix
        self.providers = providers or _providers()
        dtype = np.dtype(io.DType(kv.dtype).pool_dtype)  # int4: uint8 rows (io.KV_INT4_FORMAT)
        # KV cache groups (kvexport/io.py): a layer of the local group has `local_num_blocks`
        # blocks (default: as many as the full group's, for callers with one table per sequence)
        layer_groups = manifest.layer_groups or (io.FULL_GROUP,) * kv.num_layers
        self.groups = tuple(sorted(set(layer_groups) - {io.FULL_GROUP}))
        self.local_num_blocks = local_num_blocks or num_blocks if self.groups else None
        if self.local_num_blocks is not None and self.local_num_blocks < 2:
            raise KvExportError(f"the local KV pool needs at least 2 blocks (one is the pad block), got "
                                f"{self.local_num_blocks}")
        self.layer_groups = layer_groups
        blocks = {io.FULL_GROUP: num_blocks, io.LOCAL_GROUP: self.local_num_blocks}
        # Gemma 4: only the layers holding a KV cache have pools, each of its layer's shape (io.py "Shared KV")
        self.kv_layers, dims = io.kv_layout(manifest.model.spec, kv.num_kv_heads, kv.head_dim)
        shapes = [io.paged_pool_shape(blocks[g], dims[i][0], kv.block_size, dims[i][1],
                                      io.DType(kv.dtype).numpy_name) for i, g in enumerate(layer_groups)]
        # [K_0, V_0, K_1, V_1, ...], each [kv_heads, num_blocks (of the layer's group), block_size, head_dim];
        # MLA: [latent_0, latent_1, ...], each [1, num_blocks, block_size, row] (io.pool_names)
        self.pool_layers = io.pool_layers(kv.num_layers, kv.latent, self.kv_layers)
        self.pools = [_zeros_small_pages(shapes[i], dtype) for i in self.pool_layers]
        self.state = StateStore.for_model(manifest.model.spec)  # hybrids' recurrent state pools; None: none
        self._pool_names = io.pool_names(kv.num_layers, kv.latent, self.kv_layers)
        prefill, decode = io.Phase.PREFILL.value, io.Phase.DECODE.value
        # the sessions and what each derives (session_plan.py); only onnxruntime's CPU provider
        # runs the derived forms, and only backends that open derived graphs (step_split_ok)
        self.plans: tuple[SessionPlan, ...] = plan_sessions(
            manifest.weights.quantization, manifest.dtype, self.accuracy,
            derive=self.step_split_ok and self.providers == ["CPUExecutionProvider"])
        # phase -> session, per plan; the largest steps' first: making a session holds its weights
        # twice for a while (onnxruntime's copy and its pre-packed one), best while nothing else is resident
        sets: list[dict] = []
        for plan in reversed(self.plans):
            first = self._open(self.build_dir / manifest.graphs[prefill].file, plan)
            sets.append({prefill: first, decode: self._open(self.build_dir / manifest.graphs[decode].file, plan)
                         if both_graphs else first})
        self.session_sets = tuple(reversed(sets))
        # NOTE: an --all-logits prefill graph returns a row per token; in a decode step that
        # is one row per sequence, as the decode graph returns

    step_split_ok = True  # backends that can open derived and step-size sessions (not the reference op's)

    @property
    def sessions(self) -> dict:
        """phase -> the session of the smallest steps (decode)."""
        return self.session_sets[0]

    @property
    def large_sessions(self) -> dict:
        """phase -> the session of large steps, where the plan has one; else {}."""
        return self.session_sets[-1] if len(self.plans) > 1 else {}

    @property
    def large_form(self) -> str | None:
        """How large steps run block-wise weights ("pair" | "float" | "int8": LARGE_STEP_TOKENS),
        where a plan has a session for them."""
        return self.plans[-1].form if self.plans[-1].form in LARGE_STEP_TOKENS else None

    def session_options(self, plan: SessionPlan | None = None):
        """onnxruntime's options for the session of `plan` (default: the smallest steps')."""
        import onnxruntime as ort

        plan = plan or self.plans[0]
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = self.threads or (os.cpu_count() or 1)
        so.inter_op_num_threads = 1
        if plan.level is not None:
            # NOTE: int8 compute in the MatMulNBits that onnxruntime fuses from block-wise
            # DequantizeLinear -> MatMul (bench/quant_linear.py: the default accuracy level
            # dequantizes to float first and is slower)
            so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(plan.level))
        if self.profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = self.profile_prefix
        return so

    def _open(self, path: Path, plan: SessionPlan):
        import onnxruntime as ort

        so = self.session_options(plan)
        store: dict[str, np.ndarray] = {}
        model = self._cpu_model(path, plan, store)
        if isinstance(model, str):
            return ort.InferenceSession(model, so, providers=self.providers,
                                        disabled_optimizers=self.disabled_optimizers())
        graph, spilled = _spill(model, store)
        del model
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        if spilled:
            so.add_external_initializers(list(spilled), [ort.OrtValue.ortvalue_from_numpy(a) for a in spilled.values()])
        sess = ort.InferenceSession(graph, so, providers=self.providers, disabled_optimizers=self.disabled_optimizers())
        for a in store.values():
            _release(a)
        return sess

    def disabled_optimizers(self) -> list[str]:
        """NOTE: quantized builds turn off onnxruntime's MatMulAddFusion: it runs before the
        QDQ fusion and folds o_proj / down_proj (each followed by the residual Add) into a Gemm
        fed by a DequantizeLinear, which then dequantizes the whole weight on every call. With
        it, 60 of smollm2's 121 int8 matmuls and 48 of Qwen2.5-0.5B's 97 int4 ones stayed
        unfused; without it all become MatMulNBits (tests/runtime/execution/test_ort_backends.py)."""
        return ["MatMulAddFusion"] if self.manifest.weights.precision in ("int8", "int4") else []

    def _cpu_model(self, path: Path, plan: SessionPlan, store: dict | None = None) -> str | onnx.ModelProto:
        """The graph `plan` opens: its path, or the form its rewrites derive from it in memory
        (runtime/execution/ort_quant.py) whose external weights are the build folder's: per-channel
        int8 weights as dynamic int8 matmuls (the codes stay int8 on disk), block-wise ones but the
        LM head's as int8 pairs or per-channel int8, the int8 LM head as an explicit MatMulNBits.
        With `store` (a dict) the derived arrays wait there, out of the graph (ort_quant.DERIVED_DATA)."""
        if not plan.rewrites:
            return str(path)
        import onnx

        from . import ort_quant

        model = onnx.load(str(path), load_external_data=False)
        head = ort_quant.logits_weight(model.graph, io.LOGITS)
        skip = frozenset([head] if head else [])  # the LM head keeps its int8 blocks (session_plan.py)
        base = str(path.parent)
        changed = 0
        for rw in plan.rewrites:
            if rw is Rewrite.BLOCKS_TO_INT8_CHANNEL:
                changed += ort_quant.blocks_to_int8_channel(model, base, skip=skip, store=store)
            elif rw is Rewrite.INT8_DYNAMIC:
                changed += ort_quant.int8_dynamic(model)
            elif rw is Rewrite.BLOCKS_TO_INT8_PAIR:
                changed += ort_quant.blocks_to_int8_pair(model, base, skip=skip, store=store)
            else:
                assert rw is Rewrite.INT8_BLOCKS_TO_MATMULNBITS, rw
                changed += ort_quant.int8_blocks_to_matmulnbits(model, base, ACCURACY_LEVELS["int8"], store=store)
        return model if changed else str(path)

    @property
    def pool_bytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    def end_profiling(self) -> list[str]:
        """The profile files (onnxruntime JSON) of a backend made with `profile_prefix`."""
        return [sess.end_profiling() for sess in self._all_sessions()]

    def _all_sessions(self) -> list:
        """Every distinct session (the phases may share one)."""
        return list({id(s): s for sessions in self.session_sets for s in sessions.values()}.values())

    def execute(self, inp: ModelInput, all_tokens: bool = False) -> np.ndarray:
        """Run one step (storing its K/V in the pools); logits [S, vocab] float32, or
        [T, vocab] with `all_tokens` (an --all-logits build's prefill)."""
        n = len(inp.token_ids)
        sessions = next(s for p, s in zip(self.plans, self.session_sets) if p.runs(n))
        sess = sessions[inp.phase.value]
        takes = self._takes_indices(sess)
        logits = self._run(sess, self._with_rows(inp, all_tokens) if takes else inp)
        graph_rows = "indices" if takes else "tokens" if self.manifest.all_logits and not inp.is_decode else "last"
        return select_rows(logits, inp, all_tokens, graph_rows).astype(np.float32, copy=False)

    def _takes_indices(self, sess) -> bool:
        """The session's graph takes io.LOGITS_INDICES (a prefill graph of a build made with it)."""
        takes = self._takes
        if id(sess) not in takes:
            takes[id(sess)] = any(i.name == io.LOGITS_INDICES for i in sess.get_inputs())
        return takes[id(sess)]

    @staticmethod
    def _with_rows(inp: ModelInput, all_tokens: bool) -> ModelInput:
        """`inp` with its logits rows spelled out (`ModelInput.rows`)."""
        import dataclasses

        return dataclasses.replace(inp, logits_indices=inp.rows(all_tokens))

    def _feeds(self, sess, inp: ModelInput) -> dict[str, np.ndarray]:
        """The step's metadata inputs for `sess` (io.LOGITS_INDICES only where its graph takes it)."""
        feeds = inp.feeds()
        if not self._takes_indices(sess):
            del feeds[io.LOGITS_INDICES]
        if not self.scores:  # importance eviction: only graphs that declare it take observation_lens
            del feeds[io.OBSERVATION_LENS]
        if self.manifest.lora:  # a build that takes LoRA adapters (kvexport/io.py LORA_INDEX); absent: the base
            if io.LORA_INDEX not in feeds:
                feeds[io.LORA_INDEX] = np.full(len(feeds[io.INPUT_IDS]), -1, np.int64)
            feeds.update(self._lora_factors())
        return feeds

    def set_lora_factors(self, factors: dict[str, np.ndarray]) -> None:
        """The loaded adapters' lora_a / lora_b (kvexport/lora_adapters.py pack), fed with every step from now
        on (runtime/lora.py); the arrays are held, not copied."""
        want = {n for i, m, _, _ in self.manifest.lora["layers"] for n in (io.lora_a(i, m), io.lora_b(i, m))}
        assert set(factors) == want, "one lora_a and lora_b per adapted matmul of the build"
        self._lora_inputs = {k: np.ascontiguousarray(v) for k, v in factors.items()}

    def _lora_factors(self) -> dict[str, np.ndarray]:
        """The adapters' factors fed each step: those `set_lora_factors` gave, else 0-row factors: each adapted
        matmul adds nothing (the base model)."""
        if getattr(self, "_lora_inputs", None) is None:
            act = io.DType(self.manifest.dtype).numpy_name
            self._lora_inputs = {}
            for i, m, fan_in, fan_out in self.manifest.lora["layers"]:
                self._lora_inputs[io.lora_a(i, m)] = np.zeros((fan_in, 0), act)
                self._lora_inputs[io.lora_b(i, m)] = np.zeros((0, fan_out), act)
        return self._lora_inputs

    @property
    def scores(self) -> bool:
        """The build's graphs take io.OBSERVATION_LENS and return attention scores (manifest
        kv.attention_scores; runtime/core/importance.py)."""
        return bool(self.manifest.kv.attention_scores)

    def _score_names(self, inp: ModelInput) -> list[str]:
        """The attention_scores outputs to fetch for `inp`: every KV layer's when a sequence observes."""
        if not self.scores or inp.observation_lens is None:
            return []
        return [io.attention_scores(i) for i in (self.kv_layers or range(self.kv.num_layers))]

    def take_scores(self) -> list[np.ndarray] | None:
        """The last step's attention_scores outputs ([S, kv_heads, score_len] per KV layer), once;
        None when it had no observation queries (execution/attention_scores.py)."""
        out, self._last_scores = getattr(self, "_last_scores", None), None
        return out

    def _run(self, sess, inp: ModelInput) -> np.ndarray:
        raise NotImplementedError


class OnnxAttentionBackend(_OrtBackend):
    """`--attention onnx`. NOTE: the graphs read the pool but never write it (ONNX has no
    in-place update; kvexport/io.py): after each run the backend stores the step's new K/V
    at slot_mapping."""

    pads_queries = True  # the model runner groups a step's chunks by length
    attention_impl = "onnx"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._out_names = [io.LOGITS] + io.new_kv_names(self.kv.num_layers, self.kv.latent, self.kv_layers)
        if self.state is not None:  # hybrids: the new recurrent states, after the KV (kvexport/io.py)
            self._out_names += self.state.out_names

    def _run(self, sess, inp: ModelInput) -> np.ndarray:
        feeds = self._feeds(sess, inp)
        feeds.update(zip(self._pool_names, self.pools))
        if self.state is not None:
            feeds.update(self.state.feeds(inp.state_slots))
        score_names = self._score_names(inp)  # importance eviction: fetched only by steps that observe
        outs = sess.run(self._out_names + score_names, feeds)
        if score_names:
            self._last_scores, outs = outs[len(self._out_names):], outs[:len(self._out_names)]
        if self.state is not None:  # NOTE: after the run succeeded (execution/state_store.py)
            first = 1 + len(self.pools)
            self.state.store(inp.state_slots, outs[first:first + len(self.state.out_names)])
        slots = {g: inp.group_slots(g) for g in set(self.layer_groups)}
        for layer, pool, new in zip(self.pool_layers, self.pools, outs[1:]):
            io.store_paged_kv(pool, slots[self.layer_groups[layer]], new)
        return outs[0]


class _PluginBackend(_OrtBackend):
    full_block_tables = True  # the op stores this step's K/V first and reads it back

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._out_names = [io.LOGITS] + io.pool_out_names(self.kv.num_layers, self.kv.latent, self.kv_layers)


class NativeOpBackend(_PluginBackend):
    """`--attention plugin` on the native CPU PagedAttention op (plugins/paged_attention/cpu/).
    One IOBinding per session, made once, with each pool bound as both its input and its
    aliased output (updated in place); a step binds only its metadata and the logits."""

    attention_impl = "plugin (native CPU op)"

    def __init__(self, build_dir, manifest, num_blocks, threads=None, providers=None, profile_prefix=None,
                 both_graphs=False, accuracy=None, local_num_blocks=None, *, library: Path):
        self.library = Path(library)
        # the op is a CPU kernel and the pools live in host memory
        super().__init__(build_dir, manifest, num_blocks, threads, ["CPUExecutionProvider"], profile_prefix,
                         both_graphs, accuracy, local_num_blocks)
        import onnxruntime as ort

        self._pool_values = [ort.OrtValue.ortvalue_from_numpy(p) for p in self.pools]
        self._bindings = {id(sess): self.in_place_binding(sess) for sess in self._all_sessions()}

    def session_options(self, plan: SessionPlan | None = None):
        so = super().session_options(plan)
        so.register_custom_ops_library(str(self.library))
        return so

    def in_place_binding(self, sess):
        """An IOBinding of `sess` with every pool bound as both its input and its aliased
        output; logits are output 0."""
        b = sess.io_binding()
        b.bind_output(io.LOGITS)
        for name, out_name, value in zip(self._pool_names, self._out_names[1:], self._pool_values):
            b.bind_ortvalue_input(name, value)
            b.bind_ortvalue_output(out_name, value)
        return b

    def _run(self, sess, inp: ModelInput) -> np.ndarray:
        binding = self._bindings[id(sess)]
        for name, arr in self._feeds(sess, inp).items():  # metadata as int64; LoRA factors as they are
            binding.bind_cpu_input(name, np.ascontiguousarray(arr, dtype=np.int64 if arr.dtype.kind in "iub" else None))
        binding.bind_output(io.LOGITS)  # rebound (still output 0): allocated at this step's shape
        if self.state is not None:  # hybrids: the state pools read, the new states returned (GatedDeltaRule)
            for name, arr in self.state.feeds(inp.state_slots).items():
                binding.bind_cpu_input(name, arr)
            for name in self.state.out_names:  # NOTE: bound right after the pools (outputs 1 + pools ..)
                binding.bind_output(name)
        score_names = self._score_names(inp)
        for name in score_names:  # NOTE: bound only for steps that observe; unbound, onnxruntime drops them
            binding.bind_output(name)
        sess.run_with_iobinding(binding)
        outs = binding.get_outputs()
        if self.state is not None:  # NOTE: after the run succeeded (execution/state_store.py)
            first = 1 + len(self._pool_values)
            self.state.store(inp.state_slots, [o.numpy() for o in outs[first:first + len(self.state.out_names)]])
        if score_names:  # the last bound outputs
            self._last_scores = [o.numpy() for o in outs[len(outs) - len(score_names):]]
            binding.clear_binding_outputs()
            self._rebind_pools(binding)
        return outs[0].numpy()

    def _rebind_pools(self, binding) -> None:
        """The pools as aliased outputs again, after the score outputs were unbound."""
        binding.bind_output(io.LOGITS)
        for out_name, value in zip(self._out_names[1:], self._pool_values):
            binding.bind_ortvalue_output(out_name, value)


class ReferenceOpBackend(_PluginBackend):
    """`--attention plugin` with the float64 torch references of the ops (PagedAttention, PagedMLA) as
    PyOps (plugins/common/pyop.py). The graph returns the updated pools."""

    attention_impl = "plugin (reference PyOp)"
    step_split_ok = False  # it opens the graph file as is

    def _open(self, path: Path, plan: SessionPlan):
        from kvexport.plugins.common.pyop import plugin_session  # every registered op's nodes (PagedAttention, PagedMLA)

        return plugin_session(path, options=self.session_options(plan))  # a CPU op: CPU provider only

    def _run(self, sess, inp: ModelInput) -> np.ndarray:
        feeds = self._feeds(sess, inp)
        feeds.update(zip(self._pool_names, self.pools))
        state_names = self.state.out_names if self.state is not None else []
        if state_names:  # hybrids: the state pools read, the new states returned (GatedDeltaRule)
            feeds.update(self.state.feeds(inp.state_slots))
        score_names = self._score_names(inp)
        outs = sess.run(self._out_names + state_names + score_names, feeds)
        if state_names:  # NOTE: after the run succeeded (execution/state_store.py)
            n = len(self._out_names)
            self.state.store(inp.state_slots, outs[n:n + len(state_names)])
            outs = outs[:n] + outs[n + len(state_names):]
        self.pools = list(outs[1:len(self._out_names)])
        if score_names:
            self._last_scores = list(outs[len(self._out_names):])
        return outs[0]


def native_library_for(manifest: Manifest) -> tuple[Path | None, str]:
    """(the native op library that runs this plugin build, "") or (None, why not): PagedAttention's
    (plugins/paged_attention/native.py), for MLA builds the same library's PagedMLA (plugins/paged_mla/native.py)."""
    from kvexport.plugins.paged_attention import native

    if not manifest.kv.latent:
        lib, why = native.library_for(manifest)
        state = io.state_dims(manifest.model.spec)
        if lib is not None and state is not None and state[1].recurrent:  # gated DeltaNet hybrids: GatedDeltaRule too
            from kvexport.plugins.gated_delta import native as gdn_native

            lib, why = gdn_native.library_or_why()
        return lib, why
    from kvexport.plugins.paged_mla import native as mla_native

    return mla_native.library_for(manifest)


def ort_backend(build_dir: str | Path, manifest: Manifest, num_blocks: int, threads: int | None = None,
                kind: str = "auto", providers: list[str] | None = None, profile_prefix: str | None = None,
                both_graphs: bool = False, accuracy: str | None = None,
                local_num_blocks: int | None = None) -> _OrtBackend:
    """The onnxruntime backend for a build. kind "auto": the `onnx` attention's backend, or
    for plugin builds the native CPU op when it is built and covers the build's dtypes,
    else the reference op (with a warning). "onnx" / "native" / "reference" force one
    (an error when it cannot run this build). `local_num_blocks`: blocks of each pool of the
    local KV cache group (builds with one, kvexport/io.py; default `num_blocks`)."""
    if kind not in ORT_KINDS:
        raise KvExportError(f"onnxruntime backend kind must be one of {ORT_KINDS}, got {kind!r}")
    plugin = manifest.kv.attention == io.Attention.PLUGIN.value
    if not plugin:
        if kind not in ("auto", "onnx"):
            raise KvExportError(f"{build_dir} uses the `onnx` attention; the {kind!r} PagedAttention op needs a "
                                f"`--attention plugin` build")
        return OnnxAttentionBackend(build_dir, manifest, num_blocks, threads, providers, profile_prefix, both_graphs, accuracy,
                                    local_num_blocks)
    if kind == "onnx":
        raise KvExportError(f"{build_dir} is a `--attention plugin` build: it runs with the native or the reference op")
    if kind == "reference":
        return ReferenceOpBackend(build_dir, manifest, num_blocks, threads, providers, profile_prefix, both_graphs, accuracy,
                                  local_num_blocks)
    lib, why_not = native_library_for(manifest)
    if lib is None:
        if kind == "native":
            raise KvExportError(f"the native CPU PagedAttention op cannot run {build_dir}: {why_not}")
        log.warning("running the plugin graphs of %s with the reference PagedAttention (slow): %s", build_dir, why_not)
        return ReferenceOpBackend(build_dir, manifest, num_blocks, threads, providers, profile_prefix, both_graphs, accuracy,
                                  local_num_blocks)
    return NativeOpBackend(build_dir, manifest, num_blocks, threads, None, profile_prefix, both_graphs, accuracy,
                           local_num_blocks, library=lib)
