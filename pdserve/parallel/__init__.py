"""Tensor parallelism: one instance's model split over T ranks, one process each.

group.py     the ranks' collectives (all-reduce, all-gather, broadcast), a no-op for T = 1
sharding.py  which slice of every weight a rank holds, and which sizes T may take
(worker/tp_executor.py: rank 0, in the engine process, sends every step to ranks 1..T-1 in their own
processes; all ranks run the same forward pass, rank 0 samples)
"""
