"""Bundles from a colleague, a USB stick, a half-finished copy: every hostile or broken file is refused in one line
naming the file, by the loader, `m31r doctor` and the daemon's start, before torch allocates what the file describes,
and nothing is written into the bundle. Each case failed (a traceback, a wrong or unnamed message, a hang, an
allocation of gigabytes) before the fix it comes with."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from m31r.bundle import Bundle, BundleError, open_bundle, safetensors_header, sha256_file
from m31r.checksums import CHECKSUM_FILE, CONTENT_FILES
from m31r.cli import main
from m31r.config import load_config

ST = "model.safetensors"
# The daemons under test run with this much address space: a refusal that regressed fails the test with torch's
# allocation error instead of taking the machine's memory (torch and the tiny model need well under 1 GiB).
DAEMON_AS_LIMIT = 6 << 30


# -- helpers ------------------------------------------------------------------------------------------------------


def _reseal(d: Path) -> None:
    """Make metadata.json and checksum.txt describe the files as they now are, as a careful forger would: the fault
    must be found by what it is, not by a hash that no longer matches."""
    meta = json.loads((d / "metadata.json").read_text())
    with contextlib.suppress(ValueError):  # a config that does not load: that is what the test expects named
        meta["config_hash"] = load_config(d / "config.yaml").config_hash()
    meta["tokenizer_hash"] = sha256_file(d / "tokenizer.json")
    (d / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n")
    _sums(d)


def _sums(d: Path) -> None:
    (d / CHECKSUM_FILE).write_text("".join(f"{sha256_file(d / n)}  {n}\n" for n in CONTENT_FILES))


def _listing(d: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.lstat().st_size, p.lstat().st_mtime_ns) for p in d.iterdir()}


def _header(d: Path) -> tuple[dict, bytes]:
    raw = (d / ST).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_st(d: Path, header_json: bytes, data: bytes) -> None:
    (d / ST).write_bytes(struct.pack("<Q", len(header_json)) + header_json + data)


def _first_tensor(h: dict) -> str:
    return next(k for k in h if k != "__metadata__")


def _refused(d: Path, name: str, expected: str) -> str:
    """open_bundle refuses `d` in one line that starts with the file's path and says `expected`; `d` is unchanged."""
    before = _listing(d)
    with pytest.raises(BundleError) as e:
        open_bundle(d)
    msg = str(e.value)
    assert msg.startswith(f"{d / name}:") and expected in msg and "\n" not in msg, msg
    assert _listing(d) == before
    return msg


@pytest.fixture
def copy(tiny_bundle: Bundle, tmp_path: Path) -> Path:
    d = tmp_path / "bundle from a stick"  # a space in the folder's name, as copies often have
    shutil.copytree(tiny_bundle.path, d)
    return d


