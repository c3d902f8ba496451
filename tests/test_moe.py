"""Mixture of experts: Qwen3-MoE and Mixtral (model/families/qwen3_moe, mixtral) against
transformers' Qwen3MoeForCausalLM and MixtralForCausalLM: logits, the load-balancing loss, import
then export bit for bit, greedy generation, a 30-step fine-tune against a plain transformers
loop, the presets' parameter counts, the planner's FLOPs, ZeRO at world size 2, refusals.

Every HF model is built here with random weights (2 layers, 64 wide, 4 experts, top 2) and saved
to a temporary folder: nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    TWO_RANK_ENGINES,
    assert_config_carried,
    close,
    engine_losses,
    imported_runs,
    saved_hf_models,
    tensors,
    two_rank_losses,
)
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from fitgpt.cli import main
from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate, load_model
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.interop.hf_export import export_hf
from fitgpt.model import ModelConfig, build_model, get_preset
from fitgpt.parallel.shard import tensor_parallel_refusal

BASE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
    vocab_size=300, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2,
    initializer_range=0.05,  # off transformers' default: export carries it back
)  # fmt: skip
# name -> (config class, its fields): Qwen3-MoE with a dense layer 0 (decoder_sparse_step 2),
# with mlp_only_layers and unnormalised top-k weights and the aux loss on in config.json;
# Mixtral with a window shorter than the sequence (and Mixtral-8x7B's router_aux_loss_coef 0.02
# with the aux loss off: export keeps it), and with 4:1 grouped-query attention
CASES = {
    "qwen3moe-step2": (
        Qwen3MoeConfig,
        dict(intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=32,
             num_experts=4, decoder_sparse_step=2, norm_topk_prob=True),
    ),
    "qwen3moe-dense0-unnormed-aux": (
        Qwen3MoeConfig,
        dict(intermediate_size=96, moe_intermediate_size=48, num_key_value_heads=2, num_experts=4,
             mlp_only_layers=[0], norm_topk_prob=False, output_router_logits=True,
             router_aux_loss_coef=0.02, num_hidden_layers=3),
    ),
    "mixtral-window8": (
        MixtralConfig,
        dict(intermediate_size=32, num_key_value_heads=2, num_local_experts=4, sliding_window=8,
             router_aux_loss_coef=0.02),
    ),
    "mixtral-gqa4": (
        MixtralConfig,
        dict(intermediate_size=48, num_key_value_heads=1, num_local_experts=4),
    ),
}  # fmt: skip
X = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))


def build_hf(name: str, seed: int = 0, **changes):
    """A random HF model of case `name` (its fields with `changes`); norms near 1, so a mix-up
    (gate for up, w1 for w3) cannot hide behind a default value."""
    cls, fields = CASES[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**(BASE | fields | changes))).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.1 if "norm" in n else 0.08)
    return model


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """Each case's model, saved once: {name: (model, folder)}."""
    return saved_hf_models(build_hf, CASES, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def imported(hf_folders, tmp_path_factory):
    """Each case imported once: {name: run folder}."""
    return imported_runs(hf_folders, tmp_path_factory.mktemp("runs"))


def hf_loss(ref, x, y):
    """transformers' training loss on inputs x, next tokens y (its own loss path: the mean
    cross-entropy plus router_aux_loss_coef · aux when output_router_logits), and its aux."""
    y = y.contiguous()
    out = ref(x, labels=y, shift_labels=y, output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), y.flatten())
    return out.loss, out.aux_loss, ce


