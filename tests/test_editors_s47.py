"""Neovim's plugin (editors/neovim) as a user sets it up (s47 audit): a `cmd` written with `~`, and a second bad value
of a setting. Headless Neovim with the plugin and a real `m31r lsp` (no daemon needed: it starts and answers
`initialize` without one).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
from test_editors_audit import needs_nvim, run_nvim

pytestmark = pytest.mark.timeout(60)

TILDE_CMD_SCENARIO = r"""
  require("m31r").setup({ cmd = { "~/bin/m31r-wrapper", "lsp" } })
  vim.cmd.edit(cfg.proj .. "/src/main.rs")
  local client = H.wait(function()  -- the client, or the plugin's word that it starts none
    local c = vim.lsp.get_clients({ name = "m31r", bufnr = 0 })[1]
    return (c and c.initialized and c) or (#H.out.notes > 0 and {})
  end, "the m31r client or a message")
  H.out.cmd = client.config and client.config.cmd
"""


@needs_nvim
def test_neovim_cmd_with_a_leading_tilde_starts_the_server(tmp_path: Path):
    """`cmd = { "~/bin/m31r", "lsp" }` (the README: "or `cmd` set to its full path"): Neovim runs the program without a
    shell and its executable() check does not expand `~`, so the plugin said the (executable) file "is not executable:
    put m31r on PATH or set cmd" and started nothing. The plugin expands it, as it does the socket's."""
    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    wrapper = home / "bin" / "m31r-wrapper"
    # `m31r lsp ARGS`: the wrapper drops "lsp" and runs the language server module with this test's Python
    wrapper.write_text(f"#!/bin/sh\nshift\nexec {shlex.quote(sys.executable)} -m m31r_lsp --no-autostart "
                       f"--socket {shlex.quote(str(tmp_path / 'none.sock'))} \"$@\"\n")
    wrapper.chmod(0o755)
    res = run_nvim(tmp_path, TILDE_CMD_SCENARIO, {}, env={"HOME": str(home)})
    assert res.get("cmd") == [str(wrapper), "lsp"], res
    assert not [n for n in res["notes"] if "not executable" in n["msg"]], res


BAD_VALUES_SCENARIO = r"""
  local m = require("m31r")
  m.setup({ cmd = cfg.server, settings = { maxTokens = 5000 } })
  m.set({ debounceMs = 10 })          -- the bad maxTokens is checked again: not news
  m.set({ maxTokens = 0 })            -- another bad value: news, or the default takes its place unsaid
  m.set({ maxTokens = 0 })
  m.set({ multiline = "sometimes" })
  m.set({ multiline = "often" })
  H.sleep(50)                         -- (warnings are scheduled)
  H.out.maxTokens = m.config.settings_resolved.maxTokens
  H.out.multiline = m.config.settings_resolved.multiline
"""


@needs_nvim
def test_neovim_reports_each_bad_value_of_a_setting(tmp_path: Path):
    """The README: a setting outside the server's range "is reported and replaced by its default". Only the first bad
    value of each setting was: `set({ maxTokens = 0 })` after a rejected 5000 used 64 without a word, and the user
    took 0 (or any later typo) as set. Each bad value is reported once; checking a kept bad value again is silent."""
    res = run_nvim(tmp_path, BAD_VALUES_SCENARIO, {})
    msgs = [n["msg"] for n in res["notes"] if "maxTokens" in n["msg"] or "multiline" in n["msg"]]
    assert len(msgs) == 4, res["notes"]
    assert any("5000" in m for m in msgs) and any("got 0" in m for m in msgs), msgs
    assert any("sometimes" in m for m in msgs) and any("often" in m for m in msgs), msgs
    assert res["maxTokens"] == 64 and res["multiline"] == "auto", res
