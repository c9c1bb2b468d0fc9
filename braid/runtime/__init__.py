"""The executor: runs compiled per-rank programs on torch.distributed."""
