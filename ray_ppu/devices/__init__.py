"""Device backends: which accelerator a worker drives and how it talks to its peers.

``ppu``: the PPU's CUDA-compatible stack (torch.cuda + NCCL); runs unchanged on NVIDIA GPUs.
``cpu``: gloo on the CPU, for laptops and CI; Megatron-Core's CUDA requests are answered by
:mod:`ray_ppu.devices.cpu_shim`.

torch is imported where a function needs it: the plan's device table
(:mod:`ray_ppu.devices.specs`) is read by ``--dry-run``, which needs no torch.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Literal, Optional

if TYPE_CHECKING:
    import torch

Backend = Literal["ppu", "cpu"]


def resolve(requested: str) -> Backend:
    """``auto`` → ``ppu`` when this process can use a CUDA(-compatible) device, else ``cpu``."""
    if requested == "cpu":
        return "cpu"
    import torch

    if requested == "auto":
        return "ppu" if torch.cuda.is_available() else "cpu"
    if requested == "ppu" and not torch.cuda.is_available():
        raise RuntimeError(
            "cluster.device=ppu but torch.cuda reports no device in this process; "
            "check the PPU driver/runtime, or use cluster.device=cpu"
        )
    if requested not in ("ppu", "cpu"):
        raise ValueError(f"unknown device backend {requested!r}: expected auto, ppu or cpu")
    return requested  # type: ignore[return-value]


def transformer_engine_error() -> Optional[str]:
    """None when Transformer Engine's torch layers import here (what Megatron-Core's TE spec
    uses), else why not (not installed, or a build broken against this torch)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def dist_backend(backend: Backend) -> str:
    """torch.distributed backend for a device backend (PPU speaks NCCL through its CCL)."""
    return "nccl" if backend == "ppu" else "gloo"


def torch_device(backend: Backend) -> torch.device:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "ppu" else torch.device("cpu")


@contextlib.contextmanager
def bound(backend: Backend, device_id: int) -> Iterator[None]:
    """Run the body with this thread bound to its device.

    ppu: ``torch.cuda.set_device(device_id)``; the id is the one Ray assigned (never rewrite
    CUDA_VISIBLE_DEVICES here: CUDA may already be initialised). cpu: the CUDA→CPU shim.
    """
    if backend == "ppu":
        import torch

        torch.cuda.set_device(device_id)
        yield
    else:
        from ray_ppu.devices.cpu_shim import cpu_mode

        with cpu_mode():
            yield


def kernel_failure_is_fatal(error: RuntimeError) -> bool:
    """Whether a kernel's error is one no other kernel would avoid (out of memory, a broken
    CUDA context): raised as it is, not answered by falling back to a slower kernel."""
    import torch

    text = str(error)
    return (isinstance(error, torch.OutOfMemoryError) or "CUDA error" in text
            or "illegal memory access" in text or "device-side assert" in text)
