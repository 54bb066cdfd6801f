// Drives out/extension.js with fake `vscode` and `vscode-languageclient/node`
// modules (see support/): checks how the client is built, that settings are
// validated before they reach the server, the status bar, and the commands.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
require('./support/hook.cjs');
const vscode = require('vscode');
const lc = require('vscode-languageclient/node');
const ext = require('../out/extension.js');

// vscode-languageclient 11's State has StartFailed (4); the fake predates it.
lc.State.StartFailed ??= 4;

const fake = vscode.__fake.state;
const clients = lc.__fake.instances;
let controller;

function resetFakes() {
  fake.user = {};
  fake.workspace = {};
  fake.remote = false;
  fake.remoteUser = {};
  fake.workspaceFile = undefined;
  fake.folders = [];
  fake.folderSettings = {};
  fake.updates.length = 0;
  fake.updateDelayMs = 0;
  fake.updateError = undefined;
  fake.messages.length = 0;
  fake.statusItems.length = 0;
  fake.outputs.length = 0;
  clients.length = 0;
  Object.assign(lc.__fake.behaviour, { failStart: false, hangStart: false, startDelayMs: 0, stopDelayMs: 0 });
  if (ext.TIMINGS) Object.assign(ext.TIMINGS, timings);
}

const timings = { ...ext.TIMINGS };
/** How long a stop waits for a server still starting before it kills it (short here). */
function setStartGrace(ms) {
  if (ext.TIMINGS) ext.TIMINGS.startGraceMs = ms;
}

/** Ends the previous test's controller; a server left hanging in `initialize` is killed first, so that a test that
 * failed on a hang does not hang the ones after it. */
async function closeController() {
  lc.__fake.behaviour.hangStart = false;
  for (const c of clients) if (c.state === lc.State.Starting) c.kill();
  if (controller) {
    controller.dispose();
    await controller.whenIdle();
  }
  controller = undefined;
}

async function activate(user = {}) {
  await closeController();
  resetFakes();
  Object.assign(fake.user, user);
  const context = { subscriptions: [] };
  controller = ext.activate(context);
  await controller.whenIdle();
  return { context, item: fake.statusItems[0], client: clients.at(-1) };
}

