"""The CUDA FP8 decode kernel's host side, without a GPU: NVRTC compiles every variant the engine
and the lab launch (where a libnvrtc can be loaded; CI has none), launches are checked, and a
machine without CUDA says why and keeps the Triton kernel."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.attention import cuda_fp8_decode as cuda


def nvrtc_or_skip():
    try:
        return cuda._Nvrtc()
    except OSError as e:
        pytest.skip(f"no NVRTC here: {e}")


@pytest.mark.parametrize(
    "head_dim,group,launch,seq_i64",
    [
        (128, 2, cuda.DEFAULT_LAUNCH, False),
        (128, 2, cuda.DEFAULT_LAUNCH, True),
        (128, 4, cuda.DEFAULT_LAUNCH, False),
        (64, 3, cuda.DEFAULT_LAUNCH, False),
        (256, 1, cuda.DEFAULT_LAUNCH, False),
        (128, 2, cuda.CudaDecodeLaunch(4, 64, 3, loads_only=True), False),
        (128, 2, cuda.CudaDecodeLaunch(8, 128, 2), False),
    ],
)
def test_every_variant_compiles_to_a_hopper_cubin(head_dim, group, launch, seq_i64):
    nvrtc = nvrtc_or_skip()
    options = cuda.compile_options(head_dim, group, True, launch, "sm_90a", seq_i64)
    cubin = nvrtc.compile(cuda.SOURCE.read_text(), cuda.SOURCE.name, options)
    assert cubin[:4] == b"\x7fELF"


def test_a_compile_error_is_raised_with_nvrtcs_log():
    nvrtc = nvrtc_or_skip()
    with pytest.raises(RuntimeError, match="could not compile broken.cu"):
        nvrtc.compile('extern "C" __global__ void k() { undefined_name; }', "broken.cu", ["--gpu-architecture=sm_90a"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_without_cuda_it_says_why_and_the_backend_keeps_triton(caplog):
    pytest.importorskip("triton")
    from kvledger.engine.attention.triton_paged import TritonPagedBackend

    assert cuda.available() == "no CUDA device"
    backend = TritonPagedBackend(fp8_decode="cuda")
    q = torch.empty(2, 16, 128, dtype=torch.bfloat16)
    kp = torch.empty(8, 10, 128, dtype=torch.float8_e4m3fn)
    with caplog.at_level("WARNING"):
        assert backend._uses_cuda_fp8(q, kp, 1) is False
        assert backend._uses_cuda_fp8(q, kp, 1) is False  # decided once, said once
    assert [r.message for r in caplog.records].count(
        "FP8 decode stays in Triton: the CUDA kernel cannot run (no CUDA device)"
    ) == 1
    assert TritonPagedBackend(fp8_decode="triton")._uses_cuda_fp8(q, kp, 1) is False
    with pytest.raises(ValueError, match="fp8_decode must be"):
        TritonPagedBackend(fp8_decode="cutlass")


def test_the_libraries_are_looked_for_by_their_own_names(tmp_path, monkeypatch):
    """libcudart or libnvrtc-builtins next to the real ones are never taken for them."""
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    for name in ("libcudart-1a2b.so.12", "libcuda_fake.so", "libnvrtc-builtins-9c.so.12", "libnvrtc-5f3e.so.12"):
        (lib / name).write_bytes(b"")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert cuda._library_candidates("libcuda") == ["libcuda.so.1", "libcuda.so"]
    nvrtc = cuda._library_candidates("libnvrtc")
    assert nvrtc[0] == str(lib / "libnvrtc-5f3e.so.12")
    assert not any("builtins" in c or "cudart" in c for c in nvrtc)
