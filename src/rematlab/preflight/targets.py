"""The devices a plan can be made for without running on them: what each holds and how fast
it computes and moves bytes, for the roofline (`rematlab.preflight.roofline`).

GPU figures are the vendors' data-sheet peaks (dense, no sparsity); `memory` is what the
driver reports as the card's total (what `torch.cuda.mem_get_info` returns), not the marketing
"80 GB". A data-sheet peak is never reached: `efficiency` gives the fraction of it that real
kernels reach (slowest, typical, fastest), so a predicted time is an interval. The typical
fractions (60 % of matmul peak on an H100, 75 % of bandwidth) are what cuBLAS GEMMs of a
transformer's sizes and PyTorch's elementwise kernels reach; a card whose best matmul is
measured (`MAMF`) has its matmul fractions scaled by it against the H100's;
`rematlab.preflight.calibrate` measures them on a device that is present instead.

On a CUDA target the allocator adds to the tensors (`rematlab.preflight.allocator`): every
block is a multiple of 512 bytes (`unit`), the CUDA context lives outside the allocator
(`context`, which the budget loses), and cuBLAS keeps a workspace inside it per handle
(`workspace`; two handles are resident, `blas_resident`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from rematlab.core.files import cache_dir, write_text
from rematlab.core.units import parse_bytes
from rematlab.exceptions import ConfigError
from rematlab.plans.offload import Link
from rematlab.preflight.allocator import MIN_BLOCK
from rematlab.preflight.calibrate import VERSION, measure
from rematlab.preflight.cards import (
    CUBLAS_DEFAULT,
    CUBLAS_HOPPER,
    CUBLASLT,
    CUDA_CONTEXT,
    HIPBLAS_DEFAULT,
    HIPBLAS_GFX94,
    HIPBLASLT,
    blas_resident,
    card_terms,
)

MiB = 1 << 20
GiB = 1 << 30
KiB = 1 << 10

# What torch.utils.checkpoint's own host work costs per region (saved-tensor hooks, the RNG
# state stashed and restored, the recomputation's frames), low/typical/high seconds: an
# assumption for a data-sheet target. `benchmarks/checkpoint_host.py` measured 0.2 ms on this
# 2-core CPU (a one-layer region, less its plain step and its forward); a faster host runs
# it in less, so 0.05-0.4 ms. On a GPU it overlaps with the kernels queued before it.
HOST_CHECKPOINT = (50e-6, 200e-6, 400e-6)
# Host links offload copies over, (device-to-host, host-to-device) bytes/s of pinned copies
# by the copy engine, the low end of what is measured, as issue 61 gathered: PCIe Gen5 x16
# (H100, H200, MI300X) 35-53 GB/s, Gen4 x16 (A100, L40S, RTX 4090, MI250X) about 25 GB/s,
# Gen3 (V100) about 12 GB/s. A Grace Hopper card's NVLink-C2C is far faster, and not alike
# both ways: nvbandwidth on GH200, CE GPU->CPU 169.9-170.1 GB/s, CPU->GPU 411.6-421.1 GB/s
# (NVIDIA/Megatron-LM issue 6491, 2026-08-15): `GH200_LINK`, for a profile of one.
HOST_LINKS = {"h100-80gb": (35e9, 35e9), "h200": (35e9, 35e9), "mi300x": (35e9, 35e9),
              "v100-32gb": (12e9, 12e9)}
GH200_LINK = (170e9, 411e9)
DEFAULT_LINK = (25e9, 25e9)  # a card with no row: PCIe Gen4
HOST_MEMORY = 128 * 1024 * MiB  # pinned host bytes a job may hold per card: a default
# What selective checkpointing's dispatch modes add per op and per pass (the forward's caching
# mode, the recomputation's replay), low/typical/high seconds: `benchmarks/
# selective_overhead.py` measured 24-28 µs per op for both passes on this 2-core CPU (12-14 per
# pass); a faster host runs it in less. Every target pays it for an op-level option's ops.
HOST_SELECTIVE = (6e-6, 12e-6, 14e-6)


@dataclass(frozen=True)
class Target:
    """A device to plan for. `flops` maps a dtype name to peak matmul FLOP/s; `bandwidth` is
    memory bytes/s, what every other op is priced by (`rematlab.preflight.roofline`);
    `overhead` seconds per op (launch and dispatch); `efficiency` and `bandwidth_efficiency`
    the (slowest, typical, fastest) fractions of those peaks reached. `calibrated`: the
    figures were measured here."""

    name: str
    kind: str  # "cpu" or "cuda" (ROCm runs through torch.cuda too)
    memory: int
    flops: dict[str, float]
    bandwidth: float
    overhead: tuple[float, float, float]
    # For a data-sheet profile these are assumptions, not measurements (no GPU has run here):
    # the fractions of dense peak a training step's matmuls reach, from a small layer's (0.35)
    # to a large GEMM's (0.8), and of peak bandwidth an elementwise kernel streams at. A
    # calibrated target measures both (`rematlab.preflight.calibrate`).
    efficiency: tuple[float, float, float] = (0.35, 0.6, 0.8)
    bandwidth_efficiency: tuple[float, float, float] = (0.5, 0.75, 0.9)
    context: int = 0
    workspace: int = 0
    # host seconds of torch.utils.checkpoint's own work per region (low, typical, high): an
    # assumption (`HOST_CHECKPOINT`) unless calibrated (`extra["checkpoint"]`)
    checkpoint_host: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # host seconds per op and pass of selective checkpointing (`HOST_SELECTIVE`)
    selective_host: tuple[float, float, float] = HOST_SELECTIVE
    source: str = ""
    calibrated: bool = False
    extra: dict = field(default_factory=dict)
    # the host link offload copies over (`rematlab.plans.offload`): bytes/s device-to-host
    # and host-to-device (`HOST_LINKS`), and the host bytes a job may pin per card
    host_link: tuple[float, float] = DEFAULT_LINK
    host_memory: int = HOST_MEMORY

    @property
    def unit(self) -> int:
        """Allocation granularity: the CUDA caching allocator's 512-byte blocks."""
        return MIN_BLOCK if self.kind == "cuda" else 1

    @property
    def blas_resident(self) -> int:
        """Bytes of BLAS workspaces a training step leaves allocated: one per cuBLAS handle and
        stream (`CublasHandlePool.cpp`: `setWorkspaceForHandle`, kept for the process's
        life), and handles are per thread — the forward runs on the caller's thread, the
        backward on autograd's device thread (`torch/csrc/autograd/engine.cpp`) — so two;
        each counted as the allocator hands it out (`allocator.fresh`)."""
        return blas_resident(self.workspace)

    @property
    def usable(self) -> int:
        """Bytes the allocator can hand out: the card less the CUDA context."""
        return self.memory - self.context

    @property
    def link(self) -> Link:
        return Link(*self.host_link, self.host_memory)

    def matmul_rate(self, dtype: str) -> float:
        return self.flops.get(dtype, self.flops["float32"])

    def to_dict(self) -> dict:
        return asdict(self)


