"""Every command line of the README and docs/*.md is true (issue 49, item 6; STYLE rule 14), as
litgpt's tests/test_readme.py keeps its own:

- every line of a ```bash, ```sh or ```console block that invokes fitgpt (`fitgpt ...`,
  `.venv/bin/fitgpt ...`, `python3 -m fitgpt ...`, `torchrun ... -m fitgpt ...`) is parsed by
  fitgpt's own parser (fitgpt.cli.build_parser), so a renamed or removed flag or subcommand
  fails here. `...` in a line stands for the rest of a run's flags: such a line is parsed with
  no flag required.
- the blocks that make up a user's recipe (RECIPES) RUN end to end on the CPU, in this process,
  in an empty folder that holds tiny stand-ins under the names the block uses (a Hugging Face
  folder saved by transformers with random weights, a chat JSONL, ...). Each command runs as
  written plus the flags of SMALL for its subcommand, appended: argparse keeps a flag's last
  value, so `--steps 500 ... --steps 2` trains 2 steps. Nothing else in a block is changed.
- every other block that invokes fitgpt is in NOT_RUN, with why it does not run here;
- a block of no shell language holds no line the parser accepts (a command there would escape
  the parse: it belongs in a ```bash block), and its usage lines (`fitgpt export --ckpt RUN
  [--dtype fp32|bf16]`) name only the subcommand's own flags.

It also keeps the README's own promises: the first recipe before line 60, a code map that names
every package, a headline table whose every figure links its row of the results index, and
relative links (README.md, docs/results.md) that lead to files."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import io
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from tokenizer_folders import CORPUS, llama3

import fitgpt
from fitgpt.cli import build_parser, main

ROOT = Path(fitgpt.__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "console")
ELIDED = "\0..."  # an unquoted `...` in a command: the rest of the flags, left out
OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}  # the command ends there


# ---- reading the docs ---------------------------------------------------------------------------
def _subcommands(parser) -> dict:
    """{name: parser} of `parser`'s subcommands."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subs[0].choices if subs else {}


NESTED = {name for name, p in _subcommands(build_parser()).items() if _subcommands(p)}  # `data X`


@dataclasses.dataclass(frozen=True)
class Command:
    where: str  # "docs/data.md:12"
    text: str  # as written, continuation lines joined
    argv: tuple[str, ...]  # fitgpt's arguments
    elided: bool  # held `...`

    @property
    def subcommand(self) -> tuple[str, ...]:
        """('train',) or ('data', 'preprocess'): the words before the first flag."""
        words = []
        for a in self.argv[:2]:
            if a.startswith("-") or (words and words[0] not in NESTED):
                break
            words.append(a)
        return tuple(words)


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence
    lang: str
    lines: tuple[tuple[int, str], ...]  # (line number, text) inside the fences

    def logical_lines(self) -> list[tuple[int, str]]:
        """(first line number, text) of each shell line, `\\`-continuations joined; in a console
        block only the `$ ` lines (the rest is output)."""
        out, pending = [], None
        for n, raw in self.lines:
            text = raw.strip()
            if pending is None:
                if self.lang == "console":
                    if not text.startswith("$ "):
                        continue
                    text = text[2:]
                if not text or text.startswith("#"):
                    continue
                pending = (n, "")
            joined = pending[1] + " " + text if pending[1] else text
            if joined.endswith("\\"):
                pending = (pending[0], joined[:-1].rstrip())
                continue
            out.append((pending[0], joined))
            pending = None
        return out

    def commands(self) -> list[Command]:
        return [c for n, t in self.logical_lines() if (c := command(f"{self.doc}:{n}", t))]

    def others(self) -> list[str]:
        """The shell lines that do not invoke fitgpt."""
        return [t for n, t in self.logical_lines() if not command(f"{self.doc}:{n}", t)]

    @property
    def key(self) -> str:
        """How RECIPES and NOT_RUN name the block: its file and the first words, up to 56
        characters, of its first fitgpt command."""
        words = shlex.split(self.commands()[0].text, comments=True)
        first = words[0]
        for w in words[1:]:
            if len(first) + 1 + len(w) > 56:
                break
            first += " " + w
        return f"{self.doc}: {first}"


