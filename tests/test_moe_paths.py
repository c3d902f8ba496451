"""Everything else a mixture of experts goes through (issue 50 item 6), for Qwen3-MoE, Mixtral
and gpt-oss, by the fitgpt command on real files: chat SFT on packed rows (`fitgpt data
preprocess --chat`, then `fitgpt train --init-from FOLDER`), a ZeRO run at world size 2 on gloo
resumed on one process at another stage, `fitgpt export --format hf` loaded by transformers,
`fitgpt generate` (the KV cache) equal to transformers' greedy decoding, context parallelism
(C = 2) equal to one process, `--compile on` equal to eager with no graph break, and gpt-oss's
context parallelism refused in one line.

Every HF model is built here with random weights (2 layers, 64 wide, 4 experts, top 2, the
vocabulary of tests/tokenizer_folders.py's Qwen tokenizer) and saved with its tokenizer to a
temporary folder: nothing is downloaded. The aux loss is off (config.json's default): under
data or context parallelism each rank balances its own tokens, as transformers under DDP.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil

import pytest
import tokenizer_folders as tf
import torch
from cli_refusal import run_main
from helpers import CXX, fitgpt_rank
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GptOssConfig,
    MixtralConfig,
    Qwen3MoeConfig,
)

from fitgpt.cli import main
from fitgpt.engine.config import EngineConfig, PrecisionConfig
from fitgpt.errors import UserError
from fitgpt.infer.generate import load_model
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.model import build_model
from fitgpt.model.families.qwen3_moe.model import expert_mm
from fitgpt.plan.validate import check_settings
from fitgpt.train.rundir import read_record

# the Qwen tokenizer's size, the models' vocabulary: generate samples no id the tokenizer lacks
# (transformers' greedy may pick one of a larger vocabulary's unused rows)
VOCAB = 482
COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, vocab_size=VOCAB, num_experts_per_tok=2, bos_token_id=None,
    eos_token_id=None,
)  # fmt: skip
# Mixtral's window and gpt-oss's (its even layers) shorter than the 64-token rows
CONFIGS = {
    "qwen3_moe": Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                head_dim=16, num_experts=4, norm_topk_prob=True),
    "mixtral": MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                             sliding_window=16),
    "gpt_oss": GptOssConfig(**COMMON, head_dim=16, intermediate_size=32, num_local_experts=4,
                            sliding_window=8),
}  # fmt: skip
FAMILIES = list(CONFIGS)
S, STEPS = 64, 4
# one process: 2 rows a micro-batch, 2 micro-batches a step; two ranks take 2 rows each
TRAIN = ["--seq-len", str(S), "--micro-batch", "2", "--device", "cpu", "--precision", "fp32",
         "--log-every", "1", "--eval-every", "0", "--plan", "off", "--engine", "zero"]  # fmt: skip


def fitgpt(*argv) -> None:
    """`fitgpt ARGV` in this process; a failure raises with its exit code."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert e.value.code in (0, None), argv


