"""The native CPU `kvexport::PagedAttention` (cpu/paged_attention_ort.cc): building the
onnxruntime custom-op library and finding it at run time.

With it, `--attention plugin` graphs run on onnxruntime's CPU execution provider at full
speed: attention reads the KV pool through the block tables in place (no gather into a
padded batch, no mask tensors), and the pools are updated in place through IOBinding.
It covers float32 activations with float32, int8 or int4 pools; other dtypes run as TensorRT
engines (or through the reference harness in ort.py, for tests). The same library holds
`kvexport::PagedMLA` (SOURCES; plugins/paged_mla/native.py says what that op takes).

The library is compiled on the machine that uses it (`-march=native`), against the
onnxruntime C/C++ API headers. The onnxruntime wheel ships no headers, so
scripts/build_cpu_ops.sh takes them from a package registry and calls `build()`:

    python -m kvexport.plugins.paged_attention.native --include DIR [--out LIB]

Lookup order at run time: $KVEXPORT_ORT_OPS, then <prefix>/lib/kvexport/LIB_NAME of this
Python environment, then of the environment onnxruntime is installed in (they differ in
Triton's Python backend, whose stub runs on the system Python with EXECUTION_ENV_PATH's
packages). Next to the library found there, a variant compiled for a higher instruction-set
level (VARIANTS: libkvexport_ort_ops.x86-64-v4.so) is taken instead on CPUs that have that
level: images compile the op for x86-64-v3 (any AVX2 machine) and x86-64-v4 (AVX-512), so an
AVX-512 host runs 16-lane code (docs/BENCHMARKS.md "The native op built for x86-64-v3").
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from kvexport.errors import KvExportError

log = logging.getLogger(__name__)

LIB_NAME = "libkvexport_ort_ops.so"
SOURCE = Path(__file__).with_name("cpu") / "paged_attention_ort.cc"
# every op of the library (one translation unit each; SOURCE registers them all in the `kvexport` domain)
SOURCES = (SOURCE, Path(__file__).parents[1] / "paged_mla" / "cpu" / "paged_mla_ort.cc",
           Path(__file__).parents[1] / "gated_delta" / "cpu" / "gated_delta_ort.cc")
ENV = "KVEXPORT_ORT_OPS"
CXXFLAGS = ("-O3", "-fno-math-errno", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra")
LDFLAGS = ("-shared",)


# instruction-set levels a library variant may be compiled for, best first: (-march, the
# /proc/cpuinfo flags its code needs)
VARIANTS = (("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),)


def default_library() -> Path:
    return Path(sys.prefix) / "lib" / "kvexport" / LIB_NAME


def variant_path(library: Path, march: str) -> Path:
    """Where the `march` variant of `library` lives: libkvexport_ort_ops.MARCH.so beside it."""
    return library.with_name(f"{LIB_NAME.removesuffix('.so')}.{march}.so")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags")), "").split())


def best_variant(library: Path, flags: set[str] | None = None) -> Path:
    """The best VARIANTS entry beside `library` that this CPU (`flags`) can run, else `library`."""
    flags = cpu_flags() if flags is None else flags
    for march, needs in VARIANTS:
        path = variant_path(library, march)
        if path.is_file() and set(needs) <= flags:
            return path
    return library


def build(include_dir: str | Path, out: str | Path | None = None, cxx: str | None = None,
          march: str = "native", extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the op into `out` (default: default_library()) for `march` (native: this CPU;
    container images use a portable level such as x86-64-v3). Written next to its final
    place and renamed, so an interrupted build never leaves a broken library behind.

    NOTE: each of SOURCES compiles to its own object at the same time (one g++ each, the
    flags identical), then one link: with a free core each, the build takes its longest
    source's time (paged_attention_ort.cc, ~20 s of ~24 s here), not the sum."""
    include_dir = Path(include_dir)
    if not (include_dir / "onnxruntime_cxx_api.h").is_file():
        raise KvExportError(f"{include_dir} has no onnxruntime_cxx_api.h (the onnxruntime C/C++ API headers)")
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise KvExportError("building the CPU PagedAttention op needs a C++17 compiler (g++)")
    out = Path(out) if out else default_library()
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = [*CXXFLAGS, f"-march={march}", *extra_flags]
    with tempfile.TemporaryDirectory(prefix=".build-", dir=out.parent) as tmp_dir:
        objs = [Path(tmp_dir) / f"{src.stem}.o" for src in SOURCES]
        compiles = [[cxx, *flags, f"-I{include_dir}", "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
        logs = [obj.with_suffix(".log") for obj in objs]
        procs = []
        for cmd, log_path in zip(compiles, logs):
            with open(log_path, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        try:
            codes = [proc.wait() for proc in procs]
        finally:  # interrupted: no compiler left writing into the scratch folder
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        for src, cmd, code, log_path in zip(SOURCES, compiles, codes, logs):
            if code:
                raise KvExportError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n"
                                    f"{log_path.read_text()[:4000]}")  # the first errors: the cause
        tmp = Path(tmp_dir) / LIB_NAME
        link = [cxx, *flags, *LDFLAGS, *map(str, objs), "-o", str(tmp)]
        r = subprocess.run(link, capture_output=True, text=True)
        if r.returncode:
            raise KvExportError(f"linking {LIB_NAME} failed:\n{' '.join(link)}\n{r.stderr[-4000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    library.cache_clear()
    return out


def _ort_api_version() -> int:
    import onnxruntime as ort

    major, minor = (int(x) for x in ort.__version__.split(".")[:2])
    return minor if major == 1 else 10_000


@lru_cache(maxsize=1)
def library() -> Path | None:
    """The compiled op library, if there is one this onnxruntime can load; None otherwise
    (the caller falls back to the reference op and says so). A library named by
    $KVEXPORT_ORT_OPS that cannot be used is an error, not a fallback."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise KvExportError(f"${ENV}={env}: no such file")
    else:
        import onnxruntime

        # <prefix>/lib/pythonX.Y/site-packages/onnxruntime/__init__.py -> <prefix>/lib
        ort_lib = Path(onnxruntime.__file__).resolve().parents[3]
        found = [p for p in (default_library(), ort_lib / "kvexport" / LIB_NAME) if p.is_file()]
        if not found:
            return None
        path = best_variant(found[0])
    try:
        compiled_for = ctypes.CDLL(str(path)).kvexport_ort_api_version()
    except (OSError, AttributeError) as e:
        problem = f"{path} is not a loadable kvexport op library ({e}): rebuild it (scripts/build_cpu_ops.sh)"
    else:
        if compiled_for <= _ort_api_version():
            return path
        problem = (f"{path} needs onnxruntime API {compiled_for} (onnxruntime 1.{compiled_for}+), newer than the "
                   f"installed onnxruntime's: upgrade onnxruntime or rebuild against older headers")
    if env:
        raise KvExportError(f"${ENV}: {problem}")
    log.warning("%s", problem)
    return None


def supports(act_dtype: str, kv_dtype: str) -> bool:
    """Whether the native op runs a plugin graph with these activation / pool dtypes."""
    return act_dtype == "float32" and kv_dtype in ("float32", "int8", "int4")


def library_for(manifest) -> tuple[Path | None, str]:
    """(the op library for this build's plugin graphs, "") or (None, why not)."""
    from kvexport import io

    if manifest.kv.attention != io.Attention.PLUGIN.value:
        return None, f"the build's attention is {manifest.kv.attention!r}, not plugin"
    lib = library()
    act, kv = io.DType(manifest.dtype).numpy_name, io.DType(manifest.kv.dtype).numpy_name
    if lib is None:
        return None, "the CPU op is not built (scripts/build_cpu_ops.sh)"
    if not supports(act, kv):
        return None, f"the CPU op takes float32 activations with float32/int8/int4 pools, not {act}/{kv}"
    return lib, ""


def one_node_model(attrs, kv_dtype: str, scores: bool = False):
    """An ONNX model of one PagedAttention node (inputs/outputs named as in spec.py), to run
    or measure the op on its own; float32 activations, `kv_dtype` float32, int8 or int4 (uint8) pools.
    `scores`: with the optional observation_lens input and attention_scores output (spec.py)."""
    from onnx import TensorProto, helper

    from kvexport import io

    from .spec import INPUTS, OUTPUTS, SCORE_INPUT, SCORE_OUTPUT

    pool = {"int8": TensorProto.INT8, "int4": TensorProto.UINT8}.get(kv_dtype, TensorProto.FLOAT)
    types = [TensorProto.FLOAT] * 3 + [pool] * 2 + [TensorProto.INT64] * 4 + [TensorProto.FLOAT] * 2
    in_names, out_names = list(INPUTS), list(OUTPUTS)
    out_types = [TensorProto.FLOAT, pool, pool]
    if scores:
        in_names, out_names = in_names + [SCORE_INPUT], out_names + [SCORE_OUTPUT]
        types, out_types = types + [TensorProto.INT64], out_types + [TensorProto.FLOAT]
    ins = [helper.make_tensor_value_info(n, t, None) for n, t in zip(in_names, types)]
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(out_names, out_types)]
    node = helper.make_node(io.PLUGIN_OP, in_names, out_names, domain=io.PLUGIN_DOMAIN,
                            **attrs.onnx_attributes())
    return helper.make_model(helper.make_graph([node], "paged_attention", ins, outs),
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(io.PLUGIN_DOMAIN, 1)])


def in_place_binding(sess, feeds: dict):
    """An IOBinding of a one-node session (`one_node_model`) with each pool bound as both
    its input and its aliased output, as the runtime runs the op: after
    `sess.run_with_iobinding(b)` the numpy pools in `feeds` hold the updated pools."""
    import onnxruntime as ort

    b = sess.io_binding()
    pools = {n: ort.OrtValue.ortvalue_from_numpy(feeds[n]) for n in ("key_cache", "value_cache")}
    for n, arr in feeds.items():
        b.bind_ortvalue_input(n, pools[n]) if n in pools else b.bind_cpu_input(n, arr)
    b.bind_output("output")
    b.bind_ortvalue_output("key_cache_out", pools["key_cache"])
    b.bind_ortvalue_output("value_cache_out", pools["value_cache"])
    return b


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="build the native CPU PagedAttention op for onnxruntime")
    p.add_argument("--include", required=True, help="folder with onnxruntime_cxx_api.h and its siblings")
    p.add_argument("--out", default=None, help=f"library path (default {default_library()})")
    p.add_argument("--march", default=os.environ.get("KVEXPORT_MARCH", "native"),
                   help="g++ -march (default native; images: a portable level such as x86-64-v3)")
    p.add_argument("--variant", action="store_true",
                   help=f"write the library as its --march variant ({', '.join(m for m, _ in VARIANTS)}), taken at "
                        f"run time instead of the plain one on CPUs that have that level")
    args = p.parse_args(argv)
    out = args.out
    if args.variant:
        if args.march not in dict(VARIANTS):
            p.error(f"--variant needs --march {' or '.join(m for m, _ in VARIANTS)}, not {args.march}")
        out = variant_path(Path(out) if out else default_library(), args.march)
    built = build(args.include, out, march=args.march)
    if not args.variant:  # variants left beside it by an earlier build would be taken instead of it
        for march, _ in VARIANTS:
            variant_path(built, march).unlink(missing_ok=True)
    print(built)


if __name__ == "__main__":
    main()
