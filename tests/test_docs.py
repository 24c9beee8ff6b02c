"""Every fenced block in README.md and docs/*.md is run or checked, on a fresh cache, or says why not.

The pages: README.md and docs/*.md, except docs/architecture.md and docs/benchmarks.md (notes on the code and
measurements, not instructions) and docs/configuration.md (generated from the config models). Each fenced block is
one of:

- marked: the line before it is ``<!-- not run: REASON -->`` (a diagram, sample output that differs per machine, a
  command that needs GPUs, SLURM or a network). The reason must not be empty.
- ``toml``: written to a file and loaded with ``treadle.load_config`` (the defaults, then the block: a full config or
  a fragment that merges into the default); it must validate, cross-field rules included.
- ``python``: run as a script in a fresh directory with an empty ``TREADLE_CACHE`` of its own (a new user's notebook
  on a fresh machine).
- ``bash``: every command line is ``make TARGET`` (checked: TARGET is a Makefile target; ``make demo`` / ``make test``
  are not run here, ``make demo`` is the README's three commands, which are), ``treadle ...`` or ``torchrun ...``
  (run, in the page's order, through ``python -m treadle`` / ``python -m torch.distributed.run``; each must exit 0).
- ``console``: ``$ treadle ...`` lines are run as they stand (nothing appended); the lines after each are expected
  output: every one must appear in the command's stdout + stderr, in order (``...`` stands for anything).

Commands run in a temporary directory per page (``configs`` and ``examples`` link to the repository's), all with one
``TREADLE_CACHE`` that starts empty in this module. README.md's commands run first, once (module fixture), each in a
fresh interpreter (``python -m treadle``, as a shell runs ``treadle``), and leave the tiny ``runs/demo`` (target) and
``runs/demo-draft`` (GLIDE draft) that the pages after it copy into their directory. The other pages' ``treadle``
commands run ``treadle.cli.main`` in a process forked from one that has imported torch, transformers and treadle
(tests/preloaded.py: a new process each, its own environment and exit code, without ~3 s of imports each);
``torchrun`` lines start the real launcher. To fit in a few minutes on 2 cores, commands are shortened by appending
exactly:

- ``treadle train`` (also under torchrun): ``TRAIN_SHORT`` below (2 steps of 2 sequences, one eval batch, fp32, no
  compile, one thread; ``seq_len`` stays the page's, so SFT examples still fit); and ``TINY_MODEL`` (hidden 32,
  4 layers: the shallowest target with three distinct EAGLE-3 features an engine serves) when the run builds its model from a preset (no ``model.path``, not a draft run), and ``DRAFT_SHORT``
  (2 acceptance prompts of 8 tokens, 12 new) in a draft run or a run with a draft beside its model.
- ``treadle spec-eval``: ``--num-prompts 2 --prompt-len 16 --max-new-tokens 8 --threads 1 --repeats 1`` (one timed
  pass: the pages' spec-evals are checked for running losslessly, not for their speed spread; tests/test_spec_decode.py
  checks ``--repeats``).
- ``treadle generate``: ``--max-new-tokens 8``.
- ``treadle features``: ``DRAFT_SHORT`` (a store holds the acceptance texts of the draft run it serves).
- ``treadle samples``: ``--n 40`` (40 rows per file, not 2,000).

Nothing else is changed: the commands, configs and data are the pages' own.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.preloaded import run_treadle

REPO = Path(__file__).resolve().parents[1]
NOT_DOCS = {"architecture.md", "benchmarks.md", "configuration.md"}
PAGES = [REPO / "README.md"] + sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in NOT_DOCS)
MARKER = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
RUNNABLE = {"toml", "python", "bash", "console"}

TRAIN_SHORT = ["--train.max_steps=2", "--train.micro_batch_size=2", "--train.grad_accum_steps=1",
               "--train.eval_batches=1", "--train.log_every=1", "--train.threads=1", "--model.dtype=fp32",
               "--model.compile=false"]
TINY_MODEL = ["--model.overrides={hidden_size=32,intermediate_size=64,num_hidden_layers=4,num_attention_heads=4,"
              "num_key_value_heads=2}"]
DRAFT_SHORT = ["--draft.eval_prompts=2", "--draft.eval_prompt_len=8", "--draft.eval_new_tokens=12"]
APPENDED = {"spec-eval": ["--num-prompts", "2", "--prompt-len", "16", "--max-new-tokens", "8", "--threads", "1",
                          "--repeats", "1"],
            "generate": ["--max-new-tokens", "8"], "samples": ["--n", "40"]}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the reason of a <!-- not run: ... --> marker, or None

    def __str__(self):
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line} ({self.lang or 'no language'})"


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, start = m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(prev)
        blocks.append(Block(page, start + 1, m.group(3).lower(), "\n".join(body) + "\n",
                            marker.group(1).strip() if marker else None))
        i += 1
    return blocks


def commands(block: Block) -> list[list[str]]:
    """A bash block's command lines (continuations joined, comments dropped) as argv lists."""
    out = []
    for line in block.text.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            out.append(argv)
    return out


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in fenced_blocks(page)]


