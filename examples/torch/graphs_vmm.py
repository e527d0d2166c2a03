"""PyTorch features that use CUDA graphs, the caching allocator's expandable segments (VMM) and
stream priorities: prints one `TORCH <case> ok|FAIL ...` line per case and `TORCH PASSED n/m`.
Run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the VMM cases."""
import os
import sys
import traceback

import torch

results = {}


def case(fn):
    try:
        fn()
        results[fn.__name__] = "ok"
    except Exception as e:  # noqa: BLE001 - report every failure
        results[fn.__name__] = f"FAIL {type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    return fn


@case
def graph_capture_replay():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    static_x = torch.randn(32, 256, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):   # warm up on a side stream, as PyTorch's docs do
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = model(static_x)
    assert not torch.cuda.is_current_stream_capturing()
    for i in range(5):
        x = torch.randn(32, 256, device="cuda")
        static_x.copy_(x)
        g.replay()
        expect = model(x)
        assert torch.allclose(static_y, expect, atol=1e-5), (i, (static_y - expect).abs().max().item())


@case
def graph_whole_training_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(128, 64, device="cuda")
    y = torch.randint(0, 10, (128,), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    first = None
    for _ in range(20):
        g.replay()
        first = first if first is not None else loss.item()
    assert loss.item() < first, (first, loss.item())


@case
def make_graphed_callables():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()).cuda()
    x = torch.randn(16, 32, device="cuda", requires_grad=True)
    gm = torch.cuda.make_graphed_callables(m, (x,))
    out = gm(x)
    out.sum().backward()
    assert torch.allclose(out, m(x), atol=1e-5)


@case
def stream_priority():
    lo, hi = torch.cuda.Stream.priority_range()
    s = torch.cuda.Stream(priority=hi)
    with torch.cuda.stream(s):
        a = torch.ones(1000, device="cuda") * 3
    s.synchronize()
    assert a.sum().item() == 3000


@case
def expandable_segments():
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    tensors = [torch.full((1 << 20,), float(i), device="cuda") for i in range(64)]   # 256 MiB in 4 MiB tensors
    big = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
    big.fill_(7)
    assert all(t[0].item() == i for i, t in enumerate(tensors))
    assert big[-1].item() == 7
    del tensors
    torch.cuda.empty_cache()
    c = torch.randn(2048, 2048, device="cuda")
    assert torch.isfinite(c @ c).all()
    stats = torch.cuda.memory_stats()
    print("ALLOC_CONF", conf, "segments", stats.get("segment.all.current"), "reserved", torch.cuda.memory_reserved())


for k, v in results.items():
    print("TORCH", k, v)
passed = sum(v == "ok" for v in results.values())
print(f"TORCH PASSED {passed}/{len(results)}")
sys.exit(0 if passed == len(results) else 1)
