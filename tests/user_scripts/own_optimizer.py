"""A plain PyTorch DDP-free training script with its own optimizer and scheduler (optionally gradient clipping and
torch.compile), adopting DiLoCo with two lines (marked). Launch under torchrun, e.g. ``torchrun --standalone
--nproc_per_node 4 tests/user_scripts/own_optimizer.py``; tests/test_local_steps.py does (with --compile --clip 1).
Prints the first and the final loss of rank 0's model on its data."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from decent_train import DiLoCo  # line 1 of 2

parser = argparse.ArgumentParser()
parser.add_argument("--topology", default="ring")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--sync-every", type=int, default=5)
parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient to this norm (0: no clipping)")
parser.add_argument("--compile", action="store_true", help="model = torch.compile(model)")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
x = torch.randn(256, 20)
y = (x[:, :5].sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
if args.compile:
    model = torch.compile(model)
inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(inner, args.steps)
outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
first = None
with DiLoCo(model, inner, outer, sync_every=args.sync_every, topology=args.topology):  # line 2 of 2
    for step in range(args.steps):
        batch = torch.randint(0, 256, (32,))
        loss = F.cross_entropy(model(x[batch]), y[batch])
        first = loss.item() if first is None else first
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        inner.step()
        inner.zero_grad()
        scheduler.step()
final = F.cross_entropy(model(x), y).item()
if rank == 0:
    print(f"first loss {first:.4f} final loss {final:.4f}", flush=True)
dist.destroy_process_group()
