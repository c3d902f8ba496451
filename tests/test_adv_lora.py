"""PEFT folders made by PEFT itself (get_peft_model + save_pretrained) going into `fitgpt train
--lora-from`, and what an adversarial user hands it: initialisations that leave the base alone
(taken, PEFT's loss on the first batch), folders of another model or damaged ones (refused in
one line before the base is read: nothing written under --out).

Every HF model is built here with random weights (2 layers, 64 wide) and saved to a temporary
folder: nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from cli_refusal import assert_refused, run_in_process
from safetensors.torch import load_file, save_file
from test_lora import batches, cli, hf_model, losses, train_argv

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning:peft"),  # EVA without data: its defaults
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "llama"
    hf_model("llama").save_pretrained(folder)
    return folder


def peft_folder(base_folder, out, **lora):
    """PEFT's own folder of an adapter over `base_folder`, B drawn non-zero (a trained one)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out)
    return out


def from_folder_argv(base, adapter, out, steps=1) -> list[str]:
    argv = train_argv(base, out, steps=steps)
    i = argv.index("--lora-rank")
    del argv[i : i + 2]
    return [*argv, "--lora-from", str(adapter)]


@pytest.mark.parametrize("init", ["orthogonal", "mica", "eva"])
def test_an_initialisation_that_leaves_the_base_alone_goes_on_training(llama, tmp_path, init):
    """orthogonal, MiCA and EVA draw A and B only (the base untouched), so the saved folder is
    plain LoRA: taken, and the first step's loss is PeftModel.from_pretrained's on that batch."""
    adapter = peft_folder(llama, tmp_path / "peft", r=4, lora_alpha=8, init_lora_weights=init,
                          target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    assert json.loads((adapter / "adapter_config.json").read_text())["init_lora_weights"] == init
    cli(from_folder_argv(llama, adapter, tmp_path / "run"))
    base = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    ref = peft.PeftModel.from_pretrained(base, adapter).eval()
    x, y = batches(1)[0]
    with torch.no_grad():
        want = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item()
    assert abs(losses(tmp_path / "run")[0] - want) < 1e-5


def _damaged(tmp_path, good, name, change):
    folder = tmp_path / name
    shutil.copytree(good, folder)
    change(folder)
    return folder


def _rewrite(folder, fn):
    path = folder / "adapter_model.safetensors"
    save_file(fn(load_file(path)), path)


def _config(folder, **fields):
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


PREFIX = "base_model.model."
DAMAGE = {
    # (how the folder is damaged, what the one line names)
    "another-rank": (lambda d: _config(d, r=8), "[8, 64]"),
    "truncated": (
        lambda d: (d / "adapter_model.safetensors").write_bytes(
            (d / "adapter_model.safetensors").read_bytes()[:-100]
        ),
        "unreadable",
    ),
    "bin-only": (
        lambda d: (
            torch.save(load_file(d / "adapter_model.safetensors"), d / "adapter_model.bin"),
            (d / "adapter_model.safetensors").unlink(),
        ),
        "adapter_model.bin",
    ),
    "integers": (
        lambda d: _rewrite(d, lambda t: {k: v.to(torch.int32) for k, v in t.items()}),
        "I32",
    ),
    "no-prefix": (
        lambda d: _rewrite(d, lambda t: {k.removeprefix(PREFIX): v for k, v in t.items()}),
        "lacks base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    ),
    "alpha-infinite": (lambda d: _config(d, lora_alpha=float("inf")), "lora_alpha=inf"),
    "head": (lambda d: _config(d, target_modules=["q_proj", "lm_head"]), "target_modules lm_head"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_folder_fitgpt_cannot_read_is_refused_before_the_base_is_read(
    llama, tmp_path, capsys, case
):
    """One line naming the file and the key, and nothing under --out: the tensors' names,
    shapes and dtypes are read from the header when the run is settled, not after the base
    (minutes for a large model) is loaded."""
    good = peft_folder(llama, tmp_path / "peft", r=4, lora_alpha=8, target_modules=["q_proj"])
    change, names = DAMAGE[case]
    folder = _damaged(tmp_path, good, case, change)
    out = tmp_path / "run"
    line = assert_refused(*run_in_process(capsys, *from_folder_argv(llama, folder, out)), names)
    assert str(folder) in line
    assert not out.exists()
    if case in (
        "head",
        "alpha-infinite",
    ):  # the folder's target_modules, not a flag the user did not give
        assert "--lora-targets" not in line and "adapter_config.json" in line


def test_a_merge_whose_base_is_gone_names_the_run_s_base_not_a_flag(llama, tmp_path, capsys):
    """export --merge and generate of an adapter run read its base again: gone, the one line
    says it is the run's base that is missing and that the adapters alone still export (it
    said `--init-from X does not exist; pass ...`, a flag neither command has)."""
    base = tmp_path / "base"
    shutil.copytree(llama, base)
    run = tmp_path / "run"
    cli(train_argv(base, run, steps=1))
    shutil.rmtree(base)
    merge = ("export", "--ckpt", run, "--format", "hf", "--merge", "--out", tmp_path / "m")
    for argv in (merge, ("generate", "--ckpt", run, "--prompt", "hi", "--tokenizer", "bytes")):
        line = assert_refused(*run_in_process(capsys, *argv), str(base), "--format peft")
        assert "--init-from" not in line.split(":")[0]
    assert not (tmp_path / "m").exists()
    cli(["export", "--ckpt", run, "--format", "peft", "--out", tmp_path / "p"])


def test_peft_s_all_linear_on_a_mixture_adapts_its_experts_and_is_refused_for_that(
    tmp_path, capsys
):
    """PEFT 0.21's all-linear over transformers' Qwen3-MoE adapts the experts and the router
    too (target_parameters, with a rank_pattern for the fused experts), which fitgpt does not:
    the one line names target_parameters and the experts, not the rank_pattern PEFT added."""
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=64, vocab_size=300, intermediate_size=96,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "moe")
    folder = peft_folder(tmp_path / "moe", tmp_path / "peft", r=4, target_modules="all-linear")
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["target_parameters"] and saved["rank_pattern"]  # what PEFT made of all-linear
    argv = from_folder_argv(tmp_path / "moe", folder, tmp_path / "run")
    line = assert_refused(*run_in_process(capsys, *argv), "target_parameters", "experts")
    assert "rank_pattern" not in line and not (tmp_path / "run").exists()


def test_a_folder_holding_adapters_in_subfolders_names_them(llama, tmp_path, capsys):
    """PEFT saves an adapter not named "default" in a subfolder of its name (and the HF Trainer
    its checkpoints as checkpoint-N/): the parent folder passed, the one line names the
    subfolders that are adapters, and one of them trains."""
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    model = peft.get_peft_model(base, lora, adapter_name="sql")
    model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "sql" / "adapter_config.json").is_file()
    argv = from_folder_argv(llama, tmp_path / "saved", tmp_path / "run")
    assert_refused(*run_in_process(capsys, *argv), "adapter_config.json", "saved/sql")
    cli(from_folder_argv(llama, tmp_path / "saved" / "sql", tmp_path / "run"))


@pytest.mark.parametrize("where", ["same", "inside"])
def test_an_out_at_or_inside_the_lora_from_folder_is_refused_and_the_folder_kept(
    llama, tmp_path, capsys, where
):
    """--out the --lora-from folder with --overwrite emptied it before its tensors were read:
    the user's adapter was deleted and the run failed. Refused, as an --out in the --init-from
    model is, and the folder stays whole."""
    adapter = peft_folder(llama, tmp_path / "peft", r=4, lora_alpha=8, target_modules=["q_proj"])
    before = {p.name: p.read_bytes() for p in adapter.iterdir()}
    out = adapter if where == "same" else adapter / "run"
    argv = [*from_folder_argv(llama, adapter, out), "--overwrite"]
    assert_refused(*run_in_process(capsys, *argv), "--out", "--lora-from")
    assert {p.name: p.read_bytes() for p in adapter.iterdir()} == before


def test_a_folder_carrying_a_resized_embedding_is_refused_for_that(llama, tmp_path, capsys):
    """Tokens added to the model (resize_token_embeddings) make PEFT save the whole embedding
    and head beside the adapters, with target_modules unchanged: the one line says the folder
    holds whole weights of a resized vocabulary, not "fix target_modules"."""
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    base.resize_token_embeddings(base.config.vocab_size + 8)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "peft")
    argv = from_folder_argv(llama, tmp_path / "peft", tmp_path / "run")
    line = assert_refused(*run_in_process(capsys, *argv), "embed_tokens", "vocabulary")
    assert "fix target_modules" not in line and not (tmp_path / "run").exists()


def test_a_peft_folder_given_as_init_from_is_named_for_what_it_is(llama, tmp_path, capsys):
    """An adapter folder passed as the model: the one line says it is a PEFT adapter, and to
    pass its base (the folder's base_model_name_or_path) as --init-from and it as --lora-from."""
    adapter = peft_folder(llama, tmp_path / "peft", r=4, target_modules=["q_proj"])
    argv = train_argv(adapter, tmp_path / "run", steps=1)
    assert_refused(*run_in_process(capsys, *argv), "PEFT adapter", "--lora-from", str(llama))


def test_targets_given_again_agree_by_the_modules_they_name(llama, tmp_path, capsys):
    """PEFT saves all-linear as the module names it found (whole names on a small model):
    --lora-targets all-linear given again names the same modules and is taken; a flag naming
    other modules is refused in one line."""
    adapter = peft_folder(llama, tmp_path / "peft", r=4, target_modules="all-linear")
    saved = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert "all-linear" not in saved
    argv = from_folder_argv(llama, adapter, tmp_path / "run")
    assert_refused(*run_in_process(capsys, *argv, "--lora-targets", "q_proj"), "--lora-targets")
    cli([*argv, "--lora-targets", "all-linear"])
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_base_whose_weights_changed_is_refused_by_merge_generate_and_resume(
    llama, tmp_path, capsys
):
    """The base folder a LoRA run names, overwritten by another model of the same shape (a
    newer revision, the instruct model saved over the base): the merge, generate and a resume
    added the adapters to weights they were not trained on, silently. The run records a
    fingerprint of its base (sizes and sampled bytes of its weight files, as the data's): each
    refuses in one line naming the base; put back, all go on."""
    base = tmp_path / "base"
    shutil.copytree(llama, base)
    run = tmp_path / "run"
    cli(train_argv(base, run, steps=1))
    weights = base / "model.safetensors"
    kept = weights.read_bytes()
    other = load_file(weights)
    save_file({k: v + 0.01 for k, v in other.items()}, weights, metadata={"format": "pt"})
    merge = ("export", "--ckpt", run, "--format", "hf", "--merge", "--out", tmp_path / "m")
    resume = ("train", "--out", run, "--resume", "--steps", "2")
    generate = ("generate", "--ckpt", run, "--prompt", "hi", "--tokenizer", "bytes")
    for argv in (merge, generate, resume):
        assert_refused(*run_in_process(capsys, *argv), str(base), "other weights")
    assert not (tmp_path / "m").exists()
    weights.write_bytes(kept)
    cli(merge)
    cli(resume)
