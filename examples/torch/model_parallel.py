"""Model parallelism across two CUDA devices: the first half of an MLP on cuda:0, the second on
cuda:1 (or both on cuda:0 with --one-device, the reference run), trained for a few steps on fixed
data. Prints `LOSSES [...]` and `DEVICES n`. Through rgpu, `flexrun -n 2` gives the two devices
as two slices (two dispatchers, or one GPU shared by two)."""
import json
import sys

import torch

one_device = "--one-device" in sys.argv
d0 = torch.device("cuda:0")
d1 = torch.device("cuda:0" if one_device else "cuda:1")
torch.manual_seed(0)
first = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU()).to(d0)
second = torch.nn.Sequential(torch.nn.Linear(512, 10)).to(d1)
params = list(first.parameters()) + list(second.parameters())
opt = torch.optim.SGD(params, lr=0.05)
g = torch.Generator().manual_seed(1)
x = torch.randn(128, 256, generator=g).to(d0)
y = (torch.arange(128) % 10).to(d1)
losses = []
for _ in range(20):
    h = first(x).to(d1)                     # the copy between devices (and the event wait behind it)
    loss = torch.nn.functional.cross_entropy(second(h), y)
    opt.zero_grad()
    loss.backward()                         # gradients flow back across the devices
    opt.step()
    losses.append(round(loss.item(), 5))
print("DEVICES", torch.cuda.device_count())
print("LOSSES " + json.dumps(losses))