def _set(key: str, value: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        lines = [f"{key}: {value}" if line.startswith(f"{key}:") else line for line in text.splitlines()]
        return "\n".join(lines) + "\n"
    return edit


# -- model.safetensors --------------------------------------------------------------------------------------------


def _dtype_not_a_string(d: Path) -> None:
    h, data = _header(d)
    h[_first_tensor(h)]["dtype"] = ["F32"]
    _write_st(d, json.dumps(h).encode(), data)


def _deep_header(d: Path) -> None:
    _write_st(d, b"[" * 100_000 + b"]" * 100_000, b"")


def _duplicate_name(d: Path) -> None:
    h, data = _header(d)
    k = _first_tensor(h)
    raw = json.dumps(h).encode()
    _write_st(d, raw[:-1] + b", " + json.dumps({k: h[k]})[1:-1].encode() + b"}", data)


def _metadata_not_strings(d: Path) -> None:
    h, data = _header(d)
    h["__metadata__"] = 5
    _write_st(d, json.dumps(h).encode(), data)


@pytest.mark.parametrize(("fault", "expected"), [
    (_dtype_not_a_string, "unsupported dtype ['F32']"),  # was TypeError: unhashable type: 'list'
    (_deep_header, "nested too deeply"),  # was RecursionError
    (_duplicate_name, "appears twice"),  # json kept the last entry silently
    (_metadata_not_strings, "__metadata__ must map names to strings"),  # the safetensors library refuses it
])
def test_weights_header_faults_name_the_file(copy: Path, fault: Callable[[Path], None], expected: str) -> None:
    fault(copy)
    _reseal(copy)
    _refused(copy, ST, expected)


def test_a_header_past_the_safetensors_limit_is_not_read(tmp_path: Path) -> None:
    """A header length of 200 MB in a file that long (sparse here) was read into memory and parsed."""
    f = tmp_path / ST
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", 200_000_000) + b"{")
        fh.truncate(200_000_100)
    with pytest.raises(BundleError, match=r"over the 100,000,000 bytes safetensors allows"):
        safetensors_header(f)


# -- config.yaml --------------------------------------------------------------------------------------------------


def _bomb(text: str) -> str:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        p, c = chr(96 + i), chr(97 + i)
        lines.append(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]")
    return "\n".join(lines) + "\n" + text


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda t: "x: " + "[" * 5000 + "]" * 5000 + "\n" + t, "nested too deeply"),  # was RecursionError
    (_set("n_layers", "9" * 5000), "not a valid value"),  # was ValueError (int's digit limit), unnamed
    (_bomb, "anchors and aliases are not supported"),
    (lambda t: t + "n_layers: 3\n", "key `n_layers` appears twice"),  # the last one silently won
    (lambda t: t + "#" + "x" * (1 << 20) + "\n", "over 1 MiB"),  # a 300 MB file took minutes to parse
    (_set("fim_suffix_token", "'<|fim_prefix|>'"), "`fim_suffix_token` and `fim_prefix_token` are both"),
    (lambda t: "{{{: [\n", "(line 1, column 4)"),  # PyYAML's message quoted the source over four lines
])
def test_config_faults_name_the_file(copy: Path, edit: Callable[[str], str], expected: str) -> None:
    (copy / "config.yaml").write_text(edit((copy / "config.yaml").read_text()))
    _reseal(copy)
    _refused(copy, "config.yaml", expected)


def test_more_layers_than_the_file_has_tensors_is_refused_at_once(copy: Path) -> None:
    """Every expected tensor name was listed first: 10^9 layers ran for minutes, then out of memory."""
    (copy / "config.yaml").write_text(_set("n_layers", "100000")((copy / "config.yaml").read_text()))
    _reseal(copy)
    _refused(copy, ST, "config.yaml has n_layers 100,000 but the file holds 14 tensors")


def test_a_context_the_machine_cannot_hold_is_refused_before_loading(copy: Path) -> None:
    """max_context 10^9 passed every check, and the daemon then asked torch for 8 GB, then hundreds more."""
    (copy / "config.yaml").write_text(_set("max_context", str(10**9))((copy / "config.yaml").read_text()))
    _reseal(copy)
    _refused(copy, "config.yaml", "max_context 1,000,000,000 needs")


# -- tokenizer.json, metadata.json ----------------------------------------------------------------------------------


def test_fim_tokens_sharing_an_id_are_refused(copy: Path) -> None:
    j = json.loads((copy / "tokenizer.json").read_text())
    prefix = j["model"]["vocab"]["<|fim_prefix|>"]
    j["model"]["vocab"]["<|fim_middle|>"] = prefix
    for a in j["added_tokens"]:
        if a["content"] == "<|fim_middle|>":
            a["id"] = prefix
    (copy / "tokenizer.json").write_text(json.dumps(j))
    _reseal(copy)
    _refused(copy, "tokenizer.json", f"have one id, {prefix}")


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda m: json.dumps(m)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    (lambda m: json.dumps({**m, "junk": "x" * (17 << 20)}), "over 16 MiB"),
    (lambda m: json.dumps({**m, "format_version": 2}), "format_version 2, but this m31r reads bundles of format 1"),
])
def test_metadata_faults_name_the_file(copy: Path, edit: Callable[[dict], str], expected: str) -> None:
    (copy / "metadata.json").write_text(edit(json.loads((copy / "metadata.json").read_text())))
    _sums(copy)
    _refused(copy, "metadata.json", expected)


