// package.json's contributes.configuration must agree with src/settings.ts,
// and the manifest must carry what VS Code needs to load the extension.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync, existsSync } from 'node:fs';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const s = require('../out/settings.js');
const pkg = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8'));
// vscode-languageclient's `exports` map hides package.json and lib/: read them by path.
const lcDir = new URL('../node_modules/vscode-languageclient/', import.meta.url);
const lc = JSON.parse(readFileSync(new URL('package.json', lcDir), 'utf8'));
const props = pkg.contributes.configuration.properties;

test('every server setting is contributed with the same default', () => {
  for (const [key, dflt] of Object.entries(s.DEFAULTS)) {
    const p = props[`m31r.${key}`];
    assert.ok(p, `m31r.${key} missing from contributes.configuration`);
    assert.deepEqual(p.default, dflt, `default of m31r.${key}`);
    assert.ok(p.description || p.markdownDescription, `m31r.${key} has no description`);
  }
});

test('client settings are contributed with the same defaults', () => {
  assert.equal(props['m31r.path'].default, s.CLIENT_DEFAULTS.path);
  assert.deepEqual(props['m31r.languages'].default, [...s.CLIENT_DEFAULTS.languages]);
  assert.equal(props['m31r.completionMenu'].type, 'boolean');
  assert.equal(props['m31r.completionMenu'].default, s.CLIENT_DEFAULTS.completionMenu);
  assert.equal(props['m31r.completionMenu'].default, false, 'the suggestion menu item is opt-in');
  assert.ok(props['m31r.completionMenu'].markdownDescription);
  assert.deepEqual(props['m31r.trace.server'].enum, [...s.TRACE_LEVELS]);
  assert.equal(props['m31r.trace.server'].default, s.CLIENT_DEFAULTS.traceServer);
});

test('enums and ranges agree', () => {
  assert.deepEqual(props['m31r.debounceMode'].enum, [...s.DEBOUNCE_MODES]);
  assert.deepEqual(props['m31r.multiline'].enum, [...s.MULTILINE_MODES]);
  assert.equal(props['m31r.debounceMode'].enumDescriptions.length, s.DEBOUNCE_MODES.length);
  assert.equal(props['m31r.multiline'].enumDescriptions.length, s.MULTILINE_MODES.length);
  for (const [key, range] of Object.entries(s.RANGES)) {
    assert.equal(props[`m31r.${key}`].type, 'integer');
    assert.equal(props[`m31r.${key}`].minimum, range.minimum, `minimum of m31r.${key}`);
    assert.equal(props[`m31r.${key}`].maximum, range.maximum, `maximum of m31r.${key}`);
  }
});

test('beams is contributed as the code reads it', () => {
  assert.deepEqual(props['m31r.beams'].type, ['integer', 'null']);
  assert.equal(props['m31r.beams'].default, s.DEFAULTS.beams);
  assert.equal(props['m31r.beams'].minimum, s.BEAMS_RANGE.minimum);
  assert.equal(props['m31r.beams'].maximum, s.BEAMS_RANGE.maximum);
  assert.equal(props['m31r.minProbability'].minimum, 0);
  assert.equal(props['m31r.minProbability'].maximum, 1);
  assert.equal(props['m31r.minProbability'].default, s.DEFAULTS.minProbability);
});

test('settings are read at the window level; path and socket are per machine', () => {
  // The extension reads `getConfiguration('m31r')` without a resource, i.e. the window's value: one `m31r lsp` serves
  // every folder of a multi-root workspace. No setting but path and socket may have a scope VS Code lets a folder set
  // ("resource", "language-overridable"; FOLDER_SCOPES in
  // src/vs/workbench/services/configuration/common/configuration.ts). No scope at all means "window".
  const machine = new Set(['m31r.path', 'm31r.socket']);
  for (const [key, p] of Object.entries(props)) {
    if (machine.has(key)) continue;
    assert.ok([undefined, 'window'].includes(p.scope), `${key} has scope ${JSON.stringify(p.scope)}`);
  }
  // The server's command line names files on the machine the extension host runs on: in a remote window a value from
  // the local user settings (a local absolute path) must not apply. VS Code reads local user settings there for
  // LOCAL_MACHINE_SCOPES only (application, window, resource, language-overridable); "machine-overridable" is read
  // from the remote user settings and, unlike "machine", from the workspace too (WORKSPACE_SCOPES), so a workspace may
  // still set them. It is also kept out of Settings Sync, which would carry one machine's path to another.
  assert.equal(props['m31r.path'].scope, 'machine-overridable');
  assert.equal(props['m31r.socket'].scope, 'machine-overridable');
  // Their workspace values are not applied until the workspace is trusted.
  assert.deepEqual([...pkg.capabilities.untrustedWorkspaces.restrictedConfigurations].sort(), ['m31r.path', 'm31r.socket']);
});