const tick = () => new Promise((r) => setImmediate(r));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** `promise`, or a failure naming `what` once `ms` have passed. */
async function within(ms, promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: still pending after ${ms} ms`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

/** Activates without waiting for the server to start. */
async function activateNoWait(user = {}, behaviour = {}) {
  await closeController();
  resetFakes();
  Object.assign(lc.__fake.behaviour, behaviour);
  Object.assign(fake.user, user);
  controller = ext.activate({ subscriptions: [] });
  await tick(); // the queued start has created its client
  return { item: fake.statusItems[0], client: clients.at(-1) };
}

const warnings = () => fake.outputs[0].lines.filter(([lvl]) => lvl === 'warn' || lvl === 'error').map(([, m]) => m);

test('starts `m31r lsp` over stdio with defaults', async () => {
  const { client, context } = await activate();
  assert.equal(clients.length, 1);
  assert.equal(client.id, 'm31r');
  assert.deepEqual(client.serverOptions, { command: 'm31r', args: ['lsp'] });
  assert.equal(client.serverOptions.transport, undefined, 'stdio transport');
  // Rust only by default: the model knows no other language.
  assert.deepEqual(client.clientOptions.documentSelector, [
    { scheme: 'file', language: 'rust' },
    { scheme: 'untitled', language: 'rust' },
  ]);
  assert.deepEqual(client.clientOptions.synchronize, { configurationSection: 'm31r' });
  assert.deepEqual(client.clientOptions.initializationOptions(), {
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
  });
  assert.deepEqual([...fake.commands.keys()].sort(), ['m31r.restart', 'm31r.showOutput', 'm31r.toggle']);
  assert.ok(context.subscriptions.length >= 1);
  assert.equal(controller.state.client, 'running');
});

test('path, socket and languages shape the command line and selector', async () => {
  const { client } = await activate({
    'm31r.path': '/opt/m31r/bin/m31r',
    'm31r.socket': '/tmp/m31rd.sock',
    'm31r.languages': ['rust', 'toml'],
    'm31r.maxTokens': 99999,
  });
  assert.deepEqual(client.serverOptions, { command: '/opt/m31r/bin/m31r', args: ['lsp', '--socket', '/tmp/m31rd.sock'] });
  assert.deepEqual(client.clientOptions.documentSelector, [
    { scheme: 'file', language: 'rust' },
    { scheme: 'untitled', language: 'rust' },
    { scheme: 'file', language: 'toml' },
    { scheme: 'untitled', language: 'toml' },
  ]);
  const init = client.clientOptions.initializationOptions();
  assert.equal(init.socket, '/tmp/m31rd.sock');
  assert.equal(init.maxTokens, 4096, 'clamped');
  assert.equal('path' in init, false);
  assert.equal('languages' in init, false);
  assert.ok(fake.messages.some(([kind, m]) => kind === 'warning' && /maxTokens/.test(m)));
});

test('remote window: local user path and socket do not apply there; remote user and workspace ones do', async () => {
  const local = { 'm31r.path': '/Users/me/bin/m31r', 'm31r.socket': '/Users/me/m31rd.sock', 'm31r.maxTokens': 32 };
  await closeController();
  resetFakes();
  fake.remote = true;
  Object.assign(fake.user, local);
  controller = ext.activate({ subscriptions: [] });
  await controller.whenIdle();
  // The local machine's files do not exist on the remote one: `m31r` from the remote PATH, the default socket.
  assert.deepEqual(clients.at(-1).serverOptions, { command: 'm31r', args: ['lsp'] });
  // Other (window-scoped) settings still follow the user from the local settings.
  assert.equal(clients.at(-1).clientOptions.initializationOptions().maxTokens, 32);

  fake.remoteUser['m31r.path'] = '/home/me/bin/m31r';
  vscode.__fake.fireChange(['m31r.path']);
  await controller.whenIdle();
  assert.deepEqual(clients.at(-1).serverOptions, { command: '/home/me/bin/m31r', args: ['lsp'] });

  // A workspace may still set them (trusted workspaces only: package.json's restrictedConfigurations).
  fake.workspace['m31r.socket'] = '/srv/m31rd.sock';
  vscode.__fake.fireChange(['m31r.socket']);
  await controller.whenIdle();
  assert.deepEqual(clients.at(-1).serverOptions, {
    command: '/home/me/bin/m31r',
    args: ['lsp', '--socket', '/srv/m31rd.sock'],
  });

  // In a local window the user settings apply as they are.
  const { client } = await activate(local);
  assert.deepEqual(client.serverOptions, {
    command: '/Users/me/bin/m31r',
    args: ['lsp', '--socket', '/Users/me/m31rd.sock'],
  });
});

test("multi-root workspace: a folder's m31r.path or m31r.socket is ignored, and the user is told once", async () => {
  await closeController();
  resetFakes();
  fake.workspaceFile = { toString: () => 'file:///w/all.code-workspace' };
  fake.folders = [
    { name: 'app', uri: { toString: () => 'file:///w/app' } },
    { name: 'lib', uri: { toString: () => 'file:///w/lib' } },
  ];
  fake.folderSettings = { lib: { 'm31r.path': '/opt/lib/m31r' } };
  controller = ext.activate({ subscriptions: [] });
  await controller.whenIdle();
  assert.deepEqual(clients.at(-1).serverOptions, { command: 'm31r', args: ['lsp'] });
  const told = fake.messages.filter(([kind, m]) => kind === 'warning' && /m31r\.path/.test(m));
  assert.equal(told.length, 1);
  assert.match(told[0][1], /"lib".*ignored/);
  // Another change repeats nothing.
  fake.user['m31r.maxTokens'] = 10;
  vscode.__fake.fireChange(['m31r.maxTokens']);
  await controller.whenIdle();
  assert.equal(fake.messages.filter(([kind, m]) => kind === 'warning' && /m31r\.path/.test(m)).length, 1);
  // A folder window: the folder's settings are the workspace's, nothing to warn about.
  await closeController();
  resetFakes();
  fake.folders = [{ name: 'lib', uri: { toString: () => 'file:///w/lib' } }];
  fake.folderSettings = { lib: { 'm31r.path': '/opt/lib/m31r' } };
  controller = ext.activate({ subscriptions: [] });
  await controller.whenIdle();
  assert.deepEqual(fake.messages.filter(([kind]) => kind === 'warning'), []);
});

test('didChangeConfiguration sends validated settings.m31r only', async () => {
  const { client } = await activate({ 'm31r.multiline': 'never', 'm31r.path': 'm31r' });
  await client.clientOptions.middleware.workspace.didChangeConfiguration(['m31r'], async () => {
    throw new Error('the raw section must not be sent');
  });
  assert.equal(client.sent.length, 1);
  assert.equal(client.sent[0].method, 'workspace/didChangeConfiguration');
  const m31r = client.sent[0].params.settings.m31r;
  assert.equal(m31r.multiline, 'never');
  assert.equal('path' in m31r, false);
  assert.deepEqual(Object.keys(client.sent[0].params.settings), ['m31r']);
});

test('workspace/configuration answers m31r sections from validated settings', async () => {
  const { client } = await activate({ 'm31r.deadlineMs': 1200 });
  const next = async (params) => params.items.map(() => 'raw');
  const res = await client.clientOptions.middleware.workspace.configuration(
    { items: [{ section: 'm31r' }, { section: 'm31r.deadlineMs' }, { section: 'editor' }] },
    {},
    next,
  );
  assert.equal(res[0].deadlineMs, 1200);
  assert.equal(res[1], 1200);
  assert.equal(res[2], 'raw');
});

test('m31r/status drives the status bar', async () => {
  const { client, item } = await activate();
  assert.equal(item.text, '$(sparkle) M31R');
  assert.ok(item.visible);
  client.emit('m31r/status', { state: 'unavailable', model: null, lastLatencyMs: null });
  assert.equal(item.text, '$(warning) M31R unavailable');
  assert.equal(item.backgroundColor.id, 'statusBarItem.warningBackground');
  client.emit('m31r/status', { state: 'ready', model: 'tiny', lastLatencyMs: 37 });
  assert.equal(item.text, '$(sparkle) M31R');
  assert.match(item.tooltip, /tiny/);
  assert.match(item.tooltip, /37 ms/);
  assert.equal(item.backgroundColor, undefined);
  assert.equal(item.command, 'm31r.toggle');
  // A malformed notification is logged and ignored.
  client.emit('m31r/status', { state: 'exploded' });
  assert.equal(item.text, '$(sparkle) M31R');
  assert.ok(fake.outputs[0].lines.some(([lvl, m]) => lvl === 'warn' && /malformed/.test(m)));
});

test('toggle flips m31r.enable and short-circuits requests while disabled', async () => {
  const { client, item } = await activate();
  await vscode.commands.executeCommand('m31r.toggle');
  assert.deepEqual(fake.updates.at(-1), { key: 'm31r.enable', value: false, target: vscode.ConfigurationTarget.Global });
  assert.equal(item.text, '$(circle-slash) M31R');
  assert.equal(clients.length, 1, 'enable does not restart the server');
  const mw = client.clientOptions.middleware;
  let called = 0;
  const next = () => {
    called++;
    return { items: [] };
  };
  assert.equal(mw.provideInlineCompletionItems({}, {}, {}, {}, next), undefined);
  assert.equal(mw.provideCompletionItem({}, {}, {}, {}, next), undefined);
  assert.equal(called, 0);
  await vscode.commands.executeCommand('m31r.toggle');
  assert.equal(fake.user['m31r.enable'], true);
  assert.equal(item.text, '$(sparkle) M31R');
  assert.deepEqual(mw.provideInlineCompletionItems({}, {}, {}, {}, next), { items: [] });
  assert.equal(called, 1);
});

test('m31r.completionMenu: no suggestion-menu requests by default; opting in applies without a restart', async () => {
  const { client } = await activate();
  const mw = client.clientOptions.middleware;
  let called = 0;
  const next = () => {
    called++;
    return { isIncomplete: true, items: [{ label: 'm31r' }] };
  };
  // Off by default: the server is not asked, so nothing of M31R's lands in the suggestion menu.
  assert.equal(mw.provideCompletionItem({}, {}, {}, {}, next), undefined);
  assert.equal(called, 0);
  // Ghost text is unaffected.
  assert.deepEqual(mw.provideInlineCompletionItems({}, {}, {}, {}, () => ({ items: [] })), { items: [] });

  await vscode.workspace.getConfiguration('m31r').update('completionMenu', true, vscode.ConfigurationTarget.Global);
  await tick();
  await controller.whenIdle();
  assert.equal(clients.length, 1, 'completionMenu does not restart the server');
  assert.deepEqual(mw.provideCompletionItem({}, {}, {}, {}, next), { isIncomplete: true, items: [{ label: 'm31r' }] });
  assert.equal(called, 1);
  // A client-only key: never sent to the server.
  assert.equal('completionMenu' in client.clientOptions.initializationOptions(), false);
  await mw.workspace.didChangeConfiguration(['m31r'], async () => undefined);
  assert.equal('completionMenu' in client.sent.at(-1).params.settings.m31r, false);

  // m31r.enable still wins.
  await vscode.commands.executeCommand('m31r.toggle');
  assert.equal(mw.provideCompletionItem({}, {}, {}, {}, next), undefined);
  assert.equal(called, 1);
  await vscode.commands.executeCommand('m31r.toggle');
  assert.equal(mw.provideCompletionItem({}, {}, {}, {}, next).items.length, 1);
  assert.equal(called, 2);

  await vscode.workspace.getConfiguration('m31r').update('completionMenu', false, vscode.ConfigurationTarget.Global);
  await tick();
  assert.equal(mw.provideCompletionItem({}, {}, {}, {}, next), undefined);
  assert.equal(called, 2);
  assert.equal(clients.length, 1);
});

test('m31r.completionMenu set at activation', async () => {
  const { client } = await activate({ 'm31r.completionMenu': true });
  let called = 0;
  const next = () => {
    called++;
    return [];
  };
  assert.deepEqual(client.clientOptions.middleware.provideCompletionItem({}, {}, {}, {}, next), []);
  assert.equal(called, 1);
});

test('toggle writes to the workspace when the workspace sets m31r.enable', async () => {
  await activate();
  fake.workspace['m31r.enable'] = true;
  vscode.__fake.fireChange(['m31r.enable']);
  await vscode.commands.executeCommand('m31r.toggle');
  assert.deepEqual(fake.updates.at(-1), { key: 'm31r.enable', value: false, target: vscode.ConfigurationTarget.Workspace });
});

test('changing path/socket/languages restarts the client; other settings do not', async () => {
  const { client: first } = await activate();
  await vscode.workspace.getConfiguration('m31r').update('maxTokens', 10, vscode.ConfigurationTarget.Global);
  await controller.whenIdle();
  assert.equal(clients.length, 1);
  await vscode.workspace.getConfiguration('m31r').update('socket', '/tmp/other.sock', vscode.ConfigurationTarget.Global);
  await tick();
  await controller.whenIdle();
  assert.equal(clients.length, 2);
  assert.ok(first.disposed, 'old client disposed');
  assert.deepEqual(clients[1].serverOptions.args, ['lsp', '--socket', '/tmp/other.sock']);
  // Notifications from the old client no longer affect the status bar.
  first.emit('m31r/status', { state: 'unavailable', model: null, lastLatencyMs: null });
  assert.equal(fake.statusItems[0].text, '$(sparkle) M31R');
});

test('m31r.languages: "*" opts in to every language; a change restarts with the new selector', async () => {
  const { client: first } = await activate({ 'm31r.languages': ['*'] });
  assert.deepEqual(first.clientOptions.documentSelector, [{ scheme: 'file' }, { scheme: 'untitled' }]);
  await vscode.workspace.getConfiguration('m31r').update('languages', ['python'], vscode.ConfigurationTarget.Global);
  await tick();
  await controller.whenIdle();
  assert.equal(clients.length, 2);
  assert.ok(first.disposed, 'old client disposed');
  assert.deepEqual(clients[1].clientOptions.documentSelector, [
    { scheme: 'file', language: 'python' },
    { scheme: 'untitled', language: 'python' },
  ]);
  assert.equal('languages' in clients[1].clientOptions.initializationOptions(), false, 'client-only key');
});

test('restart command creates a fresh client', async () => {
  await activate();
  await vscode.commands.executeCommand('m31r.restart');
  assert.equal(clients.length, 2);
  assert.ok(clients[0].disposed);
  assert.equal(controller.state.client, 'running');
});

test('a server that cannot start shows an error and click restarts', async () => {
  await closeController();
  resetFakes();
  lc.__fake.behaviour.failStart = true;
  controller = ext.activate({ subscriptions: [] });
  await controller.whenIdle();
  const item = fake.statusItems[0];
  assert.equal(controller.state.client, 'failed');
  assert.equal(item.text, '$(error) M31R');
  assert.match(item.tooltip, /ENOENT/);
  assert.equal(item.command, 'm31r.restart');
  assert.equal(item.backgroundColor.id, 'statusBarItem.errorBackground');
  lc.__fake.behaviour.failStart = false;
  await vscode.commands.executeCommand('m31r.restart');
  assert.equal(controller.state.client, 'running');
  assert.equal(item.text, '$(sparkle) M31R');
});

test('StartFailed (vscode-languageclient 11) is a failure with its reason, not "stopped"', async () => {
  // The client's own restart after a crash fails: no start() of ours rejects, only the state says so.
  const { client, item } = await activate();
  client.setState(lc.State.Starting);
  client.setState(lc.State.StartFailed);
  assert.equal(controller.state.client, 'failed');
  assert.equal(item.text, '$(error) M31R');
  assert.match(item.tooltip, /exited while starting/);
  assert.match(item.tooltip, /Show Log/);
  assert.equal(item.command, 'm31r.restart');
  client.setState(lc.State.Stopped); // what follows a failed start
  assert.equal(controller.state.client, 'failed');
  assert.equal(item.text, '$(error) M31R');

  // A start() of ours that fails: v11 reports StartFailed, then the promise rejects with the reason, which is kept.
  const start = lc.LanguageClient.prototype.start;
  lc.LanguageClient.prototype.start = async function () {
    this.setState(lc.State.Starting);
    this.setState(lc.State.StartFailed);
    throw new Error(`spawn ${this.serverOptions.command} ENOENT`);
  };
  try {
    await vscode.commands.executeCommand('m31r.restart');
  } finally {
    lc.LanguageClient.prototype.start = start;
  }
  assert.equal(controller.state.client, 'failed');
  assert.match(item.tooltip, /ENOENT/);
  assert.doesNotMatch(item.tooltip, /exited while starting/);
  await vscode.commands.executeCommand('m31r.restart');
  assert.equal(controller.state.client, 'running');
  assert.equal(item.text, '$(sparkle) M31R');
});

test('deactivate stops the client', async () => {
  const { client } = await activate();
  await ext.deactivate();
  assert.ok(client.disposed);
  controller = undefined;
});

test('m31r.trace.server logs the LSP traffic in the M31R channel at its default log level; a change needs no restart', async () => {
  // vscode-languageclient 11 traces only while its trace channel is at log level Trace; the M31R channel starts at Info.
  const { client } = await activate({ 'm31r.trace.server': 'messages' });
  const out = fake.outputs[0];
  assert.equal(out.logLevel, vscode.LogLevel.Info, 'the user never touched the log level');
  assert.equal(client.effectiveTrace(), 'messages');
  client.traceLine("[Trace - 10:00:00] Sending request 'textDocument/inlineCompletion - (7)'.");
  assert.ok(out.lines.some(([, m]) => /Sending request 'textDocument\/inlineCompletion/.test(m)), 'the trace is in the log');

  await vscode.workspace.getConfiguration('m31r').update('trace.server', 'verbose', vscode.ConfigurationTarget.Global);
  await tick();
  assert.equal(client.effectiveTrace(), 'verbose');

  await vscode.workspace.getConfiguration('m31r').update('trace.server', 'off', vscode.ConfigurationTarget.Global);
  await tick();
  assert.equal(client.effectiveTrace(), 'off');
  const before = out.lines.length;
  client.traceLine("[Trace - 10:00:01] Sending request 'textDocument/inlineCompletion - (8)'.");
  assert.equal(out.lines.length, before, 'off: nothing traced');

  await vscode.workspace.getConfiguration('m31r').update('trace.server', 'messages', vscode.ConfigurationTarget.Global);
  await tick();
  assert.equal(client.effectiveTrace(), 'messages', 'on again without a restart');
  assert.equal(clients.length, 1, 'trace.server does not restart the server');
});

test('m31r.trace.server "off" (the default) traces nothing, even with the M31R channel at log level Trace', async () => {
  const { client } = await activate();
  assert.equal(client.effectiveTrace(), 'off');
  fake.outputs[0].setLogLevel(vscode.LogLevel.Trace);
  assert.equal(client.effectiveTrace(), 'off', 'the setting says off');
  await vscode.workspace.getConfiguration('m31r').update('trace.server', 'messages', vscode.ConfigurationTarget.Global);
  await tick();
  assert.equal(client.effectiveTrace(), 'messages');
});

test('deactivation as VS Code runs it: the server stops before the output channel and the status item go', async () => {
  const { client, context } = await activate();
  const out = fake.outputs[0];
  const item = fake.statusItems[0];
  // extHostExtensionService._deactivate: calls deactivate(), does not wait for it, disposes the subscriptions at once.
  const done = ext.deactivate();
  for (const d of context.subscriptions) d.dispose();
  await done; // rejected, before the fix: the client's last log line hit the already disposed channel
  assert.ok(client.disposed, 'server stopped');
  assert.ok(
    out.lines.some(([, m]) => /Server process exited successfully/.test(m)),
    "the client's lines while stopping reach the log",
  );
  assert.ok(out.disposed, 'output channel disposed afterwards');
  assert.ok(item.disposed, 'status item disposed afterwards');
  assert.equal(fake.commands.size, 0, 'commands unregistered');
  controller = undefined;
});

// --- restarts: one server per window, whatever the timing -----------------------------------------------------------

test('two quick changes of m31r.socket restart the server once, with the last value', async () => {
  const { client: first } = await activate();
  const cfg = vscode.workspace.getConfiguration('m31r');
  await cfg.update('socket', '/tmp/a.sock', vscode.ConfigurationTarget.Global);
  await cfg.update('socket', '/tmp/b.sock', vscode.ConfigurationTarget.Global);
  await controller.whenIdle();
  assert.equal(clients.length, 2, 'the second change joins the restart that has not started yet');
  assert.ok(first.disposed);
  assert.deepEqual(clients[1].serverOptions.args, ['lsp', '--socket', '/tmp/b.sock']);
  assert.deepEqual(lc.__fake.liveServers(), [clients[1]]);
  assert.equal(controller.state.client, 'running');
});

test('a change that arrives while a restart stops the old server applies at once and restarts nothing more', async () => {
  await activate();
  lc.__fake.behaviour.stopDelayMs = 30;
  // A new path; then, while the old server is still being stopped, completions off.
  fake.user['m31r.path'] = '/opt/m31r';
  vscode.__fake.fireChange(['m31r.path']);
  await tick();
  fake.user['m31r.enable'] = false;
  vscode.__fake.fireChange(['m31r.enable']);
  assert.equal(controller.state.enabled, false, 'm31r.enable applies without waiting for the restart');
  await controller.whenIdle();
  assert.equal(clients.length, 2, 'one restart');
  assert.equal(clients[1].serverOptions.command, '/opt/m31r');
  assert.deepEqual(lc.__fake.liveServers(), [clients[1]]);
  // The toggle flips what the status bar shows (with the snapshot left stale it wrote the value already there).
  await vscode.commands.executeCommand('m31r.toggle');
  assert.equal(fake.user['m31r.enable'], true);
  assert.equal(controller.state.enabled, true);
  assert.equal(clients.length, 2);
});

test('restart while the server hangs in `initialize`: the stuck process is killed and a new server runs', async () => {
  const { item, client: stuck } = await activateNoWait({}, { hangStart: true });
  setStartGrace(30);
  assert.equal(controller.state.client, 'starting');
  lc.__fake.behaviour.hangStart = false;
  await within(1000, vscode.commands.executeCommand('m31r.restart'), 'the restart waited for a start that never ends');
  assert.ok(stuck.killed, 'the stuck server was killed');
  assert.equal(clients.length, 2);
  assert.deepEqual(lc.__fake.liveServers(), [clients[1]]);
  assert.equal(controller.state.client, 'running');
  assert.equal(item.text, '$(sparkle) M31R');
  assert.ok(warnings().some((m) => /did not finish starting/.test(m)), 'the log says why it was killed');
});

test('a settings change while the server hangs in `initialize` restarts it with the new value', async () => {
  const { client: stuck } = await activateNoWait({ 'm31r.path': '/usr/bin/cat' }, { hangStart: true });
  setStartGrace(30);
  await tick();
  lc.__fake.behaviour.hangStart = false;
  await vscode.workspace.getConfiguration('m31r').update('path', 'm31r', vscode.ConfigurationTarget.Global);
  await within(1000, controller.whenIdle(), 'the restart waited for a start that never ends');
  assert.ok(stuck.killed);
  assert.equal(clients.at(-1).serverOptions.command, 'm31r');
  assert.deepEqual(lc.__fake.liveServers(), [clients.at(-1)]);
  assert.equal(controller.state.client, 'running');
});

test('deactivate while the server hangs in `initialize` ends, with the server gone', async () => {
  const { item, client: stuck } = await activateNoWait({}, { hangStart: true });
  setStartGrace(30);
  const out = fake.outputs[0];
  await tick();
  await within(1000, ext.deactivate(), 'deactivate waited for a start that never ends');
  assert.ok(stuck.killed);
  assert.deepEqual(lc.__fake.liveServers(), []);
  assert.ok(out.disposed);
  assert.ok(item.disposed);
  controller = undefined;
});

test('deactivate while the server is still starting waits for it and stops it cleanly', async () => {
  const { client } = await activateNoWait({}, { startDelayMs: 20 });
  await tick();
  await within(1000, ext.deactivate(), 'deactivate');
  assert.equal(client.killed, false, 'stopped with shutdown/exit, not killed');
  assert.deepEqual(lc.__fake.liveServers(), []);
  controller = undefined;
});

test("restart during the client's own restart after a crash waits for it, then stops that server cleanly", async () => {
  const { client: first } = await activate();
  // vscode-languageclient restarts a crashed server by itself (DefaultErrorHandler): Starting again, no start() of ours.
  first.setState(lc.State.Starting);
  setTimeout(() => first.setState(lc.State.Running), 20);
  await vscode.commands.executeCommand('m31r.restart');
  assert.equal(first.killed, false, 'stopped with shutdown/exit, not killed');
  assert.deepEqual(warnings(), [], 'no "Client is not running and can\'t be stopped"');
  assert.deepEqual(lc.__fake.liveServers(), [clients[1]]);
  assert.equal(controller.state.client, 'running');
});

test('restart right after activation (the command that activated the extension) leaves one server', async () => {
  await activateNoWait({}, { startDelayMs: 10 });
  await vscode.commands.executeCommand('m31r.restart');
  await vscode.commands.executeCommand('m31r.restart');
  await controller.whenIdle();
  assert.equal(lc.__fake.liveServers().length, 1);
  assert.equal(lc.__fake.liveServers()[0], clients.at(-1));
  assert.equal(controller.state.client, 'running');
});

test('start() on a running server does not start a second one', async () => {
  const { client } = await activate();
  await controller.start();
  assert.equal(clients.length, 1);
  assert.deepEqual(lc.__fake.liveServers(), [client]);
});

test('start() or restart() after deactivate start nothing', async () => {
  await activate();
  const c = controller;
  await ext.deactivate();
  controller = undefined;
  await c.restart();
  await c.start();
  assert.equal(clients.length, 1);
  assert.deepEqual(lc.__fake.liveServers(), []);
});

test('a restart after a failed start logs no failure to stop it', async () => {
  await activateNoWait({}, { failStart: true });
  await controller.whenIdle();
  assert.equal(controller.state.client, 'failed');
  lc.__fake.behaviour.failStart = false;
  await vscode.commands.executeCommand('m31r.restart');
  assert.equal(controller.state.client, 'running');
  assert.deepEqual(warnings().filter((m) => /stopping/.test(m)), []);
});

test('a restart asked for while a start() is queued on a running server still restarts it', async () => {
  const { client: first } = await activate();
  fake.user['m31r.socket'] = '/tmp/c.sock';
  const started = controller.start(); // a no-op: the server runs
  const restarted = controller.restart(); // joins the queued start(), and must not be lost in it
  await Promise.all([started, restarted]);
  assert.equal(clients.length, 2);
  assert.ok(first.disposed);
  assert.deepEqual(clients[1].serverOptions.args, ['lsp', '--socket', '/tmp/c.sock']);
  assert.deepEqual(lc.__fake.liveServers(), [clients[1]]);
});

test('stop() cancels a restart that has not begun: no server is started only to be stopped', async () => {
  await activate();
  const restarted = controller.restart();
  await controller.stop();
  await restarted;
  assert.equal(clients.length, 1, 'no new server');
  assert.deepEqual(lc.__fake.liveServers(), []);
  assert.equal(controller.state.client, 'stopped');
  assert.equal(fake.statusItems[0].text, '$(circle-slash) M31R stopped');
  assert.equal(fake.statusItems[0].command, 'm31r.restart');
});

test('toggle twice in quick succession ends where it began (VS Code writes settings asynchronously)', async () => {
  const { item } = await activate();
  fake.updateDelayMs = 10;
  await Promise.all([vscode.commands.executeCommand('m31r.toggle'), vscode.commands.executeCommand('m31r.toggle')]);
  await tick();
  assert.deepEqual(
    fake.updates.map((u) => u.value),
    [false, true],
  );
  assert.equal(fake.user['m31r.enable'], true);
  assert.equal(controller.state.enabled, true);
  assert.equal(item.text, '$(sparkle) M31R');
});

test('toggle that cannot write the setting says so and leaves the status as it was', async () => {
  const { item } = await activate();
  fake.updateError = 'Unable to write into user settings. Please open the user settings to correct errors/warnings in it and try again.';
  await vscode.commands.executeCommand('m31r.toggle');
  assert.equal(controller.state.enabled, true);
  assert.equal(item.text, '$(sparkle) M31R');
  assert.ok(fake.messages.some(([kind, m]) => kind === 'error' && /Unable to write into user settings/.test(m)));
});
