"""`fitgpt train --init-from`: a Hugging Face GPT-2 model trains under any engine, stage and
placement, and its first loss is the one transformers computes on the same batch."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from cli_refusal import run_main
from helpers import run_config, train

from fitgpt.data.config import DataConfig, open_data
from fitgpt.data.source import BatchLoader
from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.interop.init_source import find_source
from fitgpt.train.init_from import model_from_source

transformers = pytest.importorskip("transformers")


def hf_model(folder):
    """A random GPT2LMHeadModel (vocabulary 1000, 32 positions), every tensor random."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=1000,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.1)
    model.save_pretrained(folder)
    return model


def hf_first_loss(folder, world: int, micro: int) -> float:
    """transformers' mean loss on the run's first global batch (every rank's rows)."""
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    train_src, _, _ = open_data(DataConfig(data="synthetic"), 32, 1000, 0)
    rows = [BatchLoader(train_src, micro, r, world).next() for r in range(world)]
    x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1)).item()


def tuned_run(folder, out, **engine):
    source = find_source(str(folder))
    run = run_config(out, steps=2, micro_batch=2, data="synthetic", **engine)
    model = model_from_source(source, {}, run.data)
    return dataclasses.replace(run, model=model), source


def _zero3_two_ranks(rank: int, world: int, folder, out, want: float) -> None:
    ctx = DistContext(rank, world, rank, torch.device("cpu"), dist.group.WORLD)
    run, source = tuned_run(folder, out, engine="zero", zero_stage=3)
    got = train(run, ctx, init_from=source)["losses"]
    assert got[0] == pytest.approx(want, abs=1e-5), (got, want)
    assert len(got) == 2 and got[1] == got[1]  # the update ran and the next step is finite


@pytest.mark.slow
def test_an_hf_model_trains_with_zero3_on_two_ranks_from_its_own_loss(gloo, tmp_path):
    hf_model(tmp_path / "hf")
    want = hf_first_loss(tmp_path / "hf", world=2, micro=2)
    gloo(2, _zero3_two_ranks, tmp_path / "hf", tmp_path / "run", want)
    assert not (tmp_path / "run" / ".init-from").exists()  # the scratch import is gone


def test_an_hf_model_trains_with_its_optimizer_offloaded(tmp_path):
    hf_model(tmp_path / "hf")
    want = hf_first_loss(tmp_path / "hf", world=1, micro=2)
    run, source = tuned_run(
        tmp_path / "hf", tmp_path / "run", engine="zero", offload_optimizer="cpu"
    )
    cpu = DistContext(0, 1, 0, torch.device("cpu"))
    got = train(run, cpu, init_from=source)["losses"]
    assert got[0] == pytest.approx(want, abs=1e-5) and got[1] == got[1]


def test_the_architecture_is_the_sources(tmp_path):
    hf_model(tmp_path / "hf")
    source = find_source(str(tmp_path / "hf"))
    data = DataConfig(data="synthetic")
    assert model_from_source(source, {"dropout": 0.1}, data).dropout == 0.1  # may change
    with pytest.raises(UserError, match="n_layer=2"):
        model_from_source(source, {"n_layer": 3}, data)
    # the data's ids must lie below the model's rows: 256 bytes below 1000, GPT-2's 50257 not
    assert model_from_source(source, {}, DataConfig(data="stdlib")).vocab_size == 1000
    with pytest.raises(UserError, match="has 1000 embedding rows, the data's tokenizer gpt2"):
        model_from_source(source, {}, DataConfig(data="stdlib", tokenizer="gpt2"))


def test_init_from_on_the_command_line(tmp_path, capsys):
    hf_model(tmp_path / "hf")
    argv = ["train", "--init-from", str(tmp_path / "hf"), "--data", "synthetic", "--steps", "2"]
    argv += ["--micro-batch", "2", "--device", "cpu", "--eval-every", "0"]
    code, out, err = run_main(capsys, *argv, "--out", str(tmp_path / "run"))
    assert code == 0, err[-2000:]
    assert "initialised from" in out
    code, _, err = run_main(capsys, *argv, "--resume", "--out", str(tmp_path / "x"))
    assert code == 2 and "pass one of them" in err


def test_the_context_length_is_free_where_no_weight_holds_it(tmp_path):
    """A rotary model (a Llama) may be fine-tuned at another --seq-len: no weight depends on it;
    GPT-2's learned position table does, so its source's length stays."""
    from fitgpt.model import get_preset
    from fitgpt.train.init_from import InitSource

    data = DataConfig(data="synthetic")
    llama = InitSource(tmp_path, get_preset("tiny-llama"))
    assert model_from_source(llama, {"seq_len": 64}, data).seq_len == 64
    gpt2 = InitSource(tmp_path, get_preset("tiny"))
    with pytest.raises(UserError, match="seq_len=128"):
        model_from_source(gpt2, {"seq_len": 64}, data)