def _gpu(name: str, memory_mib: int, fp32: float, bf16: float, bandwidth: float,
         source: str, workspace: int = CUBLAS_DEFAULT + CUBLASLT, fp16: float | None = None
         ) -> Target:
    """A data-sheet profile. `workspace`: the BLAS workspaces torch allocates per handle and
    stream (`BLAS_WORKSPACES`). `overhead`: an assumption, 3-10 µs per op of eager dispatch
    and kernel launch (5 typical), until a GPU here calibrates it; `checkpoint_host` the
    assumed `HOST_CHECKPOINT`. A card with a measured best bf16 matmul (`MAMF`) has its matmul
    efficiencies scaled by it (`mamf_efficiency`)."""
    tera = 1e12
    mamf = MAMF.get(name)
    link = HOST_LINKS.get(name, DEFAULT_LINK)
    return Target(
        name=name, kind="cuda", memory=memory_mib * MiB,
        flops={"float32": fp32 * tera, "bfloat16": bf16 * tera,
               "float16": (fp16 if fp16 is not None else bf16) * tera},
        bandwidth=bandwidth, overhead=(3e-6, 5e-6, 10e-6), checkpoint_host=HOST_CHECKPOINT,
        context=CUDA_CONTEXT, workspace=workspace, host_link=link,
        efficiency=mamf_efficiency(mamf) if mamf is not None else Target.efficiency,
        source=source + (f"; best bf16 matmul {mamf:.1%} of peak ({MAMF_SOURCE})"
                         if mamf is not None else ""))


