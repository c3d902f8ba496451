"""LoRA (fitgpt/adapters) against Hugging Face PEFT: the seeded initialisation draw for draw,
the forward, a 20-step trajectory of `fitgpt train --lora-rank` against transformers + peft fed
the same batches, PEFT's folder out (`export --format peft`) and in (`--lora-from`), the merge
against merge_and_unload(), a frozen base bit for bit, the step's FLOPs, resume exact (on
another world size too), two gloo ranks against one process, and the refusals.

Every HF model is built here with random weights (2 layers, 32-64 wide) and saved to a
temporary folder: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from cli_refusal import assert_refused, run_in_process, run_process
from helpers import close, fitgpt_rank, run_config, tensors

from fitgpt.adapters import AdapterConfig, lora_targets
from fitgpt.adapters.lora import param_names
from fitgpt.cli import main
from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.engine.config import EngineConfig, OptimConfig, PrecisionConfig
from fitgpt.engine.factory import build_engine
from fitgpt.errors import UserError
from fitgpt.infer.generate import load_model
from fitgpt.interop.adapter_export import merged_base
from fitgpt.interop.hf import model_config_from_hf
from fitgpt.interop.init_source import find_source
from fitgpt.train import checkpoint as ckpt_io
from fitgpt.train.init_from import load_source

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# peft 0.21 asks transformers 5 a question it has renamed; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

CPU = DistContext(0, 1, 0, torch.device("cpu"))
V, SEQ, MB, LR = 300, 32, 4, 2e-3
X = torch.randint(0, V, (2, SEQ), generator=torch.Generator().manual_seed(1))
SMALL_LLAMA = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
# name -> the HF config: Llama with grouped-query attention (fused k/v and gate/up in fitgpt),
# GPT-2 with its Conv1D weights (PEFT's fan_in_fan_out)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=V, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=SEQ, vocab_size=V, bos_token_id=None,
        eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
    # the other Llama-shaped families: q/k/v biases, q/k norms, a sliding window
    "qwen2": lambda: transformers.Qwen2Config(**SMALL_LLAMA),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL_LLAMA, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SMALL_LLAMA, sliding_window=8),
}  # fmt: skip
# (family, --lora-targets, alpha or None, rsLoRA): every linear, one of a fused pair (its
# other half unadapted), a name both GPT-2's attention and MLP end in, and the other families
ADAPTERS = [
    ("llama", "all-linear", None, False),
    ("llama", "k_proj,down_proj", 5.0, True),
    ("gpt2", "all-linear", None, False),
    ("gpt2", "c_proj", 3.0, False),
    ("qwen2", "q_proj,v_proj", None, False),
    ("qwen3", "all-linear", None, True),
    ("mistral", "gate_proj,o_proj", 4.0, False),
]


def hf_model(name: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(1.0 if ("norm" in n or ".ln_" in n) and n.endswith("weight") else 0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> an HF folder: llama and gpt2 in fp32, llama-bf16 (the merge keeps its dtype)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name in CONFIGS:
        hf_model(name).save_pretrained(root / name)
        out[name] = root / name
    hf_model("llama").to(torch.bfloat16).save_pretrained(root / "llama-bf16")
    out["llama-bf16"] = root / "llama-bf16"
    return out


def reference(folder, targets: str, alpha, rslora: bool, seed: int, rank: int = 4):
    """transformers' model of `folder` with PEFT's LoRA, made after torch.manual_seed(seed)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    names = targets if targets == "all-linear" else targets.split(",")
    cfg = peft.LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=names,
        use_rslora=rslora, lora_dropout=0.0, fan_in_fan_out=base.config.model_type == "gpt2",
    )  # fmt: skip
    torch.manual_seed(seed)
    return peft.get_peft_model(base, cfg)


def adapter(targets="all-linear", alpha=None, rslora=False, rank=4) -> AdapterConfig:
    return AdapterConfig(lora_rank=rank, lora_alpha=alpha, lora_targets=targets, lora_rslora=rslora)


def engine_of(folder, a: AdapterConfig, seed: int, ctx=CPU, clip: float = 1.0):
    """The ddp engine with adapter `a`, its frozen base read from HF folder `folder`."""
    source = find_source(str(folder))
    e = build_engine(source.model, EngineConfig(engine="ddp"), PrecisionConfig("fp32"),
                     OptimConfig(grad_clip=clip), ctx, seed, a)  # fmt: skip
    load_source(source, e, source.model, ctx)
    return e, source


def peft_pairs(model) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module, lora_A, lora_B) of a PEFT model, in its modules' order."""
    mods = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_A") and m.lora_A]
    return [(n, m.lora_A["default"].weight, m.lora_B["default"].weight) for n, m in mods]


