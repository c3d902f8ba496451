"""`--expert-parallel P` across a resume, by the fitgpt command on real files: a Qwen3-MoE folder
saved by transformers with a real tokenizer (random weights, 2 layers, 32 wide, 4 experts, top
2), chat data from `fitgpt data preprocess --chat`, 2 steps at P = 2 over 2 gloo ranks, saved,
then `--resume` on one process without typing P again, planned and with --plan off: the losses
of one process's run throughout. P moves whole experts and nothing saved depends on it
(checkpoints hold the full layout), so a saved P that does not divide the new rank count is no
reason to refuse the resume; a P typed again is the user's and is checked as given.

Before 2026-11-28 both resumes were refused ("--expert-parallel 2 does not divide the 1 rank(s)
of this run"), the flag never typed on the resume: the saved P was judged as a setting although
the planner chooses it, and --plan off kept it as it was.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import tokenizer_folders as tf
import torch
from cli_refusal import run_main
from helpers import fitgpt_rank
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

S, STEPS = 64, 4
TRAIN = ["--seq-len", str(S), "--micro-batch", "2", "--device", "cpu", "--precision", "fp32",
         "--log-every", "1", "--eval-every", "0", "--engine", "zero", "--zero-stage", "1"]  # fmt: skip


def losses(run) -> list[float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The HF folder (with its tokenizer), the chats' data prefix, and a run saved at P = 2."""
    from conftest import run_gloo

    root = tmp_path_factory.mktemp("moe_ep_resume")
    tok = tf.qwen(root / "tok")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "ok", "why"]
    with open(root / "chats.jsonl", "w") as f:
        for _ in range(40):
            say = lambda k: " ".join(rng.choice(words) for _ in range(rng.randint(1, k)))  # noqa: E731
            msgs = [{"role": "user", "content": say(3)}, {"role": "assistant", "content": say(4)}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(SystemExit):
        from fitgpt.cli import main

        main(["data", "preprocess", "--chat", "--input", str(root / "chats.jsonl"),
              "--tokenizer", str(tok), "--output-prefix", str(root / "chats")])  # fmt: skip
    prefix = str(next(root.glob("chats*.idx")).with_suffix("")).removesuffix(".loss_mask")
    cfg = Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, vocab_size=482, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "hf")
    for f in tok.iterdir():
        shutil.copy(f, root / "hf" / f.name)
    common = ["--init-from", root / "hf", "--data", prefix, *TRAIN]
    run_gloo(2, fitgpt_rank, ["train", *common, "--grad-accum", "1", "--expert-parallel", "2",
             "--steps", 2, "--save-every", 2, "--out", root / "ep2"])  # fmt: skip
    return {"root": root, "common": common}


@pytest.fixture(scope="module")
def one_process(files):
    """The same run on one process (2 micro-batches a step: the 2 ranks' rows): its losses."""
    from fitgpt.cli import main

    run = files["root"] / "one"
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in ["train", *files["common"], "--grad-accum", "2", "--steps", STEPS,
                               "--no-save", "--out", run]])  # fmt: skip
    assert e.value.code in (0, None)
    return losses(run)


@pytest.mark.parametrize("plan", ["auto", "off"])
def test_a_run_saved_at_p2_resumes_on_one_process_without_typing_p(
    files, one_process, capsys, tmp_path, plan
):
    run = tmp_path / "run"
    shutil.copytree(files["root"] / "ep2", run)
    code, out, err = run_main(capsys, "train", "--out", run, "--resume", "--steps", STEPS,
                              "--grad-accum", "2", "--plan", plan)  # fmt: skip
    assert code == 0, err
    assert "world size 2 → 1" in out and "--expert-parallel 2 → 1" in out, out
    got = losses(run)
    assert len(got) == STEPS and max(abs(a - b) for a, b in zip(got, one_process)) < 1e-5


def test_a_p_typed_again_on_the_resume_is_checked_as_given(files, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(files["root"] / "ep2", run)
    code, _, err = run_main(capsys, "train", "--out", run, "--resume", "--steps", STEPS,
                            "--expert-parallel", "2")  # fmt: skip
    assert code != 0 and "--expert-parallel 2 does not divide the 1 rank(s)" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("ep, world, kept", [(4, 2, False), (4, 6, False), (8, 12, False),
                                             (2, 4, False), (4, 2, True)])  # fmt: skip
def test_a_saved_p_is_fitted_to_a_divisor_of_the_ranks_and_of_itself(ep, world, kept):
    """--plan off: the P resumed divides the new rank count and the saved P (so it divides the
    experts the saved P did); a P the planner chooses or the user typed stays as it is."""
    from fitgpt.train.resume import fit_degree

    p, notes = fit_degree("--expert-parallel", ep, world, kept)
    if kept or world % ep == 0:
        assert (p, notes) == (ep, [])
    else:
        assert world % p == 0 and ep % p == 0 and p > 1 and len(notes) == 1
        assert not any(world % q == 0 and ep % q == 0 for q in range(p + 1, ep)), p
