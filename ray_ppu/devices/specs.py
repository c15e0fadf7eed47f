"""What one device of each supported kind can do: bf16 peak (for MFU) and memory (for the
memory plan). ``cluster.accelerator`` names the kind; config values override both figures."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bf16_tflops: float
    """Dense bf16 peak per device, TFLOP/s (the MFU denominator)."""
    memory_gib: float
    """Device memory, GiB."""


SPECS: dict[str, DeviceSpec] = {
    # 123 TFLOPS: the vendor figure the reference's MFU table divides by ("规格值123");
    # 96 GB HBM2e per the published 810E specification.
    "ppu-810e": DeviceSpec("T-Head Zhenwu 810E (PPU)", 123.0, 96.0),
    # NVIDIA datasheets, dense (no sparsity) bf16 Tensor Core peaks; memory as torch reports it.
    "h100": DeviceSpec("NVIDIA H100 SXM", 989.0, 79.6),
    "h200": DeviceSpec("NVIDIA H200 SXM", 989.0, 139.8),
    "a100": DeviceSpec("NVIDIA A100 80GB", 312.0, 80.0),
}


def accelerator_of(device_name: str) -> str:
    """The SPECS key of a device torch names (``torch.cuda.get_device_name``): an NVIDIA part
    by its model, anything else CUDA-compatible taken for a PPU."""
    return next((k for k in ("h200", "h100", "a100") if k in device_name.lower()), "ppu-810e")


def peak_tflops(accelerator: str, override: "float | None" = None) -> float:
    """The MFU denominator: ``cluster.peak_tflops`` when set, else the table's bf16 peak."""
    return override or SPECS[accelerator].bf16_tflops


def run_peak_tflops(cluster, backend: str) -> "float | None":
    """The peak of the devices a run trains on (``cluster``: its ClusterConfig; ``backend``: the
    device kind the workers got, ``ppu`` or ``cpu``), or None where it is unknown: on a CPU the
    table's figure is a PPU's, against which the CPU would read ``MFU 0.0%``;
    ``cluster.peak_tflops`` declares one."""
    if backend == "cpu" and not cluster.peak_tflops:
        return None
    return peak_tflops(cluster.accelerator, cluster.peak_tflops)
