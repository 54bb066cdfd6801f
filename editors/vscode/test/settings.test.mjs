// Unit tests for src/settings.ts (compiled to out/settings.js).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const s = require('../out/settings.js');

const DEFAULT_SERVER = {
  enable: true,
  debounceMs: 75,
  debounceMode: 'adaptive',
  multiline: 'auto',
  deadlineMs: 800,
  maxTokens: 64,
  beams: null,
  projectContext: false,
  minProbability: 0.05,
  socket: '',
};

test('defaults match the server contract', () => {
  assert.deepEqual({ ...s.DEFAULTS }, DEFAULT_SERVER);
  assert.deepEqual(s.toServerSettings(undefined), { value: DEFAULT_SERVER, warnings: [] });
  assert.deepEqual(s.toServerSettings({}), { value: DEFAULT_SERVER, warnings: [] });
});

test('valid values pass through unchanged', () => {
  const cfg = {
    enable: false,
    debounceMs: 0,
    debounceMode: 'fixed',
    multiline: 'never',
    deadlineMs: 1500,
    maxTokens: 128,
    beams: 2,
    projectContext: true,
    minProbability: 0.2,
    socket: '/run/user/1000/m31r/m31rd.sock',
  };
  assert.deepEqual(s.toServerSettings(cfg), { value: cfg, warnings: [] });
});

test('beams: null is the daemon default, widths are clamped to 1..8, junk is reported', () => {
  assert.equal(s.toServerSettings({ beams: null }).value.beams, null);
  assert.equal(s.toServerSettings({ beams: '3' }).value.beams, 3);
  let r = s.toServerSettings({ beams: 20 });
  assert.equal(r.value.beams, s.BEAMS_RANGE.maximum);
  assert.match(r.warnings[0], /m31r\.beams/);
  r = s.toServerSettings({ beams: 'wide' });
  assert.equal(r.value.beams, null);
  assert.equal(r.warnings.length, 1);
});

test('minProbability: a probability, clamped to 0..1, junk reported and replaced by the default', () => {
  assert.equal(s.toServerSettings({ minProbability: 0 }).value.minProbability, 0);
  assert.equal(s.toServerSettings({ minProbability: '0.3' }).value.minProbability, 0.3);
  let r = s.toServerSettings({ minProbability: 1.5 });
  assert.equal(r.value.minProbability, 1);
  assert.match(r.warnings[0], /m31r\.minProbability/);
  r = s.toServerSettings({ minProbability: 'sure' });
  assert.equal(r.value.minProbability, s.DEFAULTS.minProbability);
  assert.equal(r.warnings.length, 1);
});

test('client-only keys are never sent to the server', () => {
  const { value } = s.toServerSettings({
    path: '/bin/m31r',
    languages: ['rust'],
    completionMenu: true,
    trace: { server: 'verbose' },
  });
  assert.deepEqual(Object.keys(value).sort(), Object.keys(DEFAULT_SERVER).sort());
});

test('reads a vscode.WorkspaceConfiguration-like object through get()', () => {
  const bag = { maxTokens: 32, multiline: 'always' };
  const cfg = { get: (k) => bag[k], has: () => true };
  const { value, warnings } = s.toServerSettings(cfg);
  assert.equal(value.maxTokens, 32);
  assert.equal(value.multiline, 'always');
  assert.equal(value.debounceMs, 75);
  assert.deepEqual(warnings, []);
});

test('numbers: rounded, clamped, numeric strings accepted, junk replaced by defaults', () => {
  let r = s.toServerSettings({ debounceMs: 12.6, maxTokens: '16' });
  assert.equal(r.value.debounceMs, 13);
  assert.equal(r.value.maxTokens, 16);
  assert.deepEqual(r.warnings, []);

  r = s.toServerSettings({ debounceMs: -5, deadlineMs: 1e9, maxTokens: 0 });
  assert.equal(r.value.debounceMs, s.RANGES.debounceMs.minimum);
  assert.equal(r.value.deadlineMs, s.RANGES.deadlineMs.maximum);
  assert.equal(r.value.maxTokens, s.RANGES.maxTokens.minimum);
  assert.equal(r.warnings.length, 3);

  r = s.toServerSettings({ deadlineMs: 'soon', maxTokens: Number.NaN, debounceMs: {} });
  assert.equal(r.value.deadlineMs, 800);
  assert.equal(r.value.maxTokens, 64);
  assert.equal(r.value.debounceMs, 75);
  assert.equal(r.warnings.length, 3);
  assert.match(r.warnings[0], /m31r\.debounceMs/);
});

