'use strict';
// Stand-in for `vscode-languageclient/node`: records how the extension builds
// its client, and lets tests emit notifications and state changes.

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
    instances.push(this);
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
