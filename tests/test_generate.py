"""Generation: the end-of-document stop, the sliding window, and the tokenizer checks."""

import shutil

import pytest
import torch
from cli_refusal import run_main
from helpers import run_config, train

from fitgpt.data.tokenizer import train_tokenizer
from fitgpt.dist import DistContext
from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate, tokenizer_for
from fitgpt.model import GPT, ModelConfig

CPU = DistContext(0, 1, 0, torch.device("cpu"))


def tiny(seq_len=16, vocab=64, seed=3):
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=seq_len, vocab_size=vocab)
    model = GPT(cfg).eval()
    model.reset_parameters(seed)
    return model


def prompt(n, batch=1, vocab=64, seed=0):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def by_hand(model, seq, n):
    """Greedy decoding written out: each token is the argmax given the last seq_len tokens."""
    for _ in range(n):
        nxt = model(seq[:, -model.cfg.seq_len :])[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def test_generation_stops_at_eos_and_ignore_eos_keeps_going():
    model, x = tiny(), prompt(5)
    sample = SampleConfig(max_new_tokens=30, temperature=1.0, seed=7)
    full = generate(model, x, sample)[0, 5:].tolist()
    # the end-of-document token: the first new token not seen before, as late as possible
    k = max(i for i in range(8) if full[i] not in full[:i])
    assert k >= 2, full  # the stop must come after a few tokens to show anything
    stopped = generate(model, x, sample, stop_ids=(full[k],))
    assert stopped[0, 5:].tolist() == full[: k + 1]  # the stop token itself is kept, last
    ignoring = SampleConfig(max_new_tokens=30, temperature=1.0, seed=7, ignore_eos=True)
    assert generate(model, x, ignoring, stop_ids=(full[k],))[0, 5:].tolist() == full


def test_rows_that_end_first_are_padded_with_eos():
    model, x = tiny(), prompt(4, batch=2)
    sample = SampleConfig(max_new_tokens=12, temperature=1.0, seed=1)
    free = generate(model, x, sample)
    eos = int(free[0, 4 + 1])  # row 0's second new token
    out = generate(model, x, sample, stop_ids=(eos,))
    ends = []
    for row in range(2):
        new = free[row, 4:].tolist()
        ends.append(new.index(eos) + 1 if eos in new else len(new))
        got = out[row, 4:].tolist()
        assert got[: ends[-1]] == new[: ends[-1]] and set(got[ends[-1] :]) <= {eos}
    assert ends[0] == 2 and out.shape[1] == 4 + max(ends)  # stops when the last row ends


@pytest.mark.parametrize("n_prompt", [5, 40])
@pytest.mark.parametrize("use_cache", [True, False])
def test_past_the_context_the_window_slides_and_no_token_is_lost(n_prompt, use_cache):
    model, x = tiny(seq_len=16), prompt(n_prompt)
    greedy = SampleConfig(max_new_tokens=30, temperature=0.0)
    out = generate(model, x, greedy, use_cache=use_cache)
    assert out.shape == (1, n_prompt + 30)  # the whole prompt and exactly 30 new tokens
    assert torch.equal(out[:, :n_prompt], x)
    assert torch.equal(out, by_hand(model, x, 30))


def test_ids_beyond_the_tokenizer_are_never_sampled():
    model, x = tiny(vocab=64), prompt(3)
    hot = SampleConfig(max_new_tokens=200, temperature=20.0, seed=0)  # nearly uniform
    assert generate(model, x, hot)[0, 3:].max() >= 50  # without the limit they are
    assert generate(model, x, hot, vocab_size=50)[0, 3:].max() < 50


# ---- the tokenizer a checkpoint is read with ----------------------------------------------------
def bpe(tmp_path, name, text):
    (tmp_path / f"{name}.txt").write_text(text * 40)
    tok = train_tokenizer(
        [str(tmp_path / f"{name}.txt")], 280, str(tmp_path / name), 1, "text", False
    )
    return str(tmp_path / name), tok


def test_tokenizer_override_must_fit_the_model(tmp_path):
    cfg = ModelConfig(n_layer=1, n_embd=8, n_head=1, seq_len=8, vocab_size=256)
    with pytest.raises(UserError, match="trained without a tokenizer"):
        tokenizer_for({"tokenizer": None}, None, cfg)
    assert tokenizer_for({"tokenizer": None}, "bytes", cfg).vocab_size == 256
    with pytest.raises(UserError, match="50257 tokens, but the model knows 256"):
        tokenizer_for({"tokenizer": "bytes"}, "gpt2", cfg)

    a, tok_a = bpe(tmp_path, "a", "the quick brown fox jumps over the lazy dog; " * 3)
    b, tok_b = bpe(tmp_path, "b", "lorem ipsum dolor sit amet, consectetur adipiscing; " * 3)
    assert tok_a.vocab_size == tok_b.vocab_size == 280
    cfg = cfg.replace(vocab_size=280)
    with pytest.raises(UserError, match="another vocabulary than the checkpoint's"):
        tokenizer_for({"tokenizer": a}, b, cfg)
    shutil.copytree(a, tmp_path / "a_copy")
    assert tokenizer_for({"tokenizer": a}, str(tmp_path / "a_copy"), cfg).vocab_size == 280
    shutil.rmtree(a)  # the recorded files moved: the override is how the user points at them
    assert tokenizer_for({"tokenizer": a}, str(tmp_path / "a_copy"), cfg).vocab_size == 280


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    train(run_config(out, steps=2, data="stdlib"), CPU)  # UTF-8 bytes, a context of 32
    return out


def test_cli_long_prompt_note_and_refused_tokenizer(text_run, capsys):
    cmd = ["generate", "--ckpt", str(text_run)]
    long = "def f(x):\n    return x * 2\n" * 4  # 104 bytes, past the context of 32
    code, out, err = run_main(
        capsys, *cmd, "--prompt", long, "--max-new-tokens", "40", "--temperature", "0"
    )
    assert code == 0, err
    assert err.count("exceed the model's context of 32 tokens") == 1
    assert out.startswith(long)  # the whole prompt is printed, then the continuation
    code, _, err = run_main(capsys, *cmd, "--tokenizer", "gpt2")
    assert code == 2 and "50257 tokens, but the model knows 256" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_alibi_checkpoint_loads_with_its_slopes(tmp_path):
    """load_model builds on the meta device: ALiBi's slopes, a buffer no checkpoint holds, are
    made again on the device (to_empty left them undefined), so the loaded model computes what
    the trained one did."""
    from fitgpt.infer.generate import load_model

    cfg = run_config(
        tmp_path / "run", steps=2, save_every=2, position="alibi", tie_embeddings=False
    )
    train(cfg, CPU)
    model, _ = load_model(tmp_path / "run", torch.device("cpu"))
    fresh = GPT(model.cfg)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(model.alibi_slopes_N, fresh.alibi_slopes_N)
    idx = prompt(8, batch=2, vocab=cfg.model.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), fresh.eval()(idx), rtol=0, atol=0)