test('numbers: a blank string is unset like an empty one (Number("  ") is 0), hex and booleans are junk', () => {
  let r = s.toServerSettings({ debounceMs: '  ', deadlineMs: ' ', maxTokens: '\t', beams: ' ', minProbability: '  ' });
  assert.deepEqual(
    [r.value.debounceMs, r.value.deadlineMs, r.value.maxTokens, r.value.beams, r.value.minProbability],
    [75, 800, 64, null, 0.05],
  );
  assert.deepEqual(r.warnings, []);

  r = s.toServerSettings({ debounceMs: '0x10', beams: '0b11', minProbability: '0x1', maxTokens: true, deadlineMs: ' 900 ' });
  assert.deepEqual(
    [r.value.debounceMs, r.value.beams, r.value.minProbability, r.value.maxTokens, r.value.deadlineMs],
    [75, null, 0.05, 64, 900],
  );
  assert.equal(r.warnings.length, 4);
  assert.equal(s.toServerSettings({ minProbability: '.5', maxTokens: '1e2' }).value.maxTokens, 100);
  assert.equal(s.toServerSettings({ minProbability: '.5' }).value.minProbability, 0.5);
});

test('enums: case-insensitive, invalid → default with a warning', () => {
  let r = s.toServerSettings({ multiline: 'Always', debounceMode: ' FIXED ' });
  assert.equal(r.value.multiline, 'always');
  assert.equal(r.value.debounceMode, 'fixed');
  assert.deepEqual(r.warnings, []);
  r = s.toServerSettings({ multiline: 'sometimes', debounceMode: 3 });
  assert.equal(r.value.multiline, 'auto');
  assert.equal(r.value.debounceMode, 'adaptive');
  assert.equal(r.warnings.length, 2);
});

test('booleans: strings "true"/"false" accepted, others → default', () => {
  assert.equal(s.toServerSettings({ enable: 'false' }).value.enable, false);
  const r = s.toServerSettings({ enable: 'nope' });
  assert.equal(r.value.enable, true);
  assert.equal(r.warnings.length, 1);
});

test('socket: trimmed, ~ expanded, non-strings rejected', () => {
  assert.equal(s.toServerSettings({ socket: '  /tmp/x.sock ' }).value.socket, '/tmp/x.sock');
  assert.equal(s.toServerSettings({ socket: '~/m31r.sock' }, '/home/u').value.socket, '/home/u/m31r.sock');
  assert.equal(s.toServerSettings({ socket: '~/m31r.sock' }).value.socket, '~/m31r.sock');
  const r = s.toServerSettings({ socket: 42 });
  assert.equal(r.value.socket, '');
  assert.equal(r.warnings.length, 1);
});

test('client settings: path and languages', () => {
  assert.deepEqual(s.toClientSettings({}).value, {
    path: 'm31r',
    languages: ['rust'],
    completionMenu: false,
    traceServer: 'off',
  });
  assert.deepEqual(s.toClientSettings({ path: '' }).value.path, 'm31r');
  assert.equal(s.toClientSettings({ path: '~/.local/bin/m31r' }, '/home/u/').value.path, '/home/u/.local/bin/m31r');
  assert.deepEqual(s.toClientSettings({ languages: ['rust', ' rust ', 'toml'] }).value.languages, ['rust', 'toml']);
  assert.deepEqual(s.toClientSettings({ languages: [] }).value.languages, ['rust'], 'empty: the default');
  assert.deepEqual(s.toClientSettings({ languages: ['*'] }).value.languages, ['*'], 'opting in to every language');
  assert.deepEqual(s.toClientSettings({ languages: null }).value.languages, ['rust']);
  const bad = s.toClientSettings({ languages: 7 });
  assert.deepEqual(bad.value.languages, ['rust']);
  assert.equal(bad.warnings.length, 1);
  assert.deepEqual(s.toClientSettings({ languages: 'rust' }).value.languages, ['rust']);
  const r = s.toClientSettings({ languages: ['rust', 5] });
  assert.deepEqual(r.value.languages, ['rust']);
  assert.equal(r.warnings.length, 1);
});

