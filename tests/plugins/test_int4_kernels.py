"""The int4 decode kernel of the native CPU op (plugins/paged_attention/cpu/paged_attention_int4.h:
decode_group, attend_chunk) at every instruction-set level it is compiled for: AVX-512, AVX2 and
the plain C++ fallback are chosen at compile time (-march), and the library built here exercises
only this CPU's. So the header is compiled three times into a small shim (seconds each, no
onnxruntime), and each build is checked against reference.py's int4 codec and a float64
attention: decoded values bit for bit, outputs within the op's fp32 tolerance."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvexport.plugins.paged_attention import native
from kvexport.plugins.paged_attention.reference import dequantize_int4, quantize_int4
from kvexport.plugins.paged_attention.spec import TOLERANCE

HEADER_DIR = native.SOURCE.parent

# Runs the chunk loop of paged_attention_ort.cc attend_dots over one KV head's contiguous rows.
SHIM = r"""
#include "paged_attention_int4.h"
#include <vector>
using namespace kvexport_int4;
#define API __attribute__((visibility("default")))

extern "C" {
API int lanes() { return kLanes; }

API void h2f_all(float* out) {  // every float16 bit pattern
  for (uint32_t h = 0; h < 65536; ++h) out[h] = h2f(h);
}

// x [n][d] -> pool rows [n][row_bytes(d)] (the store path)
API void quantize(const float* x, int64_t n, int64_t d, uint8_t* rows) {
  for (int64_t j = 0; j < n; ++j) quantize_row(x + j * d, d, rows + j * row_bytes(d));
}

// rows [n][row_bytes(d)] -> out [n][d] in group order
API void decode(const uint8_t* rows, int64_t n, int64_t d, float* out) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < d / kGroup; ++g) {
      vec x[kPerGroup];
      decode_group(rows + j * row_bytes(d), d, g, x);
      for (int i = 0; i < kPerGroup; ++i) store_reg(out + j * d + g * kGroup + i * kLanes, x[i]);
    }
}

