"""The declared benchmark runs: every suite, its rows, and what made each committed result.

A row is one entry point (one stage of a staged script): the script under benchmarks/, its
arguments, the machine kind it needs, what it records and the results folders under
benchmarks/results/ it has written. `benchmarks/run.py` lists, runs and indexes these; nothing
here runs anything. The row's command is built from its fields (never written twice), and is
run from the repository root with OUT (the row's output folder) and PYTHONPATH=. set.

PAST names what made the results whose scripts are no longer in the tree (git keeps them: `git
show COMMIT:PATH`). Every results folder or file is claimed by a row or a PAST entry; the index
(benchmarks/results/README.md) is generated from both and a test keeps it current.

Standard library only: `--list` and the machine check run on a box without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The machine kinds of the device tool, and "cpu" (any machine, this one included).
KIND = re.compile(r"^(cpu|nvidia-h(100|200)(-x([1248]))?)$")
# The commit that last held benchmarks/history/ and the scripts kept inside results folders.
HISTORY_COMMIT = "7c35cee"
# Sourced by device rows: installs the carried wheels, prints GPUs, RAM and disk.
DEVICE_ENV = "source benchmarks/device_env.sh; "


@dataclass(frozen=True)
class Row:
    """One named run: `{env} {bash|python3} benchmarks/{script} {args}` on `machine`."""

    name: str
    script: str  # a file under benchmarks/, at its top or in one of its rooms (peers/, ...)
    machine: str  # "cpu" or a device kind: nvidia-h100-x1, nvidia-h200, nvidia-h200-x4, ...
    records: str  # what the run measures and writes, in one sentence
    args: str = ""
    env: str = ""  # shell assignments before the command (EXTRA=..., BEFORE=.base)
    device_env: bool = False  # source benchmarks/device_env.sh first
    carry: tuple[str, ...] = ()  # ignored paths the row needs beside the tree (.whl, .nanogpt)
    results: tuple[str, ...] = ()  # names under benchmarks/results/ this row has written

    def __post_init__(self) -> None:
        if not KIND.match(self.machine):
            raise ValueError(f"row {self.name}: machine {self.machine!r} is no device kind or cpu")
        if not self.script.endswith((".py", ".sh")) or self.script.count("/") > 1:
            raise ValueError(
                f"row {self.name}: script {self.script!r} is no benchmarks/[room/]*.py|sh"
            )

    @property
    def gpus(self) -> int:
        """GPUs the row needs: 0 for cpu, else the kind's -xN (1 without it)."""
        m = KIND.match(self.machine)
        return 0 if m[1] == "cpu" else int(m[4] or 1)

    @property
    def command(self) -> str:
        run = "bash" if self.script.endswith(".sh") else "python3"
        parts = [self.env, run, f"benchmarks/{self.script}", self.args]
        return (DEVICE_ENV if self.device_env else "") + " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Suite:
    name: str
    about: str
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Past:
    """Results made by something the tree no longer holds: what, and the commit that held it."""

    made_by: str
    commit: str
    results: tuple[str, ...]


H100 = "nvidia-h100-x1"
# the lora_gpu.sh rows that have run: (stage, where) -> their results
LORA_RAN = {
    ("8b", "h200-as-h100"): ("lora8_h200_2026-11-28", "lora_rerun_h200_2026-11-28"),
    **{
        (s, "h200-as-h100"): ("lora70_h200_2026-11-28", "qlora70_h200_2026-11-28")
        for s in ("q70-long", "l70-bf16")
    },
    ("q70", "h200-as-h100"): ("lora70_h200_2026-11-28", "lora70_profile_h200_2026-11-28"),
    ("q70-fitgpt", "h200-as-h100"): ("qlora70_h200_2026-11-28",),
}
# the lora_x4.sh stages that have run -> their results
LORA_X4_RAN = {"l405": ("lora405_x4_h200_2026-11-28",)}
# the moe_x4.sh stages that have run -> their results
MOE_X4_RAN = {
    **{
        s: ("moe_x4_h200_2026-11-28", "moe_x4_split_h200_2026-11-28")
        for s in ("data", "make", "qwen")
    },
    "peer": ("moe_x4_split_h200_2026-11-28",),
}
WHL = (".whl",)  # DeepSpeed 0.19.8 and GPT-2's tokenizer, built by ../shared/device/make-wheels.sh