# -- checksum.txt -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit", [
    lambda b: b"".join(line[:64].upper() + line[64:] for line in b.splitlines(keepends=True)),  # upper-case hex
    lambda b: b"\xef\xbb\xbf" + b,  # a byte-order mark (Notepad)
    lambda b: b"\n" + b.replace(b"\n", b"\r\n\r\n"),  # blank lines, CRLF
    lambda b: b.replace(b"  ", b" *"),  # sha256sum's binary marker
], ids=["upper-hex", "bom", "blank-crlf", "binary"])
def test_checksum_files_that_sha256sum_reads_are_accepted(copy: Path, edit: Callable[[bytes], bytes]) -> None:
    f = copy / CHECKSUM_FILE
    f.write_bytes(edit(f.read_bytes()))
    open_bundle(copy)


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda b: b + b"0" * 64 + b"  model.safetensors\n", "line 5 lists model.safetensors a second time"),
    (lambda b: b + b"x" * (1 << 20), "over 64 KiB"),  # was read whole, however large
    (lambda b: b.replace(b"  config.yaml", b"  config .yaml"), "lists config .yaml,"),  # was "line 3 is not ..."
])
def test_checksum_faults_name_the_file(copy: Path, edit: Callable[[bytes], bytes], expected: str) -> None:
    f = copy / CHECKSUM_FILE
    f.write_bytes(edit(f.read_bytes()))
    _refused(copy, CHECKSUM_FILE, expected)


def test_a_bundle_path_that_cannot_be_searched_is_one_line(tmp_path: Path) -> None:
    """What pathlib raises for a folder without search permission (or a name too long) instead of answering False
    was a traceback from the daemon's start; as root, a name too long is the way to get it."""
    with pytest.raises(BundleError, match="cannot be read"):
        open_bundle(tmp_path / ("a" * 300))


# -- the daemon's start and doctor ----------------------------------------------------------------------------------


def _daemon(bundle: Path) -> tuple[int, str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (DAEMON_AS_LIMIT, DAEMON_AS_LIMIT))

    with tempfile.TemporaryDirectory() as run:
        os.chmod(run, 0o700)
        r = subprocess.run([sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(bundle), "--socket",
                            str(Path(run) / "m31rd.sock"), "--threads", "1", "--log-level", "error"],
                           capture_output=True, text=True, timeout=120, preexec_fn=limit,
                           env={**os.environ, "M31R_SOCKET": str(Path(run) / "m31rd.sock")})
        assert not (Path(run) / "m31rd.sock").exists()
    return r.returncode, r.stderr


@pytest.mark.parametrize(("fault", "name", "expected"), [
    ("context", "config.yaml", "max_context 1,000,000,000 needs"),  # was torch's "can't allocate 8000000000 bytes"
    ("dtype", ST, "unsupported dtype"),  # was "TypeError: unhashable type: 'list'"
    ("search", None, "cannot be read"),  # was a traceback
])
def test_the_daemon_refuses_in_one_line_naming_the_file(copy: Path, fault: str, name: str | None,
                                                        expected: str) -> None:
    if fault == "context":
        (copy / "config.yaml").write_text(_set("max_context", str(10**9))((copy / "config.yaml").read_text()))
    elif fault == "dtype":
        _dtype_not_a_string(copy)
    _reseal(copy)
    bundle = copy.parent / ("a" * 300) if fault == "search" else copy
    before = _listing(copy)
    code, err = _daemon(bundle)
    lines = [line for line in err.splitlines() if line.startswith("m31rd:")]
    assert code == 1 and "Traceback" not in err and "allocate" not in err, err
    assert len(lines) == 1 and lines[0].startswith("m31rd: cannot load the model: "), err
    assert expected in lines[0] and str(bundle / name if name else bundle) in lines[0], err
    assert _listing(copy) == before


@pytest.mark.parametrize("fault", ["context", "deep-metadata"])
def test_doctor_fails_the_bundle_naming_the_file(copy: Path, fault: str, tmp_path: Path) -> None:
    if fault == "context":
        (copy / "config.yaml").write_text(_set("max_context", str(10**9))((copy / "config.yaml").read_text()))
        _reseal(copy)
        name, expected = "config.yaml", "max_context 1,000,000,000 needs"
    else:
        meta = (copy / "metadata.json").read_text().rstrip()
        (copy / "metadata.json").write_text(meta[:-1] + ', "d": ' + "[" * 100_000 + "]" * 100_000 + "}")
        _sums(copy)
        name, expected = "metadata.json", "nested too deeply"  # was "the check itself failed: RecursionError"
    before = _listing(copy)
    r = CliRunner().invoke(main, ["doctor", "--bundle", str(copy), "--socket", str(tmp_path / "s.sock"), "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 1, r.output
    (check,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "bundle"]
    assert check["level"] == "fail" and f"{copy / name}: " in check["detail"] and expected in check["detail"], check
    assert _listing(copy) == before