// q [rows][d] (channel order, scaled), k / v [n][row_bytes(d)]; row r attends to keys [first[r], last[r]]
API void attend(const float* q_in, int rows, int64_t d, const uint8_t* k, const uint8_t* v, int64_t n,
            const int64_t* first, const int64_t* last, float softcap, float* out) {
  std::vector<float> q(q_in, q_in + rows * d), acc(rows * d, 0.f), m(rows, kvexport_simd::kNegInf), l(rows, 0.f);
  for (int r = 0; r < rows; ++r) to_group_order(q.data() + r * d, d);
  const int64_t rs = row_bytes(d);
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    int lo[kMaxRows], hi[kMaxRows];
    for (int r = 0; r < rows; ++r) {
      lo[r] = static_cast<int>(std::min<int64_t>(std::max(first[r], c0) - c0, kChunk));
      hi[r] = static_cast<int>(std::min({last[r], c0 + kChunk - 1, n - 1}) - c0);
    }
    attend_chunk(q.data(), rows, d, k + c0 * rs, v + c0 * rs, rs, lo, hi, softcap, m.data(), l.data(), acc.data());
  }
  for (int r = 0; r < rows; ++r) {
    from_group_order(acc.data() + r * d, d);
    for (int64_t i = 0; i < d; ++i) out[r * d + i] = l[r] > 0.f ? acc[r * d + i] / l[r] : 0.f;
  }
}
}
"""

LEVELS = {  # -march -> the /proc/cpuinfo flags it needs; the kernel's vector lanes
    "x86-64": ((), 8),
    "x86-64-v3": (("avx2", "fma", "f16c", "bmi2"), 8),
    "x86-64-v4": (("avx512f", "avx512bw", "avx512dq", "avx512vl"), 16),
}


@pytest.fixture(scope="module", params=sorted(LEVELS))
def shim(request, tmp_path_factory):
    march = request.param
    needs, lanes = LEVELS[march]
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernel's instruction-set paths are x86 ones")
    if not set(needs) <= native.cpu_flags():
        pytest.skip(f"this CPU cannot run -march={march} code")
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    d = tmp_path_factory.mktemp(f"int4-{march}")
    (d / "shim.cc").write_text(SHIM)
    lib = d / "shim.so"
    subprocess.run([cxx, *native.CXXFLAGS, *native.LDFLAGS, f"-march={march}", "-Wno-psabi", f"-I{HEADER_DIR}",
                    str(d / "shim.cc"), "-o", str(lib)], check=True, capture_output=True, text=True)
    so = ctypes.CDLL(str(lib))
    assert so.lanes() == lanes  # the path this level selects
    return so


def _ptr(a: np.ndarray, t=ctypes.c_float):
    return a.ctypes.data_as(ctypes.POINTER(t))


def group_order(x: np.ndarray) -> np.ndarray:
    g = x.reshape(*x.shape[:-1], -1, 16, 2)  # [.., groups, 16, (even, odd)]
    return np.swapaxes(g, -1, -2).reshape(x.shape)


def test_float16_conversion_is_exact(shim):
    out = np.zeros(65536, np.float32)
    shim.h2f_all(_ptr(out))
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(out) == nan).all()
    np.testing.assert_array_equal(out.view(np.uint32)[~nan], want.view(np.uint32)[~nan])  # -0.0 included


def test_store_and_decode_match_the_reference_codec_bit_for_bit(shim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=gen) * torch.logspace(-6, 4, 40)[:, None]  # the minimum scale up to large ones
    x[3] = 0.0  # the minimum scale
    x[5, 7] = 1e6  # saturates at 65504
    rows = np.ascontiguousarray(quantize_int4(x).numpy())
    stored = np.zeros_like(rows)
    xs = np.ascontiguousarray(x.numpy())
    shim.quantize(_ptr(xs), ctypes.c_int64(40), ctypes.c_int64(96), _ptr(stored, ctypes.c_uint8))
    np.testing.assert_array_equal(stored, rows)
    out = np.zeros((40, 96), np.float32)
    shim.decode(_ptr(rows, ctypes.c_uint8), ctypes.c_int64(40), ctypes.c_int64(96), _ptr(out))
    np.testing.assert_array_equal(out, group_order(dequantize_int4(torch.from_numpy(rows), 96).numpy()))


@pytest.mark.parametrize("rows, d, n, softcap", [(3, 64, 77, 0.0), (7, 32, 40, 0.0), (1, 160, 33, 0.0),
                                                 (5, 64, 50, 2.5), (2, 128, 16, 0.0)])
def test_attend_matches_float64_attention(shim, rows, d, n, softcap):
    gen = torch.Generator().manual_seed(rows * 1000 + d + n)
    k = np.ascontiguousarray(quantize_int4(torch.randn(n, d, generator=gen) * 2).numpy())
    v = np.ascontiguousarray(quantize_int4(torch.randn(n, d, generator=gen)).numpy())
    q = (torch.randn(rows, d, generator=gen) * d ** -0.5).numpy().astype(np.float32)
    # ragged visibility: causal ends, sliding-window starts, a row seeing a single key, chunks
    # where some rows see nothing (first and last off the 16-key chunk boundaries)
    last = np.array([n - 1 - (r * 7) % min(n, 20) for r in range(rows)], np.int64)
    first = np.array([0 if r % 2 == 0 else max(0, last[r] - 17 - r) for r in range(rows)], np.int64)
    first[-1] = last[-1] if rows > 1 else first[-1]
    out = np.zeros((rows, d), np.float32)
    shim.attend(_ptr(q), rows, ctypes.c_int64(d), _ptr(k, ctypes.c_uint8), _ptr(v, ctypes.c_uint8),
                ctypes.c_int64(n), _ptr(first, ctypes.c_int64), _ptr(last, ctypes.c_int64),
                ctypes.c_float(softcap), _ptr(out))
    kf = dequantize_int4(torch.from_numpy(k), d).double().numpy()
    vf = dequantize_int4(torch.from_numpy(v), d).double().numpy()
    for r in range(rows):
        s = kf[first[r]:last[r] + 1] @ q[r].astype(np.float64)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        p = np.exp(s - s.max())
        want = p @ vf[first[r]:last[r] + 1] / p.sum()
        assert np.abs(out[r] - want).max() <= TOLERANCE["float32"], r