def losses(run) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tokenizer, the chats preprocessed into packed SFT data (its prefix), and an HF
    folder per family holding the tokenizer."""
    root = tmp_path_factory.mktemp("moe_paths")
    tok = tf.qwen(root / "tok")
    assert len(AutoTokenizer.from_pretrained(tok)) == VOCAB
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "ok", "why", "because"]
    with open(root / "chats.jsonl", "w") as f:
        for _ in range(80):
            say = lambda k: " ".join(rng.choice(words) for _ in range(rng.randint(1, k)))  # noqa: E731
            msgs = [{"role": "user", "content": say(3)}, {"role": "assistant", "content": say(4)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    fitgpt("data", "preprocess", "--chat", "--input", root / "chats.jsonl", "--tokenizer", tok,
           "--output-prefix", root / "chats")  # fmt: skip
    prefix = str(next(root.glob("chats*.idx")).with_suffix("")).removesuffix(".loss_mask")
    folders = {}
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.normal_(1.0 if "norm" in n else 0.0, 0.1 if "norm" in n else 0.08)
        model.save_pretrained(root / name)
        for f in tok.iterdir():
            shutil.copy(f, root / name / f.name)
        folders[name] = root / name
    return {"root": root, "data": prefix, "hf": folders}


@pytest.fixture(scope="module")
def one_process(files):
    """Each family fine-tuned on the packed chats for STEPS steps, one process: its losses."""
    out = {}
    for name, folder in files["hf"].items():
        run = files["root"] / f"one_{name}"
        fitgpt("train", "--init-from", folder, "--data", files["data"], *TRAIN, "--grad-accum",
               "2", "--zero-stage", "1", "--steps", STEPS, "--no-save", "--out", run)  # fmt: skip
        out[name] = losses(run)
    return out


# ---- world size 2 (gloo): ZeRO, then a resume on one process; context parallelism ----------
STAGES = {"qwen3_moe": 3, "mixtral": 2, "gpt_oss": 1}  # each family another stage


@pytest.fixture(scope="module")
def two_ranks(files, one_process):
    """Over 2 gloo ranks: each family 2 steps at its ZeRO stage, saved; Qwen3-MoE and Mixtral
    STEPS steps with --context-parallel 2 (both ranks read the same rows)."""
    from conftest import run_gloo

    common = ["--data", files["data"], *TRAIN]
    for name, folder in files["hf"].items():
        run_gloo(2, fitgpt_rank, ["train", "--init-from", folder, *common, "--grad-accum", "1",
                 "--zero-stage", STAGES[name], "--steps", 2, "--save-every", 2,
                 "--out", files["root"] / f"two_{name}"])  # fmt: skip
    for name in ("qwen3_moe", "mixtral"):
        run_gloo(2, fitgpt_rank, ["train", "--init-from", files["hf"][name], *common,
                 "--grad-accum", "2", "--zero-stage", "2", "--context-parallel", "2",
                 "--steps", STEPS, "--no-save", "--out", files["root"] / f"cp_{name}"])  # fmt: skip
    return files


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_chat_sft_at_world_2_resumes_on_one_process_as_one_run(
    two_ranks, one_process, capsys, name
):
    """2 steps of ZeRO over 2 gloo ranks, then `--resume` on one process (the planner's stage,
    --grad-accum 2 keeping the rows per step): the losses of one process's run throughout."""
    run = two_ranks["root"] / f"two_{name}"
    code, out, err = run_main(capsys, "train", "--out", run, "--resume", "--steps", STEPS,
                              "--grad-accum", "2")  # fmt: skip
    assert code == 0, err
    assert "world size 2 → 1" in out and "packed into" in out, out
    got, want = losses(run), one_process[name]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_context_parallel_2_trains_as_one_process(two_ranks, one_process, name):
    """--context-parallel 2 on packed rows (each rank routes its half of every row's tokens):
    one process's losses."""
    run = two_ranks["root"] / f"cp_{name}"
    assert read_record(run)["config"]["engine"]["context_parallel"] == 2
    got, want = losses(run), one_process[name]
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_export_and_generate_of_the_resumed_run_equal_transformers(two_ranks, capsys, name):
    """`fitgpt export --format hf` of the resumed run (its last checkpoint), loaded by
    transformers: the logits of fitgpt's model, and `fitgpt generate` (greedy, KV cache) prints
    what transformers' greedy generate decodes to."""
    run = two_ranks["root"] / f"two_{name}"
    exported = two_ranks["root"] / f"hf_out_{name}"
    fitgpt("export", "--ckpt", run, "--format", "hf", "--out", exported)
    ref = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(exported)
    assert ref.config.model_type == name
    model, _ = load_model(run, torch.device("cpu"))
    assert model.cfg.family == name
    prompt = "the cat sat on the mat because"
    x = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        theirs = ref.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24,
            min_new_tokens=24, pad_token_id=0,
        )  # fmt: skip
        torch.testing.assert_close(
            model(theirs)[..., :VOCAB], ref(theirs).logits, rtol=0, atol=1e-5
        )
    code, out, err = run_main(capsys, "generate", "--ckpt", run, "--prompt", prompt,
                              "--temperature", "0", "--max-new-tokens", "24", "--ignore-eos")  # fmt: skip
    assert code == 0, err
    assert out.rstrip("\n") == tok.decode(theirs[0]), (out, tok.decode(theirs[0]))


