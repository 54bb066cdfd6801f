// VS Code glue: starts `m31r lsp` through vscode-languageclient, keeps the
// settings in sync and shows the server's `m31r/status` in the status bar.
// Everything that can be decided without VS Code lives in settings.ts/status.ts.

import * as os from 'node:os';
import * as vscode from 'vscode';
import { LanguageClient, State } from 'vscode-languageclient/node';
import type { LanguageClientOptions, ServerOptions } from 'vscode-languageclient/node';

import {
  ClientSettings,
  ServerSettings,
  configurationItem,
  documentSelector,
  needsRestart,
  serverArgs,
  toClientSettings,
  toServerSettings,
} from './settings';
import { ClientState, STATUS_NOTIFICATION, StatusParams, parseStatus, statusView } from './status';

export const SECTION = 'm31r';
export const COMMANDS = {
  restart: 'm31r.restart',
  toggle: 'm31r.toggle',
  showOutput: 'm31r.showOutput',
} as const;

interface Snapshot {
  client: ClientSettings;
  server: ServerSettings;
  warnings: string[];
}

/** Timings of stopping the server (mutable for tests). */
export const TIMINGS = {
  /** How long a stop or restart waits for a server still starting (answering `initialize`) to finish: the client can
   * stop only a running server. After that, the stop goes ahead: vscode-languageclient's Node client then kills the
   * process (lib/node/main.js, checkProcessDied). A server that never answers, e.g. `m31r.path` naming another program,
   * would otherwise hold every later restart, settings change and deactivate for good. */
  startGraceMs: 3000,
  /** vscode-languageclient's timeout of a stop (shutdown + exit). */
  stopMs: 2000,
};

interface QueuedStart {
  run: Promise<void>;
  /** Stop and start even if a server is running (a restart, not just a start, asked for it). */
  restart: boolean;
  cancelled: boolean;
}

/** Resolves once `client` is no longer Starting, or after `ms`; true if it left Starting. */
function settled(client: LanguageClient, ms: number): Promise<boolean> {
  if (client.state !== State.Starting) return Promise.resolve(true);
  return new Promise((resolve) => {
    const done = (left: boolean): void => {
      clearTimeout(timer);
      listener.dispose();
      resolve(left);
    };
    const timer = setTimeout(() => done(false), ms);
    const listener = client.onDidChangeState((e) => {
      if (e.newState !== State.Starting) done(true);
    });
  });
}

/** `m31r.path` and `m31r.socket` are "machine-overridable" (package.json): VS Code accepts them in a folder's
 * `.vscode/settings.json` of a multi-root workspace without greying them out, but the one server of the window is
 * started with the window's value. Say so rather than ignore them silently. */
function ignoredFolderValues(): string[] {
  if (!vscode.workspace.workspaceFile) return []; // a folder window: its folder settings are the workspace's
  const out: string[] = [];
  for (const folder of vscode.workspace.workspaceFolders ?? []) {
    const cfg = vscode.workspace.getConfiguration(SECTION, folder.uri);
    for (const key of ['path', 'socket']) {
      if (cfg.inspect(key)?.workspaceFolderValue !== undefined) {
        out.push(
          `m31r.${key} in the folder settings of "${folder.name}" is ignored: one server serves the whole window, ` +
            'set it in the user or workspace settings',
        );
      }
    }
  }
  return out;
}

function readSnapshot(): Snapshot {
  const cfg = vscode.workspace.getConfiguration(SECTION);
  const home = os.homedir();
  const server = toServerSettings(cfg, home);
  const client = toClientSettings(cfg, home);
  return {
    client: client.value,
    server: server.value,
    warnings: [...client.warnings, ...server.warnings, ...ignoredFolderValues()],
  };
}

/**
 * The client's `traceOutputChannel`. vscode-languageclient 11 traces the LSP traffic only while that channel's log
 * level is Trace (lib/common/client.js, refreshTrace: `this._traceLogLevel !== LogLevel.Trace ? Trace.Off : ...`),
 * and writes each line with `.trace()`, which a LogOutputChannel drops below Trace: with the M31R channel at its
 * default level (Info), `m31r.trace.server` set to "messages" or "verbose" logged nothing. This channel reports Trace
 * exactly while the setting is not "off" (and tells the client when that changes, so no restart is needed), and
 * writes the trace lines into the M31R channel as plain lines.
 */