SUITES: tuple[Suite, ...] = (
    Suite(
        "user",
        "the fitgpt commands a user types, end to end, on real text",
        (
            Row(
                "h100-a",
                "user_path.py",
                H100,
                "~8 B trained by `fitgpt train` with a checkpoint on the standard library's "
                "source, and the harness at the same configuration beside it",
                args="h100 --stage a --out $OUT",
                carry=WHL,
                results=("user_path_h100_2026-11-23",),
            ),
            Row(
                "h100-b",
                "user_path.py",
                H100,
                "resume, generate and export of stage a's run (same warm machine, same OUT)",
                args="h100 --stage b --out $OUT",
                carry=WHL,
                results=("user_path_h100_2026-11-23",),
            ),
            Row(
                "x2",
                "user_path.py",
                "nvidia-h200-x2",
                "`fitgpt train --gpus 2` at 20 B against the plan, and the largest size "
                "`fitgpt plan` accepts",
                args="x2 --out $OUT",
                carry=WHL,
                results=("user_path_x2_h200_2026-11-23",),
            ),
            Row(
                "hf-interop",
                "peers/hf_interop.py",
                H100,
                "a GPT-2 XL-shaped Hugging Face model imported, fine-tuned 50 steps, exported and "
                "scored by transformers; an 8 B import's time and peak RSS",
                args="--out $OUT",
                carry=WHL,
                results=("hf_interop_h100_2026-11-23",),
            ),
            Row(
                "demo",
                "checks/demo_load.py",
                "cpu",
                "`make demo` against `--cpu-threads 1`, idle and beside busy processes (~25 min); "
                "without --versus-one the thread matrix and the demo under load",
                args="--versus-one --out $OUT",
                results=(
                    "demo_cpu_2026-11-23",
                    "demo_cpu_quiet_2026-11-23",
                    "demo_versus_one_cpu_2026-11-26",
                ),
            ),
            Row(
                "data",
                "parts/data_bench.py",
                "cpu",
                "preprocessing throughput with 1 and 2 workers (outputs byte-identical) and the "
                "loader's time per 8 x 1024-token batch",
                args="--out $OUT",
                results=("data_cpu_2026-11-22.json", "data_cpu_2026-11-22.md"),
            ),
        ),
    ),
    Suite(
        "ep",
        "expert parallelism on the GPUs of one box: the all-to-all path against P = 1",
        (
            Row(
                "x2",
                "multi_gpu/ep_x2.sh",
                "nvidia-h200-x2",
                "`fitgpt train --gpus 2 --expert-parallel P` (2, then the planner's choice) on a "
                "Qwen3-30B-A3B shape of LAYERS layers (default 4) on the standard library's source",
                device_env=True,
                carry=WHL,
                results=("ep_x2_h200_2026-11-28",),
            ),
        ),
    ),
    Suite(
        "moe4",
        "mixture-of-experts models on the 4 GPUs of one box (issue 50's 4-GPU bars): a "
        "Qwen3-30B-A3B-shaped folder on chat data against transformers + DeepSpeed ZeRO-3, and "
        "the largest MoE the planner accepts (gpt-oss-120b) from its preset; one stage per "
        "call, in order, on the same warm machine (each remakes what it lacks)",
        tuple(
            Row(
                stage,
                "multi_gpu/moe_x4.sh",
                "nvidia-h200-x4",
                what,
                env=f"STAGES={stage}",
                carry=WHL,
                results=MOE_X4_RAN.get(stage, ()),
            )
            for stage, what in (
                (
                    "data",
                    "the standard library's source as chat conversations, a Qwen-style "
                    "tokenizer of Qwen3's 151,936 rows, `fitgpt data preprocess --chat`",
                ),
                ("make", "a Qwen3-30B-A3B-shaped folder saved by transformers (61 GB)"),
                (
                    "qwen",
                    "`fitgpt train --gpus 4 --init-from` that folder (the preset without it) on "
                    "the chat data at seq 4096, the planner's plan: tokens/s, active TFLOP/s, "
                    "predicted step and peaks beside the measured",
                ),
                (
                    "peer",
                    "transformers' Qwen3MoeForCausalLM + DeepSpeed ZeRO-3 on the 4 GPUs, same "
                    "shape, data and batch (offloaded to CPU only where it does not fit)",
                ),
                (
                    "oss120",
                    "gpt-oss-120b from its preset, 10 steps from the defaults with --moments "
                    "int8 and the disk tier: losses, step times against the plan, GPU, host "
                    "and disk peaks",
                ),
            )
        ),
    ),
    Suite(
        "nodes",
        "several machines (--nnodes), stood for by processes on one box that talk as machines do",
        (
            Row(
                "x4",
                "multi_gpu/nodes_x4.sh",
                "nvidia-h200-x4",
                "two 2-GPU machines on one 4-GPU box (each its own NCCL host: NVLink inside, "
                "sockets between): `fitgpt probe` across them, then 20 B trained with ZeRO-3 "
                "sharded within each machine (--shard-within node) and over all 4 ranks, the "
                "same batch, each step's time beside the plan's (summary.json)",
                results=("nodes_x4_h200_2026-11-28",),
            ),
            Row(
                "x2",
                "multi_gpu/nodes_x4.sh",
                "nvidia-h200-x2",
                "the same on a 2-GPU box carved into two 1-GPU machines, a 6.7 B model",
                env="GPM=1 PRESET=6.7b",
                results=("nodes_x2_h200_2026-11-28",),
            ),
        ),
    ),
    Suite(
        "moe",
        "mixture-of-experts models on one GPU: the expert matmuls, fitgpt's planned run, and "
        "transformers + DeepSpeed ZeRO-3 offload on the same shape and batch",
        (
            Row(
                "gpu",
                "peers/moe_gpu.sh",
                "nvidia-h200",
                "the GPU-side tests and check, grouped against per-expert matmuls at Qwen3-30B-A3B's "
                "layer, and `fitgpt train --preset qwen3-moe-30b-a3b --layers LAYERS` (default 8) "
                "on the standard library's source",
                env="STAGE=a",
                device_env=True,
                carry=WHL,
                results=("moe_h200_2026-11-28",),
            ),
            Row(
                "peer",
                "peers/moe_gpu.sh",
                "nvidia-h200",
                "transformers' Qwen3MoeForCausalLM + DeepSpeed ZeRO-3 offload at LAYERS layers, "
                "then fitgpt on the same shape and batch",
                env='LAYERS=6 STAGES="peer train" PEER_STEPS=3',
                device_env=True,
                carry=WHL,
                results=("moe_h200_2026-11-28",),
            ),
            Row(
                "peer80",
                "peers/moe_gpu.sh",
                "nvidia-h200",
                "NOT RUN YET (written without a device): the same peer and fitgpt on 80 GB of "
                "the GPU (an H100's; fitgpt told 115 GB of RAM, the box has 125 GiB), the "
                "largest shape the peer held uncapped (6 layers)",
                env='GPU_MEM=80GB LAYERS=6 STAGES="peer train" PEER_STEPS=3',
                device_env=True,
                carry=WHL,
            ),
            Row(
                "zero3-mem",
                "memory/moe_zero3_mem.py",
                "nvidia-h200",
                "NOT RUN YET (written without a device): a ZeRO-3 + recompute step of "
                "Qwen3-30B-A3B's width at 6 layers, the allocator's trace replayed to its peak: "
                "the largest live blocks by what allocated them, bytes at each block's backward, "
                "the planner's items beside the measured (--as-before: the recompute leak fixed "
                "on 2026-11-28)",
            ),
            Row(
                "oss",
                "peers/moe_gpu.sh",
                "nvidia-h200",
                "gpt-oss's sink attention (FlexAttention's path against the SDPA reference), one "
                "sparse block's memory against the planner's terms, and gpt-oss-20b's whole shape "
                "from its preset with the planner's plan (OSS_ARGS adds flags)",
                env='STAGES="sink blockmem oss"',
                device_env=True,
                carry=WHL,
                results=("moe_sink_h200_2026-11-28",),
            ),
            Row(
                "oss20",
                "peers/moe_gpu.sh",
                "nvidia-h200",
                "gpt-oss-20b's experts with their biases trained and frozen, its whole shape "
                "from its preset with the planner's plan at 4 × 4 × 4,096, and the same planned "
                "for and capped at 80 GB of the GPU with 115 GB of RAM and the disk tier (an "
                "H100 box's memory): step times beside the plan's, GPU and host peaks",
                env='OSS_STEPS=5 STAGES="ossexp oss oss80"',
                device_env=True,
                carry=WHL,
                results=("oss20_h200_2026-11-28",),
            ),
            Row(
                "aux-compiled",
                "checks/moe_aux_gpu.sh",
                "nvidia-h200",
                "the load-balancing term added apart from the cross-entropy, each engine eager "
                "and compiled (the regions, the whole forward as CUDA graphs) and recomputed: "
                "a 2-layer Qwen3-MoE shape at 2 x 2 accumulation, every run's losses against "
                "the eager one's",
                device_env=True,
                results=("moe_aux_h200_2026-11-29",),
            ),
        ),
    ),
    Suite(
        "peers",
        "fitgpt beside nanoGPT, DeepSpeed, FSDP2 and DDP under one protocol",
        (
            Row(
                "nanogpt",
                "peers/nanogpt_compare.py",
                H100,
                "fitgpt against nanoGPT's train.py, same tokens, batch and hyper-parameters: "
                "step time, and validation loss scored by one evaluator",
                args="--out $OUT --sizes 124m,1.5b",
                carry=(".whl", ".nanogpt"),
                results=(
                    "nanogpt_compare_h100_2026-11-23",
                    "nanogpt_compare2_h100_2026-11-23",
                    "nanogpt_compare3_h100_2026-11-24",
                    "nanogpt_compare4_h100_2026-11-24",
                    "ab_speed3_h100_2026-11-24",
                    "defaults_gpu_2026-11-26",
                ),
            ),
            Row(
                "smoke",
                "peers/peers_smoke.sh",
                H100,
                "every peer (DeepSpeed ZeRO-3 and ZeRO-2 offload, FSDP2 offload, DDP) and fitgpt "
                "build and train at small sizes",
                carry=WHL,
                results=("peers_smoke_h100_2026-11-22",),
            ),
            *(
                Row(
                    f"sweep-{stage}",
                    "peers/sweep2_h100.sh",
                    H100,
                    what,
                    args=stage,
                    carry=WHL if stage == "peers" else (),
                    results=("sweep_h100_2026-11-23",),
                )
                for stage, what in (
                    ("peers", "fitgpt 0.62-11.69 B beside DeepSpeed ZeRO-3 offload (peers.jsonl)"),
                    ("cap", "`fitgpt capacity` with int8 moments and the default formats"),
                    ("disk", "`fitgpt capacity` with optimizer state on the disk tier"),
                    ("rest", "the compact state's GPU tests, host AdamW per format, capacity"),
                )
            ),
            Row(
                "x4-peers",
                "multi_gpu/x4_sweep.sh",
                "nvidia-h200-x4",
                "fitgpt, DeepSpeed ZeRO-3 offload, FSDP2 offload and DDP at 20.25 B on 4 GPUs "
                "through `fitgpt bench sweep --gpus 4`, the planner's step time term by term",
                args="peers",
                carry=WHL,
                results=("x4_peers_h200_2026-11-26",),
            ),
            Row(
                "x4-scale",
                "multi_gpu/x4_sweep.sh",
                "nvidia-h200-x4",
                "fitgpt at 20.25 B on 1, 2 and 4 GPUs of one box (GPUS picks a subset)",
                args="scale",
                results=("x4_peers_h200_2026-11-26", "x4_h100_2026-11-27", "x4_h200_2026-11-27"),
            ),
            Row(
                "x4-capacity-peers",
                "multi_gpu/x4_capacity.sh",
                "nvidia-h200-x4",
                "DDP's and DeepSpeed ZeRO-3 offload's largest on 4 GPUs, fitgpt at DeepSpeed's "
                "largest (the second machine's commands are in the results README)",
                args="peers",
                env="DEADLINE=560 DS_START=36",
                carry=WHL,
                results=("x4_capacity_h200_2026-11-27",),
            ),
            Row(
                "x4-capacity-disk",
                "multi_gpu/x4_capacity.sh",
                "nvidia-h200-x4",
                "fitgpt's largest on 4 GPUs with some optimizer state on the disk tier",
                args="disk",
            ),
            Row(
                "x8",
                "multi_gpu/x8_h200.sh",
                "nvidia-h200-x8",
                "the 8-GPU sweep and capacity at hidden 8192: fitgpt, its ablations, DDP, "
                "DeepSpeed (checked on 2 GPUs at small sizes with GPUS=2 SIZES=1,2 CAPACITY=0)",
                carry=WHL,
                results=("x8_script_check_x2_h200_2026-11-22",),
            ),
            Row(
                "step-model",
                "memory/throughput_model_check.py",
                "cpu",
                "the planner's predicted step time, term by term, against each fitgpt trial of a "
                "committed sweep (SWEEP= another sweep.jsonl)",
                args='"${SWEEP:-benchmarks/results/x4_peers_h200_2026-11-26/scale.jsonl}" '
                "| tee $OUT/throughput_model.txt",
                results=("sweep_h100_2026-11-22", "x4_peers_h200_2026-11-26"),
            ),
        ),
    ),
    Suite(
        "llama",
        "Hugging Face folders users bring (Llama, Qwen), imported, trained, exported, re-priced",
        (
            Row(
                "8b",
                "peers/llama_gpu.sh",
                H100,
                "a Llama-3.1-8B-shaped folder made by transformers, fine-tuned by `fitgpt train "
                "--init-from` on real text, exported and scored by transformers (EXTRA adds train "
                'flags: EXTRA="--compile on" made the 2026-11-27 folder)',
                device_env=True,
                results=("llama_h100_2026-11-26", "llama_h100_2026-11-27"),
            ),
            Row(
                "qwen14b",
                "peers/qwen_gpu.sh",
                H100,
                "the same for a Qwen2.5-14B-shaped folder",
                device_env=True,
                results=("qwen_h100_2026-11-26",),
            ),
            Row(
                "speed",
                "peers/llama_speed_h100.sh",
                H100,
                "where a Llama-3.1-8B step's time goes: `fitgpt probe`, the step eager and "
                "compiled with `--profile 1`, packed rows' attention",
                device_env=True,
                results=("llama_speed_h100_2026-11-27",),
            ),
            Row(
                "70b-make",
                "multi_gpu/llama70_x4.sh",
                "nvidia-h200-x4",
                "a Llama-3.1-70B-shaped folder made by transformers and its data (~230 s); "
                "`70b-train` follows on the same warm machine",
                args="make",
                results=("llama70_x4_h200_2026-11-26", "x4_h100_2026-11-27"),
            ),
            Row(
                "70b-train",
                "multi_gpu/llama70_x4.sh",
                "nvidia-h200-x4",
                "that folder trained by `fitgpt train --gpus 4 --init-from` (MB, GA, STEPS, "
                "PROFILE, EXTRA): import time, host RAM and disk every 5 s, TFLOP/s per step",
                args="train",
                results=("llama70_x4_h200_2026-11-26", "x4_h100_2026-11-27"),
            ),
            *(
                Row(
                    f"x4-{stage}",
                    "multi_gpu/x4_h200_calls.sh",
                    "nvidia-h200-x4",
                    what,
                    args=stage,
                    results=("x4_h200_2026-11-27",),
                )
                for stage, what in (
                    (
                        "one",
                        "the 70 B folder made in the background while the GPUs run context "
                        "parallelism (parity, 8 B and Qwen2.5-32B at 131,072 tokens)",
                    ),
                    (
                        "l70",
                        "the 70 B trained compiled at micro-batch 2 x 4 (within the idle "
                        "release after `x4-one`: its folder lives under /tmp)",
                    ),
                    ("cp512", "the 8 B at 524,288 tokens per sequence on 4 GPUs"),
                )
            ),
            Row(
                "plan-check",
                "memory/llama_plan_check.py",
                "cpu",
                "the planner's step time, re-priced by today's model, against every recorded "
                "Llama-family run; no GPU",
                args="| tee $OUT/llama_plan_check.txt",
                results=("llama_plan_check_2026-11-27.txt",),
            ),
        ),
    ),
    Suite(
        "long",
        "long sequences: attention kernels, the 8 B shape at 131 k tokens and more, context "
        "parallelism, the activation memory model",
        (
            Row(
                "kernels",
                "memory/long_h100.sh",
                H100,
                "`fitgpt probe`'s attention rate, packed rows' FlexAttention against the mask "
                "path, the MLP in pieces and the window at 32-128 k tokens",
                args="kernels",
                device_env=True,
                results=("long_h100_2026-11-27",),
            ),
            Row(
                "train",
                "memory/long_h100.sh",
                H100,
                "Llama-3.1-8B's shape trained at 131,072 tokens per sequence with the planner's "
                "plan (VOCAB=llama, SEQ, STEPS, LIMIT)",
                args="train",
                device_env=True,
                results=("long_h100_2026-11-27",),
            ),
            Row(
                "seq",
                "memory/long_seq_gpu.py",
                H100,
                "one block and the whole model at 32-128 k tokens, the MLP whole and in pieces, "
                "Mistral's window through FlexAttention",
                args="--window 4096 | tee $OUT/long_seq.txt",
                results=("long_h100_2026-11-27",),
            ),
            Row(
                "packed-attention",
                "parts/packed_attention_gpu.py",
                H100,
                "packed rows' FlexAttention against the mask path: outputs, gradients, speed at "
                "4096 tokens, and a tiny Llama's step",
                args="--model | tee $OUT/packed_attention.jsonl",
                results=("llama_speed_h100_2026-11-27",),
            ),
            Row(
                "loss-pieces",
                "parts/loss_pieces_gpu.py",
                H100,
                "the loss in pieces of rows against whole logits at Llama 3 8B's head: time and "
                "peak memory",
                args="| tee $OUT/loss_pieces.txt",
            ),
            Row(
                "cp-parity",
                "multi_gpu/context_parallel_gpu.py",
                "nvidia-h100-x2",
                "the loss of `--context-parallel 2` against one GPU's, step by step, at 8 k "
                "tokens (8 blocks of the 8 B shape)",
                args="--gpus 2 --stage parity --out $OUT",
                results=("x4_h200_2026-11-27",),
            ),
            Row(
                "cp-long",
                "multi_gpu/context_parallel_gpu.py",
                "nvidia-h200-x4",
                "step time, TFLOP/s and peak GiB of --preset (Llama-3.1-8B; --preset "
                "qwen2.5-32b) at 131,072 tokens per sequence on 4 GPUs, the planner's plan",
                args="--gpus 4 --stage long --lengths 131072 --out $OUT",
                results=("x4_h200_2026-11-27",),
            ),
            Row(
                "compiled-memory",
                "memory/compiled_long_memory_cpu.py",
                "cpu",
                "peak host memory of one checkpointed block and of head + loss at 32 k tokens, "
                "eager against compiled, the MLP whole and in pieces",
                args="--json $OUT/compiled_long_memory.json",
            ),
            Row(
                "activation-memory",
                "memory/long_activation_memory_cpu.py",
                "cpu",
                "which tensors a long-sequence Llama step holds at its peak, against the memory "
                "model",
                args="--T 8192 16384 --json $OUT/long_activation_memory.json",
            ),
        ),
    ),
    Suite(
        "engine",
        "the engines' GPU paths, the host optimizer, compiled-step variants, TP and matmul",
        (
            Row(
                "gpu-check",
                "checks/gpu_check.py",
                H100,
                "every ZeRO stage and the host tier against the plain engine, a stage-3 "
                "checkpoint resumed by the plain engine, KV-cache generation",
                args="$OUT/gpu_check.json",
                results=("gpu_check_h100_2026-11-22.txt", "refactor_h100_2026-11-28"),
            ),
            Row(
                "host-adamw",
                "parts/host_adamw_formats.py",
                H100,
                "the host AdamW's update of one 8 B block in each state format (fp32, split "
                "master, bf16 and int8 moments; eager, compiled, native kernel)",
                args="--out $OUT/host_adamw.json",
                results=(
                    "compact_h100_2026-11-23",
                    "compact_native_h100_2026-11-23",
                    "sweep_h100_2026-11-23",
                ),
            ),
            Row(
                "ab-speed",
                "peers/ab_speed_h100.py",
                H100,
                "the compiled step at GPT-2 124 M and the 2.7b preset, `base` and candidate "
                "changes applied from outside fitgpt, each in its own process",
                args="--out $OUT --sizes 2.7b --variants-2p7b base",
                carry=WHL,
                results=(
                    "ab_speed_h100_2026-11-24",
                    "ab_speed2_h100_2026-11-24",
                    "ab_speed3_h100_2026-11-24",
                ),
            ),
            Row(
                "memory",
                "memory/memory_check_h100.sh",
                H100,
                "the memory model against 8 measured configurations (ddp, ZeRO 0/1/3 x "
                "checkpointing off/full at 2.03 B)",
                device_env=True,
                results=("memory_h100_2026-11-27",),
            ),
            Row(
                "matmul-x2",
                "parts/matmul_gpu.py",
                "nvidia-h200-x2",
                "`fitgpt matmul` at n = 50000 across 2 GPUs, verified",
                args="--suite x2 --out $OUT",
                results=("matmul",),
            ),
            Row(
                "matmul-oocore",
                "parts/matmul_gpu.py",
                H100,
                "`fitgpt matmul` at n = 100000 out of core on one GPU, verified",
                args="--suite oocore --out $OUT",
                results=("matmul",),
            ),
            Row(
                "tp-speed",
                "multi_gpu/tp_x2.py",
                "nvidia-h200-x2",
                "tensor parallelism (T=2) against ZeRO-3 and DDP on 2 GPUs: speed (`--tiny` "
                "checks the script on the CPU)",
                args="--out $OUT --parts speed --budget 330",
                carry=WHL,
                results=("tp_x2_h200_2026-11-24",),
            ),
            Row(
                "tp-seq",
                "multi_gpu/tp_x2.py",
                "nvidia-h200-x2",
                "the longest sequence at micro-batch 1 under T=2 (not yet run)",
                args="--out $OUT --parts seq",
                carry=WHL,
            ),
            Row(
                "compile-x2",
                "multi_gpu/compile_x2.sh",
                "nvidia-h200-x2",
                "the compiled chunk engine's own kernels at ZeRO stages 0-1 on 2 GPUs, losses "
                "against eager (not yet run: the kind was not lent on 2026-11-24)",
            ),
        ),
    ),
    Suite(
        "defaults",
        "fresh models trained with no rate, warm-up or init flag: the loss from step 1 on",
        (
            *(
                Row(
                    f"gpu-{stage}",
                    "peers/defaults_gpu.sh",
                    kind,
                    what,
                    args=stage,
                    device_env=True,
                    carry=WHL,
                    results=("defaults_gpu_2026-11-26",),
                )
                for stage, kind, what in (
                    ("one", H100, "GPT-2 1.5 B, 300 steps of 8 x 4 x 1024 tokens"),
                    ("wide", "nvidia-h200", "7.56 B at width 6144, 300 steps"),
                    ("calib", H100, "the warm-up's first-step floor measured at 1.5 B and 7.65 B"),
                    (
                        "four",
                        "nvidia-h200-x4",
                        "20.25 B on every GPU, then the largest of "
                        "width 6144 the planner accepts (MAX_LAYERS, ONLY)",
                    ),
                )
            ),
            *(
                Row(
                    f"cpu-{stage}",
                    "peers/defaults_cpu.sh",
                    "cpu",
                    what,
                    args=stage,
                    results=("defaults_cpu_2026-11-26",),
                )
                for stage, what in (
                    ("A", "old against new defaults at 4 layers x 1024, 60 steps"),
                    ("B", "2 layers x 4096, 8 steps: old init against init by width"),
                    ("C", "the same shape with every new default"),
                )
            ),
        ),
    ),
    Suite(
        "lora",
        "LoRA on a frozen base the planner places over the GPUs, host RAM and the disk (issue 51)",
        (
            *(
                Row(
                    f"x4-{stage}",
                    "multi_gpu/lora_x4.sh",
                    "nvidia-h200-x4",
                    ("" if stage in LORA_X4_RAN else "NOT RUN YET (written without a device): ")
                    + what,
                    args=stage,
                    carry=WHL,
                    results=LORA_X4_RAN.get(stage, ()),
                )
                for stage, what in (
                    (
                        "smoke",
                        "a Llama-3.1-8B-shaped LoRA from its preset, three runs at once: NF4 on "
                        "an 80 GB share of one GPU, bf16 with 16 blocks streamed from host RAM on "
                        "another, int8 sharded over two with 8 streamed (.whl must carry "
                        "bitsandbytes)",
                    ),
                    (
                        "l405",
                        "the Llama-3.1-405B shape from its preset, LoRA r=16, 5 steps of "
                        "`fitgpt train --gpus 4` with the int8 base (FMT) the planner places "
                        "over the GPUs and host RAM: the plan's bytes, tokens/s, GPU, host and "
                        "disk peaks, the adapter exported for peft",
                    ),
                    (
                        "l405-bf16",
                        "the same with the bf16 base and a disk tier (host RAM nearly full, 5 "
                        "blocks on the disk), 3 steps",
                    ),
                )
            ),
            *(
                Row(
                    f"{stage}-{where}",
                    "peers/lora_gpu.sh",
                    machine,
                    (
                        ""
                        if (stage, where) in LORA_RAN
                        else "NOT RUN YET (written without a device): "
                    )
                    + what
                    + cap,
                    args="" if stage == "8b" else stage,
                    env=env,
                    device_env=True,
                    carry=WHL,
                    results=LORA_RAN.get((stage, where), ()),
                )
                for where, machine, env, cap in (
                    ("h100", H100, "", ""),
                    (
                        "h200-as-h100",
                        "nvidia-h200",
                        "GPU_MEM=80GB",
                        "; capped at 80 GB and labelled an H100's stand-in",
                    ),
                )
                for stage, what in (
                    (
                        "8b",
                        "a Llama-3.1-8B-shaped folder (random weights) and chat data at 4,096 "
                        "tokens, LoRA r=16 all-linear: fitgpt with the planner's plan against "
                        "transformers + peft (gradient checkpointing) on the same rows and "
                        "seeded adapters, tokens/s and both loss curves (stages make, fitgpt, "
                        "peer, compare; .whl must carry peft)",
                    ),
                    (
                        "q70",
                        "QLoRA (NF4) of the llama3.1-70b preset against transformers + "
                        "bitsandbytes + peft built in memory as the QLoRA recipe trains it (no "
                        "70 B folder fits an H100 box), the same synthetic rows, tokens/s",
                    ),
                    (
                        "q70-fitgpt",
                        "q70's fitgpt run alone, the planner's plan for its 8 steps (eager: "
                        "too short a run for the compile to pay)",
                    ),
                    (
                        "q70-long",
                        "the longest --seq-len the planner accepts for that QLoRA, 2 steps of it",
                    ),
                    (
                        "l70-bf16",
                        "the 70 B shape's LoRA with its bf16 base streamed from host RAM",
                    ),
                    (
                        "q70-alt",
                        "q70's fitgpt run with every block on the GPU, then with every block "
                        "recomputed: what the planner's streamed, activations-kept plan rests on",
                    ),
                )
            ),
            Row(
                "q70-compiled-h200-as-h100",
                "peers/lora_gpu.sh",
                "nvidia-h200",
                "q70 with the compile the planner picks for a run of 150 steps or more "
                "(`fitgpt plan ... --steps 1000` prints --compile blocks; an 8-step run "
                "is too short for it to pay, so it is asked for), against the same peer; "
                "capped at 80 GB and labelled an H100's stand-in",
                args="q70",
                env='GPU_MEM=80GB EXTRA70="--compile blocks"',
                device_env=True,
                carry=WHL,
                results=("qlora70_h200_2026-11-28",),
            ),
            Row(
                "lora-gpu-rerun",
                "checks/lora_gpu.sh",
                "nvidia-h200",
                "checks/lora-gpu again on the tree whose adapters fold into the base's "
                "matmul: the peft load of the exported adapter against the merged export",
                device_env=True,
                carry=WHL,
                results=("lora_rerun_h200_2026-11-28",),
            ),
        ),
    ),
    Suite(
        "refactor",
        "a refactor changes no result: the exact losses of the tree before it and this one",
        (
            Row(
                "lora-gpu",
                "checks/lora_gpu.sh",
                "nvidia-h200",
                "LoRA r=16 beside a full fine-tune of a Llama-shaped folder on one GPU; the adapter "
                "exported, loaded by peft, its loss against the merged export's",
                device_env=True,
                carry=WHL,
                results=("lora_h200_2026-11-28",),
            ),
            Row(
                "qlora-smoke",
                "checks/qlora_smoke_gpu.sh",
                "nvidia-h200",
                "the frozen base on a GPU, first contact: a Llama-3.1-8B-shaped LoRA from its "
                "preset with the base in NF4 on an 80 GB share, then bf16 with half its blocks "
                "streamed from host RAM (.whl must carry bitsandbytes); its output is the "
                "smoke.txt of lora8_h200_2026-11-28 (run in the same call)",
                device_env=True,
                carry=WHL,
            ),
            Row(
                "cpu",
                "checks/refactor_losses_cpu.py",
                "cpu",
                "the exact losses of every engine, stage, placement, TP, CP and compile setting "
                "(1 and 2 gloo ranks); run it in each tree, AGAINST= the other tree's file",
                args="--out $OUT/losses.json ${AGAINST:+--against $AGAINST}",
                results=(
                    "refactor_h100_2026-11-26",
                    "long_cpu_2026-11-26",
                    "refactor_cpu_2026-11-28",
                ),
            ),
            Row(
                "gpu",
                "checks/refactor_gpu.sh",
                H100,
                "GPT-2 1.5 B and an 8 B offloaded plan trained by the old tree (`.base`: `git "
                "archive` of it, unpacked) and this one: losses and step times (TREES, ONLY)",
                env="BEFORE=.base",
                device_env=True,
                carry=(".whl", ".base"),
                results=("refactor_h100_2026-11-26", "refactor_h100_2026-11-28"),
            ),
        ),
    ),
)

