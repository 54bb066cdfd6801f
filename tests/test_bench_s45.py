"""The speed and soak benchmarks' own behaviour (not their figures): what they report beside every figure, what they
refuse, what they skip, and that no daemon they start outlives them. Real scripts in subprocesses, real daemons on
real sockets in private folders; nothing here times anything."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def load(name: str):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # their imports of each other (bench_common, soak_common, ...)
    spec = importlib.util.spec_from_file_location(f"s45_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def private_dir() -> Path:
    """A fresh folder only we can enter, for sockets (mkdtemp makes it 0700)."""
    d = Path(tempfile.mkdtemp(prefix="m31r-s45-"))
    assert d.stat().st_mode & 0o777 == 0o700
    return d


def ready_pid(log: Path, sock: Path) -> int:
    """The pid a daemon logged in its `ready` line for this socket."""
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("msg") == "ready" and rec.get("socket") == str(sock):
            return rec["pid"]
    raise AssertionError(f"no ready line for {sock} in {log}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that exited but was never reaped still answers kill(0): a zombie is not running.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def reap(pid: int) -> None:
    """Stop a daemon the code under test leaked, so that a failing test leaves nothing behind either."""
    if alive(pid):
        os.kill(pid, 15)


# ------------------------------------------------------------------------------------------------------------
# run_all.py: the summary shows this run's figures, under the CPU (with its flags) they were measured on
# ------------------------------------------------------------------------------------------------------------


def test_run_all_never_shows_a_failed_suites_figures_from_an_earlier_run(tmp_path: Path, monkeypatch, capfd):
    run_all = load("run_all")
    monkeypatch.setattr(run_all, "OUT", tmp_path)
    # A real bench_daemon.py run that fails (no such bundle) after an earlier run left its JSON in the folder.
    monkeypatch.setattr(run_all, "SUITE", [("daemon", "bench_daemon.py", ["--bundle", str(tmp_path / "nope")])])
    stale = {"meta": {"cpu": "an earlier machine"}, "throughput": [{"clients": 1, "tokens_per_s": 100.0},
                                                                   {"clients": 8, "tokens_per_s": 987.0}]}
    (tmp_path / "daemon.json").write_text(json.dumps(stale))
    assert run_all.main([]) == 1
    out, err = capfd.readouterr()
    assert "failed: daemon" in err
    assert not (tmp_path / "daemon.json").exists()
    assert "8 streams / 1 stream" not in out and "9.87" not in out  # the stale ratio, 987 / 100


def test_run_all_heads_the_table_with_the_cpu_flags_and_no_other_machines_figures():
    from m31r.cpu import describe

    run_all = load("run_all")
    here, bf16 = run_all.machine()
    assert here == describe()  # name, core count and the flags that choose the kernels
    results = {"daemon": {"meta": {"cpu": here}, "throughput": [{"clients": 1, "tokens_per_s": 10.0},
                                                                {"clients": 8, "tokens_per_s": 45.0}]}}
    assert run_all.header(results, here, bf16) == f"measured on: {here}; bf16 matmuls: {bf16}"
    table = run_all.report(results)
    assert "llama.cpp" not in table  # quoted figures from the machine are no peer of anything measured here
    assert "4.5" in table and "yes" in table
    assert "decode fp32" not in table  # the speed suite did not run: no row of dashes passing for a figure
    # --report on files from another machine: each file's CPU, and the warning that nothing here compares.
    other = run_all.header({"daemon": {"meta": {"cpu": "Some CPU, 64 CPUs, AVX2"}}, "speed": {}}, here, bf16)
    assert "daemon: measured on Some CPU, 64 CPUs, AVX2" in other
    assert "speed: measured on an unrecorded CPU" in other
    assert "compare with nothing measured here" in other


def test_runtime_benchmarks_record_the_cpu_flags_not_just_the_architecture():
    from m31r.cpu import describe

    m = load("bench_common").machine()
    assert m["cpu"] == describe() and m["arch"]


# ------------------------------------------------------------------------------------------------------------
# Bad arguments: a usage error naming the option, before any model is built or daemon started
# ------------------------------------------------------------------------------------------------------------

BAD_ARGS = [
    ("bench_runtime", ["--prefill-lengths", "abc"], "--prefill-lengths"),
    ("bench_runtime", ["--prefill-lengths", "0"], "--prefill-lengths"),
    ("bench_runtime", ["--dtypes", "float64"], "--dtypes"),
    ("bench_runtime", ["--config", "no-such.yaml"], "--config"),
    ("bench_speed", ["--threads", "0"], "--threads"),
    ("bench_speed", ["--keystrokes", "0"], "--keystrokes"),
    ("bench_daemon", ["--lookahead", "-1"], "--lookahead"),
    ("bench_daemon", ["--seconds", "0"], "--seconds"),
    ("bench_daemon", ["--bundle", "no-such-bundle"], "--bundle"),
    ("bench_lsp", ["--keystrokes", "0"], "--keystrokes"),
    ("bench_kernels", ["--precisions", "bf16"], "--precisions"),
    ("bench_kernels", ["--reps", "0"], "--reps"),
    ("bench_beams", ["--bundle", "b", "--data", "d", "--widths", "1,x"], "--widths"),
    ("bench_prefill", ["--bundle", "b", "--data", "d", "--tasks", "0"], "--tasks"),
    ("bench_context", ["--bundle", "b", "--data", "d", "--tasks", "0"], "--tasks"),
    ("bench_train", ["--data", "d", "--lengths", "256,x"], "--lengths"),
    ("bench_llamacpp", ["--rounds", "0"], "--rounds"),
    ("size_curve", ["--data", "d", "--candidate", "configs/model/tiny.yaml"], "NAME=MODEL_YAML"),
    ("ab", ["--base", "HEAD", "--rounds", "1"], "--rounds"),
    ("soak", ["--scale", "0"], "--scale"),
]


@pytest.mark.parametrize(("script", "args", "names"), BAD_ARGS, ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_ARGS])
def test_bad_arguments_get_a_usage_error_naming_the_option(script: str, args: list[str], names: str):
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and names in proc.stderr, proc.stderr


def test_soak_scale_from_the_environment_is_checked_too():
    proc = subprocess.run([sys.executable, str(BENCH / "soak.py")], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "SOAK_SCALE": "fast"}, timeout=60)
    assert proc.returncode == 2 and "SOAK_SCALE='fast' is not a number" in proc.stderr, proc.stderr


def test_llamacpp_avx2_mode_is_refused_where_its_build_could_not_run():
    bench = load("bench_llamacpp")
    assert bench.avx2_refusal({"avx2", "fma", "f16c", "bmi2", "sse4_2"}, "x86_64") is None
    assert "lacks fma, bmi2" in bench.avx2_refusal({"avx2", "f16c"}, "x86_64")
    assert "this CPU is aarch64" in bench.avx2_refusal({"asimd", "asimddp"}, "aarch64")


# ------------------------------------------------------------------------------------------------------------
# A CPU without the native kernels: said and skipped, not an eager-against-eager "speed-up"
# ------------------------------------------------------------------------------------------------------------


def test_kernel_benchmark_without_native_kernels_says_so_instead_of_comparing_eager_with_itself(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_kernels.py"), "--config", str(ROOT / "configs/model/tiny.yaml"),
         "--precisions", "fp32", "--threads", "1", "--reps", "1", "--tokens", "2", "--context", "16",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "M31R_KERNELS": "eager"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "no native kernels run here (disabled by M31R_KERNELS=eager)" in proc.stderr
    assert "speed-up" not in proc.stdout


# ------------------------------------------------------------------------------------------------------------
# No daemon outlives a benchmark that fails part-way
# ------------------------------------------------------------------------------------------------------------


def test_daemon_pair_stops_the_first_when_the_second_cannot_start(tiny_bundle):
    bench = load("bench_daemon")
    d = private_dir()
    log = d / "daemon.log"
    specs = {"off": (d / "off.sock", ["--threads", "1", "--dtype", "float32", "--lookahead", "0"]),
             "on": (d / "on.sock", ["--threads", "1", "--dtype", "float32", "--lookahead", "-1"])}  # click refuses
    with pytest.raises(RuntimeError, match="daemon exited with 2"):
        bench.start_daemons(tiny_bundle.path, log, specs)
    pid = ready_pid(log, d / "off.sock")
    try:
        assert not alive(pid), "the first daemon was left running after the second failed to start"
    finally:
        reap(pid)


def test_soak_kill_job_stops_its_daemon_when_the_http_adapter_cannot_start(tiny_bundle):
    soak_kill = load("soak_kill")
    work = private_dir()
    (work / "kill-http.log").mkdir()  # `m31r serve`'s log cannot be opened: the job fails after its daemon started
    with pytest.raises(IsADirectoryError):
        asyncio.run(soak_kill.kill_cycles(tiny_bundle.path, work, 1))
    pid = ready_pid(work / "kill-daemon.log", work / "kill" / "d.sock")
    try:
        assert not alive(pid), "the kill job's daemon was left running"
    finally:
        reap(pid)


def processes_mentioning(text: str) -> list[int]:
    """Pids of the processes whose command line contains `text`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            if text in cmdline and alive(int(proc.name)):
                pids.append(int(proc.name))
    return pids


def test_sigterm_to_the_daemon_benchmark_stops_its_daemon_too():
    """`timeout` or `kill` sends SIGTERM to the benchmark alone (not its process group, as Ctrl-C does): it must end
    as Ctrl-C ends it, stopping its daemon, not die at once and orphan it."""
    proc = subprocess.Popen([sys.executable, str(BENCH / "bench_daemon.py"), "--shape", "tiny", "--threads", "1",
                             "--skip", "cold", "lookahead", "roundtrip", "--keystrokes", "2", "--seconds", "60"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    folder, leaked = None, []
    try:
        for line in proc.stderr:
            if line.startswith("bundle "):  # "bundle /tmp/m31r-bench-XXXX/bundle (...)": the daemon's folder
                folder = str(Path(line.split()[1]).parent)
            if line.startswith("throughput: 1 clients"):  # the daemon is serving the 60 s throughput run
                break
        assert folder and processes_mentioning(folder), "the benchmark never got its daemon serving"
        proc.terminate()
        code = proc.wait(60)
        leaked = processes_mentioning(folder)
        assert not leaked, "the daemon outlived the benchmark it served"
        assert code == 128 + 15  # ended by SystemExit, its finally blocks run: not killed by the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in leaked:
            reap(pid)