# ---- initialisation and forward ------------------------------------------------------------
@pytest.mark.parametrize("name, targets, alpha, rslora", ADAPTERS)
def test_the_seeded_init_is_peft_s(folders, name, targets, alpha, rslora):
    """The same seed gives PEFT's A exactly, B zero, on the same modules in the same order."""
    ref = reference(folders[name], targets, alpha, rslora, seed=7)
    e, source = engine_of(folders[name], adapter(targets, alpha, rslora), seed=7)
    params = dict(e.model.named_parameters())
    ts = lora_targets(source.model, adapter(targets, alpha, rslora))
    theirs = peft_pairs(ref)
    assert [t.hf for t in ts] == [n.removeprefix("base_model.model.") for n, _, _ in theirs]
    for t, (_, a, _) in zip(ts, theirs):
        A, B = (params[n] for n in param_names(t))
        assert torch.equal(A, a) and not B.any() and A.abs().sum() > 0
    # another seed, other draws
    other, _ = engine_of(folders[name], adapter(targets, alpha, rslora), seed=8)
    assert not torch.equal(dict(other.model.named_parameters())[param_names(ts[0])[0]],
                           theirs[0][1])  # fmt: skip


@pytest.mark.parametrize("name, targets, alpha, rslora", ADAPTERS)
def test_the_forward_is_peft_s(folders, name, targets, alpha, rslora):
    """With B random (the same in both), fitgpt's logits are PEFT's within 1e-6."""
    ref = reference(folders[name], targets, alpha, rslora, seed=7)
    e, source = engine_of(folders[name], adapter(targets, alpha, rslora), seed=7)
    params = dict(e.model.named_parameters())
    g = torch.Generator().manual_seed(3)
    ts = lora_targets(source.model, adapter(targets, alpha, rslora))
    with torch.no_grad():
        for t, (_, _, b) in zip(ts, peft_pairs(ref)):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            params[param_names(t)[1]].copy_(b)
        e.model.eval()
        ours, theirs = e.model(X)[..., :V], ref(X).logits
        base = ref.get_base_model()
        with ref.disable_adapter():
            plain = base(X).logits
    assert (theirs - plain).abs().max() > 1e-3  # the adapters change the output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


# ---- the adapted linear's own ops ----------------------------------------------------------
# an nn.Linear [96, 48] with its rows adapted as one adapter, or as a fused linear's parts (k on
# rows 0-40, v on 40-80, 80-96 unadapted); 74 tokens (2 x 37: no small shape is a multiple)
IN, ROWS, RANK, TOKENS = 48, 96, 4, 74
LAYOUTS = {"one": [(0, ROWS)], "fused": [(0, 40), (40, 80)]}


def adapted_linear(layout: str, dropout: float = 0.0) -> torch.nn.Module:
    from fitgpt.adapters.lora import attach_lora, init_lora
    from fitgpt.adapters.targets import Target

    holder = torch.nn.Module()
    holder.lin = torch.nn.Linear(IN, ROWS)
    ts = [Target(f"m.p{i}", "lin", lo, hi, IN, False) for i, (lo, hi) in enumerate(LAYOUTS[layout])]
    attach_lora(holder, ts, AdapterConfig(lora_rank=RANK, lora_alpha=8.0, lora_dropout=dropout))
    init_lora(holder, ts, seed=0)
    with torch.no_grad():
        for pair in holder.lin.lora.values():
            pair.B.copy_(torch.randn(pair.B.shape, generator=torch.Generator().manual_seed(1)))
    return holder.lin.train()


