"""`dflashkit serve`, run in-process on the tiny offline target: the app it starts, and options refused before the
model loads."""

from __future__ import annotations

import threading

import pytest

import dflashkit
from dflashkit.cli.main import main
from tests.cli.helpers import PROMPT, refused


def test_serve(loads, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dflashkit serve` loads the target and drafter as generate does and runs the app with uvicorn."""
    import openai
    import uvicorn

    from tests.live_server import LiveServer

    served: dict = {}
    original_run = uvicorn.Server.run

    def fake_run(self, sockets=None) -> None:  # the CLI's server: serve its app for real, briefly
        if self.config.port != 8123:  # LiveServer's own
            return original_run(self, sockets=sockets)
        served.update(host=self.config.host, port=self.config.port, thread=threading.current_thread())
        with LiveServer(self.config.app) as live:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
            served["models"] = [m.id for m in client.models.list().data]
            resp = client.chat.completions.create(
                model=served["models"][0], messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0
            )
            served["usage"] = resp.usage

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    rc = main(["serve", "--port", "8123", "--drafter", "untrained", "--dtype", "float32", "--max-queue", "2"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    assert served["host"] == "127.0.0.1" and served["port"] == 8123
    assert served["thread"] is not threading.main_thread()  # HTTP in a thread; this one ran the passes
    assert served["models"] == [dflashkit.DEFAULT_TARGET]
    speculative = served["usage"].model_extra["speculative"]
    assert served["usage"].completion_tokens == 5 and speculative["block_size"] == 16
    assert speculative["adaptive_block_size"]  # serve's default: --block-size auto
    assert "Serving" in err and "UNTRAINED" in err and "--tree has no effect" not in err

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # plain decoding: no tree to verify
    assert main(["serve", "--drafter", "none", "--tree", "5", "--dtype", "float32"]) == 0
    assert "--tree has no effect without a drafter" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-queue", "-1"], "max_queue"),
        (["--timeout", "-5"], "timeout"),
        (["--shutdown-timeout", "0"], "shutdown_timeout"),
        (["--proposal-temperature", "0"], "proposal temperature"),
        (["--max-batch", "0"], "max_batch"),
        (["--max-batch", "17"], "max_batch"),
        (["--stored-responses", "-1"], "stored_responses"),
        (["--api-key", " "], "api_key"),
        (["--header-timeout", "0"], "header_timeout"),
        (["--body-timeout", "-1"], "body_timeout"),
        (["--allowed-hosts", "http://x/"], "allowed_hosts"),
        (["--drafter", "no-such-drafter"], "no drafter folder 'no-such-drafter'"),
    ],
)
def test_serve_bad_options_fail_before_loading(loads, capsys, args: list[str], message: str) -> None:
    rc = main(["serve", *args])
    _, err = capsys.readouterr()
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error:") and message in err
    assert loads == []  # refused before the (slow) model load


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "70000"], "--port: must be in 0..65535, got 70000"),
        (["--block-size", "1"], "--block-size: must be at least 2"),
        (["--tree", "-1"], "--tree: must be at least 0"),
        (["--draft-window", "-1"], "--draft-window: must be at least 0"),
        (["--max-body-bytes", "0"], "--max-body-bytes: must be at least 1"),
    ],
)
def test_serve_bad_arguments_are_refused_by_the_parser(loads, capsys, args: list[str], message: str) -> None:
    assert message in refused(capsys, ["serve", *args])
    assert loads == []


def test_serve_api_keys_and_hosts(loads, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """--api-key repeats and --api-keys-file adds one key a line (else $DFLASHKIT_API_KEY); a --host that is not a
    loopback address, without --allowed-hosts, allows any host and says so; the HTTP protocol gets the limits."""
    import dflashkit.server.lifecycle

    served: dict = {}

    def fake_serve(app, compute, host, port, log_level, **options) -> int:
        served.update(settings=app.state.service.settings, options=options)
        return 0

    monkeypatch.setattr(dflashkit.server.lifecycle, "serve", fake_serve)
    monkeypatch.delenv("DFLASHKIT_API_KEY", raising=False)
    keys = tmp_path / "keys.txt"
    keys.write_text("# one key per client\nkey-b\n\n  key-c  \n")
    base = ["serve", "--drafter", "none", "--dtype", "float32"]
    args = ["--api-key", "key-a", "--api-key", "key-x", "--api-keys-file", str(keys), "--host", "0.0.0.0"]
    assert main([*base, *args, "--header-timeout", "3"]) == 0
    settings = served["settings"]
    assert settings.api_keys == ["key-a", "key-x", "key-b", "key-c"] and settings.allowed_hosts == ["*"]
    assert "the Host check is off" in capsys.readouterr().err
    assert served["options"]["http"].header_timeout == 3 and served["options"]["h11_max_incomplete_event_size"] > 0

    monkeypatch.setenv("DFLASHKIT_API_KEY", "env-key")
    assert main([*base, "--allowed-hosts", "api.example, localhost"]) == 0
    assert served["settings"].api_keys == ["env-key"]
    assert served["settings"].allowed_hosts == ["api.example", "localhost"]
    assert "Host check" not in capsys.readouterr().err
    assert main(base) == 0 and served["settings"].allowed_hosts is None  # 127.0.0.1: loopback names only


@pytest.mark.parametrize(
    "content,message",
    [(None, "--api-keys-file: cannot read"), ("# none yet\n\n", "holds no keys")],
)
def test_serve_refuses_a_keys_file_without_keys_before_loading(loads, capsys, tmp_path, content, message) -> None:
    path = tmp_path / "keys.txt"
    if content is not None:
        path.write_text(content)
    rc = main(["serve", "--api-keys-file", str(path)])
    assert rc == 2 and message in capsys.readouterr().err
    assert loads == []
