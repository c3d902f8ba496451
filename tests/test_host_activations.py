"""`checkpoint_blocks(model, to_host=True)`: checkpointed blocks whose inputs wait in host memory.

On the CPU the hooks pass every tensor through (nothing to offload), so these tests pin down the
rest: the same losses and gradients as `full` and as no checkpointing, and that what a
checkpointed block keeps, the one tensor the host hooks would move, is its input alone. The CUDA
test at the end checks the offload itself and runs only where a GPU is.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks

from fitgpt.engine.transforms.activation import HostActivations, checkpoint_blocks
from fitgpt.model import GPT, ModelConfig

CFG = ModelConfig(n_layer=3, n_embd=32, n_head=4, seq_len=16, vocab_size=96, dropout=0.1)


def build(mode: str, cfg: ModelConfig = CFG, device: str = "cpu") -> GPT:
    model = GPT(cfg).to(device)
    model.reset_parameters(seed=0)
    if mode != "off":
        checkpoint_blocks(model, to_host=mode == "cpu")
    return model


def saved_by(fn) -> list[Tensor]:
    """Every non-empty tensor autograd saves while fn runs, where no inner hooks take over.

    torch < 2.12 also saves a 0-element dummy per checkpoint; it holds no memory, so skip it.
    """
    seen: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        if t.numel():
            seen.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def test_hooks_pass_cpu_tensors_through():
    host = HostActivations()
    t = torch.randn(2, 3, requires_grad=True)
    assert host.pack(t) is t  # the CUDA branch needs t.is_cuda: a CPU tensor stays itself
    assert host.unpack(host.pack(t)) is t


@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_losses_and_gradients_match_full_and_off(position):
    cfg = CFG.replace(position=position)
    models = {mode: build(mode, cfg) for mode in ("off", "full", "cpu")}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-2) for m in models}
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=gen)
        losses, grads = {}, {}
        for mode, model in models.items():
            torch.manual_seed(100 + step)  # the same dropout masks in every model
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses[mode] = loss.detach()
            grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
            opts[mode].step()
            opts[mode].zero_grad(set_to_none=True)
        for mode in ("full", "cpu"):
            torch.testing.assert_close(losses[mode], losses["off"], rtol=0, atol=1e-6)
            for name, g in grads["off"].items():
                torch.testing.assert_close(grads[mode][name], g, rtol=0, atol=1e-6, msg=name)


def test_a_checkpointed_block_keeps_only_its_input():
    x = torch.randn(2, CFG.seq_len, CFG.n_embd, requires_grad=True)
    plain = saved_by(lambda: build("off").blocks[0](x))
    kept = saved_by(lambda: build("full").blocks[0](x))
    assert len(plain) > 10  # LN, attention and MLP activations
    assert len(kept) == 1 and kept[0].data_ptr() == x.data_ptr()
    # With to_host the host hooks are the innermost ones around the checkpoint: they take that
    # one tensor (and pass it through, on the CPU), so nothing reaches the outer hooks.
    assert saved_by(lambda: build("cpu").blocks[0](x)) == []


def test_whole_model_moves_one_tensor_per_block_to_the_host_hooks():
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    counts = {
        m: len(saved_by(lambda m=m: build(m)(idx[:, :-1], idx[:, 1:])))
        for m in ("off", "full", "cpu")
    }
    assert counts["full"] - counts["cpu"] == CFG.n_layer  # each block's input, nothing else
    assert counts["off"] > counts["full"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the offload itself needs a GPU")
def test_cuda_offload_frees_block_inputs_and_keeps_gradients():
    cfg = ModelConfig(n_layer=8, n_embd=256, n_head=4, seq_len=512, vocab_size=512)
    b = 8
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), device="cuda")
    block_input = b * cfg.seq_len * cfg.n_embd * 4  # fp32
    held, grads = {}, {}
    for mode in ("full", "cpu"):
        model = build(mode, cfg.replace(dropout=0.0), "cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = model(idx[:, :-1], idx[:, 1:])
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator retire frees deferred by record_stream
        held[mode] = torch.cuda.memory_allocated() - base
        loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        del model, loss
    assert held["full"] - held["cpu"] >= (cfg.n_layer - 1) * block_input
    for name, g in grads["full"].items():
        torch.testing.assert_close(grads["cpu"][name], g, rtol=1e-4, atol=1e-5, msg=name)
