"""PyTorch beyond the basics: a torchvision model's forward and backward, torch.compile (Triton), and
a DataLoader with pin_memory=True feeding the GPU with non-blocking copies.

Prints one `TORCH <case> ok|FAIL ...` line per case, `VALUES <json>` with the numbers each case
computed (compared between a local run and one through rgpu), and `TORCH PASSED n/m`."""
import json
import sys
import traceback

import torch

results: dict[str, str] = {}
values: dict[str, float] = {}


def case(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
        results[fn.__name__] = "ok"
    except Exception as e:  # noqa: BLE001 - report every failure
        results[fn.__name__] = f"FAIL {type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    return fn


@case
def torchvision_resnet_forward_backward() -> None:
    import torchvision
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    model = torchvision.models.resnet18(num_classes=10).cuda()
    x = torch.randn(16, 3, 64, 64, generator=torch.Generator().manual_seed(1)).cuda()
    y = torch.arange(16).remainder(10).cuda()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grad = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    assert torch.isfinite(loss) and grad > 0
    values["resnet_loss"], values["resnet_grad_norm"] = loss.item(), grad


@case
def torch_compile_triton() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 32)).cuda()
    compiled = torch.compile(model)
    x = torch.randn(64, 128, device="cuda")
    eager, fast = model(x), compiled(x)
    assert torch.allclose(eager, fast, atol=1e-4, rtol=1e-4), (eager - fast).abs().max().item()
    fast.sum().backward()           # the compiled backward too
    values["compiled_sum"] = fast.double().sum().item()


@case
def dataloader_pin_memory() -> None:
    data = torch.arange(4096 * 64, dtype=torch.float32).reshape(4096, 64)
    dataset = torch.utils.data.TensorDataset(data)
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, num_workers=2, pin_memory=True)
    total = torch.zeros((), device="cuda", dtype=torch.float64)
    for (batch,) in loader:
        assert batch.is_pinned()
        total += batch.to("cuda", non_blocking=True).double().sum()
    torch.cuda.synchronize()
    assert total.item() == data.double().sum().item(), (total.item(), data.double().sum().item())
    values["loader_sum"] = total.item()


passed = sum(1 for r in results.values() if r == "ok")
for name, r in results.items():
    print(f"TORCH {name} {r}")
print("VALUES " + json.dumps(values))
print(f"TORCH PASSED {passed}/{len(results)}")
sys.exit(0 if passed == len(results) else 1)
