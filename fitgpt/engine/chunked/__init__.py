"""The chunk engine (`--engine zero`: engine.py's ChunkEngine), ZeRO stages 0-3 over flat buffers.

Every parameter, gradient and optimizer state lives in a Chunk (chunk.py): one flat buffer per
kind for each transformer block, the embedding and the head. Its Placement (placement.py, the same
value the planner prices) says per chunk what is sharded over the ranks, which tier holds its
optimizer state (GPU, host RAM or disk) and in which format. Around them: chunk_build.py makes the
chunks, reduce.py sums gradients over the ranks during the backward, fetch.py brings stage-3 and
streamed weights in just before a block runs, update.py steps each chunk where its state lives,
offload.py is the host optimizer (the host tier's AdamW on a worker thread) with disk_tier.py the
disk tier under it, chunk_state.py reads and writes checkpoints, accounting.py counts bytes per
tier. frozen.py holds a LoRA run's frozen base the same way (packed blocks, no gradient, no
optimizer state, on the GPU, in pinned RAM or on the disk, brought in by fetch.py): the ddp
engine, which trains the adapters, uses it. The host and disk tiers stand here, not in host/,
because they step Chunks; host/ holds what they stand on. This wing builds on transforms/ (the
model it wraps), formats/ (compact state) and host/ (pinned RAM, the file store); other wings
import only frozen.py (the ddp engine) and placement.py (the planner's memory model).
"""