def term_by_term(lin: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The base's output plus each adapter's s·B·A·drop(x) on its rows, term by term."""
    y = F.linear(x, lin.weight, lin.bias)
    parts = []
    for lo, hi, name in lin.spans:
        if name is None:
            parts.append(y[..., lo:hi])
            continue
        p = lin.lora[name]
        xd = F.dropout(x, p.dropout, lin.training)
        parts.append(y[..., lo:hi] + F.linear(F.linear(xd, p.A), p.B) * p.scale)
    return torch.cat(parts, dim=-1)


class Materialised(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an aten op writes anew (not a view of one of its inputs): (op, numel)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        ins = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.made.append((func.overloadpacket.__name__, t.numel()))
        return out

    def per_token(self) -> list[tuple[str, int]]:
        """The tensors with a token dimension, as (op, columns)."""
        return [(op, n // TOKENS) for op, n in self.made if n and n % TOKENS == 0]


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_adapted_linear_passes_over_its_output_rows_once(layout, bf16):
    """Forward and backward of an adapted linear (one adapter, or a fused linear's k and v with
    rows no adapter has) write two tensors of its output rows, both in the forward: the base's y
    and the one addmm's y + s·xa·B_bdᵀ; no zeros, no concatenation, no scale multiply over rows,
    nothing of them in the backward; x is not copied at dropout 0. Under a bf16 autocast (the
    ddp engine's), the base in bf16, the same: only the fp32 A and B are cast. In fp32 the
    result and every gradient are the term-by-term sum's."""
    k, dtype = len(LAYOUTS[layout]), torch.bfloat16 if bf16 else torch.float32
    lin = adapted_linear(layout)
    lin.weight.data, lin.bias.data = lin.weight.data.to(dtype), lin.bias.data.to(dtype)
    x = torch.randn(2, TOKENS // 2, IN, dtype=dtype, requires_grad=True)
    g = torch.randn(2, TOKENS // 2, ROWS, dtype=dtype)
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16), Materialised() as fwd:
        out = lin(x)
    with Materialised() as bwd:
        out.backward(g)
    base = fwd.per_token()[0][0]  # addmm or mm, as F.linear takes its bias
    assert fwd.per_token() == [(base, ROWS), ("mm", k * RANK), ("addmm", ROWS)]
    wide = [(op, c) for op, c in bwd.per_token() if c not in (IN, k * RANK)]
    assert wide == [] and ("add", IN) in bwd.per_token()  # A's and the base's dx summed
    if bf16:
        return
    params = [x, *lin.lora.parameters()]
    got = [out.detach()] + [p.grad for p in params]
    for p in params:
        p.grad = None
    want = term_by_term(lin, x)
    want.backward(g)
    for a, b in zip(got, [want.detach()] + [p.grad for p in params]):  # sums of ~100 terms
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * b.abs().max().item())


def test_dropout_draws_each_adapter_s_own_mask_and_the_base_sees_x_whole():
    """At dropout 0.5 a fused linear's k and v adapters each see x through their own mask (as
    PEFT's two modules do), drawn in row order; the base sees x undropped; eval drops nothing."""
    lin = adapted_linear("fused", dropout=0.5)
    x = torch.randn(2, TOKENS // 2, IN)
    torch.manual_seed(5)
    ours = lin(x)
    torch.manual_seed(5)
    torch.testing.assert_close(ours, term_by_term(lin, x), rtol=0, atol=1e-5)
    torch.manual_seed(5)
    mask = F.dropout(torch.ones_like(x), 0.5, True)  # one mask shared by both: not PEFT's
    shared = term_by_term(lin.eval(), x * mask)  # (eval: the reference adds no second mask)
    shared += F.linear(x, lin.weight, lin.bias) - F.linear(x * mask, lin.weight, lin.bias)
    assert (ours - shared).abs().max() > 1e-3
    torch.testing.assert_close(lin(x), term_by_term(lin, x), rtol=0, atol=1e-5)  # eval


# ---- training ------------------------------------------------------------------------------
STEPS, SEED = 20, 3


def batches(n: int) -> list:
    """The first `n` micro-batches `fitgpt train --data synthetic` reads (one rank)."""
    src, _, _ = open_data(DataConfig(data="synthetic"), SEQ, V, SEED)
    loader = BatchLoader(src, MB, 0, 1)
    return [loader.next()[:2] for _ in range(n)]


def peft_losses(model, data) -> list[float]:
    """A plain loop over the PEFT model: AdamW as fitgpt's (betas 0.9/0.95, eps 1e-8, decay
    0.1 on the matrices, which every adapter is), the global norm clipped at 1, constant rate."""
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model.train()
    out = []
    for x, y in data:
        logits = model(x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def train_argv(folder, out, *flags, steps=STEPS) -> list[str]:
    return [
        "train", "--init-from", str(folder), "--lora-rank", "4", "--precision", "fp32",
        "--device", "cpu", "--data", "synthetic", "--seq-len", str(SEQ), "--micro-batch",
        str(MB), "--steps", str(steps), "--lr", str(LR), "--min-lr", str(LR), "--warmup", "0",
        "--eval-every", "0", "--log-every", "1", "--seed", str(SEED), "--out", str(out), *flags,
    ]  # fmt: skip


def cli(argv) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    assert e.value.code in (0, None), argv


def losses(out) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def trained(folders, tmp_path_factory):
    """name -> a 20-step `fitgpt train --lora-rank 4` run folder (saved at step 10 and 20)."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("llama", "gpt2"):
        cli(train_argv(folders[name], root / name, "--save-every", "10"))
    return {name: root / name for name in ("llama", "gpt2")}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_twenty_steps_equal_transformers_and_peft(folders, trained, name):
    got = losses(trained[name])
    data = batches(STEPS)
    want = peft_losses(reference(folders[name], "all-linear", None, False, SEED), data)
    assert len(got) == STEPS and close(got, want), (got, want)
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[name]).eval()
    with torch.no_grad():  # the frozen base alone on the same batches: the adapters learnt
        frozen = [
            F.cross_entropy(base(x).logits.flatten(0, 1), y.flatten()).item() for x, y in data
        ]
    assert got[0] == pytest.approx(frozen[0], abs=1e-5) and sum(got[10:]) < sum(frozen[10:]) - 0.01


def test_only_the_adapters_train_and_the_base_stays_bit_identical(folders, tmp_path):
    """The trainer's engine after 6 steps: the base's weights are the source's, bit for bit,
    with no gradient and no optimizer state; the adapters moved; the checkpoint holds them."""
    from helpers import assembled

    from fitgpt.train.loop import Trainer

    source = find_source(str(folders["llama"]))
    cfg = run_config(tmp_path / "run", steps=6, lr=LR)
    cfg = dataclasses.replace(cfg, model=source.model, adapter=adapter())
    run = assembled(cfg, CPU, init_from=source)
    (tmp_path / "run").mkdir()  # what train() makes, and locks, before its Trainer
    trainer = Trainer(run)
    trainer.init_from(source)
    e = trainer.engine
    base = {n: p.detach().clone() for n, p in e.model.named_parameters() if not p.requires_grad}
    start = {n: p.detach().clone() for n, p in e.model.named_parameters() if p.requires_grad}
    trainer.fit()
    ref = hf_model("llama").state_dict()
    assert torch.equal(
        base["blocks.0.attn.q.weight"], ref["model.layers.0.self_attn.q_proj.weight"]
    )
    for n, p in e.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]) and p.grad is None, n
    assert set(start) == {s.name for c in e.layout for s in c.slots} and len(start) == 28
    assert all(not torch.equal(p, start[n]) for n, p in e.model.named_parameters() if n in start)
    assert {id(p) for p in e.opt.state} == {id(p) for p in e.params} and len(e.params) == 28
    mem = e.memory_report()["cpu"]
    assert mem["frozen_weights"] == 4 * sum(t.numel() for t in base.values())
    assert mem["optimizer"] == 8 * sum(t.numel() for t in start.values())
    ckpt = ckpt_io.resolve(tmp_path / "run")
    meta = ckpt_io.load_meta(ckpt)
    assert meta["init_from"] == str(folders["llama"].resolve())
    saved = sum(c["numel"] for c in meta["layout"])
    assert saved == sum(t.numel() for t in start.values())  # the adapters alone
    e.close()


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(folders, tmp_path, capsys):
    """6 steps saved at 3 and 6; the step-6 checkpoint removed and steps 4-6 run again from
    step 3: the same losses and the same adapters and moments, bit for bit. A flag given again
    that agrees with the checkpoint is no change, and is not named as one."""
    out = tmp_path / "run"
    cli(train_argv(folders["llama"], out, "--save-every", "3", "--checkpointing", "full", steps=6))
    want = losses(out)
    final = out / "step_00000006"
    keep = tmp_path / "uninterrupted"
    shutil.copytree(final, keep)
    shutil.rmtree(final)
    capsys.readouterr()
    # 2R: the run's own alpha. --checkpointing given to the first command alone: the resumed
    # run's planner may choose it (it chooses full again here, the same run), and no flag that
    # does not exist is named as a change
    cli(["train", "--out", out, "--resume", "--lora-alpha", "8"])
    assert losses(out) == want
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resumed"))
    assert line.endswith("at step 3"), line
    from fitgpt.engine.state_io import StateReader

    a, b = StateReader(keep), StateReader(final)
    for c in ckpt_io.load_meta(final)["layout"]:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.read(c["index"], kind, 0, c["numel"]),
                               b.read(c["index"], kind, 0, c["numel"]))  # fmt: skip


@pytest.mark.parametrize("name, targets", [("llama", "k_proj,down_proj"), ("gpt2", "all-linear")])
def test_the_step_log_counts_a_lora_step_s_flops_from_the_model_s_own_tensors(
    folders, tmp_path, name, targets
):
    """The FLOPs per token behind the step log's TFLOP/s and MFU (the trainer's StepMetrics),
    against the trainer's own model: with adapters, 4 per frozen parameter that multiplies (its
    forward and its input's gradient, no weight gradient), 6 per adapter element, attention as
    it was; the whole model trained, 6 per parameter that multiplies and attention, as before.
    A parameter that multiplies: every one but the input embedding when the head has its own."""
    from helpers import assembled

    from fitgpt.train.loop import Trainer

    source = find_source(str(folders[name]))
    m = source.model
    attn = 12.0 * m.n_layer * m.n_head * m.head_dim * m.seq_len
    counted = {}
    for lora in (adapter(targets), AdapterConfig()):
        out = tmp_path / f"run{lora.active}"
        cfg = dataclasses.replace(run_config(out, steps=1), model=m, adapter=lora)
        out.mkdir()  # what train() makes, and locks, before its Trainer
        trainer = Trainer(assembled(cfg, CPU, init_from=source))
        model = trainer.engine.model
        lookup = model.wte.weight if model.head_weight() is not model.wte.weight else None
        multiplying = [p for p in model.parameters() if p is not lookup]
        frozen = sum(p.numel() for p in multiplying if not p.requires_grad)
        trained = sum(p.numel() for p in multiplying if p.requires_grad)
        if lora.active:
            assert frozen == m.num_params() - (lookup.numel() if lookup is not None else 0)
            assert trained == sum(p.numel() for p in trainer.engine.params) > 0
            assert trainer.metrics.flops_per_token == 4.0 * frozen + 6.0 * trained + attn
        else:
            assert frozen == 0 and trainer.metrics.flops_per_token == 6.0 * trained + attn
        counted[lora.active] = trainer.metrics.flops_per_token
        trainer.engine.close()
    assert counted[True] < counted[False]  # a LoRA step is cheaper than a full one


# ---- two ranks -----------------------------------------------------------------------------
def lora_run(folder: str, ctx, steps: int) -> dict:
    """`steps` steps of 2 micro-batches of a global batch of 8 rows on the LoRA engine; rank d
    of `ctx`'s W takes rows [d·8/W, (d+1)·8/W). Losses, norms and the final adapters."""
    e, _ = engine_of(folder, adapter(), seed=SEED, ctx=ctx)
    w, d = ctx.world, ctx.rank
    out = {"loss": [], "norm": []}
    for step in range(steps):
        x = torch.randint(0, V, (16, SEQ + 1), generator=torch.Generator().manual_seed(step))
        micro = [x[m * 8 : (m + 1) * 8][d * 8 // w : (d + 1) * 8 // w] for m in range(2)]
        st = e.train_step([(r[:, :-1], r[:, 1:]) for r in micro], LR)
        out["loss"].append(st.loss)
        out["norm"].append(st.grad_norm)
    out["adapters"] = {s.name: dict(e.model.named_parameters())[s.name].tolist()
                       for c in e.layout for s in c.slots}  # fmt: skip
    e.close()
    return out


def _two_rank_worker(rank, world, folder, tmp) -> None:
    from pathlib import Path

    from fitgpt.dist import init_distributed

    res = lora_run(folder, init_distributed("cpu"), 4)
    (Path(tmp) / f"r{rank}.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(folders, tmp_path, gloo):
    one = lora_run(str(folders["llama"]), CPU, 4)
    gloo(2, _two_rank_worker, str(folders["llama"]), str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2))
    assert close(r0["loss"], one["loss"]) and close(r0["norm"], one["norm"])
    assert r0["adapters"] == r1["adapters"]  # DDP keeps the ranks' adapters equal
    for n, v in one["adapters"].items():
        assert torch.allclose(torch.tensor(r0["adapters"][n]), torch.tensor(v), atol=1e-6), n


@pytest.mark.slow
def test_fitgpt_train_gpus_2_equals_one_process(folders, trained, tmp_path):
    """`fitgpt train --gpus 2` (torchrun, gloo; the settled settings handed to the ranks, each
    reading the base) at micro-batch 2 per rank: the one-process run's 20 losses at 4."""
    argv = train_argv(folders["llama"], tmp_path / "run", "--gpus", "2", "--micro-batch", "2")
    r = run_process(*argv, timeout=280, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert close(losses(tmp_path / "run"), losses(trained["llama"]))


# one global batch of 8 rows a step however it is cut: 2 ranks of one micro-batch of 4, or one
# process of 2 micro-batches of 4 (BatchLoader's micro-batch k of rank d of W is rows
# [(k·W + d)·4, +4): step s reads rows [8s, 8s + 8) either way)
ONE_PROCESS, TWO_RANKS = ("--grad-accum", "2"), ("--grad-accum", "1")


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_a_resume_on_another_world_size_goes_on_as_one_uninterrupted_run(
    folders, tmp_path, gloo, capsys, streamed
):
    """4 steps of one process, uninterrupted; 2 steps over 2 gloo ranks resumed by one process
    for steps 3-4, and 2 steps of one process resumed by 2 gloo ranks: the same losses (1e-6),
    the same global batch throughout (--grad-accum). Streamed: the last block of the base in
    host RAM (--base-host-blocks 1) in the saved runs: asked again by the resume on 2 ranks;
    not by the one on one process, which places the base afresh (every block on the device
    here) and says so."""
    folder = folders["llama"]
    base = ("--base-host-blocks", "1") if streamed else ()
    cli(train_argv(folder, tmp_path / "one", *ONE_PROCESS, *base, "--no-save", steps=4))
    want = losses(tmp_path / "one")
    two_then_one, one_then_two = tmp_path / "two_then_one", tmp_path / "one_then_two"
    save = ("--save-every", "2")
    gloo(2, fitgpt_rank, train_argv(folder, two_then_one, *TWO_RANKS, *base, *save, steps=2))
    cli(["train", "--out", two_then_one, "--resume", "--steps", "4", *ONE_PROCESS])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resumed"))
    assert "world size 2 → 1" in line and "--grad-accum 1 → 2" in line, line
    assert ("--base-host-blocks 1 → 0" in line) == streamed, line  # placed again, said
    cli(train_argv(folder, one_then_two, *ONE_PROCESS, *base, *save, steps=2))
    resume = ["train", "--out", one_then_two, "--resume", "--steps", "4", *TWO_RANKS, *base]
    gloo(2, fitgpt_rank, resume)
    for out in (two_then_one, one_then_two):
        got = losses(out)
        assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, want)) < 1e-6, (out, got)


# ---- PEFT's folder out and in, the merge ---------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_exported_adapter_loads_in_peft_and_gives_fitgpt_s_logits(
    folders, trained, tmp_path, name
):
    cli(["export", "--ckpt", trained[name], "--format", "peft", "--out", tmp_path / "peft"])
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["fan_in_fan_out"] == (name == "gpt2")
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[name]).eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    # fitgpt's: the engine with the run's base and its checkpoint's adapters
    ckpt = ckpt_io.resolve(trained[name])
    meta = ckpt_io.load_meta(ckpt)
    e, _ = engine_of(folders[name], adapter(), seed=0)
    ckpt_io.load_state(ckpt, meta, e, CPU)
    e.model.eval()
    with torch.no_grad():
        ours, want = e.model(X)[..., :V], theirs(X).logits
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)
    # generate's model (the base with the adapters merged in) gives the same logits
    merged, _ = load_model(trained[name], torch.device("cpu"), merged_base(trained[name]))
    with torch.no_grad():
        torch.testing.assert_close(merged(X)[..., :V], want, rtol=0, atol=1e-5)
    e.close()


def test_an_adapter_of_an_imported_base_names_the_folder_peft_loads(folders, tmp_path):
    """A LoRA run from `fitgpt import hf`'s checkpoint exports its adapter naming the Hugging
    Face folder the import read (the same weights), which AutoPeftModelForCausalLM loads to
    fitgpt's logits; from a checkpoint trained since, its own path (no folder holds it)."""
    imported = tmp_path / "imported"
    cli(["import", "hf", folders["llama"], "--out", imported])
    cli(train_argv(imported, tmp_path / "lora", steps=2))
    cli(["export", "--ckpt", tmp_path / "lora", "--format", "peft", "--out", tmp_path / "peft"])
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folders["llama"].resolve())
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "peft").eval()
    merged, _ = load_model(tmp_path / "lora", torch.device("cpu"), merged_base(tmp_path / "lora"))
    with torch.no_grad():
        torch.testing.assert_close(merged(X)[..., :V], theirs(X).logits, rtol=0, atol=1e-5)
    tuned = tmp_path / "tuned"  # the whole model trained from the import, then LoRA on it
    whole = train_argv(imported, tuned, steps=1)
    del whole[whole.index("--lora-rank") : whole.index("--lora-rank") + 2]
    cli(whole)
    cli(train_argv(tuned, tmp_path / "lora2", steps=1))
    cli(["export", "--ckpt", tmp_path / "lora2", "--format", "peft", "--out", tmp_path / "p2"])
    config = json.loads((tmp_path / "p2" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt_io.resolve(tuned).resolve())


@pytest.mark.parametrize("name", ["llama", "gpt2", "llama-bf16"])
def test_merge_equals_peft_merge_and_unload(folders, trained, tmp_path, name):
    """`export --format hf --merge` against PEFT's merge_and_unload() of the exported adapter:
    every tensor bit for bit, in the base's dtype (bf16 for a bf16 base)."""
    run = trained[name.removesuffix("-bf16")]
    if name == "llama-bf16":  # a short run on the bf16 base
        run = tmp_path / "run"
        cli(train_argv(folders[name], run, steps=3))
    cli(["export", "--ckpt", run, "--format", "peft", "--out", tmp_path / "peft"])
    cli(["export", "--ckpt", run, "--format", "hf", "--merge", "--out", tmp_path / "merged"])
    base = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype="auto")
    want = peft.PeftModel.from_pretrained(base, tmp_path / "peft").merge_and_unload().state_dict()
    got = tensors(tmp_path / "merged")
    dtype = torch.bfloat16 if name == "llama-bf16" else torch.float32
    assert {t.dtype for t in got.values()} == {dtype}
    src = tensors(folders[name])
    assert all(torch.equal(v, want[k]) for k, v in got.items()) and got.keys() == src.keys()
    moved = {k.removesuffix(".weight") for k, v in got.items() if not torch.equal(v, src[k])}
    cfg = find_source(str(folders[name])).model
    assert moved == {t.hf for t in lora_targets(cfg, adapter())}  # the adapted weights alone
    out = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert out["dtype"] == {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]


