import pytest
import torch

from fitgpt.errors import UserError
from fitgpt.infer.generate import SampleConfig, generate
from fitgpt.model import GPT, PRESETS, ModelConfig, get_preset, padded_vocab


def closed_form(c: ModelConfig) -> int:
    h, L, V, S = c.n_embd, c.n_layer, padded_vocab(c.vocab_size), c.seq_len
    return 12 * L * h * h + 13 * L * h + (V + S) * h + 2 * h


@pytest.mark.parametrize("name", ["gpt2-125m", "gpt2-1.5b", "2.7b", "13b", "40b"])
def test_num_params_matches_closed_form_on_meta(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == closed_form(cfg) == cfg.num_params()


def test_gpt2_small_is_124m_with_padded_vocab():
    assert padded_vocab(50257) == 50304
    assert PRESETS["gpt2-125m"].num_params() == 124_475_904


@pytest.mark.parametrize(
    "opts, delta",
    [
        ({"bias": False}, lambda c: -(11 * c.n_layer * c.n_embd + c.n_embd)),
        ({"position": "alibi"}, lambda c: -c.seq_len * c.n_embd),
        ({"embed_norm": True}, lambda c: 2 * c.n_embd),
        ({"tie_embeddings": False}, lambda c: padded_vocab(c.vocab_size) * c.n_embd),
    ],
)
def test_options_change_params_as_documented(opts, delta):
    base = ModelConfig(n_layer=3, n_embd=64, n_head=4, seq_len=16, vocab_size=300)
    cfg = base.replace(**opts)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params() == cfg.num_params() == closed_form(base) + delta(base)


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"position": "alibi"},
        {"embed_norm": True, "bias": False},
        {"tie_embeddings": False, "dropout": 0.1},
    ],
)
def test_forward_shapes_and_loss(opts):
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=16, vocab_size=100, **opts)
    model = GPT(cfg)
    model.reset_parameters(0)
    x = torch.randint(0, 100, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, 128)  # vocabulary padded to 128
    loss = model(x, x)
    assert loss.ndim == 0 and 3.5 < loss.item() < 6.0  # about ln(128) at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_configs_are_user_errors():
    with pytest.raises(UserError, match="not divisible"):
        ModelConfig(n_embd=30, n_head=4)
    with pytest.raises(UserError, match="does not exist"):
        get_preset("gpt5")


@pytest.mark.parametrize("position", ["learned", "alibi"])
def test_greedy_with_kv_cache_equals_without(position):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=40, vocab_size=64, position=position)
    model = GPT(cfg).eval()
    model.reset_parameters(3)
    prompt = torch.randint(0, 64, (2, 5))
    greedy = SampleConfig(max_new_tokens=20, temperature=0.0)
    with_cache = generate(model, prompt, greedy, use_cache=True)
    without = generate(model, prompt, greedy, use_cache=False)
    assert with_cache.shape == (2, 25)
    assert torch.equal(with_cache, without)


def test_kv_cache_logits_match_full_forward():
    cfg = ModelConfig(n_layer=2, n_embd=32, n_head=4, seq_len=32, vocab_size=64)
    model = GPT(cfg).eval()
    model.reset_parameters(1)
    x = torch.randint(0, 64, (1, 12))
    from fitgpt.model import KVCache

    cache = KVCache(cfg, 1, "cpu", torch.float32)
    model(x[:, :7], cache=cache)
    last = model(x[:, 7:], cache=cache)  # a multi-token step on a non-empty cache
    full = model(x)[:, -1:]
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-5)


def test_init_is_seeded_by_name():
    cfg = ModelConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8, vocab_size=32)
    a, b = GPT(cfg), GPT(cfg)
    a.reset_parameters(5)
    b.reset_parameters(5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    w = a.blocks[0].attn.proj.weight
    assert abs(w.std().item() - 0.02 / 2**0.5) < 0.006  # residual projection scaled by 1/sqrt(2L)