class TraceChannel implements vscode.LogOutputChannel {
  private readonly changed = new vscode.EventEmitter<vscode.LogLevel>();
  readonly onDidChangeLogLevel = this.changed.event;

  constructor(
    private readonly output: vscode.LogOutputChannel,
    private on: boolean,
  ) {}

  get name(): string {
    return this.output.name;
  }

  get logLevel(): vscode.LogLevel {
    return this.on ? vscode.LogLevel.Trace : vscode.LogLevel.Off;
  }

  setEnabled(on: boolean): void {
    if (on === this.on) return;
    this.on = on;
    this.changed.fire(this.logLevel);
  }

  trace(message: string): void {
    if (this.on) this.output.appendLine(message);
  }
  debug(message: string, ...args: unknown[]): void {
    this.output.debug(message, ...args);
  }
  info(message: string, ...args: unknown[]): void {
    this.output.info(message, ...args);
  }
  warn(message: string, ...args: unknown[]): void {
    this.output.warn(message, ...args);
  }
  error(error: string | Error, ...args: unknown[]): void {
    this.output.error(error, ...args);
  }
  append(value: string): void {
    this.output.append(value);
  }
  appendLine(value: string): void {
    this.output.appendLine(value);
  }
  replace(value: string): void {
    this.output.replace(value);
  }
  clear(): void {
    this.output.clear();
  }
  show(columnOrPreserveFocus?: vscode.ViewColumn | boolean, preserveFocus?: boolean): void {
    if (typeof columnOrPreserveFocus === 'boolean') this.output.show(columnOrPreserveFocus);
    else this.output.show(columnOrPreserveFocus, preserveFocus);
  }
  hide(): void {
    this.output.hide();
  }
  /** The M31R channel itself is the controller's to dispose. */
  dispose(): void {
    this.changed.dispose();
  }
}

function errorText(e: unknown): string {
  if (e instanceof Error) return e.message;
  return String(e);
}

export class M31rController implements vscode.Disposable {
  private client: LanguageClient | undefined;
  private clientState: ClientState = 'stopped';
  private serverStatus: StatusParams | undefined;
  private error: string | undefined;
  /** The settings as they are now (kept current by onConfigurationChanged). */
  private snapshot: Snapshot;
  /** The settings the current client was started with: a change of its command line or selector restarts it. */
  private startedWith: Snapshot | undefined;
  private generation = 0;
  private lastWarnings = '';
  private disposed = false;
  /** The queue of starts and stops: one at a time, in order. */
  private pending: Promise<void> = Promise.resolve();
  /** A (re)start queued that has not read the settings yet: further starts and restarts join it (it will read their
   * settings); a stop cancels it. */
  private queuedStart: QueuedStart | undefined;
  /** Stops waiting for the client's start in flight (the queue moves on; the stop after it deals with the client). */
  private interruptStart: (() => void) | undefined;
  private closing: Promise<void> | undefined;
  private readonly statusItem: vscode.StatusBarItem;
  private readonly output: vscode.LogOutputChannel;
  private readonly traceChannel: TraceChannel;
  private readonly disposables: vscode.Disposable[] = [];

  constructor() {
    this.snapshot = readSnapshot();
    this.output = vscode.window.createOutputChannel('M31R', { log: true });
    this.statusItem = vscode.window.createStatusBarItem('m31r.status', vscode.StatusBarAlignment.Right, 100);
    this.statusItem.name = 'M31R';
    this.traceChannel = new TraceChannel(this.output, this.snapshot.client.traceServer !== 'off');
    // The output channel and the status item are not in `disposables`: they outlive them until the server has stopped
    // (see shutdown()).
    this.disposables.push(
      vscode.commands.registerCommand(COMMANDS.restart, () => this.restart()),
      vscode.commands.registerCommand(COMMANDS.toggle, () => this.toggle()),
      vscode.commands.registerCommand(COMMANDS.showOutput, () => this.output.show(true)),
      vscode.workspace.onDidChangeConfiguration((e) => this.onConfigurationChanged(e)),
    );
    this.render();
  }

