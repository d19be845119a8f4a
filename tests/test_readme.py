"""The README's walkthrough runs as written.

A user copies the README's blocks into a shell; these tests do the same, in a fresh working
directory (so nothing depends on the checkout's ``runs/`` or ``reports/``), with this environment's
``xroute`` and ``python`` first on ``PATH`` -- the state ``source .venv/bin/activate`` gives:

- the serving block, verbatim but for the port (a free one instead of 8080, so parallel runs and a
  router already on 8080 cannot collide): keys, the router, one routed request, its feedback, the
  export -- which must count the feedback;
- the gateway's config and ``openai`` client block, against a vLLM-like stand-in;
- the Python block;
- the quick evaluation line;
- every other ``xroute`` command of a ``bash`` block with ``--help`` appended: click refuses an
  unknown option or command before it reaches ``--help``, so each option shown exists.

The quick-start block (``scripts/main.sh``, ``scripts/test.sh``) is what CI itself runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == kind]


def block_after(heading: str, kind: str) -> str:
    text = README.read_text()
    start = text.index(heading)
    lang, body = FENCE.search(text, start).groups()  # type: ignore[union-attr]
    assert lang == kind, f"the block after {heading!r} is {lang}, not {kind}"
    return body


def commands(block: str) -> list[list[str]]:
    """The shell commands of a block: continuation lines joined, comments dropped, tokenized."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        tokens = shlex.split(line, comments=True)
        if tokens and tokens[-1] == "&":
            tokens = tokens[:-1]
        if tokens:
            out.append(tokens)
    return out


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XROUTE_", "MLFLOW_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(BIN.parent)
    return env


def run(script: str, cwd: Path, timeout: float, shell: str = "bash") -> subprocess.CompletedProcess[str]:
    args = ["bash", "-c", script] if shell == "bash" else [str(BIN / "python"), "-c", script]
    return subprocess.run(args, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_serving_walkthrough_runs_as_written(tmp_path: Path) -> None:
    block = block_after("### Serving", "bash")
    assert block.count("8080") >= 2, "the walkthrough's port moved: update this test"
    script = block.replace("8080", str(free_port()))
    r = run(script, tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r'"decision_id": "d_[0-9a-z]+"', r.stdout), r.stdout[-3000:]
    assert '"feedback_id"' in r.stdout, r.stdout[-3000:]
    assert re.search(r"exported 1 decisions \(1 with feedback\)", r.stdout), r.stdout[-3000:]
    assert (tmp_path / "reports" / "feedback").is_dir() and (tmp_path / "runs" / "router" / "keys.json").exists()


@pytest.mark.slow
def test_the_gateway_config_and_client_run_as_written(tmp_path: Path) -> None:
    """The gateway's YAML, with its servers' base URLs pointed at a vLLM-like stand-in (that wants
    the key the YAML names), served by ``xroute serve --config``; then the ``openai`` block, verbatim
    but for the port and the key it reads from the environment."""
    import secrets

    import yaml

    from tests.servers import ServerThread, start_subprocess
    from tests.vllm_standin import StandIn, StandInConfig

    text = README.read_text()
    start = text.index("### Calling your models through xroute")
    config = yaml.safe_load(re.search(r"^```yaml\n(.*?)^```", text[start:], re.S | re.M).group(1))  # type: ignore[union-attr]
    client = block_after("### Calling your models through xroute", "python")
    assert "8080" in client, "the gateway block's port moved: update this test"
    server_key = secrets.token_hex(8)
    standin = StandIn(StandInConfig(api_key=server_key))
    with ServerThread(standin) as upstream:
        for up in config["upstreams"]:
            assert up["api_key_env"] == "VLLM_API_KEY"
            up["base_urls"] = [f"{upstream}/v1" for _ in up["base_urls"]]
        config["db_path"] = str(tmp_path / "decisions.db")
        (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
        keys = tmp_path / "keys.json"
        key = subprocess.run([str(BIN / "python"), "-m", "router.control.keys", "add", "--tenant", "acme", "--keys-file",
                              str(keys)], capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        port = free_port()
        env = {**user_env(), "VLLM_API_KEY": server_key}
        proc = start_subprocess(["--config", str(tmp_path / "router.yaml"), "--keys-file", str(keys), "--model", ""],
                                env, port, tmp_path / "serve.log")
        try:
            r = subprocess.run([str(BIN / "python"), "-c", client.replace("8080", str(port))], cwd=tmp_path,
                               env={**user_env(), "XROUTE_KEY": key}, capture_output=True, text=True, timeout=120)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == " ".join(f"tok{i}" for i in range(32))  # the stand-in's 32 tokens, streamed
    assert standin.requests and standin.requests[-1]["authorization"] == f"Bearer {server_key}"


@pytest.mark.slow
def test_the_python_block_runs_as_written(tmp_path: Path) -> None:
    code = block_after("### The environment, for your own agents", "python")
    r = run(code + "\nprint('mask', int(info['action_mask'].sum()), 'of', len(info['action_mask']))\n",
            tmp_path, timeout=300, shell="python")
    assert r.returncode == 0, r.stderr[-3000:]
    valid, total = map(int, re.search(r"mask (\d+) of (\d+)", r.stdout).groups())  # type: ignore[union-attr]
    assert 0 < valid <= total


@pytest.mark.slow
def test_the_quick_evaluation_runs_as_written(tmp_path: Path) -> None:
    quick = [c for b in blocks("bash") for c in commands(b) if c[:2] == ["xroute", "evaluate"] and "--sample" in c]
    assert len(quick) == 1, "the README's quick look moved: update this test"
    r = run(shlex.join(quick[0]), tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    reports = sorted((tmp_path / "reports").glob("evaluate-*.json"))
    assert len(reports) == 1 and reports[0].with_suffix(".png").exists()
    for policy in ("greedy", "cheapest"):
        assert policy in r.stdout


def test_every_xroute_command_in_the_readme_exists_with_its_options(tmp_path: Path) -> None:
    shown = [c for b in blocks("bash") for c in commands(b) if c[0] == "xroute"]
    assert {c[1] for c in shown} >= {"evaluate", "train", "promote", "ope", "serve", "export-feedback", "telemetry"}
    for cmd in shown:
        r = subprocess.run([str(BIN / "xroute"), *cmd[1:], "--help"], cwd=tmp_path, env=user_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Usage:" in r.stdout, (shlex.join(cmd), r.stdout[-1500:], r.stderr[-1500:])