# ---- the network -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_training_loss_equal_transformers(hf_folders, imported, name):
    ref, _ = hf_folders[name]
    model, _ = load_model(imported[name], torch.device("cpu"))
    cfg = model.cfg
    assert cfg.family == ref.config.model_type and cfg.num_experts == 4
    with torch.no_grad():
        torch.testing.assert_close(model(X)[..., :300], ref(X).logits, rtol=0, atol=1e-5)
    # training: the aux loss as transformers computes it, added when config.json asks
    model.train(), ref.train()
    x, y = X[:, :-1], X[:, 1:]
    want, want_aux, ce = hf_loss(ref, x, y)
    coef = ref.config.router_aux_loss_coef if ref.config.output_router_logits else 0.0
    assert cfg.router_aux_loss_coef == coef
    got = model(x, y)
    assert abs(got.item() - (ce.item() + coef * want_aux.item())) < 1e-5
    if coef:
        assert abs(got.item() - want.item()) < 1e-5
    report = model.router_report()
    assert abs(report["router_aux_loss"] - want_aux.item()) < 1e-5
    assert len(report["expert_load"]) == len(cfg.moe_layers)
    assert all(abs(sum(row) - 1) < 1e-4 for row in report["expert_load"])
    # with a coefficient the aux gradient reaches every router
    model.zero_grad()
    model.cfg.__dict__["router_aux_loss_coef"] = 0.5  # a frozen config, changed for this check
    (model(x, y) - model.eval()(x, y)).backward()
    model.cfg.__dict__["router_aux_loss_coef"] = coef
    assert all(
        b.mlp.router.weight.grad.abs().sum() > 0 for b in model.blocks if hasattr(b.mlp, "router")
    )


def test_the_cases_cover_what_the_families_vary(imported):
    cfgs = {n: load_model(r, torch.device("cpu"))[0].cfg for n, r in imported.items()}
    assert cfgs["qwen3moe-step2"].moe_layers == (1,) and cfgs["qwen3moe-step2"].qk_norm
    assert cfgs["qwen3moe-dense0-unnormed-aux"].moe_layers == (1, 2)
    assert not cfgs["qwen3moe-dense0-unnormed-aux"].norm_topk_prob
    assert cfgs["mixtral-window8"].sliding_window == 8 < X.shape[1]
    assert cfgs["mixtral-gqa4"].kv_heads == 1 and cfgs["mixtral-gqa4"].ffn_hidden is None
    assert all(c.norm_topk_prob for n, c in cfgs.items() if n.startswith("mixtral"))


def test_the_experts_run_sorted_and_equal_a_per_token_loop():
    """The sorted-token experts against the plain sum over each token's k experts."""
    cfg = model_config_from_hf((BASE | CASES["mixtral-gqa4"][1] | {"model_type": "mixtral"}), "m")
    model = build_model(cfg)
    model.reset_parameters(seed=1)
    moe = model.blocks[0].mlp
    x = torch.randn(20, 64)
    p = torch.softmax(moe.router(x), -1)
    w, idx = p.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    fc, proj = moe.experts.fc.view(4, 96, 64), moe.experts.proj.view(4, 64, 48)
    want = torch.zeros_like(x)
    for n in range(20):
        for k in range(2):
            g, u = (fc[idx[n, k]] @ x[n]).chunk(2)
            want[n] += w[n, k] * (proj[idx[n, k]] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(moe(x[None])[0], want, rtol=0, atol=1e-6)


# ---- in and out --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_import_then_export_is_bit_exact_and_loads_in_transformers(
    hf_folders, imported, tmp_path, name
):
    ref, folder = hf_folders[name]
    export_hf(imported[name], tmp_path / "out")
    a, b = tensors(folder), tensors(tmp_path / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    src, out = (json.loads((p / "config.json").read_text()) for p in (folder, tmp_path / "out"))
    for key in (
        "model_type", "architectures", "intermediate_size", "num_experts_per_tok",
        "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step",
        "sliding_window", "output_router_logits", "router_aux_loss_coef",
    ):  # fmt: skip
        assert src.get(key) == out.get(key), key
    # transformers 5 writes num_local_experts for both; export writes Qwen3-MoE's published key
    experts = [c.get("num_local_experts", c.get("num_experts")) for c in (src, out)]
    assert experts == [4, 4]
    assert_config_carried(folder, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    assert type(back) is type(ref)
    with torch.no_grad():
        assert torch.equal(back(X).logits, ref(X).logits)


def test_export_keeps_what_a_fine_tune_changed_and_carries_the_rest(hf_folders):
    """carried.py's rule on Qwen3-MoE's config.json: a field the model changed (the aux loss
    a fine-tune switched on with its own coefficient) stays fitgpt's, the others come back,
    and the result reads as fitgpt's model."""
    from fitgpt.interop.carried import carry_source
    from fitgpt.interop.hf import mapping_for_model

    src = json.loads((hf_folders["qwen3moe-step2"][1] / "config.json").read_text())
    cfg = model_config_from_hf(src, "src").replace(router_aux_loss_coef=0.5)
    mapping = mapping_for_model(cfg)
    written = mapping.hf_config(cfg, {})
    out = carry_source(
        written, src | {"quantization_config": {"quant_method": "mxfp4"}}, mapping, "x"
    )
    assert (out["router_aux_loss_coef"], out["output_router_logits"]) == (0.5, True)
    assert src["output_router_logits"] is False
    assert out["initializer_range"] == src["initializer_range"] != written["initializer_range"]
    assert "quantization_config" not in out
    assert model_config_from_hf(out, "out") == model_config_from_hf(written, "out")


def test_cli_import_and_export(hf_folders, tmp_path):
    _, folder = hf_folders["qwen3moe-step2"]
    for argv in (
        ["import", "hf", str(folder), "--out", str(tmp_path / "run")],
        ["export", "--ckpt", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "o")],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code in (0, None), argv
    a, b = tensors(folder), tensors(tmp_path / "o")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["qwen3moe-step2", "mixtral-window8"])
def test_greedy_generation_equals_transformers(hf_folders, imported, name):
    """30 tokens with fitgpt's KV cache (Mixtral's 35 positions through a window of 8)."""
    ref, _ = hf_folders[name]
    model, _ = load_model(imported[name], torch.device("cpu"))
    x = X[:1, :5]
    ours = generate(model, x, SampleConfig(max_new_tokens=30, temperature=0.0))
    with torch.no_grad():
        theirs = ref.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=30,
            min_new_tokens=30, pad_token_id=0,
        )  # fmt: skip
    assert ours[0].tolist() == theirs[0].tolist()


