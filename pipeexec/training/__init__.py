"""Training: the step and the loop (`train`), data-parallel gradients (`ddp`), master weights and
loss scaling (`precision`), AdamW, learning rate and clipping (`optim`)."""
