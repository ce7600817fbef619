"""Triton GEMMs for the decode step's projections (CUDA path): `x @ w.T` with w an `nn.Linear` weight
[N, K], and the gated form that computes the fused gate/up projection and its SiLU product in one
kernel (`silu(x @ gate.T) * (x @ up.T)`, the [M, N] product never written).

The gated kernel rounds where the unfused path does (gate and up to the model dtype, then SiLU,
rounded again, then the product), so it differs from `silu_mul(linear(x, w))` only by the GEMM's
summation order. Which launch serves which shape is measured (`kvledger.bench.step_lab`), not
assumed: cuBLAS stays the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@dataclass(frozen=True)
class GemmLaunch:
    """Tile shape, warps and pipelining depth of one Triton GEMM launch."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    splits: int = 1  # split-K: programs per output tile, each over its slice of K

    def label(self) -> str:
        split = f" k/{self.splits}" if self.splits > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{split}"

    def kernel_options(self) -> dict:
        """The tile's constexprs and Triton's launch options, as both kernels take them."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }

    def fits(self, k: int) -> bool:
        """Whether K splits into `splits` slices of whole BLOCK_K blocks (split-K needs that)."""
        return self.splits == 1 or k % (self.splits * self.block_k) == 0


if triton is not None:

    @triton.jit
    def _linear_kernel(
        X,
        W,
        OUT,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        GATED: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # the batch's row tiles run fastest: the programs that read one weight tile start together,
        # so the weight (the bytes that matter at decode sizes) comes from DRAM about once
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = W + offs_n[None, :] * stride_wn + offs_k[:, None]
        u_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows follow the gate rows
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            else:
                k_mask = offs_k < K - k * BLOCK_K
                a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
            if GATED:
                if EVEN_K:
                    u = tl.load(u_ptrs, mask=n_mask[None, :], other=0.0)
                else:
                    u = tl.load(u_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
                acc_up = tl.dot(a, u, acc_up)
                u_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dtype = OUT.dtype.element_ty
        if GATED:
            g = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
            out = (silu * up).to(dtype)
        else:
            out = acc.to(dtype)
        o_ptrs = OUT + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(o_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


if triton is not None:

    @triton.jit
    def _linear_split_k_kernel(
        X,
        W,
        OUT,
        PART,
        COUNT,
        M,
        N,
        K_SLICE,
        stride_xm,
        stride_wn,
        stride_om,
        SPLITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        # program (tile, s) multiplies K slice s of its tile into float32 partials; the tile's last
        # program to finish (a counter per tile) sums the partials in slice order, so the result
        # does not depend on which program finished last, writes the tile and resets its counter
        # for the next launch (the counters start at zero and end at zero: graph-safe)
        pid = tl.program_id(0)
        s = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % num_m
        pid_n = pid // num_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = s * K_SLICE + tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = W + offs_n[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K_SLICE, BLOCK_K):
            a = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tile = offs_m[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(PART + s * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        done = tl.atomic_add(COUNT + pid, 1, sem="acq_rel")
        if done == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t in tl.static_range(SPLITS):
                total += tl.load(PART + t * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], total.to(OUT.dtype.element_ty), mask=mask)
            tl.atomic_xchg(COUNT + pid, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 1 << 14


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """One zeroed int32 counter per output tile, shared by every split-K launch on the device (the
    launches of one stream run one after another, and each leaves its counters at zero)."""
    if tiles > _MAX_TILES:
        raise ValueError(f"split-K over {tiles} tiles: at most {_MAX_TILES}")
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return c


def _split_k(x: torch.Tensor, weight: torch.Tensor, launch: GemmLaunch) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if not launch.fits(k):
        raise ValueError(f"K={k} does not split into {launch.splits} slices of {launch.block_k}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(launch.splits, m, n, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(m, launch.block_m) * triton.cdiv(n, launch.block_n)
    _linear_split_k_kernel[(tiles, launch.splits)](
        x,
        weight,
        out,
        part,
        _counters(x.device, tiles),
        m,
        n,
        k // launch.splits,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        SPLITS=launch.splits,
        **launch.kernel_options(),
    )
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, n: int, gated: bool, launch: GemmLaunch) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton_linear needs the `triton` package")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("triton_linear needs rows of x and of the weight contiguous")
    if launch.splits > 1:
        if gated:
            raise ValueError("the gated GEMM has no split-K form")
        return _split_k(x, weight, launch)
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, launch.block_m) * triton.cdiv(n, launch.block_n),)
    _linear_kernel[grid](
        x,
        weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        GATED=gated,
        EVEN_K=k % launch.block_k == 0,
        **launch.kernel_options(),
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, launch: GemmLaunch) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (float32 accumulation)."""
    return _launch(x, weight, weight.shape[0], False, launch)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, launch: GemmLaunch) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for weight = [gate; up] of [2I, K] -> [M, I]: the fused gate/up
    projection and `silu_mul` in one kernel."""
    return _launch(x, weight, weight.shape[0] // 2, True, launch)