# Maximum achievable matmul FLOPS (MAMF): the best bf16 `torch.matmul` over a brute-force
# search of shapes, as a fraction of the dense peak, measured on each card with torch 2.5-2.7
# (ROCm: TunableOp on). Cards differ: an A100 reaches more of its peak than an H100, an
# MI300X far less. A training step's matmuls are not the best shape, so a profile's
# efficiencies are the default ones scaled by its card's MAMF against the H100's: the H100
# keeps (0.35, 0.6, 0.8), which the published H100 runs bear out (`tests/data/published`:
# torchtitan's 8B on 8 and 128 H100s priced 5-8 % fast), and no card's fastest end passes its
# MAMF. A card with no MAMF row keeps the default efficiencies.
MAMF_SOURCE = ("stas00/ml-engineering compute/accelerator/README.md at b9e2972, 'Maximum "
               "Achievable Matmul FLOPS comparison table', BF16")
# The H200 is the H100's chip (GH100) with more memory: the table's later versions say "H200
# is the same". The MI250X GCD: the table's v1 rows (ROCm 6.2, one GCD).
MAMF = {"a100-80gb": 0.869, "h100-80gb": 0.803, "h200": 0.803, "mi300x": 0.514,
        "mi250x-gcd": 0.767}


def mamf_efficiency(mamf: float) -> tuple[float, float, float]:
    """The (slowest, typical, fastest) matmul efficiencies of a card whose best matmul
    reaches `mamf` of its peak (`MAMF`)."""
    scale = mamf / MAMF["h100-80gb"]
    low, typical, high = Target.efficiency
    return (low * scale, typical * scale, min(high * scale, mamf))