test('client settings: trace.server is read as VS Code stores it (the key "trace.server")', () => {
  assert.equal(s.toClientSettings({ 'trace.server': 'verbose' }).value.traceServer, 'verbose');
  assert.equal(s.toClientSettings({ get: (k) => ({ 'trace.server': 'messages' })[k] }).value.traceServer, 'messages');
  const bad = s.toClientSettings({ 'trace.server': 'loud' });
  assert.equal(bad.value.traceServer, 'off');
  assert.match(bad.warnings.join('\n'), /trace\.server/);
  // As vscode-languageclient reads it too: any case, and the object form {verbosity, format}.
  let r = s.toClientSettings({ 'trace.server': 'Verbose' });
  assert.deepEqual([r.value.traceServer, r.warnings], ['verbose', []]);
  r = s.toClientSettings({ 'trace.server': { verbosity: 'messages', format: 'json' } });
  assert.deepEqual([r.value.traceServer, r.warnings], ['messages', []]);
  r = s.toClientSettings({ 'trace.server': { verbosity: 'off' } });
  assert.deepEqual([r.value.traceServer, r.warnings], ['off', []]);
  r = s.toClientSettings({ 'trace.server': { format: 'json' } });
  assert.deepEqual([r.value.traceServer, r.warnings], ['messages', []], 'verbosity "messages" if absent, as the client');
  for (const junk of [{ verbosity: 'loud' }, ['verbose'], 3]) {
    r = s.toClientSettings({ 'trace.server': junk });
    assert.equal(r.value.traceServer, 'off');
    assert.match(r.warnings.join('\n'), /trace\.server/, JSON.stringify(junk));
  }
});

test('client settings: completionMenu is off by default, booleans as elsewhere', () => {
  assert.equal(s.CLIENT_DEFAULTS.completionMenu, false);
  assert.deepEqual(s.toClientSettings(undefined), {
    value: { path: 'm31r', languages: ['rust'], completionMenu: false, traceServer: 'off' },
    warnings: [],
  });
  assert.equal(s.toClientSettings({ completionMenu: null }).value.completionMenu, false);
  assert.equal(s.toClientSettings({ completionMenu: true }).value.completionMenu, true);
  assert.equal(s.toClientSettings({ completionMenu: 'true' }).value.completionMenu, true);
  assert.equal(s.toClientSettings({ completionMenu: 'false' }).value.completionMenu, false);
  const cfg = { get: (k) => ({ completionMenu: true })[k] };
  assert.equal(s.toClientSettings(cfg).value.completionMenu, true, 'through get()');
  const r = s.toClientSettings({ completionMenu: 'yes' });
  assert.equal(r.value.completionMenu, false);
  assert.equal(r.warnings.length, 1);
  assert.match(r.warnings[0], /m31r\.completionMenu/);
});

test('server command line: lsp [--socket PATH]', () => {
  assert.deepEqual(s.serverArgs({ socket: '' }), ['lsp']);
  assert.deepEqual(s.serverArgs({ socket: '/tmp/d.sock' }), ['lsp', '--socket', '/tmp/d.sock']);
});

test('document selector: "*" = every language on file and untitled', () => {
  assert.deepEqual(s.documentSelector(['*']), [{ scheme: 'file' }, { scheme: 'untitled' }]);
  assert.deepEqual(s.documentSelector(['rust', '*']), [{ scheme: 'file' }, { scheme: 'untitled' }]);
  assert.deepEqual(s.documentSelector([]), [{ scheme: 'file' }, { scheme: 'untitled' }]);
  assert.deepEqual(s.documentSelector(['rust']), [
    { scheme: 'file', language: 'rust' },
    { scheme: 'untitled', language: 'rust' },
  ]);
  assert.deepEqual(s.documentSelector(['rust', 'toml']), [
    { scheme: 'file', language: 'rust' },
    { scheme: 'untitled', language: 'rust' },
    { scheme: 'file', language: 'toml' },
    { scheme: 'untitled', language: 'toml' },
  ]);
});

test('needsRestart only for path, socket and languages', () => {
  const base = { client: { path: 'm31r', languages: ['rust'], completionMenu: false }, server: { ...DEFAULT_SERVER } };
  const clone = () => structuredClone(base);
  assert.equal(s.needsRestart(base, clone()), false);
  let n = clone();
  n.server.maxTokens = 8;
  n.server.enable = false;
  n.client.completionMenu = true;
  assert.equal(s.needsRestart(base, n), false);
  n = clone();
  n.client.path = '/opt/m31r';
  assert.equal(s.needsRestart(base, n), true);
  n = clone();
  n.server.socket = '/tmp/s';
  assert.equal(s.needsRestart(base, n), true);
  n = clone();
  n.client.languages = ['rust', 'toml'];
  assert.equal(s.needsRestart(base, n), true);
});

test('workspace/configuration items are answered from the validated settings', () => {
  const settings = { ...DEFAULT_SERVER, maxTokens: 9 };
  assert.deepEqual(s.configurationItem('m31r', settings), settings);
  assert.equal(s.configurationItem('m31r.maxTokens', settings), 9);
  assert.equal(s.configurationItem('m31r.path', settings), undefined);
  assert.equal(s.configurationItem('m31r.completionMenu', settings), undefined, 'client-only');
  assert.equal(s.configurationItem('rust-analyzer', settings), undefined);
  assert.equal(s.configurationItem(undefined, settings), undefined);
});