# ---- training ----------------------------------------------------------------------------------
STEPS, LR, MB = 30, 2e-3, 4


def transformers_losses(ref, batches) -> list[float]:
    """A plain transformers loop: AdamW as fitgpt's (betas 0.9/0.95, eps 1e-8, decay 0.1 on the
    matrices only), the global norm clipped at 1, a constant rate, fp32."""
    decay = [p for p in ref.parameters() if p.ndim >= 2]
    rest = [p for p in ref.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    ref.train()
    out = []
    for x, y in batches:
        y = y.contiguous()
        loss = ref(x, labels=y, shift_labels=y).loss  # + coef·aux where config.json asks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize(
    "name, flags",
    [("qwen3moe-dense0-unnormed-aux", []), ("mixtral-window8", ["--router-aux-loss-coef", "0.05"])],
)
def test_a_30_step_fine_tune_equals_a_transformers_loop(hf_folders, tmp_path, name, flags):
    """`fitgpt train --init-from FOLDER` (zero engine, stage 0, fp32) against transformers on
    the same batches: the aux loss from config.json (Qwen3-MoE) or from the flag (Mixtral)."""
    _, folder = hf_folders[name]
    # the same weights; the flag's coefficient as config.json would say it
    aux = dict(output_router_logits=True, router_aux_loss_coef=float(flags[1])) if flags else {}
    ref = build_hf(name, **aux)
    out = tmp_path / "run"
    argv = [
        "train", "--init-from", str(folder), "--plan", "off", "--engine", "zero",
        "--zero-stage", "0", "--precision", "fp32", "--device", "cpu", "--data", "synthetic",
        "--seq-len", "32", "--micro-batch", str(MB), "--grad-accum", "1", "--steps", str(STEPS),
        "--lr", str(LR), "--min-lr", str(LR), "--warmup", "0", "--eval-every", "0",
        "--log-every", "1", "--out", str(out), *flags,
    ]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code in (0, None)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("kind") == "train"]
    got = [r["loss"] for r in recs]
    src, _, _ = open_data(DataConfig(data="synthetic"), 32, 300, 0)
    loader = BatchLoader(src, MB, 0, 1)
    batches = [loader.next()[:2] for _ in range(STEPS)]
    want = transformers_losses(ref, batches)
    assert len(got) == STEPS and close(got, want), (got, want)
    assert all("router_aux_loss" in r and len(r["expert_load"]) == 2 for r in recs)


