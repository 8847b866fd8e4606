"""`python -m kvpress_c compress | ask | chat` on the embedded default model: a context compressed once, its
questions answered from the file as the pipeline answers them, a chat that saves and goes on."""
import io

import pytest

import kvpress_c
from kvpress_c.__main__ import main

CONTEXT = "Ann keeps bees in Oslo. Her cat is called Tom. Bob plays the violin in Rome.\n"


@pytest.fixture
def notes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(CONTEXT, encoding="utf-8")
    return path


def test_compress_then_ask(notes, tmp_path, capsys):
    out = tmp_path / "notes.kvc"
    assert main(["compress", str(notes), "--press", "snapkv", "--compression-ratio", "0.3", "--window-size", "8",
                 "--out", str(out)]) == 0
    assert "context tokens" in capsys.readouterr().out
    info = kvpress_c.cache_info(out)
    assert info["press"]["class"] == "SnapKVPress" and info["context"] == CONTEXT
    assert main(["ask", str(out), "What is the cat called?", "--max-new-tokens", "12"]) == 0
    answer = capsys.readouterr().out.strip()
    model = kvpress_c.load_model()  # the same model, the same file: the pipeline's answer
    assert answer == kvpress_c.Pipeline(model)(question="What is the cat called?", cache=out, max_new_tokens=12).answer


def test_chat_saves_and_goes_on(notes, tmp_path, capsys, monkeypatch):
    out = tmp_path / "notes.kvc"
    assert main(["compress", str(notes), "--out", str(out)]) == 0  # full cache
    capsys.readouterr()
    saved = tmp_path / "chat.kvc"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"What is the cat called?\n/save {saved}\nWho plays the violin?\n"))
    assert main(["chat", str(out), "--max-new-tokens", "12"]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    assert lines[1] == f"[saved to {saved}]"
    monkeypatch.setattr("sys.stdin", io.StringIO("Who plays the violin?\n/quit\n"))
    assert main(["chat", str(saved), "--max-new-tokens", "12"]) == 0
    again = capsys.readouterr().out.strip().split("\n")
    assert again == lines[2:]  # the turn after the save, from the file: the same answer


def test_errors_are_messages(tmp_path, capsys):
    assert main(["ask", str(tmp_path / "none.kvc"), "q"]) == 2
    assert "no saved cache" in capsys.readouterr().err
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(b"\x08" + b"\0" * 7 + b"{}" + b" " * 6)  # a valid, empty safetensors file
    assert main(["ask", str(bad), "q"]) == 2
    assert "not a kvpress_c cache file" in capsys.readouterr().err