# Data sheets (dense tensor-core peaks; FP32 is non-tensor FP32, which PyTorch uses for fp32
# matmuls unless TF32 is switched on). Memory in MiB as torch reports the card
# (`get_device_properties().total_memory`, `mem_get_info`'s total), from published logs of
# torch on each card, not the data sheet's "80 GB": H100 80GB HBM3 81,082-81,090 (three logs),
# A100-SXM4-80GB 79.14 GiB, H200 143,156, RTX 4090 24,563, L40S 45,589, V100 32 GB 31.75 GiB
# and an MI250X GCD 63.98 GiB (out-of-memory messages' "total capacity"). Not found for the
# L40 (taken as the L40S, the same 48 GB board) and the MI300X (its nominal 192 GiB): a
# calibrated `cuda` target reads the card's own figure.
PROFILES: dict[str, Target] = {t.name: t for t in (
    _gpu("a100-80gb", 81039, 19.5, 312, 2.039e12,
         "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): FP32 19.5 TFLOPS, BF16 312 "
         "TFLOPS, HBM2e 2,039 GB/s"),
    _gpu("h100-80gb", 81090, 67, 989.4, 3.35e12,
         "NVIDIA H100 Tensor Core GPU data sheet (SXM5): FP32 67 TFLOPS, BF16 989 TFLOPS "
         "(1,979 with sparsity), HBM3 3.35 TB/s", workspace=CUBLAS_HOPPER + CUBLASLT),
    _gpu("h200", 143156, 67, 989.4, 4.8e12,
         "NVIDIA H200 Tensor Core GPU data sheet (SXM): FP32 67 TFLOPS, BF16 989 TFLOPS, "
         "HBM3e 141 GB at 4.8 TB/s", workspace=CUBLAS_HOPPER + CUBLASLT),
    _gpu("rtx4090", 24563, 82.6, 165.2, 1.008e12,
         "NVIDIA Ada Lovelace GPU architecture whitepaper, appendix A (GeForce RTX 4090): "
         "FP32 82.6 TFLOPS, BF16 tensor with FP32 accumulate 165.2 TFLOPS, GDDR6X 1,008 GB/s"),
    _gpu("mi300x", 196608, 163.4, 1307.4, 5.3e12,
         "AMD Instinct MI300X accelerator data sheet: FP32 163.4 TFLOPS, BF16 1,307.4 TFLOPS,"
         " HBM3 192 GB at 5.3 TB/s", workspace=HIPBLAS_GFX94 + HIPBLASLT),
    _gpu("v100-32gb", 32512, 15.7, 15.7, 0.9e12,
         "NVIDIA Tesla V100 data sheet (SXM2 32GB): FP32 15.7 TFLOPS, Tensor (FP16) 125 "
         "TFLOPS, HBM2 900 GB/s; its tensor cores take no BF16: bf16 is priced at FP32's rate",
         fp16=125),
    _gpu("l40s", 45589, 91.6, 362.05, 0.864e12,
         "NVIDIA L40S data sheet: FP32 91.6 TFLOPS, BF16 tensor 362.05 TFLOPS (733 with "
         "sparsity), GDDR6 48 GB at 864 GB/s"),
    _gpu("l40", 45589, 90.5, 181.05, 0.864e12,
         "NVIDIA L40 data sheet: FP32 90.5 TFLOPS, BF16 tensor 181.05 TFLOPS (362.1 with "
         "sparsity), GDDR6 48 GB at 864 GB/s"),
    # torch sees each of an MI250X's two dies (GCDs) as a device: half the board's figures
    _gpu("mi250x-gcd", 65516, 95.7 / 2, 383.0 / 2, 1.6e12,
         "AMD Instinct MI250X data sheet, per GCD (half the board): FP32 matrix 95.7 TFLOPS, "
         "BF16 383.0 TFLOPS, HBM2e 128 GB at 3.2 TB/s for the board",
         workspace=HIPBLAS_DEFAULT + HIPBLASLT),
)}
# Which profile a device is, by a part of the name torch gives it (`get_device_name`), the
# longer names first ("L40S" before "L40")
DEVICE_NAMES = (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-80gb"),
                ("V100", "v100-32gb"), ("L40S", "l40s"), ("L40", "l40"),
                ("RTX 4090", "rtx4090"), ("MI300X", "mi300x"), ("MI250X", "mi250x-gcd"))
# profiles of the SXM card alone: the PCIe card of the same name is slower (H100 PCIe: FP32 51
# TFLOPS, BF16 756, HBM2e 2.0 TB/s against 67, 989 and 3.35)
SXM_ONLY = frozenset(("h100-80gb", "h200"))
ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "4090": "rtx4090",
           "rtx-4090": "rtx4090", "mi300": "mi300x", "h200-141gb": "h200", "v100": "v100-32gb",
           "mi250x": "mi250x-gcd"}


BOUNDS = {"slow": 0, "typical": 1, "fast": 2}


def profile_of_device(device_name: str, memory: int | None = None) -> Target | None:
    """The data-sheet profile of a device named as torch names it ("NVIDIA H100 80GB HBM3")
    with `memory` bytes (`total_memory`, when known); None for one not in `PROFILES`. The
    name's model is not enough: an "A100" may have 40 GB, an "H100" may be the PCIe card,
    whose rates are lower than the SXM profile's. A card whose memory is more than 10 % off
    its profile's, or whose form factor is not the profile's, has none (a calibrated target,
    `calibrated("cuda")`, measures it instead)."""
    name = device_name.upper()
    found = next((PROFILES[p] for part, p in DEVICE_NAMES if part in name), None)
    if found is None or ("PCIE" in name and found.name in SXM_ONLY):
        return None
    if memory is not None and abs(memory - found.memory) > 0.1 * found.memory:
        return None
    return found


