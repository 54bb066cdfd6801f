// Unit tests for src/status.ts (compiled to out/status.js).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);
const st = require('../out/status.js');

test('notification method name', () => {
  assert.equal(st.STATUS_NOTIFICATION, 'm31r/status');
});

test('parseStatus accepts the documented shape', () => {
  assert.deepEqual(st.parseStatus({ state: 'ready', model: 'm31r-small', lastLatencyMs: 41.5 }), {
    state: 'ready',
    model: 'm31r-small',
    lastLatencyMs: 41.5,
  });
  assert.deepEqual(st.parseStatus({ state: 'starting', model: null, lastLatencyMs: null }), {
    state: 'starting',
    model: null,
    lastLatencyMs: null,
  });
  // Missing optional fields are tolerated.
  assert.deepEqual(st.parseStatus({ state: 'unavailable' }), { state: 'unavailable', model: null, lastLatencyMs: null });
});

test('parseStatus rejects malformed payloads', () => {
  for (const bad of [null, undefined, 3, 'ready', [], {}, { state: 'READY' }, { state: 'broken' }]) {
    assert.equal(st.parseStatus(bad), undefined, JSON.stringify(bad));
  }
  // Junk in optional fields is dropped, not fatal.
  assert.deepEqual(st.parseStatus({ state: 'ready', model: 7, lastLatencyMs: -1 }), {
    state: 'ready',
    model: null,
    lastLatencyMs: null,
  });
});

test('ready shows the sparkle, model and latency', () => {
  const v = st.statusView({
    client: 'running',
    enabled: true,
    server: { state: 'ready', model: 'm31r-small', lastLatencyMs: 42.4 },
  });
  assert.equal(v.text, '$(sparkle) M31R');
  assert.equal(v.severity, 'normal');
  assert.match(v.tooltip, /ready/);
  assert.match(v.tooltip, /m31r-small/);
  assert.match(v.tooltip, /42 ms/);
});

test('unavailable daemon is a warning', () => {
  const v = st.statusView({
    client: 'running',
    enabled: true,
    server: { state: 'unavailable', model: null, lastLatencyMs: null },
  });
  assert.equal(v.text, '$(warning) M31R unavailable');
  assert.equal(v.severity, 'warning');
  assert.match(v.tooltip, /m31r\.socket/);
});

test('starting states spin', () => {
  assert.equal(st.statusView({ client: 'starting', enabled: true }).text, '$(sync~spin) M31R');
  const v = st.statusView({ client: 'running', enabled: true, server: { state: 'starting', model: 'x', lastLatencyMs: null } });
  assert.equal(v.text, '$(sync~spin) M31R');
  assert.match(v.tooltip, /Model: x/);
});

test('running without any status yet', () => {
  const v = st.statusView({ client: 'running', enabled: true });
  assert.equal(v.text, '$(sparkle) M31R');
});

test('disabled wins over the server state, failures win over everything', () => {
  const server = { state: 'ready', model: null, lastLatencyMs: 3 };
  assert.equal(st.statusView({ client: 'running', enabled: false, server }).text, '$(circle-slash) M31R');
  const failed = st.statusView({ client: 'failed', enabled: false, server, error: 'spawn m31r ENOENT' });
  assert.equal(failed.text, '$(error) M31R');
  assert.equal(failed.severity, 'error');
  assert.match(failed.tooltip, /ENOENT/);
  assert.match(failed.tooltip, /m31r\.path/);
  const stopped = st.statusView({ client: 'stopped', enabled: true, server });
  assert.equal(stopped.text, '$(circle-slash) M31R stopped');
  assert.equal(stopped.severity, 'warning');
});

test('latency formatting', () => {
  assert.equal(st.formatLatency(3.14159), '3.1 ms');
  assert.equal(st.formatLatency(250.4), '250 ms');
  assert.equal(st.formatLatency(12345), '12.3 s');
});

test('latency formatting: the unit follows the rounded value, at both unit boundaries', () => {
  assert.equal(st.formatLatency(9.94), '9.9 ms');
  assert.equal(st.formatLatency(9.96), '10 ms'); // was "10.0 ms"
  assert.equal(st.formatLatency(9999.4), '9999 ms');
  assert.equal(st.formatLatency(9999.6), '10.0 s'); // was "10000 ms"
});
