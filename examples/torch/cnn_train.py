"""A small CNN trained for 200 steps on synthetic data with AdamW and bf16 autocast; prints the
loss curve as JSON on its last line (`LOSSES [...]`). Deterministic algorithms, fixed seeds: the
curve through rgpu must match the local one."""
import json
import sys

import torch

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
torch.backends.cudnn.benchmark = False
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    torch.nn.Flatten(), torch.nn.Linear(64 * 8 * 8, 10)).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(1)
xs = torch.randn(8, 64, 3, 32, 32, generator=gen)
ys = torch.randint(0, 10, (8, 64), generator=gen)
# learnable structure: the label shifts the mean of one channel
for b in range(8):
    xs[b, torch.arange(64), 0] += ys[b].float().view(64, 1, 1) * 0.3
xs, ys = xs.cuda(), ys.cuda()
losses = []
for step in range(steps):
    x, y = xs[step % 8], ys[step % 8]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("LOSSES " + json.dumps(losses))