def resolve_target(target: str | Target | dict | None, device_type: str = "cpu") -> Target:
    """A `Target` from a profile name (`PROFILES`, or "cpu": this machine, calibrated), a
    JSON file of a profile the user gives, a dict of its fields, or None: the device the
    example batch is on (this CPU; a present GPU, calibrated)."""
    if isinstance(target, Target):
        return target
    if isinstance(target, dict):
        return _from_fields(target, "the given target")
    if target is None:
        target = "cpu" if device_type != "cuda" else "cuda"
    name = ALIASES.get(target.lower(), target.lower())
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("target cuda is the GPU here, and there is none: name a profile ("
                          f"{', '.join(PROFILES)}) or give a profile.json")
    if name in ("cpu", "cuda"):
        return calibrated(name)
    if name in PROFILES:
        return PROFILES[name]
    path = Path(target)
    if path.suffix == ".json":
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:  # nested past any profile
            raise ConfigError(f"cannot read the target profile {target}: "
                              f"{type(exc).__name__}: {str(exc)[:200]}") from None
        return _from_fields(fields, str(path))
    raise ConfigError(f"unknown target {str(target)[:80]!r}: choose cpu, cuda (the GPU here), "
                      f"{', '.join(PROFILES)}, or a profile.json")


def _from_fields(fields: dict, where: str) -> Target:
    """A user's profile: name, kind, memory (bytes or '24GiB'), flops and bandwidth needed;
    the rest as a GPU's defaults (a CPU has no CUDA context and no cuBLAS workspace)."""
    need = {"name", "memory", "flops", "bandwidth"}
    if not isinstance(fields, dict) or not need <= fields.keys():
        raise ConfigError(f"{where}: a target profile needs {sorted(need)}")
    kind = fields.get("kind", "cuda")
    memory = fields["memory"]
    flops = fields["flops"]
    if isinstance(flops, (int, float)):
        flops = {"float32": float(flops)}
    try:
        base = _gpu(str(fields["name"]), 0, 1, 1, 1.0, str(fields.get("source", where)))
        known = {k: v for k, v in fields.items() if k in Target.__dataclass_fields__}
        return Target(**{
            **asdict(base), "kind": kind,
            **({"context": 0, "workspace": 0} if kind == "cpu" else {}),
            **known,
            "memory": parse_bytes(memory) if isinstance(memory, str) else int(memory),
            "flops": {k: float(v) for k, v in flops.items()},
            "overhead": tuple(fields.get("overhead", base.overhead)),
            "efficiency": tuple(fields.get("efficiency", base.efficiency)),
            "bandwidth_efficiency": tuple(fields.get("bandwidth_efficiency",
                                                     base.bandwidth_efficiency)),
            "checkpoint_host": tuple(fields.get("checkpoint_host", base.checkpoint_host)),
            "selective_host": tuple(fields.get("selective_host", base.selective_host)),
            "host_link": tuple(float(v) for v in fields.get("host_link", base.host_link)),
        })
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad target profile: {exc}") from None


@functools.cache
def calibrated(kind: str = "cpu") -> Target:
    """This machine's CPU, or the GPU here, as a measured `Target`
    (`rematlab.preflight.calibrate`), kept in the cache folder (`rematlab.core.files.cache_dir`)
    per device model, thread count, torch version and calibration `VERSION` (a file of
    another version is never read): delete the file to calibrate again."""
    path = cache_dir() / f"roofline-v{VERSION}-{_machine(kind)}.json"
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        fields = json.loads(path.read_text())
        if fields.pop("version") == VERSION:  # a file this rematlab's calibration wrote
            return Target(**{**fields, **{k: tuple(fields[k]) for k in _TUPLES if k in fields}})
    fields = measure(kind)
    if kind == "cuda":  # the terms a data-sheet profile has, for this card
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        sheet = profile_of_device(props.name, props.total_memory)
        rocm = getattr(props, "gcnArchName", None) if torch.version.hip else None
        fields.update(card_terms(sheet.name if sheet else None, (props.major, props.minor),
                                 torch.version.cuda, rocm))
    target = Target(**fields)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps({**target.to_dict(), "version": VERSION}))
    return target


_TUPLES = ("overhead", "efficiency", "bandwidth_efficiency", "checkpoint_host",
           "selective_host", "host_link")


def _machine(kind: str) -> str:
    """A file-name-safe key for the device the rates are measured on."""
    if kind == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1] for line in f
                         if line.startswith("model name")), name)
    key = f"{kind}-{name.strip()}-{torch.get_num_threads()}t-torch{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", key)