def test_a_peft_folder_imports_and_training_goes_on(folders, trained, tmp_path):
    """`--init-from BASE --lora-from PEFT_DIR`: the adapter's config is the run's, its tensors
    the engine's, and the first step's loss is the PEFT model's on the same batch."""
    cli(["export", "--ckpt", trained["llama"], "--format", "peft", "--out", tmp_path / "peft"])
    out = tmp_path / "go-on"
    argv = train_argv(folders["llama"], out, steps=3)
    argv.remove("--lora-rank"), argv.remove("4")
    cli([*argv, "--lora-from", tmp_path / "peft"])
    meta = ckpt_io.load_meta(ckpt_io.resolve(out))
    a = AdapterConfig(**meta["config"]["adapter"])
    assert (a.lora_rank, a.alpha, a.lora_targets) == (4, 8.0, "q_proj,k_proj,v_proj,o_proj,"
                                                      "gate_proj,up_proj,down_proj")  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"]).eval()
    ref = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    x, y = batches(1)[0]
    with torch.no_grad():
        want = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(losses(out)[0] - want) < 1e-5
    assert losses(out)[0] < losses(trained["llama"])[0] - 0.05  # not a fresh adapter's
    # exported again, its adapter_config.json is the one it came from, field for field
    cli(["export", "--ckpt", out, "--format", "peft", "--out", tmp_path / "again"])
    first, again = (
        json.loads((p / "adapter_config.json").read_text())
        for p in (tmp_path / "peft", tmp_path / "again")
    )
    assert again == first and again["base_model_name_or_path"] == str(folders["llama"].resolve())


