"""Every ``lingo …`` and ``kfp …`` command that README.md and docs/*.md print, run as printed.

The Markdown is read when the tests are collected (the README is rewritten often): each line of
a fenced or indented code block that starts with ``lingo``, ``.venv/bin/lingo`` or ``kfp``
(after ``VAR=value`` prefixes; ``\\`` continuations joined, a ``# comment`` cut, the part
before ``&&`` / ``||`` / ``;`` / ``|``) is a command, and so is an inline code span that starts
with one of them. Each becomes a test, ``test_documented_command[README.md:411]``:

- **run**: a code-block command, or an inline span that gives arguments, runs in ``bash`` from
  a work folder (``.venv/bin/lingo`` there and ``lingo`` on PATH run this checkout's CLI;
  ``kfp`` is the stock kfp 2.17 CLI) against servers on 127.0.0.1: the KFP v2beta1 emulator
  (tests/kfp_emulator.py) as ``$KFP_ENDPOINT`` with ``$KFP_TOKEN`` set, kmock's Kubernetes
  emulator as the kubeconfig's cluster (namespace ``team``), an OpenAI-compatible chat server
  for ``lingo eval -m served=http://…``. Placeholders are filled from ``PLACEHOLDERS``. It must
  exit 0, and every call it made to the KFP emulator must have been accepted (a request body
  or filter the real server's models do not accept, or a run parameter the pipeline has not,
  is a 400 there).
- **checked**: an inline span that only names a command (``lingo estimate``, ``kfp run
  submit``), elides (``…``, ``a / b``) or sits in a table row (docs/reliability.md's rows are
  failure cases, each naming the test that runs it) is resolved with the CLI's own command
  tree: its subcommands and options must exist.
- **not run here**: the few commands in ``NOT_RUN``, each with its reason.

The ``lingo`` commands that compute (compile, estimate, data prep, eval, submit, schedule,
cluster) run under ``-m slow`` (20-60 s each on a busy machine, and each has tests of its
own); the ``kfp`` commands, ``lingo status``, ``lingo schedule list|pause|resume|delete`` and every
check run by default.

Both kinds refuse a ``kfp`` option given a ``KEY=VALUE``: run parameters are the positional
``KEY=VALUE`` arguments after the options (``-p`` is ``--pipeline-id`` in kfp 2.17).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml
from chat_server import chat_server, completion
from kfp_emulator import KfpEmulator, kfp_emulator
from kube_emulator import kube_emulator

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOKEN = "doc-test-token-3c4d"
NAMESPACE = "team"
START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:\.venv/bin/)?(lingo|kfp)(?=\s|$)")
SERVED_MODEL = "openai/gpt-oss-20b"

NOT_RUN: dict[str, str] = {
    r"^lingo (--verbose )?run --local": (
        "the whole pipeline (`make demo`, about 7 minutes here); "
        "tests/pipelines/test_local_run.py runs it shortened"
    ),
    r"^lingo compile --all": (
        "rewrites the repo's kept pipelines/compiled/*.yaml (here it would hide their drift); "
        "tests/pipelines/test_compile.py runs it into a temporary folder and compares"
    ),
    r"^lingo serve ": (
        "starts vLLM's OpenAI-compatible server and runs until interrupted; vLLM is not in "
        "this environment (make test-vllm runs tests/vllm_engines/test_vllm_serve.py: "
        "lingo serve's server scored by lingo eval's client)"
    ),
    r"^lingo eval -m sft=runs/…/sft/model -m grpo=runs/…/grpo/model": (
        "generates the 50 questions with two trained models (the demo's SFT and GRPO output), "
        "minutes on CPU; tests/eval/test_eval_engines.py runs the same eval on tiny models"
    ),
}
"""Command pattern (matched at the start, after ``.venv/bin/``) → why it cannot run here."""

PLACEHOLDERS: list[tuple[str, str]] = [
    (r"https://ds-pipeline-dspa-myproject\.apps\.example\.com", "{kfp}"),
    (r"https://<your-kfp-host>", "{kfp}"),
    (r"<run-id>|<RUN_ID>", "{run_id}"),
    (r"<ns>", NAMESPACE),
    (r"\[(--namespace \w+)\]", r"\1"),
    (r"path/to/rows\.jsonl", "{rows}"),
    (r"/models/my-sft", "{model_dir}"),
    (r"http://vllm:8000", "{chat}"),
    (r"http://127\.0\.0\.1:8000", "{chat}"),  # docs/serving.md's `lingo serve` endpoint
    (r"http://127\.0\.0\.1:8888", "{kfp}"),  # docs/submit.md's standalone emulator
    (r"(?<= )NAME(?=\s|$)", "gpt-oss-20b"),
    (r"(?<= )LAYOUT(?=\s|$)", "g5.12xlarge-x6-openrlhf"),
]
"""(regex, replacement) applied in order to a command before it runs; ``{name}`` is filled
from the servers and files of the work folder."""


@dataclass(frozen=True)
class DocCommand:
    """One command printed in the docs."""

    where: str  # "docs/submit.md:57"
    text: str  # as printed: continuations joined, comment and ``&& …`` cut
    inline: bool
    in_table: bool

    @property
    def program(self) -> str:
        return START.match(self.text).group(1)

    @property
    def argv(self) -> list[str]:
        """The words from the program on (``VAR=value`` prefixes dropped, ``.venv/bin/lingo``
        read as ``lingo``)."""
        words = _split(self.text)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words.pop(0)
        return [self.program, *words[1:]]


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an elided span: `-p grpo_execution='{"mode": …`
        return text.split()


def _cut(line: str) -> str:
    """A shell line up to its ``# comment`` and its first ``&&``, ``||``, ``;`` or ``|``
    (outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in ";|" or line.startswith("&&", i) or (char == "#" and line[i - 1 : i] == " "):
            return line[:i].strip()
    return line.strip()


def _code_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of every line in a fenced or an indented code block."""
    out, fence, previous_blank, indented = [], None, True, False
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and re.match(r"^\s*(```|~~~)", line):
            fence = stripped[:3]
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                out.append((number, line))
            continue
        indented = line.startswith("    ") and (previous_blank or indented)
        if indented:
            out.append((number, line))
        previous_blank = not stripped
    return out


def extract_commands(markdown: str, name: str) -> list[DocCommand]:
    """The ``lingo`` and ``kfp`` commands of one Markdown file, in order."""
    lines = markdown.splitlines()
    found = []
    code = _code_lines(lines)
    i = 0
    while i < len(code):
        number, text = code[i]
        text = text.strip()
        while text.endswith("\\") and i + 1 < len(code):
            i += 1
            text = text[:-1].rstrip() + " " + code[i][1].strip()
        text = _cut(text)
        if START.match(text):
            found.append(DocCommand(f"{name}:{number}", text, False, False))
        i += 1
    in_code = {number for number, _ in code}
    prose = "\n".join(
        "" if n in in_code or re.match(r"^\s*(```|~~~)", s) else s for n, s in enumerate(lines, 1)
    )
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        text = " ".join(match.group(1).split())
        if START.match(text):
            number = prose.count("\n", 0, match.start()) + 1
            in_table = lines[number - 1].lstrip().startswith("|")
            found.append(DocCommand(f"{name}:{number}", text, True, in_table))
    return found


def documented_commands() -> list[DocCommand]:
    commands = []
    for path in DOCS:
        commands += extract_commands(
            path.read_text(encoding="utf-8"),
            path.name if path.parent == ROOT else f"docs/{path.name}",
        )
    return commands


def not_run_reason(command: DocCommand) -> str | None:
    plain = " ".join(command.argv)
    return next((why for pattern, why in NOT_RUN.items() if re.match(pattern, plain)), None)


def is_mention(command: DocCommand) -> bool:
    """An inline span that names a command instead of giving one to run."""
    if not command.inline:
        return False
    if command.in_table or "…" in command.text or " / " in command.text:
        return True
    tree = _tree(command.program)
    words = command.argv[1:]
    node = tree
    while words and _subcommand(node, words[0]) is not None:
        node = _subcommand(node, words.pop(0))
    # only a command path, options without values, or an option left without its value
    return not words or all(w.startswith("-") for w in words) or _ends_without_value(node, words)


def _subcommand(node, word: str):
    """``node``'s subcommand ``word`` (aliases resolved), or None."""
    if not hasattr(node, "commands") or word.startswith("-"):
        return None
    try:
        return node.get_command(node.context_class(node), word)
    except click.UsageError:  # kfp's group raises for a name it does not have
        return None


def _ends_without_value(command, words: list[str]) -> bool:
    option = _option(command, words[-1])
    return option is not None and not option.is_flag and len(words) == 1


def _tree(program: str):
    """The root command of ``program`` (a click group; typer's for ``lingo``)."""
    if program == "lingo":
        import typer

        from pipelines.cli import app

        return typer.main.get_command(app)
    from kfp.cli.cli import cli

    return cli


def _option(command, word: str):
    """The option of ``command`` that ``word`` (``--name`` or ``--name=value``) names, or None
    (typer vendors its own click: options are recognised by duck typing)."""
    name = word.split("=", 1)[0]
    for param in command.params:
        if param.param_type_name == "option" and name in (*param.opts, *param.secondary_opts):
            return param
    return None


def check_against_cli(command: DocCommand) -> None:
    """Its subcommands and options exist in the CLI; no kfp option is given a KEY=VALUE.

    ``a / b / c`` names alternatives: each is checked with the command path of the first.
    """
    first, *others = command.text.split(" / ")
    path = [w for w in DocCommand(command.where, first, True, True).argv if not w.startswith("-")]
    texts = [first] + [" ".join([*path[:-1], other]) for other in others]
    for text in texts:
        words = DocCommand(command.where, text, True, True).argv
        program = words.pop(0)
        node, chain = _tree(program), [program]
        groups = [node]
        while words:
            word = words.pop(0)
            if word in ("…", "...") or re.fullmatch(r"<[^>]+>|\[[^\]]+\]", word):
                continue
            if word == "--help":
                continue
            if word.startswith("-"):
                option = next((o for g in reversed(groups) if (o := _option(g, word))), None)
                assert option is not None, (
                    f"{command.where}: `{command.text}`: {' '.join(chain)} has no option {word}"
                )
                takes_value = not option.is_flag and not option.count and "=" not in word
                if takes_value and words:
                    value = words.pop(0)
                    assert not (program == "kfp" and re.fullmatch(r"[A-Za-z_]\w*=.*", value)), (
                        f"{command.where}: `{command.text}`: {' '.join(chain)} {word} takes "
                        f"{option.human_readable_name}, not {value}; run parameters are "
                        "KEY=VALUE arguments after the options"
                    )
                continue
            if hasattr(node, "commands"):
                sub = _subcommand(node, word)
                assert sub is not None, (
                    f"{command.where}: `{command.text}`: {' '.join(chain)} has no command {word}"
                )
                node = sub
                chain.append(word)
                groups.append(node)


COMMANDS = documented_commands()


def test_the_docs_print_lingo_and_kfp_commands():
    # the extraction itself: if it found nothing, every test below would be vacuous
    wheres = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/submit.md", "docs/cluster.md", "docs/capacity.md"} <= wheres
    texts = [c.text for c in COMMANDS]
    assert any(t.startswith("kfp --endpoint") and " run create " in t for t in texts)


def runs_slowly(command: DocCommand) -> bool:
    """A ``lingo`` command that runs and computes (compile, estimate, data prep, eval, submit):
    over ~30 s on a busy machine, and each has its own tests; ``kfp`` commands and ``lingo
    status`` are quick."""
    return (
        command.program == "lingo"
        and not is_mention(command)
        and not_run_reason(command) is None
        and command.argv[1:2] != ["status"]
        and command.argv[1:3] not in QUICK_SCHEDULE_COMMANDS
    )


QUICK_SCHEDULE_COMMANDS = [["schedule", verb] for verb in ("list", "pause", "resume", "delete")]
"""``lingo schedule`` subcommands that compile nothing: quick, run by default (on the
``nightly`` schedule the work folder's emulator starts with)."""


def compile_outputs(commands: list[DocCommand]) -> list[tuple[str, str]]:
    """The files the documented ``lingo compile -o FILE`` commands write (relative paths),
    each with the preset it compiles (``--preset``, else the CLI's default).

    The work folder starts with each of them holding that preset's kept pipeline
    (``pipelines/compiled/<preset>.yaml``; a ``--set`` changes defaults only), so that a ``kfp
    run create -f FILE`` after it runs without the (slow) compile.
    """
    from pipelines.presets import DEFAULT_PRESET

    outputs = []
    for command in commands:
        argv = command.argv
        if argv[1:2] == ["compile"] and not is_mention(command):
            preset = argv[argv.index("--preset") + 1] if "--preset" in argv[:-1] else None
            for flag in ("-o", "--output"):
                if flag in argv[:-1]:
                    outputs.append((argv[argv.index(flag) + 1], preset or DEFAULT_PRESET))
    return [(o, preset) for o, preset in outputs if not Path(o).is_absolute()]


SAMPLE = """Intro `lingo estimate` and `lingo compile -o x.yaml`.

```bash
export KFP_ENDPOINT=https://<your-kfp-host>
.venv/bin/lingo submit --preset p \\
    --wait   # follow it
```

    lingo cluster install-runtime --dry-run > r.yaml && kubectl apply -f r.yaml

| 12 | `lingo eval --samples 0` | traceback |
"""


def test_commands_are_extracted_from_blocks_indented_code_and_inline_spans():
    found = [(c.where, c.text, c.inline, c.in_table) for c in extract_commands(SAMPLE, "S.md")]
    assert found == [
        ("S.md:5", ".venv/bin/lingo submit --preset p --wait", False, False),
        ("S.md:9", "lingo cluster install-runtime --dry-run > r.yaml", False, False),
        ("S.md:1", "lingo estimate", True, False),
        ("S.md:1", "lingo compile -o x.yaml", True, False),
        ("S.md:11", "lingo eval --samples 0", True, True),
    ]
    kinds = [is_mention(c) for c in extract_commands(SAMPLE, "S.md")]
    assert kinds == [False, False, True, False, True]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kfp run create -e x -f p.yaml -p backend=megatron", "-p takes pipeline_id, not backend"),
        ("kfp run craete -e x", "kfp run has no command craete"),
        ("lingo compile --presett gpt-oss-20b", "lingo compile has no option --presett"),
        ("lingo submit / schedul", "lingo has no command schedul"),
    ],
)
def test_a_command_the_cli_does_not_have_is_refused(text, message):
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_against_cli(DocCommand("S.md:1", text, True, False))


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=[pytest.mark.slow] if runs_slowly(c) else []) for c in COMMANDS],
    ids=[c.where for c in COMMANDS],
)
def test_documented_command(command: DocCommand, docs_env: dict, request) -> None:
    check_against_cli(command)
    if is_mention(command):
        return
    reason = not_run_reason(command)
    if reason is not None:
        pytest.skip(f"not run here: {reason}")
    run_documented(command, docs_env, request)


