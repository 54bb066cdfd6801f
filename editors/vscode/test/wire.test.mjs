// Speaks LSP over stdio to a real `m31r lsp` process, exactly as an editor
// would, using vscode-jsonrpc from plain Node (no VS Code).
//
//   M31R_LSP_CMD="m31r lsp --socket /path/to/m31rd.sock" npm run test:wire
//
// M31R_LSP_CMD is run through /bin/sh (so quoting works), or, when it starts
// with "[", parsed as a JSON array [command, ...args]. Without it the test is
// skipped. M31R_LSP_TIMEOUT_MS (default 60000) bounds each request.
// M31R_EXPECT_ITEMS=1 also requires at least one inline completion item
// (use it when a daemon with a model is running).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const require = createRequire(import.meta.url);
const rpc = require('vscode-jsonrpc/node');

const CMD = process.env.M31R_LSP_CMD?.trim();
const TIMEOUT_MS = Number(process.env.M31R_LSP_TIMEOUT_MS ?? 60000);
const EXPECT_ITEMS = ['1', 'true', 'yes'].includes((process.env.M31R_EXPECT_ITEMS ?? '').toLowerCase());
const SKIP = CMD ? false : 'M31R_LSP_CMD is not set: set it to the server command, e.g. M31R_LSP_CMD="m31r lsp"';

const SETTINGS = {
  enable: true,
  debounceMs: 0,
  debounceMode: 'fixed',
  multiline: 'auto',
  deadlineMs: 800,
  maxTokens: 16,
  // The tests' models may be random ones, sure of nothing: the confidence gate stays off.
  minProbability: 0,
  // No `socket`: "" would mean "the default socket" and could override a
  // `--socket` given in M31R_LSP_CMD.
};

const RUST = [
  'use std::collections::HashMap;',
  '',
  '/// Counts how often each word occurs.',
  'pub fn word_counts(text: &str) -> HashMap<String, usize> {',
  '    let mut counts = HashMap::new();',
  '    for word in text.split_whitespace() {',
  '        ',
  '    }',
  '    counts',
  '}',
  '',
].join('\n');
// Cursor: end of the indented empty line inside the loop.
const CURSOR = { line: 6, character: 8 };

function spawnServer() {
  if (CMD.startsWith('[')) {
    const [command, ...args] = JSON.parse(CMD);
    return spawn(command, args, { stdio: ['pipe', 'pipe', 'pipe'], detached: true });
  }
  return spawn('/bin/sh', ['-c', `exec ${CMD}`], { stdio: ['pipe', 'pipe', 'pipe'], detached: true });
}