# ---- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, needle",
    [
        (dict(lora_rank=0), "--lora-rank 0"),
        (dict(lora_rank=4, lora_dropout=1.0), "--lora-dropout 1.0"),
        (dict(lora_rank=4, lora_alpha=-1.0), "--lora-alpha -1.0"),
        (dict(lora_rank=4, lora_targets="all-linear,q_proj"), "all-linear stands alone"),
        (dict(lora_rank=4, lora_targets="q_proj,"), "'' is no module name"),
        (dict(lora_alpha=16.0), "--lora-alpha"),
    ],
)
def test_bad_adapter_fields_are_refused_in_one_line(fields, needle):
    with pytest.raises(UserError) as e:
        AdapterConfig(**fields)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_target_names_the_family_lacks_are_refused():
    llama = model_config_from_hf(CONFIGS["llama"]().to_dict(), "llama")
    gpt2 = model_config_from_hf(CONFIGS["gpt2"]().to_dict(), "gpt2")
    for cfg, name, known in ((llama, "c_attn", "q_proj"), (gpt2, "q_proj", "c_attn")):
        with pytest.raises(UserError) as e:
            lora_targets(cfg, adapter(name))
        assert name in str(e.value) and known in str(e.value) and "\n" not in str(e.value)
    # a full module name matches that module alone, as in PEFT
    one = lora_targets(llama, adapter("model.layers.1.self_attn.q_proj"))
    assert [t.module for t in one] == ["blocks.1.attn.q"]


