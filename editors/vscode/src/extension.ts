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

function readSnapshot(): Snapshot {
  const cfg = vscode.workspace.getConfiguration(SECTION);
  const home = os.homedir();
  const server = toServerSettings(cfg, home);
  const client = toClientSettings(cfg, home);
  return { client: client.value, server: server.value, warnings: [...client.warnings, ...server.warnings] };
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
  private snapshot: Snapshot;
  private generation = 0;
  private lastWarnings = '';
  private disposed = false;
  private pending: Promise<void> = Promise.resolve();
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

  start(): Promise<void> {
    return this.enqueue(() => this.doStart());
  }

  stop(): Promise<void> {
    return this.enqueue(() => this.doStop());
  }

  restart(): Promise<void> {
    return this.enqueue(async () => {
      await this.doStop();
      await this.doStart();
    });
  }

  async toggle(): Promise<void> {
    const cfg = vscode.workspace.getConfiguration(SECTION);
    const info = cfg.inspect<boolean>('enable');
    const target =
      info?.workspaceValue !== undefined ? vscode.ConfigurationTarget.Workspace : vscode.ConfigurationTarget.Global;
    const next = !this.snapshot.server.enable;
    await cfg.update('enable', next, target);
    // The configuration listener updates the snapshot; do it here too so the
    // status bar reacts even before VS Code fires the change event.
    this.snapshot = { ...this.snapshot, server: { ...this.snapshot.server, enable: next } };
    this.render();
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

  private async doStart(): Promise<void> {
    const snap = (this.snapshot = readSnapshot());
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

    try {
      this.output.info(`starting ${[snap.client.path, ...serverArgs(snap.server)].join(' ')}`);
      await client.start();
      if (gen === this.generation) this.clientState = 'running';
    } catch (e) {
      if (gen === this.generation) {
        this.clientState = 'failed';
        this.error = errorText(e);
        this.output.error(`could not start the language server: ${this.error}`);
      }
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
      try {
        await client.dispose(2000);
      } catch (e) {
        this.output.warn(`stopping the language server: ${errorText(e)}`);
      }
    }
    this.render();
  }

  private onConfigurationChanged(e: vscode.ConfigurationChangeEvent): void {
    if (!e.affectsConfiguration(SECTION)) return;
    const next = readSnapshot();
    if (needsRestart(this.snapshot, next)) {
      this.output.info('m31r.path, m31r.socket or m31r.languages changed: restarting the language server');
      void this.restart();
      return;
    }
    this.snapshot = next;
    this.traceChannel.setEnabled(next.client.traceServer !== 'off');
    this.reportWarnings(next.warnings);
    this.render();
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