test('no contributed m31r.* setting is unknown to the code', () => {
  const known = new Set([
    ...Object.keys(s.DEFAULTS),
    ...Object.keys(s.CLIENT_DEFAULTS).filter((k) => k !== 'traceServer'),
    'trace.server',
  ]);
  for (const key of Object.keys(props)) {
    assert.ok(key.startsWith('m31r.'), key);
    assert.ok(known.has(key.slice(5)), `${key} is contributed but not handled`);
  }
});

test('commands, activation and engine', () => {
  const cmds = pkg.contributes.commands.map((c) => c.command).sort();
  assert.deepEqual(cmds, ['m31r.restart', 'm31r.showOutput', 'm31r.toggle']);
  // Rust only: the extension (and its server process) must not start in windows without Rust files.
  assert.deepEqual(pkg.activationEvents, ['onLanguage:rust']);
  assert.deepEqual(s.CLIENT_DEFAULTS.languages, ['rust'], 'the default selector matches the activation event');
  assert.equal(pkg.main, './out/extension.js');
  // engines.vscode must be at least the @types/vscode we compile against.
  const engine = pkg.engines.vscode.replace(/^[\^~>=]+/, '');
  const types = pkg.devDependencies['@types/vscode'].replace(/^[\^~>=]+/, '');
  const cmp = (a, b) => {
    const [x, y] = [a.split('.').map(Number), b.split('.').map(Number)];
    for (let i = 0; i < 3; i++) if (x[i] !== y[i]) return x[i] - y[i];
    return 0;
  };
  assert.ok(cmp(engine, types) >= 0, `engines.vscode ${engine} < @types/vscode ${types}`);
  // vscode-languageclient's own engine requirement must be met too.
  const lcEngine = lc.engines.vscode.replace(/^[\^~>=]+/, '');
  assert.ok(cmp(engine, lcEngine) >= 0, `engines.vscode ${engine} < vscode-languageclient's ${lcEngine}`);
});

test('vscode-languageclient registers inline completion as a built-in feature', () => {
  // LSP 3.18 textDocument/inlineCompletion is part of the default feature set
  // from vscode-languageclient 10 on; make sure an upgrade/downgrade keeps it.
  assert.ok(Number(lc.version.split('.')[0]) >= 10, `vscode-languageclient ${lc.version} < 10`);
  const src = readFileSync(new URL('lib/common/client.js', lcDir), 'utf8');
  assert.match(src, /registerFeature\(new inlineCompletion_1\.InlineCompletionItemFeature\(this\)\)/);
});

test("vscode-languageclient traces only at its trace channel's Trace log level (what TraceChannel relies on)", () => {
  // The fake client (support/fake-languageclient.cjs, effectiveTrace) mirrors this rule; if an upgrade changes it,
  // revisit TraceChannel in src/extension.ts and the fake.
  const src = readFileSync(new URL('lib/common/client.js', lcDir), 'utf8');
  assert.match(src, /let trace = this\._traceLogLevel !== vscode_1\.LogLevel\.Trace \? [\w.]+Trace\.Off/);
  assert.match(src, /this\.traceOutputChannel\.trace\(/);
  assert.match(src, /this\._traceOutputChannel = clientOptions\.traceOutputChannel;/);
});

test('packaging files exist', () => {
  for (const f of ['README.md', 'LICENSE', '.vscodeignore', 'package-lock.json']) {
    assert.ok(existsSync(new URL(`../${f}`, import.meta.url)), `${f} missing`);
  }
});

test('the docs name every setting, and only commands that exist', () => {
  const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8');
  for (const key of Object.keys(props)) {
    assert.ok(readme.includes(`| \`${key}\` |`), `${key} is missing from README.md's settings table`);
  }
  // Commands as the palette shows them ("Category: Title"), wherever the docs and the status bar name one.
  const titles = new Set(pkg.contributes.commands.map((c) => `${c.category}: ${c.title}`));
  const st = require('../out/status.js');
  const tooltips = ['failed', 'stopped', 'running']
    .map((client) => st.statusView({ client, enabled: true }).tooltip)
    .join('\n');
  const editors = readFileSync(new URL('../../README.md', import.meta.url), 'utf8');
  const named = [
    ...tooltips.matchAll(/"(M31R: [^"]+)"/g),
    ...readme.matchAll(/\*{1,2}(M31R: [^*]+)\*{1,2}/g),
    ...editors.matchAll(/`(M31R: [^`]+)`/g),
  ].map((m) => m[1]);
  assert.ok(named.length >= 5, `found only ${named}`);
  for (const name of named) assert.ok(titles.has(name), `"${name}" is not a command (${[...titles].join(', ')})`);
});
