// Pure settings logic: no `vscode` import, so it is unit-tested with plain Node.
//
// The language server (`m31r lsp`) reads exactly these camelCase keys, both from
// `initializationOptions` (a flat object) and from
// `workspace/didChangeConfiguration` (`settings.m31r`). Client-only keys
// (`path`, `languages`, `completionMenu`, `trace.server`) are never sent to the server.

export type DebounceMode = 'adaptive' | 'fixed';
export type Multiline = 'auto' | 'always' | 'never';

export interface ServerSettings {
  enable: boolean;
  debounceMs: number;
  debounceMode: DebounceMode;
  multiline: Multiline;
  deadlineMs: number;
  maxTokens: number;
  /** Beam search width of a single-line suggestion; null means the daemon's `--beams`. */
  beams: number | null;
  /** Send snippets of the crate's other files with each request. */
  projectContext: boolean;
  /** Show a suggestion only where the model gave its first line at least this probability (0..1); 0 shows all. */
  minProbability: number;
  /** Daemon socket path; "" means the daemon's default socket. */
  socket: string;
}

export interface IntRange {
  minimum: number;
  maximum: number;
}

export const DEFAULTS: Readonly<ServerSettings> = Object.freeze({
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

/** Accepted ranges; package.json's `minimum`/`maximum` mirror these (a test checks it). */
export const RANGES: Readonly<Record<'debounceMs' | 'deadlineMs' | 'maxTokens', IntRange>> = Object.freeze({
  debounceMs: { minimum: 0, maximum: 5000 },
  deadlineMs: { minimum: 1, maximum: 60000 },
  maxTokens: { minimum: 1, maximum: 4096 },
});

/** `beams`' accepted widths (null is accepted too); package.json's `minimum`/`maximum` mirror them (a test checks it). */
export const BEAMS_RANGE: Readonly<IntRange> = Object.freeze({ minimum: 1, maximum: 8 });

export const DEBOUNCE_MODES: readonly DebounceMode[] = ['adaptive', 'fixed'];
/** `m31r.trace.server`'s values (vscode-languageclient's own `<id>.trace.server`); package.json's enum mirrors them. */
export type TraceServer = 'off' | 'messages' | 'verbose';
export const TRACE_LEVELS: readonly TraceServer[] = ['off', 'messages', 'verbose'];
export const MULTILINE_MODES: readonly Multiline[] = ['auto', 'always', 'never'];

/** Client-side settings (not sent to the server). */
export interface ClientSettings {
  /** Executable to run as `<path> lsp [--socket S]`. */
  path: string;
  /** VS Code language ids to attach to; `["*"]` means every language. */
  languages: string[];
  /** Also ask the server for `textDocument/completion` items (the suggestion menu); off: inline ghost text only.
   * Read by the completion middleware on each request, so a change applies without a restart. */
  completionMenu: boolean;
  /** `m31r.trace.server`: log the LSP traffic in the M31R output channel. vscode-languageclient reads the level itself;
   * the extension needs to know whether it is on (see TraceChannel in extension.ts). */
  traceServer: TraceServer;
}

/** Rust only by default: the model was trained on Rust, and elsewhere its suggestions are noise. package.json's
 * `activationEvents` (`onLanguage:rust`) and `m31r.languages` default mirror this (a test checks it). */
export const CLIENT_DEFAULTS: Readonly<ClientSettings> = Object.freeze({
  path: 'm31r',
  languages: ['rust'],
  completionMenu: false,
  traceServer: 'off',
});

/** The subset of `vscode.WorkspaceConfiguration` this module needs. */
export interface ConfigLike {
  get<T>(key: string): T | undefined;
}

/** Either a `vscode.WorkspaceConfiguration` for section "m31r" or a plain object. */
export type ConfigSource = ConfigLike | Record<string, unknown> | null | undefined;

export interface Validated<T> {
  value: T;
  /** Human-readable problems; invalid values were replaced by defaults. */
  warnings: string[];
}

function reader(source: ConfigSource): (key: string) => unknown {
  if (source && typeof (source as ConfigLike).get === 'function') {
    const cfg = source as ConfigLike;
    return (key) => cfg.get<unknown>(key);
  }
  const obj = (source ?? {}) as Record<string, unknown>;
  return (key) => (Object.prototype.hasOwnProperty.call(obj, key) ? obj[key] : undefined);
}

function readBool(get: (k: string) => unknown, key: string, fallback: boolean, warnings: string[]): boolean {
  const raw = get(key);
  if (raw === undefined || raw === null) return fallback;
  if (typeof raw === 'boolean') return raw;
  if (raw === 'true' || raw === 'false') return raw === 'true';
  warnings.push(`m31r.${key}: expected true or false, got ${JSON.stringify(raw)}; using ${fallback}`);
  return fallback;
}

const DECIMAL = /^[+-]?(\d+(\.\d*)?|\.\d+)(e[+-]?\d+)?$/i;

/**
 * A number setting's raw value: a number or a decimal string as a number; undefined where it is unset (undefined, null,
 * an empty or blank string); NaN for anything else (booleans, objects, "soon", "0x10"). A blank string is unset like
 * an empty one: `Number("  ")` would read it as 0.
 */
function numeric(raw: unknown): number | undefined {
  if (raw === undefined || raw === null) return undefined;
  if (typeof raw === 'number') return raw;
  if (typeof raw !== 'string') return Number.NaN;
  const text = raw.trim();
  if (text === '') return undefined;
  return DECIMAL.test(text) ? Number(text) : Number.NaN;
}

function readInt(
  get: (k: string) => unknown,
  key: 'debounceMs' | 'deadlineMs' | 'maxTokens',
  warnings: string[],
): number {
  const raw = get(key);
  const fallback = DEFAULTS[key];
  const n = numeric(raw);
  if (n === undefined) return fallback;
  if (!Number.isFinite(n)) {
    warnings.push(`m31r.${key}: expected an integer, got ${JSON.stringify(raw)}; using ${fallback}`);
    return fallback;
  }
  const { minimum, maximum } = RANGES[key];
  const rounded = Math.round(n);
  const clamped = Math.min(maximum, Math.max(minimum, rounded));
  if (clamped !== rounded) {
    warnings.push(`m31r.${key}: ${n} is outside ${minimum}..${maximum}; using ${clamped}`);
  }
  return clamped;
}

function readBeams(get: (k: string) => unknown, warnings: string[]): number | null {
  const raw = get('beams');
  const n = numeric(raw);
  if (n === undefined) return null;
  if (!Number.isFinite(n)) {
    warnings.push(`m31r.beams: expected an integer or null, got ${JSON.stringify(raw)}; using the daemon's default`);
    return null;
  }
  const { minimum, maximum } = BEAMS_RANGE;
  const rounded = Math.round(n);
  const clamped = Math.min(maximum, Math.max(minimum, rounded));
  if (clamped !== rounded) warnings.push(`m31r.beams: ${n} is outside ${minimum}..${maximum}; using ${clamped}`);
  return clamped;
}

function readProbability(get: (k: string) => unknown, warnings: string[]): number {
  const raw = get('minProbability');
  const fallback = DEFAULTS.minProbability;
  const n = numeric(raw);
  if (n === undefined) return fallback;
  if (!Number.isFinite(n)) {
    warnings.push(`m31r.minProbability: expected a number in 0..1, got ${JSON.stringify(raw)}; using ${fallback}`);
    return fallback;
  }
  const clamped = Math.min(1, Math.max(0, n));
  if (clamped !== n) warnings.push(`m31r.minProbability: ${n} is outside 0..1; using ${clamped}`);
  return clamped;
}

function readEnum<T extends string>(
  get: (k: string) => unknown,
  key: 'debounceMode' | 'multiline',
  allowed: readonly T[],
  warnings: string[],
): T {
  const raw = get(key);
  const fallback = DEFAULTS[key] as T;
  if (raw === undefined || raw === null || raw === '') return fallback;
  if (typeof raw === 'string') {
    const lowered = raw.trim().toLowerCase();
    const hit = allowed.find((a) => a === lowered);
    if (hit) return hit;
  }
  warnings.push(`m31r.${key}: expected one of ${allowed.join(', ')}, got ${JSON.stringify(raw)}; using ${fallback}`);
  return fallback;
}

function readString(get: (k: string) => unknown, key: string, fallback: string, warnings: string[]): string {
  const raw = get(key);
  if (raw === undefined || raw === null) return fallback;
  if (typeof raw === 'string') return raw.trim();
  warnings.push(`m31r.${key}: expected a string, got ${JSON.stringify(raw)}; using ${JSON.stringify(fallback)}`);
  return fallback;
}

/**
 * Turn a configuration (VS Code's `m31r` section or a plain object) into the
 * exact object the server expects as `initializationOptions` and as
 * `settings.m31r`. Every key is always present, so a setting that the user
 * removes is reset on the server too.
 */
export function toServerSettings(source: ConfigSource, homeDir?: string): Validated<ServerSettings> {
  const get = reader(source);
  const warnings: string[] = [];
  const value: ServerSettings = {
    enable: readBool(get, 'enable', DEFAULTS.enable, warnings),
    debounceMs: readInt(get, 'debounceMs', warnings),
    debounceMode: readEnum(get, 'debounceMode', DEBOUNCE_MODES, warnings),
    multiline: readEnum(get, 'multiline', MULTILINE_MODES, warnings),
    deadlineMs: readInt(get, 'deadlineMs', warnings),
    maxTokens: readInt(get, 'maxTokens', warnings),
    beams: readBeams(get, warnings),
    projectContext: readBool(get, 'projectContext', DEFAULTS.projectContext, warnings),
    minProbability: readProbability(get, warnings),
    socket: expandHome(readString(get, 'socket', DEFAULTS.socket, warnings), homeDir),
  };
  return { value, warnings };
}

export function toClientSettings(source: ConfigSource, homeDir?: string): Validated<ClientSettings> {
  const get = reader(source);
  const warnings: string[] = [];
  let path = readString(get, 'path', CLIENT_DEFAULTS.path, warnings);
  if (path === '') path = CLIENT_DEFAULTS.path;
  path = expandHome(path, homeDir);

  const rawLanguages = get('languages');
  let languages: string[] = [...CLIENT_DEFAULTS.languages];
  if (Array.isArray(rawLanguages)) {
    const cleaned = rawLanguages
      .filter((l): l is string => typeof l === 'string')
      .map((l) => l.trim())
      .filter((l) => l !== '');
    if (cleaned.length !== rawLanguages.length) {
      warnings.push('m31r.languages: ignoring entries that are not non-empty strings');
    }
    languages = cleaned.length > 0 ? Array.from(new Set(cleaned)) : [...CLIENT_DEFAULTS.languages];
  } else if (typeof rawLanguages === 'string' && rawLanguages.trim() !== '') {
    languages = [rawLanguages.trim()];
  } else if (rawLanguages !== undefined && rawLanguages !== null) {
    warnings.push(`m31r.languages: expected an array of language ids, got ${JSON.stringify(rawLanguages)}`);
  }
  const completionMenu = readBool(get, 'completionMenu', CLIENT_DEFAULTS.completionMenu, warnings);
  const rawTrace = get('trace.server');
  let traceServer = CLIENT_DEFAULTS.traceServer;
  // As vscode-languageclient reads `<id>.trace.server` (refreshTrace): any case, or the object form
  // `{"verbosity": ..., "format": ...}` (verbosity "messages" if absent). Read otherwise, the client would trace while the M31R channel dropped it all.
  const level =
    typeof rawTrace === 'string'
      ? rawTrace
      : rawTrace && typeof rawTrace === 'object' && !Array.isArray(rawTrace)
        ? ((rawTrace as Record<string, unknown>).verbosity ?? 'messages')
        : undefined;
  const lowered = typeof level === 'string' ? level.trim().toLowerCase() : undefined;
  if (lowered !== undefined && (TRACE_LEVELS as readonly string[]).includes(lowered)) {
    traceServer = lowered as TraceServer;
  } else if (rawTrace !== undefined && rawTrace !== null) {
    warnings.push(`m31r.trace.server: expected one of ${TRACE_LEVELS.join(', ')}, got ${JSON.stringify(rawTrace)}; using off`);
  }
  return { value: { path, languages, completionMenu, traceServer }, warnings };
}

/** `~/x` → `<home>/x` (only when a home directory is given). */
export function expandHome(p: string, homeDir?: string): string {
  if (!homeDir) return p;
  if (p === '~') return homeDir;
  if (p.startsWith('~/')) return homeDir.replace(/\/+$/, '') + p.slice(1);
  return p;
}

/** Arguments for the server process: `lsp [--socket PATH]`. */
export function serverArgs(settings: Pick<ServerSettings, 'socket'>): string[] {
  return settings.socket ? ['lsp', '--socket', settings.socket] : ['lsp'];
}

export interface DocumentFilterLike {
  scheme: string;
  language?: string;
}

export const SCHEMES: readonly string[] = ['file', 'untitled'];

/** `["*"]` (or any list containing "*") → every language on file/untitled documents. */
export function documentSelector(languages: readonly string[]): DocumentFilterLike[] {
  if (languages.length === 0 || languages.includes('*')) {
    return SCHEMES.map((scheme) => ({ scheme }));
  }
  const out: DocumentFilterLike[] = [];
  for (const language of languages) {
    for (const scheme of SCHEMES) out.push({ scheme, language });
  }
  return out;
}

/** Keys whose change needs a new server process (command line or document selector). */
export const RESTART_KEYS: readonly string[] = ['path', 'languages', 'socket'];

/** True when the client must be recreated to apply the new configuration. */
export function needsRestart(
  before: { client: ClientSettings; server: ServerSettings },
  after: { client: ClientSettings; server: ServerSettings },
): boolean {
  return (
    before.client.path !== after.client.path ||
    before.server.socket !== after.server.socket ||
    JSON.stringify(before.client.languages) !== JSON.stringify(after.client.languages)
  );
}

/**
 * Answer one `workspace/configuration` item for the server from the validated
 * settings: section "m31r" → the whole object, "m31r.<key>" → that value.
 * Returns undefined for sections that are not ours.
 */
export function configurationItem(section: string | undefined | null, settings: ServerSettings): unknown {
  if (section === 'm31r') return { ...settings };
  if (section && section.startsWith('m31r.')) {
    const key = section.slice('m31r.'.length);
    if (Object.prototype.hasOwnProperty.call(settings, key)) return settings[key as keyof ServerSettings];
  }
  return undefined;
}