def test_plan_prices_state_by_total_and_compute_by_active_parameters(capsys):
    cfg = get_preset("qwen3-moe-30b-a3b")
    total, active = cfg.num_params(), build_model_active(cfg)
    attn = 12.0 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len
    assert cfg.flops_per_token() == 6.0 * active + attn
    assert 6.0 * total > 5 * cfg.flops_per_token()  # 30.5 B total, 3.3 B active
    with pytest.raises(SystemExit) as e:
        main(["plan", "--preset", "qwen3-moe-30b-a3b", "--gpus", "4", "--gpu-mem", "80GB",
              "--cpu-mem", "500GB"])  # fmt: skip
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert "30.53 B parameters" in out, out
    # the chosen plan's figures: FLOP/s per GPU = active FLOPs per token × tokens/s / 4
    row = next(line for line in out.splitlines() if line.startswith(">")).split()
    tokens_s = float(row[row.index("TFLOP/s") - 2].replace(",", ""))
    tflops = float(row[row.index("TFLOP/s") - 1])
    per_token = tflops * 1e12 * 4 / tokens_s
    assert abs(per_token / cfg.flops_per_token() - 1) < 0.01, (per_token, cfg.flops_per_token())


def build_model_active(cfg: ModelConfig) -> int:
    """The multiplying parameters a token uses, counted on the meta-device model: all but the
    input embedding (the head is untied), and of each sparse layer's experts the k it uses."""
    with torch.device("meta"):
        model = build_model(cfg)
    n = sum(p.numel() for name, p in model.named_parameters() if name != "wte.weight")
    unused = (cfg.num_experts - cfg.experts_per_token) / cfg.num_experts
    for b in model.blocks:
        n -= int(unused * (b.mlp.experts.fc.numel() + b.mlp.experts.proj.numel()))
    return n


PRESET_CONFIGS = {
    "qwen3-moe-30b-a3b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, vocab_size=151936, norm_topk_prob=True)),
    "qwen3-moe-235b-a22b": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, vocab_size=151936, norm_topk_prob=True)),
    "mixtral-8x7b": (MixtralConfig, MixtralForCausalLM, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)),
    "mixtral-8x22b": (MixtralConfig, MixtralForCausalLM, dict(
        hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PRESET_CONFIGS))
def test_the_presets_count_what_transformers_builds(preset):
    """Each preset's num_params equals transformers' model of the published config.json, built
    on the meta device, and fitgpt's own network (the padded vocabulary aside)."""
    cfg_cls, cls, fields = PRESET_CONFIGS[preset]
    with torch.device("meta"):
        theirs = sum(p.numel() for p in cls(cfg_cls(**fields)).parameters())
        ours = build_model(get_preset(preset)).num_params()
    cfg = get_preset(preset)
    pad = (cfg.padded_vocab_size - cfg.vocab_size) * cfg.n_embd * 2  # embedding and head
    assert cfg.num_params() == ours == theirs + pad
    assert model_config_from_hf(cfg_cls(**fields).to_dict(), preset).num_params() == ours


# ---- world size 2 ------------------------------------------------------------------------------
TINY_MOE = model_config_from_hf(
    BASE | CASES["qwen3moe-step2"][1] | {"model_type": "qwen3_moe", "max_position_embeddings": 32},
    "tiny",
)
KEYS = ["zero1", "zero2", "zero3", "zero3_offload_stream"]


def _two_rank_worker(rank, world, tmp) -> None:
    two_rank_losses({"moe": (TINY_MOE, KEYS)}, tmp, 4, 1.0)