def run_documented(command: DocCommand, env: dict, request: pytest.FixtureRequest) -> None:
    kfp: KfpEmulator = env["kfp"]
    text = command.text
    for pattern, replacement in PLACEHOLDERS:
        text = re.sub(pattern, replacement, text)
    values = dict(env["values"])
    if "{model_dir}" in text:  # built on demand: a minute on a busy machine
        values["model_dir"] = str(request.getfixturevalue("tiny_model_dir"))
    text = text.format(**values)
    leftover = re.search(r"<[^>]+>|…", text)
    assert leftover is None, (
        f"{command.where}: `{command.text}`: placeholder {leftover.group(0)} has no value in "
        "PLACEHOLDERS"
    )
    before = len(kfp.calls)
    result = subprocess.run(
        ["bash", "-c", text],
        cwd=env["workdir"],
        env=env["environ"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    calls = kfp.calls[before:]
    shown = (
        f"{command.where}: `{text}` exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    assert result.returncode == 0, shown
    refused = [f"{c['method']} {c['path']}: {c['error']}" for c in calls if "error" in c]
    assert not refused, f"{shown}\nthe KFP emulator refused: {refused}"
    talks_to_kfp = command.program == "kfp" or command.argv[1:2] in (
        ["submit"],
        ["schedule"],
        ["status"],
    )
    if talks_to_kfp and "--help" not in command.argv:
        assert calls, f"{shown}\nno call reached the KFP emulator"


def _write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "doc", "user": {"token": "kube-doc-token"}}],
                "contexts": [
                    {
                        "name": "kmock",
                        "context": {"cluster": "kmock", "user": "doc", "namespace": NAMESPACE},
                    }
                ],
                "current-context": "kmock",
            }
        )
    )
    return path


