'use strict';
// A tiny stand-in for the `vscode` module: just what src/extension.ts uses.
// Tests drive it through `__fake`.

class Disposable {
  constructor(fn) {
    this._fn = fn;
  }
  dispose() {
    if (this._fn) this._fn();
    this._fn = undefined;
  }
}

class EventEmitter {
  constructor() {
    this.listeners = new Set();
    this.event = (listener) => {
      this.listeners.add(listener);
      return new Disposable(() => this.listeners.delete(listener));
    };
  }
  fire(e) {
    for (const l of [...this.listeners]) l(e);
  }
  dispose() {
    this.listeners.clear();
  }
}

class ThemeColor {
  constructor(id) {
    this.id = id;
  }
}

const ConfigurationTarget = { Global: 1, Workspace: 2, WorkspaceFolder: 3 };
const StatusBarAlignment = { Left: 1, Right: 2 };
// vscode.LogLevel (vscode.d.ts).
const LogLevel = { Off: 0, Trace: 1, Debug: 2, Info: 3, Warning: 4, Error: 5 };

const state = {
  /** Flat (local) user settings, e.g. {'m31r.path': 'x'}. */
  user: {},
  /** Flat workspace settings. */
  workspace: {},
  /** A remote window (SSH, WSL, container), and its remote user settings (the *Remote* tab). */
  remote: false,
  remoteUser: {},
  /** A multi-root workspace's file (undefined: a folder window), its folders ({name, uri}) and their flat settings
   * by folder name. */
  workspaceFile: undefined,
  folders: [],
  folderSettings: {},
  updates: [],
  /** Milliseconds update() takes to write, and an error it fails with (tests set them). */
  updateDelayMs: 0,
  updateError: undefined,
  commands: new Map(),
  statusItems: [],
  outputs: [],
  messages: [],
};

const configChanged = new EventEmitter();

// Each setting's contributed scope, as VS Code registers it from package.json (none means "window").
const scopes = Object.fromEntries(
  Object.entries(require('../../package.json').contributes.configuration.properties).map(([k, p]) => [
    k,
    p.scope ?? 'window',
  ]),
);
// In a remote window VS Code reads only these scopes from the local user settings (LOCAL_MACHINE_SCOPES in
// src/vs/workbench/services/configuration/common/configuration.ts); a "machine" or "machine-overridable" value
// there does not apply.
const LOCAL_MACHINE_SCOPES = new Set(['application', 'window', 'resource', 'language-overridable']);

function lookup(key) {
  const has = (bag) => Object.prototype.hasOwnProperty.call(bag, key);
  if (has(state.workspace)) return state.workspace[key];
  if (state.remote && has(state.remoteUser)) return state.remoteUser[key];
  if (has(state.user) && (!state.remote || LOCAL_MACHINE_SCOPES.has(scopes[key] ?? 'window'))) return state.user[key];
  return undefined;
}

function fireChange(keys) {
  configChanged.fire({
    affectsConfiguration: (section) => keys.some((k) => k === section || k.startsWith(section + '.')),
  });
}

const workspace = {
  get workspaceFile() {
    return state.workspaceFile;
  },
  get workspaceFolders() {
    return state.folders.length ? state.folders : undefined;
  },
  getConfiguration(section, scope) {
    const full = (key) => (section ? `${section}.${key}` : key);
    const folder = scope && state.folders.find((f) => f.uri === scope);
    const folderBag = (folder && state.folderSettings[folder.name]) || {};
    return {
      get: (key, dflt) => {
        const v = lookup(full(key));
        return v === undefined ? dflt : v;
      },
      has: (key) => lookup(full(key)) !== undefined,
      inspect: (key) => ({
        key: full(key),
        globalValue: state.user[full(key)],
        workspaceValue: state.workspace[full(key)],
        workspaceFolderValue: folderBag[full(key)],
      }),
      update: async (key, value, target) => {
        // VS Code writes settings.json asynchronously (in order); the change event follows the write.
        if (state.updateDelayMs) await new Promise((r) => setTimeout(r, state.updateDelayMs));
        if (state.updateError) throw new Error(state.updateError);
        const bag = target === ConfigurationTarget.Workspace ? state.workspace : state.user;
        bag[full(key)] = value;
        state.updates.push({ key: full(key), value, target });
        fireChange([full(key)]);
      },
    };
  },
  onDidChangeConfiguration: configChanged.event,
};

// A LogOutputChannel as VS Code's (src/vs/workbench/api/common/extHostOutput.ts) behaves: at its default level (Info)
// `trace` and `debug` lines are dropped, and once disposed every write throws "Channel has been closed".
function makeOutput(name) {
  const lines = [];
  const levelChanged = new EventEmitter();
  const validate = () => {
    if (out.disposed) throw new Error('Channel has been closed');
  };
  const at = (level, kind) => (m) => {
    validate();
    if (out.logLevel !== LogLevel.Off && out.logLevel <= level) lines.push([kind, m]);
  };
  const out = {
    name,
    lines,
    logLevel: LogLevel.Info,
    onDidChangeLogLevel: levelChanged.event,
    /** Test helper: what "Developer: Set Log Level..." does. */
    setLogLevel(level) {
      out.logLevel = level;
      levelChanged.fire(level);
    },
    info: at(LogLevel.Info, 'info'),
    warn: at(LogLevel.Warning, 'warn'),
    error: at(LogLevel.Error, 'error'),
    debug: at(LogLevel.Debug, 'debug'),
    trace: at(LogLevel.Trace, 'trace'),
    append: at(LogLevel.Info, 'append'),
    appendLine: at(LogLevel.Info, 'appendLine'),
    replace: at(LogLevel.Info, 'replace'),
    clear: () => validate(),
    hide: () => validate(),
    show: () => {
      validate();
      out.shown = true;
    },
    dispose: () => {
      out.disposed = true;
    },
  };
  state.outputs.push(out);
  return out;
}

const window = {
  createOutputChannel: (name) => makeOutput(name),
  createStatusBarItem: (id, alignment, priority) => {
    const item = {
      id,
      alignment,
      priority,
      text: '',
      tooltip: undefined,
      command: undefined,
      backgroundColor: undefined,
      visible: false,
      show() {
        this.visible = true;
      },
      hide() {
        this.visible = false;
      },
      dispose() {
        this.disposed = true;
      },
    };
    state.statusItems.push(item);
    return item;
  },
  showWarningMessage: async (msg) => {
    state.messages.push(['warning', msg]);
    return undefined;
  },
  showErrorMessage: async (msg) => {
    state.messages.push(['error', msg]);
    return undefined;
  },
  showInformationMessage: async (msg) => {
    state.messages.push(['info', msg]);
    return undefined;
  },
  setStatusBarMessage: (msg) => {
    state.messages.push(['statusbar', msg]);
    return new Disposable();
  },
};

const commands = {
  registerCommand(id, fn) {
    if (state.commands.has(id)) throw new Error(`command ${id} already registered`);
    state.commands.set(id, fn);
    return new Disposable(() => state.commands.delete(id));
  },
  async executeCommand(id, ...args) {
    const fn = state.commands.get(id);
    if (!fn) throw new Error(`command ${id} not found`);
    return fn(...args);
  },
};

module.exports = {
  Disposable,
  EventEmitter,
  ThemeColor,
  ConfigurationTarget,
  StatusBarAlignment,
  LogLevel,
  workspace,
  window,
  commands,
  __fake: { state, fireChange },
};
