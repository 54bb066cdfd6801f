"""`m31r bundle` used wrongly: every mistake is one line (exit 2 for a bad argument, 1 for a failure), and nothing
is lost or left half-written, whatever the command was told or whatever stopped it."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from m31r.bundle import CHECKSUM_FILE, CONTENT_FILES, Bundle, BundleError, init_bundle, open_bundle, sha256_file
from m31r.cli import main

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "model" / "tiny.yaml"


def _run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, ["bundle", *args])
    return r.exit_code, r.stdout, r.stderr


def _one_error_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("error: ")


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


@pytest.fixture
def pair(tiny_config, tmp_path: Path) -> tuple[Bundle, Bundle]:
    return (init_bundle(tiny_config, tmp_path / "a", seed=1, dtype=torch.float32),
            init_bundle(tiny_config, tmp_path / "b", seed=2, dtype=torch.float32))


def _tiny_yaml(tmp_path: Path, old: str, new: str) -> Path:
    f = tmp_path / f"cfg-{len(list(tmp_path.glob('cfg-*')))}.yaml"
    f.write_text(TINY.read_text().replace(old, new))
    return f


# -- usage errors are exit 2, before anything is read or written ------------------------------------------------


@pytest.mark.parametrize(("extra", "expected"), [
    (["--weights", "1,x"], "'1,x' is not numbers separated by commas"),
    (["--weights", ""], "empty"),
    (["--weights", "1"], "1 weight for 2 bundles"),
    (["--weights", "1,2,3"], "3 weights for 2 bundles"),
    (["--weights", "1,-1"], "non-negative"),
    (["--weights", "0,0"], "at least one above 0"),
    (["--weights", "nan,1"], "finite"),
    (["--model-version", ""], "must not be empty"),
])
def test_average_argument_mistakes_are_usage_errors(pair, tmp_path: Path, extra: list[str], expected: str) -> None:
    """They were exit 1 (and an empty --model-version was reported against the metadata.json of a bundle that had
    been written in full, then deleted)."""
    a, b = pair
    out = tmp_path / "avg"
    args = ["average", str(a.path), str(b.path), "--out", str(out), "--model-version", "x", *extra]
    code, stdout, err = _run(*args)
    assert code == 2 and stdout == "", err
    assert expected in err and "Invalid value for" in err, err
    assert not out.exists()


def test_average_of_one_bundle_is_a_usage_error(pair, tmp_path: Path) -> None:
    code, _, err = _run("average", str(pair[0].path), "--out", str(tmp_path / "avg"), "--model-version", "x")
    assert code == 2 and "two or more bundles, got 1" in err, err
    assert not (tmp_path / "avg").exists()


def test_group_size_with_int8_is_a_usage_error(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """int8 has one scale per output channel: `--quant int8 --group-size 32` silently wrote a plain int8 bundle."""
    code, _, err = _run("quantize", str(tiny_bundle.path), str(tmp_path / "q"), "--quant", "int8", "--group-size", "32")
    assert code == 2 and "--group-size" in err and "int4 only" in err, err
    assert not (tmp_path / "q").exists()
    assert _run("quantize", str(tiny_bundle.path), str(tmp_path / "q"), "--quant", "int8")[0] == 0  # the default


def test_int4_group_that_does_not_tile_the_model_names_the_sizes_that_do(tmp_path: Path) -> None:
    src = tmp_path / "src"
    assert _run("init", str(_tiny_yaml(tmp_path, "ffn_hidden: 128", "ffn_hidden: 96")), str(src), "--seed", "1")[0] == 0
    code, _, err = _run("quantize", str(src), str(tmp_path / "q"), "--quant", "int4", "--group-size", "64")
    assert code == 1 and _one_error_line(err), err
    assert f"{src}: " in err and "K=96" in err and "--group-size 32" in err, err
    assert not (tmp_path / "q").exists()
    assert _run("quantize", str(src), str(tmp_path / "q"), "--quant", "int4", "--group-size", "32")[0] == 0


# -- the output never lands in a source --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["quantize", "export-hf", "average"])
def test_out_inside_a_source_bundle_is_refused(pair, command: str) -> None:
    """A bundle is exactly its five files: OUT inside SRC wrote a sixth entry into the source (release/ too)."""
    a, b = pair
    before = _listing(a.path)
    for out in (a.path / "sub", a.path / "sub" / "deeper"):
        args = {"quantize": ["quantize", str(a.path), str(out), "--quant", "int8"],
                "export-hf": ["export-hf", str(a.path), str(out)],
                "average": ["average", str(b.path), str(a.path), "--out", str(out), "--model-version", "x"]}[command]
        code, _, err = _run(*args)
        assert code == 1 and _one_error_line(err) and f"inside the source bundle {a.path}" in err, err
        assert _listing(a.path) == before
    open_bundle(a.path)


# -- failures while writing: one line, nothing left ---------------------------------------------------------------


def test_a_full_disk_is_one_line_naming_the_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write() on a full disk raises an OSError without a file name: it read `error: [Errno 28] No space left on
    device`, naming nothing."""
    import m31r.bundle

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(m31r.bundle, "save_aligned", full)
    out = tmp_path / "out"
    code, _, err = _run("init", str(TINY), str(out), "--seed", "1")
    assert code == 1 and err == f"error: {out}: cannot write the bundle: {os.strerror(errno.ENOSPC)}\n", err
    assert not out.exists()


