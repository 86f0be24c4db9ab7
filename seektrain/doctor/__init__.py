"""``seektrain doctor``: find the broken node before the job does.

Each module checks one part of a machine and returns ``Check`` rows (report.py): versions and GPUs
(system.py), network interfaces, InfiniBand and ports (network.py), the NCCL/GLOO/MASTER/TORCH
environment (environment.py), the run folder's disk and, across ranks, whether it is shared
(storage.py), and collective bandwidth (comm.py). run.py puts them together for one process or for
the workers of a torchrun launch.
"""
