"""What a CUDA card adds to a step's tensors, beside the data sheet (`preflight.targets`):
the BLAS workspaces torch allocates through the caching allocator, and the CUDA context that
lives outside it. Used by data-sheet profiles, by the calibrated `cuda` target and by a
measured plan on a GPU here (`planning.planner.prepare`), so that all three count the same.
"""

from __future__ import annotations

import os
import re

import torch

from rematlab.preflight.allocator import fresh

MiB = 1 << 20
KiB = 1 << 10

# BLAS workspaces per handle and stream, from torch's `aten/src/ATen/cuda/CublasHandlePool.cpp`
# (`parseChosenWorkspaceSize`, `parseCUDABlasLtWorkspaceSize`), without the environment
# variables that change them (`CUBLAS_WORKSPACE_CONFIG`, `CUBLASLT_WORKSPACE_SIZE`):
# cuBLAS `:4096:2:16:8` (8 MiB + 128 KiB), 32 MiB on Hopper (sm90); cuBLASLt 1 MiB, counted
# apart (it shares cuBLAS's only when `TORCH_CUBLASLT_UNIFIED_WORKSPACE` is set). ROCm:
# hipBLAS 32 MiB, 128 MiB on gfx94x/gfx95x (MI300), hipBLASLt 76 MiB.
CUBLAS_DEFAULT = 4096 * KiB * 2 + 16 * KiB * 8
CUBLAS_HOPPER = 4096 * KiB * 8
CUBLASLT = 1024 * KiB
HIPBLAS_DEFAULT, HIPBLAS_GFX94 = 32 * MiB, 128 * MiB
HIPBLASLT = 76 * MiB
BLAS_HANDLES = 2  # the caller's thread (forward, optimizer) and autograd's device thread

# The CUDA context (driver, kernels of torch's libraries loaded lazily), outside the caching
# allocator: what a process holds on the card beyond the allocator's reserve after a training
# step (`mem_get_info`'s total - free - `memory_reserved`). Measured, by card and CUDA major
# version: 751-767 MiB on an H200 (driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, five
# models one per process: tests/data/gpu/h200-torch2.11). Reports for CUDA 12 with lazy module
# loading give 400-600 MiB on A100/H100; a card and version not measured is budgeted at the
# largest context measured, so that no budget counts on memory the context takes.
CUDA_CONTEXTS: dict[tuple[str, int], int] = {("h200", 13): 767 * MiB}
CUDA_CONTEXT = max(CUDA_CONTEXTS.values())


def cuda_context(profile: str | None, cuda_version: str | None) -> int:
    """The CUDA context measured for a card (its profile's name) and CUDA version ("13.0"),
    else the largest measured (`CUDA_CONTEXTS`)."""
    major = int(cuda_version.split(".")[0]) if cuda_version else None
    return CUDA_CONTEXTS.get((profile or "", major or 0), CUDA_CONTEXT)


def blas_workspace(capability: tuple[int, int] | None, rocm_arch: str | None = None,
                   env: dict[str, str] | None = None) -> int:
    """The BLAS workspaces torch allocates per handle and stream on a card, as
    `CublasHandlePool.cpp` sizes them (see `CUBLAS_DEFAULT`): by architecture — Hopper
    (compute capability 9.x) 32 MiB, others 8 MiB + 128 KiB, plus cuBLASLt's 1 MiB; on ROCm
    hipBLAS 32 MiB (128 MiB on gfx94x/gfx95x) plus hipBLASLt's 76 MiB — unless
    `CUBLAS_WORKSPACE_CONFIG` (":SIZE_KiB:COUNT" pairs) or `CUBLASLT_WORKSPACE_SIZE` (KiB) set
    them."""
    env = dict(os.environ) if env is None else env
    if rocm_arch is not None:
        big = rocm_arch.startswith(("gfx94", "gfx95"))
        return (HIPBLAS_GFX94 if big else HIPBLAS_DEFAULT) + HIPBLASLT
    blas = CUBLAS_HOPPER if capability is not None and capability[0] == 9 else CUBLAS_DEFAULT
    config = env.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        blas = sum(int(size) * KiB * int(count) for size, count in pairs)
    lt = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    return blas + (int(lt) * KiB if lt.isdigit() else CUBLASLT)


def device_blas_workspace(device: torch.device) -> int:
    """`blas_workspace` of the GPU `device` here."""
    props = torch.cuda.get_device_properties(device)
    rocm = getattr(props, "gcnArchName", None) if torch.version.hip else None
    return blas_workspace((props.major, props.minor), rocm)


def blas_resident(workspace: int) -> int:
    """Bytes of BLAS workspaces a training step holds: `workspace` per handle, two handles
    (`Target.blas_resident`), each as the allocator hands it out."""
    return BLAS_HANDLES * fresh(workspace)


def card_terms(profile: str | None, capability: tuple[int, int] | None,
               cuda_version: str | None, rocm_arch: str | None = None) -> dict[str, int]:
    """A card's `context` and `workspace` (the `Target` fields), from its data-sheet profile's
    name, compute capability, CUDA version and ROCm architecture: what the calibrated `cuda`
    target takes on the card here, and what the fact files' replay takes for a card recorded."""
    return {"context": cuda_context(profile, cuda_version),
            "workspace": blas_workspace(capability, rocm_arch)}
