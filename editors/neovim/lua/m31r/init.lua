-- M31R: offline Rust code completion for Neovim through the built-in LSP client.
--
--   require("m31r").setup({
--     cmd = { "m31r", "lsp" },      -- the language server (LSP over stdio)
--     socket = nil,                  -- daemon socket: adds `--socket PATH` and settings.socket
--     filetypes = { "rust" },        -- "*" = every filetype (the model knows Rust only)
--     settings = { maxTokens = 64 }, -- server settings (camelCase, see README)
--   })
--
-- Neovim >= 0.12: native inline completion (ghost text, LSP 3.18
-- textDocument/inlineCompletion). Older versions: the server's
-- textDocument/completion fallback (vim.lsp.completion on 0.11, omnifunc on 0.10).

local M = {}

local has_011 = vim.fn.has("nvim-0.11") == 1

--- Server settings: exactly what `m31r lsp` reads from initializationOptions
--- and from workspace/didChangeConfiguration (settings.m31r).
M.server_defaults = {
  enable = true,
  debounceMs = 75,
  debounceMode = "adaptive", -- "adaptive" | "fixed"
  multiline = "auto", -- "auto" | "always" | "never"
  deadlineMs = 800,
  maxTokens = 64, -- above half the model's context the server clamps it (and says so once)
  beams = vim.NIL, -- beam width 1..8 of a single-line suggestion; vim.NIL = the daemon's --beams
  projectContext = false, -- true: send snippets of the crate's other files
  minProbability = 0.05, -- hide suggestions whose first line the model gives less than this, cut multi-line ones
  -- to the lines that together keep it (0 shows all, whole)
  socket = "", -- "" = the server's default (`--socket` in cmd, else the daemon's); a leading ~ is expanded
}

M.defaults = {
  name = "m31r",
  cmd = { "m31r", "lsp" },
  socket = nil,
  filetypes = { "rust" }, -- the model knows Rust only: elsewhere its suggestions are noise ("*": every filetype)
  settings = {},
  root_markers = { "Cargo.toml", ".git" },
  -- Neovim >= 0.12 inline completion. Keys may be false to leave them unmapped.
  inline = {
    enabled = true,
    accept = "<Tab>", -- accepts the ghost text, otherwise does what the key did before (its mapping, else itself)
    next = "<M-]>",
    prev = "<M-[>",
  },
  -- textDocument/completion fallback, used when inline completion is unavailable.
  completion = {
    enabled = true,
    autotrigger = false, -- 0.11+: pop up on the server's trigger characters
    menuone = true, -- 0.11+: add "menuone" to the buffer's own 'completeopt', so a single suggestion gets a menu
  },
  on_attach = nil, -- function(client, bufnr)
  capabilities = nil, -- extra client capabilities, deep-merged
}

M.config = vim.deepcopy(M.defaults)

--- Last `m31r/status` from the server: { state, model, lastLatencyMs } or nil.
M.status = nil

local group = nil
local warned = {}
-- Set when the server exited before it answered `initialize` (a broken install, a bad argument): no buffer starts
-- it again until :M31rRestart, so the user gets one message, not one per buffer opened.
local failed = nil
local initialized = {}

local function notify_once(key, msg, level)
  if warned[key] then
    return
  end
  warned[key] = true
  vim.schedule(function()
    vim.notify("m31r: " .. msg, level or vim.log.levels.WARN)
  end)
end

-- 0.10 clients have dot-methods (closures), 0.11+ colon-methods.
local function client_call(client, method, ...)
  if has_011 then
    return client[method](client, ...)
  end
  return client[method](...)
end

local function supports(client, method, bufnr)
  if has_011 then
    return client:supports_method(method, bufnr)
  end
  return client.supports_method(method, { bufnr = bufnr })
end

