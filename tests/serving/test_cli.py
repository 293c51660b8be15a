"""``pdkv up`` as a user runs it: prints where the router listens and every metrics address, serves
``pdkv health`` and ``pdkv generate --server``, stops every child on SIGTERM (no orphans), and configures
every child from one config file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.serving.helpers import pdkv_model, wait_until

PDKV = [sys.executable, "-m", "pdkv"]


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def printed_metrics(lines: list[str]) -> dict[str, str]:
    """``pdkv up: metrics of NAME on URL`` lines -> {NAME: URL}."""
    return {l.split()[4]: l.split()[6] for l in list(lines) if l.startswith("pdkv up: metrics of ")}


def test_pdkv_up_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [
            *PDKV,
            "up",
            "--router-address",
            "127.0.0.1:0",
            "--kv-store",
            "none",
            "--model",
            pdkv_model(),
            "--node-args",
            "--num-blocks 256 --device cpu",
            "--metrics-ports",
            "any",  # free ports: another cluster may run on this host (the default is the fixed ones)
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        line = wait_until(
            lambda: (
                next((l for l in lines if "router listening on" in l), None)
                or (up.poll() is not None and "exited")
            ),
            timeout=120,
            what="pdkv up to print the router's address",
        )
        assert line != "exited", up.stderr.read() if up.stderr else ""
        address = line.rsplit(" ", 1)[1].strip()
        every = {"router", "prefill-0", "decode-0"}
        metrics = wait_until(
            lambda: (m := printed_metrics(lines)).keys() == every and m,
            timeout=10,
            what="pdkv up to print every metrics address",
        )
        with urllib.request.urlopen(metrics["router"], timeout=10) as response:
            assert 'model_name="' in response.read().decode()
        children = children_of(up.pid)
        assert len(children) == 3  # prefill, decode, router (no store: --kv-store none)

        health = subprocess.run([*PDKV, "health", address], capture_output=True, text=True, timeout=60)
        assert health.returncode == 0 and health.stdout.strip() == "SERVING"
        gen = subprocess.run(
            [*PDKV, "generate", "--server", address, "--max-tokens", "5", "Hello"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gen.returncode == 0, gen.stderr
        assert "output_tokens=5" in gen.stderr and "finish_reason=length" in gen.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        wait_until(lambda: not any(alive(pid) for pid in children), timeout=10, what="every child to exit")
        down = subprocess.run(
            [*PDKV, "health", address, "--timeout", "1"], capture_output=True, text=True, timeout=60
        )
        assert down.returncode == 1 and down.stdout.startswith("UNREACHABLE")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)


def http(
    url: str, key: str | None = None, body: dict[str, object] | None = None
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET (or a POST of ``body``) to the router's OpenAI API."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_pdkv_up_configures_every_child_from_one_file(tmp_path: Path) -> None:
    """One TOML file: pdkv up's own options ([up]), the nodes' ([node]) and the router's ([router]);
    pdkv up passes the served name, the context and the API keys file on; a node's variable reaches
    the nodes over [node].  (pdkv up's own $PDKV_PREFILL, a count, is refused in colocated mode:
    tests/serving/test_settings.py.)"""
    key = "sk-config-file-0123456789"
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[tenants.acme]\nkeys = ["{key}"]\n')
    config = tmp_path / "cluster.toml"
    config.write_text(
        "[up]\n"
        'mode = "colocated"\n'
        'kv-store = "none"\n'
        'router-address = "127.0.0.1:0"\n'
        "http-port = 0\n"
        'metrics-ports = "any"\n'
        f'model = "{pdkv_model()}"\n'
        'served-model-name = "smol"\n'
        "max-model-len = 128\n"
        f'api-keys-file = "{keys}"\n'
        "[node]\n"
        "num-blocks = 300\n"
        'device = "cpu"\n'
        "[router]\n"
        "max-tokens-limit = 5\n"
    )
    env = dict(os.environ, PDKV_NUM_BLOCKS="320")
    up = subprocess.Popen(
        [*PDKV, "up", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        metrics = wait_until(
            lambda: (
                ((m := printed_metrics(lines)).keys() == {"router", "colocated-0"} and m)
                or (up.poll() is not None and {"exited": ""})
            ),
            timeout=120,
            what="pdkv up to print every metrics address",
        )
        assert "exited" not in metrics, up.stderr.read() if up.stderr else ""
        api = next(l.split()[-1].strip() for l in lines if "OpenAI API on " in l)
        assert http(f"{api}/models")[0] == 401  # the keys file reached the router
        status, models = http(f"{api}/models", key)
        assert (
            status == 200 and models["data"][0]["id"] == "smol" and models["data"][0]["max_model_len"] == 128
        )
        status, refused = http(
            f"{api}/completions", key, {"model": "smol", "prompt": "Hello", "max_tokens": 10}
        )
        assert status == 400 and "max_tokens_limit 5" in refused["error"]["message"], refused  # [router]
        status, done = http(f"{api}/completions", key, {"model": "smol", "prompt": "Hello", "max_tokens": 3})
        assert status == 200 and done["usage"]["completion_tokens"] == 3
        with urllib.request.urlopen(metrics["colocated-0"], timeout=10) as response:
            node = response.read().decode()
        assert 'pdkv_kv_cache_blocks{model_name="smol"} 320.0' in node  # $PDKV_NUM_BLOCKS over [node]
        with urllib.request.urlopen(metrics["router"], timeout=10) as response:
            assert 'model_name="smol"' in response.read().decode()
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--server", "127.0.0.1:1", "--model", "/x"], "--model: local generation only"),
        (
            ["--server", "127.0.0.1:1", "--dtype", "float32", "--block-size", "7"],
            "--dtype, --block-size: local",
        ),
        (["--system", "be brief"], "--system is a system message of a chat: add --chat"),
        (["--cache-salt", "t", "--timeout", "3"], "--cache-salt, --timeout: only with --server"),
    ],
)
def test_generate_refuses_an_option_its_mode_does_not_read(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside probe's find: with --server the local engine's options were accepted and ignored (a user
    could believe another model ran), --system without --chat dropped, --cache-salt / --timeout ignored
    locally.  Each is refused by name before anything runs (rc 2, one line on stderr)."""
    from pdkv.cli import main

    assert main(["generate", *argv, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdkv generate: error: ") and says in err and err.count("\n") == 1, err


def test_generate_with_server_reads_past_a_model_the_environment_sets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """deploy/'s containers set $PDKV_MODEL for every service: `pdkv generate --server` inside one is not
    refused for it (only a flag on its own command line is); here it goes on to the (absent) router."""
    from pdkv.cli import main

    monkeypatch.setenv("PDKV_MODEL", "/models/x.gguf")
    assert main(["generate", "--server", "127.0.0.1:1", "--timeout", "5", "hi"]) == 1
    captured = capsys.readouterr()
    assert "UNAVAILABLE" in captured.err and "--model" not in captured.err and captured.out == ""


def test_pdkv_up_refuses_a_bad_model_first_and_keeps_the_log_a_failed_child_names(tmp_path: Path) -> None:
    """An outside probe: pdkv up started the store and the nodes for a file that is no model, failing
    seconds later; and a child that failed to start was reported with a log path pdkv up had deleted."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK not a model")
    ports = ["--http-port", "none", "--router-address", "127.0.0.1:0", "--metrics-ports", "none"]
    first = subprocess.run(
        [*PDKV, "up", "--model", str(bad), *ports], capture_output=True, text=True, timeout=60
    )
    assert first.returncode == 2 and "not a GGUF file" in first.stderr and "starting" not in first.stderr
    # A node that cannot start (its KV cache holds less than the length asked for), found only by it:
    failed = subprocess.run(
        [
            *PDKV, "up", "--model", str(pdkv_model()), "--kv-store", "none", *ports,
            "--node-args", "--num-blocks 2 --max-model-len 256",
        ],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert failed.returncode == 1 and "Traceback" not in failed.stderr.split("its log")[0], failed.stderr
    log = Path(failed.stderr.split("its log (")[1].split(")")[0])
    assert log.is_file() and "more than the KV cache holds" in log.read_text()
    assert [p.suffix for p in log.parent.iterdir()] == [".log"] * len(list(log.parent.iterdir()))
    shutil.rmtree(log.parent)


def test_an_address_in_use_or_malformed_is_one_line_for_every_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside probe: a taken port gave a 26-line traceback in every server command (grpcio raises
    where a 0 return was handled; /metrics, HTTP and ZeroMQ binds were not handled at all), and the
    store's --bind took port 99999 as 34463, and refused a malformed one as a security risk."""
    import socket

    from pdkv.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    router = ["serve-router", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--metrics-address"]
    store = ["kvstore", "serve", "--kv-store", "cpu:1MiB", "--metrics-address"]
    started = {  # each in a process of its own: the binds that fail come after servers start
        "gRPC": ([*router, "none", "--address", f"127.0.0.1:{port}"], "the address is in use"),
        "metrics": ([*router, f"127.0.0.1:{port}", "--address", "127.0.0.1:0"], "for /metrics"),
        "http": (
            [*router, "none", "--address", "127.0.0.1:0", "--http-address", f"127.0.0.1:{port}"],
            "for HTTP",
        ),
        "zmq": ([*store, "none", "--bind", f"tcp://127.0.0.1:{port}"], "Address already in use"),
    }
    refused = {  # refused before anything serves: in this process
        "port": ([*store, "none", "--bind", "tcp://127.0.0.1:99999"], 2, "tcp://HOST:PORT (port 0-65535"),
        "form": ([*store, "none", "--bind", "nonsense"], 2, "must be a ZeroMQ endpoint"),
        "no scheme": ([*store, "none", "--bind", "127.0.0.1:5555", "--insecure"], 2, "ZeroMQ endpoint"),
        "no folder": ([*store, "none", "--bind", f"ipc://{tmp_path}/none/s"], 1, "cannot listen on ipc://"),
        # the store's socket is up when its /metrics bind fails: closed again (it was left open)
        "metrics": ([*store, f"127.0.0.1:{port}", "--bind", f"ipc://{tmp_path}/s"], 1, "for /metrics"),
    }
    try:
        for name, (args, said) in started.items():
            done = subprocess.run([*PDKV, *args], capture_output=True, text=True, timeout=60)
            assert done.returncode == 1, (name, done.stderr)
            assert said in done.stderr and "Traceback" not in done.stderr, (name, done.stderr)
            assert f"pdkv {args[0]}: error: " in done.stderr, (name, done.stderr)
        for name, (args, code, said) in refused.items():
            assert main(args) == code, name
            err = capsys.readouterr().err
            assert said in err and f"pdkv {args[0]}: error: " in err, (name, err)
    finally:
        taken.close()