def _served_answer(body: dict):
    message = {"content": "Voici une réponse courte.", "reasoning_content": "Je réfléchis."}
    return 200, completion(message), {}, 0.0


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory):
    """The work folder, servers and environment the documented commands run with."""
    from conftest import make_rows, write_jsonl

    from pipelines.kfp_client import (
        KfpConnection,
        create_run,
        get_or_create_experiment,
        upload_pipeline,
    )
    from pipelines.schedules import create_recurring_run

    workdir = tmp_path_factory.mktemp("docs")
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    lingo = bin_dir / "lingo"
    lingo.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pipelines "$@"\n')
    lingo.chmod(0o755)
    (bin_dir / "kfp").symlink_to(Path(sys.executable).parent / "kfp")  # kfp 2.17's own script
    (workdir / ".venv" / "bin").mkdir(parents=True)
    (workdir / ".venv" / "bin" / "lingo").symlink_to(lingo)
    (workdir / "home").mkdir()
    rows = write_jsonl(workdir / "rows.jsonl", make_rows(4))
    kept = ROOT / "pipelines" / "compiled"  # every preset's pipeline, as the docs name them
    shutil.copytree(kept, workdir / "pipelines" / "compiled")
    for output, preset in compile_outputs(COMMANDS):  # what `kfp run create -f` reads
        (workdir / output).parent.mkdir(parents=True, exist_ok=True)
        (workdir / output).write_bytes((kept / f"{preset}.yaml").read_bytes())
    with (
        kfp_emulator(run_states=[{"state": "SUCCEEDED"}]) as kfp,
        kube_emulator(namespace=NAMESPACE) as kube,
        chat_server(_served_answer, [SERVED_MODEL, "lingo-gpt-oss"]) as chat,
    ):
        conn = KfpConnection(kfp.endpoint, token=TOKEN)
        version = upload_pipeline(conn, kept / "tiny-cpu.yaml", "seeded")
        experiment_id = get_or_create_experiment(conn)
        run_id = create_run(conn, version, experiment_id, {}, "seeded-run")
        # what `lingo schedule pause nightly` and its siblings act on
        create_recurring_run(conn, version, experiment_id, "30 2 * * *", {}, "nightly")
        environ = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("KFP_", "KUBE"))},
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT),
            "HOME": str(workdir / "home"),
            "KFP_ENDPOINT": kfp.endpoint,
            "KFP_TOKEN": TOKEN,
            "KUBECONFIG": str(_write_kubeconfig(workdir / "kubeconfig", kube.configuration.host)),
            "OPENAI_API_KEY": "doc-test-key",
        }
        environ.pop("MLFLOW_TRACKING_URI", None)
        values = {
            "kfp": kfp.endpoint,
            "run_id": run_id,
            "rows": str(rows),
            "chat": f"http://127.0.0.1:{chat.server_port}",
        }
        yield {"kfp": kfp, "workdir": workdir, "environ": environ, "values": values}
