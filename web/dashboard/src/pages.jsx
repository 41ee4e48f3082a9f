// The team's templates and API keys.
import { useEffect } from 'preact/hooks';
import { templates, apiKeys } from './api.js';
import { usePoll, ago } from './hooks.js';
import { ErrorLine } from './sandboxes.jsx';

export function Templates({ cred, onAuthError }) {
  const [t] = usePoll(() => templates.list(cred), [cred], 10000);
  useEffect(() => onAuthError(t.error), [t.error]);
  const rows = t.data || [];
  return (
    <section>
      <h2>
        Templates <span class="count">{t.loaded ? rows.length : ''}</span>
      </h2>
      <ErrorLine error={t.error} />
      {t.loaded && !rows.length && <p class="muted">No templates.</p>}
      {rows.length > 0 && (
        <table class="grid" data-testid="templates">
          <thead>
            <tr>
              <th>Template</th>
              <th>Names</th>
              <th>Build</th>
              <th>Status</th>
              <th>CPU / Mem</th>
              <th>Spawned</th>
              <th>Updated</th>
            </tr>
          </thead>
          <tbody>
            {rows.map((x) => (
              <tr key={x.templateID}>
                <td class="mono">{x.templateID}</td>
                <td>{(x.names?.length ? x.names : x.aliases || []).join(', ') || '—'}</td>
                <td class="mono">{x.buildID || '—'}</td>
                <td>{x.buildStatus || '—'}</td>
                <td>
                  {x.cpuCount} vCPU / {x.memoryMB} MiB
                </td>
                <td>{x.spawnCount ?? 0}</td>
                <td title={x.updatedAt}>{ago(x.updatedAt)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </section>
  );
}

function masked(m) {
  if (!m) return '—';
  return (m.prefix || '') + (m.maskedValuePrefix || '') + '…' + (m.maskedValueSuffix || '');
}

export function Keys({ cred, onAuthError }) {
  const [k] = usePoll(() => apiKeys.list(cred), [cred], 10000);
  useEffect(() => onAuthError(k.error), [k.error]);
  const rows = Array.isArray(k.data) ? k.data : [];
  return (
    <section>
      <h2>
        API keys <span class="count">{k.loaded && !k.error ? rows.length : ''}</span>
      </h2>
      {k.error && k.error.noRoute ? (
        <p class="muted" data-testid="no-keys-api">
          No API keys API on this control plane.
        </p>
      ) : (
        <ErrorLine error={k.error} />
      )}
      {rows.length > 0 && (
        <table class="grid" data-testid="keys">
          <thead>
            <tr>
              <th>Name</th>
              <th>Key</th>
              <th>Created</th>
              <th>By</th>
              <th>Last used</th>
            </tr>
          </thead>
          <tbody>
            {rows.map((x) => (
              <tr key={x.id}>
                <td>{x.name}</td>
                <td class="mono">{masked(x.mask)}</td>
                <td title={x.createdAt}>{ago(x.createdAt)}</td>
                <td>{x.createdBy?.email || x.createdBy?.id || '—'}</td>
                <td title={x.lastUsed || ''}>{x.lastUsed ? ago(x.lastUsed) : 'never'}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      <p class="muted">Keys are shown masked: a key's value is readable only once, when it is created.</p>
    </section>
  );
}
