"""The CUDA→CPU shim: one test for each request of Megatron-Core it answers on the CPU."""

import threading

import pytest
import torch

from ray_ppu.devices import cpu_shim


@pytest.fixture()
def mode():
    with cpu_shim.cpu_mode():
        yield


@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda"), torch.device("cuda", 0)])
def test_factory_devices_map_to_cpu(mode, device):
    assert torch.ones(3, device=device).device.type == "cpu"
    assert torch.empty(2, 2, device=device, dtype=torch.bfloat16).device.type == "cpu"


def test_cuda_and_to_cuda_stay_on_cpu(mode):
    t = torch.arange(4)
    assert t.cuda() is t
    assert t.cuda(torch.cuda.current_device()) is t
    assert t.to("cuda").device.type == "cpu"
    assert t.to(torch.device("cuda"), non_blocking=True).device.type == "cpu"
    assert t.to(device="cuda", dtype=torch.float32).dtype == torch.float32


def test_tensor_type_answers_with_cuda_names(mode):
    # Megatron's DDP / optimizers compare param.type() against these names.
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    converted = torch.zeros(2, dtype=torch.float64).type("torch.cuda.FloatTensor")
    assert converted.dtype == torch.float32 and converted.device.type == "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matmuls_accumulate_in_fp32_and_keep_their_dtype(mode, dtype):
    # the output layer's shapes at the tiny preset: 32 tokens, hidden 64, a 4,096-token slice
    # of the vocabulary; forward, then both gradients through autograd
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(4096, 64, generator=g).to(dtype).requires_grad_()
    for product in (torch.matmul(x, w.t()), x @ w.t(), torch.nn.functional.linear(x, w),
                    x.mm(w.t())):
        assert product.dtype == dtype
        assert torch.equal(product, (x.detach().float() @ w.detach().float().t()).to(dtype))
    grad = torch.randn(32, 4096, generator=g).to(dtype)
    torch.nn.functional.linear(x, w).backward(grad)
    assert x.grad.dtype == w.grad.dtype == dtype
    assert torch.equal(x.grad, (grad.float() @ w.detach().float()).to(dtype))
    # mixed or full-precision operands go to torch as they are
    assert torch.matmul(x.detach().float(), w.detach().float().t()).dtype == torch.float32


def test_pin_memory_is_a_no_op(mode):
    t = torch.zeros(3)
    assert t.pin_memory() is t
    assert torch.empty(3, pin_memory=True).device.type == "cpu"


def test_device_queries_streams_and_events(mode):
    assert torch.cuda.current_device() == 0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.ones(2, device="cuda") * 2
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert x.sum().item() == 4.0 and event.query()


def test_cuda_rng_is_the_cpu_generator(mode):
    torch.cuda.manual_seed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))
    state = torch.cuda.get_rng_state()
    b = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(b, torch.rand(3))


def test_megatron_rng_tracker_forks_and_restores(mode):
    from megatron.core.tensor_parallel import random as mcore_random

    assert mcore_random._get_cuda_rng_state is cpu_shim._cpu_rng_state
    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(1)
    tracker.add("test-stream", 1234)
    before = torch.get_rng_state()
    with tracker.fork("test-stream"):
        forked = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    torch.manual_seed(1234)
    assert torch.equal(forked, torch.rand(4))  # the fork drew from its own seed
    tracker.reset()


CUDA_PRESENT = torch.cuda.is_available()  # read before any test installs the stand-ins


@pytest.mark.skipif(CUDA_PRESENT, reason="on a CUDA machine the other thread's request succeeds")
def test_mode_is_per_thread():
    results = {}
    with cpu_shim.cpu_mode():
        def other():
            try:
                torch.ones(1, device="cuda")
                results["other"] = "cuda worked"
            except (RuntimeError, AssertionError) as err:
                results["other"] = type(err).__name__
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert torch.ones(1, device="cuda").device.type == "cpu"
    assert results["other"] != "cuda worked"  # the redirect did not leak to another thread