def static_problems(blocks: list[Block]) -> list[str]:
    """What makes a block neither runnable nor marked."""
    problems = []
    targets = makefile_targets()
    for b in blocks:
        if b.marker is not None:
            if not b.marker:
                problems.append(f"{b}: the not-run marker gives no reason")
            continue
        if b.lang not in RUNNABLE:
            problems.append(f"{b}: neither run nor marked; write ```toml/python/bash/console, or put "
                            "<!-- not run: REASON --> on the line before it")
        if b.lang == "bash":
            for argv in commands(b):
                if argv[0] == "make":
                    if len(argv) != 2 or argv[1] not in targets:
                        problems.append(f"{b}: {shlex.join(argv)}: not a Makefile target")
                elif argv[0] not in ("treadle", "torchrun"):
                    problems.append(f"{b}: {shlex.join(argv)}: only make, treadle and torchrun lines are run; "
                                    "mark the block <!-- not run: REASON --> or change the command")
        if b.lang == "console" and not b.text.lstrip().startswith("$ treadle"):
            problems.append(f"{b}: a console block starts with a '$ treadle ...' line")
    return problems


def toml_problems(blocks: list[Block], tmp: Path) -> list[str]:
    """Each unmarked toml block loaded by treadle's config loader over the defaults."""
    from treadle import UserError, load_config

    problems = []
    for n, b in enumerate(blocks):
        if b.lang != "toml" or b.marker is not None:
            continue
        path = tmp / f"block{n}.toml"
        path.write_text(b.text)
        try:
            load_config(path)
        except UserError as err:
            problems.append(f"{b}: {err}")
    return problems


def test_every_block_is_run_or_says_why_not():
    """No block can drift silently: each is one the tests below run or check, or carries a marker with a reason."""
    problems = static_problems(all_blocks())
    assert not problems, "\n".join(problems)


def test_toml_blocks_validate(tmp_path):
    blocks = all_blocks()
    assert sum(b.lang == "toml" and b.marker is None for b in blocks) >= 5
    problems = toml_problems(blocks, tmp_path)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_drifted_page(tmp_path):
    """A page with an unmarked sample, an empty marker, a shell line that is not run, a gone Makefile target, a
    config key that does not exist and a console line the command no longer prints: each is named."""
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "```", "output", "```",
        "<!-- not run: -->", "```bash", "treadle --help", "```",
        "```bash", "ls runs", "make no-such-target", "```",
        "```toml", "[train]", "max_stps = 5", "```",
        "```console", "$ treadle train --train.max_stps=50", "treadle: error: something else", "```",
    ]) + "\n")
    blocks = fenced_blocks(page)
    assert [(b.line, b.lang, b.marker) for b in blocks] == [
        (1, "", None), (5, "bash", ""), (8, "bash", None), (12, "toml", None), (16, "console", None)]
    found = static_problems(blocks) + toml_problems(blocks, tmp_path)
    found += _check_console(blocks[-1], tmp_path, _env(tmp_path / "cache"))
    expect = ["neither run nor marked", "marker gives no reason", "ls runs: only make, treadle and torchrun",
              "make no-such-target: not a Makefile target", "unknown key train.max_stps",
              "did not print (in order): 'treadle: error: something else'"]
    assert len(found) == len(expect), found
    for line, want in zip(found, expect):
        assert want in line, (line, want)