-- Every setting the server reads (lsp/settings.py FIELDS). Those not in M.server_defaults are sent only when set:
-- sent always, a default (autostart = true) would override the server's command line (`--no-autostart`).
local valid = {
  enable = "boolean",
  debounceMs = "number",
  debounceMode = { adaptive = true, fixed = true },
  multiline = { auto = true, always = true, never = true },
  deadlineMs = "number",
  maxTokens = "number",
  maxLines = "number",
  beams = "number",
  projectContext = "boolean",
  minProbability = "fraction",
  temperature = "fraction",
  seed = "number",
  typedThrough = "boolean",
  acceptAhead = "boolean",
  autostart = "boolean",
  socket = "string",
  bundle = "string",
}

-- The server's ranges (lsp/settings.py): it drops a value outside them, so one is replaced here, with a warning.
-- Integers are rounded; a seed goes up to 2^53 - 1, the largest integer a Lua number sends exactly (the server
-- takes up to 2^63 - 1, but a larger Lua number reaches it as another seed).
local ranges = {
  debounceMs = { 0, 5000 },
  deadlineMs = { 1, 60000 },
  maxTokens = { 1, 4096 },
  maxLines = { 1, 200 },
  beams = { 1, 8 },
  seed = { 0, 2 ^ 53 - 1 },
}

-- Numbers kept as they are (not rounded), in the server's range.
local fractions = {
  minProbability = { 0, 1 },
  temperature = { 0, 2 },
}

-- Settings that may be vim.NIL (JSON null): the server's default.
local nullable = { beams = true, seed = true, bundle = true }

-- A leading ~ is the home folder: the server would otherwise get it as written (Neovim runs it without a shell).
local function expand_home(path)
  if path:sub(1, 1) == "~" then
    local expanded = vim.fn.expand(path, true) -- true: 'wildignore' does not apply
    if expanded ~= "" then
      return expanded
    end
  end
  return path
end

--- The full settings object sent to the server (all keys present, invalid values replaced).
function M.server_settings(user)
  local out = vim.deepcopy(M.server_defaults)
  for key, value in pairs(user or {}) do
    local want = valid[key]
    -- Once per setting and bad value: every set() checks the whole table again (a bad value kept there is not news),
    -- but another bad value of the same setting is, or the default taking its place goes unsaid.
    local bad = "bad:" .. key .. "=" .. vim.inspect(value)
    if want == nil then
      notify_once("key:" .. key, ("unknown setting %q ignored"):format(key))
    elseif value == vim.NIL and nullable[key] then
      out[key] = value
    elseif type(want) == "table" then
      if type(value) == "string" and want[value] then
        out[key] = value
      else
        notify_once(bad, ("invalid value for %s: %s"):format(key, vim.inspect(value)))
      end
    elseif want == "fraction" then
      local lo, hi = fractions[key][1], fractions[key][2]
      if type(value) ~= "number" or value ~= value or value < lo or value > hi then
        notify_once(bad, ("%s must be a number in %g..%g, got %s"):format(key, lo, hi, vim.inspect(value)))
      else
        out[key] = value
      end
    elseif type(value) ~= want then
      notify_once(bad, ("%s must be a %s, got %s"):format(key, want, vim.inspect(value)))
    elseif want == "number" then
      local lo, hi = ranges[key][1], ranges[key][2]
      local n = value % 1 == 0 and value or math.floor(value + 0.5) -- (2^53 - 1 + 0.5 rounds up to 2^53)
      if value ~= value or n < lo or n > hi then
        notify_once(bad, ("%s must be in %d..%d, got %s"):format(key, lo, hi, vim.inspect(value)))
      else
        out[key] = n
      end
    elseif key == "socket" then
      out[key] = expand_home(value)
    else
      out[key] = value
    end
  end
  return out
end