def command(where: str, text: str) -> Command | None:
    """The fitgpt command of one shell line, or None if the line runs something else."""
    marked = re.sub(r"(?<!\S)\.\.\.(?!\S)", ELIDED, text)  # `...` alone; `"..."` is a value
    try:
        words = shlex.split(marked, comments=True)
    except ValueError as e:
        raise ValueError(f"{where}: not a shell line ({e}): {text}") from None
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return None
    if words[0] == "fitgpt" or words[0].endswith("/fitgpt"):
        rest = words[1:]
    elif re.fullmatch(r"python3?", words[0]) and words[1:3] == ["-m", "fitgpt"]:
        rest = words[3:]
    elif words[0] == "torchrun" and "fitgpt" in words:
        i = words.index("fitgpt")
        if words[i - 1] != "-m":
            return None
        rest = words[i + 1 :]
    else:
        return None
    cut = next((i for i, w in enumerate(rest) if w in OPERATORS), len(rest))
    rest = rest[:cut]
    argv = tuple(w for w in rest if w != ELIDED)
    return Command(where, text, argv, elided=len(argv) < len(rest))


def blocks(doc: str) -> list[Block]:
    """Every fenced block of `doc`, with its language ("" when the fence names none)."""
    found, open_at, lang, body = [], None, "", []
    for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        fence = re.match(r"\s*```(\S*)", line)
        if fence and open_at is None:
            open_at, lang, body = n, fence.group(1), []
        elif fence:
            found.append(Block(doc, open_at, lang, tuple(body)))
            open_at = None
        elif open_at is not None:
            body.append((n, line))
    return found


def shell_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc) if b.lang in SHELL and b.commands()]


def all_commands() -> list[Command]:
    return [c for b in shell_blocks() for c in b.commands()]


def parse_error(cmd: Command) -> str | None:
    """fitgpt's parser on `cmd`: None if it accepts it, else its one-line complaint."""
    parser = build_parser()
    if cmd.elided:
        _nothing_required(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(list(cmd.argv))
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip()  # 0: a --help line
    return None if getattr(args, "func", None) else "names no subcommand"


def _nothing_required(parser) -> None:
    """Drop every `required` of `parser` and its subparsers: an elided line leaves them out."""
    for action in parser._actions:
        action.required = False
    for sub in _subcommands(parser).values():
        _nothing_required(sub)


# ---- (a) every command parses ---------------------------------------------------------------
@pytest.mark.parametrize("cmd", all_commands(), ids=lambda c: c.where)
def test_every_doc_command_parses(cmd):
    error = parse_error(cmd)
    assert error is None, f"{cmd.where}: `{cmd.text}`: {error}"


def test_untagged_blocks_hold_no_command():
    """A command in a block of no shell language would escape the parse above: every line of
    such a block that fitgpt's parser accepts must move to a ```bash block. (Usage lines with
    [optional] flags, error messages and diagrams are what these blocks hold.)"""
    stray = []
    for doc in DOCS:
        for b in blocks(doc):
            if b.lang in SHELL:
                continue
            for n, line in b.lines:
                text = line.strip().removeprefix("$ ")
                try:
                    cmd = command(f"{doc}:{n}", text)
                except ValueError:  # not shell: unbalanced quotes in prose or output
                    continue
                if cmd and cmd.argv and parse_error(cmd) is None:
                    stray.append(f"{cmd.where} (```{b.lang}): {text}")
    assert not stray, "commands outside ```bash blocks:\n" + "\n".join(stray)


def test_usage_lines_name_only_real_flags():
    """The usage lines of those blocks (`fitgpt export --ckpt RUN [--dtype fp32|bf16]`) are not
    commands, but each flag they name must be one of that subcommand's."""
    top, stale = build_parser(), []
    for doc in DOCS:
        for b in blocks(doc):
            if b.lang in SHELL:
                continue
            for n, line in b.lines:
                words = line.split()
                if words[:1] != ["fitgpt"]:
                    continue
                parser, depth = top, 1
                while depth < len(words) and words[depth] in _subcommands(parser):
                    parser, depth = _subcommands(parser)[words[depth]], depth + 1
                if parser is top:  # output (`fitgpt train: error: ...`) or a diagram
                    continue
                known = {s for a in parser._actions for s in a.option_strings}
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                    if flag not in known:
                        stale.append(f"{doc}:{n}: {flag} is not a flag of {parser.prog}")
    assert not stale, "\n".join(stale)


# ---- (b) the recipes run ------------------------------------------------------------------------
# Appended to every command of a recipe, by subcommand: the only change made to what is written.
# Tiny sizes for the CPU: 2 steps of 2 rows of 64 tokens, one thread, 8 new tokens.
SMALL = {
    ("train",): ("--steps", "2", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "1",
                 "--device", "cpu", "--cpu-threads", "1"),
    ("generate",): ("--max-new-tokens", "8", "--device", "cpu"),
    ("data", "preprocess"): ("--workers", "0"),  # in this process: no pool to start
}  # fmt: skip

CHATS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
    for i in range(40)
]  # fmt: skip

