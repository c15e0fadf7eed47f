"""Run the unmodified Megatron-Core package on CPU processes (gloo), for laptops and CI.

Megatron-Core asks for CUDA in a few hundred places: ``torch.cuda.current_device()``,
``device="cuda"`` factories, ``.cuda()``, ``param.type() == "torch.cuda.FloatTensor"``,
streams, and the CUDA RNG state that its RNG tracker forks. We never edit its files; instead
this module answers those requests on the CPU:

* :class:`CudaToCpuMode`, a ``TorchFunctionMode``, rewrites CUDA devices to the CPU in every
  torch call made on the thread where it is active, makes ``Tensor.cuda()`` a no-op, makes
  ``Tensor.type()`` answer with the CUDA type name Megatron compares against, and hands the
  MoE all-to-all its split sizes as lists (what Megatron's CUDA path makes of them), and
  multiplies half-precision matrices in fp32 (:data:`_HALF_MATMULS`).
* :func:`install` replaces the ``torch.cuda`` functions Megatron calls (device queries, streams,
  events, synchronisation, RNG) with CPU stand-ins; the "CUDA" RNG *is* the CPU default
  generator, so Megatron's RNG tracker forks the generator CPU ops actually draw from.

A TorchFunctionMode is per thread: enter :func:`cpu_mode` on the thread that runs the model
(Ray Train runs the train function in its own thread).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")

# Tensor.type() names for the dtypes Megatron compares against (e.g. in DDP's grad buffers
# and the fp16/bf16 optimizer wrappers).
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


# bf16 / fp16 matrix products. On a CPU without native half-precision GEMM (AVX2 only, as on
# the 2-core CI machines) torch's fallback kernels run them 8-15x slower than fp32: the
# output layer's input gradient (32 tokens x 151,936 vocab x 64) takes 2.1 s in bf16 against
# 0.06 s in fp32. The mode multiplies in fp32 and rounds the result to the inputs' dtype:
# fp32 accumulation and a half-precision result, what the fallback kernel and a device's
# tensor cores compute too (to the order of the sums).
_HALF_MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.nn.functional.linear,
                 torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.__matmul__}
_HALF = (torch.bfloat16, torch.float16)


def _matmul_in_fp32(func, args: tuple, kwargs: dict):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if kwargs or not tensors or any(t.dtype not in _HALF or t.device.type != "cpu"
                                    for t in tensors):
        return None
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        return None
    return func(*(a.float() if isinstance(a, torch.Tensor) else a for a in args)).to(dtype)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    # A bare int is how torch spells "CUDA device n".
    return isinstance(device, int) and not isinstance(device, bool)


def _to_cpu(device: Any) -> Any:
    return _CPU if _is_cuda(device) else device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU for every torch call on this thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs a CUDA driver
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
            # t.type("torch.cuda.FloatTensor") -> the CPU type of the same dtype
            args = tuple(a.replace(".cuda.", ".") if isinstance(a, str) else a for a in args)
        elif func is torch.Tensor.to:
            args = tuple(_to_cpu(a) if i > 0 else a for i, a in enumerate(args))
        elif func in _HALF_MATMULS:
            product = _matmul_in_fp32(func, args, kwargs)
            if product is not None:
                return product
        elif func is torch.distributed.all_to_all_single:
            # MoE token dispatch: Megatron copies the split sizes to host numpy arrays only
            # when they are CUDA tensors; left as CPU tensors, c10d refuses them as sizes
            for key in ("output_split_sizes", "input_split_sizes"):
                if torch.is_tensor(kwargs.get(key)):
                    kwargs[key] = kwargs[key].tolist()
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def wait_event(self, *_: Any) -> None:
        pass

    def record_event(self, *_: Any) -> "_CpuStream":
        return self

    def record(self, *_: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, *_: Any) -> None:
        pass

    def elapsed_time(self, *_: Any) -> float:
        return 0.0

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *_: Any) -> None:
        return None


def _cpu_rng_state(device: Any = "cuda", *_: Any, **__: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *_: Any, **__: Any) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


# torch.cuda attribute -> CPU stand-in. Each is something Megatron-Core calls on the
# code paths a GPT model with the local layer spec takes.
_TORCH_CUDA_STANDINS: dict[str, Any] = {
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "set_device": lambda *_: None,
    "synchronize": lambda *_, **__: None,
    "empty_cache": lambda: None,
    "Stream": _CpuStream,
    "Event": _CpuStream,
    "current_stream": lambda *_, **__: _CpuStream(),
    "default_stream": lambda *_, **__: _CpuStream(),
    "stream": lambda *_, **__: contextlib.nullcontext(),
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "get_rng_state": _cpu_rng_state,
    "set_rng_state": _set_cpu_rng_state,
    "memory_allocated": lambda *_, **__: 0,
    "max_memory_allocated": lambda *_, **__: 0,
    "memory_reserved": lambda *_, **__: 0,
}

def _all_subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def _backward_on_cpu() -> None:
    """Run the backward of Megatron-Core's autograd Functions with CUDA → CPU redirected.

    A mode is off while its handler runs, and ``torch.autograd.backward`` goes through the
    handler: the backward pass runs without the mode. Megatron's Functions allocate on the
    device there (``torch.empty(..., device=torch.cuda.current_device())`` for sequence-parallel
    reduce-scatters) and activation recompute re-runs forward code (``device="cuda"``), so each
    of their backwards enters the mode again.
    """
    import megatron.core.tensor_parallel  # noqa: F401  (defines the Functions)

    for cls in set(_all_subclasses(torch.autograd.Function)):
        if not cls.__module__.startswith("megatron.core") or "backward" not in vars(cls):
            continue
        original = vars(cls)["backward"]
        original = original.__func__ if isinstance(original, staticmethod) else original

        def backward(ctx, *grads, _original=original):
            with CudaToCpuMode():
                return _original(ctx, *grads)

        cls.backward = staticmethod(backward)


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Replace the torch.cuda and Megatron RNG entry points with CPU stand-ins (idempotent).

    Call only in processes that will never use a real CUDA device: the cpu backend's workers.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        for name, standin in _TORCH_CUDA_STANDINS.items():
            setattr(torch.cuda, name, standin)
        torch.cuda.random.get_rng_state = _cpu_rng_state
        torch.cuda.random.set_rng_state = _set_cpu_rng_state
        torch.cuda.random.manual_seed = _manual_seed

        from megatron.core.tensor_parallel import random as mcore_random

        mcore_random._get_cuda_rng_state = _cpu_rng_state
        mcore_random._set_cuda_rng_state = _set_cpu_rng_state
        _backward_on_cpu()
        # Every torch call passes through CudaToCpuMode, which reads each argument: torch then
        # warns about reading .grad of the non-leaf tensors Megatron passes, on CPU only.
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is "
                                r"not a leaf Tensor is being accessed", category=UserWarning)
        _installed = True


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """Install the stand-ins and redirect CUDA requests to the CPU on this thread."""
    install()
    with CudaToCpuMode():
        yield