local function server_cmd(cfg, settings)
  local cmd = vim.deepcopy(cfg.cmd)
  if type(cmd) == "string" then
    cmd = { cmd }
  end
  if type(cmd[1]) == "string" then
    -- `cmd = { "~/.local/bin/m31r", "lsp" }`: Neovim runs the program without a shell, and neither it nor the
    -- executable() check expands ~ (the check said an executable file "is not executable").
    cmd[1] = expand_home(cmd[1])
  end
  if settings.socket ~= "" and not vim.tbl_contains(cmd, "--socket") then
    vim.list_extend(cmd, { "--socket", settings.socket })
  end
  return cmd
end

local function clients()
  return vim.lsp.get_clients({ name = M.config.name })
end

local function statusline_text(s)
  if not (M.config.settings_resolved or M.server_defaults).enable then
    return "M31R off"
  end
  if #clients() == 0 then
    return ""
  end
  if not s then
    return "M31R"
  end
  if s.state == "ready" then
    if type(s.lastLatencyMs) == "number" then
      return ("M31R %dms"):format(math.floor(s.lastLatencyMs + 0.5))
    end
    return "M31R"
  elseif s.state == "starting" then
    return "M31R starting"
  end
  return "M31R unavailable"
end

--- A short string for your statusline, e.g. `%{v:lua.require'm31r'.statusline()}`.
--- Redraw on `User M31rStatus` events.
function M.statusline()
  return statusline_text(M.status)
end

local function on_status(_, result, ctx)
  if type(result) ~= "table" or type(result.state) ~= "string" then
    return
  end
  M.status = {
    state = result.state,
    model = type(result.model) == "string" and result.model or nil,
    lastLatencyMs = type(result.lastLatencyMs) == "number" and result.lastLatencyMs or nil,
    client_id = ctx and ctx.client_id,
  }
  vim.schedule(function()
    vim.api.nvim_exec_autocmds("User", { pattern = "M31rStatus", modeline = false, data = M.status })
    pcall(vim.cmd.redrawstatus)
  end)
end

local function map(bufnr, lhs, rhs, desc, expr)
  if not lhs or lhs == "" then
    return
  end
  vim.keymap.set("i", lhs, rhs, { buffer = bufnr, expr = expr or false, silent = true, desc = desc })
end

-- What the plugin's keys did in a buffer before it mapped them (its buffer mapping, else the global one), by
-- buffer and key: Neovim's own <Tab> (0.11+) jumps to a snippet's next placeholder, and a user's <Tab> may be anything.
local previous = {}

--- Runs the mapping `previous[bufnr][lhs]` held, from a `<Cmd>` (a mapping that is not an expression may change text).
function M._run_previous(bufnr, lhs)
  local prev = (previous[bufnr] or {})[lhs]
  if prev and prev.callback then
    prev.callback()
  end
end

local function remember_previous(bufnr, lhs)
  local prev = vim.api.nvim_buf_call(bufnr, function()
    return vim.fn.maparg(lhs, "i", false, true)
  end)
  previous[bufnr] = previous[bufnr] or {}
  if vim.tbl_isempty(prev) then
    previous[bufnr][lhs] = nil
  elseif not (prev.buffer == 1 and (prev.desc or ""):match("^M31R: ")) then -- ours, from an earlier attach: kept
    previous[bufnr][lhs] = prev
  end
end

