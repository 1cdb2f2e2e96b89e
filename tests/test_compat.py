"""The CPU compatibility layer: what it patches, that it works, and that it is inert with CUDA.

Each check runs in a fresh interpreter: the layer changes process-global state.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

pytestmark = pytest.mark.integration  # every test here launches processes


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def test_cuda_calls_run_on_cpu():
    out = run_python("""
        import torch
        from megatron_snip.compat import cpu
        state = cpu.enable()
        assert state.active and "torch.cuda.current_device" in state.patched
        x = torch.zeros(3, device=torch.cuda.current_device())
        assert x.device.type == "cpu"
        assert torch.ones(2, device="cuda").device.type == "cpu"
        assert x.cuda() is x and x.to("cuda").device.type == "cpu"
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.type(torch.float64).dtype == torch.float64   # explicit casts untouched
        # megatron's RoPE under context parallelism asks for page-locked host memory
        assert torch.tensor([0, 3], device="cpu", pin_memory=True).cuda(non_blocking=True).tolist() == [0, 3]
        s = torch.cuda.current_stream(); s.wait_stream(s); torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); e1.record(); assert e0.elapsed_time(e1) >= 0
        print("ok")
    """)
    assert out.strip() == "ok"


def test_megatron_rng_tracker_switches_real_states():
    """Dropout inside a TP region must draw from the tracker's stream, not the default one."""
    out = run_python("""
        import torch
        from megatron_snip.compat import cpu
        cpu.enable()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        tracker = get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 123)
        torch.manual_seed(0)
        with tracker.fork():
            a = torch.rand(4)
        b = torch.rand(4)                     # default stream continues unaffected by the fork
        torch.manual_seed(0)
        c = torch.rand(4)
        torch.manual_seed(123)
        d = torch.rand(4)
        assert torch.equal(b, c), "the fork leaked into the default generator"
        assert torch.equal(a, d), "the fork did not use the tracker's seed"
        print("ok")
    """)
    assert out.strip() == "ok"


def test_recompute_in_backward_sees_the_layer():
    """Activation recompute runs forwards inside the autograd engine; CUDA devices must still map."""
    out = run_python("""
        import torch
        from torch.utils.checkpoint import checkpoint
        from megatron_snip.compat import cpu
        cpu.enable()
        def f(x):
            return x * torch.ones(x.shape, device="cuda")
        x = torch.ones(3, requires_grad=True)
        checkpoint(f, x, use_reentrant=True).sum().backward()
        assert torch.equal(x.grad, torch.ones(3))
        print("ok")
    """)
    assert out.strip() == "ok"


def test_inert_when_cuda_is_available():
    out = run_python("""
        import torch
        torch.cuda.is_available = lambda: True
        from megatron_snip.compat import cpu
        state = cpu.enable()
        assert not state.active and state.patched == [] and state.mode is None
        print("ok")
    """)
    assert out.strip() == "ok"


def test_free_port_lies_below_the_ephemeral_range_and_is_free():
    # The OS hands ports in its ephemeral range to any socket bound or connected without one (gloo's
    # connections too), so a port chosen there can be gone before the store listens: CI lost a job so.
    from megatron_snip.compat.launch import _ephemeral_start, free_port

    for _ in range(20):
        port = free_port()
        assert 1024 <= port < _ephemeral_start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: raises if not