def test_export_hf_on_a_full_disk_is_one_line(tiny_bundle: Bundle, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors' writer raises its own SafetensorError: it ended `export-hf` with a traceback."""
    from safetensors import SafetensorError

    import m31r.hf_export

    def full(*args: object, **kwargs: object) -> None:
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(m31r.hf_export, "save_file", full)
    out = tmp_path / "hf"
    r = CliRunner().invoke(main, ["bundle", "export-hf", str(tiny_bundle.path), str(out)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert _one_error_line(r.stderr) and f"{out / 'model.safetensors'}: cannot write" in r.stderr, r.stderr
    assert "No space left on device" in r.stderr and not out.exists()


def test_a_model_too_big_for_memory_is_one_line(tmp_path: Path) -> None:
    """A typo in a config's size (here 10**15 hidden units) ended `init` with torch's allocator traceback. Now the
    config is refused before anything is built: its float32 weights exceed the machine's memory."""
    out = tmp_path / "out"
    cfg = _tiny_yaml(tmp_path, "ffn_hidden: 128", "ffn_hidden: 1000000000000000")
    code, _, err = _run("init", str(cfg), str(out), "--seed", "1")
    assert code == 1 and _one_error_line(err), err
    assert f"{cfg}: the model has " in err and "GiB, more than this machine's" in err, err
    assert not out.exists()


_KILL_MID_WRITE = """
import os, signal, sys
import m31r.bundle
real = m31r.bundle.save_aligned
def save_then_terminated(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # `timeout`, a service manager, a closed session
m31r.bundle.save_aligned = save_then_terminated
from m31r.cli import main
sys.argv = ["m31r", "bundle", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("existing", [False, True])
def test_sigterm_mid_write_leaves_nothing(tmp_path: Path, existing: bool) -> None:
    """SIGTERM killed the writer with model.safetensors written and no checksum.txt: the folder never verified, but
    a re-run was refused (`already exists and is not an empty directory`) until the user removed it by hand."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    p = subprocess.run([sys.executable, "-c", _KILL_MID_WRITE, "init", str(TINY), str(out), "--seed", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, p.stderr)
    assert p.stdout == "" and _one_error_line(p.stderr) and "terminated" in p.stderr, p.stderr
    assert (list(out.iterdir()) == []) if existing else not out.exists()


# -- configs that cannot make a model are named before anything is written ---------------------------------------


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("rope_theta: 10000.0", "rope_theta: .nan", "rope_theta"),
    ("norm_eps: 1.0e-5", "norm_eps: .inf", "norm_eps"),
    ("name: m31r-tiny", 'name: ""', "`name` must not be empty"),
])
def test_config_that_cannot_make_a_model_is_named(tmp_path: Path, old: str, new: str, expected: str) -> None:
    """A nan rope_theta wrote (and verified) a model that computes NaN; an empty name was blamed on the output's
    metadata.json."""
    cfg = _tiny_yaml(tmp_path, old, new)
    out = tmp_path / "out"
    code, _, err = _run("init", str(cfg), str(out), "--seed", "1")
    assert code == 1 and _one_error_line(err) and err.startswith(f"error: {cfg}: ") and expected in err, err
    assert not out.exists()


def test_config_that_is_not_utf8_is_named(bundle_copy: Path) -> None:
    cfg = bundle_copy / "config.yaml"
    cfg.write_bytes(cfg.read_bytes() + b"\xff\xfe\n")
    (bundle_copy / CHECKSUM_FILE).write_text("".join(f"{sha256_file(bundle_copy / n)}  {n}\n" for n in CONTENT_FILES))
    code, _, err = _run("verify", str(bundle_copy))
    assert code == 1 and err.startswith(f"error: {cfg}: not UTF-8 text") and _one_error_line(err), err


@pytest.fixture
def bundle_copy(tiny_bundle: Bundle, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tiny_bundle.path, tmp_path / "bundle"))