-- The keys `lhs` stands for when no suggestion shows: the earlier mapping's, else the key itself (for an expression
-- mapping that replaces key codes; feeds them itself where the earlier mapping was recursive).
local function fallback_keys(bufnr, lhs)
  local prev = (previous[bufnr] or {})[lhs]
  if not prev then
    return lhs
  end
  local rhs
  if prev.callback and prev.expr == 1 then
    rhs = prev.callback()
  elseif prev.callback then
    -- (the key's name with its "<" as <lt>: the keys returned have their key codes replaced)
    local name = ("%q"):format(lhs):gsub("<", "<lt>")
    return ("<Cmd>lua require('m31r')._run_previous(%d, %s)<CR>"):format(bufnr, name)
  else
    rhs = (prev.rhs or ""):gsub("<[Ss][Ii][Dd]>", "<SNR>" .. (prev.sid or 0) .. "_")
    if prev.expr == 1 then
      rhs = vim.api.nvim_buf_call(bufnr, function()
        return vim.fn.eval(rhs)
      end)
    end
  end
  if type(rhs) ~= "string" then
    return ""
  end
  if prev.noremap ~= 1 then
    local codes, key = vim.keycode(rhs), vim.keycode(lhs)
    if vim.startswith(codes, key) then -- as Vim maps it: the key itself is not mapped again, the rest is
      vim.api.nvim_feedkeys(codes:sub(#key + 1), "mi", false)
      return lhs
    end
    vim.api.nvim_feedkeys(codes, "mi", false)
    return ""
  end
  return rhs
end

local function setup_inline(client, bufnr)
  local ic = vim.lsp.inline_completion
  ic.enable(true, { bufnr = bufnr })
  local keys = M.config.inline
  if keys.accept and keys.accept ~= "" then
    remember_previous(bufnr, keys.accept)
  end
  map(bufnr, keys.accept, function()
    if ic.get() then
      return ""
    end
    return fallback_keys(bufnr, keys.accept)
  end, "M31R: accept the inline completion", true)
  if ic.select then
    -- (remembered as the accept key is: on_detach gives the buffer its own mappings of these keys back)
    for _, lhs in ipairs({ keys.next, keys.prev }) do
      if lhs and lhs ~= "" then
        remember_previous(bufnr, lhs)
      end
    end
    map(bufnr, keys.next, function()
      ic.select({ count = 1 })
    end, "M31R: next inline completion")
    map(bufnr, keys.prev, function()
      ic.select({ count = -1 })
    end, "M31R: previous inline completion")
  end
end

-- The lines of an M31R completion item's text (the server marks its items with detail "m31r"), or nil.
local function suggestion_lines(item)
  if type(item) ~= "table" or item.detail ~= "m31r" or type(item.textEdit) ~= "table" then
    return nil
  end
  local text = item.textEdit.newText
  if type(text) ~= "string" then
    return nil
  end
  -- A CRLF buffer's suggestion has "\r\n": Neovim's lines have no line breaks.
  return vim.split((text:gsub("\r\n?", "\n")), "\n", { plain = true })
end

-- The line and cursor (0-based row, byte column) of the buffer's last response, as vim.lsp.completion converts its
-- items: in its response handler, with the cursor where the request was made. By buffer.
local converted = {}

-- vim.lsp.completion makes a plain-text item's word of its text up to the first whitespace (an item is usually a
-- name): of a suggestion, a line of code, that is its first word, and on an indented empty line (the edit starts at
-- the line start) nothing at all, so the indentation was replaced by nothing. The word is the first line instead.
local function convert_item(item)
  local lines = suggestion_lines(item)
  if not lines then
    return {}
  end
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  converted[vim.api.nvim_get_current_buf()] = { row = row - 1, col = col, line = vim.api.nvim_get_current_line() }
  return { word = lines[1] }
end

-- The text after the request's cursor that an accepted suggestion's edit replaces: Neovim replaces only up to the
-- cursor, but the edit may go on, over the closers the suggestion writes itself (`foo(|);` answered `a, b);`) or the
-- rest of a blank line's indentation. Left there, they came twice (`foo(a, b););`), or as trailing spaces. "" if none.
local function covered_after_cursor(bufnr, item, client_id)
  local at, range = converted[bufnr], vim.tbl_get(item, "textEdit", "range")
  local client = vim.lsp.get_client_by_id(client_id or -1)
  if not (at and range and client) or range["end"].line ~= at.row or range.start.line ~= at.row then
    return ""
  end
  local ok, stop = pcall(vim.str_byteindex, at.line, client.offset_encoding or "utf-16", range["end"].character, false)
  if not ok or stop <= at.col then
    return ""
  end
  return at.line:sub(at.col + 1, stop)
end

-- Once a suggestion is accepted (<C-y>): the text its edit replaces after the cursor goes, and, since a word has one
-- line, a multi-line suggestion's other lines go after its first one.
local function complete_rest(bufnr)
  vim.api.nvim_create_autocmd("CompleteDone", {
    group = vim.api.nvim_create_augroup("m31r.completion." .. bufnr, { clear = true }),
    buffer = bufnr,
    desc = "M31R: complete the edit of an accepted suggestion (the text it replaces after the cursor, its other lines)",
    callback = function()
      if (vim.v.event or {}).reason ~= "accept" then
        return
      end
      local lsp = vim.tbl_get(vim.v.completed_item, "user_data", "nvim", "lsp") or {}
      local lines = suggestion_lines(lsp.completion_item)
      if not lines then
        return
      end
      local row, col = unpack(vim.api.nvim_win_get_cursor(0))
      local covered = covered_after_cursor(bufnr, lsp.completion_item, lsp.client_id)
      local line = vim.api.nvim_get_current_line()
      if covered ~= "" and line:sub(col + 1, col + #covered) == covered then -- (still there as it was)
        vim.api.nvim_buf_set_text(bufnr, row - 1, col, row - 1, col + #covered, { "" })
      end
      if #lines < 2 then
        return
      end
      local rest = { "" }
      vim.list_extend(rest, lines, 2)
      vim.api.nvim_buf_set_text(bufnr, row - 1, col, row - 1, col, rest)
      vim.api.nvim_win_set_cursor(0, { row + #lines - 1, #lines[#lines] })
    end,
  })
end

-- Buffers served by the vim.lsp.completion fallback, whose own 'completeopt' holds "menuone".
local menuone_bufs = {}

local function cot_flags(value)
  return vim.split(value, ",", { plain = true, trimempty = true })
end

-- Without "menuone" the only match is inserted with no menu, so there is nothing to accept with <C-y>, and only a
-- multi-line suggestion's first line lands. 'completeopt' is global-local from 0.11 on: the buffer's own value is the
-- user's (their local value, else the global one) plus "menuone"; the global value is left alone. `:set cot=…` clears
-- local values, so this runs again on every change of the option.
local function ensure_menuone(bufnr)
  if not vim.api.nvim_buf_is_valid(bufnr) then
    menuone_bufs[bufnr] = nil
    return
  end
  local own = vim.api.nvim_get_option_value("completeopt", { buf = bufnr })
  local base = (own == "" or own == vim.b[bufnr].m31r_completeopt) and vim.go.completeopt or own
  local flags = cot_flags(base)
  if not vim.tbl_contains(flags, "menuone") then
    table.insert(flags, "menuone")
  end
  local value = table.concat(flags, ",")
  vim.b[bufnr].m31r_completeopt = value
  if value ~= own then
    vim.api.nvim_set_option_value("completeopt", value, { buf = bufnr })
  end
end

local function setup_menuone(bufnr)
  if not M.config.completion.menuone or not has_011 then
    return -- 0.10: 'completeopt' is global only
  end
  menuone_bufs[bufnr] = true
  ensure_menuone(bufnr)
end

-- Undoes on_attach in a buffer the client leaves (its filetype changed to one not served, the client stopped): the
-- completion source, the keys, the CompleteDone autocmd and the buffer's own 'completeopt'.
local function on_detach(client, bufnr)
  if not vim.api.nvim_buf_is_valid(bufnr) then
    previous[bufnr], menuone_bufs[bufnr], converted[bufnr] = nil, nil, nil
    return
  end
  if vim.lsp.completion and vim.lsp.completion.enable then
    pcall(vim.lsp.completion.enable, false, client.id, bufnr)
  end
  if vim.lsp.inline_completion then
    pcall(vim.lsp.inline_completion.enable, false, { bufnr = bufnr })
  end
  pcall(vim.api.nvim_del_augroup_by_name, "m31r.completion." .. bufnr)
  converted[bufnr] = nil
  local keys = M.config.inline
  for _, lhs in ipairs({ keys.accept, keys.next, keys.prev }) do
    if lhs and lhs ~= "" then
      local cur = vim.api.nvim_buf_call(bufnr, function()
        return vim.fn.maparg(lhs, "i", false, true)
      end)
      if cur.buffer == 1 and (cur.desc or ""):match("^M31R: ") then
        vim.keymap.del("i", lhs, { buffer = bufnr })
        local prev = (previous[bufnr] or {})[lhs]
        if prev and prev.buffer == 1 then -- the buffer's own mapping the plugin had taken over
          vim.api.nvim_buf_call(bufnr, function()
            vim.fn.mapset("i", false, prev)
          end)
        end
      end
    end
  end
  previous[bufnr] = nil
  if menuone_bufs[bufnr] then
    menuone_bufs[bufnr] = nil
    if vim.api.nvim_get_option_value("completeopt", { buf = bufnr }) == vim.b[bufnr].m31r_completeopt then
      vim.api.nvim_set_option_value("completeopt", "", { buf = bufnr }) -- empty: the global value again
    end
    vim.b[bufnr].m31r_completeopt = nil
  end
end

local function on_attach(client, bufnr)
  local cfg = M.config
  local inline_ok = cfg.inline.enabled
    and vim.lsp.inline_completion ~= nil
    and supports(client, "textDocument/inlineCompletion", bufnr)
  if inline_ok then
    setup_inline(client, bufnr)
  elseif cfg.completion.enabled and supports(client, "textDocument/completion", bufnr) then
    if vim.lsp.completion and vim.lsp.completion.enable then
      -- 0.11+: completion through vim.lsp.completion (also sets omnifunc-like behaviour).
      vim.lsp.completion.enable(
        true,
        client.id,
        bufnr,
        { autotrigger = cfg.completion.autotrigger, convert = convert_item }
      )
      complete_rest(bufnr)
      setup_menuone(bufnr)
    else
      -- 0.10: <C-x><C-o> through the LSP omnifunc.
      vim.bo[bufnr].omnifunc = "v:lua.vim.lsp.omnifunc"
    end
  end
  if cfg.on_attach then
    cfg.on_attach(client, bufnr)
  end
end

local function root_dir(bufnr)
  if vim.fs.root then
    local root = vim.fs.root(bufnr, M.config.root_markers)
    if root then
      return root
    end
  end
  return vim.fn.getcwd()
end

local function wanted(bufnr)
  if not vim.api.nvim_buf_is_valid(bufnr) or not vim.api.nvim_buf_is_loaded(bufnr) then
    return false
  end
  if vim.bo[bufnr].buftype ~= "" then
    return false
  end
  local name = vim.api.nvim_buf_get_name(bufnr)
  if name == "" or name:match("^%a[%w+.-]*://") then
    return false -- unnamed or non-file buffers (fugitive://, oil://, …)
  end
  local fts = M.config.filetypes
  if fts ~= nil then
    return vim.tbl_contains(fts, vim.bo[bufnr].filetype)
  end
  return true
end

--- Attach the M31R client to a buffer (started on first use, shared by all buffers).
function M.attach(bufnr)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  if not wanted(bufnr) then
    return nil
  end
  local cfg = M.config
  local settings = cfg.settings_resolved
  local cmd = server_cmd(cfg, settings)
  if failed then
    return nil
  end
  if vim.fn.executable(cmd[1]) ~= 1 then
    notify_once("exe", ("%q is not executable: put m31r on PATH (editors/README.md) or set cmd"):format(cmd[1]))
    return nil
  end
  local capabilities = vim.lsp.protocol.make_client_capabilities()
  if cfg.capabilities then
    capabilities = vim.tbl_deep_extend("force", capabilities, cfg.capabilities)
  end
  return vim.lsp.start({
    name = cfg.name,
    cmd = cmd,
    root_dir = root_dir(bufnr),
    init_options = vim.deepcopy(settings),
    settings = { m31r = vim.deepcopy(settings) },
    capabilities = capabilities,
    handlers = { ["m31r/status"] = on_status },
    on_attach = on_attach,
    on_init = function(client)
      initialized[client.id] = true
    end,
    on_exit = function(code, signal, client_id)
      local client = vim.lsp.get_client_by_id(client_id)
      local stopped = client and client._is_stopping -- asked to stop (:M31rRestart, :LspStop): no failure
      if not initialized[client_id] and not stopped and (code ~= 0 or signal ~= 0) then
        failed = true
        notify_once(
          "failed",
          ("%s exited (code %d, signal %d) before it started: see :LspLog; :M31rRestart tries again"):format(
            table.concat(cmd, " "),
            code,
            signal
          ),
          vim.log.levels.ERROR
        )
      end
      initialized[client_id] = nil
    end,
  }, {
    bufnr = bufnr,
    -- One server for every buffer: it holds a single daemon connection.
    reuse_client = function(client, config)
      return client.name == config.name and not (client.is_stopped and client_call(client, "is_stopped"))
    end,
  })
end

local function push_settings()
  local settings = M.config.settings_resolved
  for _, client in ipairs(clients()) do
    client.settings = { m31r = vim.deepcopy(settings) }
    client_call(client, "notify", "workspace/didChangeConfiguration", { settings = client.settings })
  end
end

--- Change server settings at run time, e.g. `require("m31r").set({ multiline = "never" })`.
function M.set(settings)
  M.config.settings = vim.tbl_extend("force", M.config.settings or {}, settings or {})
  M.config.settings_resolved = M.server_settings(M.config.settings)
  push_settings()
end

--- Turn completions on/off (the server is told through settings.m31r.enable).
function M.toggle(enable)
  if enable == nil then
    enable = not M.config.settings_resolved.enable
  end
  M.set({ enable = enable })
  if vim.lsp.inline_completion and M.config.inline.enabled then
    for _, client in ipairs(clients()) do
      for bufnr in pairs(client.attached_buffers or {}) do
        pcall(vim.lsp.inline_completion.enable, enable, { bufnr = bufnr })
      end
    end
  end
  vim.notify("m31r: completions " .. (enable and "enabled" or "disabled"))
  pcall(vim.cmd.redrawstatus)
end

--- Stop the server and start it again for every buffer that should have it.
function M.restart()
  warned.exe, warned.failed, failed = nil, nil, nil -- asked for: try again, and say again why no server starts
  local old = clients()
  for _, client in ipairs(old) do
    client_call(client, "stop")
  end
  M.status = nil
  local tries = 0
  local function again()
    tries = tries + 1
    local alive = vim.tbl_filter(function(c)
      return not client_call(c, "is_stopped")
    end, old)
    if #alive > 0 and tries < 40 then
      vim.defer_fn(again, 50)
      return
    end
    for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
      M.attach(bufnr)
    end
  end
  vim.defer_fn(again, 50)
end

local function describe()
  local lines = {}
  local cs = clients()
  table.insert(lines, ("clients: %d"):format(#cs))
  for _, c in ipairs(cs) do
    local caps = c.server_capabilities or {}
    table.insert(
      lines,
      ("  id %d, cmd %s, inlineCompletion %s, completion %s"):format(
        c.id,
        table.concat(c.config.cmd or {}, " "),
        tostring(caps.inlineCompletionProvider ~= nil),
        tostring(caps.completionProvider ~= nil)
      )
    )
  end
  table.insert(lines, "status: " .. vim.inspect(M.status))
  table.insert(lines, "settings: " .. vim.inspect(M.config.settings_resolved))
  table.insert(lines, "native inline completion: " .. tostring(vim.lsp.inline_completion ~= nil))
  return table.concat(lines, "\n")
end

function M.setup(opts)
  opts = opts or {}
  local cfg = vim.tbl_deep_extend("force", vim.deepcopy(M.defaults), opts)
  -- Lists replace rather than merge.
  if opts.cmd ~= nil then
    cfg.cmd = opts.cmd
  end
  if opts.filetypes ~= nil then
    cfg.filetypes = opts.filetypes
  end
  if opts.root_markers ~= nil then
    cfg.root_markers = opts.root_markers
  end
  if type(cfg.filetypes) == "string" then
    cfg.filetypes = { cfg.filetypes }
  end
  if cfg.filetypes and vim.tbl_contains(cfg.filetypes, "*") then
    cfg.filetypes = nil -- every filetype, and buffers without one
  end
  local settings = vim.deepcopy(cfg.settings or {})
  if cfg.socket and cfg.socket ~= "" then
    settings.socket = cfg.socket
  elseif settings.socket == nil and type(cfg.cmd) == "table" then
    -- `cmd = { "m31r", "lsp", "--socket", PATH }`: tell the server the same socket,
    -- since an empty `socket` setting means "the default socket".
    for i, arg in ipairs(cfg.cmd) do
      if arg == "--socket" and type(cfg.cmd[i + 1]) == "string" then
        settings.socket = cfg.cmd[i + 1]
      end
    end
  end
  cfg.settings = settings
  cfg.settings_resolved = M.server_settings(settings)
  M.config = cfg
  warned.exe, warned.failed, failed = nil, nil, nil -- a new command may start

  group = vim.api.nvim_create_augroup("m31r", { clear = true })
  vim.api.nvim_create_autocmd("FileType", {
    group = group,
    desc = "M31R: attach the language server (and leave a buffer whose new filetype is not served)",
    callback = function(args)
      if wanted(args.buf) then
        M.attach(args.buf)
      else
        for _, client in ipairs(vim.lsp.get_clients({ name = cfg.name, bufnr = args.buf })) do
          vim.lsp.buf_detach_client(args.buf, client.id)
        end
      end
    end,
  })
  vim.api.nvim_create_autocmd("LspDetach", {
    group = group,
    desc = "M31R: undo the buffer's completion setup",
    callback = function(args)
      local client = vim.lsp.get_client_by_id(args.data.client_id)
      if client and client.name == cfg.name then
        on_detach(client, args.buf)
      end
    end,
  })
  vim.api.nvim_create_autocmd("BufEnter", {
    group = group,
    desc = "M31R: attach buffers without a filetype",
    callback = function(args)
      if cfg.filetypes == nil and vim.bo[args.buf].filetype == "" then
        M.attach(args.buf)
      end
    end,
  })

  menuone_bufs = {} -- attached again below, with this setup's `completion.menuone`
  vim.api.nvim_create_autocmd("OptionSet", {
    group = group,
    pattern = "completeopt",
    desc = "M31R: keep \"menuone\" in 'completeopt' of the buffers with the completion fallback",
    callback = function()
      for buf in pairs(menuone_bufs) do
        ensure_menuone(buf)
      end
    end,
  })

  vim.api.nvim_create_user_command("M31rToggle", function()
    M.toggle()
  end, { desc = "M31R: toggle completions", force = true })
  vim.api.nvim_create_user_command("M31rEnable", function()
    M.toggle(true)
  end, { desc = "M31R: enable completions", force = true })
  vim.api.nvim_create_user_command("M31rDisable", function()
    M.toggle(false)
  end, { desc = "M31R: disable completions", force = true })
  vim.api.nvim_create_user_command("M31rRestart", function()
    M.restart()
  end, { desc = "M31R: restart the language server", force = true })
  vim.api.nvim_create_user_command("M31rInfo", function()
    vim.notify(describe())
  end, { desc = "M31R: show client, status and settings", force = true })

  -- Buffers that were opened before setup() ran (lazy loading).
  for _, bufnr in ipairs(vim.api.nvim_list_bufs()) do
    if vim.api.nvim_buf_is_loaded(bufnr) then
      M.attach(bufnr)
    end
  end
  return M
end

return M
