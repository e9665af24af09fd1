"""A plain FSDP2 training script with its own optimizer, scheduler and gradient clipping, whose replicas gossip
instead of all-reducing: two lines adopt it (marked); the mesh is the one an HSDP script builds already, with
``fully_shard`` over its shard dimension only. Launch under torchrun, e.g. ``torchrun --standalone --nproc_per_node
4 tests/user_scripts/own_fsdp2.py --shard 2``; tests/test_sharded_launcher.py does. Prints the first and the final
loss of rank 0's replica on its data."""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from decent_train import Gossip  # line 1 of 2

parser = argparse.ArgumentParser()
parser.add_argument("--shard", type=int, default=2, help="ranks per replica")
parser.add_argument("--topology", default="ring")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--clip", type=float, default=1.0)
args = parser.parse_args()

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh("cpu", (world // args.shard, args.shard), mesh_dim_names=("replicate", "shard"))
torch.manual_seed(rank)
x = torch.randn(256, 20)
y = (x[:, :5].sum(1) > 0).long()
torch.manual_seed(0)  # the same initial model on every rank (FSDP2 keeps each rank's own rows of it)
blocks = [torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU()), torch.nn.Linear(64, 2)]
model = torch.nn.Sequential(*blocks)
for block in blocks:
    fully_shard(block, mesh=mesh["shard"])
fully_shard(model, mesh=mesh["shard"])
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
first = None
with Gossip(model, optimizer, topology=args.topology, mesh=mesh):  # line 2 of 2
    for step in range(args.steps):
        batch = torch.randint(0, 256, (32,))
        loss = F.cross_entropy(model(x[batch]), y[batch])
        first = loss.item() if first is None else first
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
final = F.cross_entropy(model(x), y).item()
if rank == 0:
    print(f"first loss {first:.4f} final loss {final:.4f}", flush=True)
dist.destroy_process_group()