# 1,200 documents: the split the docs write, 969,30,1, leaves a test document and a valid sample
DOCUMENTS = [{"text": t} for t in CORPUS * 10]


def hf_chat_folder(folder: Path) -> Path:
    """A Llama 3-shaped Hugging Face folder: tokenizer_folders' Llama 3 tokenizer and chat
    template, and a 2-layer LlamaForCausalLM with random weights saved by transformers."""
    transformers = pytest.importorskip("transformers")
    from fitgpt.data.tokenizer import load_tokenizer

    llama3(folder)
    tok = load_tokenizer(str(folder))
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tok.bos_id, eos_token_id=tok._id("<|eot_id|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def jsonl(path: Path, rows: list[dict], gz: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())


def hf_gpt2_folder(folder: Path) -> None:
    """A 2-layer GPT2LMHeadModel with GPT-2's vocabulary (fitgpt's default tokenizer, offline),
    random weights, saved by transformers."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=50257)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)


def fitgpt_ok(*argv) -> None:
    """`fitgpt ARGV` in this process, for a stand-in the block expects to find; it must succeed."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    assert done.value.code in (0, None), argv


def readme_llama(tmp: Path) -> None:
    hf_chat_folder(tmp / "Llama-3.1-8B-Instruct")
    jsonl(tmp / "chats.jsonl", CHATS)


def readme_llama_check(tmp: Path, out: str) -> None:
    """What the README promises: `my-llama` loads in transformers, with the source's shape and
    chat template, and holds weights the training moved."""
    transformers = pytest.importorskip("transformers")
    src = transformers.AutoModelForCausalLM.from_pretrained(tmp / "Llama-3.1-8B-Instruct")
    got = transformers.AutoModelForCausalLM.from_pretrained(tmp / "my-llama")
    assert type(got) is type(src) and got.config.num_hidden_layers == src.config.num_hidden_layers
    name = "model.layers.0.self_attn.q_proj.weight"
    before = src.state_dict()[name].to(torch.bfloat16)
    assert not torch.equal(got.state_dict()[name].to(torch.bfloat16), before)  # fine-tuned
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "my-llama")
    assert "<|start_header_id|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert out.strip(), "generate printed no reply"


def interop_gpt2(tmp: Path) -> None:
    hf_gpt2_folder(tmp / "gpt2-hf")
    jsonl(tmp / "my.jsonl", [{"text": t} for t in CORPUS])


