"""`m31r` CLI audit: a context overflow worded in `generate`'s own options, a `fim --file` byte offset that counts a
byte-order mark, and `m31r doctor` naming a CC that cannot be used when no other compiler is there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

M31R = [sys.executable, "-m", "m31r.cli"]


def cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*M31R, *args], capture_output=True, text=True, input=input, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_generate_overflow_names_the_options_that_fix_it(shared_daemon, tiny_engine) -> None:
    """The daemon's context_overflow says "ask for truncation", naming no option, and said so even to `--truncate`,
    where --max-tokens alone filled the context and no truncation could help: the CLI words it in its own options."""
    _, sock = shared_daemon
    ctx = tiny_engine.config.max_context
    n = len(tiny_engine.tokenizer.encode("fn main() {"))
    r = cli("generate", "fn main() {", "--max-tokens", str(ctx), "--truncate", "--no-autostart", "--socket", str(sock))
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr == (f"error: context_overflow: prompt ({n} tokens) + --max-tokens ({ctx}) = {n + ctx} exceeds the "
                        f"model's context of {ctx} tokens: --max-tokens alone fills it; lower it below {ctx} "
                        "(--truncate then keeps the prompt's end)\n")
    r = cli("generate", "fn main() {", "--max-tokens", str(ctx), "--no-autostart", "--socket", str(sock))
    assert r.returncode == 1 and f"lower it to at most {ctx - n}\n" in r.stderr and "--truncate" not in r.stderr
    # A prompt too long with room for --max-tokens: --truncate is the way out, and names itself.
    prompt = "let x = 1;\n" * 40
    n = len(tiny_engine.tokenizer.encode(prompt))
    assert n < ctx - 8
    r = cli("generate", "-", "--max-tokens", str(ctx - n + 8), "--no-autostart", "--socket", str(sock), input=prompt)
    assert r.returncode == 1 and r.stderr.endswith(
        f"lower --max-tokens to at most {ctx - n}, or shorten the prompt, or ask for truncation with --truncate (it "
        "keeps the prompt's end)\n"), r.stderr


def test_overflow_advice_wording() -> None:
    """Each way a prompt and --max-tokens can overflow gets the ways out that work for it; figures that do not
    overflow (or --truncate, which would have cut the prompt) fall back to the daemon's message."""
    from m31r.cli import overflow_advice
    from m31r_protocol.messages import OverflowDetail

    assert overflow_advice(OverflowDetail(600, 16, 512), False).endswith(
        "the prompt alone fills it; shorten the prompt, or ask for truncation with --truncate (it keeps the prompt's "
        "end)")
    assert overflow_advice(OverflowDetail(600, 16, 512), None).endswith("the prompt alone fills it; shorten the prompt")
    assert overflow_advice(OverflowDetail(600, 512, 512), False).endswith(
        "lower it below 512 and shorten the prompt (or pass --truncate)")
    assert overflow_advice(OverflowDetail(600, 16, 512), True) is None  # --truncate cuts it: not an overflow
    assert overflow_advice(OverflowDetail(100, 16, 512), False) is None


def test_fim_file_bad_byte_offset_counts_the_byte_order_mark(tmp_path: Path) -> None:
    """With a BOM, the offset of a file's first non-UTF-8 byte was counted from after it (utf-8-sig's): 3 bytes short
    of where `xxd` or `cmp` shows it. Refused before any daemon is asked (the socket path names nothing)."""
    f = tmp_path / "bom.rs"
    f.write_bytes(b"\xef\xbb\xbffn a() { \xff }\n")
    r = cli("fim", "--file", str(f), "--line", "1", "--column", "1", "--no-autostart", "--socket",
            str(tmp_path / "none.sock"))
    assert r.returncode == 1 and r.stderr == (f"error: {f} is not UTF-8 text (byte 0xff at offset 12); the model "
                                              "completes UTF-8 source\n")
    assert f.read_bytes()[12] == 0xFF


def test_doctor_names_an_unusable_cc_when_no_compiler_is_left(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """CC naming a missing program and no cc, gcc or clang on PATH: doctor said only "no C compiler ... or set CC" to
    a user who had set it, never saying what was wrong with it."""
    from m31r import doctor

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no compiler to fall back on
    monkeypatch.setenv("CC", "/nonexistent/m31r-gcc")
    check = doctor.check_compiler(None)  # type: ignore[arg-type]  # it reads no context
    assert check.level == "warn", check
    assert check.detail.startswith("no C compiler: CC=/nonexistent/m31r-gcc cannot be used (/nonexistent/m31r-gcc "
                                   "not found) and there is no cc, gcc or clang on PATH"), check.detail
    assert "the native kernels cannot be built" in check.detail and "fix CC" in check.detail