function withTimeout(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer within ${TIMEOUT_MS} ms`)), TIMEOUT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

function assertRange(range, where) {
  assert.ok(range && typeof range === 'object', `${where}: range missing`);
  for (const end of ['start', 'end']) {
    assert.ok(Number.isInteger(range[end]?.line) && range[end].line >= 0, `${where}: range.${end}.line`);
    assert.ok(Number.isInteger(range[end]?.character) && range[end].character >= 0, `${where}: range.${end}.character`);
  }
  const before = (a, b) => a.line < b.line || (a.line === b.line && a.character <= b.character);
  assert.ok(before(range.start, range.end), `${where}: range start after end`);
}

test('m31r lsp over the wire: initialize, inlineCompletion, completion, shutdown', { skip: SKIP, timeout: 6 * TIMEOUT_MS }, async (t) => {
  const proc = spawnServer();
  let stderr = '';
  proc.stderr.setEncoding('utf8');
  proc.stderr.on('data', (d) => {
    stderr += d;
    if (stderr.length > 64 * 1024) stderr = stderr.slice(-32 * 1024);
  });
  const exited = new Promise((resolve) => proc.once('exit', (code, signal) => resolve({ code, signal })));
  proc.once('error', (e) => {
    stderr += `\nspawn error: ${e.message}`;
  });

  const conn = rpc.createMessageConnection(
    new rpc.StreamMessageReader(proc.stdout),
    new rpc.StreamMessageWriter(proc.stdin),
  );
  const statuses = [];
  const messages = [];
  const serverRequests = [];
  conn.onNotification('m31r/status', (p) => statuses.push(p));
  conn.onNotification('window/showMessage', (p) => messages.push(p));
  conn.onNotification('window/logMessage', () => {});
  // Answer whatever the server asks, as an editor would.
  conn.onRequest('workspace/configuration', (params) => {
    serverRequests.push('workspace/configuration');
    return params.items.map((item) => (item.section === 'm31r' ? SETTINGS : null));
  });
  conn.onRequest((method) => {
    serverRequests.push(method);
    return null;
  });
  conn.onNotification(() => {});
  conn.listen();

  const uri = pathToFileURL(join(tmpdir(), 'm31r-wire-test', 'src', 'lib.rs')).href;
  try {
    const init = await withTimeout(
      conn.sendRequest('initialize', {
        processId: process.pid,
        clientInfo: { name: 'm31r-wire-test', version: '0' },
        rootUri: null,
        workspaceFolders: null,
        initializationOptions: SETTINGS,
        capabilities: {
          general: { positionEncodings: ['utf-16'] },
          window: { showMessage: {}, workDoneProgress: false },
          workspace: { configuration: true, didChangeConfiguration: { dynamicRegistration: true } },
          textDocument: {
            synchronization: { dynamicRegistration: false, didSave: false },
            inlineCompletion: { dynamicRegistration: false },
            completion: {
              dynamicRegistration: false,
              completionItem: { snippetSupport: false, insertReplaceSupport: true },
              contextSupport: true,
            },
          },
        },
      }),
      'initialize',
    );
    assert.ok(init && typeof init === 'object', 'initialize result');
    const caps = init.capabilities;
    assert.ok(caps, 'initialize result has capabilities');
    assert.ok(
      caps.inlineCompletionProvider === true ||
        (caps.inlineCompletionProvider !== null && typeof caps.inlineCompletionProvider === 'object'),
      `capabilities.inlineCompletionProvider must be true or an object, got ${JSON.stringify(caps.inlineCompletionProvider)}`,
    );
    assert.ok(caps.completionProvider, 'capabilities.completionProvider (fallback for editors without inline completion)');
    const sync = caps.textDocumentSync;
    assert.ok(sync === 1 || sync === 2 || (sync && typeof sync === 'object'), `textDocumentSync: ${JSON.stringify(sync)}`);

    await conn.sendNotification('initialized', {});
    await conn.sendNotification('workspace/didChangeConfiguration', { settings: { m31r: SETTINGS } });
    await conn.sendNotification('textDocument/didOpen', {
      textDocument: { uri, languageId: 'rust', version: 1, text: RUST },
    });

    await t.test('textDocument/inlineCompletion', async () => {
      const result = await withTimeout(
        conn.sendRequest('textDocument/inlineCompletion', {
          textDocument: { uri },
          position: CURSOR,
          context: { triggerKind: 1 /* Invoked */ },
        }),
        'textDocument/inlineCompletion',
      );
      assert.ok(result && typeof result === 'object' && !Array.isArray(result), `expected an InlineCompletionList, got ${JSON.stringify(result)}`);
      assert.ok(Array.isArray(result.items), 'result.items is an array');
      if (EXPECT_ITEMS) {
        assert.ok(result.items.length > 0, `M31R_EXPECT_ITEMS is set but there are no items (m31r/status: ${JSON.stringify(statuses.at(-1) ?? null)})`);
      }
      result.items.forEach((item, i) => {
        const text = typeof item.insertText === 'string' ? item.insertText : item.insertText?.value;
        assert.equal(typeof text, 'string', `items[${i}].insertText`);
        assertRange(item.range, `items[${i}]`);
        // VS Code only shows an item whose range is on the cursor line and contains the cursor.
        assert.equal(item.range.start.line, CURSOR.line, `items[${i}].range.start is on the cursor line`);
        assert.equal(item.range.end.line, CURSOR.line, `items[${i}].range.end is on the cursor line`);
        assert.ok(item.range.start.character <= CURSOR.character, `items[${i}].range starts at or before the cursor`);
        assert.ok(item.range.end.character >= CURSOR.character, `items[${i}].range ends at or after the cursor`);
      });
      t.diagnostic(`inlineCompletion items: ${JSON.stringify(result.items).slice(0, 500)}`);
    });

    await t.test('textDocument/completion (fallback)', async () => {
      const result = await withTimeout(
        conn.sendRequest('textDocument/completion', {
          textDocument: { uri },
          position: CURSOR,
          context: { triggerKind: 1 /* Invoked */ },
        }),
        'textDocument/completion',
      );
      if (result === null) return;
      const items = Array.isArray(result) ? result : result.items;
      assert.ok(Array.isArray(items), `expected CompletionItem[] or CompletionList, got ${JSON.stringify(result)}`);
      items.forEach((item, i) => {
        assert.equal(typeof item.label, 'string', `items[${i}].label`);
      });
    });

    await t.test('m31r/status notifications (if any) have the documented shape', () => {
      for (const s of statuses) {
        assert.ok(['ready', 'starting', 'unavailable'].includes(s.state), `state: ${JSON.stringify(s)}`);
        assert.ok(s.model === null || typeof s.model === 'string', `model: ${JSON.stringify(s)}`);
        assert.ok(s.lastLatencyMs === null || typeof s.lastLatencyMs === 'number', `lastLatencyMs: ${JSON.stringify(s)}`);
      }
      t.diagnostic(`m31r/status received: ${statuses.length}; last: ${JSON.stringify(statuses.at(-1) ?? null)}`);
      if (messages.length) t.diagnostic(`window/showMessage: ${JSON.stringify(messages)}`);
      if (serverRequests.length) t.diagnostic(`server → client requests: ${serverRequests.join(', ')}`);
    });

    await conn.sendNotification('textDocument/didClose', { textDocument: { uri } });
    const shutdown = await withTimeout(conn.sendRequest('shutdown'), 'shutdown');
    assert.equal(shutdown ?? null, null, 'shutdown result is null');
    await conn.sendNotification('exit');
    const { code, signal } = await withTimeout(exited, 'exit');
    assert.equal(signal, null, `server killed by ${signal}`);
    assert.equal(code, 0, `server exit code after shutdown/exit (stderr tail: ${stderr.slice(-2000)})`);
  } catch (e) {
    // Give a dying server a moment to flush stderr and report its exit status.
    const status = await Promise.race([exited, new Promise((r) => setTimeout(() => r(null), 1000))]);
    const exit = status ? `server exited (code ${status.code}, signal ${status.signal})` : 'server still running';
    e.message += `\n--- ${exit}; server stderr (tail) ---\n${stderr.slice(-4000)}`;
    throw e;
  } finally {
    conn.dispose();
    if (proc.exitCode === null && proc.signalCode === null) {
      try {
        process.kill(-proc.pid, 'SIGKILL');
      } catch {
        proc.kill('SIGKILL');
      }
    }
  }
});
