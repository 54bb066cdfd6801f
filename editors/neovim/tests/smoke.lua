-- Headless checks of the M31R Neovim plugin. From the repository root:
--
--   nvim --clean --headless --cmd "set rtp+=editors/neovim" -l editors/neovim/tests/smoke.lua
--
-- With M31R_LSP_CMD set (e.g. "m31r lsp --socket /path"), it also attaches
-- to that server and asks it for completions. Exits non-zero on failure.

local passed, failed, skipped = 0, 0, 0

local function check(name, fn)
  local ok, err = pcall(fn)
  if ok then
    passed = passed + 1
    print("ok - " .. name)
  else
    failed = failed + 1
    print("not ok - " .. name .. ": " .. tostring(err))
  end
end

local function skip(name, why)
  skipped = skipped + 1
  print("ok - " .. name .. " # SKIP " .. why)
end

local function eq(a, b, what)
  if not vim.deep_equal(a, b) then
    error(("%s: expected %s, got %s"):format(what or "value", vim.inspect(b), vim.inspect(a)), 2)
  end
end

local m31r = require("m31r")

check("setup({}) loads and defines the commands", function()
  m31r.setup({})
  for _, cmd in ipairs({ "M31rToggle", "M31rEnable", "M31rDisable", "M31rRestart", "M31rInfo" }) do
    assert(vim.fn.exists(":" .. cmd) == 2, cmd .. " missing")
  end
  eq(m31r.config.cmd, { "m31r", "lsp" }, "default cmd")
  eq(m31r.config.filetypes, { "rust" }, "default filetypes: Rust only, as VS Code's and Emacs'")
end)

check('filetypes = "*" (or a list holding it) means every filetype', function()
  m31r.setup({ filetypes = "*" })
  eq(m31r.config.filetypes, nil, "every filetype")
  eq(vim.api.nvim_get_autocmds({ group = "m31r", event = "FileType" })[1].pattern, "*", "FileType pattern")
  m31r.setup({ filetypes = { "rust", "*" } })
  eq(m31r.config.filetypes, nil, "every filetype")
  m31r.setup({})
  -- every filetype still: a buffer whose filetype changes to one not served is detached
  eq(vim.api.nvim_get_autocmds({ group = "m31r", event = "FileType" })[1].pattern, "*", "FileType pattern")
end)

