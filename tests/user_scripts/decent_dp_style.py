"""decent-dp 0.2.3's own test script (tests/test.py of WangZesen/Decent-DP) as a user runs it against decent_train:
the imports renamed (``decent_dp`` -> ``decent_train``), MNIST replaced by local random tensors of its shape, fewer and
shorter epochs, and the end users' scripts have: ``dist.destroy_process_group()`` and a normal interpreter exit.

Launch under torchrun (or with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE set), e.g.
``torchrun --standalone --nproc_per_node 4 tests/user_scripts/decent_dp_style.py``; tests/test_clean_exit.py launches
it many times.
"""

import argparse
from functools import partial

import torch
import torch.distributed as dist
from loguru import logger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from decent_train.ddp import DecentralizedDataParallel as ddp
from decent_train.optim import optim_fn_adam
from decent_train.utils import initialize_dist

parser = argparse.ArgumentParser()
parser.add_argument("--topology", default="ring")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps", type=int, default=8, help="training steps per epoch")
args = parser.parse_args()

rank, world_size = initialize_dist()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

model = torch.nn.Sequential(
    torch.nn.Flatten(),
    torch.nn.Linear(784, 128),
    torch.nn.BatchNorm1d(128),
    torch.nn.ReLU(),
    torch.nn.Linear(128, 10),
)
optim_fn = partial(optim_fn_adam, beta1=0.974, lr=1e-3 * world_size)
model = ddp(model, optim_fn, lr_scheduler_fn=None, topology=args.topology, sync_buffer_in_global_avg=True)

batch = 256 // world_size
generator = torch.Generator().manual_seed(0)  # the same data on every rank; the samplers split it
train_dataset = TensorDataset(
    torch.rand(args.steps * 256, 1, 28, 28, generator=generator),
    torch.randint(0, 10, (args.steps * 256,), generator=generator),
)
valid_dataset = TensorDataset(
    torch.rand(512, 1, 28, 28, generator=generator), torch.randint(0, 10, (512,), generator=generator)
)
train_sampler = DistributedSampler(train_dataset)
valid_sampler = DistributedSampler(valid_dataset, shuffle=False)
train_ds = DataLoader(train_dataset, batch_size=batch, sampler=train_sampler, drop_last=True)
valid_ds = DataLoader(valid_dataset, batch_size=batch, sampler=valid_sampler)
loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.025)

for epoch in range(args.epochs):
    train_sampler.set_epoch(epoch)
    model.train()
    avg_loss = 0.0
    if epoch + 1 >= 2:
        model.set_adaptive_factor(0.1)
    for step, (data, target) in enumerate(train_ds):
        data, target = data.to(device), target.to(device)
        output = model(data)
        loss = loss_fn(output, target)
        loss.backward()
        avg_loss += loss.item()
    if rank == 0:
        logger.info(f"Training loss: {avg_loss / len(train_ds):.5f}")

    d2c = model.global_avg(will_revert=True, return_d2c=True)

    with torch.no_grad():
        model.eval()
        avg_loss = 0.0
        for data, target in valid_ds:
            avg_loss += loss_fn(model(data.to(device)), target.to(device)).item()
        if rank == 0:
            logger.info(f"D2C: {d2c:.4f}, Validation loss: {avg_loss / len(valid_ds):.5f}")

    model.revert_global_avg()

dist.destroy_process_group()
