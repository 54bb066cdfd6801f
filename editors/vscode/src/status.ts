// Pure status-bar logic: no `vscode` import, unit-tested with plain Node.

/** Method of the server's custom status notification. */
export const STATUS_NOTIFICATION = 'm31r/status';

export type ServerState = 'ready' | 'starting' | 'unavailable';

/** Params of `m31r/status`. */
export interface StatusParams {
  state: ServerState;
  model: string | null;
  lastLatencyMs: number | null;
}

/** State of the language client process itself (not the daemon behind it). */
export type ClientState = 'starting' | 'running' | 'stopped' | 'failed';

export type Severity = 'normal' | 'warning' | 'error';

export interface StatusView {
  /** Status bar text, with `$(icon)` codicons. */
  text: string;
  tooltip: string;
  severity: Severity;
}

const STATES: readonly ServerState[] = ['ready', 'starting', 'unavailable'];

/** Validate a `m31r/status` payload; returns undefined for anything malformed. */
export function parseStatus(params: unknown): StatusParams | undefined {
  if (!params || typeof params !== 'object' || Array.isArray(params)) return undefined;
  const p = params as Record<string, unknown>;
  if (typeof p.state !== 'string' || !STATES.includes(p.state as ServerState)) return undefined;
  const model = typeof p.model === 'string' && p.model !== '' ? p.model : null;
  const latency =
    typeof p.lastLatencyMs === 'number' && Number.isFinite(p.lastLatencyMs) && p.lastLatencyMs >= 0
      ? p.lastLatencyMs
      : null;
  return { state: p.state as ServerState, model, lastLatencyMs: latency };
}

/** The unit is chosen by the value as shown, after rounding: 9.96 is "10 ms" (not "10.0 ms"), 9999.6 "10.0 s" (not
 * "10000 ms"). */
export function formatLatency(ms: number): string {
  const tenths = ms.toFixed(1);
  if (Number(tenths) < 10) return `${tenths} ms`;
  const whole = Math.round(ms);
  if (whole < 10000) return `${whole} ms`;
  return `${(ms / 1000).toFixed(1)} s`;
}

export interface StatusInput {
  client: ClientState;
  /** `m31r.enable`. */
  enabled: boolean;
  /** Last valid `m31r/status` from the server, if any since the client started. */
  server?: StatusParams;
  /** Why the client failed, shown in the tooltip. */
  error?: string;
}

const CLICK_HINT = 'Click to toggle M31R completions.';

/** Map the client state, the enable setting and the last status notification to the status bar. */
export function statusView(input: StatusInput): StatusView {
  if (input.client === 'failed') {
    const why = input.error ? `\n${input.error}` : '';
    return {
      text: '$(error) M31R',
      tooltip: `M31R: the language server could not be started.${why}\nCheck the m31r.path setting, then run "M31R: Restart Language Server".`,
      severity: 'error',
    };
  }
  if (input.client === 'stopped') {
    return {
      text: '$(circle-slash) M31R stopped',
      tooltip: 'M31R: the language server is not running. Run "M31R: Restart Language Server".',
      severity: 'warning',
    };
  }
  if (!input.enabled) {
    return {
      text: '$(circle-slash) M31R',
      tooltip: 'M31R completions are disabled. Click to enable.',
      severity: 'normal',
    };
  }
  if (input.client === 'starting') {
    return { text: '$(sync~spin) M31R', tooltip: `M31R: starting the language server…\n${CLICK_HINT}`, severity: 'normal' };
  }

  const s = input.server;
  if (!s) {
    return { text: '$(sparkle) M31R', tooltip: `M31R: language server running.\n${CLICK_HINT}`, severity: 'normal' };
  }
  const model = s.model ? `Model: ${s.model}` : undefined;
  switch (s.state) {
    case 'ready': {
      const latency = s.lastLatencyMs !== null ? `Last completion: ${formatLatency(s.lastLatencyMs)}` : undefined;
      return {
        text: '$(sparkle) M31R',
        tooltip: ['M31R: ready', model, latency, CLICK_HINT].filter(Boolean).join('\n'),
        severity: 'normal',
      };
    }
    case 'starting':
      return {
        text: '$(sync~spin) M31R',
        tooltip: ['M31R: the daemon is starting (loading the model)…', model, CLICK_HINT].filter(Boolean).join('\n'),
        severity: 'normal',
      };
    case 'unavailable':
      return {
        text: '$(warning) M31R unavailable',
        tooltip: [
          'M31R: the m31rd daemon is not reachable. Is it running? Check the m31r.socket setting.',
          model,
          CLICK_HINT,
        ]
          .filter(Boolean)
          .join('\n'),
        severity: 'warning',
      };
  }
}