# Scripts the rows call or source; not entry points of their own.
HELPERS = (
    "device_env.sh",
    "multi_gpu/x4_env.sh",
    "multi_gpu/nodes_summary.py",
    "stdlib_jsonl.py",
    "peers/llama_gpu.py",
    "peers/lora_gpu.py",
    "peers/moe_gpu.py",
    "run.py",
    "suites.py",
)


def _history(script: str, *results: str) -> Past:
    return Past(f"`benchmarks/history/{script}`", HISTORY_COMMIT, results)


PAST: tuple[Past, ...] = (
    _history("mfu_2p7b.sh", "mfu_2p7b_h100_2026-11-22"),
    _history("zero_x2.sh", "zero_x2_h200_2026-11-22"),
    _history("memory_h100.sh", "memory_h100_2026-11-22"),
    _history("sweep_h100.sh", "sweep_h100_2026-11-22"),
    _history("offload_h100.sh", "offload_preview_h100_2026-11-22"),
    _history("tiers_h100.sh", "tiers_h100_2026-11-22"),
    _history("tiers_gpu_check.py", "tiers_gpu_check_h100_2026-11-22"),
    _history("nvme_h100.sh", "nvme_h100_2026-11-22"),
    _history("host_ckpt_gpu.py", "host_ckpt_h100_2026-11-22"),
    _history("moments_loss.sh", "moments_loss_cpu_2026-11-22"),
    _history("loss_curves.py", "moments_loss_cpu_2026-11-22", "dpu_loss_cpu_2026-11-22"),
    _history("ckpt_save_cpu.py", "ckpt_save_cpu_2026-11-23"),
    _history("refactor_check.py", "refactor_check_h100_2026-11-23"),
    _history("compact_check.py", "compact_h100_2026-11-23"),
    _history(
        "compact_gpu.py",
        "compact_h100_2026-11-23",
        "compact_native_h100_2026-11-23",
        "compact_x2_h200_2026-11-23",
    ),
    _history("compact_loss.py", "compact_h100_2026-11-23"),
    _history("speculate_h100.sh", "speculate_h100_2026-11-23"),
    _history("speculate_steady.py", "speculate_steady_h100_2026-11-23"),
    _history("spec_growth_h100.sh", "spec_growth_h100_2026-11-23"),
    _history("compile_h100.sh", "compile_2p7b_h100_2026-11-23"),
    _history(
        "profile_h100.sh",
        "profile_h100_2026-11-23",
        "ab_speed2_h100_2026-11-24",
        "ab_speed3_h100_2026-11-24",
    ),
    _history("small_step_h100.sh", "small_step_h100_2026-11-23"),
    _history("block_code_gpu.py", "ab_speed2_h100_2026-11-24"),
    _history("mfu_floor_gpu.py", "ab_speed3_h100_2026-11-24"),
    _history("compile_user_path_h100.sh", "ab_speed3_h100_2026-11-24"),
    _history("offload_compile_h100.sh", "offload_compile_h100_2026-11-24"),
    _history("block_speed_gpu.py", "offload_compile_h100_2026-11-24"),
    _history("precision_loss_cpu.py", "precision_loss_cpu_2026-11-24"),
    _history("lr_width_cpu.sh", "lr_width_cpu_2026-11-24"),
    Past("`benchmarks/delayed_h100.sh`", "104145a", ("delayed_h100_2026-11-23",)),
    Past("`benchmarks/dpu_loss.sh`", "104145a", ("dpu_loss_cpu_2026-11-22",)),
    Past(
        "`benchmarks/results/ab_small_h100_2026-11-23/ab_small_h100.sh` and `ab_engine.patch`",
        HISTORY_COMMIT,
        ("ab_small_h100_2026-11-23",),
    ),
    Past(
        "`fitgpt train --gpus 2 --preset 20b`, by hand (the command in its README)",
        "144337a",
        ("user_path_x2_h200_2026-11-24",),
    ),
)


def rows() -> list[tuple[Suite, Row]]:
    return [(s, r) for s in SUITES for r in s.rows]


def select(spec: str) -> list[tuple[Suite, Row]]:
    """SUITE or SUITE/ROW to its rows, in order; [] if it names none."""
    suite, _, row = spec.partition("/")
    return [(s, r) for s, r in rows() if s.name == suite and (not row or r.name == row)]