# ---- compile ---------------------------------------------------------------------------------
def test_the_experts_trace_into_one_graph():
    """A sparse block of each family traced by dynamo: one graph, no break (the per-expert
    matmuls' host sync sits inside the custom op expert_mm)."""
    from fitgpt.engine.transforms.compile import _block_train

    for name, hf_cfg in CONFIGS.items():
        cfg = model_config_from_hf(hf_cfg.to_dict() | {"max_position_embeddings": 32}, name)
        model = build_model(cfg).train()
        model.reset_parameters(seed=0)
        x = model.embed(torch.randint(0, VOCAB, (2, 32)))
        block = model.blocks[1]
        assert hasattr(block.mlp, "router"), name
        explained = torch._dynamo.explain(_block_train)(block, x, model.block_aux(32, 0, x.device))
        assert explained.graph_break_count == 0, (name, explained.break_reasons)
        assert explained.graph_count == 1, name


def test_the_per_expert_op_equals_its_matmuls_and_their_gradients():
    """expert_mm and its backward against F.linear per expert over each expert's rows (one
    expert with no row)."""
    g = torch.Generator().manual_seed(0)
    count = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, 6, generator=g, requires_grad=True)
    w = torch.randn(4, 7, 6, generator=g, requires_grad=True)
    dy = torch.randn(10, 7, generator=g)
    (expert_mm(x, w, count) * dy).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    starts = [0, 3, 3, 8, 10]
    want = torch.cat([x2[a:b] @ w2[e].T for e, (a, b) in enumerate(itertools.pairwise(starts))])
    (want * dy).sum().backward()
    torch.testing.assert_close(expert_mm(x, w, count), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=0, atol=1e-6)
    assert not w.grad[1].any()


@pytest.mark.slow
@pytest.mark.skipif(CXX is None, reason="no C++ compiler: TorchInductor cannot compile CPU code")
def test_compiled_moe_trains_as_eager(files, tmp_path, capsys):
    """`fitgpt train --compile on` (the blocks and head + loss compiled) of Qwen3-MoE on the
    packed chats with the aux loss on: eager's losses, aux losses and expert loads, with no
    graph break and no recompile."""
    runs = {}
    for mode in ("off", "on"):
        run = tmp_path / mode
        fitgpt("train", "--init-from", files["hf"]["qwen3_moe"], "--data", files["data"], *TRAIN,
               "--grad-accum", "1", "--zero-stage", "0", "--steps", 3, "--no-save",
               "--router-aux-loss-coef", "0.05", "--compile", mode, "--out", run)  # fmt: skip
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        runs[mode] = recs
    log = capsys.readouterr().out
    assert "compile: 3 regions, 0 graph breaks, 0 recompiles" in log, log
    eager, comp = ([r for r in runs[m] if r["kind"] == "train"] for m in ("off", "on"))
    assert len(eager) == len(comp) == 3 and all(r["compiled"] for r in comp)
    for a, b in zip(eager, comp):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and a["router_aux_loss"] > 0
        assert abs(a["router_aux_loss"] - b["router_aux_loss"]) < 1e-5
        torch.testing.assert_close(b["expert_load"], a["expert_load"], rtol=0, atol=1e-4)


# ---- refusals --------------------------------------------------------------------------------
def test_gpt_oss_context_parallelism_is_refused_in_one_line(files, capsys):
    """Its sink attention is not split by heads: refused before any work, by the one
    validation train and the planner share; the other families pass it."""
    cfg = {n: model_config_from_hf(c.to_dict(), n).replace(seq_len=S) for n, c in CONFIGS.items()}
    fp32 = PrecisionConfig(precision="fp32")
    with pytest.raises(UserError) as e:
        check_settings(cfg["gpt_oss"], EngineConfig(context_parallel=2), fp32, 2, "cpu")
    assert "sinks" in str(e.value) and "use 1" in str(e.value) and "\n" not in str(e.value)
    for name in ("qwen3_moe", "mixtral"):
        check_settings(cfg[name], EngineConfig(context_parallel=2), fp32, 2, "cpu")
    code, _out, err = run_main(capsys, "train", "--init-from", files["hf"]["gpt_oss"], "--data",
                              files["data"], *TRAIN, "--context-parallel", "2", "--steps", "1",
                              "--out", files["root"] / "refused")  # fmt: skip
    assert code == 2 and "--context-parallel 2: gpt-oss's attention sinks" in err, err
    assert len(err.strip().splitlines()) == 1 and not (files["root"] / "refused").exists()
