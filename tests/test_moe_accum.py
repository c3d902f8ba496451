"""A mixture's load-balancing loss under gradient accumulation (engine/base.py step_share): each
micro-batch adds coef·aux over all its tokens at the same weight, whatever its counted targets,
so the step's aux is the mean over the micro-batches, while the cross-entropy stays the mean
over the step's counted targets. Checked against transformers' Qwen3MoeForCausalLM (its
aux_loss is load_balancing_loss_func over every token of one forward) on both engines.

A tiny random Qwen3-MoE (2 layers, 32 wide, 4 experts, top 2, coef 0.5) is built and saved
here: nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.interop.init_source import find_source

COEF, T, V = 0.5, 16, 64
CPU = DistContext(0, 1, 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = Qwen3MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        vocab_size=V, max_position_embeddings=T, output_router_logits=True,
        router_aux_loss_coef=COEF,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # a router far from uniform: the aux loss and its gradient are large
        for n, p in model.named_parameters():
            p.normal_(
                1.0 if "norm" in n else 0.0, 0.1 if "norm" in n else 0.3 if "gate." in n else 0.08
            )
    out = tmp_path_factory.mktemp("hf") / "qwen3moe"
    model.save_pretrained(out)
    return out


def batch(seed: int, rows: int, counted: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` rows of T tokens and their next tokens; only the last `counted` targets of each
    row counted (-1 before them: a chat turn's prompt), none when 0."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (rows, T + 1), generator=g)
    x, y = seq[:, :-1], seq[:, 1:].clone()
    y[:, : T - counted] = -1
    return x, y


def fitgpt_step(folder, engine: str, micro_batches) -> tuple[float, float]:
    """(loss, gradient norm) of one step of `micro_batches` from the folder's weights."""
    source = find_source(str(folder))
    ecfg = EngineConfig(engine=engine, **({"zero_stage": 0} if engine == "zero" else {}))
    e = build_engine(source.model, ecfg, PrecisionConfig("fp32"), OptimConfig(grad_clip=0), CPU)
    e.load_state(source.weights, {}, optimizer=False)
    stats = e.train_step(micro_batches, 1e-3)
    e.close()
    return stats.loss, stats.grad_norm


def transformers_step(folder, micro_batches, aux_of) -> tuple[float, float]:
    """(loss, gradient norm) of transformers' model on `micro_batches`: the cross-entropy over
    all their counted targets, plus COEF times aux_of(the list of each micro-batch's aux)."""
    ref = AutoModelForCausalLM.from_pretrained(folder).train()
    counted = sum(int((y != -1).sum()) for _, y in micro_batches)
    ce_sum, auxes = 0.0, []
    for x, y in micro_batches:
        labels = torch.where(y == -1, -100, y)
        out = ref(x, output_router_logits=True)
        logits = out.logits.flatten(0, 1)
        ce_sum = ce_sum + torch.nn.functional.cross_entropy(
            logits, labels.flatten(), ignore_index=-100, reduction="sum"
        )
        auxes.append(out.aux_loss)
    loss = ce_sum / counted + COEF * aux_of(auxes)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    return loss.item(), norm.item()


def mean(auxes):
    return sum(auxes) / len(auxes)


@pytest.mark.parametrize("engine", ["ddp", "zero"])
def test_a_micro_batch_without_answers_still_balances_the_router(folder, engine):
    """Chat data: micro-batch 1 has no counted target (no assistant token), micro-batch 2 a
    few per row. The step is the cross-entropy of micro-batch 2's answers plus coef times the
    mean of both micro-batches' aux: micro-batch 1's router gradient is in the step (weighted
    by the counted targets, as before, it was dropped, and micro-batch 2's aux doubled)."""
    micro = [batch(1, 2, counted=0), batch(2, 2, counted=5)]
    got = fitgpt_step(folder, engine, micro)
    want = transformers_step(folder, micro, mean)
    assert got == pytest.approx(want, rel=1e-5)
    dropped = transformers_step(folder, micro, lambda auxes: auxes[1])  # the old weighting
    assert abs(got[1] - dropped[1]) > 1e-3 * dropped[1]


def test_accumulating_two_halves_takes_the_mean_of_their_aux(folder):
    """One micro-batch of 4 rows is transformers' forward of those rows, its loss and its
    gradient (the aux over all 4·T tokens). Two micro-batches of 2 rows each have the same
    cross-entropy (the mean over the step's targets) but the mean of the halves' aux: the aux
    multiplies a share of assignments by a mean probability, both over a forward's tokens, and
    the mean of two such products is not the product over their union. transformers trains
    the same way: each forward's aux is its own tokens'."""
    x, y = batch(3, 4, counted=T)
    halves = [(x[:2], y[:2]), (x[2:], y[2:])]
    whole = fitgpt_step(folder, "ddp", [(x, y)])
    assert whole == pytest.approx(transformers_step(folder, [(x, y)], mean), rel=1e-5)
    accumulated = fitgpt_step(folder, "ddp", halves)
    assert accumulated == pytest.approx(transformers_step(folder, halves, mean), rel=1e-5)
    assert abs(accumulated[0] - whole[0]) > 1e-6  # they differ, by the aux alone