# -- a folder of the other kind is named as such --------------------------------------------------------------------


def test_a_checkpoint_is_not_a_bundle_and_a_bundle_not_a_checkpoint(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """export-hf's output given to verify (or quantize) was told to `restore the bundle`; a bundle given to import-hf
    was told it lacked config.json."""
    hf = tmp_path / "hf"
    assert _run("export-hf", str(tiny_bundle.path), str(hf))[0] == 0
    code, _, err = _run("verify", str(hf))
    assert code == 1 and _one_error_line(err) and f"{hf}: not a bundle directory" in err and "import-hf" in err, err
    assert "restore" not in err
    code, _, err = _run("import-hf", str(tiny_bundle.path), str(tmp_path / "x"))
    assert code == 1 and _one_error_line(err) and f"{tiny_bundle.path}: an m31r bundle" in err, err
    assert not (tmp_path / "x").exists()


def test_an_interrupted_export_is_not_a_checkpoint(tiny_bundle: Bundle, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json is what makes a folder a checkpoint: written before tokenizer_config.json, an export killed
    between the two imported with another end token (import-hf falls back to <|endoftext|>)."""
    import m31r.hf_export
    from m31r.hf_import import import_hf

    def killed(*args: object) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setattr(m31r.hf_export, "tokenizer_config", killed)
    out = tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        m31r.hf_export.export_hf(tiny_bundle, out)
    with pytest.raises(BundleError, match="config.json: missing"):
        import_hf(out, tmp_path / "bundle")


def test_a_checkpoint_imported_as_dot_is_named_after_its_folder(tiny_bundle: Bundle, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle's name is the checkpoint folder's: `import-hf .` (run inside it) took the name of `.`, which is
    empty, and was refused as "config.json: config.json: `name` must not be empty", a field config.json lacks."""
    hf = tmp_path / "my-checkpoint"
    assert _run("export-hf", str(tiny_bundle.path), str(hf))[0] == 0
    monkeypatch.chdir(hf)
    code, _, err = _run("import-hf", ".", str(tmp_path / "back"))
    assert code == 0, err
    assert open_bundle(tmp_path / "back").config.name == "my-checkpoint"


def test_a_checkpoint_config_that_cannot_make_a_model_is_named_once(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """A nan rms_norm_eps in config.json is refused naming the file once (it was `config.json: config.json: ...`)."""
    import json

    hf = tmp_path / "hf"
    assert _run("export-hf", str(tiny_bundle.path), str(hf))[0] == 0
    (hf / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()),
                                                "rms_norm_eps": float("nan")}))
    code, _, err = _run("import-hf", str(hf), str(tmp_path / "back"))
    assert code == 1 and _one_error_line(err), err
    assert err == f"error: {hf / 'config.json'}: `norm_eps` must be a finite number above 0, got nan\n", err
    assert not (tmp_path / "back").exists()


# -- a writer killed outright: its leftover is named, and the same command replaces it -----------------------------

