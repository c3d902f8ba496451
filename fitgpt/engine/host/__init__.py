"""Host RAM and the local disk as the engine sees them, knowing nothing of chunks.

pinned.py: page-locked buffers sized exactly, for state that stays in host RAM for the whole run.
hostmem.py: the RAM the machine can give now, read before anything is allocated (the planner
reads it too, plan/hardware.py). nvme.py: the NVMe file store for optimizer state, with
aligned_io.py's page-aligned O_DIRECT transfers. The host and disk tiers built on them, which step
chunks, are chunked/offload.py and chunked/disk_tier.py.
"""
