"""Neovim's plugin (editors/neovim) against a real `m31r lsp` and the shared test daemon: the settings it passes on,
and the keys it gives back (s45 audit, second part). The Emacs side of that audit is in editors/emacs/m31r-tests.el
(`m31r-eglot-rust-modes-open-as-rust`, run by tests/test_emacs.py).

Neovim here is 0.11, without vim.lsp.inline_completion (0.12): where the plugin's inline-completion keys are
checked, a stand-in with 0.12's functions takes its place, so that the plugin maps them; the server, the attach and
detach and the mappings are Neovim's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import pytest
from test_editors_audit import NVIM, REPO, needs_nvim, run_nvim

from m31r_lsp import settings as lsp_settings

pytestmark = pytest.mark.timeout(120)

ALL_KEYS_SCRIPT = r"""
local notes = {}
vim.notify = function(msg) table.insert(notes, msg) end
local out = require("m31r").server_settings(vim.json.decode(os.getenv("M31R_TEST_SETTINGS")))
vim.wait(100, function() return #notes > 0 end)  -- (warnings are scheduled)
io.stdout:write(vim.json.encode({ keys = vim.tbl_keys(out), notes = notes }))
"""


@needs_nvim
def test_neovim_knows_every_setting_of_the_server(tmp_path):
    """Every key of lsp/settings.py, at its default (null where it has none; socket ""), passes the plugin's checks
    unreported: a setting added to the server but not to the plugin fails here."""
    defaults = {f.name: getattr(lsp_settings.EditorSettings(), f.name) for f in dataclasses.fields(
        lsp_settings.EditorSettings)}
    user = {key: defaults[name] if defaults[name] is not None or key != "socket" else ""
            for key, (name, _) in lsp_settings.FIELDS.items()}
    script = tmp_path / "keys.lua"
    script.write_text(ALL_KEYS_SCRIPT)
    proc = subprocess.run([NVIM, "--clean", "--headless", "--cmd", f"set rtp+={REPO / 'editors' / 'neovim'}", "-l",
                           str(script)], env={**os.environ, "M31R_TEST_SETTINGS": json.dumps(user)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout)
    assert res["notes"] == [], res
    assert sorted(res["keys"]) == sorted(lsp_settings.FIELDS), res  # (null ones are sent as null)


SETTINGS_SCENARIO = r"""
  local o = H.out
  require("m31r").setup({ cmd = cfg.server, socket = cfg.socket, settings = cfg.settings })
  vim.cmd.edit(cfg.proj .. "/src/main.rs")
  local client = H.client(0)
  o.init_options = client.config.init_options
  o.at_start = H.stats(client).settings
  require("m31r").set({ maxLines = 5, temperature = 0.5 })
  H.wait(function() return H.stats(client).settings.max_lines == 5 end, "maxLines pushed")
  o.pushed = H.stats(client).settings
"""


@needs_nvim
def test_neovim_passes_on_every_setting_the_server_reads(shared_daemon, tmp_path):
    """The plugin knew only some of the server's settings: `maxLines`, `temperature`, `seed`, `typedThrough`,
    `acceptAhead`, `autostart` and `bundle` were dropped with "unknown setting ... ignored", so that the user could not
    set them from Neovim at all. They reach the server now, at start and when changed; a key the server does not know
    is still reported, and the settings left unset are not sent (autostart = true would override the command line's
    `--no-autostart`)."""
    bundle = os.path.join(tmp_path, "b.m31r")
    settings = {"maxLines": 3, "temperature": 1.0, "seed": 11, "typedThrough": False, "acceptAhead": True,
                "autostart": False, "bundle": bundle, "nonsense": 1}
    res = run_nvim(tmp_path, SETTINGS_SCENARIO, {"socket": str(shared_daemon[1]), "settings": settings})
    s = res["at_start"]
    assert (s["max_lines"], s["temperature"], s["seed"], s["typed_through"], s["accept_ahead"], s["autostart"],
            s["bundle"]) == (3, 1.0, 11, False, True, False, bundle), s
    assert "nonsense" not in res["init_options"] and "maxLines" in res["init_options"], res["init_options"]
    p = res["pushed"]
    assert (p["max_lines"], p["temperature"], p["seed"]) == (5, 0.5, 11), p
    notes = [n["msg"] for n in res["notes"] if "setting" in n["msg"] or "must be" in n["msg"]]
    assert notes == ['m31r: unknown setting "nonsense" ignored'], res["notes"]
    assert res["errmsg"] == "", res


KEYS_SCENARIO = r"""
  local o = H.out
  if not vim.lsp.inline_completion then
    vim.lsp.inline_completion = {
      enable = function() end,
      is_enabled = function() return true end,
      get = function() return false end,
      select = function() end,
    }
  end
  local keys = { "<Tab>", "<M-]>", "<M-[>" }
  local function maps()
    local got = {}
    for _, lhs in ipairs(keys) do
      local m = vim.fn.maparg(lhs, "i", false, true)
      got[lhs] = (m.desc or ""):match("^M31R: ") and "M31R" or (m.buffer == 1 and m.rhs or "none")
    end
    return got
  end
  require("m31r").setup({ cmd = cfg.server, socket = cfg.socket })
  vim.cmd.edit(cfg.proj .. "/src/main.rs")
  local buf = vim.api.nvim_get_current_buf()
  -- the buffer's own mappings, there before the client attaches (it attaches once the server has answered)
  for _, lhs in ipairs(keys) do
    vim.keymap.set("i", lhs, "user" .. lhs:gsub("[<>]", ""), { buffer = buf })
  end
  local function attached()
    H.wait(function()
      local c = vim.lsp.get_clients({ name = "m31r", bufnr = buf })[1]
      return c and c.initialized and maps()["<M-[>"] == "M31R"
    end, "the plugin's keys")
    return maps()
  end
  local function detached()
    vim.bo[buf].filetype = "python"
    H.wait(function() return #vim.lsp.get_clients({ bufnr = buf }) == 0 end, "the client to leave the buffer")
    return maps()
  end
  o.attached = attached()
  o.detached = detached()
  vim.bo[buf].filetype = "rust"  -- served again, and left again: the buffer's mappings come back each time
  o.attached_again = attached()
  o.detached_again = detached()
"""


@needs_nvim
def test_neovim_cycling_keys_give_back_the_buffers_own_mappings(shared_daemon, tmp_path):
    """Neovim 0.12's cycling keys (<M-]>, <M-[>) replace the buffer's own mappings of those keys while the plugin
    serves the buffer. Unlike <Tab>, the plugin did not save them, so when it left the buffer (its filetype changed,
    the client stopped) it only deleted its own: the user's mappings were gone for good."""
    res = run_nvim(tmp_path, KEYS_SCENARIO, {"socket": str(shared_daemon[1])})
    ours = dict.fromkeys(["<Tab>", "<M-]>", "<M-[>"], "M31R")
    theirs = {"<Tab>": "userTab", "<M-]>": "userM-]", "<M-[>": "userM-["}
    assert res["attached"] == ours and res["attached_again"] == ours, res
    assert res["detached"] == theirs and res["detached_again"] == theirs, res
    assert res["errmsg"] == "", res
