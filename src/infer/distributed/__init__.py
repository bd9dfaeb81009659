"""Tensor parallelism over torch.distributed: the group the layers use (`group.py`), the
worker processes of ranks 1..N-1 and rank 0's side of them."""
