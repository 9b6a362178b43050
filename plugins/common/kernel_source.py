"""One Triton kernel configuration as `triton.compile` takes it, and the names every op's
configs.py uses for it: an op's configs module subclasses KernelSource to name its kernels
(`kernel_fn`), builds its sources, and is what its launcher, TensorRT registration (AOT
kernels), PTX compile check and GPU check read.
"""

from __future__ import annotations

from dataclasses import dataclass

# Triton type names of the activation / pool dtypes (the specs' ACT_DTYPES, KV_DTYPES; int4: byte rows)
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "i8", "int4": "u8"}
AOT_TARGETS = (80, 90)  # CUDA compute capabilities CI compiles for (A100, H100/H200)
GPU_ACT_DTYPES = ("float16", "bfloat16")  # TensorRT plugin / GPU activations (fp32: CPU tests only)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class KernelSource:
    """Everything `triton.compile` needs for one configuration (an op's subclass names the kernel)."""

    kernel: str  # the op's name of the kernel (its subclass's kernel_fn maps it to the @triton.jit function)
    signature: dict  # parameter name -> Triton type ("*fp16", "i32", "constexpr")
    constexprs: dict  # parameter name -> value
    num_warps: int
    num_stages: int

    def kernel_fn(self):
        """The @triton.jit function of `kernel` (imported late: kernels import triton)."""
        raise NotImplementedError

    def ast_source(self):
        import triton

        return triton.compiler.ASTSource(fn=self.kernel_fn(), signature=self.signature, constexprs=self.constexprs)

    def compile(self, capability: int | None = None):
        """Compiles for CUDA sm_<capability> (no GPU needed; None = the current GPU); returns
        the CompiledKernel (`.asm["ptx"]`, `.metadata.name`, `.metadata.shared`)."""
        import triton
        from triton.backends.compiler import GPUTarget

        target = None if capability is None else GPUTarget("cuda", capability, 32)
        return triton.compile(self.ast_source(), target=target,
                              options={"num_warps": self.num_warps, "num_stages": self.num_stages})