_PAUSE_MID_WRITE = """
import os, signal, sys, time
import m31r.bundle
real = m31r.bundle.save_aligned
def save_then_wait(*args, **kwargs):
    real(*args, **kwargs)
    print("written", flush=True)
    time.sleep(600)  # killed here, as the OOM killer or `kill -9` would
m31r.bundle.save_aligned = save_then_wait
from m31r.cli import main
sys.argv = ["m31r", "bundle", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("command", ["init", "import-hf"])
def test_a_writer_killed_outright_leaves_nothing_that_blocks_a_rerun(tiny_bundle: Bundle, tmp_path: Path,
                                                                     command: str) -> None:
    """SIGKILL (the OOM killer on a large import, `kill -9`) runs no clean-up: the half-written OUT then refused every
    re-run (`already exists and is not an empty directory`) until the user found and removed it, and `verify` told
    them to restore it from where it came from. While the writer runs, a second one is refused; once it is gone, its
    leftover is named as such and the same command replaces it."""
    hf = tmp_path / "hf"
    if command == "import-hf":
        assert _run("export-hf", str(tiny_bundle.path), str(hf))[0] == 0
    out = tmp_path / "out"
    args = ["init", str(TINY), str(out), "--seed", "1"] if command == "init" else ["import-hf", str(hf), str(out)]
    writer = subprocess.Popen([sys.executable, "-c", _PAUSE_MID_WRITE, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "written\n", writer.stderr.read()
        code, _, err = _run(*args)  # while it still writes
        assert code == 1 and err == f"error: {out}: another m31r is writing a bundle into it now: let it finish, or " \
                                    "stop it first\n", err
        assert (out / "model.safetensors").is_file()
    finally:
        writer.kill()
        writer.communicate()
    assert writer.returncode == -signal.SIGKILL
    code, _, err = _run("verify", str(out))
    assert code == 1 and _one_error_line(err) and f"{out}: unfinished: " in err and "run that command again" in err
    code, stdout, err = _run(*args)
    assert code == 0 and stdout.startswith("ok ") and "holds a bundle whose writer was stopped" in err, err
    assert sorted(p.name for p in out.iterdir()) == sorted((*CONTENT_FILES, CHECKSUM_FILE))
    open_bundle(out)


def test_an_export_killed_outright_is_named_unfinished_by_import(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """A checkpoint folder that `export-hf` left when killed lacks config.json: import-hf named the missing file
    only."""
    import m31r.hf_export

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / ".m31r-unfinished").write_text("")
    m31r.hf_export.export_hf(tiny_bundle, hf)
    (hf / "config.json").unlink()  # where the kill left it: config.json is written last
    code, _, err = _run("import-hf", str(hf), str(tmp_path / "back"))
    assert code == 1 and _one_error_line(err) and f"{hf}: unfinished: " in err, err


# -- the output never lands inside another bundle, or inside the checkpoint it is imported from ------------------


@pytest.mark.parametrize("command", ["init", "import-hf", "export-hf", "quantize"])
def test_out_inside_any_bundle_is_refused(pair, tmp_path: Path, command: str) -> None:
    """`bundle init cfg release/test` wrote a bundle into the release bundle's folder (which `m31r train export`
    then copies into every new release); only the source of a command was guarded."""
    a, b = pair
    hf = tmp_path / "hf"
    assert _run("export-hf", str(b.path), str(hf))[0] == 0
    before = _listing(a.path)
    out = a.path / "sub" / "deeper"
    args = {"init": ["init", str(TINY), str(out), "--seed", "1"], "import-hf": ["import-hf", str(hf), str(out)],
            "export-hf": ["export-hf", str(b.path), str(out)],
            "quantize": ["quantize", str(b.path), str(out), "--quant", "int8"]}[command]
    code, _, err = _run(*args)
    assert code == 1 and err == (f"error: {out}: inside the bundle {a.path}, which must hold its five files only: "
                                 "write the new one somewhere else\n"), err
    assert _listing(a.path) == before
    open_bundle(a.path)


def test_import_into_the_checkpoint_it_reads_is_refused(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """`import-hf hf hf/bundle` wrote the bundle into the checkpoint folder, which tools load and upload whole."""
    hf = tmp_path / "hf"
    assert _run("export-hf", str(tiny_bundle.path), str(hf))[0] == 0
    before = _listing(hf)
    code, _, err = _run("import-hf", str(hf), str(hf / "bundle"))
    assert code == 1 and _one_error_line(err) and f"{hf / 'bundle'}: inside the checkpoint {hf} it is made from" in err
    assert _listing(hf) == before


def test_ctrl_c_while_writing_is_one_line_and_leaves_nothing(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """Ctrl-C mid-write removed the half-written folder but said only click's `Aborted!` (exit 1)."""
    hf = tmp_path / "hf"
    assert _run("export-hf", str(tiny_bundle.path), str(hf))[0] == 0
    hook = _KILL_MID_WRITE.replace("signal.SIGTERM", "signal.SIGINT")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", hook, "import-hf", str(hf), str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 130 and p.stdout == "", (p.returncode, p.stderr)
    assert p.stderr == f"error: {out}: interrupted (Ctrl-C) before the bundle was whole; nothing was left there\n"
    assert not out.exists()


def test_init_with_a_tokenizer_that_does_not_fit_names_the_users_files(tmp_path: Path, tiny_bundle: Bundle) -> None:
    """The misfit was found by the written bundle's own check, and blamed on OUT/tokenizer.json and `config.yaml`:
    files the user never named, gone by the time they read the message."""
    cfg = _tiny_yaml(tmp_path, "vocab_size: 384", "vocab_size: 300")
    tok = tiny_bundle.tokenizer_path
    out = tmp_path / "out"
    code, _, err = _run("init", str(cfg), str(out), "--seed", "1", "--tokenizer", str(tok))
    assert code == 1 and err == f"error: {tok}: tokenizer has 384 tokens but {cfg} vocab_size is 300\n", err
    assert not out.exists()