@pytest.mark.slow
def test_zero_stages_and_offload_at_world_size_2_equal_one_process(gloo, tmp_path):
    """ZeRO 1-3 and the streamed, offloaded ZeRO-3 at world size 2 on gloo: one process's
    losses (the aux loss off: each rank balances its own rows, as transformers under DDP)."""
    one = engine_losses(
        TINY_MOE, EngineConfig(engine="zero"), DistContext(0, 1, 0, torch.device("cpu")), 4, 1.0
    )
    gloo(2, _two_rank_worker, str(tmp_path))
    res = json.loads((tmp_path / "results.json").read_text())["moe"]
    for key in KEYS:
        assert key in TWO_RANK_ENGINES and close(res[key]["loss"], one["loss"]), key


# ---- refusals ----------------------------------------------------------------------------------
QWEN3_MOE = BASE | CASES["qwen3moe-step2"][1] | {"model_type": "qwen3_moe"}


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"num_experts_per_tok": 5}, "exceeds the 4 experts"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"output_router_logits": "yes"}, "output_router_logits='yes'"),
        ({"norm_topk_prob": 1}, "norm_topk_prob=1"),
        ({"model_type": "mixtral", "router_jitter_noise": 0.01}, "router_jitter_noise=0.01"),
    ],
)
def test_config_json_refusals_are_one_line(change, needle):
    with pytest.raises(UserError) as e:
        model_config_from_hf(QWEN3_MOE | change, "config.json")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("only", [[7], [-1, 0], [1, 2, 3]])
def test_mlp_only_layers_past_the_model_are_ignored_as_transformers_does(only):
    """transformers makes layer i dense where i is in mlp_only_layers, so an entry that is no
    layer (a model cut to fewer layers keeps its list) changes nothing: fitgpt's sparse layers
    are transformers' (it refused the folder before 2026-11-28)."""
    hf = QWEN3_MOE | {"mlp_only_layers": only, "decoder_sparse_step": 1}
    cfg = model_config_from_hf(hf, "config.json")
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields))
    sparse = [i for i, b in enumerate(ref.model.layers) if hasattr(b.mlp, "gate")]
    assert cfg.moe_layers == tuple(sparse)


def test_experts_outside_a_moe_family_and_tensor_parallelism_are_refused():
    with pytest.raises(UserError, match="has a dense MLP"):
        get_preset("llama3.1-8b").replace(num_experts=8, experts_per_token=2, moe_ffn_hidden=64)
    with pytest.raises(UserError, match=r"router_aux_loss_coef=0\.01 is for a mixture"):
        get_preset("llama3.1-8b").replace(router_aux_loss_coef=0.01)
    with pytest.raises(UserError, match="always renormalises"):
        get_preset("mixtral-8x7b").replace(norm_topk_prob=False)
    why = tensor_parallel_refusal(2, get_preset("qwen3-moe-30b-a3b"))
    assert why and "the experts" in why


@pytest.mark.parametrize("preset", ["qwen3-moe-30b-a3b", "mixtral-8x7b"])
def test_recompute_is_priced_by_the_active_parameters(preset):
    """Checkpointing recomputes a forward of the k experts a token goes to, not of all of them:
    compute is priced by 6 FLOPs per active multiplying parameter and the recompute by 2 per
    active parameter (the input embedding counted, as for dense models), so a checkpointed
    step's compute is about 1 + RECOMPUTE/3 of an uncheckpointed one's, as for a dense model.
    Priced by the total it was over 2.5 times the uncheckpointed compute."""
    from fitgpt.engine.config import EngineConfig
    from fitgpt.plan import rates
    from fitgpt.plan.memory import Workload
    from fitgpt.plan.throughput import RECOMPUTE, compute_seconds

    work = Workload(get_preset(preset), micro_batch=1, world=1)
    r = rates.load("NVIDIA H100 80GB HBM3")
    off = compute_seconds(work, EngineConfig(checkpointing="off"), 4096, r)
    full = compute_seconds(work, EngineConfig(checkpointing="full"), 4096, r)
    assert 1 + RECOMPUTE / 3 <= full / off < 1 + 1.1 * RECOMPUTE / 3, full / off