def test_a_mixture_of_experts_adapts_its_attention_and_dense_mlps_not_its_experts():
    cfg = model_config_from_hf(
        dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, vocab_size=V,
             intermediate_size=96, moe_intermediate_size=32, num_experts=4,
             num_experts_per_tok=2, decoder_sparse_step=2), "moe",
    )  # fmt: skip
    assert cfg.moe_layers == (1,)
    found = [t.hf for t in lora_targets(cfg, adapter())]
    assert "model.layers.0.mlp.gate_proj" in found and "model.layers.1.self_attn.o_proj" in found
    assert not any(".layers.1.mlp." in h for h in found)
    with pytest.raises(UserError, match="experts or router"):
        lora_targets(cfg, adapter("gate"))


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--zero-stage", "1"], ["--zero-stage 1", "ddp"]),
        (["--engine", "zero"], ["--engine zero"]),
        (["--offload-optimizer", "cpu"], ["--offload-optimizer cpu"]),
        (["--offload-fraction", "0.5"], ["--offload-fraction 0.5"]),
        (["--tensor-parallel", "2"], ["--tensor-parallel 2"]),
        (["--compile", "model"], ["--compile model"]),
        (["--lora-targets", "c_fc"], ["--lora-targets c_fc", "q_proj"]),
    ],
)
def test_what_a_lora_run_cannot_have_is_refused_in_one_line(
    folders, tmp_path, capsys, flags, names
):
    argv = train_argv(folders["llama"], tmp_path / "run", *flags, steps=2)
    assert_refused(*run_in_process(capsys, *argv), *names)
    assert not (tmp_path / "run").exists()


