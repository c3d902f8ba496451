"""Optimizer state in fewer bytes than fp32, and the AdamW step over it.

Mixed-precision AdamW holds 16 bytes per parameter (fp32 master and two fp32 moments, 12 of them,
then the bf16 weight and gradient); compact.py keeps a chunk's master and moments in smaller formats, the split master
(split_master.py: the bf16 weight plus an int16 remainder, exact) and bf16 or block-wise int8
moments (moments.py), and steps them piece by piece through fp32 scratch: eagerly, through
compiled decode and encode (codec.py), or in one native pass per element on the host
(hostkernel.py over host_adamw.cpp). speculate.py undoes one AdamW step, so the speculative update
(chunked/update.py) can redo a step whose clip coefficient it guessed wrong. Formats know no
chunks, tiers or ranks: this wing imports nothing else of the engine, and chunked/ (and through
its placement, the planner) reads their sizes from here. frozen_base.py holds a LoRA run's
frozen base in fewer bytes (bf16, int8, NF4 through bitsandbytes), a block at a time: it reads
the block's parameter layout (engine/layout.py ChunkSpec) and nothing else of the engine.
"""