def interop_gpt2_check(tmp: Path, out: str) -> None:
    """The block's last line: transformers generates from the exported folder, offline."""
    transformers = pytest.importorskip("transformers")
    t = transformers.AutoTokenizer.from_pretrained(tmp / "gpt2-ft")
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp / "gpt2-ft")
    ids = m.generate(**t("Hello", return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert ids.shape[1] == len(t("Hello")["input_ids"]) + 4


def data_corpus(tmp: Path) -> None:
    jsonl(tmp / "corpus.jsonl.gz", DOCUMENTS, gz=True)


def data_tokenizers(tmp: Path) -> None:
    """out/corpus_text_document tokenized by the HF folder hf-model/ (the first line trains on it
    with that tokenizer), Megatron-made tokens of a 128,256-token vocabulary, a.txt and
    b.jsonl.gz to train a tokenizer on."""
    llama3(tmp / "hf-model")
    jsonl(tmp / "corpus.jsonl", DOCUMENTS)
    fitgpt_ok("data", "preprocess", "--input", tmp / "corpus.jsonl", "--json-key", "text",
              "--output-prefix", tmp / "out/corpus", "--tokenizer", tmp / "hf-model",
              "--workers", "0", "--append-eod")  # fmt: skip
    fitgpt_ok("data", "fake", "--output-prefix", tmp / "megatron/corpus_text_document",
              "--tokens", "20000", "--vocab", "128256", "--doc-len", "100")  # fmt: skip
    (tmp / "a.txt").write_text("\n".join(CORPUS))
    jsonl(tmp / "b.jsonl.gz", [{"text": t} for t in CORPUS], gz=True)


def data_chat(tmp: Path) -> None:
    hf_chat_folder(tmp / "llama-3.1-8b-instruct")
    jsonl(tmp / "chat.jsonl", CHATS[:20] + [{"prompt": "Hi?", "response": "Hello."}] * 20)


def data_megatron_order(tmp: Path) -> None:
    """PREFIX: GPT-2 tokens, as the block's Megatron run would have them."""
    jsonl(tmp / "c.jsonl", DOCUMENTS)
    fitgpt_ok("data", "preprocess", "--input", tmp / "c.jsonl", "--json-key", "text",
              "--output-prefix", tmp / "c", "--workers", "0", "--append-eod")  # fmt: skip
    for suffix in ("bin", "idx", "fitgpt.json"):
        (tmp / f"c_text_document.{suffix}").rename(tmp / f"PREFIX.{suffix}")


def adapters_check(tmp: Path, out: str) -> None:
    """docs/adapters.md's promises: the PEFT folder loads over transformers' base and gives
    the merged folder's logits; the merged folder is a whole model, its weights moved."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    src = transformers.AutoModelForCausalLM.from_pretrained(tmp / "Llama-3.1-8B-Instruct")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp / "my-llama-merged").eval()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], src.state_dict()[name])
    lora = peft.PeftModel.from_pretrained(src, tmp / "my-lora-adapter").eval()
    x = torch.randint(0, src.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(lora(x).logits, merged(x).logits, rtol=0, atol=1e-5)
    assert out.strip(), "generate printed no reply"


@dataclasses.dataclass(frozen=True)
class Recipe:
    stand_ins: object  # (folder) -> None: writes the files the block names
    replaced: tuple[str, ...] = ()  # the block's other shell lines: stand_ins or check do them
    check: object = None  # (folder, stdout) -> None: what the block promises, checked after it


RECIPES = {
    "README.md: fitgpt data preprocess --chat --input chats.jsonl": Recipe(
        readme_llama, check=readme_llama_check
    ),
    "docs/interop.md: fitgpt data preprocess --input my.jsonl --json-key text": Recipe(
        interop_gpt2, replaced=("python -c", "python -c"), check=interop_gpt2_check
    ),
    "docs/adapters.md: fitgpt data preprocess --chat --input chats.jsonl": Recipe(
        readme_llama, check=adapters_check
    ),
    "docs/data.md: fitgpt data preprocess --input corpus.jsonl.gz": Recipe(data_corpus),
    "docs/data.md: fitgpt train --data out/corpus_text_document --tokenizer": Recipe(
        data_tokenizers
    ),
    "docs/data.md: fitgpt data preprocess --chat --input chat.jsonl": Recipe(data_chat),
    "docs/data.md: fitgpt train --data PREFIX --sample-order megatron": Recipe(data_megatron_order),
}

NOT_RUN = {
    "README.md: fitgpt data preprocess --chat --input moe-chats.jsonl": "a 30 B mixture of "
    "experts on 4 GPUs; tests/test_moe_paths.py runs the same commands (chat preprocess, "
    "train at world size 2, export, generate) on tiny Qwen3-MoE, Mixtral and gpt-oss folders",
    "README.md: fitgpt probe --gpus 8 --nnodes 2 --node-rank 0": "two machines of 8 GPUs; "
    "tests/test_nodes.py, test_probe_nodes.py and test_node_checkpoints.py run the same "
    "commands as 2 node ranks of 1-2 processes on this host",
    "README.md: fitgpt plan --preset llama3.1-70b --lora-rank 16": "an 8 B and a 70 B "
    "Instruct folder on an 80 GB GPU; tests/test_lora.py and tests/test_lora_base.py run the "
    "same commands (train, export peft and --merge, generate) on tiny Llama folders",
    "docs/adapters.md: fitgpt train --init-from Llama-3.1-70B-Instruct": "a 70 B "
    "base on an 80 GB GPU (tests/test_lora_base.py runs the same formats and streaming on a "
    "3-block model)",
    "README.md: fitgpt presets": "the CLI tour: one line per flag, `...` standing for the rest "
    "of a run's flags, GPU sizes (13b, 20b) and GPUs (--gpus 8); parsed only",
    "docs/results.md: fitgpt train --preset gpt2-125m --data": "the nanoGPT comparison: a "
    "clone of karpathy/nanoGPT, GPT-2 124 M compiled on an H100",
    "docs/results.md: fitgpt data preprocess --input pystd.jsonl --json-key": "the user's path "
    "at ~8 B on an H100 and 20 B on 2×H200",
    "docs/matmul.md: fitgpt matmul --n 50000 --gpus 2": "2 to 8 GPUs, and a 100000² product "
    "out of core (tests/test_matmul*.py run the same code at CPU sizes)",
    "docs/parallel.md: fitgpt train --gpus 2 --tensor-parallel 2 --preset 6.7b": "tensor "
    "parallelism over 2 to 8 GPUs at 6.7 B",
    "docs/parallel.md: fitgpt train --gpus 4 --context-parallel 4 --preset": "context "
    "parallelism over 4 to 8 GPUs at 131,072 tokens",
    "docs/training.md: fitgpt train --gpus 8 --nnodes 2 --node-rank 0": "two machines of 8 "
    "GPUs (tests/test_nodes.py runs the same flags as two nodes on one CPU host)",
    "docs/planner.md: fitgpt plan --preset llama3.1-70b --micro-batch 1": "plans of 70 B and "
    "405 B on 2 to 16 machines, the table beside them (~2.5 min of planning on 2 cores; "
    "tests/test_plan_nodes.py tests the pricing of nodes)",
    "docs/planner.md: fitgpt plan --preset 2.7b --gpu-mem 80GB --cpu-mem 125GB": "plans of "
    "2.7 to 39 B for an 80 GB GPU, output quoted beside them (~20 s of planning on 2 cores; "
    "tests/test_plan*.py test the planner)",
}


def test_every_command_block_runs_or_says_why_not():
    keys = [b.key for b in shell_blocks()]
    assert len(keys) == len(set(keys)), "two blocks start alike: name them apart"
    unlisted = [k for k in keys if k not in RECIPES and k not in NOT_RUN]
    gone = [k for k in [*RECIPES, *NOT_RUN] if k not in keys]
    assert not unlisted, "blocks neither run nor in NOT_RUN (add each):\n" + "\n".join(unlisted)
    assert not gone, "listed blocks no doc holds:\n" + "\n".join(gone)
    assert not set(RECIPES) & set(NOT_RUN)


@pytest.mark.parametrize("key", list(RECIPES))
def test_recipe_runs_on_the_cpu(key, tmp_path, monkeypatch, capsys):
    block = next(b for b in shell_blocks() if b.key == key)
    recipe = RECIPES[key]
    others = block.others()
    assert len(others) == len(recipe.replaced) and all(
        line.startswith(prefix) for line, prefix in zip(others, recipe.replaced)
    ), f"{key}: lines that are not fitgpt's must be stood in for: {others}"
    monkeypatch.chdir(tmp_path)
    recipe.stand_ins(tmp_path)
    out = []
    for cmd in block.commands():
        assert not cmd.elided, f"{cmd.where}: a recipe writes every flag out"
        argv = [*cmd.argv, *SMALL.get(cmd.subcommand, ())]
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:
            main(argv)
        got = capsys.readouterr()
        assert done.value.code in (0, None), f"{cmd.where}: `{cmd.text}`\n{got.err}"
        out.append(got.out)
    if recipe.check:
        recipe.check(tmp_path, out[-1])


# ---- the README's own promises ------------------------------------------------------------------
def test_the_first_recipe_is_the_users_job_before_line_60():
    """The README's first command block after the set-up is its fine-tune recipe, RUN above: a
    Hugging Face folder and a chat JSONL in, a fine-tuned Hugging Face folder out."""
    first = next(b for b in shell_blocks() if b.doc == "README.md")
    assert first.key in RECIPES and first.line < 60, first.key
    subcommands = [c.subcommand for c in first.commands()]
    assert subcommands[:3] == [("data", "preprocess"), ("train",), ("export",)], subcommands
    text = " ".join(c.text for c in first.commands())
    for flag in ("--chat", "--init-from", "--format hf"):
        assert flag in text


def code_map() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Code map") :]
    return section[: section.index("\n## ", 1)]


def test_code_map_names_every_package_and_nothing_else():
    """One line per package, nested as the tree is: every folder of fitgpt/ holding Python is
    named, and every name is a folder."""
    map_lines = [x for x in code_map().splitlines() if re.match(r"\s*[\w./-]+/\s", x + " ")]
    named, stack = set(), []
    for line in map_lines:
        depth = (len(line) - len(line.lstrip())) // 2
        stack[depth:] = [line.split()[0].rstrip("/")]
        named.add("/".join(stack))
    packages = {
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / "fitgpt").rglob("__init__.py")
        if p.parent.parent.name != "families" or p.parent.name == "families"
    }  # one line for families/, not one per family
    assert packages - named == set(), f"packages missing from the code map: {packages - named}"
    missing = {n for n in named if not (ROOT / n).is_dir()}
    assert not missing, f"the code map names folders that do not exist: {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_links_lead_to_files_and_anchors(doc):
    """Each relative link leads to a file (results.md sits one folder down), and each link into
    the results index to one of its rows."""
    index = (ROOT / "benchmarks/results/README.md").read_text()
    broken = []
    for target in LINK.findall((ROOT / doc).read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        where = ((ROOT / doc).parent / path).resolve()
        into_index = anchor and where == (ROOT / "benchmarks/results/README.md").resolve()
        if not where.exists() or (into_index and f'<a id="{anchor}"></a>' not in index):
            broken.append(target)
    assert not broken, f"{doc}: links to nothing: {broken}"


def test_headline_table_is_short_and_every_row_links_the_index():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Results") :]
    section = section[: section.index("\n## ", 1)]
    rows = [x for x in section.splitlines() if x.startswith("|") and not x.startswith("|---")][1:]
    assert 0 < len(rows) <= 8
    for row in rows:
        assert "benchmarks/results/README.md#" in row, row
    assert "| what | device | fitgpt | baseline / target |" not in text  # the full table moved
    assert (
        "| what | device | fitgpt | baseline / target |" in (ROOT / "docs/results.md").read_text()
    )