def test_bad_lora_commands_are_refused_in_one_line_by_the_cli(folders, tmp_path):
    """Through `python -m fitgpt`: exit 2, one stderr line, no traceback."""
    r = run_process("train", "--lora-rank", "4", "--data", "synthetic", "--device", "cpu",
                    "--steps", "2", "--out", tmp_path / "a")  # fmt: skip
    assert_refused(r.returncode, r.stderr, "--init-from", "--preset")
    r = run_process("train", "--lora-alpha", "8", "--data", "synthetic", "--device", "cpu",
                    "--out", tmp_path / "b")  # fmt: skip
    assert_refused(r.returncode, r.stderr, "--lora-alpha", "--lora-rank")


def test_bad_peft_folders_and_exports_are_refused_in_one_line(folders, trained, tmp_path, capsys):
    run = trained["llama"]
    cli(["export", "--ckpt", run, "--format", "peft", "--out", tmp_path / "peft"])
    argv = train_argv(folders["llama"], tmp_path / "x", steps=2)
    argv.remove("--lora-rank"), argv.remove("4")
    # a folder that is no PEFT adapter, one with DoRA, one of another rank than typed
    (tmp_path / "empty").mkdir()
    assert_refused(*run_in_process(capsys, *argv, "--lora-from", tmp_path / "empty"),
                   "adapter_config.json")  # fmt: skip
    dora = tmp_path / "dora"
    shutil.copytree(tmp_path / "peft", dora)
    cfg = json.loads((dora / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    assert_refused(*run_in_process(capsys, *argv, "--lora-from", dora), "use_dora=True")
    assert_refused(*run_in_process(capsys, *argv, "--lora-from", tmp_path / "peft",
                                   "--lora-rank", "8"), "--lora-rank 8", "4")  # fmt: skip
    # exports: an adapter run without --merge, --merge of a whole-model run, an adapter run as
    # another run's --init-from, a resume asking another rank
    assert_refused(*run_in_process(capsys, "export", "--ckpt", run, "--format", "hf", "--out",
                                   tmp_path / "o"), "--merge")  # fmt: skip
    whole = tmp_path / "whole"
    cli(["train", "--data", "synthetic", "--device", "cpu", "--steps", "1", "--out", whole])
    assert_refused(*run_in_process(capsys, "export", "--ckpt", whole, "--format", "hf",
                                   "--merge", "--out", tmp_path / "o"), "--merge")  # fmt: skip
    assert_refused(*run_in_process(capsys, "export", "--ckpt", whole, "--format", "peft",
                                   "--out", tmp_path / "o"), "--format peft")  # fmt: skip
    assert_refused(*run_in_process(capsys, *train_argv(run, tmp_path / "y", steps=2)),
                   "LoRA adapters", "--lora-from")  # fmt: skip
    assert_refused(*run_in_process(capsys, "train", "--out", run, "--resume", "--steps", "30",
                                   "--lora-rank", "8"), "--lora-rank 8")  # fmt: skip
    assert_refused(*run_in_process(capsys, "train", "--out", whole, "--resume", "--steps", "3",
                                   "--lora-rank", "4"), "the whole model")  # fmt: skip
    assert not (tmp_path / "o").exists()
    # a resume whose base holds another model now
    base = tmp_path / "base"
    shutil.copytree(folders["llama"], base)
    cli(train_argv(base, tmp_path / "z", steps=1))
    shutil.rmtree(base)
    shutil.copytree(folders["qwen2"], base)
    assert_refused(*run_in_process(capsys, "train", "--out", tmp_path / "z", "--resume",
                                   "--steps", "2"), str(base), "another model")  # fmt: skip
