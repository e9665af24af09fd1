import torch

# Workers are forked from the test process: keep its intra-op pool single-threaded so no OpenMP state is inherited.
torch.set_num_threads(1)