check("setup() twice is harmless", function()
  m31r.setup({ filetypes = { "rust" } })
  m31r.setup({})
  eq(#vim.api.nvim_get_autocmds({ group = "m31r", event = "FileType" }), 1, "FileType autocmds")
end)

check("server settings: defaults, validation, socket", function()
  eq(m31r.server_settings({}), {
    enable = true,
    debounceMs = 75,
    debounceMode = "adaptive",
    multiline = "auto",
    deadlineMs = 800,
    maxTokens = 64,
    beams = vim.NIL,
    projectContext = false,
    minProbability = 0.05,
    socket = "",
  }, "defaults")
  eq(m31r.server_settings({ minProbability = 0.2 }).minProbability, 0.2, "a probability is not rounded")
  eq(m31r.server_settings({ minProbability = 3 }).minProbability, 0.05, "out of 0..1: the default")
  local s = m31r.server_settings({ multiline = "sometimes", maxTokens = 12.4, enable = "yes", debounceMode = "fixed" })
  eq(s.multiline, "auto", "bad enum")
  eq(s.maxTokens, 12, "rounded")
  eq(s.enable, true, "bad bool")
  eq(s.debounceMode, "fixed", "good enum")
  -- the server's ranges: a value outside is replaced by the default (the server would drop it unseen)
  s = m31r.server_settings({ deadlineMs = 0, maxTokens = 5000, debounceMs = 6000 })
  eq({ s.deadlineMs, s.maxTokens, s.debounceMs }, { 800, 64, 75 }, "out of range: the defaults")
  s = m31r.server_settings({ deadlineMs = 1, maxTokens = 4096, debounceMs = 0 })
  eq({ s.deadlineMs, s.maxTokens, s.debounceMs }, { 1, 4096, 0 }, "range ends are accepted")
  eq(m31r.server_settings({ maxTokens = 0 }).maxTokens, 64, "maxTokens 0")
  eq(m31r.server_settings({ deadlineMs = 0 / 0 }).deadlineMs, 800, "nan")
  eq(m31r.server_settings({ debounceMs = math.huge }).debounceMs, 75, "inf")
  -- beams: an integer 1..8, or vim.NIL for the daemon's --beams
  eq(m31r.server_settings({ beams = 3 }).beams, 3, "beams")
  eq(m31r.server_settings({ beams = vim.NIL }).beams, vim.NIL, "beams null")
  eq(m31r.server_settings({ beams = 9 }).beams, vim.NIL, "beams out of range")
  eq(m31r.server_settings({ beams = "2" }).beams, vim.NIL, "beams not a number")
  eq(vim.json.decode(vim.json.encode(m31r.server_settings({}))).beams, vim.NIL, "beams sent as null")
  -- every other setting the server reads: sent when set (not by default), checked as the server checks it
  s = m31r.server_settings({ maxLines = 3.2, temperature = 0.7, seed = 11, typedThrough = false, acceptAhead = true,
                             autostart = false, bundle = "/tmp/b.m31r" })
  eq({ s.maxLines, s.temperature, s.seed, s.typedThrough, s.acceptAhead, s.autostart, s.bundle },
     { 3, 0.7, 11, false, true, false, "/tmp/b.m31r" }, "the server's other settings")
  s = m31r.server_settings({ maxLines = 201, temperature = 2.5, seed = -1, typedThrough = 1, autostart = "no",
                             bundle = 3 })
  eq({ s.maxLines, s.temperature, s.seed, s.typedThrough, s.autostart, s.bundle }, {}, "bad values: not sent")
  s = m31r.server_settings({ maxLines = 200, temperature = 2, seed = 2 ^ 53 - 1 })
  eq({ s.maxLines, s.temperature, s.seed }, { 200, 2, 2 ^ 53 - 1 }, "range ends are accepted")
  eq(m31r.server_settings({ seed = 2 ^ 53 }).seed, nil, "a seed a Lua number cannot send exactly")
  eq(m31r.server_settings({ seed = vim.NIL, bundle = vim.NIL }), vim.tbl_extend("force", m31r.server_settings({}),
     { seed = vim.NIL, bundle = vim.NIL }), "seed and bundle null")
  eq(m31r.server_settings({ nonsense = 1 }), m31r.server_settings({}), "an unknown key is not sent")
  -- a leading ~ is the home folder (Neovim passes the path to the server as written)
  eq(m31r.server_settings({ socket = "~/m31rd.sock" }).socket, vim.env.HOME .. "/m31rd.sock", "~ expanded")
  eq(m31r.server_settings({ socket = "/tmp/~x.sock" }).socket, "/tmp/~x.sock", "only a leading ~")
  m31r.setup({ socket = "/tmp/m31rd-test.sock", settings = { maxTokens = 8 } })
  eq(m31r.config.settings_resolved.socket, "/tmp/m31rd-test.sock", "socket in settings")
  eq(m31r.config.settings_resolved.maxTokens, 8, "maxTokens")
  m31r.setup({ cmd = { "m31r", "lsp", "--socket", "/tmp/from-cmd.sock" } })
  eq(m31r.config.settings_resolved.socket, "/tmp/from-cmd.sock", "socket taken from cmd")
  m31r.setup({ cmd = { "m31r", "lsp", "--socket", "~/from-cmd.sock" } })
  eq(m31r.config.settings_resolved.socket, vim.env.HOME .. "/from-cmd.sock", "~ in cmd's socket expanded")
  m31r.setup({ socket = "~/opt.sock" })
  eq(m31r.config.settings_resolved.socket, vim.env.HOME .. "/opt.sock", "~ in the socket option expanded")
  m31r.setup({})
  eq(m31r.config.settings_resolved.socket, "", "default socket")
end)

check("statusline before any server", function()
  eq(m31r.statusline(), "", "no client")
end)

check("a missing executable is reported once, and again on :M31rRestart", function()
  vim.wait(50) -- the earlier checks' warnings (scheduled)
  local notes = {}
  local notify = vim.notify
  vim.notify = function(msg)
    table.insert(notes, msg)
  end
  local ok, err = pcall(function()
    m31r.setup({ cmd = { "m31r-not-installed-here", "lsp" } })
    local dir = vim.fn.tempname()
    vim.fn.mkdir(dir, "p")
    vim.cmd.edit(dir .. "/a.rs")
    vim.cmd.edit(dir .. "/b.rs")
    vim.wait(200, function()
      return #notes > 1
    end)
    eq(#notes, 1, "one message for two buffers: " .. vim.inspect(notes))
    assert(notes[1]:match("m31r%-not%-installed%-here"), notes[1])
    vim.cmd("M31rRestart")
    assert(
      vim.wait(2000, function()
        return #notes == 2
      end, 20),
      "no message on restart: " .. vim.inspect(notes)
    )
    eq(notes[2], notes[1], "the same message")
    eq(#vim.lsp.get_clients({ name = "m31r" }), 0, "no client")
  end)
  vim.notify = notify
  vim.cmd("silent! %bwipeout!") -- no file buffer left for the next setup() to start a server for
  m31r.setup({})
  assert(ok, err)
end)

local cmd_env = os.getenv("M31R_LSP_CMD")
if not cmd_env or cmd_env == "" then
  skip("attach to a real server", "M31R_LSP_CMD is not set")
else
  local cmd = vim.split(vim.trim(cmd_env), "%s+")
  local dir = vim.fn.tempname()
  vim.fn.mkdir(dir .. "/src", "p")
  vim.fn.writefile({ "[package]", 'name = "t"' }, dir .. "/Cargo.toml")
  vim.fn.writefile({
    "pub fn word_counts(text: &str) -> std::collections::HashMap<String, usize> {",
    "    let mut counts = std::collections::HashMap::new();",
    "    for word in text.split_whitespace() {",
    "        ",
    "    }",
    "    counts",
    "}",
  }, dir .. "/src/lib.rs")

  local client
  check("attaches to a Rust buffer and gets the capabilities", function()
    m31r.setup({ cmd = cmd, settings = { maxTokens = 16, debounceMs = 0 }, inline = { accept = "<C-l>" } })
    vim.cmd.edit(dir .. "/src/lib.rs")
    vim.bo.filetype = "rust"
    assert(
      vim.wait(15000, function()
        local cs = vim.lsp.get_clients({ name = "m31r", bufnr = 0 })
        client = cs[1]
        return client ~= nil and client.initialized
      end, 50),
      "no m31r client attached"
    )
    assert(client.server_capabilities.inlineCompletionProvider, "inlineCompletionProvider missing")
    assert(client.server_capabilities.completionProvider, "completionProvider missing")
    eq(client.config.init_options.maxTokens, 16, "init_options")
    eq(client.config.root_dir, dir, "root_dir from Cargo.toml")
  end)

  local function request(method, params)
    local res = vim.lsp.buf_request_sync(0, method, params, 30000)
    assert(res, method .. ": no answer")
    local r = res[client.id]
    assert(r and not r.err, method .. ": " .. vim.inspect(r and r.err))
    return r.result
  end

  check("textDocument/inlineCompletion answers with items", function()
    local result = request("textDocument/inlineCompletion", {
      textDocument = { uri = vim.uri_from_bufnr(0) },
      position = { line = 3, character = 8 },
      context = { triggerKind = 1 },
    })
    local items = result and (result.items or result)
    assert(type(items) == "table", "no items: " .. vim.inspect(result))
    for _, item in ipairs(items) do
      assert(item.insertText ~= nil, "insertText missing")
    end
  end)

  check("textDocument/completion fallback answers", function()
    local result = request("textDocument/completion", {
      textDocument = { uri = vim.uri_from_bufnr(0) },
      position = { line = 3, character = 8 },
    })
    assert(result == nil or type(result) == "table", vim.inspect(result))
  end)

  check("m31r/status is recorded (if the server sent one)", function()
    vim.wait(2000, function()
      return m31r.status ~= nil
    end, 50)
    if m31r.status then
      assert(vim.tbl_contains({ "ready", "starting", "unavailable" }, m31r.status.state), vim.inspect(m31r.status))
      assert(m31r.statusline():match("^M31R"), m31r.statusline())
    end
  end)

  check("completion wiring for this Neovim version", function()
    if vim.lsp.inline_completion then
      assert(vim.lsp.inline_completion.is_enabled({ bufnr = 0 }), "inline completion not enabled")
      assert(vim.fn.maparg("<C-l>", "i", false, true).buffer == 1, "accept key not mapped")
    elseif vim.lsp.completion then
      -- 0.11: vim.lsp.completion.enable() was called; omnifunc is the LSP one.
      assert(vim.bo.omnifunc == "v:lua.vim.lsp.omnifunc", "omnifunc: " .. vim.bo.omnifunc)
      -- a menu even for one suggestion (<C-y> accepts all its lines): "menuone" in the buffer's own 'completeopt'
      local function cot()
        return { vim.go.completeopt, vim.api.nvim_get_option_value("completeopt", { buf = 0 }) }
      end
      local global = vim.go.completeopt
      eq(cot(), { global, global .. ",menuone" }, "'completeopt' on attach")
      vim.cmd("setglobal completeopt=menu,noinsert")
      eq(cot(), { "menu,noinsert", "menu,noinsert,menuone" }, "after :setglobal")
      vim.cmd("setlocal completeopt=longest")
      eq(cot(), { "menu,noinsert", "longest,menuone" }, "after :setlocal")
      vim.cmd("set completeopt=menuone,noselect")
      eq(cot(), { "menuone,noselect", "menuone,noselect" }, "after :set, with menuone")
      vim.o.completeopt = global
      eq(cot(), { global, global .. ",menuone" }, "after :set, without menuone")
    end
  end)

  check("toggle sends settings.m31r.enable = false", function()
    m31r.toggle(false)
    eq(client.settings.m31r.enable, false, "client.settings")
    eq(m31r.statusline(), "M31R off", "statusline")
    m31r.toggle(true)
    eq(client.settings.m31r.enable, true, "client.settings")
  end)

  check("beams reaches the server, vim.NIL as null", function()
    local function beams_is(want)
      local got
      for _ = 1, 50 do
        got = request("m31r/stats", {}).settings.beams
        if got == nil then
          got = vim.NIL -- JSON null (decoded as nil in objects)
        end
        if got == want then
          break
        end
        vim.wait(50)
      end
      return got
    end
    m31r.set({ beams = 2 })
    eq(beams_is(2), 2, "beams set")
    m31r.set({ beams = vim.NIL })
    eq(beams_is(vim.NIL), vim.NIL, "beams back to the daemon's")
  end)

  check("Neovim 0.12 inline completion path (stubbed API)", function()
    local real = vim.lsp.inline_completion
    local calls = {}
    local accepted = false
    vim.lsp.inline_completion = {
      enable = function(enable, filter)
        table.insert(calls, { enable, filter })
      end,
      is_enabled = function()
        return true
      end,
      get = function()
        return accepted
      end,
      select = function() end,
    }
    local ok, err = pcall(function()
      vim.cmd.edit(dir .. "/src/main.rs")
      vim.bo.filetype = "rust"
      local buf = vim.api.nvim_get_current_buf()
      assert(
        vim.wait(5000, function()
          return #vim.lsp.get_clients({ name = "m31r", bufnr = buf }) == 1
        end, 20),
        "second buffer not attached"
      )
      eq(#vim.lsp.get_clients({ name = "m31r" }), 1, "one shared client")
      eq(calls[#calls], { true, { bufnr = buf } }, "inline_completion.enable call")
      local map = vim.fn.maparg("<C-l>", "i", false, true)
      assert(map.buffer == 1 and map.expr == 1 and map.callback, "accept mapping")
      eq(map.callback(), "<C-l>", "falls back to the key when nothing is shown")
      accepted = true
      eq(map.callback(), "", "accepts when a suggestion is shown")
      assert(vim.fn.maparg("<M-]>", "i", false, true).buffer == 1, "next mapping")
    end)
    vim.lsp.inline_completion = real
    assert(ok, err)
  end)

  check("restart starts a new client", function()
    local old = client.id
    m31r.restart()
    assert(
      vim.wait(15000, function()
        local cs = vim.lsp.get_clients({ name = "m31r" })
        return #cs == 1 and cs[1].id ~= old and cs[1].initialized
      end, 50),
      "no new client after restart"
    )
  end)

  for _, c in ipairs(vim.lsp.get_clients({ name = "m31r" })) do
    if vim.fn.has("nvim-0.11") == 1 then
      c:stop(true)
    else
      c.stop(true)
    end
  end
end

print(("%d passed, %d failed, %d skipped"):format(passed, failed, skipped))
if failed > 0 then
  os.exit(1)
end