def test_the_readme_shows_what_make_demo_runs():
    """The README says `make demo` is its three commands: the Makefile's demo recipe runs those, in that order."""
    recipe = (REPO / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    ran = [shlex.split(line.strip().replace("$(BIN)/", "")) for line in recipe.splitlines()[1:] if line.strip()]
    readme = [b for b in fenced_blocks(REPO / "README.md") if b.lang == "bash"]
    shown = [argv for b in readme for argv in commands(b) if argv[0] == "treadle"]
    assert len(ran) == len(shown) == 3
    for make_argv, doc_argv in zip(ran, shown):
        assert make_argv[:len(doc_argv)] == doc_argv, (make_argv, doc_argv)


def written_paths(blocks: list[Block]) -> set[str]:
    """The relative paths the pages' commands and Python write into a checkout: --out, output_dir, an export's
    destination, and the paths a python block writes (``output_dir = "..."``, ``export(..., "out")``)."""
    found = set()
    for b in blocks:
        if b.lang == "bash" and b.marker is None:
            for argv in commands(b):
                for i, arg in enumerate(argv):
                    if arg in ("--out", "--html", "--json") and i + 1 < len(argv):
                        found.add(argv[i + 1])
                    elif arg.startswith(("--out=", "--html=", "--json=", "--train.output_dir=")):
                        found.add(arg.split("=", 1)[1])
                if argv[:2] == ["treadle", "export"]:
                    found.add([a for a in argv[2:] if not a.startswith("-")][1])
        if b.lang == "python" and b.marker is None:
            found.update(re.findall(r'output_dir = "([^"]+)"', b.text))
            found.update(re.findall(r'export\([^,]+, "([^"]+)"', b.text))
    return {f for f in found if not f.startswith(("/", "$", "~"))}


def test_what_the_pages_write_is_ignored_by_git():
    """A new user who runs the pages' recipes in a clone sees no untracked runs, shards or exports."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    written = written_paths(all_blocks())
    assert {"shards/train", "exported/demo"} <= written, written
    probe = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-n", "-v"], cwd=REPO, text=True,
                           input="".join(f"{w}/x\n" for w in sorted(written)), capture_output=True)
    ignored = {line.split("\t")[1][:-2] for line in probe.stdout.splitlines() if not line.startswith("::")}
    assert written <= ignored, f"not in .gitignore: {sorted(written - ignored)}"


def test_pages_exist_and_the_readme_is_a_front_page():
    names = {p.name for p in PAGES}
    for page in ("data.md", "drafts.md", "serving.md", "scale-out.md", "big-models.md", "checkpoints.md",
                 "watching.md", "python.md", "training.md"):
        assert page in names, page
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "README.md is a front page; move the manual into docs/"
    assert "make demo" in readme and "make test" in readme and "make gpu-check" in readme
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"the README's map of the docs lacks docs/{page.name}"




def test_relative_links_resolve():
    problems = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"\w+://|mailto:", target):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                problems.append(f"{page.relative_to(REPO)}: link to {target} resolves to nothing")
    assert not problems, "\n".join(problems)


# Every Markdown page a user reads from a clone, the notes and the generated reference included.
READ_PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
              *sorted(p for d in ("bench", "configs", "examples") for p in (REPO / d).rglob("*.md"))]
_LINK = re.compile(r"\]\(<?([^)\s>]+)")
_BARE = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*)")  # a relative path climbing out of its page's folder
_PUBLIC_URL = re.compile(r"https?://(?!(?:localhost|127\.|0\.0\.0\.0|\[::1\]))|mailto:")


def outside_references(page: Path, root: Path = REPO) -> list[str]:
    """Links and bare ``../`` paths of ``page`` that lead out of the repository ``root`` (or to nothing in it): a
    reader has the clone and the public web, not the folders that sat beside the authors' checkout. A link may be a
    public URL; anything else must resolve, from the page's folder, to a path inside the repository."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for kind, pattern in (("link", _LINK), ("path", _BARE)):
        for target in pattern.findall(text):
            target = target.split("#")[0].rstrip(".,;:")
            if not target or (kind == "link" and _PUBLIC_URL.match(target)):
                continue
            where = f"{page.relative_to(root)}: {kind} {target}"
            if re.match(r"[a-z][\w+.-]*:", target) or target.startswith(("/", "~")):
                problems.append(f"{where} is neither a public URL nor a path in the repository")
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.is_relative_to(root):
                problems.append(f"{where} leads out of the repository")
            elif not resolved.exists():
                problems.append(f"{where} names nothing in the repository")
    return problems


def test_no_page_points_outside_the_repository():
    problems = [p for page in READ_PAGES for p in outside_references(page)]
    assert not problems, "cite the public source (repository + path, paper, issue or PR) instead:\n" + "\n".join(
        problems)


def test_outside_references_are_caught(tmp_path):
    """The check names a team folder beside the checkout, a local file, an absolute path, a localhost link and a
    link that climbs out; it passes public URLs, anchors and paths that resolve inside the repository."""
    root = tmp_path / "repo"
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "demo.toml").write_text("")
    (root / "docs").mkdir()
    page = root / "docs" / "page.md"
    page.write_text("\n".join([
        "notes: `../shared/research/dflash-offline.md` §1.4, and ../../outside.md.",
        "[a](../configs/demo.toml) [b](https://github.com/z-lab/dflash) [c](#layouts) [d](mailto:x@example.org)",
        "[e](file:///work/shared/x.md) [f](/work/shared/x.md) [g](http://localhost:8000/v1) [h](../../x.md)",
    ]) + "\n")
    found = [line.split(": ", 1)[1] for line in outside_references(page, root)]
    assert found == [
        "link file:///work/shared/x.md is neither a public URL nor a path in the repository",
        "link /work/shared/x.md is neither a public URL nor a path in the repository",
        "link http://localhost:8000/v1 is neither a public URL nor a path in the repository",
        "link ../../x.md leads out of the repository",
        "path ../shared/research/dflash-offline.md names nothing in the repository",
        "path ../../outside.md leads out of the repository",
        "path ../../x.md leads out of the repository",
    ]


