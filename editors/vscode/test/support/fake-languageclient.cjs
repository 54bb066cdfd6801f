'use strict';
// Stand-in for `vscode-languageclient/node`: records how the extension builds
// its client, and lets tests emit notifications and state changes.

const vscode = require('vscode'); // the fake, through hook.cjs

// vscode-languageclient 11's public State (lib/common/client.js).
const State = { Stopped: 1, Running: 2, Starting: 3, StartFailed: 4 };

const instances = [];
const behaviour = {
  /** The executable cannot be spawned: start() rejects (ENOENT), no process. */
  failStart: false,
  /** The server process runs but never answers `initialize`: start() stays pending until the process goes. */
  hangStart: false,
  /** Milliseconds the server takes to answer `initialize`. */
  startDelayMs: 0,
  /** Milliseconds a clean stop (shutdown + exit) takes. */
  stopDelayMs: 0,
};

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

class LanguageClient {
  constructor(id, name, serverOptions, clientOptions) {
    this.id = id;
    this.name = name;
    this.serverOptions = serverOptions;
    this.clientOptions = clientOptions;
    this.notificationHandlers = new Map();
    this.stateListeners = [];
    this.sent = [];
    this.state = State.Stopped;
    this.disposed = false;
    /** Whether this client's server process is running. */
    this.alive = false;
    /** Set when the process had to be killed (a stop while it was not running). */
    this.killed = false;
    this.startCalls = 0;
    this.pendingStart = undefined;
    // As vscode-languageclient 11 (lib/common/client.js): the trace level follows the trace channel's log level (the
    // output channel's when no trace channel is given), read at construction and on onDidChangeLogLevel.
    const traceChannel = clientOptions.traceOutputChannel ?? clientOptions.outputChannel;
    this.traceLogLevel = traceChannel ? traceChannel.logLevel : vscode.LogLevel.Info;
    traceChannel?.onDidChangeLogLevel?.((level) => {
      this.traceLogLevel = level;
    });
    instances.push(this);
  }
  /** The client's refreshTrace(): off unless the trace channel is at Trace; then `<id>.trace.server`, "off" read as
   * "messages". */
  effectiveTrace() {
    if (this.traceLogLevel !== vscode.LogLevel.Trace) return 'off';
    const configured = vscode.workspace.getConfiguration(this.id).get('trace.server', 'messages');
    return configured === 'off' ? 'messages' : configured;
  }
  /** Test helper: the client's tracer logging one message (only while tracing is on, as in the real one). */
  traceLine(message) {
    if (this.effectiveTrace() === 'off') return;
    (this.clientOptions.traceOutputChannel ?? this.clientOptions.outputChannel).trace(message);
  }
  onNotification(method, handler) {
    this.notificationHandlers.set(method, handler);
    return { dispose: () => this.notificationHandlers.delete(method) };
  }
  onDidChangeState(listener) {
    this.stateListeners.push(listener);
    return { dispose: () => {} };
  }
  setState(newState) {
    const oldState = this.state;
    this.state = newState;
    for (const l of this.stateListeners) l({ oldState, newState });
  }
  /** As vscode-languageclient 11: Starting, spawn, `initialize`, then Running; StartFailed when that fails. */
  start() {
    if (this.disposed) return Promise.reject(new Error("Client got disposed and can't be restarted."));
    if (this.pendingStart) return this.pendingStart;
    this.startCalls++;
    this.setState(State.Starting);
    if (behaviour.failStart) {
      this.setState(State.StartFailed);
      this.pendingStart = undefined;
      return Promise.reject(new Error(`spawn ${this.serverOptions.command} ENOENT`));
    }
    this.alive = true;
    this.pendingStart = new Promise((resolve, reject) => {
      // The connection closing (the process killed) rejects the pending `initialize`.
      this.closeConnection = () => {
        this.pendingStart = undefined;
        if (this.state === State.Starting) this.setState(State.StartFailed);
        reject(new Error('Pending response rejected since connection got disposed'));
      };
      if (behaviour.hangStart) return;
      sleep(behaviour.startDelayMs).then(() => {
        if (this.state !== State.Starting || !this.alive) return;
        this.pendingStart = undefined;
        this.closeConnection = undefined;
        this.setState(State.Running);
        resolve();
      });
    });
    return this.pendingStart;
  }
  /** The Node client's process kill (lib/node/main.js checkProcessDied, 2 s after a stop that left it alive). */
  kill() {
    if (!this.alive) return;
    this.alive = false;
    this.killed = true;
    const close = this.closeConnection;
    this.closeConnection = undefined;
    close?.();
  }
  async stop() {
    return this.shutdown();
  }
  /** lib/common/client.js shutdown(): only a Running client can be stopped; lib/node/main.js then makes sure the
   * process is gone, whatever the outcome. */
  async shutdown() {
    try {
      if (this.state === State.Stopped) return;
      if (this.state !== State.Running) {
        throw new Error(`Client is not running and can't be stopped. It's current state is: ${this.stateName()}`);
      }
      await sleep(behaviour.stopDelayMs);
      this.alive = false;
      this.setState(State.Stopped);
      // The node client's server-process 'exit' handler logs this once the server is gone (lib/node/main.js).
      this.clientOptions.outputChannel?.info('Server process exited successfully');
    } finally {
      this.kill();
    }
  }
  async dispose() {
    this.disposed = true;
    return this.shutdown();
  }
  stateName() {
    return { 1: 'stopped', 2: 'running', 3: 'starting', 4: 'startFailed' }[this.state];
  }
  async sendNotification(method, params) {
    this.sent.push({ method, params });
  }
  /** Test helper: deliver a server → client notification. */
  emit(method, params) {
    const h = this.notificationHandlers.get(method);
    if (h) h(params);
  }
}

/** Server processes running now (a second one is a leak: one server per window). */
function liveServers() {
  return instances.filter((c) => c.alive);
}

module.exports = { LanguageClient, State, __fake: { instances, behaviour, liveServers } };