  /** The running client, if any (exposed for tests and other extensions). */
  get languageClient(): LanguageClient | undefined {
    return this.client;
  }

  get state(): { client: ClientState; server: StatusParams | undefined; enabled: boolean } {
    return { client: this.clientState, server: this.serverStatus, enabled: this.snapshot.server.enable };
  }

  /** Resolves once the last start/stop/restart has finished. */
  whenIdle(): Promise<void> {
    return this.pending;
  }

  /** Starts the server unless it is running or starting already. */
  start(): Promise<void> {
    return this.queueStart(false);
  }

  /** Stops the server; a server still starting is given TIMINGS.startGraceMs to finish, then stopped anyway. */
  stop(): Promise<void> {
    if (this.queuedStart) this.queuedStart.cancelled = true;
    this.queuedStart = undefined;
    this.interruptStart?.();
    return this.enqueue(() => this.doStop());
  }

  /** Stops the server (see stop()) and starts a new one with the settings as they are then. Restarts asked for before
   * the queued one has read the settings join it: two quick settings changes restart the server once. */
  restart(): Promise<void> {
    return this.queueStart(true);
  }

  async toggle(): Promise<void> {
    const cfg = vscode.workspace.getConfiguration(SECTION);
    const info = cfg.inspect<boolean>('enable');
    const target =
      info?.workspaceValue !== undefined ? vscode.ConfigurationTarget.Workspace : vscode.ConfigurationTarget.Global;
    const before = this.snapshot.server.enable;
    const next = !before;
    // Take the new value before the (asynchronous) write: a second toggle before it lands flips it back instead of
    // writing the same value again, and the status bar reacts at once. The configuration listener confirms it.
    this.snapshot = { ...this.snapshot, server: { ...this.snapshot.server, enable: next } };
    this.render();
    try {
      await cfg.update('enable', next, target);
    } catch (e) {
      if (this.snapshot.server.enable === next) {
        this.snapshot = { ...this.snapshot, server: { ...this.snapshot.server, enable: before } };
        this.render();
      }
      void vscode.window.showErrorMessage(`M31R: could not ${next ? 'enable' : 'disable'} completions: ${errorText(e)}`);
      return;
    }
    vscode.window.setStatusBarMessage(`M31R completions ${next ? 'enabled' : 'disabled'}`, 2000);
  }

  /**
   * Stops the server, then lets go of the output channel and the status item. VS Code runs `deactivate()` and, without
   * waiting for it, disposes `context.subscriptions` (extHostExtensionService `_deactivate`); the client keeps writing
   * to its output channel until the server process has exited ("Server process exited successfully", a stop that
   * timed out), and a disposed LogOutputChannel throws "Channel has been closed" on every write (extHostOutput.ts), so
   * the channel must not go before the server has. Both `deactivate()` and `dispose()` come here; the stop runs once.
   */
  shutdown(): Promise<void> {
    if (!this.closing) {
      for (const d of this.disposables.splice(0)) d.dispose();
      this.closing = this.stop()
        .catch(() => undefined)
        .finally(() => {
          this.disposed = true;
          this.traceChannel.dispose();
          this.statusItem.dispose();
          this.output.dispose();
        });
    }
    return this.closing;
  }

  dispose(): void {
    void this.shutdown();
  }

  // ---------------------------------------------------------------------------

  private enqueue(op: () => Promise<void>): Promise<void> {
    const run = this.pending.then(op, op);
    this.pending = run.catch(() => undefined);
    return run;
  }