# ------------------------------------------------------------------------------------------------ running pages


def _env(cache: Path) -> dict:
    env = {**os.environ, "TREADLE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"),
           "HF_HUB_OFFLINE": "1"}
    env.pop("TREADLE_DRILL_KILLS", None)
    return env


def _shortened(argv: list[str], cwd: Path) -> list[str]:
    """argv (starting at the treadle subcommand) with what the module docstring says is appended."""
    if argv[0] == "train":
        from treadle import load_config

        config = [a for a in argv[1:] if not a.startswith("--")]
        cfg = load_config(cwd / config[0] if config else None, [a for a in argv[1:] if a.startswith("--")])
        # a draft beside its target (draft.target = "self") trains the model too: both shortenings
        extra = ((DRAFT_SHORT if cfg.draft.kind else [])
                 + ([] if cfg.model.path or cfg.draft.frozen_target else TINY_MODEL))
        return [*argv, *TRAIN_SHORT, *extra]
    if argv[0] == "features":  # the store of the shortened draft run that follows it: its acceptance settings
        return [*argv, *DRAFT_SHORT]
    return [*argv, *APPENDED.get(argv[0], [])]


def _to_python(argv: list[str], cwd: Path) -> list[str]:
    if argv[0] == "treadle":
        return [sys.executable, "-m", "treadle", *_shortened(argv[1:], cwd)]
    assert argv[0] == "torchrun", argv
    i = argv.index("-m")
    assert argv[i + 1] == "treadle", argv
    return [sys.executable, "-m", "torch.distributed.run", *argv[1:i], "-m", "treadle",
            *_shortened(argv[i + 2:], cwd)]


