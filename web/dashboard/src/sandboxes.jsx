// The sandboxes pages: the list (state, worker, generation, actions) and
// one sandbox (its executions, metrics charts, logs, actions).
import { useEffect, useMemo, useRef, useState } from 'preact/hooks';
import { sandboxes } from './api.js';
import { usePoll, ago, bytes } from './hooks.js';
import { Chart } from './chart.jsx';

const listEvery = 3000;
const metricsEvery = 5000;
const metricsWindow = 3600; // seconds of history asked for and kept

// current: the execution a sandbox runs as now (the newest one).
function current(execs) {
  if (!Array.isArray(execs) || !execs.length) return null;
  return execs.reduce((a, b) => ((b.route?.generation ?? 0) >= (a.route?.generation ?? 0) ? b : a));
}

export function SandboxList({ cred, onAuthError }) {
  const [state, reload] = usePoll(
    async () => {
      const list = (await sandboxes.list(cred)) || [];
      // Worker and generation are SPACE's: its executions API per sandbox.
      const execs = await Promise.all(
        list.map((s) => sandboxes.executions(cred, s.sandboxID).then(current, () => null)),
      );
      return list
        .map((s, i) => ({ ...s, exec: execs[i] }))
        .sort((a, b) => String(b.startedAt).localeCompare(String(a.startedAt)));
    },
    [cred],
    listEvery,
  );
  useEffect(() => onAuthError(state.error), [state.error]);
  const rows = state.data || [];
  return (
    <section>
      <h2>
        Sandboxes <span class="count">{state.loaded ? rows.length : ''}</span>
      </h2>
      <ErrorLine error={state.error} />
      {!state.loaded ? (
        <p class="muted">Loading…</p>
      ) : rows.length === 0 ? (
        <p class="muted" data-testid="no-sandboxes">No running or paused sandboxes.</p>
      ) : (
        <table class="grid" data-testid="sandbox-list">
          <thead>
            <tr>
              <th>Sandbox</th>
              <th>Template</th>
              <th>State</th>
              <th>Worker</th>
              <th>Gen.</th>
              <th>CPU / Mem</th>
              <th>Started</th>
              <th>Ends</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {rows.map((s) => (
              <tr key={s.sandboxID} data-sandbox-id={s.sandboxID} data-state={s.state}>
                <td>
                  <a href={'#/sandboxes/' + s.sandboxID} class="mono">
                    {s.sandboxID}
                  </a>
                </td>
                <td>{s.alias || s.templateID}</td>
                <td>
                  <State state={s.state} />
                </td>
                <td class="mono">{s.exec?.route?.worker || '—'}</td>
                <td class="mono">{s.exec?.route?.generation ?? '—'}</td>
                <td>
                  {s.cpuCount} vCPU / {s.memoryMB} MiB
                </td>
                <td title={s.startedAt}>{ago(s.startedAt)}</td>
                <td title={s.endAt}>{ago(s.endAt)}</td>
                <td class="actions">
                  <Actions cred={cred} sandbox={s} onDone={reload} compact />
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}

export function State({ state }) {
  return (
    <span class={'state state-' + state} data-testid="state">
      {state}
    </span>
  );
}

export function ErrorLine({ error }) {
  if (!error) return null;
  return (
    <p class="error" role="alert" data-testid="error">
      {error.status ? `HTTP ${error.status}: ` : ''}
      {error.message}
    </p>
  );
}

// Actions: pause or resume (by state) and kill, which asks once more in
// place (no window.confirm: a blocking dialog).
export function Actions({ cred, sandbox, onDone, onKilled, compact }) {
  const [busy, setBusy] = useState('');
  const [error, setError] = useState(null);
  const [arm, setArm] = useState(false);
  const id = sandbox.sandboxID;
  const run = (name, fn) => async () => {
    setBusy(name);
    setError(null);
    try {
      await fn(cred, id);
      if (name === 'kill' && onKilled) return onKilled();
    } catch (e) {
      setError(e);
    }
    setBusy('');
    setArm(false);
    onDone && onDone();
  };
  const st = sandbox.state;
  return (
    <span class="btns">
      {st === 'running' && (
        <button data-action="pause" disabled={!!busy} onClick={run('pause', sandboxes.pause)}>
          {busy === 'pause' ? 'Pausing…' : 'Pause'}
        </button>
      )}
      {st === 'paused' && (
        <button data-action="resume" disabled={!!busy} onClick={run('resume', sandboxes.resume)}>
          {busy === 'resume' ? 'Resuming…' : 'Resume'}
        </button>
      )}
      {arm ? (
        <button class="danger" data-action="kill-confirm" disabled={!!busy} onClick={run('kill', sandboxes.kill)}>
          {busy === 'kill' ? 'Killing…' : 'Really kill?'}
        </button>
      ) : (
        <button class="danger" data-action="kill" disabled={!!busy} onClick={() => setArm(true)}>
          Kill
        </button>
      )}
      {error && (
        <span class="error" role="alert" data-testid="action-error">
          {compact ? '' : 'Failed: '}
          {error.message}
        </span>
      )}
    </span>
  );
}

export function SandboxDetail({ cred, id, onAuthError }) {
  const [info, reload] = usePoll(
    async () => {
      const [detail, execs] = await Promise.all([
        sandboxes.get(cred, id),
        sandboxes.executions(cred, id).catch(() => null),
      ]);
      return { detail, execs };
    },
    [cred, id],
    listEvery,
  );
  useEffect(() => onAuthError(info.error), [info.error]);
  const d = info.data?.detail;
  const execs = info.data?.execs;
  const now = current(execs);
  return (
    <section>
      <p>
        <a href="#/sandboxes">← Sandboxes</a>
      </p>
      <h2 class="mono" data-testid="detail-id">
        {id}
      </h2>
      <ErrorLine error={info.error} />
      {d && (
        <div class="detail" data-testid="detail" data-state={d.state}>
          <dl>
            <dt>State</dt>
            <dd>
              <State state={d.state} />
            </dd>
            <dt>Template</dt>
            <dd>{d.alias || d.templateID}</dd>
            <dt>Worker</dt>
            <dd class="mono">{now?.route?.worker || '—'}</dd>
            <dt>Generation</dt>
            <dd class="mono">{now?.route?.generation ?? '—'}</dd>
            <dt>Substrate</dt>
            <dd>{now?.route?.substrate || '—'}</dd>
            <dt>Resources</dt>
            <dd>
              {d.cpuCount} vCPU, {d.memoryMB} MiB, {d.diskSizeMB} MiB disk
            </dd>
            <dt>Started</dt>
            <dd title={d.startedAt}>{ago(d.startedAt)}</dd>
            <dt>Ends</dt>
            <dd title={d.endAt}>{ago(d.endAt)}</dd>
          </dl>
          <Actions cred={cred} sandbox={d} onDone={reload} onKilled={() => (location.hash = '#/sandboxes')} />
        </div>
      )}
      <Metrics cred={cred} id={id} />
      {Array.isArray(execs) && <Executions execs={execs} />}
      <Logs cred={cred} id={id} />
    </section>
  );
}

// Metrics polls the metrics API and keeps every sample it has seen (by
// timestamp) for metricsWindow: a control plane that answers one sample
// still draws a series over time, one that keeps a series fills it at once.
function Metrics({ cred, id }) {
  const seen = useRef(new Map());
  const [m] = usePoll(
    async () => {
      const end = Math.floor(Date.now() / 1000);
      const got = (await sandboxes.metrics(cred, id, end - metricsWindow, end)) || [];
      for (const s of got) seen.current.set(s.timestampUnix || Math.floor(Date.parse(s.timestamp) / 1000), s);
      for (const t of seen.current.keys()) if (t < end - metricsWindow) seen.current.delete(t);
      return [...seen.current.entries()].sort((a, b) => a[0] - b[0]);
    },
    [cred, id],
    metricsEvery,
  );
  const series = useMemo(() => {
    const rows = m.data || [];
    return {
      t: rows.map((r) => r[0]),
      cpu: rows.map((r) => r[1].cpuUsedPct),
      mem: rows.map((r) => r[1].memUsed / 1048576),
      disk: rows.map((r) => r[1].diskUsed / 1048576),
      last: rows.length ? rows[rows.length - 1][1] : null,
    };
  }, [m.data]);
  return (
    <div>
      <h3>Metrics</h3>
      {m.error && <p class="muted">Metrics unavailable: {m.error.message}</p>}
      <div class="charts">
        <Chart title="CPU" unit="%" times={series.t} values={series.cpu} color="#2f6fde" testid="chart-cpu" />
        <Chart title="Memory" unit="MiB" times={series.t} values={series.mem} color="#1b9e5a" testid="chart-mem" />
        <Chart title="Disk" unit="MiB" times={series.t} values={series.disk} color="#b7791f" testid="chart-disk" />
      </div>
      {series.last && (
        <p class="muted">
          {series.last.cpuCount} vCPU · memory {bytes(series.last.memUsed)} of {bytes(series.last.memTotal)} · disk{' '}
          {bytes(series.last.diskUsed)} of {bytes(series.last.diskTotal)}
        </p>
      )}
    </div>
  );
}

function Executions({ execs }) {
  const rows = [...execs].sort((a, b) => (b.route?.generation ?? 0) - (a.route?.generation ?? 0));
  return (
    <div>
      <h3>Executions</h3>
      <table class="grid" data-testid="executions">
        <thead>
          <tr>
            <th>Gen.</th>
            <th>Worker</th>
            <th>Substrate</th>
            <th>Execution</th>
            <th>State</th>
            <th>Started</th>
            <th>Ended</th>
          </tr>
        </thead>
        <tbody>
          {rows.map((e) => (
            <tr key={e.route?.execution}>
              <td class="mono">{e.route?.generation}</td>
              <td class="mono">{e.route?.worker}</td>
              <td>{e.route?.substrate}</td>
              <td class="mono">{e.route?.execution}</td>
              <td>
                <State state={e.state} />
              </td>
              <td title={e.started_at}>{ago(e.started_at)}</td>
              <td title={e.ended_at || ''}>{e.ended_at ? ago(e.ended_at) : '—'}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}

function Logs({ cred, id }) {
  const [l] = usePoll(() => sandboxes.logs(cred, id), [cred, id], metricsEvery);
  let body;
  if (l.error && l.error.noRoute) {
    body = (
      <p class="muted" data-testid="no-logs-api">
        No logs API on this control plane.
      </p>
    );
  } else if (l.error) {
    body = <ErrorLine error={l.error} />;
  } else if (!l.loaded) {
    body = <p class="muted">Loading…</p>;
  } else {
    const logs = [...(l.data?.logs || [])].sort((a, b) => String(a.timestamp).localeCompare(String(b.timestamp)));
    body = logs.length ? (
      <pre class="logs" data-testid="logs">
        {logs.map((e, i) => (
          <div key={i} class={'log log-' + e.level}>
            <span class="ts">{new Date(e.timestamp).toLocaleTimeString()}</span>{' '}
            <span class="lvl">{e.level}</span> <span class="src">{e.fields?.source || ''}</span> {e.message}
          </div>
        ))}
      </pre>
    ) : (
      <p class="muted" data-testid="logs-empty">
        No log lines yet.
      </p>
    );
  }
  return (
    <div>
      <h3>Logs</h3>
      {body}
    </div>
  );
}
