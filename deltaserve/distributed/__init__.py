"""Tensor / expert parallelism over torch.distributed: the parallel layout (`parallel.py`: which rank holds
which rows), process-group start-up and the collectives with timeouts (`comm.py`)."""