def _run(argv: list[str], cwd: Path, env: dict, fresh: bool, shorten: bool = True,
         timeout: float = 600) -> subprocess.CompletedProcess:
    """A page's command line as run here (the module docstring), shortened unless not ``shorten``: ``treadle ...``
    in a fresh interpreter (``python -m treadle``) when ``fresh``, else forked from one that has imported treadle
    (tests/preloaded.py); ``torchrun ...`` always a fresh launcher."""
    if argv[0] == "treadle":
        words = _shortened(argv[1:], cwd) if shorten else argv[1:]
        if not fresh:
            return run_treadle(words, cwd, env, timeout)
        full = [sys.executable, "-m", "treadle", *words]
    else:
        full = _to_python(argv, cwd)
    return subprocess.run(full, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _check_console(b: Block, cwd: Path, env: dict, fresh: bool = False) -> list[str]:
    problems = []
    steps = re.split(r"^\$ ", b.text, flags=re.M)[1:]
    for step in steps:
        cmd, *expected = step.rstrip("\n").split("\n")
        argv = shlex.split(cmd)
        proc = _run(argv, cwd, env, fresh, shorten=False, timeout=300)
        output, pos = (proc.stdout + proc.stderr).splitlines(), 0
        for want in expected:
            if want.strip() == "...":
                continue
            found = next((i for i in range(pos, len(output)) if output[i].rstrip() == want.rstrip()), None)
            if found is None:
                problems.append(f"{b}: `{cmd}` did not print (in order): {want!r}\n  it printed:\n" +
                                "\n".join(output[:40]))
                break
            pos = found + 1
    return problems


def run_page(page: Path, cwd: Path, env: dict, fresh: bool = False) -> list[str]:
    """Run a page's bash and console blocks in order; return what went wrong (empty: all passed). ``fresh``: each
    treadle command in a new interpreter, as a user's shell starts it (else forked from a preloaded one: ``_run``)."""
    problems, timings = [], []
    for b in fenced_blocks(page):
        if b.marker is not None:
            continue
        if b.lang == "console":
            problems += _check_console(b, cwd, env, fresh)
        if b.lang != "bash":
            continue
        for argv in commands(b):
            if argv[0] == "make":
                continue  # checked in test_every_block_is_run_or_says_why_not
            full = _to_python(argv, cwd)
            t0 = time.perf_counter()
            proc = _run(argv, cwd, env, fresh)
            timings.append(f"{time.perf_counter() - t0:5.1f} s  {shlex.join(argv)}")
            if proc.returncode != 0:
                problems.append(f"{b}: `{shlex.join(argv)}` exited {proc.returncode}\n  ran: {shlex.join(full)}\n"
                                f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
                return problems  # later commands of a page build on this one
    print(f"\n{page.relative_to(REPO)}:\n  " + "\n  ".join(timings))
    return problems


def _workspace(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in ("configs", "examples"):
        (path / name).symlink_to(REPO / name)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One TREADLE_CACHE for the module's commands, empty at the start: nothing a developer's cache holds helps."""
    return tmp_path_factory.mktemp("treadle-cache")


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory, cache):
    """README.md's commands, run once: they leave runs/demo and runs/demo-draft for the pages after it."""
    cwd = _workspace(tmp_path_factory.mktemp("readme"))
    return cwd, run_page(REPO / "README.md", cwd, _env(cache), fresh=True)


def test_readme_commands_run(readme_run):
    cwd, problems = readme_run
    assert not problems, "\n".join(problems)
    assert (cwd / "runs" / "demo" / "hf" / "config.json").is_file()
    # the demo's draft leaves treadle: the directory LongSpec's LlamaGlideDecoderLayer.from_pretrained loads
    exported = json.loads((cwd / "runs" / "demo-draft" / "draft" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaGlideDecoderLayer"] and exported["layout"] == "longspec"
    assert (cwd / "runs" / "demo-draft" / "draft" / "draft_model_weights.pth").is_file()


def _runs_something(page: Path) -> bool:
    return any(b.marker is None and b.lang in ("bash", "console") and
               (b.lang == "console" or any(a[0] != "make" for a in commands(b))) for b in fenced_blocks(page))


@pytest.mark.parametrize("page", [p for p in PAGES[1:] if _runs_something(p)], ids=lambda p: p.name)
def test_page_commands_run(page, readme_run, cache, tmp_path):
    base, problems = readme_run
    assert not problems, "README.md's commands failed; the pages build on them"
    cwd = _workspace(tmp_path / "work")
    shutil.copytree(base / "runs", cwd / "runs", symlinks=True)
    problems = run_page(page, cwd, _env(cache))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.lang == "python" and b.marker is None], ids=str)
def test_python_blocks_run(block, tmp_path):
    """As a new user runs it: its own script in an empty directory, an empty cache, no __main__ guard."""
    (tmp_path / "example.py").write_text(block.text)
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**_env(tmp_path / "cache"), "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, f"{block}:\n{proc.stderr[-3000:]}"
    assert "torch.distributed is disabled, unavailable or uninitialized" not in proc.stderr
    if block.page.name == "python.md" and "runs/notebook" in block.text:  # the page's example, what it promises
        run = tmp_path / "runs" / "notebook"
        assert (run / "config.toml").is_file() and (run / "checkpoints" / "latest").exists()
        assert (tmp_path / "exported" / "notebook" / "config.json").is_file()
        assert "step 1: loss" in proc.stdout  # the example's callback ran