  private queueStart(restart: boolean): Promise<void> {
    if (this.closing) return this.closing;
    // A restart need not wait for the start in flight: the stop below waits for it (a little) itself.
    if (restart) this.interruptStart?.();
    const queued = this.queuedStart;
    if (queued) {
      queued.restart ||= restart;
      return queued.run;
    }
    const ticket: QueuedStart = { run: Promise.resolve(), restart, cancelled: false };
    ticket.run = this.enqueue(async () => {
      try {
        if (ticket.cancelled || this.closing) return;
        const alive = this.client !== undefined && (this.clientState === 'running' || this.clientState === 'starting');
        if (alive && !ticket.restart) return;
        await this.doStop();
      } finally {
        // From here on the settings are read: a change after this point needs a restart of its own.
        if (this.queuedStart === ticket) this.queuedStart = undefined;
      }
      if (ticket.cancelled || this.closing) return;
      await this.doStart();
    });
    this.queuedStart = ticket;
    return ticket.run;
  }

  private async doStart(): Promise<void> {
    const snap = (this.snapshot = this.startedWith = readSnapshot());
    this.reportWarnings(snap.warnings);
    this.traceChannel.setEnabled(snap.client.traceServer !== 'off');
    const gen = ++this.generation;
    this.serverStatus = undefined;
    this.error = undefined;
    this.clientState = 'starting';
    this.render();

    const serverOptions: ServerOptions = {
      command: snap.client.path,
      args: serverArgs(snap.server),
    };
    const settings = (): ServerSettings => readSnapshot().server;
    const enabled = (): boolean => this.snapshot.server.enable;
    // Read per request from the snapshot that onConfigurationChanged keeps current: no restart needed.
    const completionMenu = (): boolean => this.snapshot.client.completionMenu;
    let client!: LanguageClient;

    const clientOptions: LanguageClientOptions = {
      documentSelector: documentSelector(snap.client.languages),
      // Pushes `workspace/didChangeConfiguration` on every change of the "m31r"
      // section; the middleware below replaces the raw section with the
      // validated server settings (client-only keys are not sent).
      synchronize: { configurationSection: SECTION },
      initializationOptions: settings,
      outputChannel: this.output,
      // `m31r.trace.server` (the client reads it as `<id>.trace.server`) takes effect through this channel's log level.
      traceOutputChannel: this.traceChannel,
      middleware: {
        workspace: {
          didChangeConfiguration: async () => {
            await client.sendNotification('workspace/didChangeConfiguration', { settings: { [SECTION]: settings() } });
          },
          configuration: async (params, token, next) => {
            const base = await next(params, token);
            if (!Array.isArray(base)) return base;
            const current = settings();
            return params.items.map((item, i) => configurationItem(item.section, current) ?? base[i]);
          },
        },
        // Do not even ask the server while completions are switched off.
        provideInlineCompletionItems: (document, position, context, token, next) =>
          enabled() ? next(document, position, context, token) : undefined,
        // The server's `textDocument/completion` item is a fallback for editors without inline completion: in VS Code
        // it would pop the suggestion menu as one types, preselected above rust-analyzer's items, with the same text
        // the ghost text already shows. Asked for only when `m31r.completionMenu` opts in.
        provideCompletionItem: (document, position, context, token, next) =>
          enabled() && completionMenu() ? next(document, position, context, token) : undefined,
      },
    };

    client = new LanguageClient('m31r', 'M31R', serverOptions, clientOptions);
    this.client = client;
    client.onNotification(STATUS_NOTIFICATION, (params: unknown) => {
      if (gen !== this.generation) return;
      const parsed = parseStatus(params);
      if (!parsed) {
        this.output.warn(`ignoring malformed ${STATUS_NOTIFICATION}: ${JSON.stringify(params)}`);
        return;
      }
      this.serverStatus = parsed;
      this.render();
    });
    client.onDidChangeState((e) => {
      if (gen !== this.generation) return;
      if (e.newState === State.Running) this.clientState = 'running';
      else if (e.newState === State.Starting) {
        this.clientState = 'starting';
        this.error = undefined;
      } else if (e.newState === State.StartFailed) {
        // vscode-languageclient 11: the server did not start (also on the client's own restart after a crash, which
        // no `start()` of ours awaits). A rejected `start()` below replaces this text with its reason.
        this.clientState = 'failed';
        this.serverStatus = undefined;
        this.error ??= 'The server exited while starting: "M31R: Show Log" has its output.';
      } else if (this.clientState !== 'failed') {
        this.clientState = 'stopped';
        this.serverStatus = undefined;
      }
      this.render();
    });

    let interrupt!: () => void;
    const interrupted = new Promise<'interrupted'>((resolve) => (interrupt = () => resolve('interrupted')));
    this.interruptStart = interrupt;
    try {
      this.output.info(`starting ${[snap.client.path, ...serverArgs(snap.server)].join(' ')}`);
      const outcome = await Promise.race([client.start().then(() => 'started' as const), interrupted]);
      if (outcome === 'started' && gen === this.generation) this.clientState = 'running';
    } catch (e) {
      if (gen === this.generation) {
        this.clientState = 'failed';
        this.error = errorText(e);
        this.output.error(`could not start the language server: ${this.error}`);
      }
    } finally {
      if (this.interruptStart === interrupt) this.interruptStart = undefined;
    }
    this.render();
  }

