'use strict';
// Stand-in for `vscode-languageclient/node`: records how the extension builds
// its client, and lets tests emit notifications and state changes.

const vscode = require('vscode'); // the fake, through hook.cjs

const State = { Stopped: 1, Running: 2, Starting: 3 };

const instances = [];
const behaviour = { failStart: false };

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
  async start() {
    this.setState(State.Starting);
    if (behaviour.failStart) {
      this.setState(State.Stopped);
      throw new Error(`spawn ${this.serverOptions.command} ENOENT`);
    }
    this.setState(State.Running);
  }
  async stop() {
    this.setState(State.Stopped);
  }
  async dispose() {
    this.disposed = true;
    if (this.state !== State.Stopped) this.setState(State.Stopped);
    // The node client's server-process 'exit' handler logs this once the server is gone (lib/node/main.js).
    this.clientOptions.outputChannel?.info('Server process exited successfully');
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

module.exports = { LanguageClient, State, __fake: { instances, behaviour } };