def test_generation_stops_at_any_stop_id_as_transformers_does(tmp_path, capsys):
    """A Llama with Llama 3's tokenizer and generation_config.json's eos_token_id list
    [<|eot_id|>, <|end_of_text|>], its head rigged so that greedy decoding emits <|eot_id|> a
    few tokens in: fitgpt stops there as transformers' generate does with the same list, and
    `fitgpt generate` prints the text without the stop token."""
    import json

    transformers = pytest.importorskip("transformers")
    from tokenizer_folders import llama3

    from fitgpt.cli import main
    from fitgpt.data.tokenizer import load_tokenizer
    from fitgpt.infer.generate import load_model
    from fitgpt.interop.hf_import import import_hf

    folder = llama3(tmp_path / "hf")
    tok = load_tokenizer(str(folder))
    eot, end = tok._id("<|eot_id|>"), tok._id("<|end_of_text|>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    ref = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.normal_(1.0 if "norm" in n else 0.0, 0.3 if "lm_head" in n else 0.08)
    text = "The quick brown fox"
    x = torch.tensor([tok.encode(text)])
    greedy = dict(do_sample=False, max_new_tokens=16, pad_token_id=end)
    free = ref.generate(x, eos_token_id=None, min_new_tokens=16, **greedy)[0, x.shape[1] :]
    free = free.tolist()
    k = next(i for i in range(2, 16) if free[i] not in [*free[:i], eot, end])
    with torch.no_grad():  # <|eot_id|> takes the row of the token greedy first picks at step k
        w = ref.lm_head.weight
        w[[eot, free[k]]] = w[[free[k], eot]]
    ref.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, end]}))
    want = ref.generate(x, eos_token_id=[eot, end], **greedy)[0].tolist()
    assert want[x.shape[1] :] == [*free[:k], eot]  # transformers stops at the stop id

    run = import_hf(folder, tmp_path / "run").ckpt.parent
    model, meta = load_model(run, torch.device("cpu"))
    stops = tokenizer_for(meta, None, model.cfg).stop_ids
    assert {eot, end} <= set(stops)
    ours = generate(model, x, SampleConfig(max_new_tokens=16, temperature=0.0), stop_ids=stops)
    assert ours[0].tolist() == want
    argv = ["generate", "--ckpt", str(run), "--prompt", text, "--temperature", "0"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--max-new-tokens", "16", "--device", "cpu"])
    assert done.value.code == 0
    printed = capsys.readouterr().out.rstrip("\n")
    assert printed == tok.decode(want[:-1]) and "<|eot_id|>" not in printed