  private async doStop(): Promise<void> {
    const client = this.client;
    this.client = undefined;
    this.generation++;
    this.clientState = 'stopped';
    this.serverStatus = undefined;
    if (client) {
      // vscode-languageclient stops only a running client ("Client is not running and can't be stopped"): one still
      // starting, ours or its own restart after a crash, is given a moment to finish first.
      if (!(await settled(client, TIMINGS.startGraceMs))) {
        this.output.warn(
          `the language server did not finish starting within ${TIMINGS.startGraceMs / 1000} s: stopping it anyway`,
        );
      }
      // Stopped or StartFailed: nothing to shut down, but dispose() still makes sure the process is gone.
      const running = client.state === State.Running;
      try {
        await client.dispose(TIMINGS.stopMs);
      } catch (e) {
        if (running) this.output.warn(`stopping the language server: ${errorText(e)}`);
        else this.output.debug(`stopping the language server: ${errorText(e)}`);
      }
    }
    this.render();
  }

  private onConfigurationChanged(e: vscode.ConfigurationChangeEvent): void {
    if (!e.affectsConfiguration(SECTION)) return;
    const next = readSnapshot();
    // The rest applies at once, also while a restart is under way (the status bar, the toggle, the middleware).
    this.snapshot = next;
    this.traceChannel.setEnabled(next.client.traceServer !== 'off');
    this.reportWarnings(next.warnings);
    this.render();
    // Compared with what the server was started with (not with the last event's settings): a restart queued already
    // picks up this change too, and one that has read the settings already is followed by one more.
    if (!this.startedWith || needsRestart(this.startedWith, next)) {
      if (!this.queuedStart) {
        this.output.info('m31r.path, m31r.socket or m31r.languages changed: restarting the language server');
      }
      void this.restart();
    }
  }

  private reportWarnings(warnings: string[]): void {
    const key = warnings.join('\n');
    if (key === this.lastWarnings) return;
    this.lastWarnings = key;
    if (warnings.length === 0) return;
    for (const w of warnings) this.output.warn(w);
    void vscode.window.showWarningMessage(`M31R settings: ${warnings.join('; ')}`);
  }

  private render(): void {
    if (this.disposed) return;
    const view = statusView({
      client: this.clientState,
      enabled: this.snapshot.server.enable,
      server: this.serverStatus,
      error: this.error,
    });
    const item = this.statusItem;
    item.text = view.text;
    item.tooltip = view.tooltip;
    item.backgroundColor =
      view.severity === 'error'
        ? new vscode.ThemeColor('statusBarItem.errorBackground')
        : view.severity === 'warning'
          ? new vscode.ThemeColor('statusBarItem.warningBackground')
          : undefined;
    item.command = this.clientState === 'failed' || this.clientState === 'stopped' ? COMMANDS.restart : COMMANDS.toggle;
    item.show();
  }
}

let controller: M31rController | undefined;

export function activate(context: vscode.ExtensionContext): M31rController {
  controller = new M31rController();
  context.subscriptions.push(controller);
  void controller.start();
  return controller;
}

export async function deactivate(): Promise<void> {
  const c = controller;
  controller = undefined;
  if (c) await c.shutdown();
}
